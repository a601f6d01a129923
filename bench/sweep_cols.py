"""Launch-plan sweep of the transposing ("cols") quantization kernel: for each
shape, the time of the default plan and of each plan in --plans (cluster size,
cached rows per block; the private tuning knob cols_plan), as µs and % of a copy of the
same bytes. The output is the same for every plan (tests/test_rowwise.py checks it);
this only shows which is fastest. Run: python bench/sweep_cols.py [--plans "4,512 2,768"] [--uniform]
With --block, the same for block mode (MXFP8 colwise and expert weights, blocks of
32; blockwise act_rhs / act_transposed_lhs, blocks of 128): plans are "slices,rows"
(independent slices per segment, rows staged at a time; the knob cols_block_plan).
"""

import argparse
import sys

import torch

import moe_fp8_ext
from moe_fp8_ext import _tuning

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from workloads import balanced_offs  # noqa: E402
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


def block_cases():
    for m, k, g in [(16384, 7168, 8), (32768, 5120, 16), (65536, 2048, 64)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        offs = (balanced_offs(m, g, device="cuda") // 32 * 32).to(torch.int32)
        offs[-1] = m
        yield f"mxfp8 colwise ({m}, {k}, G={g})", m * k * 3 + m * k // 32, \
            lambda x=x, o=offs: moe_fp8_ext.quantize_mxfp8_colwise(x, "rceil", False, o)
        yield f"mxfp8 colwise blocked ({m}, {k}, G={g})", m * k * 3 + m * k // 32, \
            lambda x=x, o=offs: moe_fp8_ext.quantize_mxfp8_colwise(x, "rceil", True, o)
    for e, k, n in [(8, 7168, 2048), (16, 5120, 1536), (64, 2048, 1408)]:
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
        yield f"mxfp8 experts bwd ({e}, {n}, {k})", w.numel() * 3 + w.numel() // 32, \
            lambda w=w: moe_fp8_ext.quantize_mxfp8_experts(w, "rceil")
    for m, k in [(16384, 7168), (32768, 5120), (65536, 2048)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        yield f"blockwise act_rhs ({m}, {k})", m * k * 3 + m * k // 128 * 4, \
            lambda x=x: moe_fp8_ext.quantize_blockwise_act_rhs(x)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--plans", default="8,256 4,512 4,576 4,768 2,512 2,576 2,768 1,768",
                   help='space-separated "cluster,rows" plans')
    p.add_argument("--uniform", action="store_true", help="also the jagged dual with equal groups")
    p.add_argument("--block", action="store_true", help="block mode (MXFP8, blockwise): slices,rows plans")
    args = p.parse_args()
    knob = "cols_block_plan" if args.block else "cols_plan"
    if args.block and args.plans == p.get_default("plans"):
        args.plans = "1,512 2,384 4,256 4,384 8,256 16,384"
    plans = args.plans.split()
    rows = []
    for name, nbytes, fn in (block_cases() if args.block else cases(args.uniform)):
        cp = copy_us(nbytes)
        cells = [name]
        for plan in [None] + plans:
            try:
                with _tuning.override(**{knob: plan}):
                    us = bench_us(fn)
                cells.append(f"{us:.0f} ({100 * cp / us:.0f}%)")
            except RuntimeError as e:  # a plan the shape cannot launch (grid limits)
                cells.append("n/a")
                print(f"  ({plan}: {str(e).splitlines()[0][:100]})")
        rows.append(cells)
    title = "slices,rows" if args.block else "cluster,rows"
    print_table(f"cols kernel launch plans, µs (% of copy); columns are {title}",
                ["shape", "default"] + plans, rows, "sweep_cols_block.md" if args.block else "sweep_cols.md")


if __name__ == "__main__":
    main()
