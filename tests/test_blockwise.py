"""The FP8 blockwise family (DESIGN §6): quantize_blockwise_act_lhs (1x128 along K),
quantize_blockwise_act_rhs (128x1 down the columns) and
quantize_blockwise_act_transposed_lhs (x^T in 1x128 along M), with token groups for
the two transposing ops.

- the spec: moe_fp8_ext.reference against torchao's pure-torch blockwise references
  (torch_blockwise_scale_act_quant_lhs / _rhs, read from torchao's source without
  importing Triton; skipped when torchao is absent), outside the blocks whose amax is
  below 1e-12 (torchao clamps in the input dtype or fp64, DESIGN §6 in fp32);
- numerics: every op against the reference, bit for bit (codes, scales, strides), on
  CPU and (when present) GPU: bf16/fp16/fp32 inputs, e4m3fn/e4m3fnuz/e5m2, partial
  blocks (1, 127, 129, 300, ...), NaN/Inf/zero blocks, non-contiguous inputs, token
  groups with empty groups, a partial last block and rows past the groups, and the
  padded layout for any group sizes;
- errors: bad inputs give "<op>: expected X, got Y", from the op and from its fake;
- opcheck on every op (OPCHECK_CASES; test_op_coverage.py reads it) and
  torch.compile(fullgraph=True);
- GPU only: the CPU op's bits on large and odd shapes, CUDA-graph capture and replay.
"""

import ast
import math
import os

import pytest
import torch

import moe_fp8_ext
from moe_fp8_ext import _tuning
from moe_fp8_ext import reference as ref
from conftest import (
    strided_layouts_2d,
    tiled_data,
    DEVICES,
    IN_DTYPES,
    assert_fp8_equal,
    count_op_calls,
    graph_matches_eager,
    off_bf16_,
    offs_from_sizes,
    poison,
    randn,
    random_offs,
    requires_cuda,
    same_as_cpu,
)
from test_mxfp8 import edge_maxima

FP8S = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
FP8S_ALL = FP8S + [torch.float8_e5m2]
ALIGNMENTS = [128, 256, 512]
lhs = moe_fp8_ext.quantize_blockwise_act_lhs
rhs = moe_fp8_ext.quantize_blockwise_act_rhs
tlhs = moe_fp8_ext.quantize_blockwise_act_transposed_lhs


def same_layout(a, b):
    """The same memory order: equal strides on every dim of size > 1 (a size-1 dim's
    stride is arbitrary: torch's contiguous() keeps whatever it was)."""
    return a.numel() == 0 or all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def check(out, expected):
    """q: bit-exact codes (NaN matches NaN) with the expected dtype, shape and layout;
    scales: float32, exact (NaN matches NaN), the expected shape and layout."""
    (q, s), (eq, es) = out, expected
    assert q.dtype == eq.dtype and s.dtype == es.dtype == torch.float32, (q.dtype, eq.dtype, s.dtype)
    assert q.shape == eq.shape and s.shape == es.shape, (q.shape, eq.shape, s.shape, es.shape)
    assert same_layout(q, eq), (q.stride(), eq.stride())
    assert same_layout(s, es), (s.stride(), es.stride())
    assert_fp8_equal(q, eq)
    a, b = s.cpu(), es.cpu()
    same = (a == b) | (a.isnan() & b.isnan())
    if not bool(same.all()):
        i = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{int((~same).sum())} of {a.numel()} scales differ; first at {i}: "
                             f"{float(a[tuple(i)])!r} vs {float(b[tuple(i)])!r}")


# ---- data -----------------------------------------------------------------------------

def bw_data(shape, dtype, device="cpu", seed=0, specials=True):
    """tiled_data with 128x128 tiles."""
    return tiled_data(shape, dtype, device, seed, specials, tile=128, zero_frac=0.15, special_every=6000)


def layouts_2d(m, k, dtype, device, specials=True):
    return strided_layouts_2d(bw_data, m, k, dtype, device, specials)


def edge_rows(dtype, width=128):
    """(N, width) in dtype, one block per row: each edge maximum of test_mxfp8 (random
    sign and place) over random smaller values; the fp8 ties under a 448 maximum; rows
    holding +Inf, -Inf, NaN, NaN with Inf, all zeros, all -0, all +Inf, and tiny values
    below the 1e-12 clamp."""
    g = torch.Generator().manual_seed(11)
    maxima = torch.tensor(edge_maxima(dtype), dtype=torch.float64)
    n = maxima.numel()
    x = (torch.rand((n, width), generator=g, dtype=torch.float64) * 2 - 1) * maxima[:, None]
    x = x.to(dtype).double()
    pos = torch.randint(0, width, (n,), generator=g)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x[torch.arange(n), pos] = maxima * sign
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    ties = torch.cat([codes, (codes[1:] + codes[:-1]) / 2])
    ties = torch.cat([ties, -ties])[torch.randperm(2 * ties.numel(), generator=g)]
    ties = torch.cat([ties, ties.new_zeros((-ties.numel()) % (width - 1))]).view(-1, width - 1)
    ties = torch.cat([torch.full((ties.shape[0], 1), 448.0, dtype=torch.float64), ties], 1)
    special = torch.randn((9, width), generator=g, dtype=torch.float64)
    special[0, 3] = float("inf")
    special[1, width - 1] = -float("inf")
    special[2, 0] = float("nan")
    special[3, 5], special[3, 6] = float("nan"), float("inf")
    special[4] = 0.0
    special[5] = -0.0
    special[6] = float("inf")
    special[7] = special[7] * 1e-14
    special[8] = 1e-12
    return torch.cat([x, ties, special]).to(dtype)


# ---- the spec: reference = torchao's pure-torch blockwise references -------------------

def _torchao_refs():
    """torchao's torch_blockwise_scale_act_quant_lhs / _rhs, compiled from the source of
    torchao/prototype/blockwise_fp8_training/kernels.py (which imports Triton at the
    top: the pure-torch functions are taken out on their own)."""
    import importlib.util

    spec = importlib.util.find_spec("torchao")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchao is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "prototype", "blockwise_fp8_training", "kernels.py")
    if not os.path.exists(path):
        pytest.skip(f"torchao without {path}")
    tree = ast.parse(open(path).read())
    names = {"torch_blockwise_scale_act_quant_lhs", "torch_blockwise_scale_act_quant_rhs"}
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    consts = [n for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "EPS" for t in n.targets)]
    if len(funcs) != 2:
        pytest.skip("torchao's blockwise pure-torch references not found")
    from typing import Tuple

    ns = {"torch": torch, "Tuple": Tuple, "e4m3_dtype": torch.float8_e4m3fn,
          "FP8_E4M3_DTYPES": {torch.float8_e4m3fn, torch.float8_e4m3fnuz}}
    exec(compile(ast.Module(body=consts + funcs, type_ignores=[]), path, "exec"), ns)  # noqa: S102
    return ns["torch_blockwise_scale_act_quant_lhs"], ns["torch_blockwise_scale_act_quant_rhs"]


def _torchao_weight_ref():
    """torchao's torch_blockwise_scale_weight_quant, taken from the same source the same
    way as _torchao_refs."""
    import importlib.util

    _torchao_refs()  # skips when torchao or its references are absent
    path = os.path.join(list(importlib.util.find_spec("torchao").submodule_search_locations)[0], "prototype",
                        "blockwise_fp8_training", "kernels.py")
    tree = ast.parse(open(path).read())
    keep = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == "torch_blockwise_scale_weight_quant")
            or (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EPS" for t in n.targets))]
    if not any(isinstance(n, ast.FunctionDef) for n in keep):
        pytest.skip("torchao's torch_blockwise_scale_weight_quant not found")
    ns = {"torch": torch, "e4m3_dtype": torch.float8_e4m3fn}
    exec(compile(ast.Module(body=keep, type_ignores=[]), path, "exec"), ns)  # noqa: S102
    return ns["torch_blockwise_scale_weight_quant"]


def _clamped_blocks(a):
    """Blocks whose amax is below 1e-12, where torchao's clamp (in the input dtype or
    fp64) and DESIGN §6's (fp32 1e-12) give different scales."""
    return a.float() < 1e-12


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", FP8S)
@pytest.mark.parametrize("data", ["edges", "random"])
def test_reference_matches_torchao(dtype, fp8, data):
    t_lhs, t_rhs = _torchao_refs()
    if data == "edges":
        x = edge_rows(dtype)
        x = x[: x.shape[0] // 2 * 2].reshape(-1, 256)  # two blocks a row
        x = x[torch.isfinite(x.float()).all(1)]  # torchao's clamp(min=-max) keeps NaN, Inf: compared below
    else:
        x = bw_data((384, 512), dtype, seed=21, specials=False)
    # lhs: 1x128 along the rows
    tq, ts = t_lhs(x.contiguous(), 128, fp8)
    rq, rs = ref.quantize_blockwise_act_lhs(x, fp8)
    assert same_layout(tq, rq) and same_layout(ts, rs) and ts.shape == rs.shape
    keep = ~_clamped_blocks(x.float().abs().view(x.shape[0], -1, 128).amax(-1))
    assert keep.any()
    assert torch.equal(ts[keep], rs[keep])
    kq = keep.repeat_interleave(128, 1)
    assert_fp8_equal(rq[kq], tq[kq])
    # rhs: 128x1 down the columns (torchao wants M a multiple of 128 and K of 128)
    xr = x.t().contiguous() if x.shape[0] % 128 else x
    if xr.shape[0] % 128 == 0 and xr.shape[1] % 128 == 0:
        tq, ts = t_rhs(xr.contiguous(), 128, fp8)
        rq, rs = ref.quantize_blockwise_act_rhs(xr, fp8)
        assert same_layout(tq, rq) and same_layout(ts, rs) and ts.shape == rs.shape
        keep = ~_clamped_blocks(xr.float().abs().view(-1, 128, xr.shape[1]).amax(1))
        assert torch.equal(ts[keep], rs[keep])
        kq = keep.repeat_interleave(128, 0)
        assert_fp8_equal(rq[kq], tq[kq])


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", FP8S)
def test_weight_reference_matches_torchao(dtype, fp8):
    # torchao's torch_blockwise_scale_weight_quant gives q (M, N) and tile decode scales (M/128, N/128), row-major,
    # for multiples of 128. Our two orientations hold the same values: column-major copies (weight_rhs) and their
    # transposes (weight_transposed_rhs).
    t_w = _torchao_weight_ref()
    w = bw_data((384, 256), dtype, seed=23, specials=False)
    w[:128, :128] *= 64  # a tile with larger values: its scale alone changes
    tq, ts = t_w(w.contiguous(), 128, fp8)
    keep = ~_clamped_blocks(w.float().abs().view(3, 128, 2, 128).amax((1, 3)))
    assert keep.any()
    kq = keep.repeat_interleave(128, 0).repeat_interleave(128, 1)
    rq, rs = ref.quantize_blockwise_weight_rhs(w, fp8)
    assert rq.stride() == (1, 384) and rs.stride() == (1, 3) and rs.shape == ts.shape
    assert torch.equal(rs[keep], ts[keep])
    assert_fp8_equal(rq[kq], tq[kq])
    tq2, ts2 = ref.quantize_blockwise_weight_transposed_rhs(w, fp8)
    assert tq2.shape == (256, 384) and tq2.stride() == (1, 256) and ts2.shape == (2, 3) and ts2.stride() == (1, 2)
    assert torch.equal(ts2.t()[keep], ts[keep])
    assert_fp8_equal(tq2.t()[kq], tq[kq])


def test_weight_reference_partial_tiles_and_experts():
    # Sizes not divisible by 128: a partial tile's amax is over its valid part only (the
    # tile of a zero-padded copy); 3-D is the 2-D op per expert; a tile's decode scale
    # is amax / fp8_max as DESIGN §6 computes it (1 / (max / amax), fp32).
    w = bw_data((3, 200, 130), torch.bfloat16, seed=24, specials=False)
    for fp8 in FP8S:
        q, s = ref.quantize_blockwise_weight_rhs(w, fp8)
        assert q.shape == (3, 200, 130) and q.stride() == (200 * 130, 1, 200)
        assert s.shape == (3, 2, 2) and s.stride() == (4, 1, 2)
        for e in range(3):
            qe, se = ref.quantize_blockwise_weight_rhs(w[e], fp8)
            assert_fp8_equal(q[e], qe)
            assert torch.equal(s[e], se)
            padded = torch.zeros(256, 256, dtype=w.dtype)
            padded[:200, :130] = w[e]
            qp, sp = ref.quantize_blockwise_weight_rhs(padded, fp8)
            assert torch.equal(se, sp)
            assert_fp8_equal(qe, qp[:200, :130])
            amax = w[e].float().abs()[128:, :128].amax().clamp(min=1e-12)
            expect = torch.ones(()) / (torch.full((), ref.fp8_max(fp8)) / amax)
            assert torch.equal(se[1, 0], expect)


def test_reference_matches_torchao_specials():
    # NaN and Inf blocks: torchao's scale of an Inf block is 0 (decode Inf), of a NaN
    # block NaN, as DESIGN §5's rule gives.
    t_lhs, _ = _torchao_refs()
    x = torch.randn(4, 128)
    x[0, 3] = float("inf")
    x[1, 7] = float("nan")
    x[2, 0] = -float("inf")
    x[3, 1], x[3, 2] = float("nan"), float("inf")
    for fp8 in FP8S:
        tq, ts = t_lhs(x, 128, fp8)
        rq, rs = ref.quantize_blockwise_act_lhs(x, fp8)
        check((rq, rs), (tq, ts))


def test_reference_scale_rule():
    # DESIGN §6 by hand: s = max / max(amax, 1e-12) in fp32, scale = 1 / s, no pow2.
    x = torch.zeros(5, 256)
    x[0, 0], x[1, 130], x[2, 5], x[3, 200], x[4, 17] = 448.0, 3.0, 1e-20, float("nan"), -1000.0
    for fp8 in FP8S:
        mx = torch.tensor(torch.finfo(fp8).max)
        q, s = ref.quantize_blockwise_act_lhs(x, fp8)
        one = lambda a: float(torch.tensor(1.0) / (mx / torch.tensor(a)))  # noqa: E731
        zero = one(1e-12)
        want = [[one(448.0), zero], [zero, one(3.0)], [zero, zero], [zero, float("nan")], [one(1000.0), zero]]
        assert torch.allclose(s, torch.tensor(want), rtol=0, atol=0, equal_nan=True)
        assert float(q[1, 130].float()) == float(mx) and float(q[4, 17].float()) == -float(mx)
        assert math.isnan(float(q[3, 128].float())) and math.isnan(float(q[3, 255].float())) and float(q[3, 0].float()) == 0


# ---- the three ops, ungrouped -------------------------------------------------------------

SHAPES = [(0, 5), (5, 0), (1, 1), (3, 127), (5, 128), (7, 129), (130, 300), (257, 256), (129, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", FP8S_ALL)
@pytest.mark.parametrize("shape", SHAPES)
def test_act_lhs(device, dtype, fp8, shape):
    for x in layouts_2d(*shape, dtype, device):
        poison(device)
        out = lhs(x, fp8)
        check(out, ref.quantize_blockwise_act_lhs(x.cpu(), fp8))
        assert out[0].is_contiguous() and out[1].stride() == (1, max(shape[0], 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", FP8S_ALL)
@pytest.mark.parametrize("shape", SHAPES)
def test_act_rhs_and_transposed_lhs(device, dtype, fp8, shape):
    for x in layouts_2d(*shape, dtype, device):
        poison(device)
        r = rhs(x, fp8)
        check(r, ref.quantize_blockwise_act_rhs(x.cpu(), fp8))
        t = tlhs(x, fp8)
        check(t, ref.quantize_blockwise_act_transposed_lhs(x.cpu(), fp8))
        m, k = shape
        assert r[0].stride() == (1, max(m, 1)) and r[1].is_contiguous()
        assert t[0].is_contiguous() and t[1].stride() == (1, max(k, 1))
        # the same bytes: transposed_lhs is act_rhs's output transposed
        check((t[0].t(), t[1].t()), r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", FP8S_ALL)
def test_edge_values_every_op(device, dtype, fp8):
    x = edge_rows(dtype)  # (N, 128): one edge block per row
    xd = x.to(device)
    poison(device)
    check(lhs(xd, fp8), ref.quantize_blockwise_act_lhs(x, fp8))
    check(lhs(xd[:, :77], fp8), ref.quantize_blockwise_act_lhs(x[:, :77], fp8))  # a partial block
    # the transposing ops: the blocks run down the 128 rows of x.t()
    for xt in (x.t(), x.t().contiguous(), x.t()[:100]):
        check(rhs(xt.to(device), fp8), ref.quantize_blockwise_act_rhs(xt, fp8))
        check(tlhs(xt.to(device), fp8), ref.quantize_blockwise_act_transposed_lhs(xt, fp8))


@pytest.mark.parametrize("device", DEVICES)
def test_scale_rule_by_hand(device):
    # Without the reference: amax 448 -> scale 1, a zero block -> 1 / (448 / 1e-12f),
    # NaN -> NaN, Inf -> Inf (s = 0: its codes are 0, and NaN at the Inf, Inf * 0),
    # e4m3fnuz max 240; partial blocks reduce their valid part only.
    x = torch.zeros(3, 200, device=device)
    x[0, 0], x[0, 199], x[1, 127], x[2, 128] = 448.0, 240.0, float("nan"), float("inf")
    zero = float(torch.tensor(1.0) / (torch.tensor(448.0) / torch.tensor(1e-12)))
    _, s = lhs(x, torch.float8_e4m3fn)
    dec = float(torch.tensor(1.0) / (torch.tensor(448.0) / torch.tensor(240.0)))
    want = torch.tensor([[1.0, dec], [float("nan"), zero], [zero, float("inf")]])
    assert torch.allclose(s.cpu(), want, rtol=0, atol=0, equal_nan=True), s
    q, s = lhs(x, torch.float8_e4m3fnuz)
    assert float(s[0, 1]) == 1.0 and float(q[0, 199].float()) == 240.0 and float(s[0, 0]) == float(
        torch.tensor(1.0) / (torch.tensor(240.0) / torch.tensor(448.0)))
    assert math.isnan(float(q[2, 128].float())) and float(q[2, 129].float()) == 0
    q, s = rhs(x.t(), torch.float8_e4m3fn)  # the same blocks down the columns
    assert torch.allclose(s.cpu(), want.t(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_default_fp8_dtype(device):
    x = bw_data((130, 260), torch.bfloat16, device)
    f = moe_fp8_ext.default_fp8_dtype()
    for op, r in ((lhs, ref.quantize_blockwise_act_lhs), (rhs, ref.quantize_blockwise_act_rhs),
                  (tlhs, ref.quantize_blockwise_act_transposed_lhs)):
        out = op(x)
        assert out[0].dtype == f
        check(out, r(x.cpu(), f))


# ---- token groups -------------------------------------------------------------------------

GROUP_CASES = [  # (M, K, group sizes): non-empty groups start at multiples of 128, then a tail
    (0, 8, [0, 0, 0]),
    (1, 3, [1]),
    (300, 7, [128, 0, 172]),  # the last group ends in a partial block
    (300, 7, [128, 0, 100]),  # ... and rows past it
    (512, 130, [0, 256, 128, 0, 128]),
    (640, 33, [128, 0, 0, 384, 1, 0]),  # a 1-row last group: a 1-row block
    (256, 100, []),  # G = 0: every row past the groups
    (200, 129, [0, 0]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", FP8S)
@pytest.mark.parametrize("case", GROUP_CASES)
def test_groups(device, dtype, fp8, case):
    m, k, sizes = case
    offs = offs_from_sizes(sizes) if sizes else torch.zeros(0, dtype=torch.int32)
    for x in layouts_2d(m, k, dtype, device):
        poison(device)
        r = rhs(x, fp8, offs.to(device))
        check(r, ref.quantize_blockwise_act_rhs(x.cpu(), fp8, offs))
        t = tlhs(x, fp8, offs.to(device))
        check(t, ref.quantize_blockwise_act_transposed_lhs(x.cpu(), fp8, offs))
        check((t[0].t(), t[1].t()), r)


@pytest.mark.parametrize("device", DEVICES)
def test_groups_random(device):
    # Random group sizes in multiples of 128 with empty groups and a tail.
    for seed, (m, g, tail) in enumerate([(1024, 5, 0), (2048, 9, 200), (384, 3, 128)]):
        offs = random_offs(m, g, alignment=128, empty_frac=0.3, tail=tail, generator=torch.Generator().manual_seed(seed))
        x = bw_data((m, 96), torch.bfloat16, device, seed=seed)
        for fp8 in FP8S:
            check(rhs(x, fp8, offs.to(device)), ref.quantize_blockwise_act_rhs(x.cpu(), fp8, offs))
            check(tlhs(x, fp8, offs.to(device)), ref.quantize_blockwise_act_transposed_lhs(x.cpu(), fp8, offs))


PADDED_CASES = [  # (M, K, G, tail rows past offs[-1]); any group sizes
    (0, 8, 2, 0),
    (1, 7, 1, 0),
    (130, 33, 5, 3),
    (300, 96, 9, 0),
    (200, 150, 4, 0),
    (64, 130, 0, 0),
    # K multiples of 8: quantize_blockwise_act_dual's one-read kernel on a GPU
    (1000, 264, 7, 50),
    (700, 136, 3, 300),  # 300 rows past the groups: several blocks past the last padded group
    (64, 136, 0, 0),  # G = 0: every row past the groups
    (129, 8, 1, 0),
    (517, 1032, 6, 1),
]
dual = moe_fp8_ext.quantize_blockwise_act_dual


def check_dual(out, x, fp8, offs, alignment=None):
    check(out[:2], ref.quantize_blockwise_act_lhs(x.cpu(), fp8))
    check(out[2:], ref.quantize_blockwise_act_rhs(x.cpu(), fp8, offs, alignment))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("case", PADDED_CASES)
def test_padded(device, dtype, alignment, case):
    # The two transposing ops and act_dual (one-read GPU kernel for contiguous bf16/fp16 rows of 8k columns, else the
    # two ops) vs the reference: specials, empty groups, rows past the groups, alignments past one block (padded blocks
    # with no rows), every fp8 format, into poisoned memory.
    m, k, g, tail = case
    offs = random_offs(m, g, empty_frac=0.3, tail=tail, generator=torch.Generator().manual_seed(m + g + alignment))
    starts, _ = moe_fp8_ext.padded_group_offsets(offs, m, alignment)
    for i, x in enumerate(layouts_2d(m, k, dtype, device)):
        fp8 = FP8S_ALL[i % 3]
        poison(device)
        r = rhs(x, fp8, offs.to(device), starts.to(device), alignment)
        check(r, ref.quantize_blockwise_act_rhs(x.cpu(), fp8, offs, alignment))
        t = tlhs(x, fp8, offs.to(device), starts.to(device), alignment)
        check(t, ref.quantize_blockwise_act_transposed_lhs(x.cpu(), fp8, offs, alignment))
        rows = moe_fp8_ext.padded_rows(m, g, alignment)
        assert r[0].shape == (rows, k) and r[1].shape == (rows // 128, k)
        poison(device)
        check_dual(dual(x, fp8, offs.to(device), starts.to(device), alignment), x, fp8, offs, alignment)


@pytest.mark.parametrize("device", DEVICES)
def test_padded_equals_quantizing_the_padded_copy(device):
    # The padded form is the ungrouped op on pad_token_groups's copy, group by group:
    # zero padding rows never raise a block's amax.
    m, k, a = 517, 64, 128
    offs = offs_from_sizes([100, 0, 129, 1, 256, 31])
    x = bw_data((m, k), torch.bfloat16, device, specials=False)
    starts, ends = moe_fp8_ext.padded_group_offsets(offs.to(device), m, a)
    xp, _, _ = moe_fp8_ext.pad_token_groups(x, offs.to(device), a)
    got = rhs(x, torch.float8_e4m3fn, offs.to(device), starts, a)
    want = rhs(xp, torch.float8_e4m3fn, ends)
    check(got, want)


# ---- act_dual (in test_padded above too): the unpadded form -----------------------------------


def test_act_dual_reads_once_predicate():
    # When the recipe may count on one read (it then makes grad_out's two operands
    # together): a GPU, bf16/fp16, contiguous rows of a multiple of 8 columns, aligned.
    from moe_fp8_ext.blockwise import act_dual_reads_once

    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    assert not act_dual_reads_once(x)  # the CPU runs the two ops
    if torch.cuda.is_available():
        c = x.cuda()
        assert act_dual_reads_once(c) and act_dual_reads_once(c.half())
        assert not act_dual_reads_once(c.float())
        assert not act_dual_reads_once(torch.zeros(4, 12, dtype=torch.bfloat16, device="cuda"))
        assert not act_dual_reads_once(c.t().contiguous().t())
        assert not act_dual_reads_once(torch.zeros(70, dtype=torch.bfloat16, device="cuda")[2:66].view(4, 16))


@pytest.mark.parametrize("device", DEVICES)
def test_act_dual_unpadded_groups(device):
    # Groups at multiples of 128 without the padded layout: the two ops, the same rules.
    m, k = 640, 96
    offs = offs_from_sizes([128, 0, 256, 128])
    x = bw_data((m, k), torch.bfloat16, device)
    check_dual(dual(x, F8, offs.to(device)), x, F8, offs)
    with pytest.raises(RuntimeError, match="quantize_blockwise_act_dual: expected every non-empty token group to start"):
        dual(x.cpu(), F8, offs_from_sizes([100, 28]))


# ---- errors ---------------------------------------------------------------------------------

x256 = torch.randn(256, 64, dtype=torch.bfloat16)
offs2 = torch.tensor([128, 256], dtype=torch.int32)
starts2 = torch.tensor([0, 128], dtype=torch.int32)
F8 = torch.float8_e4m3fn

# (call, message, checked by the fake too): the fake cannot see the content of offs.
ERROR_CASES = [
    (lambda: lhs(torch.randn(2, 4, 32)), "quantize_blockwise_act_lhs: expected x to be a 2-D tensor, got 3-D", True),
    (lambda: lhs(torch.ones(4, 32, dtype=torch.int32)), "quantize_blockwise_act_lhs: expected x of dtype bfloat16, float16 or float32, got Int", True),
    (lambda: lhs(x256, torch.int8), "quantize_blockwise_act_lhs: expected fp8_dtype float8_e4m3fn, float8_e4m3fnuz or float8_e5m2, got Char", True),
    (lambda: lhs(x256, torch.float8_e8m0fnu), "quantize_blockwise_act_lhs: expected fp8_dtype float8_e4m3fn, float8_e4m3fnuz or float8_e5m2", True),
    (lambda: rhs(torch.randn(64)), "quantize_blockwise_act_rhs: expected x to be a 2-D tensor, got 1-D", True),
    (lambda: rhs(torch.randn(64, 4, dtype=torch.float64)), "quantize_blockwise_act_rhs: expected x of dtype bfloat16, float16 or float32, got Double", True),
    (lambda: rhs(x256, torch.bfloat16), "quantize_blockwise_act_rhs: expected fp8_dtype float8_e4m3fn, float8_e4m3fnuz or float8_e5m2, got BFloat16", True),
    (lambda: rhs(x256, F8, offs2.long()), "quantize_blockwise_act_rhs: expected offs of dtype int32, got Long", True),
    (lambda: rhs(x256, F8, offs2[None]), "quantize_blockwise_act_rhs: expected offs to be a 1-D tensor, got 2-D", True),
    (lambda: rhs(x256, F8, torch.tensor([200, 100], dtype=torch.int32)), "quantize_blockwise_act_rhs: expected non-decreasing offs", False),
    (lambda: rhs(x256, F8, torch.tensor([128, 300], dtype=torch.int32)), "quantize_blockwise_act_rhs: expected offs[1] in [0, 256], got 300", False),
    (lambda: rhs(x256, F8, torch.tensor([100, 256], dtype=torch.int32)), "quantize_blockwise_act_rhs: expected every non-empty token group to start at a multiple of 128 rows (or padded_starts and alignment for any group sizes), got group 1 starting at row 100", False),
    (lambda: tlhs(x256, F8, torch.tensor([0, 64, 64, 200], dtype=torch.int32)), "quantize_blockwise_act_transposed_lhs: expected every non-empty token group to start at a multiple of 128 rows", False),
    (lambda: rhs(x256, F8, offs2, starts2, 64), "quantize_blockwise_act_rhs: expected alignment to be a multiple of 128, got 64", True),
    (lambda: rhs(x256, F8, offs2, starts2, 384), "quantize_blockwise_act_rhs: expected alignment to be a power of two in [1, 1024], got 384", True),
    (lambda: rhs(x256, F8, offs2, starts2, 2048), "quantize_blockwise_act_rhs: expected alignment to be a power of two in [1, 1024], got 2048", True),
    (lambda: rhs(x256, F8, offs2, starts2), "quantize_blockwise_act_rhs: expected padded_starts and alignment together, got only padded_starts", True),
    (lambda: rhs(x256, F8, offs2, alignment=128), "quantize_blockwise_act_rhs: expected padded_starts and alignment together, got only alignment", True),
    (lambda: rhs(x256, F8, padded_starts=starts2, alignment=128), "quantize_blockwise_act_rhs: expected padded_starts only with offs", True),
    (lambda: rhs(x256, F8, offs2, starts2[:1], 128), "quantize_blockwise_act_rhs: expected padded_starts of shape (2,) like offs, got (1,)", True),
    (lambda: tlhs(x256, F8, offs2, torch.tensor([0, 64], dtype=torch.int32), 128), "quantize_blockwise_act_transposed_lhs: expected padded_starts[1]", False),
    (lambda: tlhs(torch.randn(3, 4, 5)), "quantize_blockwise_act_transposed_lhs: expected x to be a 2-D tensor, got 3-D", True),
    (lambda: dual(torch.randn(3, 4, 5), F8, offs2), "quantize_blockwise_act_dual: expected x to be a 2-D tensor, got 3-D", True),
    (lambda: dual(x256, torch.bfloat16, offs2), "quantize_blockwise_act_dual: expected fp8_dtype float8_e4m3fn, float8_e4m3fnuz or float8_e5m2, got BFloat16", True),
    (lambda: dual(x256, F8, offs2.long()), "quantize_blockwise_act_dual: expected offs of dtype int32, got Long", True),
    (lambda: dual(x256, F8, offs2, starts2, 64), "quantize_blockwise_act_dual: expected alignment to be a multiple of 128, got 64", True),
    (lambda: dual(x256, F8, offs2, starts2), "quantize_blockwise_act_dual: expected padded_starts and alignment together, got only padded_starts", True),
    (lambda: dual(x256, F8, offs2, torch.tensor([0, 64], dtype=torch.int32), 128), "quantize_blockwise_act_dual: expected padded_starts[1]", False),
    (lambda: tlhs(x256, F8, offs2.float()), "quantize_blockwise_act_transposed_lhs: expected offs of dtype int32, got Float", True),
    (lambda: tlhs(x256, F8, offs2, starts2, 100), "quantize_blockwise_act_transposed_lhs: expected alignment to be a multiple of 128, got 100", True),
    (lambda: tlhs(torch.ones(1, 1, dtype=torch.bfloat16).expand(2**31 - 8, 1), F8, torch.tensor([2**31 - 8], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 128), "quantize_blockwise_act_transposed_lhs: expected the padded layout of", True),
]


@pytest.mark.parametrize("call, message, _fake", ERROR_CASES, ids=[str(i) for i in range(len(ERROR_CASES))])
def test_bad_inputs(call, message, _fake):
    with pytest.raises(RuntimeError) as e:
        call()
    assert message in str(e.value)


@pytest.mark.parametrize("call, message", [(c, m) for c, m, fake in ERROR_CASES if fake],
                         ids=[str(i) for i, c in enumerate(ERROR_CASES) if c[2]])
def test_bad_inputs_fake(call, message):
    # The fakes (what torch.compile traces) refuse the same inputs with the same words.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError) as e:
            call()
    assert message.split(", got")[0] in str(e.value)


@pytest.mark.parametrize("op", [lhs, rhs, tlhs, lambda x, t=None: dual(x, t, offs2)])
def test_bad_types(op):
    with pytest.raises(TypeError, match="expected fp8_dtype to be a torch.dtype"):
        op(x256, "e4m3")
    with pytest.raises(TypeError, match="expected x to be a Tensor"):
        op([1.0, 2.0])


FAKE_CASES = [  # edge shapes opcheck does not reach: the fake's shapes and strides
    lambda: lhs(torch.randn(0, 300), F8),
    lambda: lhs(torch.randn(7, 0), F8),
    lambda: lhs(torch.randn(300, 7).t(), torch.float8_e4m3fnuz),
    lambda: rhs(torch.randn(0, 5), F8),
    lambda: rhs(torch.randn(300, 0), F8),
    lambda: tlhs(torch.randn(0, 5), F8),
    lambda: tlhs(torch.randn(300, 0), F8),
    lambda: tlhs(torch.randn(129, 3), torch.float8_e5m2),
    lambda: rhs(torch.randn(300, 7), F8, offs_from_sizes([128, 0, 100])),
    lambda: tlhs(torch.randn(300, 7), F8, torch.zeros(0, dtype=torch.int32)),
    lambda: rhs(torch.randn(0, 3), F8, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 128),
    lambda: tlhs(torch.randn(5, 3), F8, offs_from_sizes([5]), torch.zeros(1, dtype=torch.int32), 256),
    lambda: tlhs(torch.randn(5, 0), F8, offs_from_sizes([5]), torch.zeros(1, dtype=torch.int32), 256),
    lambda: dual(torch.randn(0, 8), F8, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 128),
    lambda: dual(torch.randn(300, 0), F8, offs_from_sizes([128, 0, 100])),
    lambda: dual(torch.randn(5, 16), F8, offs_from_sizes([5]), torch.zeros(1, dtype=torch.int32), 256),
    lambda: moe_fp8_ext.quantize_blockwise_weight_rhs(torch.randn(0, 5), F8),
    lambda: moe_fp8_ext.quantize_blockwise_weight_transposed_rhs(torch.randn(3, 0, 129), F8),
    lambda: moe_fp8_ext.quantize_blockwise_weight_dual(torch.randn(0, 129, 3), F8),
    lambda: moe_fp8_ext.quantize_blockwise_weight_dual(torch.randn(1, 1), torch.float8_e5m2),
    lambda: moe_fp8_ext.quantize_blockwise_weight_rhs_cat([torch.randn(2, 130, 128), torch.randn(2, 130, 5).mT.mT], F8),
    lambda: moe_fp8_ext.quantize_blockwise_weight_dual_cat([torch.randn(130, 256), torch.randn(130, 0)], F8),
]


@pytest.mark.parametrize("call", FAKE_CASES, ids=[str(i) for i in range(len(FAKE_CASES))])
def test_fake_matches_op(call):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = call()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = call()
    for r, f in zip(real, fake):
        assert (f.shape, f.dtype) == (r.shape, r.dtype)
        assert f.stride() == r.stride() or r.numel() == 0, (f.stride(), r.stride())


# ---- weights: 128x128 tiles ------------------------------------------------------------

wrhs = moe_fp8_ext.quantize_blockwise_weight_rhs
wtrhs = moe_fp8_ext.quantize_blockwise_weight_transposed_rhs
wdual = moe_fp8_ext.quantize_blockwise_weight_dual
WEIGHT_SHAPES = [(256, 384), (200, 130), (1, 1), (128, 129), (0, 5), (3, 300, 136), (1, 129, 7), (2, 0, 4)]


def weight_layouts(shape, dtype, device):
    """A weight in several memory layouts: contiguous, column-major per matrix, a
    strided slice, and (3-D) experts-major transposed."""
    w = bw_data(shape, dtype, device, seed=sum(shape))
    out = [w, w.transpose(-2, -1).contiguous().transpose(-2, -1)]
    big = bw_data((*shape[:-1], shape[-1] + 3), dtype, device, seed=5)
    out.append(big[..., 1:shape[-1] + 1])
    if w.dim() == 3:
        out.append(w.permute(1, 2, 0).contiguous().permute(2, 0, 1))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", FP8S_ALL)
@pytest.mark.parametrize("shape", WEIGHT_SHAPES)
def test_weight_ops(device, dtype, fp8, shape):
    # every layout of w, specials (NaN, Inf, zero tiles) included, into poisoned memory:
    # the reference's bits and layouts; the dual op is the two single ops
    for w in weight_layouts(shape, dtype, device):
        wc = w.cpu()
        poison(device)
        check(wrhs(w, fp8), ref.quantize_blockwise_weight_rhs(wc, fp8))
        poison(device)
        check(wtrhs(w, fp8), ref.quantize_blockwise_weight_transposed_rhs(wc, fp8))
        poison(device)
        q, s, qt, st = wdual(w, fp8)
        check((q, s), ref.quantize_blockwise_weight_rhs(wc, fp8))
        check((qt, st), ref.quantize_blockwise_weight_transposed_rhs(wc, fp8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8S)
@pytest.mark.parametrize("shape", WEIGHT_SHAPES + [(2, 256, 520), (2, 200, 256)])
def test_weight_ops_read_as_bf16(device, fp8, shape):
    # as_bf16: fp32 read as its bf16 cast (low bits, ties, overflow to Inf, specials), bit for bit the reference of
    # w.to(bfloat16), in every layout (the vector kernel's and the scalar one's)
    for i, w in enumerate(weight_layouts(shape, torch.float32, device)):
        off_bf16_(w, seed=i)
        wb = w.cpu().to(torch.bfloat16)
        poison(device)
        check(wrhs(w, fp8, as_bf16=True), ref.quantize_blockwise_weight_rhs(wb, fp8))
        poison(device)
        check(wtrhs(w, fp8, as_bf16=True), ref.quantize_blockwise_weight_transposed_rhs(wb, fp8))
    # the _cat ops: [W1; W3] of two weights, interleaved by 128 or not (each part any layout)
    if shape[-1] % 128 or len(shape) != 3:
        return
    parts = [list(weight_layouts(shape, torch.float32, device))[i] for i in (0, -1)]
    for i, w in enumerate(parts):
        off_bf16_(w, seed=10 + i)
    wb = torch.cat([w.cpu().to(torch.bfloat16) for w in parts], dim=-1)
    poison(device)
    check(moe_fp8_ext.quantize_blockwise_weight_rhs_cat(parts, fp8, as_bf16=True),
          ref.quantize_blockwise_weight_rhs(wb, fp8))
    poison(device)
    check(moe_fp8_ext.quantize_blockwise_weight_transposed_rhs_cat(parts, fp8, as_bf16=True),
          ref.quantize_blockwise_weight_transposed_rhs(wb, fp8))
    poison(device)
    check(moe_fp8_ext.quantize_blockwise_weight_rhs_cat(parts, fp8, interleave=True, as_bf16=True),
          moe_fp8_ext.quantize_blockwise_weight_rhs_cat([w.to(torch.bfloat16) for w in parts], fp8, interleave=True))


@pytest.mark.parametrize("device", DEVICES)
def test_weight_edge_tiles(device):
    # one tile per edge maximum (test_mxfp8's edges: fp8 ties, subnormal and huge
    # maxima, Inf, NaN, zero and tiny tiles), each placed at a random spot of its tile
    rows = edge_rows(torch.float32)
    n = rows.shape[0]
    w = torch.zeros((128 * n, 128), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    for i in range(n):
        w[128 * i + torch.randint(0, 128, (1,), generator=g)] = rows[i]
    for fp8 in FP8S_ALL:
        check(wrhs(w.to(device), fp8), ref.quantize_blockwise_weight_rhs(w, fp8))
        check(wtrhs(w.to(device), fp8), ref.quantize_blockwise_weight_transposed_rhs(w, fp8))


def test_weight_scale_is_per_tile():
    # an outlier changes its own tile's scale only (the others keep theirs), and the
    # partial tile of a 200 x 130 weight takes its amax over its valid part
    w = bw_data((256, 256), torch.bfloat16, specials=False)
    _, s0 = wrhs(w, torch.float8_e4m3fn)
    w2 = w.clone()
    w2[5, 200] = 1e4
    _, s1 = wrhs(w2, torch.float8_e4m3fn)
    changed = s0 != s1
    assert changed.tolist() == [[False, True], [False, False]]
    part = bw_data((200, 130), torch.float32, specials=False)
    _, sp = wrhs(part, torch.float8_e4m3fn)
    amax = part[128:, 128:].abs().amax().clamp(min=1e-12)
    assert torch.equal(sp[1, 1], torch.ones(()) / (torch.full((), 448.0) / amax))


@pytest.mark.parametrize("device", DEVICES)
def test_weight_default_fp8_dtype(device):
    w = _x(device)
    q, _ = wrhs(w)
    assert q.dtype == moe_fp8_ext.default_fp8_dtype(w.device if w.is_cuda else None)


@pytest.mark.parametrize("op", [wrhs, wtrhs, wdual])
def test_weight_bad_inputs(op):
    name = op.__name__
    with pytest.raises(RuntimeError, match=f"{name}: expected w to be 2-D \\(M, N\\) or 3-D"):
        op(torch.zeros(4), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=f"{name}: expected w of dtype bfloat16, float16 or float32"):
        op(torch.zeros(4, 4, dtype=torch.int32), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=f"{name}: expected fp8_dtype"):
        op(torch.zeros(4, 4), torch.float16)
    raw = getattr(torch.ops.moe_fp8, name)  # (the op itself, no Python wrapper, refuses the same way)
    if op is not wdual:
        for f in (op, raw):
            with pytest.raises(RuntimeError, match=f"{name}: expected w of dtype float32 to read it as bfloat16"):
                f(torch.zeros(4, 4, dtype=torch.bfloat16), torch.float8_e4m3fn, True)
    with pytest.raises(RuntimeError, match=f"{name}: expected w to be 2-D"):
        raw(torch.zeros(2, 2, 2, 2), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=f"{name}: expected w .*bfloat16, float16 or float32"):
        raw(torch.zeros(4, 4, dtype=torch.int32), torch.float8_e4m3fn)


wrcat = moe_fp8_ext.quantize_blockwise_weight_rhs_cat
wtcat = moe_fp8_ext.quantize_blockwise_weight_transposed_rhs_cat
wdcat = moe_fp8_ext.quantize_blockwise_weight_dual_cat
# (shape of the first part without its N, the parts' N): every part but the last whole tiles
CAT_CASES = [((3, 300), [256, 136]), ((1, 129), [128, 128, 7]), ((200,), [128, 0, 130]), ((2, 0), [128, 4]),
             ((0, 5), [128, 1]), ((130,), [384])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", FP8S_ALL)
@pytest.mark.parametrize("case", CAT_CASES)
def test_weight_cat_ops(device, dtype, fp8, case):
    # the weight ops of the concatenation along N, bit for bit, each part in its own
    # layout (the experts layer passes W1^T and W3^T: N strided), into poisoned memory
    lead, ns = case
    parts = []
    for i, n in enumerate(ns):
        layouts = weight_layouts((*lead, n), dtype, device)
        parts.append(layouts[(i + 1) % len(layouts)])
    cat = torch.cat([p.cpu() for p in parts], dim=-1)
    want = (*ref.quantize_blockwise_weight_rhs(cat, fp8), *ref.quantize_blockwise_weight_transposed_rhs(cat, fp8))
    poison(device)
    check(wrcat(parts, fp8), want[:2])
    poison(device)
    check(wtcat(parts, fp8), want[2:])
    poison(device)
    got = wdcat(parts, fp8)
    check(got[:2], want[:2])
    check(got[2:], want[2:])
    assert moe_fp8_ext.blockwise.weight_cat_ok(parts)


def test_weight_cat_bad_inputs():
    w = torch.zeros(2, 64, 128)
    cases = [
        ([], "expected at least one weight"),
        ([w[..., :100], w], "expected every weight but the last to have a multiple of 128 columns"),
        ([w, w[:1]], "expected every weight of the shape of the first but its last size"),
        ([w, w[:, :5]], "expected every weight of the shape of the first but its last size"),
        ([w, w.half()], "expected every weight of one dtype and device"),
        ([w, torch.zeros(64, 128)], "expected every weight of the shape of the first but its last size"),
        ([w, w.int()], "expected every weight of one dtype and device"),  # the first weight's rules bind the rest
        ([w, w[None]], "expected every weight of the shape of the first but its last size"),
        ([w.int(), w], "expected w of dtype bfloat16, float16 or float32"),
    ]
    for name in ("quantize_blockwise_weight_rhs_cat", "quantize_blockwise_weight_transposed_rhs_cat",
                 "quantize_blockwise_weight_dual_cat"):
        for ws, msg in cases:
            # (the raw op with no tensors cannot dispatch: the wrapper's check only)
            for op in (getattr(moe_fp8_ext, name), getattr(torch.ops.moe_fp8, name))[:2 if ws else 1]:
                with pytest.raises(RuntimeError, match=f"{name}: {msg}"):
                    op(ws, F8)
            assert not moe_fp8_ext.blockwise.weight_cat_ok(ws)
    for name in ("quantize_blockwise_weight_rhs_cat", "quantize_blockwise_weight_transposed_rhs_cat"):
        for op in (getattr(moe_fp8_ext, name), getattr(torch.ops.moe_fp8, name)):
            with pytest.raises(RuntimeError, match=f"{name}: expected w of dtype float32 to read it as bfloat16"):
                op([w.bfloat16()] * 2, F8, as_bf16=True)


def test_recipe_takes_the_cat_ops(monkeypatch):
    # fp8_blockwise's W1/W3 operands: the cat ops where the parts allow (bit for bit the
    # operand of the copy), else quantizing the copy (no cat op called)
    from moe_fp8_ext import recipes

    r = recipes.get_recipe("fp8_blockwise")
    calls = []
    count_op_calls(monkeypatch, recipes.blockwise, {"quantize_blockwise_weight_" + name: name
                                          for name in ("rhs_cat", "transposed_rhs_cat", "dual_cat")}, calls)
    for ns in ([256, 136], [100, 128]):
        ws = [bw_data((2, 130, n), torch.bfloat16, specials=False) for n in ns]
        cat = torch.cat(ws, dim=-1)
        whole = ns[0] % 128 == 0
        assert r.joins_w13_dgrad(*(w.transpose(-2, -1) for w in ws)) == whole
        calls.clear()
        check(r.quantize_weights(ws, F8)[0], wrhs(cat, F8))
        check(r.quantize_weights(ws, F8, fwd=False, bwd=True)[1], wtrhs(cat, F8))
        fwd, bwd = r.quantize_weights(ws, F8, bwd=True)
        check(fwd, wrhs(cat, F8))
        check(bwd, wtrhs(cat, F8))
        assert calls == (["rhs_cat", "transposed_rhs_cat", "dual_cat"] if whole else [])
        assert (r.quantize_weights(ws, F8, bwd=recipes.SAME_READ)[1] is not None) == whole  # one read makes both


# ---- opcheck and torch.compile ------------------------------------------------------------

def _x(d, m=300, k=200):
    return randn((m, k), torch.bfloat16, d)


def _offs(d):
    return torch.tensor([128, 128, 256, 290], dtype=torch.int32, device=d)


def _any_offs(d):
    return torch.tensor([5, 5, 140, 290], dtype=torch.int32, device=d)


def _starts(d, a=128):
    return moe_fp8_ext.padded_group_offsets(_any_offs("cpu"), 300, a)[0].to(d)


# (op name in torch.ops.moe_fp8, device -> args): schema, fake tensor and AOT dispatch
# of every op of the family. test_op_coverage.py reads the names.
OPCHECK_CASES = [
    ("quantize_blockwise_act_lhs", lambda d: (_x(d), torch.float8_e4m3fn)),
    ("quantize_blockwise_act_lhs", lambda d: (_x(d).t(), torch.float8_e4m3fnuz)),
    ("quantize_blockwise_act_rhs", lambda d: (_x(d), torch.float8_e4m3fn, None, None, None)),
    ("quantize_blockwise_act_rhs", lambda d: (_x(d, 200, 300).t(), torch.float8_e4m3fnuz, None, None, None)),
    ("quantize_blockwise_act_rhs", lambda d: (_x(d), torch.float8_e4m3fn, _offs(d), None, None)),
    ("quantize_blockwise_act_rhs", lambda d: (_x(d), torch.float8_e5m2, _any_offs(d), _starts(d), 128)),
    ("quantize_blockwise_act_transposed_lhs", lambda d: (_x(d), torch.float8_e4m3fn, None, None, None)),
    ("quantize_blockwise_act_transposed_lhs", lambda d: (_x(d).t().contiguous().t(), torch.float8_e4m3fnuz, None, None, None)),
    ("quantize_blockwise_act_transposed_lhs", lambda d: (_x(d), torch.float8_e4m3fn, _offs(d), None, None)),
    ("quantize_blockwise_act_transposed_lhs", lambda d: (_x(d), torch.float8_e4m3fnuz, _any_offs(d), _starts(d, 256), 256)),
    ("quantize_blockwise_act_dual", lambda d: (_x(d), torch.float8_e4m3fn, _offs(d), None, None)),
    ("quantize_blockwise_act_dual", lambda d: (_x(d), torch.float8_e4m3fnuz, _any_offs(d), _starts(d, 256), 256)),
    ("quantize_blockwise_act_dual", lambda d: (_x(d, 300, 208), torch.float8_e4m3fn, _any_offs(d), _starts(d), 128)),
    ("quantize_blockwise_weight_rhs", lambda d: (_x(d), torch.float8_e4m3fn)),
    ("quantize_blockwise_weight_rhs", lambda d: (randn((3, 130, 200), torch.float16, d), torch.float8_e4m3fnuz)),
    ("quantize_blockwise_weight_transposed_rhs", lambda d: (_x(d).t(), torch.float8_e4m3fn)),
    ("quantize_blockwise_weight_transposed_rhs", lambda d: (randn((2, 129, 64), torch.float32, d), torch.float8_e5m2)),
    ("quantize_blockwise_weight_rhs", lambda d: (randn((3, 130, 200), torch.float32, d), F8, True)),
    ("quantize_blockwise_weight_transposed_rhs", lambda d: (randn((2, 256, 136), torch.float32, d).mT, F8, True)),
    ("quantize_blockwise_weight_dual", lambda d: (_x(d), torch.float8_e4m3fnuz)),
    ("quantize_blockwise_weight_dual", lambda d: (randn((2, 300, 129), torch.bfloat16, d), torch.float8_e4m3fn)),
    ("quantize_blockwise_weight_rhs_cat", lambda d: ([randn((2, 300, 128), torch.bfloat16, d),
                                                       randn((2, 300, 129), torch.bfloat16, d)], torch.float8_e4m3fn)),
    ("quantize_blockwise_weight_transposed_rhs_cat", lambda d: ([randn((3, 130, 128), torch.float32, d),
                                                                  randn((3, 130, 40), torch.float32, d)], F8)),
    ("quantize_blockwise_weight_dual_cat", lambda d: ([randn((300, 256), torch.bfloat16, d),
                                                        randn((300, 7), torch.bfloat16, d)], torch.float8_e4m3fnuz)),
    ("quantize_blockwise_weight_rhs_cat", lambda d: ([randn((2, 200, 256), torch.bfloat16, d),
                                                       randn((2, 200, 256), torch.bfloat16, d)], F8, True)),
    ("quantize_blockwise_weight_dual_cat", lambda d: ([randn((2, 130, 128), torch.float32, d),
                                                        randn((2, 130, 128), torch.float32, d)], F8, True)),
    ("quantize_blockwise_weight_rhs_cat", lambda d: ([randn((2, 200, 256), torch.float32, d),
                                                       randn((2, 200, 256), torch.float32, d)], F8, True, True)),
    ("quantize_blockwise_weight_transposed_rhs_cat", lambda d: ([randn((3, 130, 128), torch.float32, d),
                                                                  randn((3, 130, 40), torch.float32, d)], F8, True)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, args", OPCHECK_CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(OPCHECK_CASES)])
def test_opcheck(device, op, args):
    torch.library.opcheck(getattr(torch.ops.moe_fp8, op).default, args(device))


def _bw_step(a, offs, starts):
    q1, s1 = moe_fp8_ext.quantize_blockwise_act_lhs(a, torch.float8_e4m3fn)
    q2, s2 = moe_fp8_ext.quantize_blockwise_act_rhs(a, torch.float8_e4m3fnuz)
    q3, s3 = moe_fp8_ext.quantize_blockwise_act_transposed_lhs(a * 2, torch.float8_e4m3fn, offs, starts, 128)
    q4, s4 = moe_fp8_ext.quantize_blockwise_act_rhs(a, torch.float8_e4m3fn, offs, starts, 128)
    w = moe_fp8_ext.quantize_blockwise_weight_dual(a * 0.5, torch.float8_e4m3fn)
    q5, s5 = moe_fp8_ext.quantize_blockwise_weight_rhs(a, torch.float8_e4m3fnuz)
    q6, s6 = moe_fp8_ext.quantize_blockwise_weight_transposed_rhs(a * 0.25, torch.float8_e4m3fn)
    d = moe_fp8_ext.quantize_blockwise_act_dual(a * 4, torch.float8_e4m3fn, offs, starts, 128)
    return q1, s1, q2, s2, q3, s3, q4, s4, *w, q5, s5, q6, s6, *d


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    def step(a, offs, starts):
        outs = _bw_step(a, offs, starts)
        # some surrounding math so that the ops sit inside a real graph: over the fp32
        # scales only (Triton on NVIDIA has no e4m3fnuz type, so inductor cannot read the
        # fnuz data; the data outputs are compared bit for bit below)
        total = sum(o.nansum() for o in outs if o.dtype == torch.float32)
        return (*outs, total)

    a = _x(device)
    offs, starts = _any_offs(device), _starts(device)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got, want = compiled(a, offs, starts), step(a, offs, starts)
    for g, e in zip(got[:-1], want[:-1]):
        assert g.dtype == e.dtype and g.shape == e.shape and g.stride() == e.stride()
        assert torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g.view(torch.int32),
                           e.view(torch.uint8) if e.element_size() == 1 else e.view(torch.int32))
    # The surrounding sum is plain float math that inductor may reorder (seen: 1.3e-7
    # relative); the ops' outputs above are compared bit for bit.
    torch.testing.assert_close(got[-1], want[-1], rtol=1e-5, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_default_dtype(device):
    # fp8_dtype=None resolves to the platform default before the op, under compile too
    x = _x(device)
    torch._dynamo.reset()
    got = torch.compile(lambda t: moe_fp8_ext.quantize_blockwise_act_lhs(t), fullgraph=True)(x)
    check(got, moe_fp8_ext.quantize_blockwise_act_lhs(x))


# ---- GPU only: the CPU op's bits on large shapes; CUDA graphs -------------------------------

@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8S)
def test_large_same_as_cpu(fp8):
    x = bw_data((8192, 7168), torch.bfloat16, "cuda")
    for t in (x, x.t(), x[:, :2050], x[:8000, 1:7001]):
        same_as_cpu(lambda u: lhs(u, fp8), t)
        same_as_cpu(lambda u: rhs(u, fp8), t)
        same_as_cpu(lambda u: tlhs(u, fp8), t)
    for w in (x, x[:, 1:7001], x.t(), x.view(8, 1024, 7168)):
        same_as_cpu(lambda u: wdual(u, fp8), w)
    offs = random_offs(8192, 64, alignment=128, generator=torch.Generator().manual_seed(2))
    same_as_cpu(lambda u, o: rhs(u, fp8, o), x[:, :1000], offs)
    same_as_cpu(lambda u, o: tlhs(u, fp8, o), x[:, :1000], offs)
    offs_any = random_offs(8192, 64, generator=torch.Generator().manual_seed(1))
    for a in ALIGNMENTS:
        starts, _ = moe_fp8_ext.padded_group_offsets(offs_any, 8192, a)
        same_as_cpu(lambda u, o, s: rhs(u, fp8, o, s, a), x[:, :1000], offs_any, starts)
        same_as_cpu(lambda u, o, s: tlhs(u, fp8, o, s, a), x[:, :1000], offs_any, starts)
        same_as_cpu(lambda u, o, s: dual(u, fp8, o, s, a), x[:, :1000], offs_any, starts)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_act_dual_kernel_same_as_two_ops(dtype):
    # The one-read kernel against the GPU's own two ops (and the CPU), bit for bit, on
    # the experts' shapes: router-like groups with empty ones, rows past the groups,
    # strided rows (a column slice), M not a multiple of 128.
    for m, k, g, seed in ((16384 + 77, 2048, 8, 0), (8192, 7168, 64, 1), (3000, 1408, 16, 2)):
        x = bw_data((m, 2 * k), dtype, "cuda", seed=seed)[:, :k]
        offs = random_offs(m, g, empty_frac=0.2, tail=33, generator=torch.Generator().manual_seed(seed)).cuda()
        starts, _ = moe_fp8_ext.padded_group_offsets(offs, m, 128)
        for fp8 in FP8S_ALL:
            poison("cuda")
            got = dual(x, fp8, offs, starts, 128)
            check(got[:2], lhs(x, fp8))
            check(got[2:], rhs(x, fp8, offs, starts, 128))
        same_as_cpu(lambda u, o, s: dual(u, torch.float8_e4m3fn, o, s, 128), x, offs, starts)


def act_lhs_rows_same_as_cpu(dtype, shapes, strided_cols, seed):
    """act_lhs on the GPU = on the CPU for each (M, K) of `shapes` in every fp8 format, then
    on 1000 rows of `strided_cols` columns that lie 2 * strided_cols apart."""
    for m, k in shapes:
        x = bw_data((m, k), dtype, "cuda", seed=m + k)
        for fp8 in FP8S_ALL:
            same_as_cpu(lambda u: lhs(u, fp8), x)
    wide = bw_data((1000, 2 * strided_cols), dtype, "cuda", seed=seed)
    same_as_cpu(lambda u: lhs(u, FP8S[0]), wide[:, :strided_cols])


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_act_lhs_cluster_gather_same_as_cpu(dtype):
    # act_lhs's ring kernel (16-byte-aligned rows that fit a ring stage), its 16-bit sm90+ instance forced to gather
    # scales over 8-row clusters: row counts around multiples of 8 (some under a cluster), a partial last block, M % 4
    # != 0 (per-row stores), strided rows, clusters walking several steps; then the default choice on a large shape.
    widths = (1024, 1032, 2048, 7168) if dtype != torch.float32 else (512, 1032, 2048, 8192)
    shapes = [(5, widths[0]), (8, widths[0]), (9, widths[1]), (23, widths[2]), (8195, widths[1]), (4100, widths[3]),
              (16384, widths[2])]
    with _tuning.override(rows_gather="1"):
        act_lhs_rows_same_as_cpu(dtype, shapes, widths[1], seed=3)
    same_as_cpu(lambda u: lhs(u, FP8S[0]), bw_data((16384 + 9, 7168), dtype, "cuda", seed=4))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_act_lhs_block_runs_same_as_cpu(dtype):
    # act_lhs's ring kernel on rows of at most 16 blocks, its 16-bit instance forced to block runs of 8 rows stored as
    # 32-byte scale runs: row counts around multiples of 8, a partial last block, M % 4 != 0 (per-row stores), more runs
    # than blocks, strided rows; then the default choice on a large shape.
    widths = (1024, 1032, 2048) if dtype != torch.float32 else (512, 1032, 2048)
    shapes = [(1, widths[0]), (5, widths[0]), (8, widths[2]), (9, widths[1]), (23, widths[2]), (1003, widths[2]),
              (8195, widths[1]), (40000, widths[2])]
    with _tuning.override(rows_gather="0", rows_runs="1"):
        act_lhs_rows_same_as_cpu(dtype, shapes, widths[2], seed=5)
    same_as_cpu(lambda u: lhs(u, FP8S[0]), bw_data((65536 + 5, 2048), dtype, "cuda", seed=6))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_odd_shapes_same_as_cpu(dtype):
    for m, k in ((1, 1), (7, 127), (129, 129), (300, 33), (4097, 1000)):
        x = bw_data((m, k), dtype, "cuda")
        for fp8 in FP8S_ALL:
            same_as_cpu(lambda u: lhs(u, fp8), x)
            same_as_cpu(lambda u: rhs(u, fp8), x)
            same_as_cpu(lambda u: tlhs(u, fp8), x.t())
    x = edge_rows(dtype).cuda()
    for fp8 in FP8S_ALL:
        same_as_cpu(lambda u: lhs(u, fp8), x)
        same_as_cpu(lambda u: rhs(u, fp8), x.t())


@requires_cuda
@pytest.mark.gpu
def test_cuda_graph_replay():
    a = bw_data((4096, 512), torch.bfloat16, "cuda", specials=False)
    offs = random_offs(4096, 16, generator=torch.Generator().manual_seed(5)).cuda()
    starts, _ = moe_fp8_ext.padded_group_offsets(offs, 4096, 128)
    graph_matches_eager(lambda: _bw_step(a, offs, starts))
