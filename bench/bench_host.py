"""Host (CPU) time per call of each op, on small inputs so the GPU is never the
bottleneck: what an eager training step pays before any kernel runs. A plain torch
op (x.abs()) and PyTorch's own grouped GEMMs are the yardsticks.
Run: python bench/bench_host.py"""

import sys
import time

import torch

import moe_fp8_ext
from moe_fp8_ext.recipes import scaled_grouped_mm_rowwise

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import linear_problem, print_table  # noqa: E402

F8 = torch.float8_e4m3fn


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def main():
    m, k, n, e = 1024, 2048, 1408, 8
    a, w, offs, g = linear_problem(m, k, n, e)
    b_t = w.detach().transpose(1, 2)
    ad = a.detach()
    starts, poffs = moe_fp8_ext.padded_group_offsets(offs, m, 16)
    qa, sa = moe_fp8_ext.quantize_rowwise(ad, F8)
    qb, sb = moe_fp8_ext.quantize_experts_fwd(b_t, F8)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cases = [
        ("x.abs()", lambda: ad.abs()),
        ("torch._grouped_mm (bf16)", lambda: torch._grouped_mm(ad, b_t, offs=offs)),
        ("scaled grouped GEMM (fp8)", lambda: scaled_grouped_mm_rowwise(qa, qb, sa.squeeze(-1), sb.squeeze(1), offs, torch.bfloat16)),
        ("quantize_rowwise", lambda: moe_fp8_ext.quantize_rowwise(ad, F8)),
        ("torch.ops.moe_fp8.quantize_rowwise", lambda: torch.ops.moe_fp8.quantize_rowwise(ad, F8, True)),
        ("quantize_experts_fwd", lambda: moe_fp8_ext.quantize_experts_fwd(b_t, F8)),
        ("quantize_experts_bwd", lambda: moe_fp8_ext.quantize_experts_bwd(b_t, F8)),
        ("quantize_jagged_colwise_dual (padded)", lambda: moe_fp8_ext.quantize_jagged_colwise_dual(g, ad, offs, F8, padded_starts=starts)),
        ("padded_group_offsets", lambda: moe_fp8_ext.padded_group_offsets(offs, m, 16)),
        ("zero_rows_past_groups_", lambda: moe_fp8_ext.zero_rows_past_groups_(out, offs)),
        ("grouped_mm fwd, bf16", lambda: moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs, recipe="bf16")),
        ("grouped_mm fwd, fp8", lambda: moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs)),
        ("grouped_mm fwd+bwd, bf16", lambda: torch.autograd.grad(moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs, recipe="bf16"), (a, w), g)),
        ("grouped_mm fwd+bwd, fp8", lambda: torch.autograd.grad(moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs), (a, w), g)),
    ]
    rows = [[name, f"{host_us(fn):.1f}"] for name, fn in cases]
    print_table(f"host time per call, µs (inputs ({m}, {k}), ({e}, {n}, {k}))", ["call", "host µs"], rows, "bench_host.md")


if __name__ == "__main__":
    main()
