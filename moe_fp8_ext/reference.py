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


def quantize_jagged_colwise_padded(x: Tensor, offs: Tensor, alignment: int, fp8_dtype: torch.dtype, pow2_scale: bool = True):
    """The padded layout of the jagged quantization: quantize the padded copy."""
    xp, _starts, ends = pad_token_groups(x, offs, alignment)
    return quantize_jagged_colwise(xp, ends, fp8_dtype, pow2_scale)


# ---- token groups (DESIGN §8) ------------------------------------------------------------


def padded_group_offsets(offs: Tensor, alignment: int) -> Tuple[Tensor, Tensor]:
    sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    padded = (sizes + alignment - 1) // alignment * alignment
    ends = torch.cumsum(padded, 0)
    return (ends - padded).to(torch.int32), ends.to(torch.int32)


def pad_token_groups(x: Tensor, offs: Tensor, alignment: int) -> Tuple[Tensor, Tensor, Tensor]:
    m, g = x.shape[0], offs.numel()
    rows = -(-(m + g * alignment) // alignment) * alignment
    starts, ends = padded_group_offsets(offs, alignment)
    xp = torch.zeros((rows, x.shape[1]), dtype=x.dtype, device=x.device)
    lo = 0
    for p, hi in zip(starts.tolist(), offs.tolist()):
        xp[p : p + hi - lo] = x[lo:hi]
        lo = hi
    return xp, starts, ends


def unpad_token_groups(xp: Tensor, offs: Tensor, starts: Tensor, num_tokens: int) -> Tensor:
    x = torch.zeros((num_tokens, xp.shape[1]), dtype=xp.dtype, device=xp.device)
    lo = 0
    for p, hi in zip(starts.tolist(), offs.tolist()):
        x[lo:hi] = xp[p : p + hi - lo]
        lo = hi
    return x


def permute_indices(counts: Tensor, experts_per_rank: int, num_ranks: int, alignment: int, max_len: int):
    c = counts.view(num_ranks, experts_per_rank).long()
    start = (torch.cumsum(c.flatten(), 0) - c.flatten()).view(num_ranks, experts_per_rank)
    total = c.sum(0)
    sizes = torch.clamp((total + alignment - 1) // alignment * alignment, min=alignment)
    ends = torch.cumsum(sizes, 0)
    idx = torch.full((max_len,), -1, dtype=torch.int32)
    for e in range(experts_per_rank):
        slot = int(ends[e] - sizes[e])
        for r in range(num_ranks):
            n = int(c[r, e])
            idx[slot : slot + n] = torch.arange(int(start[r, e]), int(start[r, e]) + n, dtype=torch.int32)[: max(0, max_len - slot)]
            slot += n
    return idx.to(counts.device), sizes.to(torch.int32).to(counts.device), ends.to(torch.int32).to(counts.device)


def gather_rows(x: Tensor, indices: Tensor) -> Tensor:
    xz = torch.cat([x, x.new_zeros((1, x.shape[1]))])
    return xz[indices.long().masked_fill(indices < 0, x.shape[0])]


def scatter_rows(y: Tensor, indices: Tensor, num_rows: int) -> Tensor:
    x = y.new_zeros((num_rows + 1, y.shape[1]))
    x[indices.long().masked_fill(indices < 0, num_rows)] = y
    return x[:num_rows]
