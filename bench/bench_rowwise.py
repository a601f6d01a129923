"""FP8 rowwise quantization: ours vs torchao 0.18's Triton kernels vs torch.compile
of moe_fp8_ext.reference, with % of a device-to-device copy of the same bytes.

Correctness first: every shape is checked bit-exact against the reference before
it is timed. Run: python bench/bench_rowwise.py [--quick]
"""

import argparse
import sys

import torch

import moe_fp8_ext
from moe_fp8_ext import _tuning
from moe_fp8_ext import reference as ref

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from workloads import balanced_offs  # noqa: E402
from common import bench_us, copy_us, fmt, print_table, try_peer  # noqa: E402

F8 = torch.float8_e4m3fn


def torchao_kernels():
    from torchao.prototype.moe_training.kernels import (
        float8_rowwise,
        jagged_float8_scales,
    )

    return float8_rowwise, jagged_float8_scales


def check(ours, spec):
    for o, s in zip(ours, spec):
        if o.dtype == torch.float32:
            assert torch.equal(o, s), "scales differ from the reference"
        else:
            assert o.stride() == s.stride(), (o.stride(), s.stride())
            assert torch.equal(o.view(torch.uint8), s.view(torch.uint8)), "fp8 codes differ from the reference"


def row(shape_str, nbytes, ours_fn, ao_fn, compiled_fn):
    t = bench_us(ours_fn)
    c = copy_us(nbytes)
    ao = try_peer(ao_fn)
    comp = try_peer(compiled_fn)
    t_ao = bench_us(ao) if ao else None
    t_comp = bench_us(comp) if comp else None
    return [
        shape_str,
        fmt(t),
        fmt(nbytes / t / 1e3, "{:.0f}"),
        fmt(100 * c / t, "{:.0f}%"),
        fmt(t_ao),
        fmt(t_ao and 100 * c / t_ao, "{:.0f}%"),
        fmt(t_comp),
        fmt(t_ao and t_ao / t, "{:.2f}x"),
    ]


HEADER = ["shape", "ours µs", "GB/s", "% of copy", "torchao µs", "torchao % copy", "compile(ref) µs", "vs torchao"]


def bench_rowwise(shapes):
    rows = []
    for m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        check(moe_fp8_ext.quantize_rowwise(x, F8), ref.quantize_rowwise(x, F8))
        nbytes = m * k * 3 + m * 4
        ao = lambda: (lambda: torchao_kernels()[0].triton_fp8_rowwise_2d_scale_and_cast(x, F8, round_scales_to_power_of_2=True))
        comp = lambda: (lambda f=torch.compile(ref.quantize_rowwise): f(x, F8))
        rows.append(row(f"({m}, {k})", nbytes, lambda: moe_fp8_ext.quantize_rowwise(x, F8), ao, comp))
        del x
    return print_table("quantize_rowwise (bf16 -> e4m3fn, pow2 scales)", HEADER, rows, "bench_rowwise.md")


def bench_experts(shapes):
    rows = []
    for e, k, n in shapes:
        # B_t as the transpose of an (E, N, K) weight, the layout an MoE layer holds.
        b_t = (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(1, 2)
        nbytes = e * k * n * 3
        for which, ao_name in (("fwd", "triton_fp8_colwise_3d_scale_and_cast"), ("bwd", "triton_fp8_rowwise_3d_transpose_rhs")):
            op = getattr(moe_fp8_ext, f"quantize_experts_{which}")
            spec = getattr(ref, f"quantize_experts_{which}")
            check(op(b_t, F8), spec(b_t, F8))
            ao = lambda: (lambda f=getattr(torchao_kernels()[0], ao_name): f(b_t, F8, round_scales_to_power_of_2=True))
            comp = lambda: (lambda f=torch.compile(spec): f(b_t, F8))
            rows.append(row(f"{which} ({e}, {k}, {n})", nbytes + e * (n if which == "fwd" else k) * 4, lambda: op(b_t, F8), ao, comp))
        del b_t
    return print_table("quantize_experts_fwd / _bwd (B_t = W^T, W (E, N, K) contiguous)", HEADER, rows, "bench_rowwise.md")


def bench_jagged(shapes):
    """Router-like group sizes, multiples of `align` rows (1: any sizes, so the groups'
    q runs start off the 8-byte grid)."""
    rows = []
    for m, k, n, g, align in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        go = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        offs = balanced_offs(m, g, alignment=align, device="cuda")
        check(moe_fp8_ext.quantize_jagged_colwise_dual(go, a, offs, F8), ref.quantize_jagged_colwise_dual(go, a, offs, F8))
        nbytes = m * (k + n) * 3 + g * (k + n) * 4
        ao = lambda: (lambda: torchao_kernels()[1].triton_fp8_per_group_colwise_scales_dual(go, a, offs, F8, round_scales_to_power_of_2=True))
        comp = lambda: (lambda f=torch.compile(ref.quantize_jagged_colwise_dual): f(go, a, offs, F8))
        shape = f"({m}, {k}, {n}, {g})" + (", any sizes" if align == 1 else "")
        rows.append(row(shape, nbytes, lambda: moe_fp8_ext.quantize_jagged_colwise_dual(go, a, offs, F8), ao, comp))
        del a, go
    return print_table("quantize_jagged_colwise_dual (grad_out (M, N), A (M, K), G groups)", HEADER, rows, "bench_rowwise.md")


def bench_dual(shapes):
    """Both operands of an experts layer's weights (quantize_experts_dual_cat) with its
    one-read kernel (the default L2 budget, tuning dual_l2_bytes="l2"; "forced": no L2
    limit, where "l2" takes the two ops) against the two ops and torchao's two 3-D
    kernels per weight."""
    rows = []
    header = ["weights (E, dim, hidden)", "dual µs", "GB/s", "% of copy", "forced µs", "two ops µs", "vs two ops",
              "torchao µs", "vs torchao"]
    for e, dim, hidden in shapes:
        w13 = [(torch.randn(e, hidden, dim, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(1, 2) for _ in range(2)]
        w2 = [(torch.randn(e, dim, hidden, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(1, 2)]
        for name, parts in (("W1+W3", w13), ("W2", w2)):
            cat = torch.cat(parts, dim=2)
            k, n = parts[0].shape[1], sum(p.shape[2] for p in parts)
            nbytes = e * k * n * 4 + e * (k + n) * 4  # bf16 in, two fp8 out, the scales
            times = {}
            for setting in ("l2", str(1 << 50)):
                with _tuning.override(dual_l2_bytes=setting):
                    out = moe_fp8_ext.quantize_experts_dual_cat(parts, F8)
                    check(out[:2], ref.quantize_experts_fwd(cat, F8))
                    check(out[2:], ref.quantize_experts_bwd(cat, F8))
                    del out
                    times[setting] = bench_us(lambda: moe_fp8_ext.quantize_experts_dual_cat(parts, F8))
            del cat
            t, forced = times["l2"], times[str(1 << 50)]
            two = bench_us(lambda: (moe_fp8_ext.quantize_experts_fwd_cat(parts, F8),
                                    moe_fp8_ext.quantize_experts_bwd_cat(parts, F8)))
            c = copy_us(nbytes)

            def ao_fn():
                kernels = torchao_kernels()[0]
                fns = (kernels.triton_fp8_colwise_3d_scale_and_cast, kernels.triton_fp8_rowwise_3d_transpose_rhs)
                return lambda: [f(b, F8, round_scales_to_power_of_2=True) for b in parts for f in fns]

            ao = try_peer(ao_fn)
            t_ao = bench_us(ao) if ao else None
            rows.append([f"{name} ({e}, {dim}, {hidden})", fmt(t), fmt(nbytes / t / 1e3, "{:.0f}"),
                         fmt(100 * c / t, "{:.0f}%"), fmt(forced), fmt(two), fmt(two / t, "{:.2f}x"), fmt(t_ao),
                         fmt(t_ao and t_ao / t, "{:.2f}x")])
        del w13, w2
    return print_table("quantize_experts_dual_cat (both operands of W1+W3 and of W2, one read)", header, rows,
                       "bench_rowwise.md")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="first shape of each table only")
    p.add_argument("--dual", action="store_true", help="the dual-orientation weight table only")
    args = p.parse_args()
    dual = [(8, 7168, 2048), (16, 5120, 1536), (64, 2048, 1408), (128, 2048, 768)]
    if args.dual:
        bench_dual(dual[:1] if args.quick else dual)
        return
    rowwise = [(16384, 7168), (16384, 2048), (65536, 7168), (131072, 2048)]
    experts = [(8, 7168, 2048), (16, 5120, 1536), (64, 2048, 1408)]
    jagged = [(16384, 7168, 2048, 8, 16), (32768, 5120, 1536, 16, 16), (65536, 2048, 1408, 64, 16),
              (65536, 2048, 1408, 64, 1)]
    if args.quick:
        rowwise, experts, jagged = rowwise[:1], experts[:1], jagged[:1]
    bench_rowwise(rowwise)
    bench_experts(experts)
    bench_jagged(jagged)
    bench_dual(dual[:1] if args.quick else dual)


if __name__ == "__main__":
    main()
