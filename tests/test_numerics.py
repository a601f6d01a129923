"""The fp8 encoders of core/numerics.h against PyTorch's casts, on every rounding
boundary. Each row carries an anchor element equal to the fp8 max, so that its
pow2 encode scale is exactly 1 and q is the plain encoding of the other values."""

import pytest
import torch

import moe_fp8_ext
from conftest import DEVICES, FP8_DTYPES, assert_fp8_equal, poison


def boundary_values(fp8_dtype):
    """Every finite code's value, the midpoints between neighbours (ties), one ulp
    either side of each midpoint, subnormals and the smallest subnormal's half, with
    both signs, plus +-0 and +-max."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
    vals = torch.unique(codes[torch.isfinite(codes)].abs())
    mids = (vals[1:] + vals[:-1]) / 2  # exact in fp32
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    tiny = vals[1] * torch.tensor([0.25, 0.5, 0.75, 1.0, 1.5])
    pos = torch.cat([vals, mids, up, down, tiny, torch.tensor([0.0])])
    return torch.cat([pos, -pos])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES + [torch.float8_e5m2])
def test_encoder_matches_torch_cast_on_boundaries(device, fp8_dtype):
    m = torch.finfo(fp8_dtype).max
    v = boundary_values(fp8_dtype)
    k = 63  # values per row, plus the anchor
    pad = (-v.numel()) % k
    v = torch.cat([v, torch.zeros(pad)]).view(-1, k)
    x = torch.cat([v, torch.full((v.shape[0], 1), m)], dim=1).to(device)
    poison(device)
    q, scale = moe_fp8_ext.quantize_rowwise(x, fp8_dtype)
    assert torch.all(scale.cpu() == 1.0)
    assert_fp8_equal(q, x.cpu().to(fp8_dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_encoder_matches_torch_cast_on_random_floats(device, fp8_dtype):
    m = torch.finfo(fp8_dtype).max
    # Log-uniform magnitudes over the whole fp8 range and below it, random signs.
    mag = torch.exp2(torch.empty(4096, 255).uniform_(-14, 9)).clamp(max=m)
    x = mag * torch.sign(torch.randn_like(mag))
    x = torch.cat([x, torch.full((4096, 1), m)], dim=1).to(device)
    q, _ = moe_fp8_ext.quantize_rowwise(x, fp8_dtype)
    assert_fp8_equal(q, x.cpu().to(fp8_dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_nan_and_inf_rows(device, fp8_dtype):
    x = torch.randn(4, 40)
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    x[3] = 0.0
    q, scale = moe_fp8_ext.quantize_rowwise(x.to(device), fp8_dtype)
    q, scale = q.cpu(), scale.cpu()
    assert torch.isnan(scale[1]).all() and torch.isnan(q[1].float()).all()  # NaN poisons its row
    assert torch.isinf(scale[2]).all() and torch.isnan(q[2, 3].float())      # inf: s = 0, inf*0 = NaN
    assert (q[2].float()[torch.arange(40) != 3] == 0).all()
    assert (q[3].float() == 0).all() and torch.isfinite(scale[3]).all()       # zero row: amax clamps to 1e-12
    assert torch.isfinite(q[0].float()).all()


# Input NaNs of both signs, quiet and signalling, with payloads (fp32 bits); in bf16
# and fp16 the same sign and top mantissa bits.
NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0xFFFFFFFF, 0x7FA5A5A5]


def _nan_inputs(in_dtype):
    """NAN_BITS in in_dtype: the sign and the top mantissa bits (at least one set)."""
    bits = torch.tensor(NAN_BITS, dtype=torch.int64)
    if in_dtype == torch.float32:
        return bits.to(torch.int32).view(torch.float32)
    sign = (bits >> 16) & 0x8000
    if in_dtype == torch.bfloat16:
        h = sign | 0x7F80 | ((bits >> 16) & 0x7F).clamp(min=1)
    else:
        h = sign | 0x7C00 | ((bits >> 13) & 0x3FF).clamp(min=1)
    return h.to(torch.int16).view(in_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES + [torch.float8_e5m2])
def test_every_nan_is_torchs_cast_of_positive_nan(device, in_dtype, fp8_dtype):
    # DESIGN §4: a NaN of any sign or payload, and every element of its row (x * NaN),
    # is written as torch's cast of +NaN; the row's decode scale is 0x7FFFFFFF. A row
    # with an Inf: s = 0, so the Inf is NaN (Inf * 0) and the finite values +-0.
    nans = _nan_inputs(in_dtype)
    assert torch.isnan(nans.float()).all()
    x = torch.randn(2 * len(nans) + 1, 40).to(in_dtype)
    for i, v in enumerate(nans):
        x[2 * i, 3 * i] = v
        x[2 * i + 1, 39 - 3 * i] = v
        x[2 * i + 1, 0] = -x[2 * i + 1, 0].abs()  # a negative finite value in a NaN row
    x[-1, 5] = -float("inf")
    poison(device)
    q, scale = moe_fp8_ext.quantize_rowwise(x.to(device), fp8_dtype)
    q, scale = q.view(torch.uint8).cpu(), scale.view(torch.int32).cpu()
    nan_byte = int(torch.tensor(float("nan")).to(fp8_dtype).view(torch.uint8))
    assert nan_byte == (0x80 if fp8_dtype == torch.float8_e4m3fnuz else 0x7F)
    bad = (q[:-1] != nan_byte).sum()
    assert bad == 0, f"quantize_rowwise: expected every byte of a NaN row {nan_byte:#x}, got {int(bad)} others"
    assert (scale[:-1] == 0x7FFFFFFF).all(), (
        f"quantize_rowwise: expected NaN scales 0x7fffffff, got {scale[:-1].flatten().tolist()}")
    assert int(q[-1, 5]) == nan_byte, f"quantize_rowwise: expected -Inf * 0 as {nan_byte:#x}, got {int(q[-1, 5]):#x}"
    zero = torch.zeros(40, dtype=torch.float32).copysign(x[-1].float()).to(fp8_dtype).view(torch.uint8)
    others = torch.arange(40) != 5
    assert torch.equal(q[-1][others], zero[others]), (
        "quantize_rowwise: expected +-0 for the finite values of an Inf row")
    assert scale[-1].item() == 0x7F800000, f"quantize_rowwise: expected the scale +Inf, got {scale[-1].item():#x}"


# fp32 amax values at the edges of fp32: zero, the smallest subnormal, subnormal maxima,
# the smallest normal, 1e-12f and its neighbours, a max near fp32's limit, its max, Inf.
EDGE_AMAX = [0.0, 1e-45, 1e-39, 5.9e-39, 2.0**-126, 9.9999994e-13, 1e-12, 1.0000001e-12, 1.0, 448.0, 3e38,
             3.4028235e38, float("inf")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES + [torch.float8_e5m2])
@pytest.mark.parametrize("pow2", [True, False])
def test_scales_are_ieee_fp32_at_fp32_edges(device, fp8_dtype, pow2):
    # DESIGN §5: s = fp8_max / max(amax, 1e-12f) and 1 / s in IEEE fp32 with subnormals,
    # computed here by numpy; rows whose max is each edge value (and the same in 1x128
    # blocks). A flush to zero or an approximate division would change these scales.
    import numpy as np

    np_max = np.float32(torch.finfo(fp8_dtype).max)
    rows = []
    for a in EDGE_AMAX:
        r = torch.linspace(-0.9, 0.9, 128, dtype=torch.float64) * a if a != float("inf") else torch.zeros(128)
        r[37] = a
        rows.append(r.float())
    x = torch.stack(rows)
    with np.errstate(divide="ignore", over="ignore"):
        amax = np.abs(x.numpy()).max(axis=1)
        s = np_max / np.maximum(amax, np.float32(1e-12))
        if pow2:
            s = (s.view(np.uint32) & np.uint32(0x7F800000)).view(np.float32)
        want = (np.float32(1) / s).astype(np.float32)
    poison(device)
    _, scale = moe_fp8_ext.quantize_rowwise(x.to(device), fp8_dtype, pow2)
    got = scale.cpu().view(torch.int32).flatten()
    assert torch.equal(got, torch.from_numpy(want.view(np.int32))), (
        f"quantize_rowwise: expected scales {want.view(np.uint32).tolist()}, got {got.tolist()}")
    if not pow2 and fp8_dtype != torch.float8_e5m2:
        _, scale = moe_fp8_ext.quantize_blockwise_act_lhs(x.to(device), fp8_dtype)
        got = scale.cpu().contiguous().view(torch.int32).flatten()
        assert torch.equal(got, torch.from_numpy(want.view(np.int32))), (
            f"quantize_blockwise_act_lhs: expected scales {want.view(np.uint32).tolist()}, got {got.tolist()}")
