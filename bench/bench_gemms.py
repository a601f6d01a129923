"""The three GEMMs of one grouped linear step on their own: PyTorch's FP8 grouped GEMM
on operands already quantized by this package (as grouped_mm calls it) against the
bf16 grouped GEMM of the same product, in ms and TFLOP/s. This is the part of the
step that this package does not write; it bounds what grouped_mm can gain.

  fwd     out    = A (M, K) @ B_t (E, K, N)              2-D x 3-D
  dgrad   grad_A = grad_out (M, N) @ W (E, N, K)         2-D x 3-D
  wgrad   grad_W = grad_out^T (N, M) @ A (M, K)          2-D x 2-D, per group -> (E, N, K)
  wgrad^T grad_B_t = A^T (K, M) @ grad_out (M, N)        the same product, other orientation

Run: python bench/bench_gemms.py [--quick]
"""

import argparse
import sys

import torch

import moe_fp8_ext
from moe_fp8_ext.recipes import get_recipe, scaled_grouped_mm_rowwise


sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import GROUPED_MM_SHAPES, bench_us, linear_problem, print_table, sqnr  # noqa: E402

F8 = torch.float8_e4m3fn


def gemms(m, k, n, e):
    """{name: (bf16 fn, fp8 fn)} for one shape; the fp8 operands are made once."""
    a, w, offs, g = linear_problem(m, k, n, e)
    a, w = a.detach(), w.detach()
    b_t = w.transpose(1, 2)
    qa, sa = moe_fp8_ext.quantize_rowwise(a, F8)
    qb, sb = moe_fp8_ext.quantize_experts_fwd(b_t, F8)
    qg, sg = moe_fp8_ext.quantize_rowwise(g, F8)
    qw, sw = moe_fp8_ext.quantize_experts_bwd(b_t, F8)
    starts, poffs = moe_fp8_ext.padded_group_offsets(offs, m, get_recipe("fp8_rowwise").alignment)
    qgc, sgc, qac, sac = moe_fp8_ext.quantize_jagged_colwise_dual(g, a, offs, F8, padded_starts=starts, alignment=get_recipe("fp8_rowwise").alignment)
    mm = scaled_grouped_mm_rowwise
    bf = torch.bfloat16
    return {
        "fwd": (lambda: torch._grouped_mm(a, b_t, offs=offs),
                lambda: mm(qa, qb, sa.squeeze(-1), sb.squeeze(1), offs, bf)),
        "dgrad": (lambda: torch._grouped_mm(g, w, offs=offs),
                  lambda: mm(qg, qw, sg.squeeze(-1), sw.squeeze(1), offs, bf)),
        "wgrad": (lambda: torch._grouped_mm(g.t(), a, offs=offs),
                  lambda: mm(qgc.t(), qac, sgc.reshape(-1), sac.reshape(-1), poffs, bf)),
        "wgrad^T": (lambda: torch._grouped_mm(a.t(), g, offs=offs),
                    lambda: mm(qac.t(), qgc, sac.reshape(-1), sgc.reshape(-1), poffs, bf)),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="first shape only")
    args = p.parse_args()
    rows = []
    for m, k, n, e in GROUPED_MM_SHAPES[:1] if args.quick else GROUPED_MM_SHAPES:
        flop = 2.0 * m * k * n
        totals = [0.0, 0.0]
        for name, (f_bf16, f_fp8) in gemms(m, k, n, e).items():
            q = sqnr(f_bf16(), f_fp8())
            assert q > 20, f"{name}: fp8 GEMM SQNR {q:.1f} dB against bf16 (operands wired wrong?)"
            t = [bench_us(f_bf16) / 1000, bench_us(f_fp8) / 1000]
            if name != "wgrad^T":
                totals = [totals[0] + t[0], totals[1] + t[1]]
            rows.append([f"({m}, {k}, {n}, {e})", name, f"{t[0]:.3f}", f"{flop / t[0] / 1e9:.0f}",
                         f"{t[1]:.3f}", f"{flop / t[1] / 1e9:.0f}", f"{t[0] / t[1]:.2f}x"])
        rows.append([f"({m}, {k}, {n}, {e})", "3 GEMMs", f"{totals[0]:.3f}", "", f"{totals[1]:.3f}", "", f"{totals[0] / totals[1]:.2f}x"])
        torch.cuda.empty_cache()
    header = ["(M, K, N, E)", "GEMM", "bf16 ms", "bf16 TFLOP/s", "fp8 ms", "fp8 TFLOP/s", "fp8 speedup"]
    print_table("grouped GEMMs alone (pre-quantized operands)", header, rows, "bench_gemms.md")


if __name__ == "__main__":
    main()
