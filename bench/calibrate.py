"""Calibration of the bandwidth ceilings on this GPU: a device-to-device copy,
a read-only reduction, and torch's own bf16 -> fp8 cast (the 2:1 read/write mix of
the quantization kernels), each as GB/s of bytes read + written."""

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import bench_us, print_table  # noqa: E402


def main():
    m, k = 16384, 7168
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    q = torch.empty(m, k, device="cuda", dtype=torch.float8_e4m3fn)
    n = x.numel()
    cases = [
        ("copy bf16 (2 B read + 2 B write)", lambda: y.copy_(x), 4 * n),
        ("max (2 B read)", lambda: torch.amax(x), 2 * n),
        ("cast to fp8 (2 B read + 1 B write)", lambda: q.copy_(x), 3 * n),
    ]
    rows = []
    for name, fn, nbytes in cases:
        t = bench_us(fn)
        rows.append([name, f"{t:.1f}", f"{nbytes / t / 1e3:.0f}"])
    print_table(f"bandwidth calibration ({m} x {k})", ["kernel", "µs", "GB/s"], rows, "calibrate.md")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()
    main()
