"""Every FP8 rowwise op against moe_fp8_ext.reference, bit for bit, on CPU and (when
present) GPU: input dtypes, both e4m3 encodings, pow2 and exact scales, odd and
edge shapes, non-contiguous inputs, empty and many token groups."""

import pytest
import torch

import moe_fp8_ext
from moe_fp8_ext import reference as ref
from conftest import DEVICES, FP8_DTYPES, IN_DTYPES, assert_fp8_equal, assert_scale_equal, poison, randn


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


# ---- jagged column-wise ---------------------------------------------------------------

def random_offs(m, g, empty_frac=0.25, tail=0, gen=None):
    """Sorted cumulative ends of g groups over m - tail rows, about empty_frac of them empty."""
    cuts = torch.sort(torch.randint(0, m - tail + 1, (g,), generator=gen)).values
    if g > 1:
        empty = torch.rand(g, generator=gen) < empty_frac
        cuts[1:][empty[1:]] = cuts[:-1][empty[1:]]
        cuts = torch.cummax(cuts, 0).values
    if g > 0 and tail == 0:
        cuts[-1] = m
    return cuts.to(torch.int32)


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
    offs = random_offs(m, g, tail=tail)
    for x in layouts_2d(m, d, in_dtype, device):
        poison(device)
        out = moe_fp8_ext.quantize_jagged_colwise(x, offs.to(device), fp8_dtype, pow2)
        check(out, ref.quantize_jagged_colwise(x.cpu(), offs, fp8_dtype, pow2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("case", [(300, 72, 24, 8), (1000, 40, 1, 300), (64, 0, 16, 2), (96, 16, 0, 4)])
def test_quantize_jagged_colwise_dual(device, fp8_dtype, case):
    m, d1, d2, g = case
    offs = random_offs(m, g)
    x1 = randn((m, d1), torch.bfloat16, device)
    x2 = randn((d2, m), torch.bfloat16, device).t()
    poison(device)
    out = moe_fp8_ext.quantize_jagged_colwise_dual(x1, x2, offs.to(device), fp8_dtype)
    check(out, ref.quantize_jagged_colwise_dual(x1.cpu(), x2.cpu(), offs, fp8_dtype))


def test_default_fp8_dtype_is_used():
    x = randn((4, 32), torch.bfloat16)
    q, _ = moe_fp8_ext.quantize_rowwise(x)
    assert q.dtype == moe_fp8_ext.default_fp8_dtype()
