"""MXFP8 quantization (DESIGN §7): e4m3fn data with one E8M0 scale per 32 consecutive
elements of the contraction dimension, as the sm100 block-scaled GEMMs consume it.

``rounding`` is ``"rceil"`` (default: the scale rounds up, so no block saturates) or
``"floor"`` (OCP's rule), both bit-exact with torchao 0.18's ``to_mx``. Scales are
``float8_e8m0fnu``. ``blocked=True`` returns them in the swizzled layout the GEMMs read
(128x4 tiles, torchao's ``to_blocked``), written by the quantization kernel itself;
its padding is zero. Each wrapper has its fake implementation beside it, so the ops
trace under ``torch.compile(fullgraph=True)``.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from .ops import (
    _dtype_name,
    _require,
    check_block_jagged,
    check_index,
    check_quant_input,
    check_same_device,
    checked_padded_rows,
)

_ops = torch.ops.moe_fp8
MX_BLOCK = 32
ROUNDINGS = ("rceil", "floor")


# ---- argument checks shared by each wrapper and its fake (rules and order of csrc/mxfp8/mxfp8_ops.cpp): a wrapper
# fails before it reads a shape, and a fake (torch.compile, a meta tensor among CPU/CUDA ones) refuses what the
# real kernel refuses. The kernel checks the content of offs and padded_starts.


def _check_rounding(op, rounding):
    if not isinstance(rounding, str):
        raise TypeError(f"{op}: expected rounding to be a str, got {type(rounding).__name__}")
    if rounding not in ROUNDINGS:
        raise RuntimeError(f"{op}: expected rounding \"rceil\" or \"floor\", got \"{rounding}\"")


def _check_multiple_of_block(op, n, what):
    _require(n % MX_BLOCK == 0, lambda: f"{op}: expected {what} to be a multiple of {MX_BLOCK}, got {n}")


def check_quantize_mxfp8_rowwise(x, rounding, blocked, offs, op="quantize_mxfp8_rowwise"):
    check_quant_input(op, "x", x, 2)
    _check_rounding(op, rounding)
    _check_multiple_of_block(op, x.shape[1], "K (x.size(1))")
    if offs is None:
        return
    if not blocked:
        raise RuntimeError(f"{op}: expected offs only with blocked=True (plain scales do not depend on the token "
                           "groups), got offs with blocked=False")
    check_index(op, "offs", offs)
    check_same_device(op, "x", x, offs=offs)
    # the groups' scale rows start at the padded offsets of 128 (int32)
    checked_padded_rows(op, x.shape[0], offs.shape[0], 128)


def check_quantize_mxfp8_colwise(x, rounding, blocked, offs, padded_starts, alignment, op="quantize_mxfp8_colwise"):
    """Returns the rows of q: M, or the padded rows."""
    check_quant_input(op, "x", x, 2)
    _check_rounding(op, rounding)
    q_rows = check_block_jagged(op, x, offs, padded_starts, alignment, MX_BLOCK)
    if padded_starts is None:  # the unpadded form: whole blocks, groups of whole blocks (content: the kernel's)
        _check_multiple_of_block(op, x.shape[0], "M (x.size(0))")
    if offs is None:
        return q_rows
    m, g = x.shape[0], offs.shape[0]
    group_alignment = 128 if padded_starts is None else max(alignment, 128)
    if blocked:  # the groups' scale columns start at padded offsets (int32)
        checked_padded_rows(op, m, g, group_alignment)
    return q_rows


def check_quantize_mxfp8_experts(b, rounding, blocked, op="quantize_mxfp8_experts"):
    check_quant_input(op, "b", b, 3)
    _check_rounding(op, rounding)
    _check_multiple_of_block(op, b.shape[1], "K (b.size(1))")
    _require(b.shape[0] <= 65535, lambda: f"{op}: expected at most 65535 experts, got {b.shape[0]}")


def _ceil(a, b):
    return -(-a // b) * b


def quantize_mxfp8_rowwise(x: Tensor, rounding: str = "rceil", blocked: bool = False,
                           offs: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Blocks of 32 along the rows of ``x`` (M, K) (the left operand, K the contraction;
    K % 32 == 0). Returns q (M, K) row-major and the scales: (M, K/32), or blocked as a
    (ceil128(M), ceil4(K/32)) tensor; with ``offs`` (token groups of the rows, blocked
    only) the M-group layout of the grouped GEMM: group g's scale rows start at row
    sum_{j<g} ceil128(n_j), (M + 128 G, ceil4(K/32)) in all, no host sync."""
    check_quantize_mxfp8_rowwise(x, rounding, blocked, offs)
    return _ops.quantize_mxfp8_rowwise(x, rounding, blocked, offs)


@torch.library.register_fake("moe_fp8::quantize_mxfp8_rowwise")
def _(x, rounding="rceil", blocked=False, offs=None):
    check_quantize_mxfp8_rowwise(x, rounding, blocked, offs)
    m, k = x.shape
    q = x.new_empty((m, k), dtype=torch.float8_e4m3fn)
    c = k // MX_BLOCK
    if not blocked:
        shape = (m, c)
    elif offs is None:
        shape = (_ceil(m, 128), _ceil(c, 4))
    else:
        shape = (m + 128 * offs.shape[0], _ceil(c, 4))
    return q, x.new_empty(shape, dtype=torch.float8_e8m0fnu)


def quantize_mxfp8_colwise(x: Tensor, rounding: str = "rceil", blocked: bool = False, offs: Optional[Tensor] = None,
                           padded_starts: Optional[Tensor] = None, alignment: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Blocks of 32 consecutive rows of each column of ``x`` (M, K) (a weight-gradient
    operand: the contraction runs over the M tokens). Returns q (M, K) column-major and
    scales (K, M/32), or blocked (ceil128(K), ceil4(M/32)). With ``offs`` (token groups,
    sizes multiples of 32) blocks stay inside their group, rows past the last group are
    zero, and blocked scales take the K-group layout: group g's block columns start at
    sum_{j<g} ceil4(n_j/32), (ceil128(K), ceil4(M/32) + 4 G) in all. ``padded_starts``
    and ``alignment`` (a multiple of 32; from :func:`moe_fp8_ext.padded_group_offsets`:
    gap-free, other starts raise on the CPU and with ``MOE_FP8_DEBUG=1``) write q in the
    padded layout of :func:`moe_fp8_ext.pad_token_groups` from the unpadded x, for any
    group sizes."""
    check_quantize_mxfp8_colwise(x, rounding, blocked, offs, padded_starts, alignment)
    return _ops.quantize_mxfp8_colwise(x, rounding, blocked, offs, padded_starts, alignment)


@torch.library.register_fake("moe_fp8::quantize_mxfp8_colwise")
def _(x, rounding="rceil", blocked=False, offs=None, padded_starts=None, alignment=None):
    q_rows = check_quantize_mxfp8_colwise(x, rounding, blocked, offs, padded_starts, alignment)
    m, k = x.shape
    q = x.new_empty_strided((q_rows, k), (1, torch.sym_max(q_rows, 1)), dtype=torch.float8_e4m3fn)
    c = q_rows // MX_BLOCK
    if not blocked:
        shape = (k, c)
    elif offs is None:
        shape = (_ceil(k, 128), _ceil(c, 4))
    else:
        shape = (_ceil(k, 128), _ceil(c, 4) + 4 * offs.shape[0])
    return q, x.new_empty(shape, dtype=torch.float8_e8m0fnu)


def quantize_mxfp8_experts(b: Tensor, rounding: str = "rceil", blocked: bool = False) -> Tuple[Tensor, Tensor]:
    """Expert weights ``b`` (E, K, N), the right operand of a GEMM contracting over K
    (dim -2; K % 32 == 0): q (E, K, N) column-major per expert and scales (E, N, K/32),
    or blocked per expert as (E, ceil128(N) * ceil4(K/32)), the shape
    ``scaled_grouped_mm`` takes. Call it on ``B_t`` for the forward and on
    ``B_t.transpose(-2, -1)`` for the input gradient."""
    check_quantize_mxfp8_experts(b, rounding, blocked)
    return _ops.quantize_mxfp8_experts(b, rounding, blocked)


@torch.library.register_fake("moe_fp8::quantize_mxfp8_experts")
def _(b, rounding="rceil", blocked=False):
    check_quantize_mxfp8_experts(b, rounding, blocked)
    e, k, n = b.shape
    q = b.new_empty_strided((e, k, n), (k * n, 1, torch.sym_max(k, 1)), dtype=torch.float8_e4m3fn)
    c = k // MX_BLOCK
    shape = (e, _ceil(n, 128) * _ceil(c, 4)) if blocked else (e, n, c)
    return q, b.new_empty(shape, dtype=torch.float8_e8m0fnu)


# ---- scale swizzles (DESIGN §7): scales made elsewhere to and from the blocked layout, any 1-byte dtype (kept).
# Blocked outputs are written whole, padding zero; plain outputs (the inverses) drop it. offs: int32 group ends
# (DESIGN §3), bad content clamped on a GPU (never out of bounds), an error on the CPU. No host sync, any group count.

_SCALE_BYTE_BAD = (torch.bool, torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)
_MAX_DIM = 1 << 40


def _check_scale_bytes(op, name, t, dims):
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: expected {name} to be a Tensor, got {type(t).__name__}")
    if t.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise RuntimeError(f"{op}: expected {name} to be a {want} tensor, got {t.dim()}-D")
    if t.dtype.itemsize != 1 or t.dtype in _SCALE_BYTE_BAD:
        raise RuntimeError(f"{op}: expected {name} of a 1-byte dtype (float8_e8m0fnu, uint8, int8 or another "
                           f"float8), got {_dtype_name(t.dtype)}")


def _check_swizzle_offs(op, name, t, offs):
    check_index(op, "offs", offs)
    check_same_device(op, name, t, offs=offs)
    return offs.shape[0]


def _check_size(op, name, v):
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
        raise TypeError(f"{op}: expected {name} to be an int, got {type(v).__name__}")
    _require(0 <= v <= _MAX_DIM, lambda: f"{op}: expected {name} in [0, {_MAX_DIM}], got {v}")


def check_to_blocked_scales(s, op="to_blocked_scales"):
    """Returns the blocked shape."""
    _check_scale_bytes(op, "s", s, (2, 3))
    r, c = s.shape[-2], s.shape[-1]
    if s.dim() == 2:
        return (_ceil(r, 128), _ceil(c, 4))
    return (s.shape[0], _ceil(r, 128) * _ceil(c, 4))


def check_to_blocked_scales_m_groups(s, offs, op="to_blocked_scales_m_groups"):
    _check_scale_bytes(op, "s", s, (2,))
    g = _check_swizzle_offs(op, "s", s, offs)
    checked_padded_rows(op, s.shape[0], g, 128)
    return (s.shape[0] + 128 * g, _ceil(s.shape[1], 4))


def check_to_blocked_scales_k_groups(s, offs, op="to_blocked_scales_k_groups"):
    _check_scale_bytes(op, "s", s, (2,))
    g = _check_swizzle_offs(op, "s", s, offs)
    checked_padded_rows(op, s.shape[1], g, 4)
    return (_ceil(s.shape[0], 128), _ceil(s.shape[1], 4) + 4 * g)


def check_from_blocked_scales(b, rows, cols, op="from_blocked_scales"):
    """Returns the plain shape: (rows, cols) or (E, rows, cols)."""
    _check_scale_bytes(op, "b", b, (2,))
    _check_size(op, "rows", rows)
    _check_size(op, "cols", cols)
    rp, cp = _ceil(rows, 128), _ceil(cols, 4)
    if b.shape[0] == rp and b.shape[1] == cp:
        return (rows, cols)
    _require(b.shape[1] == rp * cp, lambda: f"{op}: expected b of shape ({rp}, {cp}) (one blocked matrix) or (E, "
             f"{rp * cp}) (E blocked matrices) for rows={rows} and cols={cols}, got {list(b.shape)}")
    return (b.shape[0], rows, cols)


def check_from_blocked_scales_m_groups(b, offs, cols, op="from_blocked_scales_m_groups"):
    _check_scale_bytes(op, "b", b, (2,))
    g = _check_swizzle_offs(op, "b", b, offs)
    _check_size(op, "cols", cols)
    _require(b.shape[1] == _ceil(cols, 4) and b.shape[0] >= 128 * g,
             lambda: f"{op}: expected b of shape (M + 128 * {g}, {_ceil(cols, 4)}) (M tokens in {g} groups, "
             f"cols={cols}), got {list(b.shape)}")
    m = b.shape[0] - 128 * g
    checked_padded_rows(op, m, g, 128)
    return (m, cols)


def check_from_blocked_scales_k_groups(b, offs, rows, cols, op="from_blocked_scales_k_groups"):
    _check_scale_bytes(op, "b", b, (2,))
    g = _check_swizzle_offs(op, "b", b, offs)
    _check_size(op, "rows", rows)
    _check_size(op, "cols", cols)
    width = _ceil(cols, 4) + 4 * g
    _require(b.shape[0] == _ceil(rows, 128) and b.shape[1] == width,
             lambda: f"{op}: expected b of shape ({_ceil(rows, 128)}, {width}) (rows={rows}, cols={cols}, {g} "
             f"groups), got {list(b.shape)}")
    checked_padded_rows(op, cols, g, 4)
    return (rows, cols)


def to_blocked_scales(s: Tensor) -> Tensor:
    """Scales ``s`` (R, C) (any strides) in the blocked layout of DESIGN §7 (torchao's
    ``to_blocked``): a (ceil128(R), ceil4(C)) tensor whose memory is in blocked order,
    padding zero. ``s`` (E, R, C): each matrix blocked on its own, (E, ceil128(R) *
    ceil4(C)) (the per-expert layout ``scaled_grouped_mm`` takes)."""
    check_to_blocked_scales(s)
    return _ops.to_blocked_scales(s)


@torch.library.register_fake("moe_fp8::to_blocked_scales")
def _(s):
    return s.new_empty(check_to_blocked_scales(s))


def to_blocked_scales_m_groups(s: Tensor, offs: Tensor) -> Tensor:
    """Scales ``s`` (M, C) of a token-grouped left operand (groups along the rows, ends
    ``offs``) in the M-group blocked layout: group g's rows blocked on their own from
    row sum_{j<g} ceil128(n_j); (M + 128 G, ceil4(C)) in all, zeros elsewhere (what
    ``quantize_mxfp8_rowwise(..., blocked=True, offs=offs)`` writes)."""
    check_to_blocked_scales_m_groups(s, offs)
    return _ops.to_blocked_scales_m_groups(s, offs)


@torch.library.register_fake("moe_fp8::to_blocked_scales_m_groups")
def _(s, offs):
    return s.new_empty(check_to_blocked_scales_m_groups(s, offs))


def to_blocked_scales_k_groups(s: Tensor, offs: Tensor) -> Tensor:
    """Scales ``s`` (R, C) of a weight-gradient operand, one column per 32 tokens, with
    token groups along the columns (``offs`` in TOKENS, clamped to [0, 32 C]): group g
    (tokens [lo, hi)) owns the ceil((hi - lo) / 32) block columns from column lo // 32
    (its own columns when group sizes are multiples of 32), blocked on their own as a
    (ceil128(R), ceil4(n_g)) matrix stored from flat offset ceil128(R) * sum_{j<g}
    ceil4(n_j); the buffer is (ceil128(R), ceil4(C) + 4 G), zeros elsewhere (what
    ``quantize_mxfp8_colwise(..., blocked=True, offs=offs)`` writes)."""
    check_to_blocked_scales_k_groups(s, offs)
    return _ops.to_blocked_scales_k_groups(s, offs)


@torch.library.register_fake("moe_fp8::to_blocked_scales_k_groups")
def _(s, offs):
    return s.new_empty(check_to_blocked_scales_k_groups(s, offs))


def from_blocked_scales(b: Tensor, rows: int, cols: int) -> Tensor:
    """The inverse of :func:`to_blocked_scales`: ``b`` (ceil128(rows), ceil4(cols)) ->
    plain (rows, cols); ``b`` (E, ceil128(rows) * ceil4(cols)) -> (E, rows, cols). The
    padding is dropped. (When both readings fit, i.e. rows = cols = 0 and b is (0, 0),
    b is one matrix.)"""
    check_from_blocked_scales(b, rows, cols)
    return _ops.from_blocked_scales(b, rows, cols)


@torch.library.register_fake("moe_fp8::from_blocked_scales")
def _(b, rows, cols):
    return b.new_empty(check_from_blocked_scales(b, rows, cols))


def from_blocked_scales_m_groups(b: Tensor, offs: Tensor, cols: int) -> Tensor:
    """The inverse of :func:`to_blocked_scales_m_groups`: ``b`` (M + 128 G, ceil4(cols))
    -> plain (M, cols) (M = b.size(0) - 128 G). Rows past offs[-1] belong to no group:
    zero."""
    check_from_blocked_scales_m_groups(b, offs, cols)
    return _ops.from_blocked_scales_m_groups(b, offs, cols)


@torch.library.register_fake("moe_fp8::from_blocked_scales_m_groups")
def _(b, offs, cols):
    return b.new_empty(check_from_blocked_scales_m_groups(b, offs, cols))


def from_blocked_scales_k_groups(b: Tensor, offs: Tensor, rows: int, cols: int) -> Tensor:
    """The inverse of :func:`to_blocked_scales_k_groups` (``offs`` in tokens, ``cols``
    block columns): ``b`` (ceil128(rows), ceil4(cols) + 4 G) -> plain (rows, cols).
    Columns no group owns are zero; a column two groups share (group sizes not
    multiples of 32) is read from the first of them."""
    check_from_blocked_scales_k_groups(b, offs, rows, cols)
    return _ops.from_blocked_scales_k_groups(b, offs, rows, cols)


@torch.library.register_fake("moe_fp8::from_blocked_scales_k_groups")
def _(b, offs, rows, cols):
    return b.new_empty(check_from_blocked_scales_k_groups(b, offs, rows, cols))
