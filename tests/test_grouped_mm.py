"""grouped_mm: numerics against fp32 (SQNR), autograd wiring, torch.compile, a short
MoE FFN training run, and errors. On the CPU (and GPUs without an FP8 grouped GEMM)
this runs the emulated path; on sm90+ the FP8 GEMM."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

import moe_fp8_ext
from moe_fp8_ext import reference as ref
from conftest import (DEVICES, count_backward_operand_calls, count_zero_rows_calls, count_zero_tail_calls,
                      force_weights_read_once, holding, spy_weight_bwd_calls,
                      offs_from_sizes as make_offs, poison, random_offs, randn, requires_cuda, set_dual_kernel_budget,
                      sqnr)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from workloads import MoEExperts  # noqa: E402  (bench/workloads.py: the three-grouped_mm experts layer)

F8 = torch.float8_e4m3fn


CASES = {  # (M, K, N, group sizes)
    # At least ~10^5 elements of A: below that, a handful of outliers moves the SQNR of
    # a fresh draw by more than a dB (measured: K=64 shapes dip under 27 dB in 2-8%
    # of draws; these stay above 27.8 dB over 100 draws each).
    "e4": (512, 256, 64, [128, 0, 256, 128]),
    "e1": (512, 256, 96, [512]),
    "e8_empty": (512, 256, 128, [0, 96, 32, 0, 160, 64, 160, 0]),
    "tail_rows": (640, 256, 48, [192, 384]),  # rows past offs[-1] belong to no group
    "tail_rows_odd_m": (600, 256, 48, [192, 0, 384]),  # and M not a multiple of 16
    # Any group sizes (pad_groups=True, the default): odd, empty, one expert.
    "unaligned_e5": (601, 256, 64, [13, 0, 177, 250, 161]),
    "unaligned_e1": (517, 256, 32, [517]),
    "unaligned_e9_tail": (768, 256, 48, [1, 33, 0, 0, 100, 7, 450, 150, 2]),
}


def fp32_reference(a, b_t, offs):
    a32 = a.detach().float().requires_grad_()
    b32 = b_t.detach().float().requires_grad_()
    out = torch._grouped_mm(a32, b32, offs=offs)
    return a32, b32, out


# Per recipe: shapes, SQNR floors (out, grad_A, grad_B dB vs fp32, e4m3 pow2 scales, N(0,1)+outlier activations,
# N(0, 0.02) weights), cases also run aligned with pad_groups=False, data seed (None: fresh draw), recipes printed
# beside it. MXFP8 meets fp8_rowwise's floors: with pow2 scales both round every value to e4m3's 3 mantissa bits.
MX_CASES = {  # (M, K, N, group sizes): K and N multiples of 32
    "e4": (512, 256, 64, [128, 0, 256, 128]),
    "e1": (512, 256, 96, [512]),
    "e8_empty": (512, 256, 128, [0, 96, 32, 0, 160, 64, 160, 0]),
    "tail_rows_odd_m": (600, 256, 96, [192, 0, 384]),  # rows past offs[-1]; M % 32 != 0
    "unaligned_e5": (601, 256, 64, [13, 0, 177, 250, 161]),
    "unaligned_e1": (517, 256, 32, [517]),
    "unaligned_e9_tail": (768, 256, 64, [1, 33, 0, 0, 100, 7, 450, 150, 2]),
}
SQNR_CASES = {"fp8_rowwise": CASES, "mxfp8": MX_CASES}
SQNR_FLOORS = {"fp8_rowwise": (27, 25, 22), "mxfp8": (27, 25, 22)}
SQNR_ALIGNED = {"fp8_rowwise": ["e4", "e1", "e8_empty", "tail_rows", "tail_rows_odd_m"],
                "mxfp8": ["e4", "e1", "e8_empty"]}  # group sizes multiples of the alignment
SQNR_SEED = {"fp8_rowwise": None, "mxfp8": 0}
SQNR_BESIDE = {"fp8_rowwise": (), "mxfp8": ("fp8_rowwise",)}


def recipe_cases(table):
    return [(recipe, case) for recipe, cases in table.items() for case in cases]


def sqnr_vs_fp32(m, k, n, offs, device, recipes_, pad_groups=True, seed=None, outliers=False):
    """{recipe: (out, grad_A, grad_B) SQNR vs fp32} of grouped_mm forward and backward on
    the same data (A with outliers; with ``outliers`` B and grad_out too), after the
    checks every recipe must pass: bf16 output of the right shape, gradients of the
    inputs' shapes, rows past offs[-1] zero. grad_B's SQNR is inf where the fp32 one is
    all zero. ``seed`` None: a fresh draw."""
    seeds = (None,) * 3 if seed is None else (seed, seed + 1, seed + 2)
    a0 = randn((m, k), torch.bfloat16, device, seed=seeds[0])
    b0 = (randn((offs.numel(), n, k), torch.bfloat16, device, outliers=outliers, seed=seeds[1]) * 0.02).transpose(1, 2)
    grad = randn((m, n), torch.bfloat16, device, outliers=outliers, seed=seeds[2])
    a32, b32, out32 = fp32_reference(a0.cpu(), b0.cpu(), offs.cpu())  # fp32 reference on the CPU
    out32.backward(grad.float().cpu())
    used = int(offs[-1])
    result = {}
    for recipe in recipes_:
        a, b_t = a0.clone().requires_grad_(), b0.detach().clone().requires_grad_()
        out = moe_fp8_ext.grouped_mm(a, b_t, offs, recipe=recipe, pad_groups=pad_groups)
        out.backward(grad)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n) and a.grad.shape == a.shape and b_t.grad.shape == b_t.shape
        assert bool((out[used:] == 0).all()), "rows past offs[-1] have no output"
        assert bool((a.grad[used:] == 0).all()), "rows past offs[-1] get no gradient"
        out, ga, gb = out.cpu(), a.grad.cpu(), b_t.grad.cpu()
        gb = sqnr(b32.grad, gb) if b32.grad.abs().max() > 0 else float("inf")
        result[recipe] = (sqnr(out32[:used], out[:used]), sqnr(a32.grad[:used], ga[:used]), gb)
    print(f"({m}, {k}, {n}) {device}: " + ", ".join(f"{r} out {o:.2f} grad_A {ga:.2f} grad_B {gb:.2f} dB"
                                                     for r, (o, ga, gb) in result.items()))
    return result


def check_sqnr_floors(recipe, m, k, n, offs, device, pad_groups=True, seed=None):
    res = sqnr_vs_fp32(m, k, n, offs, device, (*SQNR_BESIDE[recipe], recipe), pad_groups, seed)
    o, ga, gb = res[recipe]
    fo, fga, fgb = SQNR_FLOORS[recipe]
    assert o >= fo and ga >= fga and gb >= fgb, (torch.diff(offs.cpu(), prepend=offs.new_zeros(1).cpu()).tolist(), res)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe, case", recipe_cases(SQNR_CASES))
def test_sqnr_against_fp32(device, recipe, case):
    m, k, n, sizes = SQNR_CASES[recipe][case]
    check_sqnr_floors(recipe, m, k, n, make_offs(sizes, device), device, seed=SQNR_SEED[recipe])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe, case", recipe_cases(SQNR_ALIGNED))
def test_sqnr_aligned_groups_without_padding(device, recipe, case):
    # pad_groups=False: groups of multiples of the alignment, any M (with rows past
    # offs[-1], an M that is not a multiple of it still needs the padded weight-gradient
    # layout).
    m, k, n, sizes = SQNR_CASES[recipe][case]
    check_sqnr_floors(recipe, m, k, n, make_offs(sizes, device), device, pad_groups=False, seed=SQNR_SEED[recipe])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", list(SQNR_FLOORS))
@pytest.mark.parametrize("experts", [1, 7, 32])
def test_sqnr_random_unaligned_groups(device, recipe, experts):
    # Fresh random group sizes (any size, some empty, rows past the last group) and data
    # every run: pad_groups=True.
    m = max(512, 40 * experts) + 3
    check_sqnr_floors(recipe, m, 256, 64, random_offs(m, experts, tail=3, device=device), device)


def test_backward_is_the_quantized_math():
    # Output and gradients are the products of the quantized operands (emulated path): checks autograd wiring, operand
    # layouts, scale placement. Both sides sum in fp32 in different orders, then round to bf16: allow one bf16 ulp
    # (2^-7 relative at most) where a sum lands on a rounding boundary.
    m, k, n, sizes = CASES["e4"]
    offs = make_offs(sizes, "cpu")
    a = randn((m, k), torch.bfloat16).requires_grad_()
    b_t = (randn((4, k, n), torch.bfloat16, outliers=False) * 0.02).requires_grad_()
    grad = randn((m, n), torch.bfloat16)
    out = moe_fp8_ext.grouped_mm(a, b_t, offs)
    out.backward(grad)

    qa, sa = ref.quantize_rowwise(a.detach(), F8)
    qb, sb = ref.quantize_experts_fwd(b_t.detach(), F8)
    want_out = torch._grouped_mm(qa.float() * sa, qb.float() * sb, offs=offs).to(torch.bfloat16)
    qg, sg = ref.quantize_rowwise(grad, F8)
    qw, sw = ref.quantize_experts_bwd(b_t.detach(), F8)
    want_ga = torch._grouped_mm(qg.float() * sg, qw.float() * sw, offs=offs).to(torch.bfloat16)
    qgc, sgc, qac, sac = ref.quantize_jagged_colwise_dual(grad, a.detach(), offs, F8)
    gid = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    want_gb = torch._grouped_mm((qgc.float() * sgc[gid]).t(), qac.float() * sac[gid], offs=offs).to(torch.bfloat16)
    for got, want in ((out, want_out), (a.grad, want_ga), (b_t.grad, want_gb.transpose(1, 2))):
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_groups_match_explicit_padding(device):
    # pad_groups runs the forward and input gradient unpadded and quantizes the weight
    # gradient's operands straight into the padded layout. Padding the input by hand,
    # running the aligned path and unpadding must give the same numbers.
    m, k, n, sizes = CASES["unaligned_e9_tail"]
    offs = make_offs(sizes, device)
    a = randn((m, k), torch.bfloat16, device)
    b_t = (randn((len(sizes), n, k), torch.bfloat16, device, outliers=False) * 0.02).transpose(1, 2)
    grad = randn((m, n), torch.bfloat16, device, outliers=False)
    got = []
    for explicit in (False, True):
        aa, bb = a.clone().requires_grad_(), b_t.detach().clone().requires_grad_()
        if explicit:
            ap, starts, ends = moe_fp8_ext.pad_token_groups(aa, offs, 16)
            out = moe_fp8_ext.unpad_token_groups(moe_fp8_ext.grouped_mm(ap, bb, ends, pad_groups=False), offs, starts, m)
        else:
            out = moe_fp8_ext.grouped_mm(aa, bb, offs)
        out.backward(grad)
        used = int(offs[-1])
        got.append((out[:used].float(), aa.grad[:used].float(), bb.grad.float()))
    for fused, explicit in zip(*got):
        torch.testing.assert_close(fused, explicit, rtol=2**-7, atol=1e-5)  # one bf16 ulp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("needs_b", [True, False])
def test_saves_fp8_a_instead_of_a(device, needs_b):
    # fp8_rowwise makes A's weight-gradient operand with its forward one (one read) and
    # saves it instead of A when B needs a gradient; otherwise nothing of A is kept
    # (only the weight gradient reads it).
    offs = make_offs([40, 0, 70], device)
    a = randn((120, 64), torch.bfloat16, device).requires_grad_()
    b_t = (randn((3, 64, 32), torch.bfloat16, device) * 0.02).requires_grad_(needs_b)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = moe_fp8_ext.grouped_mm(a, b_t, offs)
    fp8_a = [t for t in saved if t.dtype == F8 and t.shape == (moe_fp8_ext.padded_rows(120, 3, 16), 64)]
    bf16_a = [t for t in saved if t.dtype == a.dtype and t.data_ptr() == a.data_ptr()]
    assert (len(fp8_a), len(bf16_a)) == ((1, 0) if needs_b else (0, 0))
    out.float().sum().backward()
    assert a.grad is not None and (b_t.grad is not None) == needs_b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name,dual_kernel", [("fp8_rowwise", "0"), ("fp8_rowwise", "default"),
                                                     ("fp8_blockwise", "default")])
def test_weight_backward_operand_made_in_forward(device, recipe_name, dual_kernel, monkeypatch):
    # Where one read makes both weight operands (bwd=SAME_READ; the rule forced so CPU and kernel-off GPU run it),
    # the forward makes B_t's dgrad operand, held on ctx until the dgrad GEMM: same bits as the backward's (rowwise) or
    # the dual's transposed half (blockwise). A second backward re-quantizes; hold_weight_operands=False (the default)
    # holds nothing.
    import weakref

    set_dual_kernel_budget(monkeypatch, dual_kernel)
    m, k, n, sizes = (123, 64, 48, [40, 0, 25, 51]) if recipe_name == "fp8_rowwise" else (300, 256, 128, [130, 0, 170])
    offs = make_offs(sizes, device)
    a = randn((m, k), torch.bfloat16, device)
    b_t = randn((len(sizes), n, k), torch.bfloat16, device).transpose(1, 2) * 0.02  # W (E, N, K) contiguous
    grad = randn((m, n), torch.bfloat16, device)
    recipe = type(moe_fp8_ext.recipes.get_recipe(recipe_name))
    real_cat_ok = moe_fp8_ext.blockwise.weight_cat_ok
    rhs_bwd_calls, real_quantize_weights = spy_weight_bwd_calls(monkeypatch, recipe_name)
    results = []
    for once in (False, True):
        force_weights_read_once(monkeypatch, recipe_name, real_cat_ok if once and recipe_name == "fp8_blockwise" else once)
        aa, bb = a.clone().requires_grad_(), b_t.clone().requires_grad_()
        out = moe_fp8_ext.grouped_mm(aa, bb, offs, recipe=holding(recipe_name))
        box = out.grad_fn.bwd_box
        assert (box is not None and len(box) == 1) == once
        held = weakref.ref(box[0][0]) if once else None
        rhs_bwd_calls.clear()
        ga, gb = torch.autograd.grad(out, (aa, bb), grad, retain_graph=True)
        assert not box and (held is None or held() is None)  # dropped once used, and freed
        assert len(rhs_bwd_calls) == (0 if once else 1)  # the held operand is the one the dgrad GEMM used
        ga2, gb2 = torch.autograd.grad(out, (aa, bb), grad)  # B_t quantized again
        assert len(rhs_bwd_calls) == (1 if once else 2)
        assert torch.equal(ga, ga2) and torch.equal(gb, gb2)
        results.append((out.detach(), ga, gb))
    monkeypatch.setattr(recipe, "quantize_weights", real_quantize_weights)  # (a side effect compile cannot trace)
    for x, y in zip(*results):
        assert torch.equal(x, y)
    # Switched off: nothing held, the same bits.
    held_nothing = moe_fp8_ext.recipes.get_recipe(recipe_name)
    assert not held_nothing.hold_weight_operands and hash(held_nothing) != hash(holding(recipe_name))  # (a constant)
    aa, bb = a.clone().requires_grad_(), b_t.clone().requires_grad_()
    out = moe_fp8_ext.grouped_mm(aa, bb, offs, recipe=held_nothing)
    assert out.grad_fn.bwd_box is None
    assert all(name != "bwd" for name, *_ in out.grad_fn.layout)  # not even saved
    for x, y in zip((out.detach(), *torch.autograd.grad(out, (aa, bb), grad)), results[0]):
        assert torch.equal(x, y)
    # Only where the input gradient is wanted; and never under saved-tensor hooks
    # (activation checkpointing must see every saved tensor).
    out = moe_fp8_ext.grouped_mm(a, b_t.clone().requires_grad_(), offs, recipe=holding(recipe_name))
    assert out.grad_fn.bwd_box is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = moe_fp8_ext.grouped_mm(a.clone().requires_grad_(), b_t.clone().requires_grad_(), offs,
                                     recipe=holding(recipe_name))
    assert out.grad_fn.bwd_box is None
    # Nor under torch.compile, where the recipe's check is not even asked (the real one
    # reads data pointers, which fullgraph tracing cannot: it broke the graph on a GPU).
    if recipe_name != "fp8_rowwise":
        return

    def untraceable(b_ts):
        return b_ts[0].data_ptr() % 16 == 0

    force_weights_read_once(monkeypatch, recipe_name, untraceable)
    torch._dynamo.reset()
    held = holding(recipe_name)
    step = torch.compile(lambda x, w: (moe_fp8_ext.grouped_mm(x, w, offs, recipe=held).float() * grad.float()).sum(),
                         fullgraph=True)
    aa, bb = a.clone().requires_grad_(), b_t.clone().requires_grad_()
    step(aa, bb).backward()
    for x, y in zip((aa.grad, bb.grad), results[0][1:]):
        torch.testing.assert_close(x, y, rtol=1e-2, atol=1e-2)  # same quantized math; fusion may reorder fp32 sums


@pytest.mark.parametrize("recipe_name", ["fp8_rowwise", "fp8_blockwise"])
def test_no_grad_makes_nothing_for_backward(recipe_name, monkeypatch):
    # Under no_grad (eval, inference) the forward runs the forward operands only: no
    # weight dgrad operand, no fp8 saved A (autograd sets needs_input_grad there too),
    # and the output is the grad-mode one.
    calls, recipe = count_backward_operand_calls(monkeypatch, recipe_name)
    force_weights_read_once(monkeypatch, recipe_name, True)
    offs = make_offs([40, 0, 88], "cpu")
    a = randn((130, 128), torch.bfloat16).requires_grad_()  # 130 rows: the padded wgrad layout
    b_t = (randn((3, 128, 128), torch.bfloat16) * 0.02).requires_grad_()
    out = moe_fp8_ext.grouped_mm(a, b_t, offs, recipe=holding(recipe_name))
    made = sorted(set(calls))
    assert made == (["quantize_both", "weight_dual", "weights_both"] if recipe_name == "fp8_blockwise"
                    else ["quantize_both", "weights_both"])
    calls.clear()
    with torch.no_grad():
        out2 = moe_fp8_ext.grouped_mm(a, b_t, offs, recipe=holding(recipe_name))
    assert calls == [] and torch.equal(out.detach(), out2)


@pytest.mark.parametrize("recipe_name", ["fp8_rowwise", "fp8_blockwise", "mxfp8", "bf16"])
@pytest.mark.parametrize("needs", ["a", "b"])
def test_saves_only_what_the_gradients_need(recipe_name, needs):
    # A is read only by the weight gradient, B_t only by the input gradient: when a gradient is not wanted, nothing is
    # kept of the operand only it reads (frozen experts keep no activation). The gradient computed is the full call's,
    # bit for bit.
    offs = make_offs([64, 0, 96], "cpu")
    a = randn((200, 128), torch.bfloat16)
    b_t = (randn((3, 128, 128), torch.bfloat16) * 0.02).transpose(1, 2)
    grad = randn((200, 128), torch.bfloat16)
    aa, bb = a.clone().requires_grad_(), b_t.detach().clone().requires_grad_()
    full = torch.autograd.grad(moe_fp8_ext.grouped_mm(aa, bb, offs, recipe=recipe_name), (aa, bb), grad)
    aa, bb = a.clone().requires_grad_(needs == "a"), b_t.detach().clone().requires_grad_(needs == "b")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = moe_fp8_ext.grouped_mm(aa, bb, offs, recipe=recipe_name)
    unread = aa if needs == "a" else bb  # A feeds only grad_B, B_t only grad_A
    assert not [t for t in saved if t.untyped_storage().data_ptr() == unread.untyped_storage().data_ptr()]
    # nor an fp8 operand made from it: A's is 2-D, the weight's 3-D
    low = [t for t in saved if t.dtype not in (torch.bfloat16, torch.float32, torch.int32, torch.int64)]
    assert not [t for t in low if t.dim() == (2 if needs == "a" else 3)]
    (g,) = torch.autograd.grad(out, aa if needs == "a" else bb, grad)
    assert torch.equal(g, full[0] if needs == "a" else full[1])


@pytest.mark.parametrize("recipe_name", ["fp8_rowwise", "fp8_blockwise", "bf16"])
def test_in_place_weight_write_before_backward_raises(recipe_name, monkeypatch):
    # The weight stays saved wherever the input gradient runs: an in-place write between forward and backward raises
    # autograd's error as bf16 does, rather than a dgrad of the old weight beside a wgrad of the new one.
    # (Under saved-tensor hooks PyTorch checks no versions, for any recipe.)
    if recipe_name != "bf16":
        force_weights_read_once(monkeypatch, recipe_name, True)  # the held path on the CPU too
    offs = make_offs([64, 0, 96], "cpu")
    a = randn((200, 128), torch.bfloat16).requires_grad_()
    w = (randn((3, 128, 128), torch.bfloat16) * 0.02).requires_grad_()  # W (E, N, K)
    recipe = recipe_name if recipe_name == "bf16" else holding(recipe_name)
    out = moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs, recipe=recipe)
    assert (out.grad_fn.bwd_box is not None) == (recipe_name != "bf16")  # the held path
    with torch.no_grad():
        w.mul_(2)  # what an optimizer step does
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


def test_needs_only_weight_grad():
    offs = make_offs([32, 32], "cpu")
    a = randn((64, 32), torch.bfloat16)
    b_t = (randn((2, 32, 16), torch.bfloat16) * 0.02).requires_grad_()
    moe_fp8_ext.grouped_mm(a, b_t, offs).float().sum().backward()
    assert a.grad is None and b_t.grad is not None and torch.isfinite(b_t.grad.float()).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8"])
@pytest.mark.parametrize("case", ["e4", "unaligned_e5"])
def test_compile_fullgraph_forward_backward(device, recipe, case):
    m, k, n, sizes = SQNR_CASES[recipe][case]
    offs = make_offs(sizes, device)
    a = randn((m, k), torch.bfloat16, device)
    b_t = (randn((len(sizes), n, k), torch.bfloat16, device, outliers=False) * 0.02).transpose(1, 2)

    def step(a, b_t, offs):
        return moe_fp8_ext.grouped_mm(a, b_t, offs, recipe=recipe).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        aa, bb = a.clone().requires_grad_(), b_t.detach().clone().requires_grad_()
        loss = fn(aa, bb, offs)
        loss.backward()
        results.append((loss.detach(), aa.grad, bb.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=1e-2, atol=1e-2)  # same quantized math; fusion may reorder fp32 sums


def train(recipe, dtype, steps=50, device="cpu", layer=False):
    """Loss curve of the MoE SwiGLU FFN on a regression task: three grouped_mm calls
    (MoEExperts), or with ``layer`` the fused moe_fp8_ext.GroupedExperts."""
    torch.manual_seed(0)
    experts, dim, hidden, tokens = 4, 64, 128, 256
    if layer:
        model = moe_fp8_ext.GroupedExperts(dim, hidden, experts, recipe=recipe, dtype=dtype, device=device)
    else:
        model = MoEExperts(experts, dim, hidden, recipe, dtype, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(dim, dim, generator=g) / dim**0.5
    offs = make_offs([64, 48, 96, 48], device)
    groups = torch.diff(offs, prepend=offs.new_zeros(1)) if layer else offs  # the layer takes tokens per expert
    losses = []
    for _ in range(steps):
        x = torch.randn(tokens, dim, generator=g)
        y = torch.tanh(x @ teacher)
        out = model(x.to(dtype).to(device), groups)
        loss = F.mse_loss(out.float(), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer", [False, True], ids=["grouped_mm", "GroupedExperts"])
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8", "fp8_blockwise"])
def test_fp8_training_tracks_high_precision(recipe, layer, device):
    # 50 steps of the MoE SwiGLU FFN (unaligned groups) via three grouped_mm calls or the fused experts layer. CPU: fp32
    # baseline (no bf16 grouped GEMM) vs fp8 of the same fp32 activations; GPU: both bf16, fp8 on the recipe's GPU path.
    # fp8 noise moves single steps a little, so the curve must stay within 5% of the baseline at every step.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    base = train("bf16", dtype, device=device, layer=layer)
    fp8 = train(recipe, dtype, device=device, layer=layer)
    assert base[-1] < 0.8 * base[0], "the model must actually learn"
    rel = [abs(f - b) / b for f, b in zip(fp8, base)]
    print(f"{recipe} vs {dtype} loss on {device}: max relative gap {max(rel):.4f}; final {fp8[-1]:.4f} vs {base[-1]:.4f}")
    assert max(rel) < 0.05, max(rel)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(recipe="fp4"), "expected recipe in"),
        (dict(A=torch.randn(4, 8, 2)), "expected A 2-D and B_t 3-D"),
        (dict(B_t=torch.randn(2, 16, 8)), "with the same K"),
        (dict(offs=torch.tensor([16, 32])), "expected offs int32"),
    ],
)
def test_errors(kwargs, message):
    args = dict(A=torch.randn(32, 8), B_t=torch.randn(2, 8, 4), offs=torch.tensor([16, 32], dtype=torch.int32))
    recipe = kwargs.pop("recipe", "fp8_rowwise")
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        moe_fp8_ext.grouped_mm(args["A"], args["B_t"], args["offs"], recipe=recipe)


def test_debug_checks_group_alignment(monkeypatch):
    monkeypatch.setenv("MOE_FP8_DEBUG", "1")
    with pytest.raises(ValueError, match="multiples of 16 for the fp8 GEMM, got 8 for group 1"):
        moe_fp8_ext.grouped_mm(torch.randn(32, 16), torch.randn(2, 16, 8), torch.tensor([16, 24], dtype=torch.int32), pad_groups=False)


def test_backend_report():
    assert moe_fp8_ext.grouped_mm_backend("cpu") == "emulated"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        assert moe_fp8_ext.grouped_mm_backend("cuda") == "fp8_gemm"


# ======================================================================================
# GPU only: the whole grouped_mm step, forward and backward, never syncs with the host; captured in a CUDA graph
# it replays bit-equal to eager. Skipped without a CUDA GPU and build.

from conftest import graph_matches_eager  # noqa: E402


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("pad_groups", [True, False])
@pytest.mark.parametrize("recipe_name", ["fp8_rowwise", "fp8_blockwise", "mxfp8"])
def test_grouped_mm_step_has_no_host_sync(pad_groups, recipe_name):
    # Every recipe on its GPU path (fp8_blockwise: our CUTLASS GEMM on sm90; mxfp8:
    # emulated off sm100), forward and backward in one CUDA graph.
    m, k, n = 1000, 256, 384
    # Unaligned groups (and an empty one) need pad_groups; without it, groups of the
    # recipe's alignment (and M = 1000, not a multiple of it, with rows past the last group).
    aligned = {"fp8_rowwise": [96, 96, 400, 720, 992], "fp8_blockwise": [128, 128, 384, 640, 896],
               "mxfp8": [96, 96, 384, 704, 992]}[recipe_name]
    ends = aligned if not pad_groups else [90, 90, 401, 733, 990]
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    a = randn((m, k), torch.bfloat16, "cuda").requires_grad_()
    w = (randn((len(ends), n, k), torch.bfloat16, "cuda") * 0.02).requires_grad_()
    g = randn((m, n), torch.bfloat16, "cuda")

    def step():
        out = moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs, recipe=recipe_name, pad_groups=pad_groups)
        return (out, *torch.autograd.grad(out, (a, w), g))

    graph_matches_eager(step)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "bf16"])
def test_grouped_mm_garbage_offs_on_gpu(recipe):
    """Unchecked offs content on a GPU (decreasing, negative, past M) never reaches the
    grouped GEMMs as such (their device-side assert would kill the context): the result
    is the one of the clamped, non-decreasing table, forward and backward."""
    m, k, n = 512, 128, 256
    bad = torch.tensor([200, 100, -5, 700, 480], dtype=torch.int32, device="cuda")
    fixed = torch.tensor([200, 200, 200, 512, 512], dtype=torch.int32, device="cuda")
    a = randn((m, k), torch.bfloat16, "cuda").requires_grad_()
    w = (randn((5, n, k), torch.bfloat16, "cuda") * 0.02).requires_grad_()
    g = randn((m, n), torch.bfloat16, "cuda")
    results = []
    for offs in (bad, fixed):
        out = moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs, recipe=recipe)
        results.append((out, *torch.autograd.grad(out, (a, w), g)))
    torch.cuda.synchronize()
    for got, want in zip(*results):
        assert torch.equal(got, want)


# =======================================================================================
# Recipes (issue 12) and grouped_mm argument validation (issue 16): everything below drives grouped_mm through
# moe_fp8_ext.recipes; new cases of other families go after the end of this section.

import dataclasses  # noqa: E402

from moe_fp8_ext import recipes  # noqa: E402

i32 = lambda *v, device="cpu": torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731


def per_group_reference(a, b_t, offs, grad):
    """out, grad_A, grad_B_t of the grouped product with per-group fp32 torch matmuls
    (rows past offs[-1]: zero output and gradient)."""
    a32 = a.detach().float().requires_grad_()
    b32 = b_t.detach().float().requires_grad_()
    ends = offs.cpu().tolist()
    rows, start = [], 0
    for e, end in enumerate(ends):
        rows.append(a32[start:end] @ b32[e])
        start = end
    rows.append(a32.new_zeros((a32.shape[0] - start, b32.shape[2])))
    out = torch.cat(rows)
    out.backward(grad.float())
    return out.detach(), a32.grad, b32.grad


def test_registry():
    assert {"fp8_rowwise", "bf16"} <= set(recipes.RECIPES)
    r = recipes.get_recipe("fp8_rowwise")
    assert r.alignment == 16 and recipes.get_recipe(r) is r and recipes.get_recipe("bf16").alignment == 1
    with pytest.raises(ValueError, match="get_recipe: expected recipe in"):
        recipes.get_recipe("fp4")
    with pytest.raises(ValueError, match="already registered"):
        recipes.register_recipe(recipes.Bf16())
    with pytest.raises(ValueError, match="expected alignment a power of two"):
        recipes.register_recipe(dataclasses.replace(r, name="bad_alignment", alignment=12))
    with pytest.raises(TypeError, match="expected a Recipe"):
        recipes.register_recipe("bf16")
    assert moe_fp8_ext.grouped_mm_backend("cpu", "bf16") == "grouped_mm"
    assert moe_fp8_ext.grouped_mm_backend("cpu", recipe=r) == "emulated"


def test_backend_answers_are_remembered_per_device():
    # The recipes' backend and the GEMMs' availability are decided once per (key, device)
    # for a torch.device with an index; anything else is decided at every call.
    from moe_fp8_ext.platform import remembered_per_device

    memo, asked = {}, []
    devices = [torch.device("cuda", 0), torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu"), None,
               "cuda:0", torch.device("cuda", 1)]
    for d in devices:
        assert remembered_per_device(memo, d, lambda dev: asked.append(dev) or "answer", "recipe") == "answer"
    assert asked == [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu"), None, "cuda:0"]
    assert memo == {("recipe", "cuda", 0): "answer", ("recipe", "cuda", 1): "answer"}


# ---- a recipe added without touching grouped_mm.py ------------------------------------


@dataclasses.dataclass(frozen=True)
class ToyTensorwise(recipes.Recipe):
    """fp8 with ONE scale per tensor (per expert for the weights, per group for the
    wgrad pair), written in pure torch here: the test that a recipe plugs in through
    the Recipe protocol alone. Its weight gradient needs groups aligned to 8 (so grouped_mm
    asks for the colwise operands in the padded layout, and keeps A's instead of A)."""

    name: str = "toy_tensorwise"
    alignment: int = 8

    def fp8_dtypes(self, backend, device):
        return (F8,)

    def out_dtypes(self, backend, in_dtype):
        return recipes.FLOAT_DTYPES

    @staticmethod
    def tensorwise(x, dims):
        amax = x.float().abs().amax(dim=dims, keepdim=True).clamp(min=1e-12)
        # Power-of-two scales: exact in bf16, which the emulation multiplies in on CUDA.
        scale = torch.exp2(torch.ceil(torch.log2(amax / torch.finfo(F8).max)))
        return (x.float() / scale).to(F8), scale

    def quantize(self, x, fp8_dtype, groups=None, *, rowwise=True, colwise=False):
        col = None
        if colwise is True:
            offs, starts, x_p = *groups, x
            if starts is not None:  # the padded layout of DESIGN §8, via the pad op
                rows = moe_fp8_ext.padded_rows(x.shape[0], offs.shape[0], self.alignment)
                x_p = torch.ops.moe_fp8.pad_token_groups_at(x.float().contiguous(), offs, starts, rows)
            col = self.tensorwise(x_p, (0, 1))
        return (self.tensorwise(x, (0, 1)) if rowwise else None), col

    def quantize_weights(self, b_ts, fp8_dtype, *, fwd=True, bwd=False):
        q, s = self.tensorwise(recipes.joined_fwd(b_ts), (1, 2))
        return ((q, s) if fwd else None), ((q.transpose(-2, -1), s.transpose(-2, -1)) if bwd is True else None)

    def mm_2d3d(self, lhs, rhs, offs, out_dtype, backend):
        (qa, sa), (qb, sb) = lhs, rhs
        out = recipes.emulated_grouped_mm_2d3d(qa.float() * sa, qb.float() * sb, offs).to(out_dtype)
        return recipes._zero_tail(out, offs)

    def mm_2d2d(self, grad, a, offs, out_dtype, backend):
        (qg, sg), (qa, sa) = grad, a
        return recipes.emulated_grouped_mm_2d2d((qg.float() * sg).t(), qa.float() * sa, offs).to(out_dtype)


@pytest.fixture
def toy_recipe():
    recipe = recipes.register_recipe(ToyTensorwise(), replace=True)
    yield recipe
    del recipes.RECIPES[recipe.name]


@pytest.mark.parametrize("device", DEVICES)
def test_new_recipe_plugs_in(device, toy_recipe):
    # The toy recipe's output and gradients are its own quantized math (checked here
    # against the same math done by hand), with the tail rows zeroed and the padded
    # wgrad layout (unaligned groups) handled by grouped_mm.
    m, k, n, sizes = 300, 64, 32, [13, 0, 100, 150]
    offs = make_offs(sizes, device)
    a = randn((m, k), torch.float32, device).requires_grad_()
    b_t = (randn((4, n, k), torch.float32, device, outliers=False) * 0.02).transpose(1, 2).detach().requires_grad_()
    grad = randn((m, n), torch.float32, device, outliers=False)
    out = moe_fp8_ext.grouped_mm(a, b_t, offs, recipe="toy_tensorwise", out_dtype=torch.float32)
    out.backward(grad)
    q = ToyTensorwise.tensorwise
    deq = lambda t, dims: (lambda qs: qs[0].float() * qs[1])(q(t, dims))  # noqa: E731
    a_d, b_d, g_d = deq(a.detach(), (0, 1)), deq(b_t.detach(), (1, 2)), deq(grad, (0, 1))
    want_out, want_ga, _ = per_group_reference(a_d, b_d, offs, g_d)
    used = int(offs[-1])
    # fp32 sums in another order; on CUDA the emulation's GEMM also rounds its output to
    # bf16 (one bf16 ulp, 2^-8 relative: the operands themselves are exact in bf16).
    tol = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=2**-7, atol=1e-4)
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(a.grad, want_ga, **tol)
    # wgrad: per group, grad^T @ A of the tensorwise-quantized pair.
    gq, aq = deq(grad.t(), (0, 1)), a_d  # (A's colwise operand: A tensorwise, as its rowwise one)
    start = 0
    for e, end in enumerate(offs.cpu().tolist()):
        torch.testing.assert_close(b_t.grad[e], (gq[:, start:end] @ aq[start:end]).t(), **tol)
        start = end
    assert bool((out[used:] == 0).all()) and bool((a.grad[used:] == 0).all())


def test_new_recipe_runs_the_experts_layer(toy_recipe):
    # quantize, quantize_weights and the two GEMMs are all the experts layer needs too (its
    # fused steps have defaults, W1's and W3's gradients from one GEMM): close to bf16's.
    offs = make_offs([50, 0, 150], "cpu")
    x = randn((200, 64), torch.float32, outliers=False)
    ws = [randn(shape, torch.float32, outliers=False) * 0.05 for shape in ((3, 32, 64), (3, 32, 64), (3, 64, 32))]
    grad = randn((200, 64), torch.float32, outliers=False)
    results = []
    for recipe in ("toy_tensorwise", "bf16"):
        leaves = [t.clone().requires_grad_() for t in (x, *ws)]
        out = moe_fp8_ext.experts(*leaves, offs, recipe=recipe)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in leaves])
    for toy, bf16 in zip(*results):
        assert toy.shape == bf16.shape and torch.isfinite(toy).all()
        assert (toy - bf16).norm() <= 0.1 * bf16.norm()


def test_new_recipe_trains(toy_recipe):
    base = train("bf16", torch.float32)
    for recipe in ("toy_tensorwise", recipes.register_recipe(
            dataclasses.replace(recipes.get_recipe("fp8_rowwise"), name="fp8_rowwise_exact_scales", pow2_scale=False),
            replace=True).name):
        losses = train(recipe, torch.float32)
        rel = [abs(f - b) / b for f, b in zip(losses, base)]
        assert max(rel) < 0.05, (recipe, max(rel))  # as test_fp8_training_tracks_high_precision
    del recipes.RECIPES["fp8_rowwise_exact_scales"]


def test_rowwise_variant_is_its_quantized_math():
    # A Recipe field (pow2_scale) reaches every operand: exact (non-pow2) scales here.
    variant = dataclasses.replace(recipes.get_recipe("fp8_rowwise"), name="rowwise_exact", pow2_scale=False)
    m, k, n, sizes = CASES["e4"]
    offs = make_offs(sizes, "cpu")
    a = randn((m, k), torch.float32)
    b_t = randn((4, k, n), torch.float32, outliers=False) * 0.02
    out = moe_fp8_ext.grouped_mm(a, b_t, offs, recipe=variant, out_dtype=torch.float32)
    qa, sa = ref.quantize_rowwise(a, F8, pow2_scale=False)
    qb, sb = ref.quantize_experts_fwd(b_t, F8, pow2_scale=False)
    want, _, _ = per_group_reference(qa.float() * sa, qb.float() * sb, offs, torch.zeros(m, n))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, moe_fp8_ext.grouped_mm(a, b_t, offs, out_dtype=torch.float32))  # the field took effect


@pytest.mark.parametrize("device", DEVICES)
def test_new_recipe_compiles(device, toy_recipe):
    offs = make_offs([40, 0, 88], device)
    a = randn((128, 64), torch.float32, device).requires_grad_()
    b_t = (randn((3, 64, 32), torch.float32, device) * 0.02).requires_grad_()

    def step(a, b_t, offs):
        return moe_fp8_ext.grouped_mm(a, b_t, offs, recipe="toy_tensorwise", out_dtype=torch.float32).square().sum()

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(step, fullgraph=True)(a, b_t, offs), (a, b_t))
    want = torch.autograd.grad(step(a, b_t, offs), (a, b_t))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


# ---- argument validation, both recipes (issue 16 items 5 and 6) ------------------------


def valid_args(device="cpu", dtype=torch.bfloat16):
    return dict(A=torch.randn(32, 16, device=device).to(dtype), B_t=torch.randn(2, 16, 16, device=device).to(dtype),
                offs=i32(16, 32, device=device))


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "bf16"])
@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(A=None), TypeError, "expected A to be a torch.Tensor, got NoneType"),
        (dict(B_t=None), TypeError, "expected B_t to be a torch.Tensor, got NoneType"),
        (dict(offs=None), TypeError, "expected offs to be a torch.Tensor, got NoneType"),
        (dict(offs=[16, 32]), TypeError, "expected offs to be a torch.Tensor, got list"),
        (dict(pad_groups=None), TypeError, "expected pad_groups to be a bool"),
        (dict(out_dtype="bf16"), TypeError, "expected out_dtype to be a torch.dtype or None, got 'bf16'"),
        (dict(out_dtype=torch.int32), ValueError, "expected out_dtype in"),
        (dict(out_dtype=torch.bool), ValueError, "expected out_dtype in"),
        (dict(out_dtype=torch.complex64), ValueError, "expected out_dtype in"),
        (dict(out_dtype=torch.float8_e4m3fn), ValueError, "expected out_dtype in"),
        (dict(fp8_dtype="e4m3"), TypeError, "expected fp8_dtype to be a torch.dtype or None"),
        (dict(A=torch.randn(4, 8, 2)), ValueError, "expected A 2-D and B_t 3-D"),
        (dict(B_t=torch.randn(16, 8)), ValueError, "expected A 2-D and B_t 3-D, got 2-D and 2-D"),
        (dict(B_t=torch.randn(2, 8, 16)), ValueError, r"expected A \(M, K\) and B_t \(E, K, N\) with the same K"),
        (dict(offs=torch.tensor([16, 32])), ValueError, "expected offs int32 of shape"),
        (dict(offs=i32(16, 32, 32)), ValueError, r"expected offs int32 of shape \(2,\)"),
        (dict(offs=i32(16, 32).view(2, 1)), ValueError, "expected offs int32 of shape"),
        (dict(offs=i32(16, 32, device="meta")), ValueError, "expected offs on cpu .the device of A., got meta"),
        (dict(B_t=torch.randn(2, 16, 16, device="meta")), ValueError, "expected B_t on cpu .the device of A., got meta"),
        (dict(A=torch.randint(0, 4, (32, 16))), ValueError, "expected A of dtype bfloat16, float16 or float32, got torch.int64"),
        (dict(offs=i32(-1, 32)), ValueError, r"expected offs\[0\] in \[0, 32\]"),
        (dict(offs=i32(40, 40)), ValueError, r"expected offs\[0\] in \[0, 32\]"),
        (dict(offs=i32(16, 2**31 - 1)), ValueError, r"expected offs\[1\] in \[0, 32\]"),
        (dict(offs=i32(20, 16)), ValueError, r"expected non-decreasing offs, got offs\[1\] = 16 < offs\[0\] = 20"),
        (dict(recipe="fp4"), ValueError, "grouped_mm: expected recipe in"),
    ],
)
def test_bad_arguments(recipe, change, error, message):
    args = dict(valid_args(), recipe=recipe)
    args.update(change)
    A, B_t, offs = args.pop("A"), args.pop("B_t"), args.pop("offs")
    with pytest.raises(error, match=message if message.startswith("grouped_mm") else "grouped_mm: " + message):
        moe_fp8_ext.grouped_mm(A, B_t, offs, **args)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(recipe="bf16", out_dtype=torch.float32), r"expected out_dtype in \(torch.bfloat16,\) for recipe 'bf16'"),
        (dict(recipe="bf16", fp8_dtype=F8), "expected fp8_dtype None for recipe 'bf16'"),
        (dict(fp8_dtype=torch.float16), "expected fp8_dtype in"),
        (dict(recipe="bf16", B_t=torch.randn(2, 16, 16)), "expected A and B_t of one dtype"),
        (dict(recipe="bf16", A=torch.randn(32, 12).bfloat16(), B_t=torch.randn(2, 12, 8).bfloat16()),
         "expected K and N to be multiples of 8 for recipe 'bf16'"),
    ],
)
def test_recipe_specific_arguments(kwargs, message):
    args = valid_args()
    args.update(kwargs)
    A, B_t, offs = args.pop("A"), args.pop("B_t"), args.pop("offs")
    with pytest.raises(ValueError, match="grouped_mm: " + message):
        moe_fp8_ext.grouped_mm(A, B_t, offs, **args)


def test_out_dtypes_accepted_on_cpu():
    # The emulated fp8 path writes bf16, fp16 and fp32; bf16 (the recipe) writes A's
    # dtype, which out_dtype=None picks.
    a = valid_args()
    for dtype in recipes.FLOAT_DTYPES:
        assert moe_fp8_ext.grouped_mm(a["A"], a["B_t"], a["offs"], out_dtype=dtype).dtype == dtype
    for dtype in recipes.FLOAT_DTYPES:
        x = valid_args(dtype=dtype)
        assert moe_fp8_ext.grouped_mm(x["A"], x["B_t"], x["offs"], recipe="bf16").dtype == dtype
        assert moe_fp8_ext.grouped_mm(x["A"], x["B_t"], x["offs"], recipe="bf16", out_dtype=dtype).dtype == dtype


@pytest.mark.gpu
@pytest.mark.skipif(moe_fp8_ext.grouped_mm_backend("cuda") != "fp8_gemm" if torch.cuda.is_available() else True,
                    reason="needs the FP8 grouped GEMM")
def test_fp8_gemm_out_dtype_and_fp32_master_grads():
    a = randn((64, 32), torch.float32, "cuda").requires_grad_()
    w = randn((2, 32, 16), torch.float32, "cuda").requires_grad_()
    offs = i32(32, 64, device="cuda")
    with pytest.raises(ValueError, match=r"grouped_mm: expected out_dtype in \(torch.bfloat16,\)"):
        moe_fp8_ext.grouped_mm(a, w, offs, out_dtype=torch.float32)
    out = moe_fp8_ext.grouped_mm(a, w, offs)
    out.float().sum().backward()  # the gradients are fp32 (the GEMM's bf16, cast)
    assert out.dtype == torch.bfloat16 and a.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe, d", [("fp8_rowwise", 16), ("bf16", 16), ("mxfp8", 32)])  # d: K = N
def test_no_experts_gives_zeros(device, recipe, d):
    # E = 0: every row is past offs[-1]. (Was "index 0 is out of bounds".)
    a = randn((32, d), torch.bfloat16, device).requires_grad_()
    b_t = torch.randn(0, d, d, device=device).bfloat16().requires_grad_()
    out = moe_fp8_ext.grouped_mm(a, b_t, i32(device=device), recipe=recipe)
    assert out.shape == (32, d) and out.dtype == torch.bfloat16 and bool((out == 0).all())
    out.sum().backward()
    assert bool((a.grad == 0).all()) and b_t.grad.shape == (0, d, d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "bf16", "fp8_blockwise"])
@pytest.mark.parametrize("ends", [(0, 0), (48, 100)])
def test_rows_past_last_group_are_zero(device, recipe, ends):
    # offs = (0, 0): no row is in a group; torch._grouped_mm alone leaves them unwritten.
    # (48, 100): rows 100.. past the groups. fp8_blockwise's GEMM zeroes them itself on a
    # GPU (no zeroing kernel after it), over poisoned memory.
    poison(device)
    a = randn((160, 64), torch.bfloat16, device).requires_grad_()
    b_t = randn((2, 64, 48), torch.bfloat16, device).requires_grad_()
    out = moe_fp8_ext.grouped_mm(a, b_t, i32(*ends, device=device), recipe=recipe)
    out.backward(torch.ones_like(out))
    used = ends[-1]
    assert bool((out[used:] == 0).all()) and bool((a.grad[used:] == 0).all())
    assert torch.isfinite(out).all() and torch.isfinite(a.grad).all() and torch.isfinite(b_t.grad).all()
    if used == 0:
        assert bool((out == 0).all()) and bool((b_t.grad == 0).all())


@pytest.mark.parametrize("zeroes", [False, True])
def test_no_zeroing_kernel_after_a_gemm_that_zeroes(zeroes, monkeypatch):
    """The rows past offs[-1] are zeroed by the recipe's 2d3d GEMMs (forward, dgrad) and
    by nothing after them: with a GEMM that writes them itself (fp8_blockwise's on a GPU)
    no zeroing kernel runs; the emulated GEMM zeroes them, one kernel a GEMM."""
    calls = count_zero_tail_calls(monkeypatch, zeroes)
    a = randn((160, 64), torch.bfloat16, "cpu").requires_grad_()
    b_t = randn((2, 64, 48), torch.bfloat16, "cpu").requires_grad_()
    out = moe_fp8_ext.grouped_mm(a, b_t, i32(48, 100), recipe="fp8_blockwise")
    out.backward(torch.ones_like(out))
    assert len(calls) == (0 if zeroes else 2)
    assert bool((out[100:] == 0).all()) and bool((a.grad[100:] == 0).all())


@pytest.mark.parametrize("gemm", ["ours", "torch"])
def test_rowwise_zeroes_the_tail_once(gemm, monkeypatch):
    """fp8_rowwise's 2d3d GEMMs leave the rows past offs[-1] zero with one kernel at most:
    on a GPU our GEMM's table kernel writes them (no zeroing kernel after it); behind
    PyTorch's GEMM (gemm_kernel="torch"), which leaves them unwritten, and emulated, the
    recipe zeroes them, one kernel a GEMM. Zero over poisoned
    memory either way."""
    from moe_fp8_ext import recipes

    r = recipes.get_recipe("fp8_rowwise")
    device = "cuda" if r.backend(torch.device("cuda")) == "fp8_gemm" else "cpu"
    if gemm == "torch":
        r = recipes.Fp8Rowwise(gemm_kernel="torch")
    ours = device == "cuda" and r._ours(torch.empty(0, dtype=torch.float8_e4m3fn, device=device))
    if gemm == "ours" and device == "cuda" and not ours:
        pytest.skip("our rowwise GEMM does not run on this GPU")
    calls = count_zero_rows_calls(monkeypatch)
    poison(device)
    a = randn((160, 64), torch.bfloat16, device).requires_grad_()
    b_t = randn((2, 64, 48), torch.bfloat16, device).requires_grad_()
    out = moe_fp8_ext.grouped_mm(a, b_t, i32(48, 100, device=device), recipe=r)
    out.backward(torch.ones_like(out))
    assert len(calls) == (0 if ours else 2)
    assert bool((out[100:] == 0).all()) and bool((a.grad[100:] == 0).all())
    assert torch.isfinite(out).all() and torch.isfinite(a.grad).all()


def test_rowwise_torch_gemm_path_zeroes_the_tail(monkeypatch):
    """The branch of fp8_rowwise's mm_2d3d behind PyTorch's GEMM (backend "fp8_gemm",
    our kernels not in use), on the CPU with a stand-in GEMM that leaves NaN in the
    rows past offs[-1]: the recipe zeroes them itself (nothing after it does), once, and
    the rows of the groups are the GEMM's."""
    from moe_fp8_ext import recipes

    r = recipes.get_recipe("fp8_rowwise")

    def torch_gemm(qa, qb, sa, sb, offs, out_dtype):
        out = recipes.emulated_grouped_mm_2d3d(qa.float() * sa[:, None], qb.float() * sb[:, None, :], offs)
        out[int(offs[-1]):] = float("nan")
        return out.to(out_dtype)

    monkeypatch.setattr(recipes.rowwise, "scaled_grouped_mm_rowwise", torch_gemm)
    calls = count_zero_rows_calls(monkeypatch)
    offs = i32(48, 100)
    a, b_t = randn((160, 64), torch.bfloat16), randn((2, 64, 48), torch.bfloat16)
    lhs, rhs = r.quantize(a, torch.float8_e4m3fn)[0], r.quantize_weights([b_t], torch.float8_e4m3fn)[0]
    out = r.mm_2d3d(lhs, rhs, offs, torch.bfloat16, "fp8_gemm")
    assert len(calls) == 1
    want = r.mm_2d3d(lhs, rhs, offs, torch.bfloat16, "emulated")
    assert bool((out[100:] == 0).all()) and torch.equal(out[:100], want[:100])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sizes, m", [([16, 16], 32), ([13, 0, 7, 40], 64), ([0, 0, 96], 96), ([5, 3], 24)])
def test_bf16_recipe_matches_per_group_matmuls(device, dtype, sizes, m):
    # Groups of any size (odd, empty, rows past offs[-1]); the gradient of out.sum() is an
    # expanded (stride-0) tensor, on which torch's own _grouped_mm backward raises
    # "Invalid strides/sizes, got [0, 0]".
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("torch._grouped_mm on CUDA is bf16 only")
    poison(device)
    offs = make_offs(sizes, device)
    a = randn((m, 32), dtype, device).requires_grad_()
    b_t = (randn((len(sizes), 16, 32), dtype, device, outliers=False) * 0.1).transpose(1, 2).detach().requires_grad_()
    out = moe_fp8_ext.grouped_mm(a, b_t, offs, recipe="bf16")
    out.sum().backward()
    want_out, want_ga, want_gb = per_group_reference(a, b_t, offs, torch.ones(m, 16, device=device))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)  # bf16 inputs, outputs
    assert out.dtype == dtype and a.grad.dtype == dtype and b_t.grad.dtype == dtype
    torch.testing.assert_close(out.float(), want_out, **tol)
    torch.testing.assert_close(a.grad.float(), want_ga, **tol)  # no NaN rows past offs[-1]
    torch.testing.assert_close(b_t.grad.float(), want_gb, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_recipe_compile_fullgraph(device):
    offs = make_offs([40, 0, 88], device)
    a = randn((136, 64), torch.bfloat16, device)
    b_t = (randn((3, 32, 64), torch.bfloat16, device) * 0.05).transpose(1, 2)

    def step(a, b_t, offs):
        return moe_fp8_ext.grouped_mm(a, b_t, offs, recipe="bf16").float().square().sum()

    torch._dynamo.reset()
    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        aa, bb = a.clone().requires_grad_(), b_t.detach().clone().requires_grad_()
        loss = fn(aa, bb, offs)
        loss.backward()
        results.append((loss.detach(), aa.grad, bb.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp.float(), eager.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "bf16"])
def test_debug_env_checks_offs_content_on_gpu(monkeypatch, recipe):
    # Without MOE_FP8_DEBUG such offs are not checked (no sync); torch's grouped GEMM
    # then trips a device-side assert, so this test does not try it.
    args = valid_args("cuda")
    bad = i32(20, 16, device="cuda")
    monkeypatch.setenv("MOE_FP8_DEBUG", "1")
    with pytest.raises(ValueError, match="grouped_mm: expected non-decreasing offs"):
        moe_fp8_ext.grouped_mm(args["A"], args["B_t"], bad, recipe=recipe)


# =======================================================================================
# MXFP8 recipe (issue 13): e8m0 scales per 32 contraction elements, in the sm100 GEMM's blocked layouts; emulated
# (blocked scales read back, fp32 GEMM) off CUDA capability 10.x. Other families' cases go after this section.

MX = recipes.get_recipe("mxfp8")
MX_FLOOR = dataclasses.replace(MX, name="mxfp8_floor", rounding="floor")

def _mx_deq_rows(q, s):
    """q (R, C) with plain scales (R, C/32) along its rows."""
    return q.float() * s.float().repeat_interleave(32, -1)


@pytest.mark.parametrize("recipe", [MX, MX_FLOOR], ids=["rceil", "floor"])
def test_mxfp8_is_its_quantized_math(recipe):
    # Emulated output and gradients are the products of reference.py's MXFP8 quantization: checks operand roles, each
    # 32-block's orientation, the rounding field, and that blocked scales (M-group, per-expert, K-group) read back in
    # place. One bf16 ulp where fp32 sums in a different order land on a rounding boundary.
    m, k, n, sizes = MX_CASES["unaligned_e5"]
    offs = make_offs(sizes, "cpu")
    a = randn((m, k), torch.bfloat16).requires_grad_()
    b_t = (randn((len(sizes), n, k), torch.bfloat16, outliers=False) * 0.02).transpose(1, 2).detach().requires_grad_()
    grad = randn((m, n), torch.bfloat16)
    out = moe_fp8_ext.grouped_mm(a, b_t, offs, recipe=recipe)
    out.backward(grad)
    rnd = recipe.rounding

    def experts(w):  # (E, Kc, Nout) -> dequantized (E, Kc, Nout), blocks along Kc
        q, s = ref.quantize_mxfp8_experts(w.detach(), rnd)
        return q.float() * s.float().repeat_interleave(32, -1).transpose(1, 2)

    want_out = torch._grouped_mm(_mx_deq_rows(*ref.quantize_mxfp8_rowwise(a.detach(), rnd)), experts(b_t), offs=offs)
    want_ga = torch._grouped_mm(_mx_deq_rows(*ref.quantize_mxfp8_rowwise(grad, rnd)), experts(b_t.transpose(1, 2)), offs=offs)
    _, ends = ref.padded_group_offsets(offs, 32)
    qg, sg = ref.quantize_mxfp8_colwise_padded(grad, offs, 32, rnd)  # (Mp, N), scales (N, Mp/32)
    qa, sa = ref.quantize_mxfp8_colwise_padded(a.detach(), offs, 32, rnd)
    want_gb = torch._grouped_mm(_mx_deq_rows(qg.t(), sg), _mx_deq_rows(qa.t(), sa).t(), offs=ends)  # (E, N, K)
    used = int(offs[-1])
    want_out[used:] = 0
    want_ga[used:] = 0
    for got, want in ((out, want_out), (a.grad, want_ga), (b_t.grad, want_gb.transpose(1, 2))):
        torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp8_emulation_reads_blocked_scales_exactly(device):
    # The inverse layouts used by the emulation give back the plain scales of the same
    # kernel, for every layout the recipe uses; K groups with R > 128 and R < 128 (the
    # per-group-contiguous layout differs from one wide blocked matrix only for R > 128).
    offs = i32(13, 13, 200, 290, device=device)
    x = randn((301, 96), torch.bfloat16, device)
    _, blocked = moe_fp8_ext.quantize_mxfp8_rowwise(x, blocked=True, offs=offs)
    _, plain = moe_fp8_ext.quantize_mxfp8_rowwise(x)
    got = recipes.unblock_scales_m_groups(blocked, offs, 301, 3)
    assert torch.equal(got[:290], plain.float()[:290])
    for w in (randn((3, 96, 160), torch.bfloat16, device), randn((3, 160, 96), torch.bfloat16, device)[..., :64]):
        _, blocked = moe_fp8_ext.quantize_mxfp8_experts(w, blocked=True)
        _, plain = moe_fp8_ext.quantize_mxfp8_experts(w)
        assert torch.equal(recipes.unblock_scales_experts(blocked, w.shape[2], w.shape[1] // 32), plain.float())
    starts, ends = moe_fp8_ext.ops.padded_group_offsets(offs, 301, 32)
    for cols in (48, 200):
        y = randn((301, cols), torch.bfloat16, device)
        q, blocked = moe_fp8_ext.quantize_mxfp8_colwise(y, "rceil", True, offs, padded_starts=starts, alignment=32)
        _, plain = moe_fp8_ext.quantize_mxfp8_colwise(y, "rceil", False, offs, padded_starts=starts, alignment=32)
        got = recipes.unblock_scales_k_groups(blocked, ends, cols, q.shape[0] // 32)
        used = int(ends[-1]) // 32
        assert torch.equal(got[:, :used], plain.float()[:, :used]) and bool((got[:, used:] == 0).all())


def test_mxfp8_rounding_variant():
    # "floor" is a field: a variant recipe, registered under its own name if wanted.
    assert MX.rounding == "rceil" and MX.alignment == 32 and MX_FLOOR.rounding == "floor"
    m, k, n, sizes = MX_CASES["e4"]
    offs = make_offs(sizes, "cpu")
    a = randn((m, k), torch.bfloat16, seed=5)
    b_t = (randn((4, n, k), torch.bfloat16, outliers=False, seed=6) * 0.02).transpose(1, 2)
    assert not torch.equal(moe_fp8_ext.grouped_mm(a, b_t, offs, recipe=MX), moe_fp8_ext.grouped_mm(a, b_t, offs, recipe=MX_FLOOR))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes, m", [([16, 16], 32), ([13, 0, 7, 40], 64), ([0, 0, 96], 96), ([5, 3], 24), ([0, 0], 32)])
def test_mxfp8_any_group_sizes(device, sizes, m):
    # Odd, empty, all-empty groups, rows past offs[-1], M < 32: pad_groups=True (default).
    poison(device)
    offs = make_offs(sizes, device)
    a = randn((m, 64), torch.bfloat16, device).requires_grad_()
    b_t = (randn((len(sizes), 32, 64), torch.bfloat16, device, outliers=False) * 0.1).transpose(1, 2).detach().requires_grad_()
    grad = randn((m, 32), torch.bfloat16, device, outliers=False)
    out = moe_fp8_ext.grouped_mm(a, b_t, offs, recipe="mxfp8")
    out.backward(grad)
    want_out, want_ga, want_gb = per_group_reference(a, b_t, offs, grad)
    for got, want in ((out, want_out), (a.grad, want_ga), (b_t.grad, want_gb)):
        assert bool(torch.isfinite(got.float()).all())
        if want.abs().max() == 0:
            assert bool((got == 0).all())
        else:
            assert sqnr(want, got) >= 20, (sizes, sqnr(want, got))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(B_t=torch.randn(2, 48, 32), A=torch.randn(32, 48)), ValueError,
         r"grouped_mm: expected K and N to be multiples of 32 for recipe 'mxfp8' .*got K=48, N=32"),
        (dict(B_t=torch.randn(2, 32, 16)), ValueError, r"grouped_mm: expected K and N to be multiples of 32 .*got K=32, N=16"),
        (dict(fp8_dtype=torch.float8_e4m3fnuz), ValueError, r"grouped_mm: expected fp8_dtype in \(torch.float8_e4m3fn,\)"),
        (dict(fp8_dtype=torch.float8_e5m2), ValueError, r"grouped_mm: expected fp8_dtype in \(torch.float8_e4m3fn,\)"),
    ],
)
def test_mxfp8_errors(kwargs, error, message):
    args = dict(A=torch.randn(32, 32), B_t=torch.randn(2, 32, 32), offs=i32(16, 32))
    args.update(kwargs)
    A, B_t, offs = args.pop("A"), args.pop("B_t"), args.pop("offs")
    with pytest.raises(error, match=message):
        moe_fp8_ext.grouped_mm(A, B_t, offs, recipe="mxfp8", **args)


def test_mxfp8_bad_rounding():
    with pytest.raises(ValueError, match="Mxfp8: expected rounding in .*got 'nearest'"):
        dataclasses.replace(MX, name="mxfp8_bad", rounding="nearest")


def test_mxfp8_emulated_out_dtypes_and_fp32_grads():
    a = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(2, 32, 64, requires_grad=True)
    for dtype in recipes.FLOAT_DTYPES:
        assert moe_fp8_ext.grouped_mm(a, w, i32(32, 64), recipe="mxfp8", out_dtype=dtype).dtype == dtype
    moe_fp8_ext.grouped_mm(a, w, i32(32, 64), recipe="mxfp8").float().sum().backward()
    assert a.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_mxfp8_backend_report():
    assert moe_fp8_ext.grouped_mm_backend("cpu", "mxfp8") == "emulated"
    assert MX.out_dtypes("mxfp8_gemm", torch.bfloat16) == (torch.bfloat16,)
    assert MX.pads_token_groups("mxfp8_gemm") and not MX.pads_token_groups("emulated")
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability()[0]
        want = "mxfp8_gemm" if major == 10 and not torch.version.hip else "emulated"
        assert moe_fp8_ext.grouped_mm_backend("cuda", "mxfp8") == want


@dataclasses.dataclass(frozen=True)
class _Mxfp8ForcedGemm(recipes.Mxfp8):
    """The sm100 path on any device: for tracing only, never for running."""

    name: str = "mxfp8_forced_gemm"

    def backend(self, device):
        return "mxfp8_gemm"


def test_mxfp8_gemm_path_traces_fullgraph():
    # The sm100 path (padded token groups, three MXFP8 GEMMs) traced forward and backward with fullgraph=True on meta
    # tensors: torch's meta checks of _scaled_grouped_mm (fp8 layouts, e8m0 scales, 2-D scales for 2-D operands,
    # (E, ceil128(N) ceil4(K/32)) for the 3-D one) accept every operand the recipe makes.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = {}

    def count(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                seen[str(node.target)] = seen.get(str(node.target), 0) + 1
        return make_boxed_func(gm)

    m, sizes = 601, [13, 0, 177, 250, 161]
    a = torch.empty(m, 256, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(5, 64, 256, dtype=torch.bfloat16, device="meta", requires_grad=True)
    offs = torch.empty(len(sizes), dtype=torch.int32, device="meta")

    def step(a, w, offs):
        return moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs, recipe=_Mxfp8ForcedGemm()).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=count, bw_compiler=count), fullgraph=True)
    compiled(a, w, offs).backward()
    assert a.grad.shape == a.shape and w.grad.shape == w.shape and w.grad.dtype == torch.bfloat16
    assert seen.get("aten._scaled_grouped_mm.default") == 3, seen  # forward, dgrad, wgrad
    assert seen.get("moe_fp8.quantize_mxfp8_colwise.default") == 2, seen
    assert "aten._grouped_mm.default" not in seen and "aten.einsum.default" not in seen, "no emulation on the GEMM path"


def test_mxfp8_gemm_call_binds_torch_api():
    # F.scaled_grouped_mm takes the recipe's arguments (BlockWise1x32, SWIZZLE_32_4_4,
    # offs, output_dtype) as this torch spells them; only the CPU dispatch is missing.
    if not hasattr(torch.nn.functional, "scaled_grouped_mm"):
        pytest.skip("this torch has no F.scaled_grouped_mm")
    x = randn((64, 64), torch.bfloat16)
    w = randn((2, 64, 32), torch.bfloat16)
    offs = i32(32, 64)
    qa, sa = moe_fp8_ext.quantize_mxfp8_rowwise(x, blocked=True, offs=offs)
    qb, sb = moe_fp8_ext.quantize_mxfp8_experts(w, blocked=True)
    with pytest.raises(NotImplementedError, match="_scaled_grouped_mm_v2.*CPU"):
        recipes.scaled_grouped_mm_mxfp8(qa, qb, sa, sb, offs, torch.bfloat16)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] == 10,
                    reason="the gate test is for GPUs other than capability 10.x (sm90)")
def test_mxfp8_gate_never_calls_torch_mxfp8_gemm_off_sm100(monkeypatch):
    # torch 2.11 launches its sm100 MXFP8 kernel on sm90 and the CUDA context dies: on
    # any GPU but capability 10.x the recipe must stay emulated and never call it.
    assert moe_fp8_ext.grouped_mm_backend("cuda", "mxfp8") == "emulated"

    def forbidden(*args, **kwargs):
        raise AssertionError("torch's scaled grouped GEMM called off sm100")

    monkeypatch.setattr(torch.nn.functional, "scaled_grouped_mm", forbidden, raising=False)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", forbidden, raising=False)
    monkeypatch.setattr(torch, "_scaled_grouped_mm_v2", forbidden, raising=False)
    m, k, n, sizes = MX_CASES["unaligned_e9_tail"]
    offs = make_offs(sizes, "cuda")
    a = randn((m, k), torch.bfloat16, "cuda").requires_grad_()
    w = (randn((len(sizes), n, k), torch.bfloat16, "cuda", outliers=False) * 0.02).requires_grad_()
    out = moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs, recipe="mxfp8")
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out.float()).all()) and bool(torch.isfinite(w.grad.float()).all())
    a32, b32, out32 = fp32_reference(a.cpu(), w.transpose(1, 2).cpu(), offs.cpu())
    used = int(offs[-1])
    assert sqnr(out32[:used], out[:used].cpu()) >= 27


# ---- end of the MXFP8 recipe section ---------------------------------------------------


# =======================================================================================
# FP8 blockwise recipe (issue 14): 1x128 activation blocks, 128x128 weight tiles, exact fp32 scales; our CUTLASS
# grouped GEMM on sm90 (moe_fp8_ext.blockwise_gemm), emulated (dequantized operands, fp32 GEMM) elsewhere.

BW_CASES = {  # (M, K, N, group sizes)
    "e4": (512, 512, 256, [128, 0, 256, 128]),
    "e1": (384, 1024, 128, [384]),
    "unaligned_e5_tail": (601, 512, 256, [13, 0, 177, 250, 150]),
    "partial_blocks": (300, 200, 136, [100, 0, 200]),  # K, N not multiples of 128
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(BW_CASES))
def test_blockwise_sqnr_with_outliers_beats_rowwise(device, case):
    # Issue 14: out >= 28, grad_A >= 26, grad_B >= 24 dB on data with outliers, and
    # above fp8_rowwise on the same data (an outlier costs only its 128-block).
    m, k, n, sizes = BW_CASES[case]
    if device == "cuda" and moe_fp8_ext.grouped_mm_backend(device, "fp8_blockwise") == "blockwise_gemm" and (k % 16 or n % 16):
        pytest.skip("the blockwise GEMM needs K and N multiples of 16")
    res = sqnr_vs_fp32(m, k, n, make_offs(sizes, device), device, ("fp8_rowwise", "fp8_blockwise"), seed=0,
                       outliers=True)
    o, ga, gb = res["fp8_blockwise"]
    assert o >= 28 and ga >= 26 and gb >= 24, res
    ro, rga, rgb = res["fp8_rowwise"]
    assert o > ro and ga > rga and gb > rgb, res


@pytest.mark.parametrize("device", DEVICES)
def test_blockwise_is_its_quantized_math(device):
    """The recipe multiplies exactly the reference's quantized operands: dequantize the
    reference's (q, scale) and run an fp32 grouped GEMM (tolerance: the GEMM's own fp32
    accumulation order, and bf16 output rounding)."""
    m, k, n, sizes = 384, 256, 128, [128, 0, 256]
    offs = make_offs(sizes, device)
    a = randn((m, k), torch.bfloat16, device, seed=3).requires_grad_()
    b_t = (randn((3, n, k), torch.bfloat16, device, seed=4) * 0.02).transpose(1, 2).detach().requires_grad_()
    f8 = moe_fp8_ext.recipes.get_recipe("fp8_blockwise").default_fp8_dtype(torch.device(device))
    out = moe_fp8_ext.grouped_mm(a, b_t, offs, recipe="fp8_blockwise", fp8_dtype=f8)
    qa, sa = ref.quantize_blockwise_act_lhs(a.detach().cpu(), f8)
    qb, sb = ref.quantize_blockwise_weight_rhs(b_t.detach().cpu(), f8)
    deq_a = qa.float() * sa.repeat_interleave(128, 1)[:, :k]
    deq_b = qb.float() * sb.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :k, :n]
    want = torch.zeros(m, n)
    start = 0
    for e, end in enumerate(offs.cpu().tolist()):
        want[start:end] = deq_a[start:end] @ deq_b[e]
        start = end
    assert sqnr(want, out.cpu()) > 45


def test_blockwise_backend_and_errors():
    assert moe_fp8_ext.grouped_mm_backend("cpu", "fp8_blockwise") == "emulated"
    a = torch.randn(64, 128, dtype=torch.bfloat16)
    b_t = torch.randn(2, 128, 64, dtype=torch.bfloat16)
    offs = torch.tensor([32, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match="fp8_dtype"):
        moe_fp8_ext.grouped_mm(a, b_t, offs, recipe="fp8_blockwise", fp8_dtype=torch.float8_e5m2)
    out = moe_fp8_ext.grouped_mm(a, b_t, offs, recipe="fp8_blockwise", fp8_dtype=torch.float8_e4m3fnuz)
    assert out.shape == (64, 64) and torch.isfinite(out).all()



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise", "mxfp8", "bf16"])
@pytest.mark.parametrize("where", ["A", "grad_out", "weight"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_and_inf_stay_in_their_expert(device, recipe, where, value):
    """A NaN or Inf in one expert's tokens (or weights) reaches that expert's outputs and
    gradients only: every other expert's weight gradient, and the other groups' rows of
    the output and of grad_A, stay finite and equal a clean run's."""
    offs = torch.tensor([64, 64, 192], dtype=torch.int32, device=device)  # group 1 empty
    a = randn((192, 64), torch.bfloat16, device)
    b_t = (randn((3, 64, 64), torch.bfloat16, device, outliers=False) * 0.1).transpose(1, 2).contiguous()
    grad = randn((192, 64), torch.bfloat16, device, outliers=False)
    results = []
    for poisoned in (False, True):
        a_, b_, g_ = a.clone(), b_t.clone(), grad.clone()
        if poisoned:
            {"A": a_, "grad_out": g_, "weight": b_[0]}[where][5, 3] = value  # all in group / expert 0
        a_.requires_grad_()
        b_.requires_grad_()
        out = moe_fp8_ext.grouped_mm(a_, b_, offs, recipe=recipe)
        out.backward(g_)
        results.append((out.detach(), a_.grad, b_.grad))
    (out0, ga0, gb0), (out1, ga1, gb1) = results
    assert torch.equal(gb1[1:], gb0[1:]), "another expert's weight gradient changed"
    assert torch.equal(out1[64:], out0[64:]) and torch.equal(ga1[64:], ga0[64:]), "another group's rows changed"
    assert not torch.isfinite(gb1[0]).all() or where == "weight"  # (the poison did reach its own expert)
