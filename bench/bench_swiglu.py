"""The SwiGLU kernels of the experts layer (csrc/swiglu, DESIGN §10): h = silu(h1) * h3
and its gradient, plain and fused with the FP8 rowwise quantization of the result,
against the unfused way (torch's elementwise ops as the bf16 module runs them, then
our quantize_rowwise) on the experts layer's (tokens, hidden) shapes. µs, GB/s of the
fused op's own bytes and their % of a device copy of the same bytes, measured in the
same run. Correctness first: every fused output equals the unfused one's within one
bf16 ulp (the fused values) and quantize_rowwise of its own values bit for bit (the
codes) before timing. Run: python bench/bench_swiglu.py
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import moe_fp8_ext

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import bench_us, copy_us, fmt, print_table  # noqa: E402

F8 = torch.float8_e4m3fn
# (tokens, hidden) of bench_experts' shapes
SHAPES = [(32768, 2048), (16384, 1536), (65536, 1408), (65536, 768)]


def unfused_fwd_q(h13, hidden):
    return moe_fp8_ext.quantize_rowwise(F.silu(h13[:, :hidden]) * h13[:, hidden:], F8)


def unfused_bwd(g, h13, hidden):
    h1, h3 = h13[:, :hidden], h13[:, hidden:]
    return torch.cat([torch.ops.aten.silu_backward(g * h3, h1), g * F.silu(h1)], dim=1)


def unfused_bwd_q(g, h13, hidden):
    g13 = unfused_bwd(g, h13, hidden)
    return g13, moe_fp8_ext.quantize_rowwise(g13[:, :hidden], F8), moe_fp8_ext.quantize_rowwise(g13[:, hidden:], F8)


def unfused_bwd_h_q(g, h13, hidden):
    g13 = unfused_bwd(g, h13, hidden)
    return g13, moe_fp8_ext.quantize_rowwise(g13, F8), F.silu(h13[:, :hidden]) * h13[:, hidden:]


def check(m, hidden, h13, g):
    h = moe_fp8_ext.swiglu(h13)
    want = F.silu(h13[:, :hidden]) * h13[:, hidden:]
    assert ((h.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()
    q, s = moe_fp8_ext.swiglu_quantize_rowwise(h13, F8)
    rq, rs = moe_fp8_ext.quantize_rowwise(h, F8)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    g13, q1, s1, q3, s3 = moe_fp8_ext.swiglu_backward_quantize_rowwise(g, h13, F8)
    want = unfused_bwd(g, h13, hidden)
    assert ((g13.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()
    rq, rs = moe_fp8_ext.quantize_rowwise(g13[:, hidden:], F8)
    assert torch.equal(q3.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s3, rs)
    g13_again, q, s, h_again = moe_fp8_ext.swiglu_backward_with_h_quantize_rowwise(g, h13, F8)
    rq, rs = moe_fp8_ext.quantize_rowwise(g13, F8)
    assert torch.equal(h_again, h) and torch.equal(g13_again, g13)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def main():
    rows = []
    for m, hidden in SHAPES:
        h13 = (torch.randn(m, 2 * hidden, device="cuda") * 2).bfloat16()
        g = torch.randn(m, hidden, device="cuda").bfloat16()
        check(m, hidden, h13, g)
        mh = m * hidden
        cases = [
            # (op, ours, unfused, bytes moved by ours)
            ("swiglu", lambda: moe_fp8_ext.swiglu(h13), lambda: F.silu(h13[:, :hidden]) * h13[:, hidden:], 6 * mh),
            ("swiglu + quantize_rowwise", lambda: moe_fp8_ext.swiglu_quantize_rowwise(h13, F8),
             lambda: unfused_fwd_q(h13, hidden), 5 * mh + 4 * m),
            ("swiglu_backward", lambda: moe_fp8_ext.swiglu_backward(g, h13), lambda: unfused_bwd(g, h13, hidden),
             10 * mh),
            ("swiglu_backward + 2 quantize_rowwise", lambda: moe_fp8_ext.swiglu_backward_quantize_rowwise(g, h13, F8),
             lambda: unfused_bwd_q(g, h13, hidden), 12 * mh + 8 * m),
            # the experts backward's: grad_h13 quantized as a whole, and h for W2's
            # gradient (unfused: + swiglu's ops)
            ("swiglu_backward + h + quantize_rowwise",
             lambda: moe_fp8_ext.swiglu_backward_with_h_quantize_rowwise(g, h13, F8),
             lambda: unfused_bwd_h_q(g, h13, hidden), 14 * mh + 4 * m),
        ]
        for name, ours, unfused, nbytes in cases:
            t, tu, tc = bench_us(ours), bench_us(unfused), copy_us(nbytes)
            rows.append([f"({m}, {hidden})", name, fmt(t), fmt(nbytes / t / 1e3, "{:.0f}"), fmt(100 * tc / t, "{:.0f}%"),
                         fmt(tu), fmt(tu / t, "{:.2f}x")])
        del h13, g
        torch.cuda.empty_cache()
    print_table("SwiGLU kernels (bf16 in, e4m3fn out): fused vs unfused", [
        "(tokens, hidden)", "op", "µs", "GB/s", "% of copy", "unfused µs", "speed-up"], rows, "bench_swiglu.md")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
