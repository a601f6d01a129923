"""Per-kernel GPU time of one experts-layer step (forward + backward) on an issue-15
shape, for the bf16 module math and moe_fp8_ext.experts: torch.profiler's CUDA kernel
times summed by kernel family, the table the issue asks for when a target is missed.

  python scripts/profile_experts.py [tokens dim hidden experts] [--recipe fp8_rowwise] [--reuse]

Beside the GPU kernel time, the wall time of a step (CUDA events, median): where the
wall time is longer, the GPU waited on the host (launch overhead) between kernels.
"""

import collections
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile


sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/bench")
from bench_experts import step_parser, steps  # noqa: E402
from common import bench_us  # noqa: E402

FAMILIES = [  # (label, regex on the kernel name), first match wins
    ("fp8 grouped GEMM", r"f8f8bf16|fp8.*grouped|scaled.*grouped|cutlass.*(e4m3|f8)|GroupProblemShape.*e4m3"),
    ("bf16 grouped GEMM", r"grouped|cutlass|sm90_xmma|gemm"),
    ("swiglu (ours)", r"swiglu"),
    ("rowwise quant rows", r"quantize_rows"),
    ("colwise quant (jagged/experts)", r"quantize_cols|cols_"),
    ("quant (other)", r"quantize|tiles"),
    ("token groups / offs", r"copy_rows|padded_offsets|zero_rows|permute|invert"),
    ("elementwise (torch)", r"elementwise|vectorized|unrolled|silu|CatArrayBatched|reduce_kernel|fill"),
]


def family(name):
    for label, pat in FAMILIES:
        if re.search(pat, name, re.I):
            return label
    return "other"


def main():
    p = step_parser(__doc__)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--reuse", action="store_true", help="also the recipe with its quantized weights reused")
    a = p.parse_args()
    fns, (m, d, h, e) = steps(a)
    for name, step in fns.items():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        fam, kern = collections.Counter(), collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                fam[family(ev.name)] += ev.device_time / 5
                kern[ev.name[:90]] += ev.device_time / 5
        total = sum(fam.values())
        wall = bench_us(step) / 1000
        print(f"\n### {name}: ({m}, {d}, {h}, {e}), GPU kernel time per fwd+bwd {total / 1000:.2f} ms, wall "
              f"{wall:.2f} ms ({torch.cuda.get_device_name()})")
        print("| family | ms | share |\n|---|---|---|")
        for k, v in fam.most_common():
            print(f"| {k} | {v / 1000:.3f} | {100 * v / total:.1f}% |")
        print(f"\ntop {a.top} kernels:")
        for k, v in kern.most_common(a.top):
            print(f"  {v / 1000:7.3f} ms  {k}")


if __name__ == "__main__":
    main()
