"""The user's path: torchtitan 0.3.0's own ``GroupedExperts`` and ``MoE`` modules, bf16,
converted by moe_fp8_ext (``integrations.torchtitan.convert``), and torchtitan's own FP8
path (torchao's Float8 grouped GEMMs, whose token groups torchtitan pads to 16 rows).

A step is the forward and ``out.backward(grad)`` (a loss's backward) into the
parameters' ``.grad``, as after an optimizer step (the weights' version counters move):
"fresh" sets every ``.grad`` to None first (one micro-batch a step), "accum" is the time
per micro-batch of four that add into ``.grad`` in place. "+reuse" rows convert with
``reuse_weights=True`` (each weight quantized once a step). In the MoE table, converting
also swaps the layer's token dispatcher for ``OnePassTokenDispatcher`` (x's gradient rows
summed in one pass, the bits of torchtitan's index_put backward; the combine in one pass
each way, the bits of torchtitan's on CUDA); "bf16+dispatcher" is torchtitan's bf16
layer with only that dispatcher: the part of the gain that is not FP8's. "+shared" rows
convert the layer's shared experts too (``shared_experts=True``), and "+dispatch" rows
dispatch in fp8 (``fp8_dispatch=True``: each token quantized once and its fp8 rows
gathered).
Token groups are a
router's: unaligned sizes drawn around tokens/experts (the MoE table routes real tokens
through torchtitan's router). Peak is the most memory one fresh step allocates above
what was allocated before it (activations, operands and the new gradients). The
``autograd.grad`` column times ``torch.autograd.grad`` of the same step (no ``.grad``).
With --swiglu-ab, fp8_blockwise also runs without its GEMMs' SwiGLU and dSwiGLU epilogues.
--stack L times fresh steps of L MoE layers in a row (a model's step, which holds every
layer's saved activations at once), each recipe also with ``hold_weight_operands=True``.
Variants are timed in alternating rounds. Eager, and with --compile torch.compile'd
modules (fullgraph, as torchtitan compiles its blocks) at the --compile-shapes, and the
MoE layer's bf16 and fp8-dispatch variants. Each shape is checked first: ours against
bf16 by SQNR.

    python bench/bench_experts.py [--quick] [--compile] [--moe] [--shapes 0,2]

Prints tables and writes $OUT/bench_experts.json (--profile: profile_experts.json;
--fused-accumulation, --stack: bench_experts_fused_accumulation.json,
bench_experts_stack.json); bench/report.py renders RESULTS.md from them.
"""

import argparse
import copy
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (bench_interleaved_us, copy_us, fmt, peak_mib, print_table, profile_step, sqnr,  # noqa: E402
                    write_json)

from moe_fp8_ext.recipes import Fp8Blockwise  # noqa: E402
from moe_fp8_ext.token_groups import router_counts  # noqa: E402

EXPERTS_SHAPES = [(32768, 7168, 2048, 8), (16384, 5120, 1536, 16), (65536, 2048, 1408, 64), (65536, 2048, 768, 128)]
MOE_SHAPES = [(16384, 2048, 1408, 64, 6), (8192, 7168, 2048, 32, 8)]  # tokens, dim, hidden, experts, top-k
RECIPES = ("fp8_rowwise", "fp8_blockwise")
DEVICE = "cuda"  # --smoke: "cpu", tiny shapes, one timed call (a check of the script, not a benchmark)


def padded(counts: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    return (counts + multiple - 1) // multiple * multiple


def torchao_fp8(module: torch.nn.Module) -> torch.nn.Module:
    """torchtitan's Float8GroupedExperts conversion of a GroupedExperts (torchao)."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization.quant_api import quantize_
    from torchtitan.models.common.moe import GroupedExperts

    quantize_(module, config=Float8TrainingOpConfig(), filter_fn=lambda m, _fqn: isinstance(m, GroupedExperts))
    return module


def grouped_experts(dim, hidden, experts, seed=0):
    from torchtitan.models.common.moe import GroupedExperts

    module = GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts).build()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return module.to(device=DEVICE, dtype=torch.bfloat16)


MICRO = 4  # micro-batches an optimizer step in the accumulating step


def steps_of(module, args, grad, mode):
    """(fresh step, accumulating step of MICRO micro-batches, autograd.grad step) of
    ``module(*args)``. Each starts as after an optimizer step: the parameters' version
    counters move (what an in-place update does, without its kernel), so a weight cache
    misses once a step."""
    params = [p for p in module.parameters() if p.requires_grad]
    x = args[0]

    def stepped():
        for p in params:
            torch.autograd.graph.increment_version(p)

    def fresh():
        stepped()
        for t in params + [x]:
            t.grad = None
        module(*args).backward(grad)

    def accum():
        stepped()
        for _ in range(MICRO):
            module(*args).backward(grad)

    def agrad():
        stepped()
        torch.autograd.grad(module(*args), params + [x], grad)

    return fresh, accum, agrad


def peak_step_mib(step) -> float:
    if DEVICE == "cpu":
        step()
        return float("nan")
    return peak_mib(step)


def once_us(fns):
    import time

    ts = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return ts, None


def timed_us(fns):
    """(µs of each, ratios): fns timed in alternating rounds on a GPU, once each on the CPU (--smoke)."""
    return bench_interleaved_us(fns) if DEVICE == "cuda" else once_us(fns)


def measure(variants, mode):
    """{name: (fresh ms, accum ms, autograd.grad ms, peak MiB)} for {name: (module, args, grad)}."""
    fns = {n: steps_of(m, a, g, mode) for n, (m, a, g) in variants.items()}
    for n in list(fns):
        try:
            fns[n][0]()  # warm-up (and compile)
        except Exception as ex:  # one variant that cannot run (a peer under compile) must not stop the rest
            if n == "bf16":
                raise
            print(f"  ({n}, {mode}: {type(ex).__name__}: {str(ex).splitlines()[0][:160]})", flush=True)
            del fns[n]
    names = list(fns)
    peak = {}
    for n in names:
        for p in variants[n][0].parameters():
            p.grad = None
        variants[n][1][0].grad = None
        peak[n] = peak_step_mib(fns[n][0])
    fresh, _ = timed_us([fns[n][0] for n in names])
    for n in names:
        fns[n][1]()  # .grad exists from here on
    accum, _ = timed_us([fns[n][1] for n in names])
    accum = [t / MICRO for t in accum]
    agrad, _ = timed_us([fns[n][2] for n in names])
    for m, a, _ in variants.values():
        for p in m.parameters():
            p.grad = None
        a[0].grad = None
    return {n: (fresh[i] / 1e3, accum[i] / 1e3, agrad[i] / 1e3, peak[n]) for i, n in enumerate(names)}


def rows_of(shape, mode, res, checks):
    base = res["bf16"]
    rows, records = [], []
    for name, (fresh, accum, agrad, peak) in res.items():
        rows.append([shape, mode, name, fmt(fresh, "{:.2f}"), fmt(base[0] / fresh, "{:.2f}x"), fmt(accum, "{:.2f}"),
                     fmt(base[1] / accum, "{:.2f}x"), fmt(agrad, "{:.2f}"), fmt(base[2] / agrad, "{:.2f}x"),
                     fmt(peak, "{:.0f}"), fmt(peak / base[3], "{:.2f}x"), checks.get(name, "")])
        records.append(dict(shape=shape, mode=mode, variant=name, fresh_ms=fresh, accum_ms=accum, autograd_grad_ms=agrad,
                            peak_mib=peak, fresh_vs_bf16=base[0] / fresh, accum_vs_bf16=base[1] / accum,
                            autograd_grad_vs_bf16=base[2] / agrad, peak_vs_bf16=peak / base[3], check=checks.get(name)))
    return rows, records


def compiled(variants):
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"  # (--smoke checks the script, not the speed)
    return {n: (torch.compile(m, fullgraph=True, backend=backend), a, g) for n, (m, a, g) in variants.items()}


@dataclasses.dataclass(frozen=True)
class ComposedSwiglu(Fp8Blockwise):
    """fp8_blockwise with the GEMMs, then the SwiGLU kernels: the A/B of its (d)SwiGLU epilogues (--swiglu-ab)."""

    def swiglu_in_gemm(self, hidden_dim, device):
        return False


def experts_problem(m, d, h, e):
    """One experts shape's router counts, x (with a gradient), the output's gradient, their generator (for more
    draws) and torchtitan's bf16 module."""
    counts = router_counts(m, e).to(DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(m, d, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_()
    grad = torch.randn(m, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
    return counts, x, grad, g, grouped_experts(d, h, e)


def bench_grouped_experts(shapes, modes, peer, compile_shapes=(), swiglu_ab=False):
    from moe_fp8_ext.integrations.torchtitan import convert

    rows, records = [], []
    for m, d, h, e in shapes:
        counts, x, grad, g, bf16 = experts_problem(m, d, h, e)
        variants = {"bf16": (bf16, (x, counts), grad)}
        for r in RECIPES:
            for reuse in (False, True):
                mod = copy.deepcopy(bf16)
                convert(mod, r, reuse_weights=reuse)
                variants[r + ("+reuse" if reuse else "")] = (mod, (x, counts), grad)
        if swiglu_ab:
            mod = copy.deepcopy(bf16)
            convert(mod, ComposedSwiglu())
            variants["fp8_blockwise (composed SwiGLU)"] = (mod, (x, counts), grad)
        if peer:
            try:  # torchao needs groups of multiples of 16: the padded rows torchtitan's dispatcher adds
                pc = padded(counts)
                xp = torch.randn(int(pc.sum()), d, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_()
                gp = torch.randn(xp.shape, device=DEVICE, dtype=torch.bfloat16, generator=g)
                variants["torchao fp8 (padded)"] = (torchao_fp8(copy.deepcopy(bf16)), (xp, pc), gp)
                variants["torchao fp8 (padded)"][0](xp, pc).sum().backward()
            except Exception as ex:  # a peer that cannot run must not stop our numbers
                print(f"  (torchao peer unavailable: {type(ex).__name__}: {str(ex).splitlines()[0][:120]})")
                variants.pop("torchao fp8 (padded)", None)
        with torch.no_grad():
            want = bf16(x, counts)
            checks = {r: f"{sqnr(want, variants[r][0](x, counts)):.1f} dB" for r in variants if r not in ("bf16",)
                      and not r.startswith("torchao")}
        for mode in modes:
            if mode == "compiled" and (m, d, h, e) not in compile_shapes:
                continue
            chosen = variants if mode == "eager" else {n: v for n, v in variants.items() if "+reuse" not in n}
            res = measure(compiled(chosen) if mode == "compiled" else chosen, mode)
            rw, rec = rows_of(f"({m}, {d}, {h}, {e})", mode, res, checks)
            rows += rw
            records += rec
            print("\n".join(" | ".join(r) for r in rw), flush=True)
        del variants, bf16, x, grad
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows, records


def bench_fused_accumulation(shapes):
    """A micro-batch into fp32 main gradients (Megatron's scheme; ``GroupedExperts(fuse_grad_accumulation=True)``):
    torchtitan's bf16 module and our fp8 layers writing bf16 ``.grad`` then adding it to ``main_grad``, against the
    fp8 recipes adding to ``main_grad`` inside their weight-gradient GEMMs. The step's time and peak (above the
    weights and main gradients)."""
    from moe_fp8_ext import GroupedExperts

    rows = []
    for m, d, h, e in shapes:
        counts, x, grad, g, bf16 = experts_problem(m, d, h, e)
        mods = {"bf16 (torchtitan), .grad then main_grad +=": bf16}
        for recipe, fuse in ((r, f) for r in ("fp8_blockwise", "fp8_rowwise") for f in (False, True)):
            name = f"{recipe}, fused" if fuse else f"{recipe}, .grad then main_grad +="
            mod = GroupedExperts(d, h, e, recipe=recipe, dtype=torch.bfloat16, device=DEVICE,
                                 fuse_grad_accumulation=fuse)
            with torch.no_grad():
                for n, t in (("w1", "w1_EFD"), ("w2", "w2_EDF"), ("w3", "w3_EFD")):  # (torchtitan's names)
                    getattr(mod, n).copy_(getattr(bf16, t))
            mods[name] = mod
        for mod in mods.values():
            for p in mod.parameters():
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=DEVICE)

        def step(mod, fused, x=x, counts=counts, grad=grad):
            x.grad = None
            mod(x, counts).backward(grad)
            if not fused:
                for p in mod.parameters():
                    p.main_grad.add_(p.grad)
                    p.grad = None

        fns = [lambda mod=mod, n=n: step(mod, n.endswith("fused")) for n, mod in mods.items()]
        for fn in fns:
            fn()
        peaks = [peak_step_mib(fn) for fn in fns]
        times, _ = timed_us(fns)
        for i, name in enumerate(mods):
            unfused = i - 1 if name.endswith("fused") else i  # (the same recipe's unfused row)
            rows.append(dict(shape=f"({m}, {d}, {h}, {e})", variant=name, step_ms=times[i] / 1e3,
                             vs_bf16=times[0] / times[i], vs_unfused=times[unfused] / times[i], peak_mib=peaks[i],
                             peak_vs_bf16=peaks[i] / peaks[0]))
            print(" | ".join(str(v) if not isinstance(v, float) else f"{v:.2f}" for v in rows[-1].values()), flush=True)
        del mods, bf16, x, grad, fns
        torch.cuda.empty_cache()
    return rows


def moe_layer(tokens, dim, hidden, experts, top_k, converter=None, seed=0):
    from moe_fp8_ext.integrations.torchtitan import build_moe

    return build_moe(dim, hidden, experts, top_k, device=DEVICE, seed=seed, all_to_all=True, converter=converter)


COMPILED_MOE = ("bf16", "bf16+dispatcher", "fp8_rowwise", "fp8_blockwise", "fp8_rowwise+dispatch",
                "fp8_blockwise+dispatch")


def bench_moe(shapes, modes, peer):
    from moe_fp8_ext.integrations.torchtitan import ExpertsConverter, OnePassTokenDispatcher

    rows, records = [], []
    for t, d, h, e, k in shapes:
        g = torch.Generator(device=DEVICE).manual_seed(1)
        x = torch.randn(1, t, d, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_()
        grad = torch.randn(1, t, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
        variants = {"bf16": (moe_layer(t, d, h, e, k), (x,), grad)}
        bf16_ours = moe_layer(t, d, h, e, k)
        bf16_ours.routed_experts.token_dispatcher.__class__ = OnePassTokenDispatcher  # (an all-to-all one)
        variants["bf16+dispatcher"] = (bf16_ours, (x,), grad)
        for r in RECIPES:  # (+shared: shared_experts=True; +dispatch: fp8_dispatch=True)
            variants[r] = (moe_layer(t, d, h, e, k, ExpertsConverter.Config(recipe=r)), (x,), grad)
            variants[r + "+shared"] = (moe_layer(t, d, h, e, k, ExpertsConverter.Config(recipe=r, shared_experts=True)),
                                       (x,), grad)
            variants[r + "+dispatch"] = (moe_layer(t, d, h, e, k, ExpertsConverter.Config(recipe=r, fp8_dispatch=True)),
                                         (x,), grad)
        if peer:
            try:
                from torchtitan.components.quantization import Float8GroupedExpertsConverter

                variants["torchao fp8"] = (moe_layer(t, d, h, e, k, Float8GroupedExpertsConverter.Config()), (x,), grad)
                variants["torchao fp8"][0](x).sum().backward()
            except Exception as ex:
                print(f"  (torchao peer unavailable: {type(ex).__name__}: {str(ex).splitlines()[0][:120]})")
                variants.pop("torchao fp8", None)
        with torch.no_grad():
            want = variants["bf16"][0](x)
            checks = {r: f"{sqnr(want, variants[r][0](x)):.1f} dB" for r in variants if r.startswith(RECIPES)}
        for mode in modes:
            if mode == "compiled":  # (as torchtitan compiles: scalar outputs captured; fewer variants, each compiles)
                torch._dynamo.config.capture_scalar_outputs = True
                res = measure(compiled({n: v for n, v in variants.items() if n in COMPILED_MOE}), mode)
            else:
                res = measure(variants, mode)
            rw, rec = rows_of(f"({t}, {d}, {h}, {e}, top-{k})", mode, res, checks)
            rows += rw
            records += rec
            print("\n".join(" | ".join(r) for r in rw), flush=True)
        del variants, x, grad
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows, records


class MoEStack(torch.nn.Module):
    """Layers of torchtitan's MoE, pre-norm with residuals (x + moe(rms_norm(x))): a decoder
    without attention, whose step holds every layer's saved activations at once, as a model's does."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(torch.nn.functional.rms_norm(x, x.shape[-1:]))
        return x


def bench_stack(shapes, layers):
    """``layers`` MoE layers in a row (copies of one layer, weights drawn again on the device):
    bf16, each recipe, and each with ``hold_weight_operands=True`` (the weights' backward
    operands saved from the forward, not quantized again), all with torchtitan's token
    dispatcher (the experts' share alone). Fresh steps and their peak."""
    from moe_fp8_ext.integrations.torchtitan import convert
    from moe_fp8_ext.recipes import get_recipe

    rows, records = [], []
    for t, d, h, e, k in shapes:
        g = torch.Generator(device=DEVICE).manual_seed(1)
        x = torch.randn(1, t, d, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_()
        grad = torch.randn(1, t, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
        layer = moe_layer(t, d, h, e, k)
        bf16 = MoEStack([copy.deepcopy(layer) for _ in range(layers)])
        del layer
        with torch.no_grad():
            for p in bf16.parameters():
                p.copy_(torch.randn(p.shape, device=DEVICE, dtype=p.dtype, generator=g) * p.shape[-1] ** -0.5)
        variants = {"bf16": bf16}
        for r in RECIPES:
            hold = dataclasses.replace(get_recipe(r), hold_weight_operands=True)
            for name, recipe in ((r, r), (r + "+hold", hold)):
                variants[name] = copy.deepcopy(bf16)
                convert(variants[name], recipe, torchtitan_dispatcher=True)
        with torch.no_grad():
            want = bf16(x)
            checks = {n: f"{sqnr(want, m(x)):.1f} dB" for n, m in variants.items() if n != "bf16"}
        fresh = {n: steps_of(m, (x,), grad, "eager")[0] for n, m in variants.items()}
        peak = {}
        for n, fn in fresh.items():
            fn()  # warm-up
            peak[n] = peak_step_mib(fn)
        times, _ = timed_us(list(fresh.values()))
        base = dict(zip(fresh, times))["bf16"], peak["bf16"]
        for (n, t_us) in zip(fresh, times):
            rec = dict(shape=f"{layers} x ({t}, {d}, {h}, {e}, top-{k})", variant=n, fresh_ms=t_us / 1e3,
                       fresh_vs_bf16=base[0] / t_us, peak_mib=peak[n], peak_vs_bf16=peak[n] / base[1],
                       check=checks.get(n))
            records.append(rec)
            rows.append([rec["shape"], n, fmt(rec["fresh_ms"], "{:.2f}"), fmt(rec["fresh_vs_bf16"], "{:.2f}x"),
                         fmt(peak[n], "{:.0f}"), fmt(rec["peak_vs_bf16"], "{:.2f}x"), checks.get(n, "")])
            print(" | ".join(rows[-1]), flush=True)
        del variants, bf16, fresh, x, grad
        torch.cuda.empty_cache()
    return rows, records


def copy_tbs(total_bytes=2 << 30):
    """The device's copy bandwidth, TB/s of bytes read + written (a memory-bound kernel's ceiling)."""
    if DEVICE != "cuda":
        return 1.0  # --smoke: any positive figure
    return total_bytes / copy_us(total_bytes) / 1e6


def fusion_bytes(m, h):
    """The most bytes DESIGN §13's epilogue fusions remove from a step of m rows and hidden h: the forward's h13
    read-back and the backward's grad_h write and read (bf16), and h13 saved in fp8 instead of bf16 (write, read)."""
    return 2 * (m * 2 * h * 2) + 2 * (m * h * 2) + 2 * (m * 2 * h)


def profile_summary(m, h, res, bf16_ms, tbs):
    """A variant's step split into GEMMs and memory-bound work, and the ratios to bf16 that would follow with no
    memory-bound work at all (GEMM-only) and with §13's fusions removing their bytes at copy bandwidth."""
    gemm = sum(v for k, v in res["families"].items() if "GEMM" in k)
    rest = res["total_ms"] - gemm
    fused = res["total_ms"] - (fusion_bytes(m, h) / (tbs * 1e12) * 1e3 if res["variant"] != "bf16" else 0.0)
    return dict(shape=res["shape"], variant=res["variant"], step_ms=round(res["total_ms"], 3), gemm_ms=round(gemm, 3),
                memory_bound_ms=round(rest, 3), memory_bound_share=round(rest / res["total_ms"], 3),
                vs_bf16=round(bf16_ms / res["total_ms"], 3), gemm_only_vs_bf16=round(bf16_ms / gemm, 3),
                fusion_bound_vs_bf16=round(bf16_ms / fused, 3))


def profile_experts(shapes, swiglu_ab=False):
    """The per-kernel profile of a fresh user-path step, bf16 and each recipe, and its split into GEMMs and
    memory-bound work (issue 69's profile table)."""
    from moe_fp8_ext.integrations.torchtitan import convert

    out, steps, tbs = [], [], copy_tbs()
    for m, d, h, e in shapes:
        counts = router_counts(m, e).to(DEVICE)
        x = torch.randn(m, d, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
        grad = torch.randn(m, d, device=DEVICE, dtype=torch.bfloat16)
        bf16 = grouped_experts(d, h, e)
        recipes = {r: r for r in RECIPES}
        if swiglu_ab:
            recipes["fp8_blockwise (composed SwiGLU)"] = ComposedSwiglu()
        bf16_ms = None  # (bf16 first)
        for name in ("bf16",) + tuple(recipes):
            mod = bf16 if name == "bf16" else copy.deepcopy(bf16)
            if name != "bf16":
                convert(mod, recipes[name])
            res = profile_step(f"({m}, {d}, {h}, {e}) {name}", steps_of(mod, (x, counts), grad, "eager")[0])
            out.append(dict(shape=f"({m}, {d}, {h}, {e})", variant=name, **res))
            bf16_ms = bf16_ms or res["total_ms"]
            steps.append(profile_summary(m, h, out[-1], bf16_ms, tbs))
            del mod
        del bf16, x, grad
        torch.cuda.empty_cache()
    return dict(device=dict(copy_tbs=round(tbs, 2)), steps=steps, kernels=out)


HEADER = ["shape", "mode", "variant", "fresh ms", "vs bf16", "accum ms", "vs bf16", "autograd.grad ms", "vs bf16",
          "peak MiB", "vs bf16", "SQNR out"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the first shape of each table only")
    p.add_argument("--compile", action="store_true", help="also torch.compile'd modules")
    p.add_argument("--compile-shapes", default="0,3", help="the experts shapes compiled too (indices)")
    p.add_argument("--moe", action="store_true", help="only the MoE-layer table")
    p.add_argument("--experts", action="store_true", help="only the GroupedExperts table")
    p.add_argument("--shapes", default=None, help="indices into the experts shapes, comma-separated")
    p.add_argument("--no-peer", action="store_true", help="without torchtitan's torchao FP8 path")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, one call each: checks the script")
    p.add_argument("--profile", action="store_true", help="only the per-kernel profile of a fresh experts step")
    p.add_argument("--fused-accumulation", action="store_true",
                   help="only the micro-batch into fp32 main gradients, fused (fuse_grad_accumulation) and not")
    p.add_argument("--stack", type=int, default=0, metavar="L",
                   help="only L MoE layers in a row (a model's saved activations), the recipes with and without "
                        "held weight operands (+hold)")
    p.add_argument("--swiglu-ab", action="store_true",
                   help="also fp8_blockwise without the SwiGLU and dSwiGLU epilogues (Recipe.swiglu_in_gemm)")
    args = p.parse_args()
    if args.smoke:
        global DEVICE, EXPERTS_SHAPES, MOE_SHAPES
        DEVICE, EXPERTS_SHAPES, MOE_SHAPES = "cpu", [(300, 128, 128, 4)], [(200, 128, 128, 8, 2)]
        args.compile_shapes = "0"
        args.no_peer = True
    modes = ("eager", "compiled") if args.compile else ("eager",)
    shapes = EXPERTS_SHAPES[:1] if args.quick else EXPERTS_SHAPES
    if args.shapes:
        shapes = [EXPERTS_SHAPES[int(i)] for i in args.shapes.split(",")]
    out = {}
    if args.profile:
        write_json("profile_experts", profile_experts(shapes, args.swiglu_ab), sys.argv)
        return
    if args.fused_accumulation:
        rows = bench_fused_accumulation(shapes)
        print_table("a micro-batch into fp32 main gradients: .grad then an add, against the add in the GEMM",
                    list(rows[0]), [[f"{v:.2f}" if isinstance(v, float) else v for v in r.values()] for r in rows],
                    "bench_experts.md")
        write_json("bench_experts_fused_accumulation", {"fused_accumulation": rows}, sys.argv)
        return
    if args.stack:
        rows, out["stack"] = bench_stack(MOE_SHAPES[:1] if args.quick else MOE_SHAPES[::-1], args.stack)
        print_table(f"{args.stack} torchtitan MoE layers in a row, fwd + backward into .grad (fresh)",
                    ["shape", "variant", "fresh ms", "vs bf16", "peak MiB", "vs bf16", "SQNR out"], rows,
                    "bench_experts.md")
        write_json("bench_experts_stack", out, sys.argv)
        return
    if not args.moe:
        compile_shapes = [EXPERTS_SHAPES[int(i)] for i in args.compile_shapes.split(",")] if args.compile else []
        rows, out["grouped_experts"] = bench_grouped_experts(shapes, modes, not args.no_peer, compile_shapes,
                                                          args.swiglu_ab)
        print_table("torchtitan GroupedExperts, fwd + backward into .grad: bf16 vs converted", HEADER, rows,
                    "bench_experts.md")
    if not args.experts:
        rows, out["moe"] = bench_moe(MOE_SHAPES[:1] if args.quick else MOE_SHAPES, modes, not args.no_peer)
        print_table("torchtitan MoE layer (router, dispatcher, experts, shared experts), fwd + backward into .grad",
                    HEADER, rows, "bench_experts.md")
    write_json("bench_experts", out, sys.argv)


if __name__ == "__main__":
    main()
