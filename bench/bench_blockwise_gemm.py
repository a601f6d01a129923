"""FP8 blockwise grouped GEMMs on Hopper (csrc/gemm/blockwise_grouped_sm90.cu): TFLOP/s of
the forward, dgrad and wgrad GEMMs of one grouped linear, beside

* the dense blockwise ``torch._scaled_mm`` (cuBLAS) on the same total problem: one GEMM
  of all M tokens (1x128 x 128x128 scales for forward / dgrad, 1x128 x 1x128 for wgrad),
  the column "% of dense" (the targets: >= 85% forward / dgrad, >= 70% wgrad);
* bf16 ``torch._grouped_mm`` on the same groups.

Shapes (tokens M, dim K, hidden N, experts E), balanced groups of M / E tokens (multiples
of 128): issue 14's three, then two of one group (one expert's tokens, as with few
experts a GPU under expert parallelism), where the order of the tiles decides how often
A is read from DRAM. forward: (M, K) x (E, K, N) -> (M, N); dgrad: (M, N) x (E, N, K) -> (M, K);
wgrad: (N, M) x (M, K) grouped over the tokens -> (E, N, K). The operands come from
the quantization ops (not timed). Correctness first: each output's SQNR against the
bf16 result. Run: python bench/bench_blockwise_gemm.py [--quick]

``--swiglu``: the experts layer's W13 forward and W2 input gradient at bench_experts'
shapes (tokens, dim, hidden, experts), router-like unaligned groups: the GEMMs with the
SwiGLU and dSwiGLU epilogues (``blockwise_grouped_mm_swiglu``, ``_dswiglu``) against the
GEMM, the (d)SwiGLU op and the activation dual they replace (the same bits, checked), and
the GEMM alone; writes $OUT/bench_blockwise_swiglu.json.
"""

import argparse
import sys

import torch

import moe_fp8_ext
from moe_fp8_ext import blockwise_gemm as bg
from moe_fp8_ext.token_groups import router_counts

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import bench_interleaved_us, fmt, print_table, sqnr, try_peer, write_json  # noqa: E402

SHAPES = [(16384, 7168, 2048, 8), (32768, 5120, 1536, 16), (65536, 2048, 1408, 64)]
ONE_GROUP = [(16384, 7168, 2048, 1), (65536, 2048, 1408, 1)]
E4M3 = torch.float8_e4m3fn


def equal_offs(m, e):
    return torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (m // e)


def dense_scaled_mm(a, sa, b, sb):
    """torch._scaled_mm with blockwise scales (a (M, K) row-major, b (K, N) column-major);
    cuBLAS wants the 128x128 scales column-major, some versions with the K blocks
    padded to a multiple of 4: try the plain layout first, then the padded one."""
    f = lambda sb=sb: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    fn = try_peer(lambda: f)
    if fn is None and sb.dim() == 2:
        kb, nb = sb.shape
        l4 = -(-kb // 4) * 4
        padded = torch.zeros(nb, l4, device=sb.device, dtype=sb.dtype).t()[:kb]
        padded.copy_(sb)
        fn = try_peer(lambda: (lambda: torch._scaled_mm(a, b, sa, padded, out_dtype=torch.bfloat16)))
    return fn


def tflops(flops, us):
    return None if us is None else flops / us / 1e6


def row(shape, what, flops, ours_fn, dense_fn, bf16_fn):
    """Ours, the dense GEMM and bf16 timed in alternation (bench_interleaved_us); "% of
    dense" is the median over the rounds of dense / ours in the same round (back to back,
    one GEMM's two timings have differed by 5%, the size of the margins measured)."""
    fns = [ours_fn] + [f for f in (dense_fn, bf16_fn) if f]
    ts, ratios = bench_interleaved_us(fns)
    t = ts[0]
    td = ts[1] if dense_fn else None
    tb = ts[-1] if bf16_fn else None
    pct = 100 * ratios[1] if dense_fn else None  # the median of dense / ours over the rounds
    return [shape, what, fmt(t), fmt(tflops(flops, t), "{:.0f}"), fmt(td), fmt(tflops(flops, td), "{:.0f}"),
            fmt(pct, "{:.0f}%"), fmt(tb), fmt(tflops(flops, tb), "{:.0f}")]


HEADER = ["shape (M, K, N, E)", "GEMM", "ours µs", "TFLOP/s", "dense fp8 µs", "TFLOP/s", "% of dense", "bf16 grouped µs",
          "TFLOP/s"]


EXPERTS_SHAPES = [(32768, 7168, 2048, 8), (16384, 5120, 1536, 16), (65536, 2048, 1408, 64), (65536, 2048, 768, 128)]


def bench_swiglu(shapes):
    ops = torch.ops.moe_fp8
    rows, data = [], []
    for t, d, h, e in shapes:
        offs = torch.cumsum(router_counts(t, e), 0).to(torch.int32).cuda()
        starts, _ = ops.padded_group_offsets(offs, t, bg.BW_BLOCK)
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        parts = [(torch.randn(e, h, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5).transpose(1, 2)
                 for _ in range(2)]
        qa, sa = ops.quantize_blockwise_act_lhs(x, E4M3)
        qb, sb = ops.quantize_blockwise_weight_rhs_cat(parts, E4M3)
        qi, si = ops.quantize_blockwise_weight_rhs_cat(parts, E4M3, True)
        del x, parts

        def composed():
            h13 = ops.blockwise_grouped_mm_2d3d(qa, sa, qb, sb, offs, torch.bfloat16)
            return (h13,) + tuple(ops.quantize_blockwise_act_dual(ops.swiglu(h13), E4M3, offs, starts, bg.BW_BLOCK))

        fused = lambda: ops.blockwise_grouped_mm_swiglu(qa, sa, qi, si, offs, starts)  # noqa: E731
        gemm = lambda: ops.blockwise_grouped_mm_2d3d(qa, sa, qb, sb, offs, torch.bfloat16)  # noqa: E731
        shape = str((t, d, h, e))
        bench_pair(rows, data, shape, "W13 fwd + SwiGLU", composed, fused, gemm)
        h13 = gemm()
        # W2's input gradient: grad_out (tokens, dim) x W2 (E, dim, hidden), then dSwiGLU with h13
        g = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        qg, sg = ops.quantize_blockwise_act_lhs(g, E4M3)
        qw, sw = ops.quantize_blockwise_weight_rhs(torch.randn(e, d, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5,
                                                   E4M3)

        def composed_bwd():
            g13 = ops.swiglu_backward(ops.blockwise_grouped_mm_2d3d(qg, sg, qw, sw, offs, torch.bfloat16), h13)
            return tuple(ops.quantize_blockwise_act_dual(g13, E4M3, offs, starts, bg.BW_BLOCK))

        fused_bwd = lambda: ops.blockwise_grouped_mm_dswiglu(qg, sg, qw, sw, offs, h13, starts)  # noqa: E731
        gemm_bwd = lambda: ops.blockwise_grouped_mm_2d3d(qg, sg, qw, sw, offs, torch.bfloat16)  # noqa: E731
        bench_pair(rows, data, shape, "W2 dgrad + dSwiGLU", composed_bwd, fused_bwd, gemm_bwd)
        torch.cuda.empty_cache()
    print_table("experts: GEMMs with the (d)SwiGLU epilogue vs GEMM + (d)swiglu + act_dual (router groups)",
                ["shape (tokens, dim, hidden, experts)", "GEMM", "composed µs", "fused µs", "fused / composed",
                 "GEMM alone µs"], rows, "bench_blockwise_swiglu.md")
    write_json("bench_blockwise_swiglu", {"swiglu_epilogues": data}, sys.argv)


def bench_pair(rows, data, shape, gemm_name, composed, fused, gemm):
    """A fused GEMM against the kernels it replaces (the same bits, checked) and its GEMM alone."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    same = all(torch.equal(a.view(bits[a.element_size()]), b.view(bits[a.element_size()]))
               for a, b in zip(composed(), fused()))
    assert same, f"{gemm_name}: the fused GEMM differs from the composed path at {shape}"
    (tc, tf, tg), _ = bench_interleaved_us([composed, fused, gemm], rounds=3, rep_ms=40)
    rows.append([shape, gemm_name, fmt(tc, "{:.0f}"), fmt(tf, "{:.0f}"), f"{tf / tc:.3f}", fmt(tg, "{:.0f}")])
    data.append(dict(shape=shape, gemm=gemm_name, composed_us=tc, fused_us=tf, fused_vs_composed=tf / tc, gemm_us=tg))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="first shape only")
    p.add_argument("--swiglu", action="store_true", help="only the W13 GEMM with the SwiGLU epilogue")
    args = p.parse_args()
    if not bg.available():
        print("bench_blockwise_gemm: needs an NVIDIA GPU of compute capability 9.0 and the sm_90a build; skipped")
        return
    if args.swiglu:
        bench_swiglu(EXPERTS_SHAPES[:1] if args.quick else EXPERTS_SHAPES)
        return
    torch.manual_seed(0)
    rows = []
    for m, k, n, e in SHAPES[:1] if args.quick else SHAPES + ONE_GROUP:
        shape = f"({m}, {k}, {n}, {e})"
        flops = 2.0 * m * k * n
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) * 0.02
        grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        offs = equal_offs(m, e)

        # forward: x @ w[g]
        a, sa = moe_fp8_ext.quantize_blockwise_act_lhs(x, E4M3)
        b, sb, bt, sbt = moe_fp8_ext.quantize_blockwise_weight_dual(w, E4M3)  # (E, K, N) and (E, N, K)
        fwd = lambda: bg.blockwise_grouped_mm_2d3d(a, sa, b, sb, offs)
        ref = torch._grouped_mm(x, w, offs=offs)
        q = sqnr(ref, fwd())
        assert q > 25, f"forward SQNR {q:.1f} dB against bf16"
        dense = dense_scaled_mm(a, sa, b[0], sb[0])  # the same M x K x N, one weight
        rows.append(row(shape, f"forward ({q:.0f} dB)", flops, fwd, dense, lambda: torch._grouped_mm(x, w, offs=offs)))
        del ref

        # dgrad: grad @ w[g]^T
        ga, gsa = moe_fp8_ext.quantize_blockwise_act_lhs(grad, E4M3)
        wt = w.transpose(1, 2)
        dgrad = lambda: bg.blockwise_grouped_mm_2d3d(ga, gsa, bt, sbt, offs)
        ref = torch._grouped_mm(grad, wt, offs=offs)
        q = sqnr(ref, dgrad())
        assert q > 25, f"dgrad SQNR {q:.1f} dB against bf16"
        dense = dense_scaled_mm(ga, gsa, bt[0], sbt[0])
        rows.append(row(shape, f"dgrad ({q:.0f} dB)", flops, dgrad, dense, lambda: torch._grouped_mm(grad, wt, offs=offs)))
        del ref, ga, gsa

        # wgrad: grad[tokens of g]^T @ x[tokens of g]
        wa, wsa = moe_fp8_ext.quantize_blockwise_act_transposed_lhs(grad, E4M3, offs)
        wb, wsb = moe_fp8_ext.quantize_blockwise_act_rhs(x, E4M3, offs)
        wgrad = lambda: bg.blockwise_grouped_mm_2d2d(wa, wsa, wb, wsb, offs)
        gt = grad.t()
        ref = torch._grouped_mm(gt, x, offs=offs)
        q = sqnr(ref, wgrad())
        assert q > 25, f"wgrad SQNR {q:.1f} dB against bf16"
        # dense: (N, M) x (M, K), 1x128 blocks along M on both sides; cuBLAS may want
        # the right operand's scales (M/128, K) column-major
        dense = try_peer(lambda: (lambda: torch._scaled_mm(wa, wb, wsa, wsb, out_dtype=torch.bfloat16)))
        if dense is None:
            wsb_cm = wsb.t().contiguous().t()
            dense = try_peer(lambda: (lambda: torch._scaled_mm(wa, wb, wsa, wsb_cm, out_dtype=torch.bfloat16)))
        rows.append(row(shape, f"wgrad ({q:.0f} dB)", flops, wgrad, dense, lambda: torch._grouped_mm(gt, x, offs=offs)))
        del ref, x, w, grad, a, b, bt, wa, wb
        torch.cuda.empty_cache()
    print_table("FP8 blockwise grouped GEMM (sm90, CUTLASS) vs dense blockwise _scaled_mm and bf16 _grouped_mm",
                HEADER, rows, "bench_blockwise_gemm.md")


if __name__ == "__main__":
    main()
