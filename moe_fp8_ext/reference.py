"""Pure-torch reference of every op: the spec in code (DESIGN §4, §5).

The kernels match these bit for bit. Three details matter for that: the encode
scale is ``fp8_max / amax`` as a true fp32 division (``scalar / tensor`` in torch
multiplies by a reciprocal, which rounds differently); the power-of-two rounding
takes the exponent bits of the scale (``exp2(floor(log2(s)))`` in fp32 can round
up just below a power of two); and every NaN is made the positive NaN before a cast
and in fp32 scales (the sign and payload of a NaN that torch's arithmetic makes
depend on the operand order and on vectorization). The reference syncs with the
host; it is for tests, not for training.
"""

from typing import Tuple

import torch
from torch import Tensor


def fp8_max(fp8_dtype: torch.dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)


F32_NAN_BITS = 0x7FFFFFFF  # the one fp32 NaN of the outputs: +NaN, every payload bit (NVIDIA's)


def positive_nan(v: Tensor) -> Tensor:
    """v (fp32) with every NaN replaced by F32_NAN_BITS: what the ops write for a NaN
    (DESIGN §4), whatever NaN the arithmetic made. (Chosen as bits: traced, a NaN
    constant would be folded to the canonical one.)"""
    bits = v.view(torch.int32)
    return torch.where(torch.isnan(v), torch.full_like(bits, F32_NAN_BITS), bits).view(torch.float32)


def _plus_nan(y: Tensor) -> Tensor:
    """y with every NaN the type's +NaN (torch's nan constant: 0x7FC0 in bf16)."""
    return torch.where(torch.isnan(y), torch.full_like(y, float("nan")), y)


def round_to(v: Tensor, dtype: torch.dtype) -> Tensor:
    """v (fp32) rounded to bf16, fp16 or fp32 as the ops write it (§3): a bf16 NaN is
    0x7FC0 (c10's cast) whatever its sign and payload; fp16 and fp32 keep the NaN the
    arithmetic made."""
    out = v.to(dtype)
    return _plus_nan(out) if dtype == torch.bfloat16 else out


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
    return positive_nan(s), positive_nan(torch.ones_like(s) / s)


def encode(x: Tensor, s: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    m = fp8_max(fp8_dtype)
    return positive_nan(torch.clamp(x.float() * s, min=-m, max=m)).to(fp8_dtype)


def column_major(q: Tensor) -> Tensor:
    """The same values with the last two dims column-major: strides (1, rows), also
    where a dim is 1 (as the kernels' outputs)."""
    out = q.new_empty((*q.shape[:-2], q.shape[-1], q.shape[-2])).transpose(-2, -1)
    return out.copy_(q)


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


def sum_rows(x: Tensor, indices: Tensor, offs: Tensor) -> Tensor:
    """Row t: x's rows indices[offs[t-1]:offs[t]] added in order to +0, each partial sum
    rounded to x's dtype; -1 adds nothing."""
    ends, idx = offs.long().cpu(), torch.cat([indices.long().cpu(), torch.full((1,), -1)])
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    xc = x.cpu()
    acc = torch.zeros(offs.shape[0], x.shape[1], dtype=x.dtype)
    for step in range(int((ends - starts).max()) if offs.numel() else 0):
        j = starts + step
        rows = idx[torch.where(j < ends, j, -1)]
        live = rows >= 0
        add = xc[rows.clamp(min=0)].float() if xc.shape[0] else acc.float()
        acc = torch.where(live[:, None], round_to(acc.float() + add, x.dtype), acc)
    return acc.to(x.device)


def combine_rows(x: Tensor, scores: Tensor, indices: Tensor, offs: Tensor) -> Tensor:
    """sum_rows of the rows x[i] * scores[i] (fp32 products, rounded to x's dtype)."""
    terms = round_to(x.cpu().float() * scores.cpu()[:, None], x.dtype)
    return sum_rows(terms, indices, offs).to(x.device)


def combine_rows_backward(grad: Tensor, x: Tensor, scores: Tensor, token: Tensor) -> Tuple[Tensor, Tensor]:
    """x's row i of token t = token[i]: grad[t] * scores[i] (fp32, rounded to x's dtype),
    and the fp32 dot of grad[t] and x[i]: 32 partial sums, partial l over the columns of
    the 8-column chunks l, l + 32, ... in order, then added pairwise (l + 16 into l, then
    l + 8, ...). A row of no token (-1): zeros."""
    tok = token.long().cpu()
    live = tok >= 0
    g = torch.where(live[:, None], grad.cpu().float()[tok.clamp(min=0)], 0.0) if grad.shape[0] else \
        torch.zeros(x.shape[0], x.shape[1])
    s = scores.cpu()
    gx = torch.where(live[:, None], round_to(g * s[:, None], x.dtype), torch.zeros((), dtype=x.dtype))
    n, d = x.shape
    chunks = -(-d // 256) * 256
    prod = torch.full((n, chunks), -0.0)  # (-0.0 adds nothing, the sign of a zero sum kept)
    prod[:, :d] = g * x.cpu().float()
    prod = prod.view(n, chunks // 256, 32, 8)
    part = torch.zeros(n, 32)
    for c in range(prod.shape[1]):
        for k in range(8):
            part = part + prod[:, c, :, k]
    off = 16
    while off:
        part[:, :off] = part[:, :off] + part[:, off:2 * off]
        off //= 2
    gs = torch.where(live, part[:, 0], 0.0)
    return gx.to(x.device), gs.to(x.device)


def dequantize_rows(q: Tensor, scale: Tensor, block: int, out_dtype: torch.dtype) -> Tensor:
    s = scale.repeat_interleave(block, dim=1)[:, :q.shape[1]]
    return _plus_nan((q.float() * s).to(out_dtype))  # (§8)


# ---- MXFP8 (DESIGN §7): E8M0 scales over blocks of 32, the blocked scale layout ----------

MX_BLOCK = 32
E8M0_NAN = 255


def e8m0_from_amax(a: Tensor, rounding: str) -> Tensor:
    """Biased E8M0 exponent (int32) of each block amax (fp32), FLOOR or RCEIL, from the bits."""
    bits = a.float().contiguous().view(torch.int32) & 0x7FFFFFFF
    nan = bits > 0x7F800000
    if rounding == "floor":
        b = torch.clamp(((bits >> 23) & 0xFF) - 127 - 8, -127, 128) + 127
    elif rounding == "rceil":
        d = (a.float().abs() / torch.full_like(a.float(), 448.0)).contiguous().view(torch.int32)
        e = (d >> 23) & 0xFF
        man = d & 0x7FFFFF
        # subnormal d = man * 2^-149: ceil(log2(man)) - 149 from the highest set bit
        hi = torch.floor(torch.log2(man.clamp(min=1).double())).to(torch.int32)
        sub = hi + ((man & ((1 << hi) - 1)) != 0).to(torch.int32) - 149
        normal = e - 127 + (man != 0).to(torch.int32)
        log2c = torch.where(e == 0, sub, normal)
        b = torch.clamp(log2c, -127, 127) + 127
        b = torch.where((e == 0) & (man == 0), torch.zeros_like(b), b)
    else:
        raise ValueError(f"expected rounding 'floor' or 'rceil', got {rounding!r}")
    return torch.where(nan, torch.full_like(b, E8M0_NAN), b)


def e8m0_multiplier(b: Tensor, rounding: str) -> Tensor:
    """The encode multiplier of each biased exponent (float32): the data is quantized as
    e4m3fn(clamp(x * m, +-448))."""
    b = b.to(torch.int32)
    if rounding == "floor":
        # torchao divides by max(2^(b-127), 2^-126), and by +Inf for a NaN block
        m = ((254 - b.clamp(min=1)).clamp(min=0) << 23).view(torch.float32)
        return torch.where(b == E8M0_NAN, torch.zeros_like(m), m)
    m = ((254 - b).clamp(min=0) << 23).view(torch.float32)
    m = torch.where(b == 254, torch.full_like(m, 2.0**-127), m)
    m = torch.where(b == 0, torch.ones_like(m), m)
    return torch.where(b == E8M0_NAN, torch.full_like(m, float("nan")), m)


def _mx_blocks(xb: Tensor, rounding: str) -> Tuple[Tensor, Tensor]:
    """xb (..., nblocks, 32) -> q (same shape, e4m3fn) and biased exponents (..., nblocks)."""
    a = torch.amax(xb.float().abs(), dim=-1) if xb.shape[-1] else torch.zeros(xb.shape[:-1])
    b = e8m0_from_amax(a, rounding)
    m = e8m0_multiplier(b, rounding)
    q = positive_nan(torch.clamp(xb.float() * m[..., None], min=-448.0, max=448.0)).to(torch.float8_e4m3fn)
    return q, b.to(torch.uint8)


def to_blocked(s: Tensor) -> Tensor:
    """The blocked (swizzled) layout of a scale matrix (R, C) (any 1-byte dtype): padded
    to (ceil128(R), ceil4(C)) with zeros, scale (r, c) at the DESIGN §7 index; returned
    as a (ceil128(R), ceil4(C)) tensor whose memory is in blocked order."""
    r, c = s.shape
    rp, cp = -(-r // 128) * 128, -(-c // 4) * 4
    out = torch.zeros(rp * cp, dtype=torch.uint8)
    if r and c:
        ri = torch.arange(r)[:, None]
        ci = torch.arange(c)[None, :]
        idx = ((ri // 128) * (cp // 4) + ci // 4) * 512 + (ri % 32) * 16 + ((ri % 128) // 32) * 4 + ci % 4
        out[idx.flatten()] = s.contiguous().view(torch.uint8).cpu().flatten()
    return out.view(rp, cp).view(s.dtype).to(s.device)


def _group_sizes(offs: Tensor, rows: int):
    ends = [min(max(int(o), 0), rows) for o in offs.tolist()]
    starts = [0] + ends[:-1]
    return [(s, max(e, s)) for s, e in zip(starts, ends)]


def to_blocked_m_groups(s: Tensor, offs: Tensor) -> Tensor:
    """Token groups along the rows of s (M, C): group g's rows blocked from row
    sum_{j<g} ceil128(n_j); (M + 128 G, ceil4(C)), zeros elsewhere."""
    m, c = s.shape
    cp = -(-c // 4) * 4
    out = torch.zeros((m + 128 * offs.numel()) * cp, dtype=torch.uint8)
    row = 0
    for lo, hi in _group_sizes(offs, m):
        blk = to_blocked(s[lo:hi]).view(torch.uint8).flatten().cpu()
        out[row * cp : row * cp + blk.numel()] = blk
        row += -(-(hi - lo) // 128) * 128
    return out.view(m + 128 * offs.numel(), cp).view(s.dtype).to(s.device)


def to_blocked_k_groups(s: Tensor, offs: Tensor, block: int = MX_BLOCK) -> Tensor:
    """Token groups along the columns of s (R, M/32) (offs in tokens): each group's block
    columns blocked on their own (to_blocked of its (R, n_g) slice) and laid out
    contiguously, group g's from flat offset ceil128(R) * sum_{j<g} ceil4(n_j / 32) (the
    grouped GEMM reads group g's scales as one blocked matrix there, like torch's own
    tests and torchao's torch_to_blocked_2d_K_groups lay them out); the buffer is
    (ceil128(R), ceil4(M/32) + 4 G), zeros elsewhere."""
    r, c = s.shape
    rp = -(-r // 128) * 128
    width = -(-c // 4) * 4 + 4 * offs.numel()
    out = torch.zeros(rp * width, dtype=torch.uint8)
    col = 0
    for lo, hi in _group_sizes(offs, c * block):
        n = -(-(hi - lo) // block)
        if n:
            blk = to_blocked(s[:, lo // block : lo // block + n]).view(torch.uint8).flatten().cpu()
            out[col * rp : col * rp + blk.numel()] = blk
        col += -(-n // 4) * 4
    return out.view(rp, width).view(s.dtype).to(s.device)


def quantize_mxfp8_rowwise(x: Tensor, rounding: str = "rceil", blocked: bool = False, offs=None):
    m, k = x.shape
    q, b = _mx_blocks(x.reshape(m, k // MX_BLOCK, MX_BLOCK), rounding)
    scale = b.view(torch.float8_e8m0fnu)
    if blocked:
        scale = to_blocked(scale) if offs is None else to_blocked_m_groups(scale, offs)
    return q.reshape(m, k).contiguous(), scale  # row-major whatever the strides of x


def quantize_mxfp8_colwise(x: Tensor, rounding: str = "rceil", blocked: bool = False, offs=None):
    """Blocks of 32 consecutive rows of each column: q (M, K) column-major, scale (K, M/32).
    With token groups (offs, sizes multiples of 32) the rows past the last group belong
    to no group: their q and scales are zero."""
    m, k = x.shape
    if offs is not None:  # no groups (G = 0): every row is past the last group
        x = x.clone()
        x[min(max(int(offs[-1]), 0), m) if offs.numel() else 0 :] = 0
    q, b = _mx_blocks(x.t().reshape(k, m // MX_BLOCK, MX_BLOCK), rounding)
    scale = b.view(torch.float8_e8m0fnu)
    if blocked:
        scale = to_blocked(scale) if offs is None else to_blocked_k_groups(scale, offs)
    return column_major(q.reshape(k, m).t()), scale


def quantize_mxfp8_colwise_padded(x: Tensor, offs: Tensor, alignment: int, rounding: str = "rceil", blocked: bool = False):
    """The padded layout of the per-group colwise quantization: quantize the padded copy."""
    xp, _starts, ends = pad_token_groups(x, offs, alignment)
    return quantize_mxfp8_colwise(xp, rounding, blocked, ends)


def quantize_mxfp8_experts(b_t: Tensor, rounding: str = "rceil", blocked: bool = False):
    """b_t (E, K, N), blocks of 32 along K: q (E, K, N) column-major per expert, scale
    (E, N, K/32) or blocked per expert (E, ceil128(N) * ceil4(K/32))."""
    e, k, n = b_t.shape
    w = b_t.transpose(-2, -1)  # (E, N, K)
    q, b = _mx_blocks(w.reshape(e, n, k // MX_BLOCK, MX_BLOCK), rounding)
    scale = b.view(torch.float8_e8m0fnu)
    if blocked:
        per_expert = -(-n // 128) * 128 * (-(-(k // MX_BLOCK) // 4) * 4)
        scale = torch.stack([to_blocked(scale[i]).flatten() for i in range(e)]) if e else scale.new_empty((0, per_expert))
    return column_major(q.reshape(e, n, k).transpose(-2, -1)), scale


# ---- FP8 blockwise (DESIGN §6): 1x128 / 128x1 blocks, exact fp32 decode scales --------

BW_BLOCK = 128


def _bw_blocks(x: Tensor, fp8_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Blocks of 128 consecutive elements along the last dim of x (R, C), the last
    block partial when C % 128 != 0 (its amax over the valid part: the zero padding
    never raises it): q (R, C) contiguous and decode scales (R, ceil(C/128)), fp32."""
    r, c = x.shape
    nb = -(-c // BW_BLOCK)
    xp = torch.zeros((r, nb * BW_BLOCK), dtype=torch.float32, device=x.device)
    xp[:, :c] = x.float()
    xb = xp.view(r, nb, BW_BLOCK)
    a = torch.amax(xb.abs(), dim=-1) if r * nb else torch.zeros((r, nb), device=x.device)
    s, dec = scales_from_amax(a, fp8_dtype, False)
    q = encode(xb, s[..., None], fp8_dtype).view(r, nb * BW_BLOCK)[:, :c].contiguous()
    return q, dec


def quantize_blockwise_act_lhs(x: Tensor, fp8_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """1x128 blocks along the rows of x (M, K): q (M, K) row-major, scale (M, ceil(K/128))
    column-major."""
    q, dec = _bw_blocks(x, fp8_dtype)
    return q, column_major(dec)


def _bw_cols(x: Tensor, fp8_dtype: torch.dtype, offs=None) -> Tuple[Tensor, Tensor]:
    """128x1 blocks down the columns of x (M, K) as x^T (K, M) row-major q and (K,
    ceil(M/128)) row-major scales. With token groups the blocks restart at each
    group's first row (which must be a multiple of 128 for a non-empty group: its scale
    column is first_row / 128); rows past the last group are zero, with zero scales."""
    m, k = x.shape
    if offs is None:
        return _bw_blocks(x.t(), fp8_dtype)
    nb = -(-m // BW_BLOCK)
    q = torch.zeros((k, m), dtype=torch.float32, device=x.device).to(fp8_dtype)
    scale = torch.zeros((k, nb), dtype=torch.float32, device=x.device)
    for lo, hi in _group_sizes(offs, m):
        if hi == lo:
            continue
        assert lo % BW_BLOCK == 0, f"group starting at row {lo}"
        qg, dg = _bw_blocks(x[lo:hi].t(), fp8_dtype)
        q[:, lo:hi] = qg
        scale[:, lo // BW_BLOCK : lo // BW_BLOCK + dg.shape[1]] = dg
    return q, scale


def _bw_cols_any(x, fp8_dtype, offs=None, alignment=None):
    if alignment is None:
        return _bw_cols(x, fp8_dtype, offs)
    xp, _starts, ends = pad_token_groups(x, offs, alignment)
    return _bw_cols(xp, fp8_dtype, ends)


def quantize_blockwise_act_rhs(x: Tensor, fp8_dtype: torch.dtype, offs=None, alignment=None) -> Tuple[Tensor, Tensor]:
    """128x1 blocks down the columns of x (M, K): q (M, K) column-major, scale
    (ceil(M/128), K) row-major. ``offs``: token groups (non-empty ones start at
    multiples of 128); with ``alignment`` (a multiple of 128) the padded layout of
    pad_token_groups is quantized instead, for any group sizes."""
    qt, st = _bw_cols_any(x, fp8_dtype, offs, alignment)
    return qt.t(), st.t().contiguous()


def quantize_blockwise_act_transposed_lhs(x: Tensor, fp8_dtype: torch.dtype, offs=None,
                                          alignment=None) -> Tuple[Tensor, Tensor]:
    """x^T quantized in 1x128 blocks along M: q (K, M) row-major, scale (K, ceil(M/128))
    column-major; token groups as quantize_blockwise_act_rhs."""
    qt, st = _bw_cols_any(x, fp8_dtype, offs, alignment)
    return qt, column_major(st)


def _bw_tiles(w: Tensor, fp8_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """128x128 tiles of w (M, N) or (E, M, N), the last tile of a row or column partial
    when M or N is not a multiple of 128 (amax over its valid part): q row-major, the
    shape of w, and decode scales (..., ceil(M/128), ceil(N/128)), fp32."""
    lead, (m, n) = w.shape[:-2], w.shape[-2:]
    tm, tn = -(-m // BW_BLOCK), -(-n // BW_BLOCK)
    wp = torch.zeros((*lead, tm * BW_BLOCK, tn * BW_BLOCK), dtype=torch.float32, device=w.device)
    wp[..., :m, :n] = w.float()
    t = wp.view(*lead, tm, BW_BLOCK, tn, BW_BLOCK)
    if wp.numel():
        a = torch.amax(t.abs(), dim=(-3, -1))
    else:
        a = torch.zeros((*lead, tm, tn), device=w.device)
    s, dec = scales_from_amax(a, fp8_dtype, False)
    q = encode(t, s[..., :, None, :, None], fp8_dtype).view(*lead, tm * BW_BLOCK, tn * BW_BLOCK)
    return q[..., :m, :n].contiguous(), dec


def quantize_blockwise_weight_rhs(w: Tensor, fp8_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """128x128 tiles of w (M, N) (or (E, M, N), per expert), the right operand of a
    1x128 x 128x128 GEMM: q (M, N) column-major, scale (ceil(M/128), ceil(N/128))
    column-major (torchao's triton_fp8_blockwise_weight_quant_rhs layouts)."""
    q, dec = _bw_tiles(w, fp8_dtype)
    return column_major(q), column_major(dec)


def quantize_blockwise_weight_transposed_rhs(w: Tensor, fp8_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """w^T in 128x128 tiles (a tile and its transpose share the scale): q (N, M)
    column-major (w's row-major bytes), scale (ceil(N/128), ceil(M/128)) column-major
    (torchao's triton_fp8_blockwise_weight_quant_transposed_rhs layouts)."""
    q, dec = _bw_tiles(w, fp8_dtype)
    return q.transpose(-2, -1), column_major(dec.transpose(-2, -1))


# ---- SwiGLU (DESIGN §10): silu(h1) * h3 and its gradient, csrc/swiglu/swiglu.h's math ---
# fp32 tensor-tensor operations only (each rounded once, as the kernels' f_mul / f_add /
# f_div), so the reference, the CPU twin and the GPU kernel agree to the bit.

_EXP_HI, _EXP_LO = 88.72283935546875, -87.3365478515625
_EXP_POLY = (1.98412698e-4, 1.38888889e-3, 8.33333377e-3, 4.16666679e-2, 1.66666672e-1, 0.5, 1.0, 1.0)


def _c(x: Tensor, v: float) -> Tensor:
    return torch.full_like(x, v)


def exp_f32(x: Tensor) -> Tensor:
    """swiglu.h's exp_f32: exp of fp32 x to within 2 ulp from +, *, - alone; 0 below
    -87.34 (where 1 + exp(x) is 1), +Inf above 88.72, NaN kept."""
    x = x.float()
    magic = torch.where(x < 0, _c(x, -12582912.0), _c(x, 12582912.0))
    t = x * _c(x, 1.44269502162933349609375)
    n = (t + magic) - magic
    r = (x - n * _c(x, 0.693359375)) - n * _c(x, -2.12194440e-4)
    p = _c(x, _EXP_POLY[0])
    for coef in _EXP_POLY[1:]:
        p = p * r + _c(x, coef)
    ni = torch.nan_to_num(n).clamp(-126, 128).to(torch.int32)
    a = torch.div(ni, 2, rounding_mode="trunc")
    b = ni - a
    two = lambda e: ((e + 127) << 23).view(torch.float32)  # noqa: E731
    y = (p * two(a)) * two(b)
    y = torch.where(x < _EXP_LO, torch.zeros_like(x), y)
    return torch.where(x < _EXP_HI, y, torch.where(torch.isnan(x), x, _c(x, float("inf"))))


def silu_f32(x: Tensor) -> Tensor:
    x = x.float()
    return x / (_c(x, 1.0) + exp_f32(-x))


def silu_backward_f32(g: Tensor, x: Tensor) -> Tensor:
    g, x = g.float(), x.float()
    one = _c(x, 1.0)
    sig = one / (one + exp_f32(-x))
    return (g * sig) * (one + x * (one - sig))


def _round_as(v: Tensor, dtype: torch.dtype) -> Tensor:
    return v.to(dtype).float()


def swiglu(h13: Tensor) -> Tensor:
    """h = R(R(silu(h1)) * h3) for h13 = [h1 | h3] (R: round to h13's dtype)."""
    hidden = h13.shape[1] // 2
    h1, h3 = h13[:, :hidden].float(), h13[:, hidden:].float()
    return round_to(_round_as(silu_f32(h1), h13.dtype) * h3, h13.dtype)


def swiglu_backward(grad_h: Tensor, h13: Tensor) -> Tensor:
    """grad_h13 = [R(silu_backward(R(g h3), h1)) | R(g R(silu(h1)))] in h13's dtype."""
    hidden = h13.shape[1] // 2
    dt = h13.dtype
    g, h1, h3 = grad_h.float(), h13[:, :hidden].float(), h13[:, hidden:].float()
    grad_h1 = round_to(silu_backward_f32(_round_as(g * h3, dt), h1), dt)
    grad_h3 = round_to(g * _round_as(silu_f32(h1), dt), dt)
    return torch.cat([grad_h1, grad_h3], dim=1)


def swiglu_quantize_rowwise(h13: Tensor, fp8_dtype: torch.dtype, pow2_scale: bool = True):
    return quantize_rowwise(swiglu(h13), fp8_dtype, pow2_scale)


def swiglu_backward_quantize_rowwise(grad_h: Tensor, h13: Tensor, fp8_dtype: torch.dtype, pow2_scale: bool = True):
    gh13 = swiglu_backward(grad_h, h13)
    hidden = h13.shape[1] // 2
    q1, s1 = quantize_rowwise(gh13[:, :hidden], fp8_dtype, pow2_scale)
    q3, s3 = quantize_rowwise(gh13[:, hidden:], fp8_dtype, pow2_scale)
    return gh13, q1, s1, q3, s3


# ---- the W13 GEMM with the SwiGLU in its epilogue (DESIGN §6): blockwise_grouped_mm_swiglu -----


def swiglu_blockwise_operands(h13: Tensor, offs: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """What the SwiGLU GEMM's epilogue writes from its h13 = [h1 | h3]: h = swiglu(h13)'s
    1x128 operand (q (M, H), scale column-major) and its 128x1 operand in the 128-aligned
    padded layout (q column-major, scale (R/128, H)), e4m3fn."""
    h = swiglu(h13)
    f8 = torch.float8_e4m3fn
    return quantize_blockwise_act_lhs(h, f8) + quantize_blockwise_act_rhs(h, f8, offs, BW_BLOCK)


def blockwise_grouped_mm_swiglu(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor,
                                offs: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The op's outputs: h13 = a (M, K) x [W1; W3] per token group, from b (E, K, 2H)
    interleaved by 128 columns (block 2j is W1's block j, 2j + 1 W3's) in 128x128 tiles,
    fp32 sums (the GPU's order of summation aside) rounded to bf16, rows past offs[-1]
    zero; then :func:`swiglu_blockwise_operands` of h13."""
    e, k, n = b.shape
    bf = _blockwise_weights(b, scale_b).view(e, k, n // (2 * BW_BLOCK), 2, BW_BLOCK)
    b13 = torch.cat([bf[:, :, :, 0].reshape(e, k, n // 2), bf[:, :, :, 1].reshape(e, k, n // 2)], dim=2)
    h13 = _blockwise_grouped_gemm(a, scale_a, b13, offs)
    return (h13,) + swiglu_blockwise_operands(h13, offs)


def _blockwise_weights(b: Tensor, scale_b: Tensor) -> Tensor:
    """(E, K, N) 128x128-tile operand, dequantized to fp32."""
    _, k, n = b.shape
    return b.float() * scale_b.repeat_interleave(BW_BLOCK, 1).repeat_interleave(BW_BLOCK, 2)[:, :k, :n]


def _blockwise_grouped_gemm(a: Tensor, scale_a: Tensor, bf: Tensor, offs: Tensor) -> Tensor:
    """a (M, K) 1x128 operand x fp32 weights (E, K, N) per token group, fp32 sums rounded
    to bf16; rows past offs[-1] zero."""
    m, k = a.shape
    af = a.float() * scale_a.repeat_interleave(BW_BLOCK, 1)[:, :k]
    out = torch.zeros((m, bf.shape[2]), dtype=torch.float32, device=a.device)
    for g, (lo, hi) in enumerate(_group_sizes(offs, m)):
        out[lo:hi] = af[lo:hi] @ bf[g]
    return out.bfloat16()


# ---- the W2 input-gradient GEMM with the dSwiGLU in its epilogue: blockwise_grouped_mm_dswiglu ----


def dswiglu_blockwise_operands(grad_h: Tensor, h13: Tensor, offs: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """What the dSwiGLU GEMM's epilogue writes from its grad_h and h13 = [h1 | h3]:
    grad_h13 = swiglu_backward(grad_h, h13)'s 1x128 operand and its 128x1 operand in the
    128-aligned padded layout, e4m3fn (the layouts of :func:`swiglu_blockwise_operands`);
    grad_h13's rows past offs[-1] zero (+0, whatever h13 holds there)."""
    m = grad_h.shape[0]
    end = offs[-1].clamp(0, m) if offs.numel() else torch.zeros((), dtype=offs.dtype)
    inside = torch.arange(m, device=grad_h.device) < end
    g13 = torch.where(inside[:, None], swiglu_backward(grad_h, h13), 0.0)  # rows past offs[-1]: zero
    f8 = torch.float8_e4m3fn
    return quantize_blockwise_act_lhs(g13, f8) + quantize_blockwise_act_rhs(g13, f8, offs, BW_BLOCK)


def blockwise_grouped_mm_dswiglu(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, offs: Tensor,
                                 h13: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's outputs: grad_h = a (M, K) x b (E, K, H) per token group (128x128 tiles),
    fp32 sums (the GPU's order of summation aside) rounded to bf16, rows past offs[-1]
    zero; then :func:`dswiglu_blockwise_operands` of grad_h and h13."""
    return dswiglu_blockwise_operands(_blockwise_grouped_gemm(a, scale_a, _blockwise_weights(b, scale_b), offs),
                                      h13, offs)
