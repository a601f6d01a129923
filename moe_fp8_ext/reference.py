"""Pure-torch reference of every op: the spec in code (DESIGN §4, §5).

The kernels match these bit for bit. Two details matter for that: the encode
scale is ``fp8_max / amax`` as a true fp32 division (``scalar / tensor`` in torch
multiplies by a reciprocal, which rounds differently), and the power-of-two
rounding takes the exponent bits of the scale (``exp2(floor(log2(s)))`` in fp32
can round up just below a power of two). The reference syncs with the host; it
is for tests, not for training.
"""

from typing import Tuple

import torch
from torch import Tensor


def fp8_max(fp8_dtype: torch.dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)


def amax(x: Tensor, dim: int) -> Tensor:
    """NaN-propagating max of |x| in fp32 along ``dim`` (kept); 0 for an empty set."""
    x = x.float().abs()
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    return torch.amax(x, dim=dim, keepdim=True)


def scales_from_amax(a: Tensor, fp8_dtype: torch.dtype, pow2_scale: bool) -> Tuple[Tensor, Tensor]:
    """(encode scale s, decode scale 1/s) for each amax."""
    s = torch.full_like(a, fp8_max(fp8_dtype)) / torch.clamp(a, min=1e-12)
    if pow2_scale:
        pow2 = (s.view(torch.int32) & 0x7F800000).view(torch.float32)
        s = torch.where(torch.isnan(s), s, pow2)
    return s, torch.ones_like(s) / s


def encode(x: Tensor, s: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    m = fp8_max(fp8_dtype)
    return torch.clamp(x.float() * s, min=-m, max=m).to(fp8_dtype)


def column_major(q: Tensor) -> Tensor:
    """The same values with the last two dims column-major."""
    return q.transpose(-2, -1).contiguous().transpose(-2, -1)


def quantize_rowwise(x: Tensor, fp8_dtype: torch.dtype, pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    s, dec = scales_from_amax(amax(x, 1), fp8_dtype, pow2_scale)
    return encode(x, s, fp8_dtype).contiguous(), dec


def quantize_experts_fwd(b_t: Tensor, fp8_dtype: torch.dtype, pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    s, dec = scales_from_amax(amax(b_t, 1), fp8_dtype, pow2_scale)  # (E, 1, N)
    return column_major(encode(b_t, s, fp8_dtype)), dec


def quantize_experts_bwd(b_t: Tensor, fp8_dtype: torch.dtype, pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    w = b_t.transpose(-2, -1)  # (E, N, K)
    s, dec = scales_from_amax(amax(w, 1), fp8_dtype, pow2_scale)  # (E, 1, K)
    return column_major(encode(w, s, fp8_dtype)), dec


def quantize_jagged_colwise(x: Tensor, offs: Tensor, fp8_dtype: torch.dtype, pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    m, d = x.shape
    q = torch.zeros((d, m), dtype=torch.float32, device=x.device).to(fp8_dtype).t()
    scales = torch.empty((offs.numel(), d), dtype=torch.float32, device=x.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        rows = x[start:end]
        s, dec = scales_from_amax(amax(rows, 0), fp8_dtype, pow2_scale)
        q[start:end] = encode(rows, s, fp8_dtype)
        scales[g] = dec[0]
        start = end
    return q, scales


def quantize_jagged_colwise_dual(x1: Tensor, x2: Tensor, offs: Tensor, fp8_dtype: torch.dtype, pow2_scale: bool = True):
    return (*quantize_jagged_colwise(x1, offs, fp8_dtype, pow2_scale), *quantize_jagged_colwise(x2, offs, fp8_dtype, pow2_scale))
