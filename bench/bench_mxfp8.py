"""MXFP8 quantization (DESIGN §7): ours vs torchao 0.18's `to_mx` under torch.compile,
with % of a device-to-device copy of the same bytes, and the cost of writing the
scales in the blocked (swizzled) layout instead of plain.

Correctness first: every shape is checked bit-exact against moe_fp8_ext.reference
before it is timed. Run: python bench/bench_mxfp8.py [--quick]
"""

import argparse
import sys

import torch

import moe_fp8_ext
from moe_fp8_ext import reference as ref

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from workloads import balanced_offs  # noqa: E402
from common import bench_interleaved_us, bench_us, bench_vs_copy_us, copy_fn, fmt, print_table, try_peer  # noqa: E402


def check(ours, spec):
    q, s = ours
    rq, rs = spec
    assert q.stride() == rq.stride(), (q.stride(), rq.stride())
    nan = torch.isnan(rq.float())
    assert torch.equal(torch.isnan(q.float()), nan), "NaN positions differ from the reference"
    assert torch.equal(q.view(torch.uint8)[~nan], rq.view(torch.uint8)[~nan]), "fp8 codes differ from the reference"
    assert torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8).cpu()), "scales differ from the reference"


def torchao_to_mx(rounding):
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

    mode = ScaleCalculationMode.RCEIL if rounding == "rceil" else ScaleCalculationMode.FLOOR
    return torch.compile(lambda x, swz=False: to_mx(x, torch.float8_e4m3fn, 32, mode, swz))


HEADER = ["op", "shape", "plain µs", "GB/s", "% of copy", "blocked µs", "% of copy", "blocked cost", "torchao µs", "vs torchao"]


def row(name, shape, nbytes, plain_fn, blocked_fn, peer_make):
    """Plain and blocked are timed in alternation (bench_interleaved_us), and the
    blocked cost is the median of their per-round ratios: it is a few percent, as large
    as the drift between two back-to-back medians of the same op."""
    (t, tb, c), (_, ratio, _) = bench_interleaved_us([plain_fn, blocked_fn, copy_fn(nbytes)])
    peer = try_peer(peer_make) if peer_make else None
    tp = bench_us(peer) if peer else None
    return [name, shape, fmt(t), fmt(nbytes / t / 1e3, "{:.0f}"), fmt(100 * c / t, "{:.0f}%"), fmt(tb),
            fmt(100 * c / tb, "{:.0f}%"), fmt(100 * (ratio - 1), "{:+.1f}%"), fmt(tp), fmt(tp and tp / t, "{:.2f}x")]


def fixed_offs(m, g, alignment=16):
    """Router-like group ends drawn from a fixed seed: the M-group layout's padding
    (and so its work) depends on the sizes, so every run times the same groups."""
    return balanced_offs(m, g, alignment, generator=torch.Generator().manual_seed(m * 1000 + g), device="cuda")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="first shape of each table only")
    p.add_argument("--rounding", default="rceil", choices=["rceil", "floor"])
    p.add_argument("--swizzles", action="store_true", help="the scale swizzle table only")
    args = p.parse_args()
    if args.swizzles:
        swizzle_table(args.quick)
        return
    r = args.rounding
    rows_shapes = [(16384, 7168), (16384, 2048), (65536, 7168), (131072, 2048)]
    expert_shapes = [(8, 7168, 2048), (16, 5120, 1536), (64, 2048, 1408)]
    col_shapes = [(16384, 7168, 8), (32768, 5120, 16), (65536, 2048, 64)]
    if args.quick:
        rows_shapes, expert_shapes, col_shapes = rows_shapes[:1], expert_shapes[:1], col_shapes[:1]
    out = []
    for m, k in rows_shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if m * k <= 16384 * 7168:
            check(moe_fp8_ext.quantize_mxfp8_rowwise(x, r, True), ref.quantize_mxfp8_rowwise(x, r, True))
        nbytes = m * k * 3 + m * k // 32
        out.append(row("rowwise", f"({m}, {k})", nbytes, lambda: moe_fp8_ext.quantize_mxfp8_rowwise(x, r),
                       lambda: moe_fp8_ext.quantize_mxfp8_rowwise(x, r, True),
                       lambda: (lambda f=torchao_to_mx(r): f(x))))
        offs = fixed_offs(m, 8)
        out.append(row("rowwise M-groups (G=8)", f"({m}, {k})", nbytes, lambda: moe_fp8_ext.quantize_mxfp8_rowwise(x, r),
                       lambda: moe_fp8_ext.quantize_mxfp8_rowwise(x, r, True, offs), None))
        del x
    for m, k, g in col_shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        offs = fixed_offs(m, g, 32)
        if m * k <= 16384 * 7168:
            check(moe_fp8_ext.quantize_mxfp8_colwise(x, r, True, offs), ref.quantize_mxfp8_colwise(x, r, True, offs))
        nbytes = m * k * 3 + m * k // 32
        out.append(row("colwise K-groups", f"({m}, {k}, G={g})", nbytes, lambda: moe_fp8_ext.quantize_mxfp8_colwise(x, r, False, offs),
                       lambda: moe_fp8_ext.quantize_mxfp8_colwise(x, r, True, offs),
                       lambda: (lambda f=torchao_to_mx(r): f(x.t().contiguous()))))
        del x
    for e, k, n in expert_shapes:
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        b_t = w.transpose(1, 2)  # (E, K, N), K contiguous: the forward operand
        check(moe_fp8_ext.quantize_mxfp8_experts(b_t, r, True), ref.quantize_mxfp8_experts(b_t, r, True))
        nbytes = e * k * n * 3 + e * k * n // 32
        out.append(row("experts fwd", f"({e}, {k}, {n})", nbytes, lambda: moe_fp8_ext.quantize_mxfp8_experts(b_t, r),
                       lambda: moe_fp8_ext.quantize_mxfp8_experts(b_t, r, True),
                       lambda: (lambda f=torchao_to_mx(r): f(w))))
        out.append(row("experts bwd (transposing)", f"({e}, {n}, {k})", nbytes,
                       lambda: moe_fp8_ext.quantize_mxfp8_experts(w, r),
                       lambda: moe_fp8_ext.quantize_mxfp8_experts(w, r, True),
                       lambda: (lambda f=torchao_to_mx(r): f(w.transpose(1, 2).contiguous()))))
        del w, b_t
    print_table(f"MXFP8 quantization (bf16 -> e4m3fn + e8m0, {r})", HEADER, out, "bench_mxfp8.md")
    swizzle_table(args.quick)


# ---- scale swizzles: ours vs torchao's Triton rearranges (issue 13: >= 1.5x) ----------------

SWZ_HEADER = ["op", "scales", "G", "ours µs", "GB/s", "% of copy", "torchao µs", "vs torchao", "copy vs torchao"]


def torchao_rearrange(name):
    """One of torchao's Triton rearranges (torchao.prototype.moe_training.kernels.mxfp8.quant)."""
    from torchao.prototype.moe_training.kernels.mxfp8 import quant

    return getattr(quant, name)


def same_prefix(ours, theirs):
    """torchao's static bounds differ from ours (K groups: M/32 + 4G columns); the
    common prefix must agree and the rest be zero."""
    a, b = ours.view(torch.uint8).flatten(), theirs.view(torch.uint8).flatten()
    n = min(a.numel(), b.numel())
    assert torch.equal(a[:n], b[:n]), "torchao's rearrange differs from ours"
    assert not a[n:].any() and not b[n:].any(), "nonzero bytes past the common prefix"


def swz_row(name, shape, g, nbytes, ours, peer_make):
    """"copy vs torchao" is the most any kernel could show against torchao in event
    time: one at copy speed."""
    peer = try_peer(peer_make) if peer_make else None
    t, c, tp, vs = bench_vs_copy_us(ours, nbytes, peer)
    return [name, shape, str(g), fmt(t), fmt(nbytes / t / 1e3, "{:.0f}"), fmt(100 * c / t, "{:.0f}%"), fmt(tp),
            fmt(vs, "{:.2f}x"), fmt(tp and tp / c, "{:.2f}x")]


def _scales(shape):
    return torch.randint(1, 255, shape, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)


def swizzle_cases(quick=False):
    """to_blocked_scales_m_groups / _k_groups / per expert on the scale shapes of the
    quantization table, against triton_mx_block_rearrange_2d_M_groups /
    _2d_K_groups / _per_group_3d on the same inputs, each checked against the reference
    (ours) and against ours (torchao's, on the common prefix). Yields (op, scales, G,
    bytes: scales read + blocked written, padding included, ours, peer maker)."""
    m_cases = [(16384, 7168, 8), (65536, 7168, 32), (131072, 2048, 8), (65536, 2048, 256)]
    k_cases = [(7168, 16384, 8), (5120, 32768, 16), (2048, 65536, 64)]
    e_cases = [(8, 2048, 7168), (16, 1536, 5120), (64, 1408, 2048), (64, 2048, 1408)]
    if quick:
        m_cases, k_cases, e_cases = m_cases[:1], k_cases[:1], e_cases[:1]
    for m, k, g in m_cases:
        s = _scales((m, k // 32))
        offs = fixed_offs(m, g)
        b = moe_fp8_ext.to_blocked_scales_m_groups(s, offs)
        if m <= 16384:
            assert torch.equal(b.view(torch.uint8).cpu(), ref.to_blocked_m_groups(s.cpu(), offs.cpu()).view(torch.uint8))

        def peer(s=s, offs=offs, b=b):
            f = torchao_rearrange("triton_mx_block_rearrange_2d_M_groups")
            same_prefix(b, f(s, offs))
            return lambda: f(s, offs)

        yield ("M-groups (rowwise A)", f"({m}, {k // 32})", g, s.numel() + b.numel(),
               lambda s=s, offs=offs: moe_fp8_ext.to_blocked_scales_m_groups(s, offs), peer)
    for k, m, g in k_cases:
        s = _scales((k, m // 32))
        offs = fixed_offs(m, g, 32)
        b = moe_fp8_ext.to_blocked_scales_k_groups(s, offs)
        if k * m <= 7168 * 16384:
            assert torch.equal(b.view(torch.uint8).cpu(), ref.to_blocked_k_groups(s.cpu(), offs.cpu()).view(torch.uint8))

        def peer(s=s, offs=offs, b=b):
            f = torchao_rearrange("triton_mx_block_rearrange_2d_K_groups")
            blk_offs = (offs // 32).to(torch.int32)
            same_prefix(b, f(s, blk_offs))
            return lambda: f(s, blk_offs)

        yield ("K-groups (colwise wgrad)", f"({k}, {m // 32})", g, s.numel() + b.numel(),
               lambda s=s, offs=offs: moe_fp8_ext.to_blocked_scales_k_groups(s, offs), peer)
    for e, n, k in e_cases:
        s = _scales((e, n, k // 32))
        b = moe_fp8_ext.to_blocked_scales(s)
        assert torch.equal(b[0].view(torch.uint8).cpu(), ref.to_blocked(s[0].cpu()).view(torch.uint8).flatten())
        assert torch.equal(b[-1].view(torch.uint8).cpu(), ref.to_blocked(s[-1].cpu()).view(torch.uint8).flatten())

        def peer(s=s, b=b):
            f = torchao_rearrange("triton_mx_block_rearrange_per_group_3d")
            same_prefix(b, f(s))
            return lambda: f(s)

        yield ("per expert (3-D)", f"({e}, {n}, {k // 32})", "-", s.numel() + b.numel(),
               lambda s=s: moe_fp8_ext.to_blocked_scales(s), peer)


def swizzle_table(quick):
    out = [swz_row(*case) for case in swizzle_cases(quick)]
    print_table("MXFP8 scale swizzles (e8m0 -> blocked), vs torchao's Triton rearranges", SWZ_HEADER, out,
                "bench_mxfp8_swizzle.md")


if __name__ == "__main__":
    main()
