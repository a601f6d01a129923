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
