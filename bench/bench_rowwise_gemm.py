"""Our FP8 rowwise grouped GEMM (csrc/gemm/rowwise_grouped_sm90*.cu, CUTLASS, a
configuration picked per shape) against PyTorch's (torch._scaled_grouped_mm, one fixed
heuristic) and the bf16 grouped GEMM, on the six GEMMs of the SwiGLU experts layer at
issue 15's shapes (tokens, dim, hidden, experts), router-like group sizes:

  W13 fwd    x (T, D) @ [W1; W3]^T        2-D x 3-D, N = 2H
  W2 fwd     h (T, H) @ W2^T              2-D x 3-D, N = D
  W2 dgrad   grad_out (T, D) @ W2         2-D x 3-D, N = H
  W13 dgrad  grad_h13 (T, 2H) @ [W1; W3]  2-D x 3-D, N = D
  W2 wgrad   grad_out^T @ h per group     2-D x 2-D -> (E, D, H)
  W13 wgrad  grad_h13^T @ x per group     2-D x 2-D -> (E, 2H, D)

Each configuration's output is checked against PyTorch's (the same math: equal up to
the order of the fp32 sums) before timing. --sweep adds every configuration's time.

Run: python bench/bench_rowwise_gemm.py [--quick] [--sweep]
"""

import argparse
import sys

import torch


sys.path.insert(0, __file__.rsplit("/", 1)[0])
from workloads import balanced_offs  # noqa: E402
from common import bench_us, print_table  # noqa: E402

F8 = torch.float8_e4m3fn
SHAPES = [(32768, 7168, 2048, 8), (16384, 5120, 1536, 16), (65536, 2048, 1408, 64), (65536, 2048, 768, 128)]
CONFIGS = ["coop128x128c21", "coop128x128c12", "coop128x256c21", "coop256x128c21", "pong128x128c21",
           "pong128x128c12"]  # csrc/gemm/rowwise_grouped_sm90.cuh: MOE_FP8_RW_CONFIGS


def fp8(*shape):
    return torch.randn(*shape, device="cuda").clamp(-6, 6).to(F8)


def scales(*shape):
    return torch.rand(*shape, device="cuda") + 0.5


def problems(t, d, h, e):
    """[(name, flops, torch fn, ours(config) fn, bf16 fn)] for the six GEMMs."""
    offs = balanced_offs(t, e, device="cuda")
    out = []
    for name, k, n in (("W13 fwd", d, 2 * h), ("W2 fwd", h, d), ("W2 dgrad", d, h), ("W13 dgrad", 2 * h, d)):
        a, b = fp8(t, k), fp8(e, n, k).transpose(1, 2)  # b (E, K, N) column-major per expert
        sa, sb = scales(t), scales(e, n)
        ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
        out.append((name, 2 * t * k * n,
                    lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                                                        use_fast_accum=True),
                    lambda c, a=a, b=b, sa=sa, sb=sb: torch.ops.moe_fp8.rowwise_grouped_mm_2d3d(a, sa, b, sb, offs,
                                                                                              torch.bfloat16, c),
                    lambda ab=ab, bb=bb: torch._grouped_mm(ab, bb, offs=offs)))
    for name, n, k in (("W2 wgrad", d, h), ("W13 wgrad", 2 * h, d)):
        a, b = fp8(n, t), fp8(k, t).t()  # a (N, T) row-major, b (T, K) column-major
        sa, sb = scales(e, n), scales(e, k)
        ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
        out.append((name, 2 * t * k * n,
                    lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_grouped_mm(a, b, sa.reshape(-1), sb.reshape(-1), offs=offs,
                                                                        out_dtype=torch.bfloat16, use_fast_accum=True),
                    lambda c, a=a, b=b, sa=sa, sb=sb: torch.ops.moe_fp8.rowwise_grouped_mm_2d2d(a, sa, b, sb, offs,
                                                                                              torch.bfloat16, c),
                    lambda ab=ab, bb=bb: torch._grouped_mm(ab, bb, offs=offs)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="the first shape only")
    p.add_argument("--sweep", action="store_true", help="every configuration's time")
    a = p.parse_args()
    header = ["(T, D, H, E)", "GEMM", "bf16 µs", "torch fp8 µs", "TFLOP/s", "ours µs", "TFLOP/s", "vs torch"]
    if a.sweep:
        header += CONFIGS
    rows, totals = [], {}
    for shape in SHAPES[:1] if a.quick else SHAPES:
        for name, flops, ref, ours, bf16 in problems(*shape):
            want = ref()
            for c in range(-1, len(CONFIGS)):
                got = ours(c)
                err = (got.float() - want.float()).abs().max().item()
                scale = want.float().abs().max().item()
                assert err <= 1e-2 * scale, f"{shape} {name} config {c}: max error {err} vs max {scale}"
            t_bf16, t_ref, t_ours = bench_us(bf16), bench_us(ref), bench_us(lambda: ours(-1))
            tot = totals.setdefault(shape, [0.0, 0.0, 0.0])
            tot[0] += t_bf16
            tot[1] += t_ref
            tot[2] += t_ours
            row = [str(shape), name, f"{t_bf16:.1f}", f"{t_ref:.1f}", f"{flops / t_ref / 1e6:.0f}", f"{t_ours:.1f}",
                   f"{flops / t_ours / 1e6:.0f}", f"{t_ref / t_ours:.2f}x"]
            if a.sweep:
                row += [f"{bench_us(lambda c=c: ours(c)):.1f}" for c in range(len(CONFIGS))]
            rows.append(row)
        tot = totals[shape]
        rows.append([str(shape), "all six", f"{tot[0]:.1f}", f"{tot[1]:.1f}", "", f"{tot[2]:.1f}", "",
                     f"{tot[1] / tot[2]:.2f}x"] + ([""] * len(CONFIGS) if a.sweep else []))
    print_table("FP8 rowwise grouped GEMMs: ours vs torch._scaled_grouped_mm (experts-layer GEMMs)", header, rows,
                "rowwise_gemm")


if __name__ == "__main__":
    main()
