"""Python wrappers of the FP8 rowwise ops (DESIGN §5), each with its fake (meta)
implementation right beside it so the ops trace under ``torch.compile``.

All scales are *decode* scales: ``x ≈ q.float() * scale``. With ``pow2_scale`` (the
default) every scale is an exact power of two. ``fp8_dtype=None`` picks
:func:`moe_fp8_ext.default_fp8_dtype`.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from .platform import default_fp8_dtype

_ops = torch.ops.moe_fp8


def _dtype(fp8_dtype: Optional[torch.dtype], ref: Tensor) -> torch.dtype:
    return fp8_dtype if fp8_dtype is not None else default_fp8_dtype(ref.device if ref.is_cuda else None)


def quantize_rowwise(x: Tensor, fp8_dtype: Optional[torch.dtype] = None, pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    """Quantize each row of ``x`` (M, K) (bf16/fp16/fp32, any strides).

    Returns ``q`` (M, K) row-major in ``fp8_dtype`` and ``scale`` (M, 1) float32,
    the amax of each row mapped to the fp8 max.
    """
    return _ops.quantize_rowwise(x, _dtype(fp8_dtype, x), pow2_scale)


@torch.library.register_fake("moe_fp8::quantize_rowwise")
def _(x, fp8_dtype, pow2_scale=True):
    torch._check(x.dim() == 2, lambda: f"quantize_rowwise: expected x to be a 2-D tensor, got {x.dim()}-D")
    m, k = x.shape
    return x.new_empty((m, k), dtype=fp8_dtype), x.new_empty((m, 1), dtype=torch.float32)


def quantize_experts_fwd(b_t: Tensor, fp8_dtype: Optional[torch.dtype] = None, pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    """Quantize expert weights ``b_t`` (E, K, N), the right operand of ``A @ B_t``,
    over K for every (e, n).

    Returns ``q`` (E, K, N) column-major per expert (strides (K·N, 1, K)) and
    ``scale`` (E, 1, N) float32. Any input layout; the fast paths are B_t
    column-major (the transpose of an (E, N, K) weight) and row-major.
    """
    return _ops.quantize_experts_fwd(b_t, _dtype(fp8_dtype, b_t), pow2_scale)


def _experts_fake(b_t, fp8_dtype, rdim, op):
    """q (E, R, C) column-major per expert and scale (E, 1, C), R = b_t.shape[rdim]."""
    torch._check(b_t.dim() == 3, lambda: f"{op}: expected b_t to be a 3-D tensor, got {b_t.dim()}-D")
    e, r, c = b_t.shape[0], b_t.shape[rdim], b_t.shape[3 - rdim]
    q = b_t.new_empty_strided((e, r, c), (r * c, 1, r), dtype=fp8_dtype)
    return q, b_t.new_empty((e, 1, c), dtype=torch.float32)


@torch.library.register_fake("moe_fp8::quantize_experts_fwd")
def _(b_t, fp8_dtype, pow2_scale=True):
    return _experts_fake(b_t, fp8_dtype, 1, "quantize_experts_fwd")


def quantize_experts_bwd(b_t: Tensor, fp8_dtype: Optional[torch.dtype] = None, pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    """Quantize the same expert weights for the input gradient ``grad_A = grad_out @ B``
    (B = ``b_t.transpose(-2, -1)``, (E, N, K)), over N for every (e, k).

    Returns ``q`` (E, N, K) column-major per expert (strides (N·K, 1, N)) and
    ``scale`` (E, 1, K) float32.
    """
    return _ops.quantize_experts_bwd(b_t, _dtype(fp8_dtype, b_t), pow2_scale)


@torch.library.register_fake("moe_fp8::quantize_experts_bwd")
def _(b_t, fp8_dtype, pow2_scale=True):
    return _experts_fake(b_t, fp8_dtype, 2, "quantize_experts_bwd")


def quantize_jagged_colwise(
    x: Tensor,
    offs: Tensor,
    fp8_dtype: Optional[torch.dtype] = None,
    pow2_scale: bool = True,
    padded_starts: Optional[Tensor] = None,
    alignment: int = 16,
) -> Tuple[Tensor, Tensor]:
    """Quantize each column of ``x`` (M, D) separately within every token group.

    ``offs`` is int32 (G,), the cumulative end row of each group (DESIGN §3); empty
    groups are fine. Returns ``q`` (M, D) column-major (strides (1, M)) and ``scale``
    (G, D) float32. Rows past ``offs[-1]`` get q = 0. Invalid ``offs`` raises on CPU
    (and on GPU with ``MOE_FP8_DEBUG=1``); on GPU it is clamped, never out of bounds.

    With ``padded_starts`` (from :func:`padded_group_offsets` or
    :func:`pad_token_groups` with the same ``alignment``), ``q`` is written in the
    padded layout instead: ``R = ceil((M + G·alignment)/alignment)·alignment`` rows,
    group g at rows ``[padded_starts[g], padded_starts[g] + round_up(n_g, alignment))``
    and zeros everywhere else: bit for bit ``quantize_jagged_colwise(pad_token_groups(x,
    offs, alignment)[0], padded_ends)``, without writing the padded bf16 copy.
    """
    return _ops.quantize_jagged_colwise(x, offs, _dtype(fp8_dtype, x), pow2_scale, padded_starts, alignment)


def padded_rows(num_tokens: int, groups: int, alignment: int) -> int:
    """Rows of the padded layout: ``ceil((num_tokens + groups·alignment)/alignment)·alignment``."""
    return -(-(num_tokens + groups * alignment) // alignment) * alignment


def _jagged_fake(x, offs, fp8_dtype, op, padded_starts=None, alignment=16):
    torch._check(x.dim() == 2, lambda: f"{op}: expected x to be a 2-D tensor, got {x.dim()}-D")
    torch._check(offs.dim() == 1, lambda: f"{op}: expected offs to be a 1-D tensor, got {offs.dim()}-D")
    m, d = x.shape
    rows = m if padded_starts is None else padded_rows(m, offs.shape[0], alignment)
    q = x.new_empty_strided((rows, d), (1, rows), dtype=fp8_dtype)
    return q, x.new_empty((offs.shape[0], d), dtype=torch.float32)


@torch.library.register_fake("moe_fp8::quantize_jagged_colwise")
def _(x, offs, fp8_dtype, pow2_scale=True, padded_starts=None, alignment=16):
    return _jagged_fake(x, offs, fp8_dtype, "quantize_jagged_colwise", padded_starts, alignment)


def quantize_jagged_colwise_dual(
    x1: Tensor,
    x2: Tensor,
    offs: Tensor,
    fp8_dtype: Optional[torch.dtype] = None,
    pow2_scale: bool = True,
    padded_starts: Optional[Tensor] = None,
    alignment: int = 16,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`quantize_jagged_colwise` of ``x1`` (M, D1) and ``x2`` (M, D2) (one dtype,
    one ``offs``, one layout) in a single launch: both operands of the weight-gradient
    GEMM ``grad_B[g] = grad_out[g]^T @ A[g]``. Returns ``(q1, scale1, q2, scale2)``."""
    return _ops.quantize_jagged_colwise_dual(x1, x2, offs, _dtype(fp8_dtype, x1), pow2_scale, padded_starts, alignment)


@torch.library.register_fake("moe_fp8::quantize_jagged_colwise_dual")
def _(x1, x2, offs, fp8_dtype, pow2_scale=True, padded_starts=None, alignment=16):
    q1, s1 = _jagged_fake(x1, offs, fp8_dtype, "quantize_jagged_colwise_dual", padded_starts, alignment)
    q2, s2 = _jagged_fake(x2, offs, fp8_dtype, "quantize_jagged_colwise_dual", padded_starts, alignment)
    return q1, s1, q2, s2


# ---- token groups (DESIGN §8) ----------------------------------------------------------
# Raw ops; the differentiable versions are in moe_fp8_ext.token_groups.


@torch.library.register_fake("moe_fp8::pad_token_groups")
def _(x, offs, alignment):
    torch._check(x.dim() == 2, lambda: f"pad_token_groups: expected x to be a 2-D tensor, got {x.dim()}-D")
    g = offs.shape[0]
    return x.new_empty((padded_rows(x.shape[0], g, alignment), x.shape[1])), offs.new_empty((g,)), offs.new_empty((g,))


@torch.library.register_fake("moe_fp8::pad_token_groups_at")
def _(x, offs, padded_starts, num_padded_rows):
    return x.new_empty((num_padded_rows, x.shape[1]))


@torch.library.register_fake("moe_fp8::unpad_token_groups")
def _(x_padded, offs, padded_starts, num_tokens):
    return x_padded.new_empty((num_tokens, x_padded.shape[1]))


def padded_group_offsets(offs: Tensor, num_tokens: int, alignment: int = 16) -> Tuple[Tensor, Tensor]:
    """``(padded_starts, padded_ends)`` of the layout :func:`pad_token_groups` builds for
    ``num_tokens`` tokens grouped by ``offs``: each group's size rounded up to
    ``alignment``, cumulated. One small kernel, no sync."""
    return _ops.padded_group_offsets(offs, num_tokens, alignment)


@torch.library.register_fake("moe_fp8::padded_group_offsets")
def _(offs, num_tokens, alignment):
    return offs.new_empty(offs.shape), offs.new_empty(offs.shape)


def permute_indices(
    tokens_per_expert_group: Tensor, experts_per_rank: int, num_ranks: int, alignment: int, max_len: int
) -> Tuple[Tensor, Tensor, Tensor]:
    """Index map from the rank-major order tokens arrive in after an all-to-all to the
    expert-major, padded order the grouped GEMM wants (DESIGN §8), in one launch.

    ``tokens_per_expert_group`` int32 (num_ranks·experts_per_rank,): the tokens each
    rank sent to each local expert, rank-major. Returns ``indices`` int32 (max_len,):
    the source row of every slot, -1 for a padding slot (a zero row); ``padded_sizes``
    and ``padded_ends`` int32 (experts_per_rank,): each expert's tokens rounded up to
    ``alignment``, and at least ``alignment`` (an expert with no tokens still gets a
    group). ``max_len = num_tokens + experts_per_rank·alignment`` always holds every
    slot; slots past ``max_len`` are dropped, which is checked on the CPU and with
    ``MOE_FP8_DEBUG=1``."""
    return _ops.permute_indices(tokens_per_expert_group, experts_per_rank, num_ranks, alignment, max_len)


@torch.library.register_fake("moe_fp8::permute_indices")
def _(counts, experts_per_rank, num_ranks, alignment, max_len):
    return counts.new_empty((max_len,)), counts.new_empty((experts_per_rank,)), counts.new_empty((experts_per_rank,))


def zero_rows_past_groups_(x: Tensor, offs: Tensor) -> Tensor:
    """In place: rows of ``x`` (M, D) at or past ``offs[-1]`` (no group holds them)
    become zeros; only those rows are touched. Returns ``x``."""
    _ops.zero_rows_past_groups_(x, offs)
    return x


@torch.library.register_fake("moe_fp8::zero_rows_past_groups_")
def _(x, offs):
    return None


def gather_rows(x: Tensor, indices: Tensor) -> Tensor:
    """``y[j] = x[indices[j]]``, a zero row where ``indices[j] == -1``. Any dtype."""
    return _ops.gather_rows(x, indices)


@torch.library.register_fake("moe_fp8::gather_rows")
def _(x, indices):
    return x.new_empty((indices.shape[0], x.shape[1]))


def scatter_rows(y: Tensor, indices: Tensor, num_rows: int) -> Tensor:
    """The inverse of :func:`gather_rows`: ``x[indices[j]] = y[j]`` for every
    ``indices[j] != -1`` (each row at most once), zero rows elsewhere; x has
    ``num_rows`` rows. Any dtype."""
    return _ops.scatter_rows(y, indices, num_rows)


@torch.library.register_fake("moe_fp8::scatter_rows")
def _(y, indices, num_rows):
    return y.new_empty((num_rows, y.shape[1]))
