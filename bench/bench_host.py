"""Host (CPU) time per call of each op, on small inputs so the GPU is never the
bottleneck: what an eager training step pays before any kernel runs. A plain torch
op (x.abs()) and PyTorch's own grouped GEMMs are the yardsticks.
Run: python bench/bench_host.py [--profile]
--profile: also cProfile the grouped_mm and experts steps of each recipe (the Python
functions and the op calls where the host time of a step goes, by self time)."""

import argparse
import cProfile
import pstats
import sys

import torch

import moe_fp8_ext
from moe_fp8_ext.recipes import scaled_grouped_mm_rowwise

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import host_us, linear_problem, print_table  # noqa: E402

F8 = torch.float8_e4m3fn


RECIPES = ("bf16", "fp8_rowwise", "fp8_blockwise")


def steps(m, k, n, e):
    """{name: one forward + backward} of grouped_mm and of the experts layer per recipe,
    on small inputs (router-like groups)."""
    a, w, offs, g = linear_problem(m, k, n, e)
    d, h = k, 768
    x = a.detach().clone().requires_grad_()
    w1 = (torch.randn(e, h, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5).requires_grad_()
    w3 = (torch.randn(e, h, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5).requires_grad_()
    w2 = (torch.randn(e, d, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5).requires_grad_()
    gx = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    out = {}
    for r in RECIPES:
        out[f"grouped_mm fwd+bwd, {r}"] = lambda r=r: torch.autograd.grad(
            moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs, recipe=r), (a, w), g)
    for r in RECIPES[1:]:
        out[f"experts fwd+bwd, {r}"] = lambda r=r: torch.autograd.grad(
            moe_fp8_ext.experts(x, w1, w3, w2, offs, recipe=r), (x, w1, w3, w2), gx)
    return out


def profile_steps(m, k, n, e, n_steps=200, top=18):
    """cProfile of each step: the functions where its host time goes, by self time."""
    for name, fn in steps(m, k, n, e).items():
        host_us(fn, 20, 1)  # warm-up
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n_steps):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"== {name}: self time per step (cProfile, {n_steps} steps; its own overhead included)")
        st = pstats.Stats(prof)
        rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
        for (file, line, func), (cc, nc, tt, ct, _) in rows:
            where = f"{file.rsplit('/', 1)[-1]}:{line}" if line else file
            print(f"  {tt / n_steps * 1e6:8.1f} µs self {ct / n_steps * 1e6:8.1f} µs cum {nc // n_steps:4d}x  {func[:60]}  {where[:40]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
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
    ]
    cases += list(steps(m, k, n, e).items())
    rows = [[name, *(f"{t:.1f}" for t in host_us(fn))] for name, fn in cases]
    print_table(f"host time per call, µs (inputs ({m}, {k}), ({e}, {n}, {k}); experts: dim {k}, hidden 768)",
                ["call", "median µs", "min µs"], rows, "bench_host.md")
    if args.profile:
        profile_steps(m, k, n, e)


if __name__ == "__main__":
    main()
