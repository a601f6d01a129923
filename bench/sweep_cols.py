"""Launch-plan sweep of the transposing ("cols") quantization kernel: for each
shape, the time of the default plan and of each plan in --plans (cluster size,
cached rows per block; set through MOE_FP8_COLS_PLAN), as µs and % of a copy of the
same bytes. The output is the same for every plan (tests/test_gpu.py checks it);
this only shows which is fastest. Run: python bench/sweep_cols.py [--plans "4,512 2,768"] [--uniform]
"""

import argparse
import os
import sys

import torch

import moe_fp8_ext
from moe_fp8_ext.moe import balanced_offs

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import bench_us, copy_us, print_table  # noqa: E402

F8 = torch.float8_e4m3fn


def cases(uniform: bool):
    for e, k, n in [(8, 7168, 2048), (16, 5120, 1536), (64, 2048, 1408)]:
        w_t = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        yield f"experts_bwd ({e}, {k}, {n})", w_t.numel() * 3 + e * k * 4, lambda w_t=w_t: moe_fp8_ext.quantize_experts_bwd(w_t, F8)
    for m, k, n, g in [(16384, 7168, 2048, 8), (32768, 5120, 1536, 16), (65536, 2048, 1408, 64)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        go = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        offs = balanced_offs(m, g, device="cuda")  # router-like sizes, as in bench_rowwise
        groupings = [("", offs)]
        if uniform:  # every group m / g rows: what the router-like spread costs
            groupings.append((" uniform", torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * (m // g)))
        for label, o in groupings:
            yield (f"jagged dual{label} ({m}, {k}, {n}, {g})", m * (k + n) * 3 + g * (k + n) * 4,
                   lambda go=go, a=a, o=o: moe_fp8_ext.quantize_jagged_colwise_dual(go, a, o, F8))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--plans", default="8,256 4,512 4,576 4,768 2,512 2,576 2,768 1,768",
                   help='space-separated "cluster,rows" plans')
    p.add_argument("--uniform", action="store_true", help="also the jagged dual with equal groups")
    args = p.parse_args()
    plans = args.plans.split()
    rows = []
    for name, nbytes, fn in cases(args.uniform):
        cp = copy_us(nbytes)
        cells = [name]
        for plan in [None] + plans:
            if plan is None:
                os.environ.pop("MOE_FP8_COLS_PLAN", None)
            else:
                os.environ["MOE_FP8_COLS_PLAN"] = plan
            try:
                us = bench_us(fn)
                cells.append(f"{us:.0f} ({100 * cp / us:.0f}%)")
            except RuntimeError as e:  # a plan the shape cannot launch (grid limits)
                cells.append("n/a")
                print(f"  ({plan}: {str(e).splitlines()[0][:100]})")
        os.environ.pop("MOE_FP8_COLS_PLAN", None)
        rows.append(cells)
    print_table("cols kernel launch plans, µs (% of copy); columns are cluster,rows",
                ["shape", "default"] + plans, rows, "sweep_cols.md")


if __name__ == "__main__":
    main()
