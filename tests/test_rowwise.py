"""The FP8 rowwise quantization family (DESIGN §5): quantize_rowwise, the expert
weights (fwd / bwd), and the jagged column-wise ops (single and dual).

- numerics: every op against moe_fp8_ext.reference, bit for bit, on CPU and (when
  present) GPU: input dtypes, both e4m3 encodings, pow2 and exact scales, odd and
  edge shapes, non-contiguous inputs, empty and many token groups;
- errors: bad inputs give the stated "<op>: expected X, got Y";
- opcheck on every op of the family (OPCHECK_CASES; test_op_coverage.py checks that
  every registered op has a case) and torch.compile(fullgraph=True);
- GPU only: large shapes bit-exact with the CPU op, and the kernel paths that small
  shapes do not reach (cluster-split reductions, slices longer than the shared-memory
  cache, unaligned group starts, launch-plan overrides, garbage offs, MOE_FP8_DEBUG).
"""

import os
import subprocess
import sys

import pytest
import torch

import moe_fp8_ext
from moe_fp8_ext import _tuning
from moe_fp8_ext import reference as ref
from conftest import (
    DEVICES,
    FP8_DTYPES,
    IN_DTYPES,
    assert_fp8_equal,
    assert_scale_equal,
    off_bf16_,
    offs_from_sizes,
    poison,
    randn,
    random_offs,
    requires_cuda,
    same_as_cpu,
    set_dual_kernel_budget,
)

F8 = torch.float8_e4m3fn


def check(out, expected):
    for o, e in zip(out, expected):
        if o.dtype in FP8_DTYPES or o.dtype == torch.float8_e5m2:
            assert o.stride() == e.stride() or o.numel() == 0, (o.stride(), e.stride())
            assert_fp8_equal(o, e)
        else:
            assert_scale_equal(o, e)


def layouts_2d(m, k, dtype, device):
    """Row-major, column-major, and strided views of (m, k)."""
    yield randn((m, k), dtype, device)
    yield randn((k, m), dtype, device).t()
    yield randn((m, 2 * k + 1), dtype, device)[:, 1 : 2 * k + 1 : 2]


# ---- quantize_rowwise ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("shape", [(0, 64), (3, 1), (5, 769), (4, 5125), (33, 256), (2, 0)])
def test_quantize_rowwise(device, in_dtype, fp8_dtype, pow2, shape):
    for x in layouts_2d(*shape, in_dtype, device):
        poison(device)
        out = moe_fp8_ext.quantize_rowwise(x, fp8_dtype, pow2)
        check(out, ref.quantize_rowwise(x.cpu(), fp8_dtype, pow2))
        assert out[0].is_contiguous()


# ---- expert weights -----------------------------------------------------------------

def layouts_3d(e, k, n, dtype, device):
    """B_t (E, K, N) row-major, as the transpose of an (E, N, K) weight, and permuted."""
    yield randn((e, k, n), dtype, device, outliers=False) * 0.02
    yield (randn((e, n, k), dtype, device, outliers=False) * 0.02).transpose(1, 2)
    yield randn((k, e, n), dtype, device).permute(1, 0, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 769, 33), (3, 64, 130), (4, 17, 5), (2, 0, 8), (0, 8, 8)])
@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_quantize_experts(device, in_dtype, fp8_dtype, pow2, shape, which):
    op = getattr(moe_fp8_ext, f"quantize_experts_{which}")
    spec = getattr(ref, f"quantize_experts_{which}")
    for b_t in layouts_3d(*shape, in_dtype, device):
        poison(device)
        check(op(b_t, fp8_dtype, pow2), spec(b_t.cpu(), fp8_dtype, pow2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("shape, ns", [((2, 769), (33, 5)), ((3, 64), (130, 64, 16)), ((4, 17), (5,)),
                                       ((2, 32), (0, 48)), ((0, 8), (8, 8)), ((1, 1), (1, 1))])
def test_quantize_experts_fwd_cat(device, in_dtype, fp8_dtype, pow2, shape, ns):
    # = quantize_experts_fwd of the concatenation along N, for parts of every layout
    # (the rows and cols kernel shapes, writing into slices of one buffer)
    e, k = shape
    for rot in range(3):
        parts = [list(layouts_3d(e, k, n, in_dtype, device))[(rot + i) % 3] for i, n in enumerate(ns)]
        poison(device)
        q, s = moe_fp8_ext.quantize_experts_fwd_cat(parts, fp8_dtype, pow2)
        rq, rs = ref.quantize_experts_fwd(torch.cat([p.cpu() for p in parts], dim=2), fp8_dtype, pow2)
        assert q.shape == (e, k, sum(ns)) and s.shape == (e, 1, sum(ns))
        assert q.transpose(1, 2).is_contiguous()  # column-major per expert (size-1 dims: any stride)
        assert_fp8_equal(q, rq)
        assert_scale_equal(s, rs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("shape, ns", [((2, 769), (33, 5)), ((3, 64), (130, 130)), ((4, 17), (5,)),
                                       ((2, 32), (0, 48)), ((0, 8), (8, 8)), ((1, 1), (1, 1)), ((2, 48), (40, 24)),
                                       ((2, 769), (40, 40))])
def test_quantize_experts_bwd_cat(device, in_dtype, fp8_dtype, pow2, shape, ns):
    # = quantize_experts_bwd of the concatenation along N (the reduced dim: scales span
    # both weights). Same-layout pairs with N strided are read in place (the split
    # "cols" launch), the others reduce a copy: both checked.
    e, k = shape
    for rot in range(3):
        parts = [list(layouts_3d(e, k, n, in_dtype, device))[(rot + i * (rot != 1)) % 3] for i, n in enumerate(ns)]
        # outliers in the second part only, so a scale that does not span both fails
        if len(parts) == 2 and parts[1].numel():
            parts[1] = parts[1] * 64
        poison(device)
        q, s = moe_fp8_ext.quantize_experts_bwd_cat(parts, fp8_dtype, pow2)
        rq, rs = ref.quantize_experts_bwd(torch.cat([p.cpu() for p in parts], dim=2), fp8_dtype, pow2)
        assert q.shape == (e, sum(ns), k) and s.shape == (e, 1, k)
        assert q.transpose(1, 2).is_contiguous()
        assert_fp8_equal(q, rq)
        assert_scale_equal(s, rs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("shape, ns", [((2, 769), (33, 5)), ((3, 64), (130, 130)), ((4, 17), (5,)), ((2, 32), (0, 48)),
                                       ((0, 8), (8, 8)), ((2, 256), (264, 264))])
def test_quantize_experts_read_as_bf16(device, fp8_dtype, pow2, shape, ns):
    # as_bf16: fp32 read as its bf16 cast (low bits, ties, overflow to Inf, specials), bit for bit the reference of the
    # parts' bf16 cast: fwd and bwd of the first part, fwd_cat and bwd_cat of the parts, every layout (rows and cols
    # kernels)
    e, k = shape
    for rot in range(3):
        parts = [list(layouts_3d(e, k, n, torch.float32, device))[(rot + i * (rot != 1)) % 3]
                 for i, n in enumerate(ns)]
        for i, p in enumerate(parts):
            if p.numel():
                p[0, 0, 0] = float("nan") if rot == 2 else float("inf")
            off_bf16_(p, seed=rot + i)
        bf = [p.cpu().to(torch.bfloat16) for p in parts]
        for which in ("fwd", "bwd"):
            poison(device)
            check(getattr(moe_fp8_ext, f"quantize_experts_{which}")(parts[0], fp8_dtype, pow2, as_bf16=True),
                  getattr(ref, f"quantize_experts_{which}")(bf[0], fp8_dtype, pow2))
        for which in ("fwd", "bwd"):
            poison(device)
            q, s = getattr(moe_fp8_ext, f"quantize_experts_{which}_cat")(parts, fp8_dtype, pow2, as_bf16=True)
            want = getattr(ref, f"quantize_experts_{which}")(torch.cat(bf, dim=2), fp8_dtype, pow2)
            assert_fp8_equal(q, want[0])
            assert_scale_equal(s, want[1])


# ---- jagged column-wise ---------------------------------------------------------------

JAGGED_CASES = [  # (M, D, G, tail rows past offs[-1])
    (0, 16, 3, 0),
    (64, 1, 1, 0),
    (300, 769, 8, 0),
    (1000, 40, 300, 0),
    (257, 130, 5, 17),
    (128, 32, 0, 0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("case", JAGGED_CASES)
def test_quantize_jagged_colwise(device, in_dtype, fp8_dtype, pow2, case):
    m, d, g, tail = case
    offs = random_offs(m, g, empty_frac=0.25, tail=tail)
    for x in layouts_2d(m, d, in_dtype, device):
        poison(device)
        out = moe_fp8_ext.quantize_jagged_colwise(x, offs.to(device), fp8_dtype, pow2)
        check(out, ref.quantize_jagged_colwise(x.cpu(), offs, fp8_dtype, pow2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("case", [(300, 72, 24, 8), (1000, 40, 1, 300), (64, 0, 16, 2), (96, 16, 0, 4)])
def test_quantize_jagged_colwise_dual(device, fp8_dtype, case):
    m, d1, d2, g = case
    offs = random_offs(m, g, empty_frac=0.25)
    x1 = randn((m, d1), torch.bfloat16, device)
    x2 = randn((d2, m), torch.bfloat16, device).t()
    poison(device)
    out = moe_fp8_ext.quantize_jagged_colwise_dual(x1, x2, offs.to(device), fp8_dtype)
    check(out, ref.quantize_jagged_colwise_dual(x1.cpu(), x2.cpu(), offs, fp8_dtype))


def test_default_fp8_dtype_is_used():
    x = randn((4, 32), torch.bfloat16)
    q, _ = moe_fp8_ext.quantize_rowwise(x)
    assert q.dtype == moe_fp8_ext.default_fp8_dtype()


# ---- errors ---------------------------------------------------------------------------

x2d = torch.randn(8, 16, dtype=torch.bfloat16)
offs2 = torch.tensor([4, 8], dtype=torch.int32)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: moe_fp8_ext.quantize_rowwise(torch.randn(2, 3, 4), F8), "quantize_rowwise: expected x to be a 2-D tensor, got 3-D"),
        (lambda: moe_fp8_ext.quantize_rowwise(torch.ones(4, 4, dtype=torch.int32), F8), "quantize_rowwise: expected x of dtype bfloat16, float16 or float32, got Int"),
        (lambda: moe_fp8_ext.quantize_rowwise(x2d, torch.bfloat16), "quantize_rowwise: expected fp8_dtype float8_e4m3fn, float8_e4m3fnuz or float8_e5m2, got BFloat16"),
        (lambda: moe_fp8_ext.quantize_experts_fwd(x2d, F8), "quantize_experts_fwd: expected b_t to be a 3-D tensor, got 2-D"),
        (lambda: moe_fp8_ext.quantize_experts_bwd(torch.randn(2, 2, 2, dtype=torch.float64), F8), "quantize_experts_bwd: expected b_t of dtype bfloat16, float16 or float32, got Double"),
        (lambda: moe_fp8_ext.quantize_experts_fwd(torch.randn(2, 2, 2, dtype=torch.bfloat16), F8, as_bf16=True), "quantize_experts_fwd: expected b_t of dtype float32 to read it as bfloat16 (as_bf16=True), got BFloat16"),
        (lambda: torch.ops.moe_fp8.quantize_experts_bwd(torch.randn(2, 2, 2, dtype=torch.bfloat16), F8, True, True), "quantize_experts_bwd: expected b_t of dtype float32 to read it as bfloat16 (as_bf16=True), got BFloat16"),
        (lambda: moe_fp8_ext.quantize_experts_bwd_cat([torch.randn(2, 8, 4, dtype=torch.half)] * 2, F8, as_bf16=True), "quantize_experts_bwd_cat: expected b_t of dtype float32 to read it as bfloat16 (as_bf16=True), got Half"),
        (lambda: torch.ops.moe_fp8.quantize_experts_fwd_cat([torch.randn(2, 8, 4, dtype=torch.half)] * 2, F8, True, True), "quantize_experts_fwd_cat: expected b_t of dtype float32 to read it as bfloat16 (as_bf16=True), got Half"),
        (lambda: moe_fp8_ext.quantize_experts_fwd_cat([torch.randn(2, 8, 4, dtype=torch.half)] * 2, F8, as_bf16=True), "quantize_experts_fwd_cat: expected b_t of dtype float32 to read it as bfloat16 (as_bf16=True), got Half"),
        (lambda: moe_fp8_ext.quantize_experts_fwd_cat([], F8), "quantize_experts_fwd_cat: expected at least one weight, got none"),
        (lambda: moe_fp8_ext.quantize_experts_bwd_cat([torch.randn(2, 8, 4)] * 3, F8), "quantize_experts_bwd_cat: expected one or two weights, got 3"),
        (lambda: moe_fp8_ext.quantize_experts_bwd_cat([torch.randn(2, 8, 4), torch.randn(2, 4, 4)], F8), "quantize_experts_bwd_cat: expected every weight of shape (E, K, N_i) with the E and K of the first, (2, 8, .), got (2, 4, 4) (weight 1)"),
        (lambda: moe_fp8_ext.quantize_experts_fwd_cat([torch.randn(2, 8, 4), torch.randn(2, 4, 4)], F8), "quantize_experts_fwd_cat: expected every weight of shape (E, K, N_i) with the E and K of the first, (2, 8, .), got (2, 4, 4) (weight 1)"),
        (lambda: moe_fp8_ext.quantize_experts_fwd_cat([torch.randn(2, 8, 4), torch.randn(2, 8, 4, dtype=torch.bfloat16)], F8), "quantize_experts_fwd_cat: expected every weight of one dtype and device, got Float on cpu and BFloat16 on cpu (weight 1)"),
        (lambda: moe_fp8_ext.quantize_experts_dual_cat([torch.randn(2, 8, 4)] * 3, F8), "quantize_experts_dual_cat: expected one or two weights, got 3"),
        (lambda: moe_fp8_ext.quantize_experts_dual_cat([], F8), "quantize_experts_dual_cat: expected at least one weight, got none"),
        (lambda: moe_fp8_ext.quantize_experts_dual_cat([torch.randn(2, 8, 4), torch.randn(2, 4, 4)], F8), "quantize_experts_dual_cat: expected every weight of shape (E, K, N_i) with the E and K of the first, (2, 8, .), got (2, 4, 4) (weight 1)"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise(x2d, offs2.long(), F8), "quantize_jagged_colwise: expected offs of dtype int32, got Long"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise(x2d, offs2.view(2, 1), F8), "quantize_jagged_colwise: expected offs to be a 1-D tensor, got 2-D"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise(x2d, torch.tensor([6, 4], dtype=torch.int32), F8), "quantize_jagged_colwise: expected non-decreasing offs, got offs[1] = 4 < offs[0] = 6"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise(x2d, torch.tensor([4, 9], dtype=torch.int32), F8), "quantize_jagged_colwise: expected offs[1] in [0, 8], got 9"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise(x2d, torch.tensor([-1, 8], dtype=torch.int32), F8), "quantize_jagged_colwise: expected offs[0] in [0, 8], got -1"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise_dual(x2d, torch.randn(8, 4), offs2, F8), "quantize_jagged_colwise_dual: expected x1 and x2 of one dtype, got BFloat16 and Float"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise_dual(x2d, x2d[:4], offs2, F8), "quantize_jagged_colwise_dual: expected x1 and x2 with the same number of rows, got 8 and 4"),
    ],
)
def test_bad_inputs(call, message):
    with pytest.raises(RuntimeError) as e:
        call()
    assert message in str(e.value)


def test_bad_inputs_cat_same_words_in_cpp():
    # the C++ op (no wrapper in front) refuses with the wrapper's words (an empty list
    # does not reach it: the dispatcher needs a tensor argument)
    for op in ("quantize_experts_fwd_cat", "quantize_experts_bwd_cat", "quantize_experts_dual_cat"):
        for args, message in (
                ([torch.randn(2, 8, 4), torch.randn(3, 8, 4)], "(2, 8, .), got (3, 8, 4) (weight 1)"),
                ([torch.randn(2, 8, 4), torch.randn(2, 8, 4).half()], "got Float on cpu and Half on cpu (weight 1)")):
            with pytest.raises(RuntimeError) as e:
                getattr(torch.ops.moe_fp8, op)(args, F8)
            assert f"{op}: expected" in str(e.value) and message in str(e.value)
    for op in ("quantize_experts_bwd_cat", "quantize_experts_dual_cat"):
        with pytest.raises(RuntimeError, match=f"{op}: expected one or two weights, got 3"):
            getattr(torch.ops.moe_fp8, op)([torch.randn(2, 8, 4)] * 3, F8)


@requires_cuda
@pytest.mark.gpu
def test_offs_on_other_device():
    with pytest.raises(RuntimeError, match="quantize_jagged_colwise: expected offs on cuda:0 \\(the device of x\\), got cpu"):
        moe_fp8_ext.quantize_jagged_colwise(x2d.cuda(), offs2, F8)


def weight_parts(e, k, ns, dtype, device, layout):
    """b_t = W_i^T (E, K, N_i) of weights W_i (E, N_i, K): "titan" row-major W_i (the
    dual kernel's layout: K contiguous), or every part in another layout (fallback)."""
    parts = []
    for i, n in enumerate(ns):
        if layout == "titan":
            b = randn((e, n, k), dtype, device).transpose(1, 2)
        else:
            b = list(layouts_3d(e, k, n, dtype, device))[(i + (layout == "permuted")) * 2 % 3]
        parts.append(b * 64 if i == 1 else b)  # outliers in one part: a scale over both must see them
    return parts


def check_dual(parts, fp8_dtype, pow2):
    poison(parts[0].device.type)
    out = moe_fp8_ext.quantize_experts_dual_cat(parts, fp8_dtype, pow2)
    cat = torch.cat([p.cpu() for p in parts], dim=2)
    e, k, n = cat.shape
    assert out[0].shape == (e, k, n) and out[1].shape == (e, 1, n)
    assert out[2].shape == (e, n, k) and out[3].shape == (e, 1, k)
    check(out[:2], ref.quantize_experts_fwd(cat, fp8_dtype, pow2))
    check(out[2:], ref.quantize_experts_bwd(cat, fp8_dtype, pow2))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("shape, ns", [((3, 144), (48, 80)), ((2, 272), (136, 120)), ((1, 16), (16,)),
                                       ((5, 160), (400,)), ((2, 48), (0, 32)), ((0, 32), (16, 16)),
                                       ((2, 33), (40, 24)), ((2, 32), (20, 12))])
@pytest.mark.parametrize("layout", ["titan", "other", "permuted"])
@pytest.mark.parametrize("dual", ["default", "0"])
def test_quantize_experts_dual_cat(device, in_dtype, fp8_dtype, pow2, shape, ns, layout, dual, monkeypatch):
    # = (quantize_experts_fwd, quantize_experts_bwd) of the concatenation along N, bit for bit. On a GPU the "titan"
    # layout with N, K multiples of 16 runs the dual kernel (136: a part boundary in a tile; 400: column maxima over
    # several row tiles); the other layouts, the kernel off ("0") and the CPU run the two ops.
    set_dual_kernel_budget(monkeypatch, dual)
    check_dual(weight_parts(*shape, ns, in_dtype, device, layout), fp8_dtype, pow2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
def test_quantize_experts_dual_cat_special_values(device, in_dtype):
    # NaN, +-Inf, all-zero rows and columns, -0: the amax of a row or a column sees them
    # exactly as the single ops do.
    w = randn((3, 64, 144), in_dtype, device)
    w[0, 5, 7] = float("nan")
    w[1, :, 3] = 0.0
    w[1, 9, :] = -0.0
    w[2, 60, 100] = float("inf")
    w[2, 61, 101] = -float("inf")
    check_dual([w.transpose(1, 2), (w * 3).transpose(1, 2)], F8, True)


# ---- rowwise + jagged colwise from one read (DESIGN §10) ------------------------------

ROWWISE_JAGGED_DUAL_CASES = [  # (M, D, G, tail rows past offs[-1], alignment)
    (300, 72, 4, 0, 16),  # a partial column tile
    (1000, 256, 7, 33, 16),  # tail rows (rowwise only)
    (777, 136, 1, 0, 16),  # G = 1, an odd group end
    (2048, 64, 64, 0, 16),  # many small groups
    (513, 1040, 3, 5, 32),  # rows over nine column tiles, alignment 32
    (200, 48, 300, 0, 16),  # more groups than rows: most empty
    (0, 16, 3, 0, 16),  # no rows
    (64, 0, 2, 0, 16),  # no columns
    (96, 24, 0, 0, 16),  # no groups
]


def _dual_layouts(m, d, dtype, device):
    """Row-major; rows strided by d + 8 elements (what the kernel takes); column-major
    (the two ops)."""
    yield randn((m, d), dtype, device)
    yield randn((m, d + 8), dtype, device)[:, :d]
    yield randn((d, m), dtype, device).t()


def check_rowwise_jagged_dual(x, offs, fp8_dtype, pow2, alignment, padded=True):
    starts = None
    if padded:
        starts, _ = moe_fp8_ext.padded_group_offsets(offs, x.shape[0], alignment)
    poison(x.device.type)
    out = moe_fp8_ext.quantize_rowwise_jagged_dual(x, offs, fp8_dtype, pow2, starts, alignment)
    xc, oc = x.cpu(), offs.cpu()
    check(out[:2], ref.quantize_rowwise(xc, fp8_dtype, pow2))
    if padded:
        check(out[2:], ref.quantize_jagged_colwise_padded(xc, oc, alignment, fp8_dtype, pow2))
    else:
        check(out[2:], ref.quantize_jagged_colwise(xc, oc, fp8_dtype, pow2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("case", ROWWISE_JAGGED_DUAL_CASES)
def test_quantize_rowwise_jagged_dual(device, in_dtype, fp8_dtype, pow2, case):
    # = (quantize_rowwise, quantize_jagged_colwise in the padded layout), bit for bit.
    # (Its one-read kernel measured slower and was deleted: docs/decisions/029.)
    m, d, g, tail, alignment = case
    offs = random_offs(m, g, empty_frac=0.25, tail=tail).to(device)
    for x in _dual_layouts(m, d, in_dtype, device):
        check_rowwise_jagged_dual(x, offs, fp8_dtype, pow2, alignment)


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_rowwise_jagged_dual_unpadded(device):
    # Without padded_starts: the two ops (the kernel writes the padded layout only).
    offs = random_offs(480, 5, alignment=16).to(device)
    check_rowwise_jagged_dual(randn((480, 64), torch.bfloat16, device), offs, F8, True, 16, padded=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
def test_quantize_rowwise_jagged_dual_special_values(device, in_dtype):
    # NaN, +-Inf, a zero column inside a group, a zero row, -0: a row's amax and a
    # (group, column) amax see them exactly as the single ops do.
    x = randn((500, 200), in_dtype, device)
    offs = torch.tensor([90, 90, 260, 400], dtype=torch.int32, device=device)
    x[5, 7] = float("nan")
    x[100:260, 3] = 0.0
    x[270, :] = -0.0
    x[300, 100] = float("inf")
    x[301, 101] = -float("inf")
    x[450, 10] = float("nan")  # a tail row: its row scale only
    check_rowwise_jagged_dual(x, offs, F8, True, 16)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(65536, 2048, 64), (16384, 5120, 16), (16384, 2048, 128)])
def test_quantize_rowwise_jagged_dual_large(shape):
    # The benchmark shapes, skewed groups.
    m, d, g = shape
    offs = random_offs(m, g, skew=1.0, empty_frac=0.1).cuda()
    check_rowwise_jagged_dual(randn((m, d), torch.bfloat16, "cuda"), offs, F8, True, 16)


@requires_cuda
@pytest.mark.gpu
def test_quantize_rowwise_jagged_dual_is_two_ops():
    # The two ops' kernels, whatever the dual kernel's L2 budget (no one-read kernel).
    x = randn((4096, 512), torch.bfloat16, "cuda")
    offs = random_offs(4096, 16).cuda()
    starts, _ = moe_fp8_ext.padded_group_offsets(offs, 4096, 16)
    for budget in (None, str(1 << 40)):
        with _tuning.override(dual_l2_bytes=budget), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            moe_fp8_ext.quantize_rowwise_jagged_dual(x, offs, F8, True, starts, 16)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert not any("quantize_dual_kernel" in n for n in names), names


# ---- opcheck and torch.compile --------------------------------------------------------

def _x(d):
    return randn((64, 48), torch.bfloat16, d)


def _w(d):
    return randn((3, 32, 48), torch.bfloat16, d)


def _offs(d):
    return torch.tensor([16, 16, 40, 64], dtype=torch.int32, device=d)


def _starts(d):
    return moe_fp8_ext.padded_group_offsets(_offs(d), 64, 16)[0]


# (op name in torch.ops.moe_fp8, device -> args): schema, fake tensor and AOT dispatch
# of every op of the family. test_op_coverage.py reads the names.
OPCHECK_CASES = [
    ("quantize_rowwise", lambda d: (_x(d), F8, True)),
    ("quantize_rowwise", lambda d: (_x(d).t(), torch.float8_e4m3fnuz, False)),
    ("quantize_experts_fwd", lambda d: (_w(d), F8, True)),
    ("quantize_experts_bwd", lambda d: (_w(d).transpose(1, 2), F8, True)),
    ("quantize_experts_fwd_cat", lambda d: ([_w(d), _w(d)[:, :, :16].transpose(1, 2).contiguous().transpose(1, 2)], F8, True)),
    ("quantize_experts_bwd_cat", lambda d: ([_w(d).transpose(1, 2).contiguous().transpose(1, 2)] * 2, F8, True)),
    ("quantize_experts_fwd", lambda d: (_w(d).float(), F8, True, True)),
    ("quantize_experts_bwd", lambda d: (_w(d).float().transpose(1, 2), F8, False, True)),
    ("quantize_experts_bwd_cat", lambda d: ([_w(d).float().transpose(1, 2)] * 2, F8, True, True)),
    ("quantize_experts_fwd_cat", lambda d: ([_w(d).float(), _w(d).float()[:, :, :16]], F8, False, True)),
    ("quantize_experts_dual_cat", lambda d: ([_w(d).transpose(1, 2), _w(d)[:, :16].transpose(1, 2)], F8, True)),
    ("quantize_experts_dual_cat", lambda d: ([_w(d)[:, :, :16]], F8, False)),
    ("quantize_jagged_colwise", lambda d: (_x(d), _offs(d), F8, True)),
    ("quantize_jagged_colwise_dual", lambda d: (_x(d), _x(d)[:, :16], _offs(d), F8, True)),
    ("quantize_rowwise_jagged_dual", lambda d: (_x(d), _offs(d), F8, True, _starts(d), 16)),
    ("quantize_rowwise_jagged_dual", lambda d: (_x(d), _offs(d), F8, False)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, args", OPCHECK_CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(OPCHECK_CASES)])
def test_opcheck(device, op, args):
    torch.library.opcheck(getattr(torch.ops.moe_fp8, op).default, args(device))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    def step(a, w, wt, offs):
        qa, sa = moe_fp8_ext.quantize_rowwise(a, F8)
        qw, sw = moe_fp8_ext.quantize_experts_fwd(w, F8)
        qc, sc = moe_fp8_ext.quantize_experts_fwd_cat([w, w * 2], F8)
        qb, sb = moe_fp8_ext.quantize_experts_bwd_cat([w, w * 2], F8)
        qd, sd, qe, se = moe_fp8_ext.quantize_experts_dual_cat([wt, wt * 2], F8)
        qg, sg, qx, sx = moe_fp8_ext.quantize_jagged_colwise_dual(a, a * 2, offs, F8)
        starts, _ = moe_fp8_ext.padded_group_offsets(offs, a.shape[0], 16)
        qr, sr, qj, sj = moe_fp8_ext.quantize_rowwise_jagged_dual(a * 3, offs, F8, True, starts, 16)
        # Some surrounding math so that the ops sit inside a real graph.
        return (qa.float() * sa, qw.float() * sw, sg + sx, qg.float().sum() + qx.float().sum(), qc.float() * sc,
                qb.float() * sb, qd.float() * sd, qe.float() * se, qr.float() * sr, qj.float().sum() + sj.sum())

    a = randn((64, 48), torch.bfloat16, device)
    w = randn((3, 32, 48), torch.bfloat16, device)
    wt = randn((3, 48, 32), torch.bfloat16, device).transpose(1, 2)
    offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    for got, want in zip(compiled(a, w, wt, offs), step(a, w, wt, offs)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- GPU only: large shapes and the kernel paths small shapes do not reach ------------

@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(16384, 7168), (4096, 40000), (65536, 2048)])
def test_rowwise_large(fp8_dtype, shape):
    same_as_cpu(moe_fp8_ext.quantize_rowwise, randn(shape, torch.bfloat16, "cuda"), fp8_dtype)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(8, 7168, 2048), (16, 5120, 1536), (64, 2048, 1408)])
@pytest.mark.parametrize("transposed", [False, True])
def test_experts_large(fp8_dtype, shape, transposed):
    e, k, n = shape
    w = randn((e, n, k), torch.bfloat16, "cuda").transpose(1, 2) if transposed else randn(shape, torch.bfloat16, "cuda")
    same_as_cpu(moe_fp8_ext.quantize_experts_fwd, w, fp8_dtype)
    same_as_cpu(moe_fp8_ext.quantize_experts_bwd, w, fp8_dtype)
    gpu = moe_fp8_ext.quantize_experts_fwd_cat([w, w[:, :, : n // 2] * 3], fp8_dtype)
    poison("cuda")
    cpu = moe_fp8_ext.quantize_experts_fwd_cat([w.cpu(), w[:, :, : n // 2].cpu() * 3], fp8_dtype)
    check(gpu, cpu)
    w3 = w * 3  # the same layout as w: read in place by the split "cols" launch
    poison("cuda")
    gpu = moe_fp8_ext.quantize_experts_bwd_cat([w, w3], fp8_dtype)
    check(gpu, moe_fp8_ext.quantize_experts_bwd_cat([w.cpu(), w3.cpu()], fp8_dtype))
    check(gpu, moe_fp8_ext.quantize_experts_bwd(torch.cat([w, w3], dim=2), fp8_dtype))


def _dual_kernel_ran(parts, fp8_dtype, tries=2):
    """Whether quantize_experts_dual_cat launched the dual kernel (profiler names). A
    second profile when the first shows no kernel at all: the profiler can drop events,
    and that must not read as "the two ops ran"."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(tries):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            moe_fp8_ext.quantize_experts_dual_cat(parts, fp8_dtype)
            torch.cuda.synchronize()
        keys = [e.key for e in prof.key_averages()]
        if any("quantize_dual_kernel" in k for k in keys):
            return True
        if any("quantize" in k for k in keys):  # the two ops' kernels: a real "no"
            return False
    return False


# GPUs whose blocks can have the dual kernel's 85 KB of shared memory: NVIDIA from sm_80
# on (99 KB and more); the others (AMD MI300: 64 KB) always run the two ops
# (test_dual_budget_gate).
DUAL_GPU = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 0)
requires_dual_gpu = pytest.mark.skipif(not DUAL_GPU, reason="no dual kernel on this machine")


def test_dual_budget_without_gpu_kernels():
    # the budget the Python predicate asks for: 0 (never) in a build without GPU kernels
    info = moe_fp8_ext.build_info()
    if info["cuda"] or info["hip"]:
        pytest.skip("a GPU build")
    assert moe_fp8_ext._C.dual_l2_budget(0) == 0


@requires_cuda
@requires_dual_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("e, k, n", [(64, 2048, 1408), (128, 2048, 768), (16, 1536, 5120), (40, 1040, 272),
                                     (3, 256, 144)])
@pytest.mark.parametrize("budget", ["l2", "two", "all"])
def test_dual_large(fp8_dtype, e, k, n, budget):
    # The dual kernel on an experts layer's W1, W3 (E, n, k) and W2 (E, k, n), torchtitan's layout: bit for bit the two
    # GPU ops (and the CPU op on smaller shapes) at each budget's lag: 3/5 of L2 (shapes that fit), two experts in L2
    # (lag 1), no limit (lag from resident blocks alone). W2's budget uses its own K (else the op rightly runs two ops).
    w1, w3 = (randn((e, n, k), torch.bfloat16, "cuda") * 0.02 for _ in range(2))
    w2 = randn((e, k, n), torch.bfloat16, "cuda") * 0.02
    for parts in ([w1.transpose(1, 2), (w3 * 8).transpose(1, 2)], [w2.transpose(1, 2)]):
        matrix = parts[0].shape[1] * sum(p.shape[2] for p in parts) * 2  # one expert's K x N, 2 bytes
        if budget == "l2" and 2 * matrix > 0.6 * torch.cuda.get_device_properties(0).L2_cache_size:
            continue  # past that budget: the two ops, tested elsewhere
        with _tuning.override(dual_l2_bytes=budget if budget == "l2" else
                              str(2 * matrix if budget == "two" else (e + 1) * matrix)):
            poison("cuda")
            got = moe_fp8_ext.quantize_experts_dual_cat(parts, fp8_dtype)
            check(got, moe_fp8_ext.quantize_experts_fwd_cat(parts, fp8_dtype) +
                  moe_fp8_ext.quantize_experts_bwd_cat(parts, fp8_dtype))
            if e * k * n < 2**24:
                check(got, moe_fp8_ext.quantize_experts_dual_cat([p.cpu() for p in parts], fp8_dtype))
            assert moe_fp8_ext.ops.dual_cat_reads_once(parts), "the predicate says the kernel does not run"
            assert _dual_kernel_ran(parts, fp8_dtype), "the profiler saw no dual kernel"


@requires_cuda
@requires_dual_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("e, k, ns", [(40, 1040, (272, 272)), (16, 5120, (1536,)), (130, 256, (64, 80))])
def test_dual_repeated(e, k, ns):
    # The cross-block protocol (per-expert atomic amaxes, a release/acquire counter per expert) under many launches:
    # each budget from lag 1 to no limit, 40 launches each against the two ops' bits; outputs poisoned (0xFF) before
    # being freed, so the next launch, getting the same memory back, shows any element it does not write.
    parts = [(randn((e, n, k), torch.bfloat16, "cuda") * (0.02 * (i + 1))).transpose(1, 2) for i, n in enumerate(ns)]
    parts[0][e // 2, 7, 3] = 1.0  # an outlier in one expert: its scales differ from the rest
    want = moe_fp8_ext.quantize_experts_fwd_cat(parts, F8) + moe_fp8_ext.quantize_experts_bwd_cat(parts, F8)
    matrix = k * sum(ns) * 2
    for budget in (2 * matrix, 3 * matrix, 8 * matrix, 1 << 50):
        with _tuning.override(dual_l2_bytes=str(budget)):
            assert moe_fp8_ext.ops.dual_cat_reads_once(parts)
    check_repeated(lambda: moe_fp8_ext.quantize_experts_dual_cat(parts, F8), want,
                   (2 * matrix, 3 * matrix, 8 * matrix, 1 << 50), 40)


def check_repeated(call, want, budgets, reps):
    """call() under each L2 budget, reps times, every output against want's bits, each
    poisoned (0xFF) before it is freed."""
    def raw(t):
        return t.view(torch.uint8) if t.element_size() == 1 else t

    want = [raw(t) for t in want]
    bad = []
    for budget in budgets:
        with _tuning.override(dual_l2_bytes=str(budget)):
            for rep in range(reps):
                got = call()
                for i, (g, w) in enumerate(zip(got, want)):
                    if not torch.equal(raw(g), w):
                        bad.append((budget, rep, i))
                    raw(g).view(torch.uint8).fill_(0xFF)
                del got
    assert not bad, f"{len(bad)} mismatching outputs (budget, launch, output): {bad[:8]}"


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["titan", "other", "permuted"])
@pytest.mark.parametrize("shape, ns", [((3, 144), (48, 80)), ((2, 33), (40, 24)), ((2, 48), (0, 32)), ((5, 160), (400,))])
def test_dual_predicate_matches_kernel(layout, shape, ns):
    # ops.dual_cat_reads_once (what the experts layer asks) says what the op does
    with _tuning.override(dual_l2_bytes="l2"):
        parts = weight_parts(*shape, ns, torch.bfloat16, "cuda", layout)
        assert moe_fp8_ext.ops.dual_cat_reads_once(parts) == _dual_kernel_ran(parts, F8)
        half = [p.half() for p in parts]
        assert moe_fp8_ext.ops.dual_cat_reads_once(half) == _dual_kernel_ran(half, F8)
        assert not moe_fp8_ext.ops.dual_cat_reads_once([p.float() for p in parts])


@requires_cuda
@pytest.mark.gpu
def test_dual_budget_gate():
    # The budget decides: unset means "l2"; 0 leaves the kernel off (the two ops, the
    # same bits); an expert whose two matrices do not fit runs the two ops.
    w = randn((4, 256, 512), torch.bfloat16, "cuda").transpose(1, 2)
    want = moe_fp8_ext.quantize_experts_dual_cat([w.cpu()], F8)
    assert _tuning.get("dual_l2_bytes") is None
    # the default budget, where a block can have the kernel's 85 KB of shared memory
    # (DUAL_GPU); elsewhere 0: the two ops
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    assert moe_fp8_ext._C.dual_l2_budget(0) == (l2 * 3 // 5 if DUAL_GPU else 0)
    if not DUAL_GPU:
        pytest.skip("no dual kernel on this GPU")
    check(moe_fp8_ext.quantize_experts_dual_cat([w], F8), want)
    assert _dual_kernel_ran([w], F8) and moe_fp8_ext.ops.dual_cat_reads_once([w])
    for budget, ran in (("0", False), (str(2 * 256 * 512 * 2 - 1), False), (str(2 * 256 * 512 * 2), True),
                        ("l2", True)):
        with _tuning.override(dual_l2_bytes=budget):
            check(moe_fp8_ext.quantize_experts_dual_cat([w], F8), want)
            assert _dual_kernel_ran([w], F8) == ran == moe_fp8_ext.ops.dual_cat_reads_once([w]), budget
    with _tuning.override(dual_l2_bytes="lots"), pytest.raises(
            RuntimeError, match='expected tuning dual_l2_bytes to be "l2" or a byte count, got "lots"'):
        moe_fp8_ext.quantize_experts_dual_cat([w], F8)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("m, d1, d2, g", [(16384, 7168, 2048, 8), (65536, 2048, 1408, 64), (20000, 136, 72, 1024)])
def test_jagged_dual_large(fp8_dtype, m, d1, d2, g):
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise_dual, randn((m, d1), torch.bfloat16, "cuda"),
                randn((m, d2), torch.bfloat16, "cuda"), random_offs(m, g), fp8_dtype)


@requires_cuda
@pytest.mark.gpu
def test_jagged_skewed_groups_reread_path():
    # One group holds almost every row: far larger than the planned cache, so its
    # slices re-read rows from memory in pass 2; a 16-unaligned start too.
    m = 60000
    offs = torch.tensor([3, 3, 59993, 60000], dtype=torch.int32)
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, randn((m, 256), torch.bfloat16, "cuda"), offs, torch.float8_e4m3fn)
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, randn((m, 100), torch.float32, "cuda"), offs, torch.float8_e4m3fnuz)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4600, 8000, 20000])
def test_long_segment_plans(rows):
    # The three plans of a segment split over the largest cluster (plan_cols_launch): the 72 KB budget (576-row slices),
    # the 768-row cache (1000-row slices, re-read past 768) and the whole-SM cache (2500-row slices); one group of all
    # rows and a skewed pair, for a jagged tensor and an expert weight.
    x = randn((rows, 200), torch.bfloat16, "cuda")
    for offs in ([rows], [rows // 3, rows]):
        same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, x, torch.tensor(offs, dtype=torch.int32), torch.float8_e4m3fn)
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, randn((rows, 40), torch.float32, "cuda"),
                torch.tensor([rows], dtype=torch.int32), torch.float8_e4m3fnuz)
    w_t = randn((2, rows, 72), torch.bfloat16, "cuda").transpose(1, 2)  # reduced over N = rows
    same_as_cpu(moe_fp8_ext.quantize_experts_bwd, w_t, torch.float8_e4m3fn)


@requires_cuda
@pytest.mark.gpu
def test_jagged_single_block_plan():
    # Token groups whose planned group takes a 2-block cluster run one block per group slice with all the SM's shared
    # memory (plan_cols_launch): 10 groups over 8000 rows, empty groups, unaligned starts, one of 2300 rows (past 1752
    # cached: re-read in pass 2); plain and padded layouts, bf16, strided fp32, and the dual.
    m = 8000
    offs = torch.tensor([0, 0, 901, 1700, 4000, 4001, 5003, 6000, 7000, 8000], dtype=torch.int32)
    starts, _ = moe_fp8_ext.padded_group_offsets(offs, m, 16)
    x1, x2 = randn((m, 264), torch.bfloat16, "cuda"), randn((m, 96), torch.bfloat16, "cuda")
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, x1, offs, torch.float8_e4m3fn)
    same_as_cpu(lambda a, b, o, f: moe_fp8_ext.quantize_jagged_colwise_dual(a, b, o, f), x1, x2, offs, torch.float8_e4m3fn)
    same_as_cpu(lambda a, b, o, f, s: moe_fp8_ext.quantize_jagged_colwise_dual(a, b, o, f, padded_starts=s),
                x1, x2, offs, torch.float8_e4m3fnuz, starts)
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, randn((m, 2 * 40), torch.float32, "cuda")[:, ::2], offs,
                torch.float8_e4m3fn)


@requires_cuda
@pytest.mark.gpu
def test_jagged_unaligned_groups_and_odd_width():
    m = 5000
    offs = torch.tensor([1, 17, 18, 1000, 1001, 4999], dtype=torch.int32)  # tail row 4999
    x = randn((m, 2 * 769), torch.float16, "cuda")[:, ::2]  # strided: scalar path
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, x, offs, torch.float8_e4m3fn)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m, sizes", [
    # a 408-row cache (the planned group: 403 rows): groups shorter than a run, group
    # starts of seven residues mod 8, groups over several passes and past the cache
    # (chunks, each ending in a short pass)
    (5000, [3, 1, 5, 0, 7, 130, 9, 255, 2100, 11, 600, 6, 1000, 2]),
    (4999, [3, 1, 5, 0, 7, 130, 9, 255, 2100, 11, 600, 6, 1000, 2]),  # odd q stride: every column its own shift
    (40001, [1, 9001, 3, 20003, 4, 10987]),  # on sm90, an 8-block cluster a group: slices at rank * chunk
])
def test_jagged_shifted_runs(m, sizes):
    # q runs off the 8-byte grid (group starts, an odd q stride) are stored as aligned words assembled across lanes
    # (store_fragment_runs_shifted): vector path in bf16/fp16, scalar path, both fp8 formats, the dual, expert weights
    # (odd N at 4999 rows; at 5000 the launcher picks the instance without shifted stores, cols_runs_may_shift).
    offs = offs_from_sizes(sizes)
    assert int(offs[-1]) <= m
    x1, x2 = randn((m, 264), torch.bfloat16, "cuda"), randn((m, 72), torch.float16, "cuda")
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, x1, offs, torch.float8_e4m3fn)
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, x2, offs, torch.float8_e4m3fnuz)
    same_as_cpu(lambda a, b, o, f: moe_fp8_ext.quantize_jagged_colwise_dual(a, b, o, f), x1, x2.bfloat16(), offs,
                torch.float8_e4m3fn)
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, randn((m, 2 * 40), torch.float32, "cuda")[:, ::2], offs,
                torch.float8_e4m3fn)
    if m < 10000:
        w_t = randn((3, m, 72), torch.bfloat16, "cuda").transpose(1, 2)  # (E, 72, m), reduced over N = m
        same_as_cpu(moe_fp8_ext.quantize_experts_bwd, w_t, torch.float8_e4m3fn)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_rowwise_column_major_input_long_k(transposed):
    x = randn((3000, 20000), torch.bfloat16, "cuda")
    same_as_cpu(moe_fp8_ext.quantize_rowwise, x.t() if transposed else x, torch.float8_e4m3fn)


@requires_cuda
@pytest.mark.gpu
def test_garbage_offs_is_memory_safe():
    # Decreasing, negative and past-the-end offsets: results are unspecified on GPU
    # without MOE_FP8_DEBUG=1, but nothing outside q and scale may be touched.
    x = randn((512, 64), torch.bfloat16, "cuda")
    offs = torch.tensor([700, -5, 100, 2**31 - 1, 30, -2**31], dtype=torch.int32, device="cuda")
    guard = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
    q, s = moe_fp8_ext.quantize_jagged_colwise(x, offs, torch.float8_e4m3fn)
    torch.cuda.synchronize()
    assert q.shape == (512, 64) and s.shape == (6, 64)
    assert torch.all(guard == 7)


@requires_cuda
@pytest.mark.gpu
def test_debug_env_checks_offs_on_gpu():
    code = (
        "import torch, moe_fp8_ext\n"
        "x = torch.randn(8, 16, device='cuda', dtype=torch.bfloat16)\n"
        "offs = torch.tensor([6, 4], dtype=torch.int32, device='cuda')\n"
        "try:\n"
        "    moe_fp8_ext.quantize_jagged_colwise(x, offs, torch.float8_e4m3fn)\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = dict(os.environ, MOE_FP8_DEBUG="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "RAISED" in out.stdout and "expected non-decreasing offs" in out.stdout, out.stdout + out.stderr


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["1,8", "1,40", "2,64", "4,512", "8,16", "8,256"])
def test_cols_plan_override_same_bits(plan):
    # Any launch plan of the transposing kernel gives the CPU op's bits: caches far
    # shorter than a slice (the re-read path), one-fragment caches, single blocks and
    # 8-block clusters, with unaligned groups, a padded layout and the strided path.
    with _tuning.override(cols_plan=plan):
        m = 3001
        offs = torch.tensor([0, 5, 1500, 1517, 2999], dtype=torch.int32)  # empty group, tail rows
        starts, _ = moe_fp8_ext.padded_group_offsets(offs, m, 16)
        x1, x2 = randn((m, 264), torch.bfloat16, "cuda"), randn((m, 96), torch.bfloat16, "cuda")
        same_as_cpu(lambda a, b, o, f: moe_fp8_ext.quantize_jagged_colwise_dual(a, b, o, f), x1, x2, offs, torch.float8_e4m3fn)
        same_as_cpu(lambda a, b, o, f, s: moe_fp8_ext.quantize_jagged_colwise_dual(a, b, o, f, padded_starts=s),
                    x1, x2, offs, torch.float8_e4m3fn, starts)
        same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, randn((m, 2 * 77), torch.float32, "cuda")[:, ::2], offs,
                    torch.float8_e4m3fnuz)
        w_t = randn((3, 1000, 136), torch.bfloat16, "cuda").transpose(1, 2)
        same_as_cpu(moe_fp8_ext.quantize_experts_bwd, w_t, torch.float8_e4m3fn)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["1,128", "3,128", "2,384", "5,256", "64,512"])
def test_cols_block_plan_override_same_bits(plan):
    # Block mode (MXFP8 blocks of 32, blockwise blocks of 128) under any plan: the CPU
    # op's bytes, for unaligned-to-the-slice groups, an empty group, blocked and plain
    # scales, the padded layout, and more slices than a segment has blocks.
    with _tuning.override(cols_block_plan=plan):
        m = 4096 + 640
        offs = torch.tensor([0, 96, 1056, 1056, 3200, m], dtype=torch.int32)
        x = randn((m, 200), torch.bfloat16, "cuda")
        calls = [
            lambda t, o: moe_fp8_ext.quantize_mxfp8_colwise(t, "rceil", False, o),
            lambda t, o: moe_fp8_ext.quantize_mxfp8_colwise(t, "floor", True, o),
            lambda t, o: moe_fp8_ext.quantize_blockwise_act_rhs(t, torch.float8_e4m3fn),
            lambda t, o: moe_fp8_ext.quantize_blockwise_act_transposed_lhs(
                t, torch.float8_e4m3fn, offs=o, padded_starts=moe_fp8_ext.padded_group_offsets(o, m, 128)[0], alignment=128),
        ]
        for call in calls:
            gpu = call(x, offs.cuda())
            cpu = call(x.cpu(), offs)
            for g, c in zip(gpu, cpu):
                assert g.shape == c.shape and torch.equal(_bytes(g).cpu(), _bytes(c)), plan


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["0,128", "65,128", "2,64", "2,100", "2", "2,128x", "1,100096"])
def test_cols_block_plan_override_rejects_bad_values(plan):
    with _tuning.override(cols_block_plan=plan), pytest.raises(RuntimeError, match="tuning cols_block_plan"):
        moe_fp8_ext.quantize_mxfp8_colwise(randn((64, 64), torch.bfloat16, "cuda"))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["3,64", "2,12", "0,64", "2", "2,64x", "1,100000"])
def test_cols_plan_override_rejects_bad_values(plan):
    with _tuning.override(cols_plan=plan), pytest.raises(RuntimeError, match="tuning cols_plan"):
        # W^T: the reduction dimension is strided, so this is the transposing kernel
        moe_fp8_ext.quantize_experts_bwd(randn((2, 32, 64), torch.bfloat16, "cuda").transpose(1, 2), torch.float8_e4m3fn)
