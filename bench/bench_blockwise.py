"""FP8 blockwise quantization (DESIGN §6): our five ops and the dual weight op vs
torchao 0.18's Triton kernels of the same names, with % of a device-to-device copy
of the same bytes measured in the same run.

Correctness first: every shape is checked bit-exact against moe_fp8_ext.reference
(and torchao's output against ours where its layouts are the same) before it is
timed. Bytes: the input read, q written (twice for the dual ops), the fp32 scales.
act_dual (A's or grad_out's forward and weight-gradient operands over token groups,
one read) is timed against our own two ops on the same groups.
Run: python bench/bench_blockwise.py [--quick] [--fp8 e4m3fn|e4m3fnuz]
"""

import argparse
import sys

import torch

import moe_fp8_ext
from moe_fp8_ext import reference as ref

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import bench_vs_copy_us, fmt, print_table, try_peer  # noqa: E402

HEADER = ["op", "shape", "ours µs", "GB/s", "% of copy", "torchao µs", "% of copy", "vs torchao"]
DUAL_HEADER = ["op", "shape", "ours µs", "GB/s", "% of copy", "two ops µs", "% of copy", "vs two ops"]


def check(ours, spec):
    """Bit-exact q (NaN positions aside) and scales, same strides."""
    for q, rq in ((ours[i], spec[i]) for i in range(0, len(ours), 2)):
        assert q.shape == rq.shape and q.stride() == rq.stride(), (q.shape, q.stride(), rq.shape, rq.stride())
        nan = torch.isnan(rq.float())
        assert torch.equal(torch.isnan(q.float()), nan), "NaN positions differ from the reference"
        assert torch.equal(q.view(torch.uint8)[~nan], rq.view(torch.uint8)[~nan]), "fp8 codes differ from the reference"
    for s, rs in ((ours[i], spec[i]) for i in range(1, len(ours), 2)):
        assert s.shape == rs.shape, (s.shape, rs.shape)
        assert torch.equal(s, rs), "scales differ from the reference"


def torchao_kernel(name):
    from torchao.prototype.blockwise_fp8_training import kernels

    return getattr(kernels, name)


def same_as_ours(theirs, ours):
    """torchao's (q, scale) equals ours bit for bit (its layouts are DESIGN §6's)."""
    assert torch.equal(theirs[0].view(torch.uint8), ours[0].view(torch.uint8)), "torchao's q differs from ours"
    assert torch.equal(theirs[1].reshape(ours[1].shape), ours[1]), "torchao's scales differ from ours"


def row(name, shape, nbytes, ours, peer_make):
    peer = try_peer(peer_make) if peer_make else None
    t, c, tp, vs = bench_vs_copy_us(ours, nbytes, peer)
    cells = [name, shape, fmt(t), fmt(nbytes / t / 1e3, "{:.0f}"), fmt(100 * c / t, "{:.0f}%"), fmt(tp),
             fmt(tp and 100 * c / tp, "{:.0f}%"), fmt(vs, "{:.2f}x")]
    print("  " + " | ".join(cells), flush=True)  # as it goes: the table prints at the end
    return cells


def peer_2d(name, x, ours_out, dtype):
    """A torchao Triton kernel on x, checked against our output first."""
    def make():
        f = torchao_kernel(name)
        same_as_ours(f(x, 128, dtype), ours_out)
        return lambda: f(x, 128, dtype)
    return make


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="first shape of each group only")
    p.add_argument("--fp8", default="e4m3fn", choices=["e4m3fn", "e4m3fnuz"])
    p.add_argument("--ops", default="all", choices=["all", "act", "weight"], help="activation or weight ops only")
    args = p.parse_args()
    fp8 = getattr(torch, f"float8_{args.fp8}")
    act_shapes = [(16384, 7168), (32768, 5120), (65536, 2048), (131072, 2048)]
    weight_shapes = [(7168, 2048), (2048, 7168), (5120, 1536)]
    expert_shapes = [(8, 2048, 7168), (16, 1536, 5120), (64, 1408, 2048)]  # (E, N, K): W of the forward
    dual_shapes = [(16384, 2048), (32768, 1536), (65536, 1408)]
    if args.quick:
        act_shapes, weight_shapes, expert_shapes = act_shapes[:1], weight_shapes[:1], expert_shapes[:1]
        dual_shapes = []
    if args.ops == "weight":
        act_shapes, dual_shapes = [], []
    elif args.ops == "act":
        weight_shapes, expert_shapes = [], []
    out, dual_out = [], []
    for m, k in act_shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        nbytes = m * k * 3 + 4 * m * (-(-k // 128))
        small = m * k <= 32768 * 5120
        for name, fn, spec, tname in (
            ("act_lhs (1x128)", moe_fp8_ext.quantize_blockwise_act_lhs, ref.quantize_blockwise_act_lhs,
             "triton_fp8_blockwise_act_quant_lhs"),
            ("act_rhs (128x1, transposing)", moe_fp8_ext.quantize_blockwise_act_rhs, ref.quantize_blockwise_act_rhs,
             "triton_fp8_blockwise_act_quant_rhs"),
            ("act_transposed_lhs (transposing)", moe_fp8_ext.quantize_blockwise_act_transposed_lhs,
             ref.quantize_blockwise_act_transposed_lhs, "triton_fp8_blockwise_act_quant_transposed_lhs"),
        ):
            o = fn(x, fp8)
            if small:
                check(o, spec(x, fp8))
            out.append(row(name, f"({m}, {k})", nbytes, lambda fn=fn: fn(x, fp8), peer_2d(tname, x, o, fp8)))
        dual_out.append(dual_row(x, fp8, True))
        del x
    for m, k in dual_shapes:  # grad_out of the grouped-linear shapes: the dual alone
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        dual_out.append(dual_row(x, fp8, True))
        del x
    for m, n in weight_shapes:
        w = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 0.02
        nbytes = m * n * 3 + 4 * (-(-m // 128)) * (-(-n // 128))
        o_rhs = moe_fp8_ext.quantize_blockwise_weight_rhs(w, fp8)
        o_t = moe_fp8_ext.quantize_blockwise_weight_transposed_rhs(w, fp8)
        check(o_rhs, ref.quantize_blockwise_weight_rhs(w, fp8))
        check(o_t, ref.quantize_blockwise_weight_transposed_rhs(w, fp8))
        check(moe_fp8_ext.quantize_blockwise_weight_dual(w, fp8), o_rhs + o_t)
        out.append(row("weight_rhs (128x128)", f"({m}, {n})", nbytes,
                       lambda: moe_fp8_ext.quantize_blockwise_weight_rhs(w, fp8),
                       peer_2d("triton_fp8_blockwise_weight_quant_rhs", w, o_rhs, fp8)))
        out.append(row("weight_transposed_rhs", f"({m}, {n})", nbytes,
                       lambda: moe_fp8_ext.quantize_blockwise_weight_transposed_rhs(w, fp8),
                       peer_2d("triton_fp8_blockwise_weight_quant_transposed_rhs", w, o_t, fp8)))
        out.append(row("weight_dual (both; peer: rhs + transposed)", f"({m}, {n})", nbytes + m * n,
                       lambda: moe_fp8_ext.quantize_blockwise_weight_dual(w, fp8),
                       _peer_both(w, fp8)))
        del w
    for e, n, k in expert_shapes:
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        b_t = w.transpose(1, 2)  # (E, K, N): the forward operand, K contiguous
        nbytes = e * n * k * 3 + 4 * e * (-(-n // 128)) * (-(-k // 128))
        o = moe_fp8_ext.quantize_blockwise_weight_dual(b_t, fp8)
        if e * n * k <= 16 * 1536 * 5120:
            check(o, ref.quantize_blockwise_weight_rhs(b_t, fp8) + ref.quantize_blockwise_weight_transposed_rhs(b_t, fp8))
        out.append(row("experts weight_rhs (3-D)", f"({e}, {k}, {n})", nbytes,
                       lambda: moe_fp8_ext.quantize_blockwise_weight_rhs(b_t, fp8), _peer_experts(w, fp8, False)))
        out.append(row("experts weight_dual (3-D; peer: both, per expert)", f"({e}, {k}, {n})", nbytes + e * n * k,
                       lambda: moe_fp8_ext.quantize_blockwise_weight_dual(b_t, fp8), _peer_experts(w, fp8, True)))
        del w, b_t
    print_table(f"FP8 blockwise quantization (bf16 -> {args.fp8} + fp32 scales)", HEADER, out, "bench_blockwise.md")
    if dual_out:
        print_table(f"act_dual: one read for both activation operands (bf16 -> {args.fp8})", DUAL_HEADER, dual_out,
                    "bench_blockwise_dual.md")


GROUPS = {16384: 8, 32768: 16, 65536: 64, 131072: 8}  # experts of the grouped-linear shapes


def router_offs(m, g, seed=0):
    """Router-like token groups: sizes spread around m / g (0.5-1.5x), any size."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(g, generator=gen) + 0.5
    ends = (torch.cumsum(w, 0) / w.sum() * m).floor().to(torch.int32)
    ends[-1] = m
    return ends.cuda()


def dual_row(x, fp8, check_two_ops=True):
    """quantize_blockwise_act_dual on G router-like groups, padded layout (the grouped
    linear's A and grad_out operands). Peer columns: OUR act_lhs + act_rhs of the same
    groups (torchao has no grouped or one-read form), checked bit-equal first; a table
    of its own."""
    m, k = x.shape
    g = GROUPS.get(m, 8)
    offs = router_offs(m, g)
    starts, _ = moe_fp8_ext.padded_group_offsets(offs, m, 128)
    rows = moe_fp8_ext.padded_rows(m, g, 128)
    run = lambda: moe_fp8_ext.quantize_blockwise_act_dual(x, fp8, offs, starts, 128)  # noqa: E731
    two = lambda: (moe_fp8_ext.quantize_blockwise_act_lhs(x, fp8),  # noqa: E731
                   moe_fp8_ext.quantize_blockwise_act_rhs(x, fp8, offs, starts, 128))
    if check_two_ops:
        (a, b) = two()
        check(run(), a + b)
    # minimal bytes: the padded operand's padding rows (about G * 64 rows) not counted
    nbytes = m * k * 4 + 4 * m * (-(-k // 128)) + 4 * (rows // 128) * k
    return row(f"act_dual, {g} groups", f"({m}, {k})", nbytes, run, lambda: two)


def _peer_both(w, dtype):
    def make():
        f, g = torchao_kernel("triton_fp8_blockwise_weight_quant_rhs"), torchao_kernel(
            "triton_fp8_blockwise_weight_quant_transposed_rhs")
        return lambda: (f(w, 128, dtype), g(w, 128, dtype))
    return make


def _peer_experts(w, dtype, both):
    """torchao's kernels are 2-D and take contiguous inputs: one launch per expert on
    W[e] (N, K), whose transposed_rhs is the rhs of B_t[e] = W[e]^T (the same bytes)."""
    def make():
        f, g = torchao_kernel("triton_fp8_blockwise_weight_quant_rhs"), torchao_kernel(
            "triton_fp8_blockwise_weight_quant_transposed_rhs")
        if both:
            return lambda: [(g(b, 128, dtype), f(b, 128, dtype)) for b in w]
        return lambda: [g(b, 128, dtype) for b in w]
    return make


if __name__ == "__main__":
    main()
