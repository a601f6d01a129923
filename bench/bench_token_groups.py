"""Token groups: pad / unpad (µs, GB/s, % of a copy of the same bytes) beside torchao's
pad helpers, permute_indices beside torchao's (torchtitan's) Triton index builder,
and grouped_mm with unaligned groups against aligned ones (the cost of padding).

Correctness first: every result is compared with the reference before timing.
Run: python bench/bench_token_groups.py [--quick]
"""

import argparse
import sys

import torch

import moe_fp8_ext
from moe_fp8_ext import reference as ref

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import bench_us, copy_us, fmt, linear_problem, print_table, try_peer  # noqa: E402

ALIGN = 16


def router_offs(tokens, groups, gen):
    """Unaligned, router-like group ends summing to tokens (some groups empty when
    there are many)."""
    w = torch.rand(groups, generator=gen) + 0.3
    sizes = (w / w.sum() * tokens).floor().long()
    sizes[-1] += tokens - int(sizes.sum())
    return torch.cumsum(sizes, 0).to(torch.int32).cuda()


def bench_pad(shapes):
    rows = []
    gen = torch.Generator().manual_seed(0)
    for tokens, d, g in shapes:
        x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
        offs = router_offs(tokens, g, gen)
        xp, starts, ends = moe_fp8_ext.pad_token_groups(x, offs, ALIGN)
        rxp, _, _ = ref.pad_token_groups(x, offs, ALIGN)
        assert torch.equal(xp, rxp), "pad differs from the reference"
        assert torch.equal(moe_fp8_ext.unpad_token_groups(xp, offs, starts, tokens), x), "unpad is not the inverse"
        es = x.element_size()
        pad_bytes = (tokens + xp.shape[0]) * d * es  # read every token, write every padded row
        unpad_bytes = 2 * tokens * d * es
        t_pad = bench_us(lambda: moe_fp8_ext.pad_token_groups(x, offs, ALIGN))
        t_unpad = bench_us(lambda: moe_fp8_ext.unpad_token_groups(xp, offs, starts, tokens))
        c_pad, c_unpad = copy_us(pad_bytes), copy_us(unpad_bytes)

        def ao_pad():
            from torchao.prototype.moe_training.kernels.mxfp8.quant import torch_pad_token_groups

            return lambda: torch_pad_token_groups(x, offs, ALIGN)

        def ao_unpad():
            from torchao.prototype.moe_training.kernels.mxfp8.quant import torch_unpad_token_groups

            return lambda: torch_unpad_token_groups(xp, offs, starts, tokens, ALIGN)

        def ao_fused():
            from torchao.prototype.moe_training.kernels.mxfp8.quant import fused_pad_token_groups_cuda

            return lambda: fused_pad_token_groups_cuda(x, offs, ALIGN)

        peers = {}
        for name, make in (("ao_pad", ao_pad), ("ao_unpad", ao_unpad), ("ao_fused", ao_fused)):
            fn = try_peer(make)
            peers[name] = bench_us(fn) if fn else None
        rows.append([
            f"{tokens}x{d}, G={g}",
            f"{t_pad:.1f}", f"{pad_bytes / t_pad / 1e3:.0f}", f"{100 * c_pad / t_pad:.0f}%",
            f"{t_unpad:.1f}", f"{unpad_bytes / t_unpad / 1e3:.0f}", f"{100 * c_unpad / t_unpad:.0f}%",
            fmt(peers["ao_pad"]), fmt(peers["ao_fused"]), fmt(peers["ao_unpad"]),
        ])
        del x, xp, rxp
    print_table(
        f"pad_token_groups / unpad_token_groups (bf16, alignment {ALIGN}, unaligned router-like groups)",
        ["tokens x D, G", "pad µs", "GB/s", "% copy", "unpad µs", "GB/s", "% copy",
         "torchao pad µs (syncs)", "torchao fused pad µs", "torchao unpad µs (syncs)"],
        rows, "token_groups.md",
    )


def bench_permute(cases, tokens_per_rank):
    rows = []
    gen = torch.Generator().manual_seed(1)
    for ranks, experts in cases:
        w = torch.rand(ranks * experts, generator=gen) + 0.2
        counts = (w / w.sum() * tokens_per_rank).floor().to(torch.int32)
        m = int(counts.sum())
        counts = counts.cuda()
        max_len = moe_fp8_ext.padded_rows(m, experts, ALIGN)
        got = moe_fp8_ext.permute_indices(counts, experts, ranks, ALIGN, max_len)
        want = ref.permute_indices(counts.cpu(), experts, ranks, ALIGN, max_len)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want)), "permute_indices differs from the reference"
        t = bench_us(lambda: moe_fp8_ext.permute_indices(counts, experts, ranks, ALIGN, max_len))

        def ao():
            from torchao.prototype.moe_training.ep.kernels import generate_permute_indices

            return lambda: generate_permute_indices(counts, experts, ranks, max_len, ALIGN)

        fn = try_peer(ao)
        t_ao = bench_us(fn) if fn else None
        rows.append([f"{ranks} x {experts}", str(m), f"{t:.1f}", fmt(t_ao), fmt(t_ao / t if t_ao else None, "{:.1f}x")])
    print_table(
        "permute_indices (one launch, no sync) vs torchao generate_permute_indices",
        ["ranks x experts/rank", "tokens", "ours µs", "torchao µs", "speedup"], rows, "token_groups.md",
    )


def bench_unaligned_gmm(shapes):
    rows = []
    gen = torch.Generator().manual_seed(2)
    for m, k, n, e in shapes:
        a, w, aligned, grad = linear_problem(m, k, n, e)
        unaligned = router_offs(m, e, gen)

        def explicit(a, b_t, offs):
            ap, starts, ends = moe_fp8_ext.pad_token_groups(a, offs, ALIGN)
            return moe_fp8_ext.unpad_token_groups(moe_fp8_ext.grouped_mm(ap, b_t, ends, pad_groups=False), offs, starts, m)

        variants = {
            "aligned, pad_groups=False": (aligned, lambda a, b, o: moe_fp8_ext.grouped_mm(a, b, o, pad_groups=False)),
            "aligned, pad_groups=True": (aligned, lambda a, b, o: moe_fp8_ext.grouped_mm(a, b, o)),
            "unaligned, pad_groups=True": (unaligned, lambda a, b, o: moe_fp8_ext.grouped_mm(a, b, o)),
            "unaligned, pad+unpad copies": (unaligned, explicit),
        }
        t = {}
        for name, (offs, f) in variants.items():
            step = lambda f=f, offs=offs: f(a, w.transpose(1, 2), offs).backward(grad)
            t[name] = bench_us(step, warmup_ms=50, rep_ms=300) / 1000
        base = t["aligned, pad_groups=False"]
        for name, v in t.items():
            rows.append([f"{m}x{k}x{n}, E={e}", name, f"{v:.3f}", f"{100 * (v / base - 1):+.1f}%"])
        a.grad = w.grad = None
    print_table(
        "grouped_mm fp8 forward+backward: unaligned groups vs aligned",
        ["M x K x N, E", "groups", "ms", "vs aligned"], rows, "token_groups.md",
    )


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="one shape per table")
    args = p.parse_args()
    pads = [(16384, 7168, 8), (16384, 2048, 64), (131072, 2048, 8), (32768, 5120, 300)]
    perms = [(8, 8), (8, 32), (64, 4)]
    gmms = [(16384, 7168, 2048, 8), (32768, 5120, 1536, 16), (65536, 2048, 1408, 64)]
    if args.quick:
        pads, perms, gmms = pads[:1], perms[1:2], gmms[:1]
    bench_pad(pads)
    bench_permute(perms, tokens_per_rank=16384 * 8)
    bench_unaligned_gmm(gmms)


if __name__ == "__main__":
    main()
