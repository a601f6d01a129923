"""The MXFP8 family (DESIGN §7): quantize_mxfp8_rowwise, quantize_mxfp8_colwise and
quantize_mxfp8_experts (e4m3fn data, one E8M0 scale per 32 elements of the contraction
dim, plain or blocked scales).

- the spec: moe_fp8_ext.reference bit-exact with torchao 0.18's ``to_mx`` (FLOOR and
  RCEIL, bf16 and fp32) and its ``to_blocked`` / grouped rearranges, edge cases
  included (skipped when torchao is not importable);
- numerics: every op against the reference, bit for bit (codes, scale bytes, the
  zero padding of blocked layouts, strides), on CPU and (when present) GPU: input
  dtypes, both roundings, odd and edge shapes, non-contiguous inputs, empty groups;
- errors: bad inputs give "<op>: expected X, got Y", from the op and from its fake;
- opcheck on every op (OPCHECK_CASES; test_op_coverage.py reads it) and
  torch.compile(fullgraph=True);
- GPU only: the CPU op's bits on large shapes, CUDA-graph capture and replay.
"""

import math

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
    graph_matches_eager,
    offs_from_sizes,
    poison,
    randn,
    random_offs,
    requires_cuda,
    same_as_cpu,
)

F8 = torch.float8_e4m3fn
E8 = torch.float8_e8m0fnu
ROUNDINGS = ["rceil", "floor"]
ALIGNMENTS = [32, 64, 128, 256]


def check(out, expected):
    """q: bit-exact codes (NaN matches NaN), float8_e4m3fn, the expected strides; scales:
    float8_e8m0fnu, byte-exact (blocked padding included), the expected shape."""
    (q, s), (eq, es) = out, expected
    assert q.dtype == F8 and s.dtype == E8, (q.dtype, s.dtype)
    assert q.shape == eq.shape, (q.shape, eq.shape)
    assert q.stride() == eq.stride() or q.numel() == 0, (q.stride(), eq.stride())
    assert_fp8_equal(q, eq)
    assert s.shape == es.shape, (s.shape, es.shape)
    assert s.is_contiguous()
    a, b = s.view(torch.uint8).cpu(), es.view(torch.uint8).cpu()
    if not torch.equal(a, b):
        i = (a != b).nonzero()[0].tolist()
        raise AssertionError(f"{int((a != b).sum())} of {a.numel()} scale bytes differ; first at {i}: "
                             f"{int(a[tuple(i)])} vs {int(b[tuple(i)])}")


# ---- data -----------------------------------------------------------------------------

def mx_data(shape, dtype, device="cpu", seed=0, specials=True):
    """tiled_data with 32x32 tiles."""
    return tiled_data(shape, dtype, device, seed, specials, tile=32, zero_frac=0.1, special_every=4000)


def layouts_2d(m, k, dtype, device, specials=True):
    return strided_layouts_2d(mx_data, m, k, dtype, device, specials)


def layouts_3d(e, k, n, dtype, device):
    """B_t (E, K, N): row-major; column-major per expert (the transpose of a contiguous
    (E, N, K) weight); and a permuted, strided view."""
    yield mx_data((e, k, n), dtype, device, seed=4)
    yield mx_data((e, n, k), dtype, device, seed=5).transpose(1, 2)
    yield mx_data((k, e, 2 * n), dtype, device, seed=6).permute(1, 0, 2)[:, :, ::2]


def _next(v, dtype, step):
    """The value `step` representable steps from v in dtype (v >= 0)."""
    itype = torch.int32 if dtype == torch.float32 else torch.int16
    t = torch.tensor([v], dtype=torch.float32).to(dtype)
    return float((t.view(itype) + step).view(dtype).float())


def edge_maxima(dtype):
    """Block maxima (fp32 values exact in dtype, finite, >= 0): zero, 448 * 2^k and 2^k
    over the whole range with their neighbours, fp32 values a hair above 448 * 2^k, the
    dtype's max / smallest normal / subnormals, and random magnitudes."""
    fi = torch.finfo(dtype)
    vals = {0.0, float(fi.max), float(fi.tiny), float(fi.tiny) / 2, float(fi.smallest_normal) * 0.75}
    sub = float(fi.tiny) * 2.0 ** -(23 if dtype == torch.float32 else 7 if dtype == torch.bfloat16 else 10)
    vals |= {sub, 3 * sub, 5 * sub, 7 * sub}
    for k in range(-160, 130):
        for base in (448.0, 1.0, 1.5, 1.75):
            v = base * 2.0**k
            t = torch.tensor([v], dtype=torch.float64).to(dtype)
            if t.isfinite().all() and float(t) == v and v > 0:
                vals.add(v)
                for step in (-1, 1, 2):
                    w = _next(v, dtype, step)
                    if math.isfinite(w) and w > 0:
                        vals.add(w)
    g = torch.Generator().manual_seed(7)
    lo, hi = (-24, 15) if dtype == torch.float16 else (-148, 127)
    rnd = torch.exp2(torch.randint(lo, hi, (200,), generator=g).double()) * (1 + torch.rand(200, generator=g, dtype=torch.float64))
    vals |= {float(v) for v in rnd.to(dtype).float() if math.isfinite(float(v)) and float(v) > 0}
    return sorted(vals)


def e4m3_midpoints():
    """Every midpoint of two adjacent positive e4m3fn values, and the values themselves:
    the data's round-to-nearest-even ties."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(F8).float()
    return torch.cat([codes, (codes[1:] + codes[:-1]) / 2])


def edge_blocks(dtype):
    """(N, 32) in dtype, one block per row: each edge maximum (random sign, random place)
    over random smaller values; the e4m3 ties under a 448 maximum; blocks holding +Inf,
    -Inf, NaN, NaN with Inf, and a negative-zero block."""
    g = torch.Generator().manual_seed(11)
    maxima = torch.tensor(edge_maxima(dtype), dtype=torch.float64)
    n = maxima.numel()
    x = (torch.rand((n, 32), generator=g, dtype=torch.float64) * 2 - 1) * maxima[:, None]
    x = x.to(dtype).double()
    pos = torch.randint(0, 32, (n,), generator=g)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x[torch.arange(n), pos] = maxima * sign
    ties = e4m3_midpoints().double()
    ties = torch.cat([ties, -ties])
    ties = ties[torch.randperm(ties.numel(), generator=g)]
    ties = torch.cat([ties, ties.new_zeros((-ties.numel()) % 31)]).view(-1, 31)
    ties = torch.cat([torch.full((ties.shape[0], 1), 448.0, dtype=torch.float64), ties], 1)
    if dtype == torch.float16:
        ties = ties.clamp(min=-448, max=448)
    special = torch.randn((6, 32), generator=g, dtype=torch.float64)
    special[0, 3] = float("inf")
    special[1, 30] = -float("inf")
    special[2, 0] = float("nan")
    special[3, 5], special[3, 6] = float("nan"), float("inf")
    special[4] = -0.0
    special[5, :] = float("inf")
    return torch.cat([x, ties, special]).to(dtype)


# ---- the spec: reference = torchao 0.18 -------------------------------------------------

def _torchao():
    pytest.importorskip("torchao")
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.utils import to_blocked
    except ImportError as e:  # a torchao without the MX prototype
        pytest.skip(f"torchao.prototype.mx_formats: {e}")
    modes = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}
    return to_mx, to_blocked, modes


def torchao_float_log2_misses(amax):
    """Blocks where torchao's fp32 RCEIL fallback, ceil(log2(amax / 448)) evaluated in
    float, is not the exact ceil of DESIGN §7: amax / 448 a hair above a power of two
    2^j with |j| >= 4, whose float log2 rounds to j itself. The reference follows the
    bit rule there (test_reference_rceil_follows_the_bit_rule)."""
    d = amax.float() / torch.full_like(amax.float(), 448.0)
    fl = torch.clamp(torch.ceil(torch.log2(d)), -127, 127) + 127
    return (fl.to(torch.int32) != ref.e8m0_from_amax(amax, "rceil")) & d.isfinite() & (d > 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("data", ["edges", "random"])
def test_reference_matches_torchao_to_mx(dtype, rounding, data):
    to_mx, _, modes = _torchao()
    x = edge_blocks(dtype) if data == "edges" else mx_data((96, 256), dtype, seed=21).view(-1, 32)
    scale, q = to_mx(x, F8, 32, modes[rounding])
    rq, rs = ref.quantize_mxfp8_rowwise(x, rounding)
    assert rs.dtype == scale.dtype == E8 and rq.dtype == q.dtype == F8
    miss = torchao_float_log2_misses(x.float().abs().amax(1))
    if dtype == torch.bfloat16:
        assert not miss.any()  # bf16 maxima never sit a hair above 448 * 2^k
    elif data == "edges":
        assert miss.any()  # the edge set holds such fp32 maxima: the exclusion is exercised
    if miss.any():
        # Known spec point: torchao's float log2 misses the exact ceil a hair above a
        # power of two (torchao_float_log2_misses); only there, and only for RCEIL.
        d = x.float().abs().amax(1)[miss].double() / 448
        frac = d / torch.exp2(torch.floor(torch.log2(d))) - 1
        assert bool((frac > 0).all() and (frac < 2.0**-18).all()), frac
    keep = ~miss if rounding == "rceil" else torch.ones_like(miss)
    assert torch.equal(rs[keep].view(torch.uint8), scale[keep].view(torch.uint8))
    assert_fp8_equal(rq[keep], q[keep])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rceil_float_log2_never_misses_for_16_bit_inputs(dtype):
    # Every finite 16-bit amax: torchao's float log2 and the bit rule agree (DESIGN §7).
    finite = torch.arange(0, 0x7C00 if dtype == torch.float16 else 0x7F80, dtype=torch.int32)
    amax = finite.to(torch.int16).view(dtype)
    assert not torchao_float_log2_misses(amax).any()


def test_reference_rceil_follows_the_bit_rule():
    # amax / 448 = 2^j (1 + 2^-23): the scale must be 2^(j+1) (ceil of the exact log2),
    # so that no element saturates, whatever a float log2 rounds to.
    for j in (-140, -130, -126, -100, -20, -4, -1, 0, 1, 3, 4, 20, 100, 119):
        d = torch.tensor([2.0**j], dtype=torch.float32)
        d = (d.view(torch.int32) + 1).view(torch.float32)  # the smallest fp32 above 2^j
        amax = (d.double() * 448).float()  # exact for these d
        assert float(amax) / 448 > 2.0**j and math.isfinite(float(amax))
        assert int(ref.e8m0_from_amax(amax, "rceil")) == max(j + 1, -127) + 127, j
    # exact powers of two and values a hair below stay on the exact ceil too
    for j in (-130, -10, 0, 10, 119):
        amax = torch.tensor([448 * 2.0**j], dtype=torch.float64).float()
        assert int(ref.e8m0_from_amax(amax, "rceil")) == max(j, -127) + 127
        below = (amax.view(torch.int32) - 1).view(torch.float32)
        assert int(ref.e8m0_from_amax(below, "rceil")) == max(j, -127) + 127


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (128, 4), (130, 5), (300, 9), (256, 8)])
def test_reference_to_blocked_matches_torchao(shape):
    _, to_blocked, _ = _torchao()
    s = torch.randint(0, 256, shape, dtype=torch.uint8).view(E8)
    got = ref.to_blocked(s)
    assert got.shape == (-(-shape[0] // 128) * 128, -(-shape[1] // 4) * 4)
    assert torch.equal(got.view(torch.uint8).flatten(), to_blocked(s).view(torch.uint8).flatten())


def test_reference_grouped_blocked_matches_torchao():
    """The grouped layouts against torchao's pure-torch rearranges (the layouts torch's
    scaled_grouped_mm reads): M groups, K groups (each group's blocked matrix contiguous),
    per expert. torchao's static bounds are a little shorter (M/32 + 4G columns for K
    groups): the rest of ours must be zero."""
    _torchao()
    try:
        from torchao.prototype.moe_training.kernels.mxfp8.quant import (
            torch_to_blocked_2d_K_groups,
            torch_to_blocked_2d_M_groups,
            torch_to_blocked_per_group_3d,
        )
    except ImportError as e:
        pytest.skip(f"torchao moe_training: {e}")
    g = torch.Generator().manual_seed(3)

    def same_prefix(ours, theirs):
        a, b = ours.view(torch.uint8).flatten(), theirs.view(torch.uint8).flatten()
        n = min(a.numel(), b.numel())
        assert torch.equal(a[:n], b[:n])
        assert not a[n:].any() and not b[n:].any()

    for sizes in ([5, 0, 130, 128, 1], [300], [0, 0, 7], [128, 129, 0, 3]):
        offs = offs_from_sizes(sizes)
        s = torch.randint(1, 255, (sum(sizes), 8), dtype=torch.uint8, generator=g)
        same_prefix(ref.to_blocked_m_groups(s, offs), torch_to_blocked_2d_M_groups(s, offs)[0])
    for rows in (1, 100, 128, 130, 300):
        for sizes in ([64, 0, 160, 32, 96], [32], [0, 256, 0], [128, 128]):
            offs = offs_from_sizes(sizes)
            s = torch.randint(1, 255, (rows, sum(sizes) // 32), dtype=torch.uint8, generator=g)
            same_prefix(ref.to_blocked_k_groups(s, offs), torch_to_blocked_2d_K_groups(s, offs // 32)[0])
    for e, n, c in ((1, 1, 1), (3, 130, 5), (2, 256, 8)):
        s = torch.randint(1, 255, (e, n, c), dtype=torch.uint8, generator=g)
        want = torch_to_blocked_per_group_3d(s)
        assert torch.equal(torch.stack([ref.to_blocked(s[i]).flatten() for i in range(e)]), want)


def test_reference_k_groups_layout_by_index():
    # Independent of torchao: group g's (R, n_g) scales are to_blocked on their own,
    # starting at flat offset ceil128(R) * sum_{j<g} ceil4(n_j / 32).
    rows, sizes = 200, [96, 0, 32, 160]
    s = torch.arange(rows * 9, dtype=torch.int32).remainder(251).add(1).to(torch.uint8).view(rows, 9)
    out = ref.to_blocked_k_groups(s, offs_from_sizes(sizes)).view(torch.uint8).flatten()
    assert out.numel() == 256 * (12 + 16)
    col, start = 0, 0
    for n in sizes:
        nb = n // 32
        blk = ref.to_blocked(s[:, col : col + nb]).view(torch.uint8).flatten()
        assert torch.equal(out[start * 256 : start * 256 + blk.numel()], blk)
        col += nb
        start += -(-nb // 4) * 4
    assert not out[start * 256 :].any()


# ---- quantize_mxfp8_rowwise ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("shape", [(0, 64), (1, 32), (7, 96), (130, 128), (300, 64)])
def test_rowwise(device, dtype, rounding, blocked, shape):
    for x in layouts_2d(*shape, dtype, device):
        poison(device)
        out = moe_fp8_ext.quantize_mxfp8_rowwise(x, rounding, blocked)
        check(out, ref.quantize_mxfp8_rowwise(x.cpu(), rounding, blocked))
        assert out[0].is_contiguous()


ROW_GROUP_CASES = [  # (M, K, G, tail rows past offs[-1])
    (0, 64, 3, 0),
    (1, 32, 1, 0),
    (130, 96, 4, 0),
    (300, 64, 9, 5),
    (257, 32, 1, 0),
    (64, 32, 0, 0),
    (2000, 64, 32, 3),  # a warp's lanes of groups,
    (2100, 32, 33, 0),  # and one group more
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("case", ROW_GROUP_CASES)
def test_rowwise_m_groups(device, dtype, rounding, case):
    m, k, g, tail = case
    offs = random_offs(m, g, empty_frac=0.3, tail=tail, generator=torch.Generator().manual_seed(m + g))
    for x in layouts_2d(m, k, dtype, device):
        poison(device)
        out = moe_fp8_ext.quantize_mxfp8_rowwise(x, rounding, True, offs.to(device))
        check(out, ref.quantize_mxfp8_rowwise(x.cpu(), rounding, True, offs))
        assert out[1].shape == (m + 128 * g, -(-k // 128) * 4)


@pytest.mark.parametrize("device", DEVICES)
def test_rowwise_explicit_groups(device):
    # Groups of 128 exactly, 129 (a second tile), an empty group first and last.
    x = mx_data((389, 64), torch.bfloat16, device)
    offs = offs_from_sizes([0, 128, 129, 1, 131, 0])
    for rounding in ROUNDINGS:
        poison(device)
        out = moe_fp8_ext.quantize_mxfp8_rowwise(x, rounding, True, offs.to(device))
        check(out, ref.quantize_mxfp8_rowwise(x.cpu(), rounding, True, offs))


# ---- quantize_mxfp8_colwise ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("shape", [(0, 5), (32, 1), (96, 7), (128, 130), (320, 33)])
def test_colwise(device, dtype, rounding, blocked, shape):
    for x in layouts_2d(*shape, dtype, device):
        poison(device)
        out = moe_fp8_ext.quantize_mxfp8_colwise(x, rounding, blocked)
        check(out, ref.quantize_mxfp8_colwise(x.cpu(), rounding, blocked))


COL_GROUP_CASES = [  # (M, K, G, tail rows past offs[-1]); group sizes multiples of 32
    (0, 8, 3, 0),
    (32, 1, 1, 0),
    (192, 7, 1, 0),
    (256, 130, 5, 64),
    (320, 33, 12, 0),
    (128, 100, 0, 0),
    (96, 128, 3, 0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("case", COL_GROUP_CASES)
def test_colwise_groups(request, device, dtype, rounding, blocked, case):
    m, k, g, tail = case
    offs = random_offs(m, g, alignment=32, empty_frac=0.3, tail=tail, generator=torch.Generator().manual_seed(m + g))
    for x in layouts_2d(m, k, dtype, device):
        poison(device)
        out = moe_fp8_ext.quantize_mxfp8_colwise(x, rounding, blocked, offs.to(device))
        check(out, ref.quantize_mxfp8_colwise(x.cpu(), rounding, blocked, offs))


COL_PADDED_CASES = [  # (M, K, G, tail); any group sizes
    (0, 8, 2, 0),
    (1, 7, 1, 0),
    (130, 33, 5, 3),
    (300, 96, 9, 0),
    (200, 150, 4, 0),
    (64, 130, 0, 0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("case", COL_PADDED_CASES)
def test_colwise_padded(request, device, dtype, blocked, alignment, case):
    m, k, g, tail = case
    offs = random_offs(m, g, empty_frac=0.3, tail=tail, generator=torch.Generator().manual_seed(m + g + alignment))
    starts, _ = moe_fp8_ext.padded_group_offsets(offs, m, alignment)
    for i, x in enumerate(layouts_2d(m, k, dtype, device)):
        rounding = ROUNDINGS[i % 2]
        poison(device)
        out = moe_fp8_ext.quantize_mxfp8_colwise(x, rounding, blocked, offs.to(device), starts.to(device), alignment)
        check(out, ref.quantize_mxfp8_colwise_padded(x.cpu(), offs, alignment, rounding, blocked))


# ---- quantize_mxfp8_experts ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("shape", [(1, 32, 1), (3, 96, 7), (2, 128, 130), (1, 64, 300), (2, 0, 5), (0, 32, 8), (3, 64, 256)])
def test_experts(device, dtype, rounding, blocked, shape):
    for b_t in layouts_3d(*shape, dtype, device):
        poison(device)
        out = moe_fp8_ext.quantize_mxfp8_experts(b_t, rounding, blocked)
        check(out, ref.quantize_mxfp8_experts(b_t.cpu(), rounding, blocked))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("shape", [(1, 32, 32), (3, 96, 64), (2, 160, 128)])
def test_experts_dgrad(device, dtype, blocked, shape):
    # dgrad: the same B_t, contracted over N: quantize B_t.transpose(-2, -1).
    for i, b_t in enumerate(layouts_3d(*shape, dtype, device)):
        rounding = ROUNDINGS[i % 2]
        w = b_t.transpose(-2, -1)
        poison(device)
        out = moe_fp8_ext.quantize_mxfp8_experts(w, rounding, blocked)
        check(out, ref.quantize_mxfp8_experts(w.cpu(), rounding, blocked))


# ---- edge values through every op -----------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_edge_values_every_op(device, dtype, rounding):
    x = edge_blocks(dtype)  # (N, 32): one edge block per row
    xd = x.to(device)
    poison(device)
    for blocked in (False, True):
        check(moe_fp8_ext.quantize_mxfp8_rowwise(xd, rounding, blocked), ref.quantize_mxfp8_rowwise(x, rounding, blocked))
        # colwise: the blocks run down the 32 rows of x.t(), column-major and row-major
        check(moe_fp8_ext.quantize_mxfp8_colwise(xd.t(), rounding, blocked), ref.quantize_mxfp8_colwise(x.t(), rounding, blocked))
        check(moe_fp8_ext.quantize_mxfp8_colwise(xd.t().contiguous(), rounding, blocked),
              ref.quantize_mxfp8_colwise(x.t().contiguous(), rounding, blocked))
        # experts (1, K=32, N): column-major per expert and row-major
        for b_t in (x.t()[None], x.t().contiguous()[None]):
            check(moe_fp8_ext.quantize_mxfp8_experts(b_t.to(device), rounding, blocked),
                  ref.quantize_mxfp8_experts(b_t, rounding, blocked))


def test_scales_are_e8m0_of_the_block_max():
    # A plain check of the scale rule that does not go through the reference.
    x = torch.zeros(4, 64)
    x[0, 0], x[1, 32], x[2, 5], x[3, 40] = 448.0, 449.0, 1.0, float("nan")
    _, s = moe_fp8_ext.quantize_mxfp8_rowwise(x, "rceil")
    assert s.view(torch.uint8).tolist() == [[127, 0], [0, 128], [119, 0], [0, 255]]
    _, s = moe_fp8_ext.quantize_mxfp8_rowwise(x, "floor")
    assert s.view(torch.uint8).tolist() == [[127, 0], [0, 127], [119, 0], [0, 255]]


# ---- errors ---------------------------------------------------------------------------------

x64 = torch.randn(64, 64, dtype=torch.bfloat16)
offs2 = torch.tensor([32, 64], dtype=torch.int32)
starts2 = torch.tensor([0, 64], dtype=torch.int32)
rowwise = moe_fp8_ext.quantize_mxfp8_rowwise
colwise = moe_fp8_ext.quantize_mxfp8_colwise
experts = moe_fp8_ext.quantize_mxfp8_experts

# (call, message, checked by the fake too): the fake cannot see the content of offs.
ERROR_CASES = [
    (lambda: rowwise(torch.randn(4, 48)), "quantize_mxfp8_rowwise: expected K (x.size(1)) to be a multiple of 32, got 48", True),
    (lambda: rowwise(torch.randn(2, 4, 32)), "quantize_mxfp8_rowwise: expected x to be a 2-D tensor, got 3-D", True),
    (lambda: rowwise(torch.ones(4, 32, dtype=torch.int32)), "quantize_mxfp8_rowwise: expected x of dtype bfloat16, float16 or float32, got Int", True),
    (lambda: rowwise(x64, "nearest"), 'quantize_mxfp8_rowwise: expected rounding "rceil" or "floor", got "nearest"', True),
    (lambda: rowwise(x64, "rceil", False, offs2), "quantize_mxfp8_rowwise: expected offs only with blocked=True", True),
    (lambda: rowwise(x64, "rceil", True, offs2.long()), "quantize_mxfp8_rowwise: expected offs of dtype int32, got Long", False),
    (lambda: rowwise(x64, "rceil", True, torch.tensor([40, 30], dtype=torch.int32)), "quantize_mxfp8_rowwise: expected non-decreasing offs", False),
    (lambda: colwise(torch.randn(48, 4)), "quantize_mxfp8_colwise: expected M (x.size(0)) to be a multiple of 32, got 48", True),
    (lambda: colwise(torch.randn(64)), "quantize_mxfp8_colwise: expected x to be a 2-D tensor, got 1-D", True),
    (lambda: colwise(torch.randn(64, 4, dtype=torch.float64)), "quantize_mxfp8_colwise: expected x of dtype bfloat16, float16 or float32, got Double", True),
    (lambda: colwise(x64, "RCEIL"), 'quantize_mxfp8_colwise: expected rounding "rceil" or "floor", got "RCEIL"', True),
    (lambda: colwise(x64, offs=torch.tensor([16, 64], dtype=torch.int32)), "quantize_mxfp8_colwise: expected token groups whose sizes are multiples of 32", False),
    (lambda: colwise(x64, offs=offs2, padded_starts=starts2, alignment=48), "quantize_mxfp8_colwise: expected alignment to be a multiple of 32, got 48", True),
    (lambda: colwise(x64, offs=offs2, padded_starts=starts2, alignment=16), "quantize_mxfp8_colwise: expected alignment to be a multiple of 32, got 16", True),
    (lambda: colwise(x64, offs=offs2, padded_starts=starts2, alignment=96), "quantize_mxfp8_colwise: expected alignment to be a power of two", False),
    (lambda: colwise(x64, offs=offs2, padded_starts=starts2), "quantize_mxfp8_colwise: expected padded_starts and alignment together", True),
    (lambda: colwise(x64, offs=offs2, alignment=32), "quantize_mxfp8_colwise: expected padded_starts and alignment together", True),
    (lambda: colwise(x64, padded_starts=starts2, alignment=32), "quantize_mxfp8_colwise: expected padded_starts only with offs", True),
    (lambda: colwise(x64, offs=offs2, padded_starts=torch.tensor([0, 16], dtype=torch.int32), alignment=32), "quantize_mxfp8_colwise: expected padded_starts[1]", False),
    (lambda: experts(torch.randn(2, 48, 8)), "quantize_mxfp8_experts: expected K (b.size(1)) to be a multiple of 32, got 48", True),
    (lambda: experts(x64), "quantize_mxfp8_experts: expected b to be a 3-D tensor, got 2-D", True),
    (lambda: experts(torch.ones(2, 32, 4, dtype=torch.int64)), "quantize_mxfp8_experts: expected b of dtype bfloat16, float16 or float32, got Long", True),
    (lambda: experts(torch.randn(2, 32, 4), "up"), 'quantize_mxfp8_experts: expected rounding "rceil" or "floor", got "up"', True),
]


@pytest.mark.parametrize("call, message, _fake", ERROR_CASES, ids=[str(i) for i in range(len(ERROR_CASES))])
def test_bad_inputs(call, message, _fake):
    with pytest.raises(RuntimeError) as e:
        call()
    assert message in str(e.value)


@pytest.mark.parametrize("call, message", [(c, m) for c, m, fake in ERROR_CASES if fake],
                         ids=[str(i) for i, c in enumerate(ERROR_CASES) if c[2]])
def test_bad_inputs_fake(call, message):
    assert_fake_refuses(call, message)


def assert_fake_refuses(call, message):
    """The fakes (what torch.compile traces) refuse the same inputs with the same words."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError) as e:
            call()
    assert message.split(", got")[0] in str(e.value)


FAKE_CASES = [  # edge shapes opcheck does not reach: the fake's shapes and strides
    lambda: rowwise(torch.randn(0, 64), "rceil", True),
    lambda: rowwise(torch.randn(7, 96), "floor", True, torch.zeros(0, dtype=torch.int32)),
    lambda: rowwise(torch.randn(130, 32).t().contiguous().t(), "rceil", True, offs_from_sizes([0, 130, 0])),
    lambda: colwise(torch.randn(0, 5)),
    lambda: colwise(torch.randn(64, 0), "rceil", True),
    lambda: colwise(torch.randn(96, 7), "rceil", True, offs_from_sizes([32, 0, 64])),
    lambda: colwise(torch.randn(0, 3), "rceil", True, torch.zeros(0, dtype=torch.int32),
                    torch.zeros(0, dtype=torch.int32), 128),
    lambda: colwise(torch.randn(5, 3), "floor", True, offs_from_sizes([5]), torch.zeros(1, dtype=torch.int32), 256),
    lambda: experts(torch.randn(0, 32, 8), "rceil", True),
    lambda: experts(torch.randn(2, 0, 8), "rceil", True),
    lambda: experts(torch.randn(2, 64, 0), "floor", False),
    lambda: experts(torch.randn(3, 7, 64).transpose(1, 2), "rceil", True),
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


# ---- opcheck and torch.compile ------------------------------------------------------------

def _x(d, m=96, k=64):
    return randn((m, k), torch.bfloat16, d)


def _w(d):
    return randn((3, 64, 40), torch.bfloat16, d)


def _offs(d):
    return torch.tensor([32, 32, 64, 96], dtype=torch.int32, device=d)


def _any_offs(d):
    return torch.tensor([5, 5, 40, 90], dtype=torch.int32, device=d)


def _starts(d, a=64):
    return moe_fp8_ext.padded_group_offsets(_any_offs("cpu"), 96, a)[0].to(d)


# (op name in torch.ops.moe_fp8, device -> args): schema, fake tensor and AOT dispatch
# of every op of the family. test_op_coverage.py reads the names.
OPCHECK_CASES = [
    ("quantize_mxfp8_rowwise", lambda d: (_x(d), "rceil", False, None)),
    ("quantize_mxfp8_rowwise", lambda d: (_x(d).t(), "floor", True, None)),
    ("quantize_mxfp8_rowwise", lambda d: (_x(d), "rceil", True, _any_offs(d))),
    ("quantize_mxfp8_colwise", lambda d: (_x(d), "rceil", False, None, None, None)),
    ("quantize_mxfp8_colwise", lambda d: (_x(d, 96, 200).t().contiguous().t(), "floor", True, None, None, None)),
    ("quantize_mxfp8_colwise", lambda d: (_x(d), "rceil", True, _offs(d), None, None)),
    ("quantize_mxfp8_colwise", lambda d: (_x(d), "rceil", False, _any_offs(d), _starts(d), 64)),
    ("quantize_mxfp8_colwise", lambda d: (_x(d), "floor", True, _any_offs(d), _starts(d, 256), 256)),
    ("quantize_mxfp8_experts", lambda d: (_w(d), "rceil", False)),
    ("quantize_mxfp8_experts", lambda d: (_w(d).transpose(1, 2).contiguous().transpose(1, 2), "floor", True)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, args", OPCHECK_CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(OPCHECK_CASES)])
def test_opcheck(device, op, args):
    torch.library.opcheck(getattr(torch.ops.moe_fp8, op).default, args(device))


def _mx_step(a, w, offs, starts):
    qa, sa = moe_fp8_ext.quantize_mxfp8_rowwise(a, "rceil", True, offs)
    qw, sw = moe_fp8_ext.quantize_mxfp8_experts(w, "floor", True)
    qc, sc = moe_fp8_ext.quantize_mxfp8_colwise(a, "rceil", False, offs, starts, 64)
    qg, sg = moe_fp8_ext.quantize_mxfp8_colwise(a * 2, "floor", True)
    return qa, sa, qw, sw, qc, sc, qg, sg


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    def step(a, w, offs, starts):
        outs = _mx_step(a, w, offs, starts)
        # Some surrounding math so that the ops sit inside a real graph (inductor cannot
        # bitcast e8m0 to uint8: the raw outputs are compared outside).
        total = sum(o.float().nansum() for o in outs)
        return (*outs, total)

    a = _x(device)
    w = _w(device)
    offs, starts = _any_offs(device), _starts(device)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got, want = compiled(a, w, offs, starts), step(a, w, offs, starts)
    for g, e in zip(got[:-1], want[:-1]):
        assert g.dtype == e.dtype and g.shape == e.shape and g.stride() == e.stride()
        assert torch.equal(g.view(torch.uint8), e.view(torch.uint8))
    torch.testing.assert_close(got[-1], want[-1], rtol=0, atol=0, equal_nan=True)


# ---- GPU only: the CPU op's bits on large shapes; CUDA graphs -------------------------------

@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("blocked", [False, True])
def test_large_same_as_cpu(rounding, blocked):
    x = mx_data((8192, 7168), torch.bfloat16, "cuda")
    same_as_cpu(lambda t: moe_fp8_ext.quantize_mxfp8_rowwise(t, rounding, blocked), x)
    same_as_cpu(lambda t: moe_fp8_ext.quantize_mxfp8_rowwise(t, rounding, blocked), x.t())
    same_as_cpu(lambda t: moe_fp8_ext.quantize_mxfp8_colwise(t, rounding, blocked), x)
    same_as_cpu(lambda t: moe_fp8_ext.quantize_mxfp8_colwise(t, rounding, blocked), x[:, :2050])
    offs = random_offs(8192, 64, generator=torch.Generator().manual_seed(1))
    offs32 = random_offs(8192, 64, alignment=32, generator=torch.Generator().manual_seed(2))
    if blocked:
        same_as_cpu(lambda t, o: moe_fp8_ext.quantize_mxfp8_rowwise(t, rounding, True, o), x, offs)
        # up to kRowsLocalGroups (1024) groups the kernel sums the starts into dynamic
        # shared memory (4 bytes a group: 1000 groups take the 7-blocks-an-SM launch)
        local = random_offs(8192, 1000, generator=torch.Generator().manual_seed(5))
        same_as_cpu(lambda t, o: moe_fp8_ext.quantize_mxfp8_rowwise(t, rounding, True, o), x[:, :256], local)
        # above kRowsLocalGroups groups the kernel reads the op's start table
        many = random_offs(8192, 1500, generator=torch.Generator().manual_seed(3))
        same_as_cpu(lambda t, o: moe_fp8_ext.quantize_mxfp8_rowwise(t, rounding, True, o), x[:, :256], many)
        # K groups: each warp sums the widths of the groups before its own, 32 a step
        many32 = random_offs(8192, 200, alignment=32, generator=torch.Generator().manual_seed(4))
        same_as_cpu(lambda t, o: moe_fp8_ext.quantize_mxfp8_colwise(t, rounding, True, o), x[:, :300], many32)
    same_as_cpu(lambda t, o: moe_fp8_ext.quantize_mxfp8_colwise(t, rounding, blocked, o), x, offs32)
    for a in ALIGNMENTS:
        starts, _ = moe_fp8_ext.padded_group_offsets(offs, 8192, a)
        same_as_cpu(lambda t, o, s: moe_fp8_ext.quantize_mxfp8_colwise(t, rounding, blocked, o, s, a), x[:, :1000], offs, starts)
    w = mx_data((8, 2048, 1408), torch.bfloat16, "cuda")
    same_as_cpu(lambda t: moe_fp8_ext.quantize_mxfp8_experts(t, rounding, blocked), w)
    same_as_cpu(lambda t: moe_fp8_ext.quantize_mxfp8_experts(t, rounding, blocked), w.transpose(1, 2).contiguous().transpose(1, 2))
    same_as_cpu(lambda t: moe_fp8_ext.quantize_mxfp8_experts(t, rounding, blocked), w.transpose(1, 2))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_rowwise_m_groups_placement_same_as_cpu(rounding):
    # The M-group kernel walks blocked rows, guesses each block's first unit lies in group 0, and zeroes rows past the
    # padded groups separately. Cases: tiny groups (mostly padding), router-like groups with tail rows (wrong guesses),
    # odd sizes (every parity), one group (guesses right), more groups than the kernel's table (1024: the op's table).
    g = torch.Generator().manual_seed(7)
    cases = [
        (700, 256, offs_from_sizes(torch.randint(0, 4, (300,), generator=g).tolist())),
        (16384, 2048, offs_from_sizes([1392, 2496, 2640, 1376, 2480, 2512, 1568, 1904])),
        (5000, 160, offs_from_sizes(torch.randint(0, 80, (64,), generator=g).tolist())),
        (1000, 64, torch.tensor([1000], dtype=torch.int32)),
        (4096, 96, torch.tensor([4000], dtype=torch.int32)),
        (3000, 32, offs_from_sizes(torch.randint(0, 3, (1100,), generator=g).tolist())),
    ]
    for m, k, offs in cases:
        assert int(offs[-1]) <= m
        x = mx_data((m, k), torch.bfloat16, "cuda")
        same_as_cpu(lambda t, o: moe_fp8_ext.quantize_mxfp8_rowwise(t, rounding, True, o), x, offs)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("walk", ["dynamic", "stride"])
def test_rowwise_blocked_walks_same_as_cpu(walk):
    # The octet-tile kernel takes units from a per-stream work counter (stride walk if rows_dynamic="0"), reset by each
    # launch's last block: back-to-back calls with more and fewer units than the last, and calls on two side streams
    # (overlapping launches, one counter each), each give the CPU op's bits into poisoned memory.
    with _tuning.override(rows_dynamic="0" if walk == "stride" else None):
        q = moe_fp8_ext.quantize_mxfp8_rowwise
        big = mx_data((16384, 2048), torch.bfloat16, "cuda")
        small = mx_data((777, 320), torch.bfloat16, "cuda")
        offs = offs_from_sizes([1392, 2496, 2640, 1376, 2480, 2512, 1568, 1904]).cuda()
        offs_small = offs_from_sizes([0, 300, 5, 200, 0, 250]).cuda()
        calls = [(big, None), (small, None), (big, offs), (small, offs_small), (big, offs), (big, None)]
        want = [ref.quantize_mxfp8_rowwise(x.cpu(), "rceil", True, None if o is None else o.cpu()) for x, o in calls]
        poison("cuda")
        got = [q(x, "rceil", True, o) for x, o in calls]
        for g, w in zip(got, want):
            check(g, w)
        streams = [torch.cuda.Stream() for _ in range(2)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                poison("cuda")  # this stream's free blocks (poison fills the current stream's)
        got = []
        for s, (x, o) in zip(streams * 2, calls[2:]):
            with torch.cuda.stream(s):
                got.append(q(x, "rceil", True, o))
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        for g, w in zip(got, want[2:]):
            check(g, w)


@requires_cuda
@pytest.mark.gpu
def test_rowwise_blocked_graph_counters():
    # Each launch captured into a graph has its own work counter, reset at the end of every replay: three launches of
    # 8192+ units in one graph, replayed three times into poisoned outputs, each replay followed by eager calls into
    # poisoned memory, all against the CPU op.
    q = moe_fp8_ext.quantize_mxfp8_rowwise
    x = mx_data((16384, 2048), torch.bfloat16, "cuda", specials=False)
    offs = offs_from_sizes([1000, 0, 3000, 17, 4000, 8000]).cuda()
    offs_cut = offs_from_sizes([1000, 0, 3000, 17, 4000, 4000]).cuda()
    step = lambda: (*q(x, "rceil", True), *q(x, "rceil", True, offs), *q(x[:12017], "floor", True, offs_cut))
    xc = x.cpu()
    want = [*ref.quantize_mxfp8_rowwise(xc, "rceil", True), *ref.quantize_mxfp8_rowwise(xc, "rceil", True, offs.cpu()),
            *ref.quantize_mxfp8_rowwise(xc[:12017], "floor", True, offs_cut.cpu())]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        for t in out:
            t.view(torch.uint8).fill_(0xFF)
        graph.replay()
        poison("cuda")
        eager = step()
        for g, e, w in zip(out, eager, want):
            assert torch.equal(g.view(torch.uint8).cpu(), w.view(torch.uint8))
            assert torch.equal(e.view(torch.uint8).cpu(), w.view(torch.uint8))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_odd_shapes_same_as_cpu(dtype):
    for m, k in ((1, 32), (7, 96), (300, 32), (4097, 160)):
        x = mx_data((m, k), dtype, "cuda")
        same_as_cpu(lambda t: moe_fp8_ext.quantize_mxfp8_rowwise(t, "rceil", True), x)
        same_as_cpu(lambda t: moe_fp8_ext.quantize_mxfp8_experts(t, "floor", True), x.view(1, m, k).transpose(1, 2).contiguous())
    for m, k in ((32, 1), (96, 7), (4096, 301)):
        same_as_cpu(lambda t: moe_fp8_ext.quantize_mxfp8_colwise(t, "rceil", True), mx_data((m, k), dtype, "cuda"))


@requires_cuda
@pytest.mark.gpu
def test_cuda_graph_replay():
    a = mx_data((4096, 512), torch.bfloat16, "cuda", specials=False)
    w = mx_data((4, 512, 384), torch.bfloat16, "cuda", specials=False)
    offs = random_offs(4096, 16, generator=torch.Generator().manual_seed(5)).cuda()
    starts, _ = moe_fp8_ext.padded_group_offsets(offs, 4096, 64)
    graph_matches_eager(lambda: _mx_step(a, w, offs, starts))


# ---- scale swizzles: to_blocked_scales*, from_blocked_scales* ------------------------------
# Bit-exact against reference.to_blocked* (and torchao's rearranges when importable), round trips, recipes.py's
# pure-torch readers, the quantization ops' own blocked scales, errors, opcheck, compile.

from moe_fp8_ext import recipes  # noqa: E402

SWZ_DTYPES = [E8, torch.uint8, torch.int8, F8]
to_blk = moe_fp8_ext.to_blocked_scales
to_blk_m = moe_fp8_ext.to_blocked_scales_m_groups
to_blk_k = moe_fp8_ext.to_blocked_scales_k_groups
from_blk = moe_fp8_ext.from_blocked_scales
from_blk_m = moe_fp8_ext.from_blocked_scales_m_groups
from_blk_k = moe_fp8_ext.from_blocked_scales_k_groups


def scale_bytes(shape, dtype=E8, device="cpu", seed=0):
    """Random nonzero scale bytes (1..254: padding zeros stand out) of a 1-byte dtype."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 255, shape, dtype=torch.uint8, generator=g).view(dtype).to(device)


def swz_layouts(shape, dtype, device):
    """Contiguous, transposed (column-major) and strided views of the same shape, and the
    first columns of a row-major tensor 4 columns wider (rows padded: 32-bit loads)."""
    yield scale_bytes(shape, dtype, device, 1)
    yield scale_bytes(shape[:-2] + shape[-2:][::-1], dtype, device, 2).transpose(-2, -1)
    wide = shape[:-1] + (2 * shape[-1] + 1,)
    yield scale_bytes(wide, dtype, device, 3)[..., 1::2]
    yield scale_bytes(shape[:-1] + (shape[-1] + 4,), dtype, device, 4)[..., : shape[-1]]


def same_bytes(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert got.is_contiguous()
    a, b = got.view(torch.uint8).cpu(), want.view(torch.uint8).cpu()
    if not torch.equal(a, b):
        i = (a != b).nonzero()[0].tolist()
        raise AssertionError(f"{int((a != b).sum())} of {a.numel()} bytes differ; first at {i}: "
                             f"{int(a[tuple(i)])} vs {int(b[tuple(i)])}")


def random_sizes(n, total_groups, seed, multiple=1, empty_frac=0.3):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(total_groups, generator=g) * (torch.rand(total_groups, generator=g) > empty_frac)
    sizes = (w / max(float(w.sum()), 1e-9) * n / multiple).floor().long() * multiple
    return sizes.tolist()


SWZ_2D = [(0, 0), (0, 5), (5, 0), (1, 1), (7, 3), (128, 4), (130, 5), (300, 9), (256, 8), (33, 1)]
SWZ_3D = [(1, 1, 1), (3, 130, 5), (2, 256, 8), (0, 5, 3), (4, 0, 2), (2, 33, 0), (5, 7, 13)]
M_GROUP_SIZES = [[], [5], [0], [5, 0, 130, 128, 1], [0, 0, 7], [128, 129, 0, 3], [256], [1] * 40]
K_GROUP_SIZES = [[], [32], [0], [64, 0, 160, 32, 96], [0, 256, 0], [128, 128], [32] * 9]
K_GROUP_ANY = [[5], [40, 0, 7, 100], [33, 31, 0, 64, 1], [0, 0, 3]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SWZ_DTYPES)
@pytest.mark.parametrize("shape", SWZ_2D)
def test_to_blocked_scales_2d(device, dtype, shape):
    for s in swz_layouts(shape, dtype, device):
        b = to_blk(s)
        same_bytes(b, ref.to_blocked(s.cpu()))
        same_bytes(from_blk(b, *shape), s.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [E8, torch.uint8])
@pytest.mark.parametrize("shape", SWZ_3D)
def test_to_blocked_scales_3d(device, dtype, shape):
    e, r, c = shape
    per = -(-r // 128) * 128 * (-(-c // 4) * 4)
    for s in list(swz_layouts(shape, dtype, device)) + [scale_bytes((r, e, c), dtype, device, 4).transpose(0, 1)]:
        b = to_blk(s)
        want = torch.stack([ref.to_blocked(s[i].cpu()).flatten() for i in range(e)]) if e else s.new_empty((0, per)).cpu()
        same_bytes(b, want.view(dtype))
        same_bytes(from_blk(b, r, c), s.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols", [1, 7, 8])
@pytest.mark.parametrize("sizes", M_GROUP_SIZES + [random_sizes(5000, 300, seed=7)], ids=lambda s: f"G{len(s)}")
@pytest.mark.parametrize("tail", [0, 37])
def test_to_blocked_scales_m_groups(device, cols, sizes, tail):
    m = sum(sizes) + tail
    offs = offs_from_sizes(sizes, device) if sizes else torch.zeros(0, dtype=torch.int32, device=device)
    for s in swz_layouts((m, cols), E8, device):
        b = to_blk_m(s, offs)
        same_bytes(b, ref.to_blocked_m_groups(s.cpu(), offs.cpu()))
        back = s.cpu().view(torch.uint8).clone()
        back[sum(sizes):] = 0  # rows past the last group belong to no group
        same_bytes(from_blk_m(b, offs, cols), back.view(E8))


def _k_covered(sizes, cols):
    """Block columns some group owns (lo // 32 .. + ceil(n / 32))."""
    cov = torch.zeros(cols, dtype=torch.bool)
    lo = 0
    for n in sizes:
        cov[lo // 32 : lo // 32 + -(-n // 32)] = True
        lo += n
    return cov


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 100, 128, 130, 300])
@pytest.mark.parametrize("sizes", K_GROUP_SIZES + K_GROUP_ANY + [random_sizes(9600, 300, seed=8, multiple=32)],
                         ids=lambda s: f"G{len(s)}-{sum(s)}")
@pytest.mark.parametrize("extra_cols", [0, 3, "to4"])
def test_to_blocked_scales_k_groups(device, rows, sizes, extra_cols):
    # "to4": cols a multiple of 4, so groups starting at any column take the 32-bit loads
    cols = -(-sum(sizes) // 32)
    cols += -cols % 4 if extra_cols == "to4" else extra_cols
    offs = offs_from_sizes(sizes, device) if sizes else torch.zeros(0, dtype=torch.int32, device=device)
    for s in swz_layouts((rows, cols), E8, device):
        b = to_blk_k(s, offs)
        same_bytes(b, ref.to_blocked_k_groups(s.cpu(), offs.cpu()))
        back = s.cpu().view(torch.uint8).clone()
        back[:, ~_k_covered(sizes, cols)] = 0
        same_bytes(from_blk_k(b, offs, rows, cols), back.view(E8))


def test_swizzles_many_groups_global_tables():
    # Above 2048 groups the GPU builds its group tables in a scratch buffer: the same bytes.
    sizes = random_sizes(20000, 5000, seed=9)
    offs = offs_from_sizes(sizes)
    s = scale_bytes((sum(sizes) + 3, 4))
    b = to_blk_m(s, offs)
    same_bytes(b, ref.to_blocked_m_groups(s, offs))
    same_bytes(from_blk_m(b, offs, 4)[: sum(sizes)], s[: sum(sizes)])
    ksizes = random_sizes(32 * 6000, 5000, seed=10, multiple=32)
    koffs = offs_from_sizes(ksizes)
    sk = scale_bytes((130, 6000))
    bk = to_blk_k(sk, koffs)
    same_bytes(bk, ref.to_blocked_k_groups(sk, koffs))
    back = sk.view(torch.uint8).clone()
    back[:, ~_k_covered(ksizes, 6000)] = 0
    same_bytes(from_blk_k(bk, koffs, 130, 6000), back.view(E8))


def test_swizzle_padding_is_zero_and_matches_the_index():
    # Independent of the reference: every byte by the DESIGN §7 index, the rest zero.
    r, c = 200, 6
    s = scale_bytes((r, c), torch.uint8)
    b = to_blk(s).flatten()
    rp, cp = 256, 8
    want = torch.zeros(rp * cp, dtype=torch.uint8)
    for i in range(r):
        for j in range(c):
            want[((i // 128) * (cp // 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4] = s[i, j]
    assert torch.equal(b, want)


@pytest.mark.parametrize("device", DEVICES)
def test_swizzle_inverses_match_recipes_readers(device):
    # recipes.unblock_scales* are the pure-torch readers the emulated GEMMs use.
    s = scale_bytes((300, 9), torch.uint8, device)
    b = to_blk(s)
    assert torch.equal(from_blk(b, 300, 9).float(), recipes.unblock_scales(b, 300, 9)[:300, :9])
    e = scale_bytes((3, 130, 5), torch.uint8, device)
    be = to_blk(e)
    assert torch.equal(from_blk(be, 130, 5).float(), recipes.unblock_scales_experts(be, 130, 5))
    sizes = [5, 0, 130, 128, 1]
    offs = offs_from_sizes(sizes, device)
    sm = scale_bytes((sum(sizes), 7), torch.uint8, device)
    bm = to_blk_m(sm, offs)
    assert torch.equal(from_blk_m(bm, offs, 7).float(), recipes.unblock_scales_m_groups(bm, offs, sum(sizes), 7))
    ksizes = [64, 0, 160, 32, 96]
    koffs = offs_from_sizes(ksizes, device)
    sk = scale_bytes((130, 11), torch.uint8, device)
    bk = to_blk_k(sk, koffs)
    assert torch.equal(from_blk_k(bk, koffs, 130, 11).float(), recipes.unblock_scales_k_groups(bk, koffs, 130, 11))


@pytest.mark.parametrize("device", DEVICES)
def test_swizzles_match_the_quantizers_blocked_scales(device):
    # The quantization kernels write the same layouts themselves.
    x = mx_data((300, 96), torch.bfloat16, device, specials=False)
    offs = offs_from_sizes([5, 0, 130, 128, 1], device)
    _, plain = moe_fp8_ext.quantize_mxfp8_rowwise(x)
    same_bytes(to_blk(plain), moe_fp8_ext.quantize_mxfp8_rowwise(x, "rceil", True)[1])
    same_bytes(to_blk_m(plain, offs), moe_fp8_ext.quantize_mxfp8_rowwise(x, "rceil", True, offs)[1])
    xc = mx_data((320, 130), torch.bfloat16, device, specials=False)
    koffs = offs_from_sizes([64, 0, 160, 32, 64], device)
    _, pc = moe_fp8_ext.quantize_mxfp8_colwise(xc, "rceil", False, koffs)
    same_bytes(to_blk_k(pc, koffs), moe_fp8_ext.quantize_mxfp8_colwise(xc, "rceil", True, koffs)[1])
    w = mx_data((3, 64, 130), torch.bfloat16, device, specials=False)
    _, pw = moe_fp8_ext.quantize_mxfp8_experts(w)
    same_bytes(to_blk(pw), moe_fp8_ext.quantize_mxfp8_experts(w, "rceil", True)[1])


def test_swizzles_match_torchao():
    _, to_blocked, _ = _torchao()
    try:
        from torchao.prototype.moe_training.kernels.mxfp8.quant import (
            torch_to_blocked_2d_K_groups,
            torch_to_blocked_2d_M_groups,
            torch_to_blocked_per_group_3d,
        )
    except ImportError as e:
        pytest.skip(f"torchao moe_training: {e}")

    def same_prefix(ours, theirs):
        a, b = ours.view(torch.uint8).flatten(), theirs.view(torch.uint8).flatten()
        n = min(a.numel(), b.numel())
        assert torch.equal(a[:n], b[:n])
        assert not a[n:].any() and not b[n:].any()

    for shape in SWZ_2D[3:]:
        s = scale_bytes(shape)
        assert torch.equal(to_blk(s).view(torch.uint8).flatten(), to_blocked(s).view(torch.uint8).flatten())
    for sizes in ([5, 0, 130, 128, 1], [300], [0, 0, 7], [128, 129, 0, 3], random_sizes(3000, 64, seed=11)):
        offs = offs_from_sizes(sizes)
        s = scale_bytes((sum(sizes), 8), torch.uint8)
        same_prefix(to_blk_m(s, offs), torch_to_blocked_2d_M_groups(s, offs)[0])
    for rows in (1, 100, 128, 130, 300):
        for sizes in ([64, 0, 160, 32, 96], [32], [0, 256, 0], [128, 128]):
            offs = offs_from_sizes(sizes)
            s = scale_bytes((rows, sum(sizes) // 32), torch.uint8)
            same_prefix(to_blk_k(s, offs), torch_to_blocked_2d_K_groups(s, offs // 32)[0])
    for e, n, c in ((1, 1, 1), (3, 130, 5), (2, 256, 8)):
        s = scale_bytes((e, n, c), torch.uint8)
        assert torch.equal(to_blk(s), torch_to_blocked_per_group_3d(s))


_s8 = scale_bytes((8, 4))
_o2 = offs_from_sizes([3, 5])
SWZ_ERROR_CASES = [
    (lambda: to_blk(torch.zeros(4)), "to_blocked_scales: expected s to be a 2-D or 3-D tensor, got 1-D", True),
    (lambda: to_blk(torch.zeros(4, 4)), "to_blocked_scales: expected s of a 1-byte dtype (float8_e8m0fnu, uint8, int8 or another float8), got Float", True),
    (lambda: to_blk(torch.zeros(4, 4, dtype=torch.bool)), "to_blocked_scales: expected s of a 1-byte dtype", True),
    (lambda: to_blk_m(_s8.view(1, 8, 4), _o2), "to_blocked_scales_m_groups: expected s to be a 2-D tensor, got 3-D", True),
    (lambda: to_blk_m(_s8.view(torch.uint8).to(torch.int16), _o2), "to_blocked_scales_m_groups: expected s of a 1-byte dtype", True),
    (lambda: to_blk_m(_s8, _o2.long()), "to_blocked_scales_m_groups: expected offs of dtype int32, got Long", True),
    (lambda: to_blk_m(_s8, _o2.view(1, 2)), "to_blocked_scales_m_groups: expected offs to be a 1-D tensor, got 2-D", True),
    (lambda: to_blk_m(_s8, _o2.to("meta")), "to_blocked_scales_m_groups: expected offs on cpu (the device of s), got meta", True),
    (lambda: to_blk_m(_s8, torch.tensor([5, 3], dtype=torch.int32)), "to_blocked_scales_m_groups: expected non-decreasing offs", False),
    (lambda: to_blk_m(_s8, torch.tensor([3, 9], dtype=torch.int32)), "to_blocked_scales_m_groups: expected offs[1] in [0, 8], got 9", False),
    (lambda: to_blk_k(_s8, torch.tensor([129], dtype=torch.int32)), "to_blocked_scales_k_groups: expected offs[0] in [0, 128], got 129", False),
    (lambda: to_blk_k(_s8, torch.tensor([64, 32], dtype=torch.int32)), "to_blocked_scales_k_groups: expected non-decreasing offs", False),
    (lambda: to_blk_k(torch.zeros(4, 4, dtype=torch.float16), _o2), "to_blocked_scales_k_groups: expected s of a 1-byte dtype", True),
    (lambda: from_blk(torch.zeros(128, 4, dtype=torch.uint8), 128, 5), "from_blocked_scales: expected b of shape (128, 8) (one blocked matrix) or (E, 1024) (E blocked matrices) for rows=128 and cols=5, got [128, 4]", True),
    (lambda: from_blk(torch.zeros(128, 4, dtype=torch.uint8), -1, 4), "from_blocked_scales: expected rows in [0, 1099511627776], got -1", True),
    # the op itself (the wrapper's Python ints cannot overflow): 2^40 x 2^24 scales per matrix
    (lambda: torch.ops.moe_fp8.from_blocked_scales(torch.zeros(1, 5, dtype=torch.uint8), 2**40, 2**24), "from_blocked_scales: expected one blocked matrix (ceil128(rows) * ceil4(cols)) to fit in int64, got 1099511627776 * 16777216 (overflows)", False),
    (lambda: from_blk(torch.zeros(512, dtype=torch.uint8), 1, 1), "from_blocked_scales: expected b to be a 2-D tensor, got 1-D", True),
    (lambda: from_blk(torch.zeros(128, 4), 1, 1), "from_blocked_scales: expected b of a 1-byte dtype", True),
    (lambda: from_blk_m(torch.zeros(200, 4, dtype=torch.uint8), _o2, 4), "from_blocked_scales_m_groups: expected b of shape (M + 128 * 2, 4) (M tokens in 2 groups, cols=4), got [200, 4]", True),
    (lambda: from_blk_m(torch.zeros(264, 8, dtype=torch.uint8), _o2, 4), "from_blocked_scales_m_groups: expected b of shape (M + 128 * 2, 4)", True),
    (lambda: from_blk_m(torch.zeros(264, 4, dtype=torch.uint8), _o2.long(), 4), "from_blocked_scales_m_groups: expected offs of dtype int32, got Long", True),
    (lambda: from_blk_m(torch.zeros(264, 4, dtype=torch.uint8), torch.tensor([3, 9], dtype=torch.int32), 4), "from_blocked_scales_m_groups: expected offs[1] in [0, 8], got 9", False),
    (lambda: from_blk_k(torch.zeros(128, 12, dtype=torch.uint8), _o2, 1, 5), "from_blocked_scales_k_groups: expected b of shape (128, 16) (rows=1, cols=5, 2 groups), got [128, 12]", True),
    (lambda: from_blk_k(torch.zeros(128, 16, dtype=torch.uint8), _o2, 1, -5), "from_blocked_scales_k_groups: expected cols in [0, 1099511627776], got -5", True),
    (lambda: from_blk_k(torch.zeros(128, 16, dtype=torch.uint8), torch.tensor([3, 200], dtype=torch.int32), 1, 5), "from_blocked_scales_k_groups: expected offs[1] in [0, 160], got 200", False),
]


@pytest.mark.parametrize("call, message, _fake", SWZ_ERROR_CASES, ids=[str(i) for i in range(len(SWZ_ERROR_CASES))])
def test_swizzle_bad_inputs(call, message, _fake):
    with pytest.raises(RuntimeError) as e:
        call()
    assert message in str(e.value)


@pytest.mark.parametrize("call, message", [(c, m) for c, m, fake in SWZ_ERROR_CASES if fake],
                         ids=[str(i) for i, c in enumerate(SWZ_ERROR_CASES) if c[2]])
def test_swizzle_bad_inputs_fake(call, message):
    assert_fake_refuses(call, message)


@pytest.mark.parametrize("name", ["to_blocked_scales", "to_blocked_scales_m_groups", "to_blocked_scales_k_groups",
                                  "from_blocked_scales", "from_blocked_scales_m_groups", "from_blocked_scales_k_groups"])
def test_swizzle_raw_op_checks(name):
    # The registered op itself (not only the wrapper) refuses a wide dtype.
    op = getattr(torch.ops.moe_fp8, name)
    args = {"to_blocked_scales": (torch.zeros(4, 4),), "to_blocked_scales_m_groups": (torch.zeros(8, 4), _o2),
            "to_blocked_scales_k_groups": (torch.zeros(8, 4), _o2), "from_blocked_scales": (torch.zeros(128, 4), 1, 1),
            "from_blocked_scales_m_groups": (torch.zeros(264, 4), _o2, 4),
            "from_blocked_scales_k_groups": (torch.zeros(128, 12), _o2, 1, 4)}[name]
    with pytest.raises(RuntimeError, match=f"{name}: expected (s|b) of a 1-byte dtype"):
        op(*args)


SWZ_FAKE_CASES = [
    lambda: to_blk(scale_bytes((0, 0))),
    lambda: to_blk(scale_bytes((130, 5)).t()),
    lambda: to_blk(scale_bytes((0, 5, 3))),
    lambda: to_blk_m(scale_bytes((0, 3)), torch.zeros(0, dtype=torch.int32)),
    lambda: to_blk_m(scale_bytes((7, 3)), offs_from_sizes([0, 7, 0])),
    lambda: to_blk_k(scale_bytes((130, 0)), torch.zeros(2, dtype=torch.int32)),
    lambda: to_blk_k(scale_bytes((5, 9)), offs_from_sizes([64, 0, 200])),
    lambda: from_blk(to_blk(scale_bytes((0, 0))), 0, 0),
    lambda: from_blk(to_blk(scale_bytes((3, 7, 5))), 7, 5),
    lambda: from_blk_m(to_blk_m(scale_bytes((7, 3)), offs_from_sizes([0, 7, 0])), offs_from_sizes([0, 7, 0]), 3),
    lambda: from_blk_k(to_blk_k(scale_bytes((5, 9)), offs_from_sizes([64, 0, 200])), offs_from_sizes([64, 0, 200]), 5, 9),
]


@pytest.mark.parametrize("call", SWZ_FAKE_CASES, ids=[str(i) for i in range(len(SWZ_FAKE_CASES))])
def test_swizzle_fake_matches_op(call):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = call()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = call()
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)
    assert fake.stride() == real.stride() or real.numel() == 0


def _sw(d, shape=(130, 9)):
    return scale_bytes(shape, torch.uint8, d, 5)  # opcheck compares with float math e8m0 lacks


SWZ_OPCHECK_CASES = [
    ("to_blocked_scales", lambda d: (_sw(d),)),
    ("to_blocked_scales", lambda d: (_sw(d, (9, 130)).t(),)),
    ("to_blocked_scales", lambda d: (scale_bytes((3, 33, 5), torch.uint8, d),)),
    ("to_blocked_scales_m_groups", lambda d: (_sw(d), offs_from_sizes([5, 0, 100, 20], d))),
    ("to_blocked_scales_k_groups", lambda d: (_sw(d), offs_from_sizes([64, 0, 160, 64], d))),
    ("to_blocked_scales_k_groups", lambda d: (_sw(d), offs_from_sizes([40, 7, 0, 100], d))),
    ("from_blocked_scales", lambda d: (to_blk(_sw(d)), 130, 9)),
    ("from_blocked_scales", lambda d: (to_blk(scale_bytes((3, 33, 5), torch.uint8, d)), 33, 5)),
    ("from_blocked_scales_m_groups", lambda d: (to_blk_m(_sw(d), offs_from_sizes([5, 0, 100, 20], d)),
                                                offs_from_sizes([5, 0, 100, 20], d), 9)),
    ("from_blocked_scales_k_groups", lambda d: (to_blk_k(_sw(d), offs_from_sizes([64, 0, 160, 64], d)),
                                                offs_from_sizes([64, 0, 160, 64], d), 130, 9)),
]
# test_op_coverage.py reads the whole list (a new list: test_opcheck keeps its own parameters)
OPCHECK_CASES = OPCHECK_CASES + SWZ_OPCHECK_CASES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, args", SWZ_OPCHECK_CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(SWZ_OPCHECK_CASES)])
def test_swizzle_opcheck(device, op, args):
    torch.library.opcheck(getattr(torch.ops.moe_fp8, op).default, args(device))


@pytest.mark.parametrize("device", DEVICES)
def test_swizzle_compile_fullgraph(device):
    def step(s, s3, sk, offs, koffs):
        b, b3 = to_blk(s), to_blk(s3)
        bm, bk = to_blk_m(s, offs), to_blk_k(sk, koffs)
        back = (from_blk(b, s.shape[0], s.shape[1]), from_blk(b3, s3.shape[1], s3.shape[2]),
                from_blk_m(bm, offs, s.shape[1]), from_blk_k(bk, koffs, sk.shape[0], sk.shape[1]))
        return (b, b3, bm, bk) + back

    s = scale_bytes((300, 9), torch.uint8, device)
    s3 = scale_bytes((3, 130, 5), torch.uint8, device)
    sk = scale_bytes((130, 12), torch.uint8, device)
    offs = offs_from_sizes([5, 0, 130, 128, 1], device)
    koffs = offs_from_sizes([64, 0, 160, 32, 96], device)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got, want = compiled(s, s3, sk, offs, koffs), step(s, s3, sk, offs, koffs)
    for g, e in zip(got, want):
        assert g.dtype == e.dtype and g.shape == e.shape and g.stride() == e.stride()
        assert torch.equal(g, e)


# GPU only: the CPU op's bytes (poisoned outputs), bad offs stay in bounds, CUDA graphs.

@requires_cuda
@pytest.mark.gpu
def test_swizzles_same_as_cpu():
    for shape in ((8192, 224), (4097, 7), (1, 1), (300, 64)):
        for s in swz_layouts(shape, E8, "cuda"):
            same_as_cpu(lambda t: (to_blk(t),), s)
            same_as_cpu(lambda t: (from_blk(t, *shape),), to_blk(s))
    s3 = scale_bytes((64, 2048, 44), E8, "cuda")
    same_as_cpu(lambda t: (to_blk(t),), s3)
    same_as_cpu(lambda t: (to_blk(t),), s3.transpose(1, 2).contiguous().transpose(1, 2))
    # 2048 and 2049 groups: the last with its tables in shared memory, the first in a
    # global scratch buffer (kSwizzleSmemGroups)
    for g in (1, 8, 300, 2048, 2049, 5000):
        offs = random_offs(8192, g, generator=torch.Generator().manual_seed(g))
        s = scale_bytes((8192, 224), E8, "cuda")
        same_as_cpu(lambda t, o: (to_blk_m(t, o),), s, offs)
        same_as_cpu(lambda t, o: (from_blk_m(t, o, 224),), to_blk_m(s, offs.cuda()), offs)
        koffs = random_offs(8192, g, alignment=32, generator=torch.Generator().manual_seed(g + 1))
        anyoffs = random_offs(8192, g, generator=torch.Generator().manual_seed(g + 2))
        sk = scale_bytes((2050, 256), E8, "cuda")
        for o in (koffs, anyoffs):
            same_as_cpu(lambda t, oo: (to_blk_k(t, oo),), sk, o)
            same_as_cpu(lambda t, oo: (from_blk_k(t, oo, 2050, 256),), to_blk_k(sk, o.cuda()), o)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("groups", [3, 5000])
def test_swizzles_bad_offs_stay_in_bounds(groups):
    # Unchecked on a GPU: clamped, whatever offs holds (compute-sanitizer runs this too).
    g = torch.Generator().manual_seed(groups)
    offs = torch.randint(-50, 20000, (groups,), generator=g, dtype=torch.int32).cuda()
    s = scale_bytes((1000, 9), E8, "cuda")
    outs = [to_blk_m(s, offs), to_blk_k(s, offs)]
    outs += [from_blk_m(outs[0], offs, 9), from_blk_k(outs[1], offs, 1000, 9)]
    torch.cuda.synchronize()
    assert [o.shape for o in outs] == [(1000 + 128 * groups, 12), (1024, 12 + 4 * groups), (1000, 9), (1000, 9)]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape, offs", [((256, 64), [2048, 0, 2048, 0]), ((1000, 9), [288, 0, 288, 0, 288])])
def test_swizzles_bad_offs_write_every_byte(shape, offs):
    # Decreasing offs make groups overlap, and the padded K groups could then reach past
    # the buffer's static bound: every byte must still be written (no 0xFF of the
    # poison left; the scales are 1..254, padding 0).
    s = scale_bytes(shape, E8, "cuda")
    o = torch.tensor(offs, dtype=torch.int32, device="cuda")
    for fn in (to_blk_m, to_blk_k):
        poison("cuda")
        b = fn(s, o)
        torch.cuda.synchronize()
        assert not (b.view(torch.uint8) == 0xFF).any(), fn.__name__


@requires_cuda
@pytest.mark.gpu
def test_swizzles_cuda_graph_replay():
    s = scale_bytes((4096, 224), E8, "cuda")
    s3 = scale_bytes((8, 1408, 64), E8, "cuda")
    offs = random_offs(4096, 16, generator=torch.Generator().manual_seed(5)).cuda()
    koffs = random_offs(4096 * 32 // 32, 16, alignment=32, generator=torch.Generator().manual_seed(6)).cuda()
    sk = scale_bytes((1408, 128), E8, "cuda")
    graph_matches_eager(lambda: (to_blk(s), to_blk(s3), to_blk_m(s, offs), to_blk_k(sk, koffs),
                                 from_blk_m(to_blk_m(s, offs), offs, 224)))
