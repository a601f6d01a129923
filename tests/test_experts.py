"""The SwiGLU experts layer (moe_fp8_ext.experts, GroupedExperts; DESIGN §10) on the
CPU (emulated GEMMs) and, when there is one, the GPU: numerics against an fp32
autograd reference, the same math as three grouped_mm calls, token-group edge cases,
weight reuse and its invalidation, torch.compile, and bad arguments."""

import contextlib
import dataclasses
import functools
import importlib
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import moe_fp8_ext
from moe_fp8_ext.experts import GroupedExperts, WeightCache, clear_weight_caches, experts
from moe_fp8_ext.recipes import RECIPES, get_recipe

from conftest import (count_backward_operand_calls, count_zero_tail_calls, force_weights_read_once, graph_matches_eager,
                      holding, poison, set_dual_kernel_budget, spy_weight_bwd_calls)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sqnr(ref, x):
    ref, x = ref.float(), x.float()
    return (20 * torch.log10(ref.norm() / (ref - x).norm())).item()


def make(e, hidden, dim, m, device, dtype=torch.bfloat16, seed=0, offs=None):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(e, hidden, dim, generator=g) * dim ** -0.5).to(dtype).to(device)
    w3 = (torch.randn(e, hidden, dim, generator=g) * dim ** -0.5).to(dtype).to(device)
    w2 = (torch.randn(e, dim, hidden, generator=g) * hidden ** -0.5).to(dtype).to(device)
    x = torch.randn(m, dim, generator=g).to(dtype).to(device)
    if offs is None:
        cuts = torch.sort(torch.randint(0, m + 1, (e,), generator=g)).values
        cuts[-1] = m
        offs = cuts
    offs = torch.as_tensor(offs, dtype=torch.int32).to(device)
    grad = torch.randn(m, dim, generator=g).to(dtype).to(device)
    return x, w1, w3, w2, offs, grad


def reference(x, w1, w3, w2, offs):
    """fp32 autograd, group by group."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        xe = x[start:end].float()
        h = F.silu(xe @ w1[e].float().t()) * (xe @ w3[e].float().t())
        out = out.index_add(0, torch.arange(start, end, device=x.device), h @ w2[e].float().t())
        start = end
    return out


def layer_with(w1, w3, w2, **kwargs):
    """A GroupedExperts holding copies of the weights w1, w3 (E, hidden, dim), w2."""
    e, hidden, dim = w1.shape
    kwargs.setdefault("reuse_weights", True)
    layer = GroupedExperts(dim, hidden, e, dtype=w1.dtype, device=w1.device, **kwargs)
    with torch.no_grad():
        for p, w in zip((layer.w1, layer.w3, layer.w2), (w1, w3, w2)):
            p.copy_(w)
    return layer


def run(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_() for t in inputs[:4]]
    out = fn(*leaves, inputs[4])
    out.backward(grad)
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8", "fp8_blockwise", "bf16"])
def test_matches_fp32_reference(device, recipe):
    x, w1, w3, w2, offs, grad = make(4, 128, 96, 300, device, offs=[40, 40, 170, 300])
    out, grads = run(lambda *a: experts(*a, recipe=recipe), (x, w1, w3, w2, offs), grad)
    ref_out, ref_grads = run(reference, (x.float(), w1.float(), w3.float(), w2.float(), offs), grad.float())
    assert out.dtype == x.dtype and out.shape == x.shape
    floor = 35.0 if recipe == "bf16" else 23.0  # fp8: issue 15 asks 23 (out, grad_x) and 20 dB (weights)
    got = {"out": sqnr(ref_out, out), "grad_x": sqnr(ref_grads[0], grads[0])}
    for name, r, g in zip(("w1", "w3", "w2"), ref_grads[1:], grads[1:]):
        got["grad_" + name] = sqnr(r, g)
    print(recipe, device, {k: round(v, 1) for k, v in got.items()})
    assert got["out"] >= floor and got["grad_x"] >= floor, got
    assert min(got["grad_w1"], got["grad_w3"], got["grad_w2"]) >= floor - 3, got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8", "fp8_blockwise", "bf16"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_weight_gradients_taken_without_copy(device, recipe, accumulate):
    """loss.backward() into .grad: each weight's gradient comes out contiguous in the
    weight's layout, in a storage of its own, so autograd keeps the very tensor the
    layer returned (no copy); with .grad already set it accumulates into it in place."""
    x, w1, w3, w2, offs, grad = make(3, 160, 96, 200, device, offs=[50, 50, 200])
    ws = [w.clone().requires_grad_() for w in (w1, w3, w2)]
    seen = {}  # (the hook must not hold the gradient: a second reference makes autograd copy it)
    for i, w in enumerate(ws):
        w.register_hook(lambda g, i=i: seen.__setitem__(i, (
            g.data_ptr(), g.is_contiguous() and g.untyped_storage().nbytes() == g.numel() * g.element_size())))
    if accumulate:
        for w in ws:
            w.grad = torch.full_like(w, 0.5)
    before = [w.grad.data_ptr() if accumulate else None for w in ws]
    experts(x, *ws, offs, recipe=recipe).backward(grad)
    _, fresh = run(lambda *a: experts(*a, recipe=recipe), (x, *ws, offs), grad)
    for i, w in enumerate(ws):
        ptr, own_layout = seen[i]
        assert own_layout, i
        if accumulate:
            assert w.grad.data_ptr() == before[i] and torch.equal(w.grad, fresh[i + 1] + 0.5), i
        else:
            assert w.grad.data_ptr() == ptr and torch.equal(w.grad, fresh[i + 1]), i


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden", [128, 144])
def test_blockwise_joins_w13_dgrad_for_whole_tiles(device, hidden, monkeypatch):
    # fp8_blockwise runs the input gradient through W1 and W3 as one GEMM where hidden is whole 128-column tiles (no
    # operand copy), else as two summed GEMMs over the halves (no bf16 [W1; W3] copy at the backward's peak);
    # both match the fp32 layer.
    from moe_fp8_ext import recipes

    x, w1, w3, w2, offs, grad = make(3, hidden, 96, 300, device, offs=[40, 170, 300])
    r = get_recipe("fp8_blockwise")
    assert r.joins_w13_dgrad(w1, w3) == (hidden % 128 == 0)
    calls, _ = spy_weight_bwd_calls(monkeypatch, "fp8_blockwise")
    held_nothing = recipes.Fp8Blockwise(hold_weight_operands=False)  # the backward makes W13's operand itself
    out, grads = run(lambda *a: experts(*a, recipe=held_nothing), (x, w1, w3, w2, offs), grad)
    assert sorted(calls) == ([1, 2] if hidden % 128 == 0 else [1, 1, 1])  # W2, then [W1; W3] or W1 and W3
    ref_out, ref_grads = run(reference, (x.float(), w1.float(), w3.float(), w2.float(), offs), grad.float())
    assert sqnr(ref_out, out) >= 23 and sqnr(ref_grads[0], grads[0]) >= 23
    assert min(sqnr(r_, g) for r_, g in zip(ref_grads[1:], grads[1:])) >= 20


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden, mode", [(128, "box"), (64, "box"), (128, "hooks"), (128, "no_pad")])
@pytest.mark.parametrize("needs", [(0, 1, 2, 3), (0, 1, 2), (3,), (0, 3), (1, 2, 3), (0,), (1,)])
def test_blockwise_swiglu_operands(device, hidden, mode, needs, monkeypatch):
    # fp8_blockwise makes h's two fp8 operands together in the forward (wgrad one kept, h never recomputed) and, where
    # dgrad through W1/W3 is one GEMM, grad_h13's two in the backward; bit-equal to the path without. h's operand is
    # in a box ("box") or under saved-tensor hooks ("hooks"); aligned groups, pad_groups=False keep nothing ("no_pad").
    from moe_fp8_ext import recipes

    experts_mod = importlib.import_module("moe_fp8_ext.experts")  # (moe_fp8_ext.experts is the function)
    # The composed path (the fused SwiGLU GEMM makes both of h's operands in one: its own test below).
    monkeypatch.setattr(recipes.Fp8Blockwise, "quantize_w13", recipes.Recipe.quantize_w13)

    pad = mode != "no_pad"
    x, w1, w3, w2, offs, grad = (make(3, hidden, 96, 300, device, offs=[40, 170, 300]) if pad
                                 else make(3, hidden, 96, 256, device, offs=[128, 128, 256]))

    def go(makes):
        calls, swiglus = [], []  # the widths of the tensors whose two operands are made together; h computed
        monkeypatch.setattr(moe_fp8_ext.blockwise, "act_dual_reads_once", lambda t: makes)  # (the GPU's rule)
        real = recipes.Fp8Blockwise.quantize

        def spy(self, t, *a, **k):
            out = real(self, t, *a, **k)
            if out[0] is not None and out[1] is not None:
                calls.append(t.shape[1])
            return out

        monkeypatch.setattr(recipes.Fp8Blockwise, "quantize", spy)
        for mod in (experts_mod, importlib.import_module("moe_fp8_ext.swiglu")):
            monkeypatch.setattr(mod, "swiglu", lambda h13, real=mod.swiglu: swiglus.append(1) or real(h13))
        leaves = [t.detach().clone().requires_grad_(i in needs) for i, t in enumerate((x, w1, w3, w2))]
        with contextlib.ExitStack() as stack:
            if mode == "hooks":
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
            out = experts(*leaves, offs, recipe="fp8_blockwise", pad_groups=pad)
            box = out.grad_fn.box
            held.append(box is not None and box.get("h_col") is not None)  # (h's operand on ctx, as made)
            out.backward(grad)
        return out, [t.grad for t in leaves], [c for c in calls if c in (hidden, 2 * hidden)], len(swiglus)

    held = []
    out0, grads0, calls0, _ = go(False)
    out1, grads1, calls1, swiglus1 = go(True)
    need_x, need_w13, need_w2 = 0 in needs, 1 in needs or 2 in needs, 3 in needs
    joint = hidden % 128 == 0
    assert calls0 == []
    if pad:
        assert calls1 == [hidden] * need_w2 + [2 * hidden] * (joint and need_x and need_w13), calls1
        assert swiglus1 == 1
    else:  # nothing kept: h recomputed where W2 needs it, else never
        assert calls1 == [] and swiglus1 == 1 + need_w2
    assert held == [False, mode == "box" and 3 in needs]
    assert out1.grad_fn.box == ({} if mode != "hooks" else None)  # emptied by the backward
    assert torch.equal(out0, out1)
    for a, b in zip(grads0, grads1):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.skipif(not moe_fp8_ext.blockwise_gemm.available(), reason="needs the sm_90a blockwise GEMM")
@pytest.mark.parametrize("hidden", [128, 384])
@pytest.mark.parametrize("pad, cached", [(True, False), (False, False), (True, True)])
def test_blockwise_swiglu_gemm_is_the_composed_path(hidden, pad, cached, monkeypatch):
    # On sm90, fp8_blockwise runs W13 and the SwiGLU as one GEMM whose epilogue writes h13 and h's two operands
    # (quantize_w13 interleaves W1 and W3 by 128; DESIGN §6, §10), and with dswiglu_in_gemm W2's input gradient and
    # the dSwiGLU as one whose epilogue writes grad_h13's two operands (in the padded layout): the layer's output and
    # gradients are the composed path's bit for bit, with an empty group, tail rows, an odd number of 128- and
    # 256-column tiles and weight reuse.
    from moe_fp8_ext import recipes

    x, w1, w3, w2, offs, grad = make(3, hidden, 256, 700, "cuda", offs=[100, 100, 650])
    fused, real, real_w13 = [], recipes.Fp8Blockwise.mm_2d3d_swiglu, recipes.Fp8Blockwise.quantize_w13
    composed_bwd, real_bwd = [], recipes.Fp8Blockwise.quantize_swiglu_backward

    def spy(self, tensors, *a, **k):
        fused.append(isinstance(tensors[1], recipes.blockwise.W13Interleaved))
        return real(self, tensors, *a, **k)

    def spy_bwd(self, *a, **k):  # the composed backward's dSwiGLU
        composed_bwd.append(True)
        return real_bwd(self, *a, **k)

    monkeypatch.setattr(recipes.Fp8Blockwise, "mm_2d3d_swiglu", spy)
    monkeypatch.setattr(recipes.Fp8Blockwise, "quantize_swiglu_backward", spy_bwd)
    results = []
    for composed in (False, True):
        if composed:
            monkeypatch.setattr(recipes.Fp8Blockwise, "quantize_w13", recipes.Recipe.quantize_w13)
        cache = WeightCache() if cached else None
        r = get_recipe("fp8_blockwise") if composed else dataclasses.replace(get_recipe("fp8_blockwise"),
                                                                              dswiglu_in_gemm=True)
        for _ in range(2 if cached else 1):  # (a miss, then a hit)
            layer = functools.partial(experts, recipe=r, pad_groups=pad, weight_cache=cache)
            results.append(run(layer, (x, w1, w3, w2, offs), grad))
    assert fused == [True] * (1 + cached) + [False] * (1 + cached)
    assert len(composed_bwd) == 1 + cached  # (700 tokens take the padded layout even with pad_groups=False)
    # another padded layout than the op's (128-row blocks) keeps the composed path
    wide = dataclasses.replace(recipes.Fp8Blockwise(), alignment=256)
    parts = [w1.transpose(1, 2), w3.transpose(1, 2)]
    interleaved = recipes.blockwise.W13Interleaved
    assert isinstance(real_w13(get_recipe("fp8_blockwise"), parts, torch.float8_e4m3fn)[0], interleaved)
    assert not isinstance(real_w13(wide, parts, torch.float8_e4m3fn)[0], interleaved)
    (out_f, grads_f), (out_c, grads_c) = results[0], results[-1]
    assert torch.equal(out_f, out_c) and all(torch.equal(a, b) for a, b in zip(grads_f, grads_c))
    assert all(torch.equal(results[0][0], r[0]) for r in results)


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise"])
def test_swiglu_steps_drop_their_gemm_operands(recipe, monkeypatch):
    # The operands of the GEMM before each SwiGLU step (x's and W13's in the forward, grad_out's and W2's backward
    # one in the backward) are dropped before the step allocates its outputs: the forward's and the step's peaks.
    r = get_recipe(recipe)
    x, w1, w3, w2, offs, grad = make(3, 128, 128, 300, "cpu", offs=[100, 200, 300])
    operands, dead = [], []
    real_mm = type(r).mm_2d3d

    def spy_mm(self, lhs, rhs, *a, **k):
        operands.append([weakref.ref(t) for op in (lhs, rhs) for t in ((op,) if isinstance(op, torch.Tensor) else op)])
        return real_mm(self, lhs, rhs, *a, **k)

    def spy(name):  # (the last mm_2d3d before each step is its GEMM)
        real = getattr(type(r), name)

        def step(self, *a, **k):
            dead.append((name, all(ref() is None for ref in operands[-1])))
            return real(self, *a, **k)
        return step

    monkeypatch.setattr(type(r), "mm_2d3d", spy_mm)
    for name in ("quantize_swiglu", "quantize_swiglu_backward"):
        monkeypatch.setattr(type(r), name, spy(name))
    run(functools.partial(experts, recipe=r), (x, w1, w3, w2, offs), grad)
    assert dead == [("quantize_swiglu", True), ("quantize_swiglu_backward", True)]


def test_recipe_fields_are_checked_at_construction():
    """Every built-in recipe refuses a bad field when it is made (dataclasses.replace
    included), not at its first use; the alignment a power-of-two multiple of its own."""
    import dataclasses

    from moe_fp8_ext import recipes

    for cls, field in [(recipes.Fp8Blockwise, "hold_weight_operands"), (recipes.Fp8Blockwise, "dswiglu_in_gemm"),
                       (recipes.Fp8Rowwise, "pow2_scale"), (recipes.Fp8Rowwise, "hold_weight_operands")]:
        with pytest.raises(TypeError, match=f"{cls.__name__}: expected {field} to be a bool, got 'false'"):
            cls(**{field: "false"})
    with pytest.raises(ValueError, match=r"Mxfp8: expected rounding in \('rceil', 'floor'\), got 'up'"):
        recipes.Mxfp8(rounding="up")
    with pytest.raises(ValueError, match="Fp8Rowwise: expected gemm_kernel in"):
        recipes.Fp8Rowwise(gemm_kernel="cutlass")
    for name, wrong in [("fp8_blockwise", 16), ("fp8_blockwise", 384), ("fp8_rowwise", 8), ("mxfp8", 16),
                        ("bf16", 0), ("bf16", True)]:
        r = get_recipe(name)
        with pytest.raises(ValueError, match=f"multiple of {r.alignment} .*got {wrong}"):
            dataclasses.replace(r, alignment=wrong)
        assert dataclasses.replace(r, alignment=2 * r.alignment).alignment == 2 * r.alignment


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8", "fp8_blockwise", "bf16"])
@pytest.mark.parametrize("hidden", [128, 192])
def test_swiglu_in_gemm_says_which_path_runs(device, recipe, hidden, monkeypatch):
    # Recipe.swiglu_in_gemm is the W13 operand's layout: the SwiGLU GEMM runs exactly where it says so (fp8_blockwise
    # on sm90, hidden a multiple of 128, 128-row padded layout); everywhere else the composed path.
    from moe_fp8_ext import recipes

    r = get_recipe(recipe)
    x, w1, w3, w2, offs, grad = make(2, hidden, 128, 300, device, offs=[100, 300])
    taken, real = [], type(r).mm_2d3d_swiglu
    composed_bwd, real_bwd = [], type(r).quantize_swiglu_backward

    def spy(self, tensors, *a, **k):
        taken.append(isinstance(tensors[1], recipes.blockwise.W13Interleaved))
        return real(self, tensors, *a, **k)

    def spy_bwd(self, *a, **k):
        composed_bwd.append(True)
        return real_bwd(self, *a, **k)

    monkeypatch.setattr(type(r), "mm_2d3d_swiglu", spy)
    monkeypatch.setattr(type(r), "quantize_swiglu_backward", spy_bwd)
    run(functools.partial(experts, recipe=r), (x, w1, w3, w2, offs), grad)
    want = (recipe == "fp8_blockwise" and device == "cuda" and hidden % 128 == 0
            and moe_fp8_ext.blockwise_gemm.available())
    assert taken == [want] and r.swiglu_in_gemm(hidden, torch.device(device)) is want
    if recipe != "bf16":  # (its own autograd function) the backward's dSwiGLU GEMM only where asked for
        assert composed_bwd == [True]
    if recipe == "fp8_blockwise":
        run(functools.partial(experts, recipe=dataclasses.replace(r, dswiglu_in_gemm=True)), (x, w1, w3, w2, offs),
            grad)
        assert composed_bwd == [True] * (1 + (not want))
    if recipe == "fp8_blockwise":
        assert not dataclasses.replace(r, alignment=256).swiglu_in_gemm(hidden, torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
def test_same_math_as_three_grouped_mm(device):
    """The fused W1/W3 GEMM quantizes x once with the same rowwise scales, so the
    layer equals silu(mm(x, w1)) * mm(x, w3) -> mm(., w2) up to the GEMMs' own
    summation order (fp32 accumulation): near-identical outputs and gradients."""
    x, w1, w3, w2, offs, grad = make(3, 64, 128, 257, device, offs=[100, 100, 250])

    def three(x, w1, w3, w2, offs):
        def mm(a, w):
            return moe_fp8_ext.grouped_mm(a, w.transpose(-2, -1), offs)
        return mm(F.silu(mm(x, w1)) * mm(x, w3), w2)

    out, grads = run(experts, (x, w1, w3, w2, offs), grad)
    out3, grads3 = run(three, (x, w1, w3, w2, offs), grad)
    assert sqnr(out3, out) > 40
    for a, b in zip(grads3, grads):
        assert sqnr(a, b) > 35


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise"])
@pytest.mark.parametrize("hidden", [64, 128])
def test_tail_rows_and_empty_groups(device, recipe, hidden):
    """Rows past offs[-1] give zero output and zero gradient; empty groups (first,
    middle, last) and E = 1 work; the tail holds huge values that must not leak (over
    poisoned memory: fp8_blockwise's GEMMs zero those rows themselves on a GPU). Hidden
    64 runs fp8_blockwise's input gradient as two GEMMs summed, 128 as one (the joint
    path, with h's and grad_h13's operands made together on a GPU)."""
    for offs, e in (([0, 50, 50, 120], 4), ([120], 1), ([0, 0, 0], 3)):
        x, w1, w3, w2, o, grad = make(e, hidden, 32, 160, device, offs=offs)
        x[120:] = 1e30
        poison(device)
        out, grads = run(lambda *a: experts(*a, recipe=recipe), (x, w1, w3, w2, o), grad)
        assert torch.isfinite(out).all() and (out[o[-1]:] == 0).all()
        assert (grads[0][o[-1]:] == 0).all() and torch.isfinite(grads[0]).all()
        ref_out = reference(x, w1, w3, w2, o)
        if o[-1] > 0:
            assert sqnr(ref_out[:o[-1]], out[:o[-1]]) > 20
        for g in grads[1:]:
            assert torch.isfinite(g).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise", "mxfp8", "bf16"])
@pytest.mark.parametrize("m", [96, 100])
def test_strided_inputs_give_the_contiguous_bits(device, recipe, m):
    """x and grad_out column-major (a leading stride of m elements: not 16 bytes for
    m = 100): the bits of contiguous inputs."""
    x, w1, w3, w2, offs, grad = make(3, 64, 64, m, device, offs=[30, 30, m])
    want = run(lambda *a: experts(*a, recipe=recipe), (x, w1, w3, w2, offs), grad)
    xs = x.t().contiguous().t()
    got = run(lambda *a: experts(*a, recipe=recipe), (xs, w1, w3, w2, offs), grad.t().contiguous().t())
    assert all(torch.equal(a, b) for a, b in zip([want[0]] + want[1], [got[0]] + got[1]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise", "mxfp8"])
def test_unpadded_groups_checked_in_debug_mode(device, recipe, monkeypatch):
    """pad_groups=False promises group sizes that are multiples of the alignment:
    MOE_FP8_DEBUG=1 checks them (a sync), as grouped_mm does."""
    x, w1, w3, w2, offs, grad = make(3, 64, 128, 96, device, offs=[30, 30, 96])
    monkeypatch.setenv("MOE_FP8_DEBUG", "1")
    with pytest.raises(ValueError, match="experts: expected group sizes that are multiples of"):
        experts(x, w1, w3, w2, offs, recipe=recipe, pad_groups=False)
    aligned = torch.tensor([32, 32, 96], dtype=torch.int32, device=device) if recipe == "fp8_rowwise" else None
    if aligned is not None:
        experts(x, w1, w3, w2, aligned, recipe=recipe, pad_groups=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise", "mxfp8"])
def test_autocast_changes_no_bit(device, recipe):
    """Under torch.autocast (bf16) the fp8 recipes give the bits they give without it:
    their emulated GEMMs keep fp32 operands."""
    x, w1, w3, w2, offs, grad = make(4, 64, 128, 100, device, dtype=torch.float32, offs=[30, 30, 80, 100])
    want = run(lambda *a: experts(*a, recipe=recipe), (x, w1, w3, w2, offs), grad)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = run(lambda *a: experts(*a, recipe=recipe), (x, w1, w3, w2, offs), grad)
    assert all(torch.equal(a, b) for a, b in zip([want[0]] + want[1], [got[0]] + got[1]))


@pytest.mark.parametrize("zeroes", [False, True])
@pytest.mark.parametrize("hidden", [64, 128])
def test_no_zeroing_kernel_after_a_gemm_that_zeroes(zeroes, hidden, monkeypatch):
    """The rows past offs[-1] are zeroed by the recipe's 2d3d GEMMs (Recipe.mm_2d3d) and
    by nothing after them: with a GEMM that writes them itself no zeroing kernel runs;
    the emulated GEMM zeroes once a GEMM (W13's, W2's, W2's input gradient, and the
    input gradient's one GEMM or two), and the gradients are the unpatched layer's."""
    x, w1, w3, w2, offs, grad = make(3, hidden, 32, 160, "cpu", offs=[40, 40, 120])
    _, want = run(lambda *a: experts(*a, recipe="fp8_blockwise"), (x, w1, w3, w2, offs), grad)
    calls = count_zero_tail_calls(monkeypatch, zeroes)
    out, grads = run(lambda *a: experts(*a, recipe="fp8_blockwise"), (x, w1, w3, w2, offs), grad)
    assert len(calls) == (0 if zeroes else 4 if hidden % 128 == 0 else 5)
    for a, b in zip(grads, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_no_experts(device):
    x, w1, w3, w2, offs, grad = make(1, 32, 32, 8, device, offs=[8])
    w1, w3, w2 = w1[:0], w3[:0], w2[:0]
    out, grads = run(experts, (x, w1, w3, w2, offs[:0]), grad)
    assert (out == 0).all() and (grads[0] == 0).all() and grads[1].shape == w1.shape


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_inputs_and_fp8_dtypes(device):
    x, w1, w3, w2, offs, grad = make(2, 32, 64, 64, device, dtype=torch.float32, offs=[20, 64])
    ref_out = reference(x, w1, w3, w2, offs)
    for f8 in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        if device == "cuda" and f8 != moe_fp8_ext.default_fp8_dtype(torch.device(device)):
            continue  # the real GEMM takes the platform's fp8 only
        out = experts(x, w1, w3, w2, offs, fp8_dtype=f8)
        assert out.dtype == torch.float32 and sqnr(ref_out, out) > 20


@pytest.mark.parametrize("device", DEVICES)
def test_saved_w13_output_freed_in_backward(device):
    """The W13 output is freed half way through the backward (the peak is there): a
    second backward over the same forward raises a clear error instead of reading
    freed memory; under saved-tensor hooks (activation checkpointing, offloading) the
    layer saves it normally, so checkpointing gives the same gradients and a
    retain_graph backward can run twice."""
    x, w1, w3, w2, offs, grad = make(4, 64, 32, 100, device, offs=[10, 40, 40, 100])
    out, grads = run(experts, (x, w1, w3, w2, offs), grad)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w3, w2)]
    y = experts(*leaves, offs)
    y.backward(grad, retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice over one forward"):
        y.backward(grad)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w3, w2)]
    ckpt = torch.utils.checkpoint.checkpoint(lambda *t: experts(*t, offs), *leaves, use_reentrant=False)
    ckpt.backward(grad)
    assert torch.equal(ckpt, out) and all(torch.equal(t.grad, g) for t, g in zip(leaves, grads))
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w3, w2)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = experts(*leaves, offs)
    for _ in range(2):
        for t in leaves:
            t.grad = None
        y.backward(grad, retain_graph=True)
        assert all(torch.equal(t.grad, g) for t, g in zip(leaves, grads))


@pytest.mark.parametrize("recipe_name", ["bf16", "fp8_rowwise", "fp8_blockwise", "mxfp8"])
def test_w13_forward_operand_freed_before_w2_gemm(recipe_name, monkeypatch):
    """W13's forward operand (fp8 [W1; W3] and scales, or bf16's) has no reader after its
    GEMM: it is gone when W2's forward GEMM runs, where the forward's memory peaks (held
    there, it put the fp8_blockwise layer's peak above bf16's at (65536, 2048, 1408, 64));
    the gradients are unchanged."""
    import weakref

    tensors = importlib.import_module("moe_fp8_ext.weight_cache")._tensors
    x, w1, w3, w2, offs, grad = make(3, 128, 96, 300, "cpu", offs=[40, 170, 300])
    _, full = run(lambda *a: experts(*a, recipe=recipe_name), (x, w1, w3, w2, offs), grad)
    recipe_cls = type(get_recipe(recipe_name))
    real = recipe_cls.mm_2d3d
    operands, alive = [], []  # weak references to each GEMM's rhs tensors; at each call, how many earlier ones live

    def spy(self, lhs, rhs, *args):
        alive.append(sum(r() is not None for refs in operands for r in refs))
        operands.append([weakref.ref(t) for t in tensors(rhs)])
        return real(self, lhs, rhs, *args)

    monkeypatch.setattr(recipe_cls, "mm_2d3d", spy)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w3, w2)]
    out = experts(*leaves, offs, recipe=recipe_name)
    assert len(operands) == 2 and operands[0] and alive == [0, 0], (len(operands), alive)
    out.backward(grad)
    for t, g in zip(leaves, full):
        assert torch.equal(t.grad, g)


@pytest.mark.parametrize("recipe_name", ["bf16", "fp8_rowwise", "fp8_blockwise", "mxfp8"])
@pytest.mark.parametrize("few_tokens", [True, False])
def test_w2_weight_gradient_last_where_its_operands_are_smaller(recipe_name, few_tokens, monkeypatch):
    """W2's weight-gradient GEMM runs after W1's and W3's where its two operands take fewer
    bytes than grad_w2 (few tokens an expert: the operands, not grad_w2, live through
    W13's GEMMs), else first; the gradients are the same bits in either order."""
    e, hidden, dim, m = (2, 384, 256, 64) if few_tokens else (2, 128, 96, 1000)
    x, w1, w3, w2, offs, grad = make(e, hidden, dim, m, "cpu", offs=[m // 2, m])
    recipe_cls = type(get_recipe(recipe_name))
    real, order = recipe_cls.mm_2d2d, []

    def spy(self, *args):
        out = real(self, *args)
        order.append("w2" if tuple(out.shape[1:]) == (dim, hidden) else "w13")
        return out

    monkeypatch.setattr(recipe_cls, "mm_2d2d", spy)
    _, grads = run(lambda *a: experts(*a, recipe=recipe_name), (x, w1, w3, w2, offs), grad)
    assert order.count("w2") == 1 and (order[-1] if few_tokens else order[0]) == "w2", order
    order.clear()
    monkeypatch.setattr(importlib.import_module("moe_fp8_ext.experts"), "_nbytes", lambda op: float("inf"))
    _, first = run(lambda *a: experts(*a, recipe=recipe_name), (x, w1, w3, w2, offs), grad)
    assert order[0] == "w2", order
    for g, f in zip(grads, first):
        assert torch.equal(g, f)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("frozen_w13", [False, True])
def test_saves_fp8_x_instead_of_x(device, frozen_w13):
    """fp8_rowwise makes x's weight-gradient operand with its forward one (one read of x)
    and saves that (fp8, the padded layout) instead of the bf16 x; with W1 and W3
    frozen no weight gradient reads x, and the layer saves nothing of it."""
    x, w1, w3, w2, offs, grad = make(4, 64, 32, 100, device, offs=[10, 40, 40, 100])
    leaves = [t.detach().clone().requires_grad_(not (frozen_w13 and i in (1, 2))) for i, t in enumerate((x, w1, w3, w2))]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = experts(*leaves, offs)
    rows = moe_fp8_ext.padded_rows(100, 4, 16)
    fp8_x = [t for t in saved if t.dtype == torch.float8_e4m3fn and t.shape == (rows, 32)]
    bf16_x = [t for t in saved if t.dtype == x.dtype and t.shape == x.shape and t.data_ptr() == leaves[0].data_ptr()]
    assert (len(fp8_x), len(bf16_x)) == ((0, 0) if frozen_w13 else (1, 0))
    y.backward(grad)
    _, full = run(experts, (x, w1, w3, w2, offs), grad)
    for t, g in zip(leaves, full):
        assert t.grad is None if not t.requires_grad else torch.equal(t.grad, g)


@pytest.mark.parametrize("needs", [(3,), (0,), (1,), (1, 2), (0, 3)])
def test_partial_gradients(needs):
    """Only some inputs require grad (frozen experts, a frozen input): the gradients that
    are asked for equal those of a full backward, the others stay None; and nothing is
    saved that only an unwanted gradient reads (x: W1/W3's weight gradient, which reads
    its fp8 operand here; W1, W3: the input gradient; W2: both)."""
    x, w1, w3, w2, offs, grad = make(4, 64, 32, 100, "cpu", offs=[10, 40, 40, 100])
    _, full = run(experts, (x, w1, w3, w2, offs), grad)
    leaves = [t.detach().clone().requires_grad_(i in needs) for i, t in enumerate((x, w1, w3, w2))]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = experts(*leaves, offs)
    kept = [any(t.untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr() for t in saved) for leaf in leaves]
    need_x, need_w13 = 0 in needs, 1 in needs or 2 in needs
    assert kept == [False, need_x, need_x, need_x or need_w13], kept
    out.backward(grad)
    for i, t in enumerate(leaves):
        assert (t.grad is None) != (i in needs)
        if i in needs:
            assert torch.equal(t.grad, full[i])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["fp8_rowwise", "fp8_blockwise"])
def test_step_has_no_host_sync(recipe_name):
    """The layer's forward and backward (unaligned token groups, an empty one, rows past
    the last) run under torch's sync-debug mode and replay from one CUDA graph bit for
    bit (any host sync fails the capture). No weight cache: a graph replays kernels,
    not the cache's Python bookkeeping."""
    x, w1, w3, w2, offs, grad = make(5, 256, 128, 1000, "cuda", offs=[90, 90, 401, 733, 990])
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w3, w2)]

    def step():
        out = experts(*leaves, offs, recipe=recipe_name, weight_cache=None)
        return (out, *torch.autograd.grad(out, leaves, grad))

    graph_matches_eager(step)


# ---- weight reuse ----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_weight_reuse_hits_and_is_exact(device):
    x, w1, w3, w2, offs, grad = make(3, 64, 64, 100, device, offs=[10, 60, 100])
    layer = layer_with(w1, w3, w2)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    cache = layer.weight_cache
    outs = []
    for _ in range(3):  # micro-batches: one quantization of each weight per orientation
        xl = x.clone().requires_grad_()
        out = layer(xl, counts)
        out.backward(grad)
        outs.append((out.detach(), xl.grad))
    # w13 fwd and bwd (fp8_rowwise: one dgrad GEMM against [W1; W3]), w2 fwd and bwd;
    # where one read makes both (the GPU's dual kernel) the forward's miss makes the
    # backward operand too, and the backward's first lookup hits
    once = moe_fp8_ext.ops.dual_cat_reads_once([layer.w2.transpose(1, 2)])
    assert (cache.misses, cache.hits) == ((2, 10) if once else (4, 8))
    assert cache.nbytes() > 0
    fresh = experts(x, w1, w3, w2, offs)
    for out, gx in outs:
        assert torch.equal(out, fresh) and torch.equal(gx, outs[0][1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("dual_kernel", ["0", "default"])
def test_backward_operands_made_in_forward(device, cached, dual_kernel, monkeypatch):
    # A recipe that reads a weight once for both operands (bwd=SAME_READ; the rule forced here so CPU and kernel-off
    # GPU run it) makes the backward operands in the forward: the same bits as making them in the backward, kept on ctx
    # until used and then dropped (no cache), or in the cache.
    set_dual_kernel_budget(monkeypatch, dual_kernel)
    x, w1, w3, w2, offs, grad = make(3, 48, 64, 100, device, offs=[10, 60, 100])
    results = []
    remade, _ = spy_weight_bwd_calls(monkeypatch, "fp8_rowwise")  # (the backward quantizing a weight again)
    for once in (False, True):
        force_weights_read_once(monkeypatch, "fp8_rowwise", once)
        remade.clear()
        leaves = [t.clone().requires_grad_() for t in (x, w1, w3, w2)]
        cache = WeightCache() if cached else None
        out = experts(*leaves, offs, recipe=holding("fp8_rowwise"), weight_cache=cache)
        box = out.grad_fn.box
        held = sorted(k for k in box if k.startswith("bwd_"))
        if cached:
            assert held == [] and (cache.misses, cache.hits) == (2, 0)
            assert len(cache._entries) == (4 if once else 2)
        else:
            assert held == (["bwd_w13", "bwd_w2"] if once else [])
        out.backward(grad)
        assert box == {} and len(remade) == (0 if once else 2)  # held operands used, not made again
        if cached:
            assert (cache.misses, cache.hits) == ((2, 2) if once else (4, 0))
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe_name", ["fp8_rowwise", "fp8_blockwise"])
def test_default_holds_no_weight_operand(recipe_name, monkeypatch):
    # By default (hold_weight_operands=False, record 050) the forward keeps nothing made from a weight for the
    # backward, where one read could make both operands: the backward quantizes each weight again, to the same bits.
    x, w1, w3, w2, offs, grad = make(3, 128, 128, 300, "cpu", offs=[130, 130, 300])
    force_weights_read_once(monkeypatch, recipe_name, True)
    remade, _ = spy_weight_bwd_calls(monkeypatch, recipe_name)
    assert not get_recipe(recipe_name).hold_weight_operands
    results = []
    for recipe in (recipe_name, holding(recipe_name)):
        remade.clear()
        leaves = [t.clone().requires_grad_() for t in (x, w1, w3, w2)]
        out = experts(*leaves, offs, recipe=recipe)
        held = sorted(k for k in out.grad_fn.box if k.startswith("bwd_"))
        assert held == ([] if recipe == recipe_name else ["bwd_w13", "bwd_w2"])
        out.backward(grad)
        assert len(remade) == (2 if recipe == recipe_name else 0)  # W2, then [W1; W3] quantized again
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe_name", ["fp8_rowwise", "fp8_blockwise"])
def test_no_grad_makes_nothing_for_backward(recipe_name, monkeypatch):
    # Under no_grad the layer makes no backward operand (weights' dgrad ones, x's wgrad one), though autograd sets
    # needs_input_grad there too; the output equals grad mode's. (fp8_blockwise makes x's two operands, and each
    # weight's two, from one read: W1 and W3 together, W2 alone.)
    x, w1, w3, w2, offs, _ = make(3, 128, 128, 300, "cpu", offs=[130, 130, 300])
    calls, recipe = count_backward_operand_calls(monkeypatch, recipe_name)
    if recipe_name == "fp8_rowwise":
        force_weights_read_once(monkeypatch, recipe_name, True)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w3, w2)]
    out = experts(*leaves, offs, recipe=holding(recipe_name))
    if recipe_name == "fp8_rowwise":
        assert sorted(set(calls)) == ["quantize_both", "weights_both"]
    else:
        assert calls == ["weight_dual_cat", "weights_both", "quantize_both", "weight_dual", "weights_both"]
    calls.clear()
    with torch.no_grad():
        out2 = experts(*leaves, offs, recipe=holding(recipe_name))
    assert calls == [] and torch.equal(out.detach(), out2)


@pytest.mark.parametrize("device", DEVICES)
def test_weight_reuse_never_stale(device):
    """Every write the cache can see invalidates: in-place writes through autograd-visible
    ops, optimizer steps, a new storage through ``.data =`` (even where the allocator
    hands back the old address) and swap_tensors. Writes it cannot see are documented,
    with clear_weight_caches as the remedy. After each, the layer's output equals a
    cache-free call on the new weights."""
    x, _, _, _, offs, grad = make(2, 32, 64, 64, device, offs=[30, 64])
    layer = GroupedExperts(64, 32, 2, dtype=torch.bfloat16, device=device, reuse_weights=True)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))

    def fresh():
        return experts(x, layer.w1, layer.w3, layer.w2, offs, weight_cache=None)

    layer(x, counts)
    with torch.no_grad():
        layer.w2.mul_(2)  # an in-place write
    assert torch.equal(layer(x, counts), fresh())
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    out = layer(x, counts)
    out.backward(grad)
    opt.step()
    assert len(layer.weight_cache._entries) == 0  # the optimizer hook emptied it
    assert torch.equal(layer(x, counts), fresh())
    # a new storage for w3 through .data; the old one freed first, so that the allocator
    # may hand its address back
    new = layer.w3.detach().clone() * 3
    layer.w3.data = torch.empty(0, dtype=torch.bfloat16, device=device)
    layer.w3.data = new
    del new
    assert torch.equal(layer(x, counts), fresh())
    misses = layer.weight_cache.misses
    torch.utils.swap_tensors(layer.w1, torch.nn.Parameter(layer.w1.detach() * -1))  # (needs no weakref to w1)
    assert torch.equal(layer(x, counts), fresh()) and layer.weight_cache.misses > misses
    # writes the version counter cannot see, then the documented remedy
    layer.w1.data.mul_(-1)
    layer.w2.untyped_storage().copy_((layer.w2.detach() * 0.5).untyped_storage())
    clear_weight_caches()
    assert torch.equal(layer(x, counts), fresh())


def test_weight_cache_errors_and_pickling():
    x, w1, w3, w2, offs, _ = make(2, 32, 64, 64, "cpu", offs=[30, 64])
    with pytest.raises(TypeError, match="expected weight_cache to be a moe_fp8_ext.WeightCache or None, got bool"):
        experts(x, w1, w3, w2, offs, weight_cache=True)
    layer = layer_with(w1, w3, w2)
    layer(x, torch.tensor([30, 34]))
    assert layer.weight_cache.nbytes() > 0
    import io
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert isinstance(back.weight_cache, WeightCache) and back.weight_cache.nbytes() == 0
    assert torch.equal(back(x, torch.tensor([30, 34])), layer(x, torch.tensor([30, 34])))


@pytest.mark.parametrize("counts, error, match", [
    (torch.tensor([2 ** 32 + 20, 44]), ValueError, "summing to at most 64"),
    (torch.tensor([20.7, 43.6]), TypeError, "integer dtype, got torch.float32"),
    (torch.tensor([True, True]), TypeError, "integer dtype, got torch.bool"),
    (torch.tensor([-4, 40]), ValueError, "minimum of -4"),
    (torch.tensor([[20, 44]]), ValueError, "1-D"),
])
def test_bad_token_counts_raise(counts, error, match):
    layer = GroupedExperts(64, 32, 2, dtype=torch.bfloat16)
    with pytest.raises(error, match=match):
        layer(torch.randn(64, 64, dtype=torch.bfloat16), counts)


def test_counts_never_wrap_on_the_device_path():
    """Without the CPU check (a GPU's counts, unchecked to avoid a sync) counts past 2^31
    clamp into [0, M] in int64, never wrap to a small valid-looking table."""
    from moe_fp8_ext.experts import offsets_from_counts

    class Gpu(torch.Tensor):  # a CPU tensor that reports a CUDA device to the check
        @property
        def device(self):
            return torch.device("cuda", 0)

    counts = torch.tensor([2 ** 32 + 20, 44]).as_subclass(Gpu)
    offs = offsets_from_counts(counts, 64)
    assert offs.dtype == torch.int32 and offs.as_subclass(torch.Tensor).tolist() == [64, 64]


@pytest.mark.parametrize("reentrant", [False, True])
def test_weight_reuse_on_checkpoint_recompute(reentrant):
    """Activation checkpointing runs the layer's forward twice a step: the recompute in
    the backward finds the forward's weight operands in the cache (a hit per forward
    operand, no requantization) and gives the gradients of an uncheckpointed step, bit
    for bit. (CPU: no recipe reads a weight once here. Where one does, on a GPU, the
    reentrant form's first forward runs under no_grad and caches no backward operand,
    so the backward makes them: the counts below would differ there.)"""
    x, w1, w3, w2, offs, grad = make(3, 64, 64, 100, "cpu", offs=[10, 60, 100])
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    results = []
    for ckpt in (False, True):
        layer = layer_with(w1, w3, w2)
        xl = x.clone().requires_grad_()
        if ckpt:
            out = torch.utils.checkpoint.checkpoint(layer, xl, counts, use_reentrant=reentrant)
        else:
            out = layer(xl, counts)
        out.backward(grad)
        cache = layer.weight_cache
        results.append(((cache.misses, cache.hits), out.detach(), xl.grad, layer.w1.grad, layer.w3.grad, layer.w2.grad))
    (plain_stats, *plain), (ckpt_stats, *ckpt) = results
    # the same misses (each weight quantized once per orientation); the recompute's two
    # forward operands (W13, W2) are hits
    assert ckpt_stats == (plain_stats[0], plain_stats[1] + 2), (plain_stats, ckpt_stats)
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_compiled_module_bypasses_the_cache(device, backend, checkpointed):
    """torch.compile(fullgraph=True) of the module itself (what a user compiling a
    model does), also inside activation checkpointing (a higher-order op that refuses
    side effects): it never touches its weight cache (the version counter is not
    traceable), stays empty, and gives eager's outputs and gradients over two steps
    (same quantized math; compiled code
    may round the SwiGLU differently by an ulp, so compared by SQNR as in
    test_compile_fullgraph)."""
    x, w1, w3, w2, offs, grad = make(3, 64, 64, 96, device, offs=[32, 32, 96])
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    runs = []
    for compiled in (False, True):
        layer = layer_with(w1, w3, w2)
        torch._dynamo.reset()
        step = (lambda x, c: torch.utils.checkpoint.checkpoint(layer, x, c, use_reentrant=False)) if checkpointed else layer
        f = torch.compile(step, fullgraph=True, backend=backend) if compiled else step
        for _ in range(2):
            for p in layer.parameters():
                p.grad = None
            xl = x.clone().requires_grad_()
            out = f(xl, counts)
            out.backward(grad)
        stats = (layer.weight_cache.misses, layer.weight_cache.hits, len(layer.weight_cache._entries))
        runs.append((stats, out.detach(), xl.grad, layer.w1.grad, layer.w3.grad, layer.w2.grad))
    torch._dynamo.reset()
    (eager_stats, *eager), (compiled_stats, *comp) = runs
    assert eager_stats[0] > 0 and eager_stats[1] > 0  # the eager module does use it
    assert compiled_stats == (0, 0, 0)
    got = [sqnr(a, b) for a, b in zip(eager, comp)]
    assert got[0] > 35 and min(got[1:]) > 30, got


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise"])
def test_compiled_experts_compile_twice_across_token_counts(recipe):
    """torch.compile (dynamic=None) over steps whose token count changes: the static
    graph, then one dynamic graph for every count. The backward's choice to run W2's
    weight GEMM last reads the row count; decided on a symbolic count it guarded on it,
    and counts past about w2's bytes / (dim + hidden) rows compiled a third graph."""
    from torch._dynamo.utils import counters

    e, dim, hidden = 8, 256, 256
    g = torch.Generator().manual_seed(5)
    w1, w3, w2 = [(torch.randn(s, generator=g) * 0.05).bfloat16().requires_grad_()
                  for s in ((e, hidden, dim), (e, hidden, dim), (e, dim, hidden))]

    def step(x, counts):
        return experts(x, w1, w3, w2, torch.cumsum(counts, 0, dtype=torch.int32), recipe=recipe)

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(step, backend="aot_eager", fullgraph=True)
    for t in (384, 256, 1800, 2100, 512):  # (the threshold: 1872 rows)
        counts = torch.bincount(torch.randint(0, e - 2, (t,), generator=g), minlength=e)
        f(torch.randn(t, dim, dtype=torch.bfloat16, generator=g).requires_grad_(), counts).float().sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == 2, graphs


def test_reuse_skips_inference_tensor_weights():
    """Weights made under torch.inference_mode() (a model built or loaded there) have no
    version counter: the cache leaves them alone instead of raising, and the output is
    the uncached layer's."""
    with torch.inference_mode():
        cached, plain = (GroupedExperts(64, 128, 2, reuse_weights=r, dtype=torch.bfloat16) for r in (True, False))
        plain.load_state_dict(cached.state_dict())
        x, counts = torch.randn(12, 64, dtype=torch.bfloat16), torch.tensor([5, 7])
    assert cached.w1.is_inference()
    with torch.no_grad():
        assert torch.equal(cached(x, counts), plain(x, counts))
    with torch.inference_mode():
        assert torch.equal(cached(x, counts), plain(x, counts))
    assert cached.weight_cache.hits == cached.weight_cache.misses == len(cached.weight_cache._entries) == 0


@pytest.mark.parametrize("on_parent", [False, True])
def test_fsdp2_reuses_by_the_sharded_parameters(tmp_path, on_parent):
    """FSDP2 (fully_shard on the layer or on a parent; one CPU rank over gloo): the
    all-gather rewrites the unsharded weights without a version bump, so reuse is keyed
    on the sharded parameters the optimizer writes. Micro-batches hit; an optimizer
    step, load_state_dict and an in-place write into the sharded parameter or into its
    state_dict entry (an in-place dcp.load) each make the next call requantize, and
    outputs always equal the unsharded layer's."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ref = GroupedExperts(64, 32, 2, dtype=torch.float32)
        layer = GroupedExperts(64, 32, 2, dtype=torch.float32, reuse_weights=True)
        layer.load_state_dict(ref.state_dict())
        mesh = init_device_mesh("cpu", (1,))
        class Parent(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.experts = layer

            def forward(self, x, counts):
                return self.experts(x, counts)

        root = Parent() if on_parent else layer
        fully_shard(root, mesh=mesh)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, layer)]
        x = torch.randn(40, 64)
        counts = torch.tensor([25, 15])
        cache = layer.weight_cache

        def step(micro_batches=2):
            for _ in range(micro_batches):
                want = ref(x, counts)
                want.sum().backward()
                out = root(x, counts)
                out.sum().backward()
                assert torch.equal(out, want)

        step()
        assert cache.hits > 0
        for o in opts:
            o.step()
            o.zero_grad()
        step()
        assert torch.equal(layer.w1.full_tensor(), ref.w1)
        new = {k: v * 0.5 for k, v in ref.state_dict().items()}
        ref.load_state_dict(new)
        layer.load_state_dict({k: torch.distributed.tensor.distribute_tensor(v, mesh, [torch.distributed.tensor.Shard(0)])
                               for k, v in new.items()})
        misses = cache.misses
        step(1)
        assert cache.misses > misses
        with torch.no_grad():
            ref.w2.mul_(-1)
            layer.w2.mul_(-1)  # (outside forward: the sharded parameter)
        step(1)
        with torch.no_grad():  # (into the state_dict's entries, as an in-place dcp.load writes)
            ref.w1.mul_(2)
            layer.state_dict()["w1"].to_local().mul_(2)
        misses = cache.misses
        step(1)
        assert cache.misses > misses
    finally:
        dist.destroy_process_group()


def test_reuse_off():
    layer = GroupedExperts(32, 32, 2, reuse_weights=False, dtype=torch.bfloat16)
    assert layer.weight_cache is None
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    out = layer(x, torch.tensor([8, 8]))
    assert out.shape == x.shape and "reuse_weights=False" in repr(layer)


def test_cache_distinguishes_tensors():
    """Two weights with the same version and shape never share an entry."""
    cache = WeightCache()
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert cache.get("w", (a,), (), lambda: "A") == "A"
    assert cache.get("w", (b,), (), lambda: "B") == "B"
    assert cache.get("w", (b,), (), lambda: "C") == "B"
    assert cache.get("w", (b,), ("other recipe",), lambda: "D") == "D"


# ---- module, compile, errors -----------------------------------------------------------


def test_module_layout_and_state_dict():
    layer = GroupedExperts(48, 80, 5)
    assert tuple(layer.w1.shape) == (5, 80, 48) and tuple(layer.w3.shape) == (5, 80, 48)
    assert tuple(layer.w2.shape) == (5, 48, 80)
    assert set(layer.state_dict()) == {"w1", "w2", "w3"}
    assert layer.w1.std().item() == pytest.approx(0.02, rel=0.2)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    x, w1, w3, w2, offs, grad = make(3, 64, 64, 96, device, offs=[32, 32, 96])
    eager_out, eager_grads = run(experts, (x, w1, w3, w2, offs), grad)
    torch._dynamo.reset()
    f = torch.compile(lambda *a: experts(*a), fullgraph=True, backend="aot_eager")
    out, grads = run(f, (x, w1, w3, w2, offs), grad)
    # AOT autograd decomposes silu / silu_backward into primitive ops whose bf16
    # rounding can differ from the fused eager kernels by an ulp (seen on CUDA), and an
    # ulp can move an fp8 code: equal up to that, not bit for bit.
    got = [sqnr(eager_out, out)] + [sqnr(a, b) for a, b in zip(eager_grads, grads)]
    print("compiled vs eager SQNR (out, x, w1, w3, w2):", [round(v, 1) for v in got])
    assert got[0] > 40 and min(got[1:]) > 35, got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("copy_output", [True, False])
def test_compiled_fused_function_has_real_gradients(device, recipe, copy_output, monkeypatch, request):
    """The fused Function compiled (fullgraph) against eager, for every recipe: the
    failure guarded against is all-zero gradients. torch < 2.13 gives them for an output
    last written in place, unless the layer returns a copy (``_COPY_COMPILED_OUTPUT``)."""
    mod = importlib.import_module("moe_fp8_ext.experts")  # (the package attribute is the function)
    if not copy_output:
        if not mod._COPY_COMPILED_OUTPUT:
            pytest.skip("this torch compiles the Function's own output correctly: no copy is made")
        if recipe != "fp8_rowwise" or device != "cpu":
            pytest.skip("the torch bug is shown once (fp8_rowwise on the CPU zeroes the tail in place)")
        request.node.add_marker(pytest.mark.xfail(strict=True, reason="torch < 2.13: zero gradients without the copy"))
    monkeypatch.setattr(mod, "_COPY_COMPILED_OUTPUT", copy_output)
    x, w1, w3, w2, offs, grad = make(2, 64, 64, 80, device, offs=[48, 80])
    f = functools.partial(experts, recipe=recipe)
    eager_out, eager_grads = run(f, (x, w1, w3, w2, offs), grad)
    torch._dynamo.reset()
    out, grads = run(torch.compile(f, fullgraph=True, backend="aot_eager"), (x, w1, w3, w2, offs), grad)
    torch._dynamo.reset()
    got = [sqnr(eager_out, out)] + [sqnr(a, b) for a, b in zip(eager_grads, grads)]
    assert got[0] > 35 and min(got[1:]) > 30, got


@pytest.mark.parametrize("bad, match", [
    (lambda x, w1, w3, w2, o: (x[:, :10], w1, w3, w2, o), "expected w1 and w3"),
    (lambda x, w1, w3, w2, o: (x, w1, w3[:1], w2, o), "expected w1 and w3"),
    (lambda x, w1, w3, w2, o: (x, w1, w3, w2, o.long()), "expected offs int32"),
    (lambda x, w1, w3, w2, o: (x.int(), w1, w3, w2, o), "expected x of dtype"),
    (lambda x, w1, w3, w2, o: (x, w1[0], w3, w2, o), "expected x 2-D"),
    (lambda x, w1, w3, w2, o: (x, w1, w3, w2, torch.tensor([5, 3], dtype=torch.int32)), "non-decreasing"),
])
def test_bad_arguments(bad, match):
    x, w1, w3, w2, offs, _ = make(2, 32, 32, 16, "cpu", offs=[8, 16])
    with pytest.raises((ValueError, TypeError), match=match):
        experts(*bad(x, w1, w3, w2, offs))
    with pytest.raises(ValueError, match="fp8_dtype"):
        experts(x, w1, w3, w2, offs, fp8_dtype=torch.float16)
    with pytest.raises(ValueError, match="multiples of 8"):
        w1b = torch.zeros(2, 30, 32, dtype=torch.bfloat16)
        experts(x, w1b, w1b, torch.zeros(2, 32, 30, dtype=torch.bfloat16), offs, recipe="bf16")


def test_reuse_under_swapped_module_params():
    """load_state_dict and .to() swap parameter tensors under
    set_swap_module_params_on_conversion(True) (torch.utils.swap_tensors): the cache holds
    no reference that stops them, and the swapped-in weights are used."""
    x, w1, w3, w2, offs, _ = make(2, 32, 64, 64, "cpu", offs=[30, 64])
    counts = torch.tensor([30, 34])
    layer = layer_with(w1, w3, w2)
    layer(x, counts)
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        layer.load_state_dict({k: v * 2 for k, v in layer.state_dict().items()})
        assert torch.equal(layer(x, counts), experts(x, layer.w1, layer.w3, layer.w2, offs))
        layer.to(torch.float32)
        assert torch.equal(layer(x.float(), counts), experts(x.float(), layer.w1, layer.w3, layer.w2, offs))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_compiled_blockwise_backward_reuses_the_forward_weight_operands():
    """Under compile nothing lives on ctx: the backward weight operands that the forward's
    one read makes (fp8_blockwise's weight dual ops, hold_weight_operands=True) are saved,
    not made again."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = {"fw": [], "bw": []}

    def recorder(kind):
        def compiler(gm, example_inputs):
            graphs[kind] += [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return gm.forward
        return compiler

    x, w1, w3, w2, offs, grad = make(2, 128, 128, 96, "cpu", offs=[40, 96])
    f = functools.partial(experts, recipe=holding("fp8_blockwise"))
    want_out, want = run(f, (x, w1, w3, w2, offs), grad)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"))
    out, got = run(torch.compile(f, fullgraph=True, backend=backend), (x, w1, w3, w2, offs), grad)
    torch._dynamo.reset()
    assert any("quantize_blockwise_weight_dual_cat" in t for t in graphs["fw"]), graphs["fw"]
    assert any("quantize_blockwise_weight_dual." in t for t in graphs["fw"]), graphs["fw"]
    assert not any("quantize_blockwise_weight" in t for t in graphs["bw"]), graphs["bw"]
    for a, b in zip([want_out] + want, [out] + got):
        assert sqnr(a, b) > 35


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise"])
def test_compiled_backward_reads_grad_out_before_the_dswiglu(recipe):
    """Under compile the output gradient's colwise operand is made with its rowwise one,
    so the backward graph reads grad_out for the last time before the dSwiGLU (Inductor
    frees it there: the step's peak is at the dSwiGLU for fp8_rowwise). Bits as eager."""
    from torch._dynamo.backends.common import aot_autograd

    seen = {}

    def bw_compiler(gm, example_inputs):
        nodes = list(gm.graph.nodes)
        tangent = next(n for n in nodes if n.op == "placeholder" and n.name.startswith("tangents"))
        readers = [i for i, n in enumerate(nodes) if tangent in n.all_input_nodes]
        dswiglu = [i for i, n in enumerate(nodes) if "swiglu" in str(n.target)]
        seen.update(readers=readers, dswiglu=dswiglu)
        return gm.forward

    x, w1, w3, w2, offs, grad = make(3, 128, 128, 200, "cpu", offs=[40, 40, 200])
    f = functools.partial(experts, recipe=recipe, pad_groups=True)
    want_out, want = run(f, (x, w1, w3, w2, offs), grad)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=bw_compiler)
    out, got = run(torch.compile(f, fullgraph=True, backend=backend), (x, w1, w3, w2, offs), grad)
    torch._dynamo.reset()
    assert seen["readers"] and seen["dswiglu"], seen
    assert max(seen["readers"]) < min(seen["dswiglu"]), seen
    for a, b in zip([want_out] + want, [out] + got):
        assert torch.equal(a, b)


# ---- main_grads: weight gradients added to fp32 main gradients (gradient accumulation fusion)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["bf16", "fp8_rowwise", "fp8_blockwise"])
def test_main_grads_accumulate_as_autograd_does(device, recipe):
    """Over two micro-batches (empty and odd groups), main_grads gain the weights' gradients in place and the weights
    get no .grad; x's gradient is unchanged. Where the recipe adds after its GEMM (all but the fp8 recipes on
    Hopper: test_main_grads_fused_on_hopper) the sums are autograd's accumulation of .grad bit for bit."""
    from moe_fp8_ext import blockwise_gemm, rowwise_gemm

    kernels = {"fp8_blockwise": blockwise_gemm, "fp8_rowwise": rowwise_gemm}  # (the GEMMs that add)
    if device == "cuda" and recipe in kernels and kernels[recipe].available("cuda"):
        pytest.skip("the fused GEMM adds the unrounded product: test_main_grads_fused_on_hopper")
    batches = [make(4, 256, 128, 384, device, dtype=torch.float32, seed=s, offs=offs)
               for s, offs in ((1, [0, 129, 129, 384]), (2, [200, 201, 300, 384]))]
    ws = [w.clone().requires_grad_() for w in batches[0][1:4]]
    fused = [w.clone().requires_grad_() for w in batches[0][1:4]]
    mains = tuple(torch.zeros_like(w) for w in ws)
    for x, _, _, _, offs, grad in batches:
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        experts(xa, *ws, offs, recipe=recipe).backward(grad)
        experts(xb, *fused, offs, recipe=recipe, main_grads=mains).backward(grad)
        assert torch.equal(xa.grad, xb.grad)
    assert all(w.grad is None for w in fused)
    for m, w in zip(mains, ws):
        assert torch.equal(m, w.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
def test_main_grads_fused_on_hopper(recipe):
    """experts(main_grads=...) on Hopper with either fp8 recipe: the weights' gradients added to fp32 main gradients
    by the GEMM (no .grad), twice over two micro-batches; against autograd's bf16 gradients summed in fp32 (within
    the bf16 rounding those carry)."""
    from moe_fp8_ext import blockwise_gemm, rowwise_gemm

    if not {"fp8_blockwise": blockwise_gemm, "fp8_rowwise": rowwise_gemm}[recipe].available("cuda"):
        pytest.skip("needs an NVIDIA GPU of compute capability 9.0 and the sm_90a build")
    torch.manual_seed(0)
    e, d, h = 4, 256, 384
    ws = [(torch.randn(e, h, d, device="cuda") * 0.05), (torch.randn(e, h, d, device="cuda") * 0.05),
          (torch.randn(e, d, h, device="cuda") * 0.05)]
    sizes = [[300, 0, 129, 211], [128, 500, 1, 7]]
    xs = [torch.randn(sum(z), d, device="cuda", dtype=torch.bfloat16) for z in sizes]
    counts = [torch.tensor(z, device="cuda") for z in sizes]
    ref_w = [w.bfloat16().requires_grad_() for w in ws]
    fused_w = [w.bfloat16().requires_grad_() for w in ws]
    mains = tuple(torch.zeros_like(w) for w in ws)
    ref = [torch.zeros_like(w) for w in ws]
    for x, c in zip(xs, counts):
        offs = torch.cumsum(c, 0).to(torch.int32)
        for w in ref_w:
            w.grad = None
        experts(x, *ref_w, offs, recipe=recipe).float().square().sum().backward()
        for r, w in zip(ref, ref_w):
            r += w.grad.float()
        experts(x, *fused_w, offs, recipe=recipe, main_grads=mains).float().square().sum().backward()
    assert all(w.grad is None for w in fused_w)
    for m, r in zip(mains, ref):
        assert bool(((m - r).abs() <= 2.0**-7 * r.abs() + 2.0**-7 * r.abs().max()).all())


def test_main_grads_checks():
    x, w1, w3, w2, offs, _ = make(2, 64, 32, 16, "cpu", dtype=torch.float32)
    good = [torch.zeros_like(w) for w in (w1, w3, w2)]
    for bad, msg in (((good[0], good[1]), "expected main_grads to be None or three tensors"),
                     ((good[0].bfloat16(), good[1], good[2]), "expected the main gradient of w1 float32 of shape"),
                     ((good[0], good[1], good[2][:, :16]), "expected the main gradient of w2 float32 of shape"),
                     ((good[0], good[1].transpose(1, 2).contiguous().transpose(1, 2), good[2]),
                      "expected the main gradient of w3 contiguous")):
        with pytest.raises((TypeError, ValueError), match=msg):
            experts(x, w1, w3, w2, offs, recipe="bf16", main_grads=bad)


def test_grouped_experts_fuse_grad_accumulation():
    """GroupedExperts(fuse_grad_accumulation=True): each weight's main_grad made as fp32 zeros by the first forward,
    then added to by every backward (twice the same batch: twice the gradient, exactly); .grad stays None."""
    torch.manual_seed(0)
    layer = GroupedExperts(128, 256, 4, recipe="fp8_blockwise", dtype=torch.float32, fuse_grad_accumulation=True)
    assert "fuse_grad_accumulation=True" in repr(layer)
    x, counts = torch.randn(300, 128), torch.tensor([100, 0, 150, 50])
    layer(x, counts).square().sum().backward()
    once = [p.main_grad.clone() for p in (layer.w1, layer.w3, layer.w2)]
    assert all(p.grad is None and p.main_grad.dtype == torch.float32 for p in (layer.w1, layer.w3, layer.w2))
    assert all(bool(g.abs().sum() > 0) for g in once)
    layer(x, counts).square().sum().backward()
    for p, g in zip((layer.w1, layer.w3, layer.w2), once):
        assert torch.equal(p.main_grad, 2 * g)
    with pytest.raises(TypeError, match="expected fuse_grad_accumulation to be a bool"):
        GroupedExperts(128, 256, 4, fuse_grad_accumulation=1)


@pytest.mark.parametrize("recipe, ours", [("fp8_blockwise", True), ("fp8_blockwise+dswiglu", True),
                                          ("fp8_rowwise", True), ("fp8_rowwise", False)])
def test_hopper_paths_trace_rows_of_unbacked_size(monkeypatch, recipe, ours):
    """Rows of a size torch.compile knows only at run time (unbacked: after expert
    parallelism's all-to-all, as torchtitan compiles it) through the sm90 paths'
    Python and fakes, forward and backward (fake tensors with an unbacked row count;
    the backends forced, as no GPU is needed to trace): no check or choice guards on it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from moe_fp8_ext import rowwise_gemm
    from moe_fp8_ext.recipes import Fp8Blockwise, Fp8Rowwise

    monkeypatch.setattr(Fp8Blockwise, "backend", lambda self, device: "blockwise_gemm")
    monkeypatch.setattr(Fp8Rowwise, "backend", lambda self, device: "fp8_gemm")
    monkeypatch.setattr(rowwise_gemm, "available", lambda device=None: ours)  # (ours, or torch's GEMM)
    r = Fp8Blockwise(dswiglu_in_gemm=True) if recipe.endswith("+dswiglu") else get_recipe(recipe)
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        m = env.create_unbacked_symint()
        torch._check(m >= 0)
        torch._check(m <= 2 ** 20)
        x, w1, w3, w2 = (torch.empty(s, dtype=torch.bfloat16, device="meta", requires_grad=True)
                         for s in ((m, 256), (4, 256, 256), (4, 256, 256), (4, 256, 256)))
        out = experts(x, w1, w3, w2, torch.empty(4, dtype=torch.int32, device="meta"), recipe=r)
        grads = torch.autograd.grad(out, (x, w1, w3, w2), torch.empty_like(out))
    assert out.shape == (m, 256) and [g.shape for g in grads] == [(m, 256)] + [(4, 256, 256)] * 3
