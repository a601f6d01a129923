"""The SwiGLU experts layer, forward + backward (DESIGN §10, issue 15's shapes):
bf16 (torchtitan's GroupedExperts math: three torch._grouped_mm calls, silu * mul, under
torch autograd), ours = moe_fp8_ext.experts (fp8_rowwise) without and with weight reuse
(4 micro-batches per optimizer step: the time is per micro-batch, the weights quantized
once), the previous way, three moe_fp8_ext.grouped_mm calls, and the peer: the same
torchtitan math with torchao 0.18's FP8 rowwise grouped GEMM in each of the three
calls (what torchtitan's FP8 MoE conversion runs). Peak memory of one fwd+bwd above
the weights, and the activation bytes saved for backward (x included: in a model the
layer's input is the permuted tokens, an activation only the layer keeps alive), bf16
vs ours; for both, x enters the step as a fresh tensor (a clone), as the permuted tokens
do, so a layer that does not save it lets it go after the forward. Eager; with --compile also
torch.compile'd (our layer runs as three grouped_mm calls under compile with torch <
2.13, see moe_fp8_ext.experts.COMPILE_COMPOSITE).

Correctness first: each shape's output and input gradient are checked against the
bf16 layer (SQNR) before timing. Run: python bench/bench_experts.py [--quick] [--compile]
[--recipe fp8_blockwise] (ours, reuse and the three grouped_mm calls in that recipe; the
torchao column stays its FP8 rowwise layer)
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import moe_fp8_ext
from moe_fp8_ext.experts import WeightCache, experts
from moe_fp8_ext.moe import balanced_offs

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import bench_us, fmt, peak_mib, print_table, sqnr, torchao_gmm, try_peer  # noqa: E402

SHAPES = [(32768, 7168, 2048, 8), (16384, 5120, 1536, 16), (65536, 2048, 1408, 64), (65536, 2048, 768, 128)]


def bf16_layer(x, w1, w3, w2, offs):
    """torchtitan 0.3.0 GroupedExperts.forward, without the module."""
    def mm(a, w):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    return mm(F.silu(mm(x, w1)) * mm(x, w3), w2)


def problem(m, d, h, e, seed=0):
    """One experts step on the GPU: x (m, d) and w1, w3 (e, h, d), w2 (e, d, h) bf16
    leaves (weights ~ N(0, 1/fan_in)), balanced group ends, an output gradient."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w1 = (torch.randn(e, h, d, device="cuda", dtype=torch.bfloat16, generator=g) * d ** -0.5).requires_grad_()
    w3 = (torch.randn(e, h, d, device="cuda", dtype=torch.bfloat16, generator=g) * d ** -0.5).requires_grad_()
    w2 = (torch.randn(e, d, h, device="cuda", dtype=torch.bfloat16, generator=g) * h ** -0.5).requires_grad_()
    offs = balanced_offs(m, e, device="cuda")
    grad = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, w1, w3, w2, offs, grad


def step_parser(doc):
    """The command line of the per-step scripts (scripts/profile_experts.py,
    scripts/memory_experts.py): a shape (tokens dim hidden experts) and --recipe."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("shape", nargs="*", type=int, default=[65536, 2048, 1408, 64])
    p.add_argument("--recipe", default="fp8_rowwise")
    return p


def steps(args):
    """{name: one forward + backward} for the bf16 module, ``args.recipe`` and (with
    ``args.reuse``) ``args.recipe`` with its quantized weights reused (a call that hits
    the cache for every weight: 3 of 4 micro-batches) on ``args.shape``, and the shape."""
    m, d, h, e = args.shape
    x, w1, w3, w2, offs, grad = problem(m, d, h, e)
    impls = {"bf16": bf16_layer, args.recipe: lambda *t: experts(*t, recipe=args.recipe)}
    if getattr(args, "reuse", False):
        cache = WeightCache()
        impls[args.recipe + ", weights reused"] = lambda *t: experts(*t, recipe=args.recipe, weight_cache=cache)
    return {name: (lambda fn=fn: torch.autograd.grad(fn(x, w1, w3, w2, offs), (x, w1, w3, w2), grad))
            for name, fn in impls.items()}, (m, d, h, e)


def torchao_layer(x, w1, w3, w2, offs):
    """torchtitan's GroupedExperts math on torchao's FP8 grouped GEMM."""
    gmm = torchao_gmm()

    def mm(a, w):
        return gmm(a, w.transpose(-2, -1), offs)
    return mm(F.silu(mm(x, w1)) * mm(x, w3), w2)


def three_grouped_mm(x, w1, w3, w2, offs, recipe="fp8_rowwise"):
    def mm(a, w):
        return moe_fp8_ext.grouped_mm(a, w.transpose(-2, -1), offs, recipe=recipe)
    return mm(F.silu(mm(x, w1)) * mm(x, w3), w2)


def saved_bytes(fn, *args):
    """Bytes of the tensors autograd keeps for backward (distinct storages, the weights
    and offs excluded; x counts: it is an activation)."""
    seen, inputs = {}, {a.untyped_storage().data_ptr() for a in args[1:] if isinstance(a, torch.Tensor)}

    def pack(t):
        p = t.untyped_storage().data_ptr()
        if p not in inputs:
            seen[p] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


HEADER = ["(tokens, dim, hidden, E)", "mode", "bf16 ms", "ours ms", "vs bf16", "reuse ms", "vs bf16", "3x grouped_mm ms",
          "vs bf16", "torchao ms", "vs bf16", "peak MiB bf16", "ours", "saved MiB bf16", "ours", "SQNR out", "SQNR dx"]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="the first shape only")
    p.add_argument("--compile", action="store_true", help="also torch.compile'd rows")
    p.add_argument("--shapes", default=None, help="indices into SHAPES, comma-separated (e.g. 1,2)")
    p.add_argument("--recipe", default="fp8_rowwise",
                   help="the recipe of ours, reuse and 3x grouped_mm (the torchao peer is its FP8 rowwise)")
    args = p.parse_args()
    recipe = args.recipe
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    rows = []
    for m, d, h, e in shapes:
        x, w1, w3, w2, offs, grad = problem(m, d, h, e)
        params = (x, w1, w3, w2)
        cache = WeightCache()
        impls = {
            "bf16": bf16_layer,
            "ours": lambda *a: experts(*a, recipe=recipe),
            "reuse": lambda *a: experts(*a, recipe=recipe, weight_cache=cache),
            "3x": lambda *a: three_grouped_mm(*a, recipe=recipe),
        }
        if try_peer(lambda: (lambda: torchao_layer(x, w1, w3, w2, offs))):
            impls["torchao"] = torchao_layer
        # correctness against the bf16 layer
        outs = {}
        for name in ("bf16", "ours"):
            out = impls[name](x, w1, w3, w2, offs)
            outs[name] = (out.detach(), torch.autograd.grad(out, x, grad)[0])
        q_out, q_dx = sqnr(outs["bf16"][0], outs["ours"][0]), sqnr(outs["bf16"][1], outs["ours"][1])
        assert q_out > 20 and q_dx > 20, (q_out, q_dx)
        del outs
        saved = {n: saved_bytes(impls[n], x.clone(), w1, w3, w2, offs) / 2**20 for n in ("bf16", "ours")}
        for mode in ("eager", "compiled") if args.compile else ("eager",):
            fns = impls if mode == "eager" else {
                n: torch.compile(f) for n, f in impls.items() if n != "reuse"}
            t, mem = {}, {}
            for name, f in fns.items():
                step = lambda f=f: torch.autograd.grad(f(x, w1, w3, w2, offs), params, grad)
                if name == "reuse":
                    # 4 micro-batches per optimizer step: every weight changes (its
                    # version counter moves, as an optimizer's in-place update moves it;
                    # no kernel, so the update's own cost is not timed) every 4th call,
                    # so 1 in 4 requantizes every weight.
                    def step4(step=step):
                        for w in (w1, w3, w2):
                            torch.autograd.graph.increment_version(w)
                        for _ in range(4):
                            step()
                    t[name] = bench_us(step4) / 4 / 1000
                else:
                    t[name] = bench_us(step) / 1000
                    mem[name] = peak_mib(lambda f=f: torch.autograd.grad(f(x.clone(), w1, w3, w2, offs), params, grad))
            rows.append([f"({m}, {d}, {h}, {e})", mode, fmt(t["bf16"], "{:.2f}"), fmt(t["ours"], "{:.2f}"),
                         fmt(t["bf16"] / t["ours"], "{:.2f}x"), fmt(t.get("reuse"), "{:.2f}"),
                         fmt(t.get("reuse") and t["bf16"] / t["reuse"], "{:.2f}x"), fmt(t["3x"], "{:.2f}"),
                         fmt(t["bf16"] / t["3x"], "{:.2f}x"), fmt(t.get("torchao"), "{:.2f}"),
                         fmt(t.get("torchao") and t["bf16"] / t["torchao"], "{:.2f}x"),
                         fmt(mem["bf16"], "{:.0f}"), fmt(mem["ours"], "{:.0f}"),
                         fmt(saved["bf16"], "{:.0f}"), fmt(saved["ours"], "{:.0f}"), fmt(q_out), fmt(q_dx)])
        del x, w1, w3, w2, grad, cache, impls
        torch.cuda.empty_cache()
    print_table(f"SwiGLU experts fwd+bwd: bf16 (torchtitan math) vs moe_fp8_ext.experts ({recipe})", HEADER, rows,
                "bench_experts.md" if recipe == "fp8_rowwise" else f"bench_experts_{recipe}.md")


if __name__ == "__main__":
    main()
