"""Token-group building blocks (DESIGN §8): the padded layout's offsets and size, the expert-parallel
permutation, row gather and scatter, fp8 token rows back to values (dequantize_rows) and a row gather's
backward (sum_rows) and the MoE combine (combine_rows). Raw ops; the differentiable helpers are in
:mod:`moe_fp8_ext.token_groups` (top-level names). Each op's argument checks are one function, run
by its wrapper (before any shape is read) and by its fake.
"""

from typing import Tuple

import torch
from torch import Tensor

from ._checks import (
    FP8_DTYPES,
    INT32_MAX,
    QUANT_IN_DTYPES,
    _check_padded_starts,
    _dtype_name,
    _require,
    check_alignment,
    check_index,
    check_int,
    check_rows_alloc,
    check_same_device,
    check_tensor,
    checked_padded_rows,
    padded_rows,
)

_ops = torch.ops.moe_fp8

__all__ = [
    "dequantize_rows",
    "gather_rows",
    "padded_group_offsets",
    "padded_rows",
    "permute_indices",
    "scatter_rows",
    "sum_rows",
    "combine_rows",
    "combine_rows_backward",
    "zero_rows_past_groups_",
]


def check_pad_token_groups(x, offs, alignment, op="pad_token_groups"):
    check_tensor(op, "x", x, dim=2)
    check_index(op, "offs", offs)
    check_same_device(op, "x", x, offs=offs)
    check_alignment(op, alignment)
    r = checked_padded_rows(op, x.shape[0], offs.shape[0], alignment)
    check_rows_alloc(op, "the padded output", r, x)
    return r


@torch.library.register_fake("moe_fp8::pad_token_groups")
def _(x, offs, alignment):
    r = check_pad_token_groups(x, offs, alignment)
    g = offs.shape[0]
    return x.new_empty((r, x.shape[1])), offs.new_empty((g,)), offs.new_empty((g,))


def check_pad_token_groups_at(x, offs, padded_starts, num_padded_rows, op="pad_token_groups_at"):
    check_tensor(op, "x", x, dim=2)
    check_index(op, "offs", offs)
    check_index(op, "padded_starts", padded_starts)
    check_same_device(op, "x", x, offs=offs, padded_starts=padded_starts)
    check_int(op, "num_padded_rows", num_padded_rows)
    check_rows_alloc(op, "the padded output", num_padded_rows, x)
    _check_padded_starts(op, offs, padded_starts)


@torch.library.register_fake("moe_fp8::pad_token_groups_at")
def _(x, offs, padded_starts, num_padded_rows):
    check_pad_token_groups_at(x, offs, padded_starts, num_padded_rows)
    return x.new_empty((num_padded_rows, x.shape[1]))


def check_unpad_token_groups(x_padded, offs, padded_starts, num_tokens, op="unpad_token_groups"):
    check_tensor(op, "x_padded", x_padded, dim=2)
    check_index(op, "offs", offs)
    check_index(op, "padded_starts", padded_starts)
    check_same_device(op, "x_padded", x_padded, offs=offs, padded_starts=padded_starts)
    check_int(op, "num_tokens", num_tokens)
    check_rows_alloc(op, "the output", num_tokens, x_padded)
    _check_padded_starts(op, offs, padded_starts)


@torch.library.register_fake("moe_fp8::unpad_token_groups")
def _(x_padded, offs, padded_starts, num_tokens):
    check_unpad_token_groups(x_padded, offs, padded_starts, num_tokens)
    return x_padded.new_empty((num_tokens, x_padded.shape[1]))


def check_padded_group_offsets(offs, num_tokens, alignment, op="padded_group_offsets"):
    check_index(op, "offs", offs)
    check_alignment(op, alignment)
    check_int(op, "num_tokens", num_tokens)
    checked_padded_rows(op, num_tokens, offs.shape[0], alignment)


def padded_group_offsets(offs: Tensor, num_tokens: int, alignment: int = 16) -> Tuple[Tensor, Tensor]:
    """``(padded_starts, padded_ends)`` of the layout :func:`pad_token_groups` builds for
    ``num_tokens`` tokens grouped by ``offs``: each group's size rounded up to
    ``alignment``, cumulated. One small kernel, no sync."""
    check_padded_group_offsets(offs, num_tokens, alignment)
    return _ops.padded_group_offsets(offs, num_tokens, alignment)


@torch.library.register_fake("moe_fp8::padded_group_offsets")
def _(offs, num_tokens, alignment):
    check_padded_group_offsets(offs, num_tokens, alignment)
    return offs.new_empty(offs.shape), offs.new_empty(offs.shape)


def check_permute_indices(counts, experts_per_rank, num_ranks, alignment, max_len, op="permute_indices"):
    check_index(op, "tokens_per_expert_group", counts)
    check_int(op, "experts_per_rank", experts_per_rank, lo=1)
    check_int(op, "num_ranks", num_ranks, lo=1)
    groups = experts_per_rank * num_ranks
    if groups > 2**20:
        raise RuntimeError(f"{op}: expected num_ranks * experts_per_rank <= 2^20, got {groups}")
    check_alignment(op, alignment)
    check_int(op, "max_len", max_len, hi=INT32_MAX)
    _require(
        counts.shape[0] == groups,
        lambda: f"{op}: expected tokens_per_expert_group of shape ({groups},) = num_ranks * experts_per_rank, "
        f"got ({counts.shape[0]},)",
    )


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
    slot; a ``max_len`` too small for the padded slots is an error on the CPU and with
    ``MOE_FP8_DEBUG=1`` (on a GPU otherwise, slots past ``max_len`` are dropped)."""
    check_permute_indices(tokens_per_expert_group, experts_per_rank, num_ranks, alignment, max_len)
    return _ops.permute_indices(tokens_per_expert_group, experts_per_rank, num_ranks, alignment, max_len)


@torch.library.register_fake("moe_fp8::permute_indices")
def _(counts, experts_per_rank, num_ranks, alignment, max_len):
    check_permute_indices(counts, experts_per_rank, num_ranks, alignment, max_len)
    return counts.new_empty((max_len,)), counts.new_empty((experts_per_rank,)), counts.new_empty((experts_per_rank,))


def check_zero_rows_past_groups_(x, offs, op="zero_rows_past_groups_"):
    check_tensor(op, "x", x, dim=2)
    check_index(op, "offs", offs)
    check_same_device(op, "x", x, offs=offs)
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise RuntimeError(f"{op}: expected x with a unit stride along dim 1, got strides {x.stride()}")
    # at::has_internal_overlap's "Yes" (a dim of size > 1 with stride 0: an expanded
    # view); the cases it calls too hard to tell are let through, as torch's in-place
    # ops do. Written out so that dynamo traces it.
    if any(s == 0 and n > 1 for n, s in zip(x.shape, x.stride())):
        raise RuntimeError(
            f"{op}: expected x without internal overlap (each element its own memory, as torch's in-place ops "
            f"require), got sizes {tuple(x.shape)} and strides {x.stride()}"
        )
    if torch.is_grad_enabled() and x.requires_grad and x.is_leaf:
        raise RuntimeError(
            f"{op}: expected x that is not a leaf requiring grad (an in-place write would bypass autograd), got a "
            "leaf with requires_grad=True"
        )


def zero_rows_past_groups_(x: Tensor, offs: Tensor) -> Tensor:
    """In place: rows of ``x`` (M, D) at or past ``offs[-1]`` (no group holds them)
    become zeros; only those rows are touched. Returns ``x``. Like torch's in-place
    ops, refuses an ``x`` whose elements share memory (an expanded view) and a leaf
    that requires grad."""
    check_zero_rows_past_groups_(x, offs)
    _ops.zero_rows_past_groups_(x, offs)
    return x


@torch.library.register_fake("moe_fp8::zero_rows_past_groups_")
def _(x, offs):
    check_zero_rows_past_groups_(x, offs)
    return None


def check_gather_rows(x, indices, op="gather_rows"):
    check_tensor(op, "x", x, dim=2)
    check_index(op, "indices", indices)
    check_same_device(op, "x", x, indices=indices)


def gather_rows(x: Tensor, indices: Tensor) -> Tensor:
    """``y[j] = x[indices[j]]``, a zero row where ``indices[j] == -1``. Any dtype."""
    check_gather_rows(x, indices)
    return _ops.gather_rows(x, indices)


@torch.library.register_fake("moe_fp8::gather_rows")
def _(x, indices):
    check_gather_rows(x, indices)
    return x.new_empty((indices.shape[0], x.shape[1]))


def check_scatter_rows(y, indices, num_rows, op="scatter_rows"):
    check_tensor(op, "y", y, dim=2)
    check_index(op, "indices", indices)
    check_same_device(op, "y", y, indices=indices)
    check_int(op, "num_rows", num_rows, hi=INT32_MAX)
    check_int(op, "the rows of y", y.shape[0], hi=INT32_MAX)  # (slots of the inverse map are int32)
    _require(
        indices.shape[0] == y.shape[0],
        lambda: f"{op}: expected indices of shape ({y.shape[0]},) (a row of y each), got {tuple(indices.shape)}",
    )
    check_rows_alloc(op, "the output", num_rows, y)


def scatter_rows(y: Tensor, indices: Tensor, num_rows: int) -> Tensor:
    """The inverse of :func:`gather_rows`: ``x[indices[j]] = y[j]`` for every
    ``indices[j] != -1`` (each row at most once), zero rows elsewhere; x has
    ``num_rows`` rows. Any dtype."""
    check_scatter_rows(y, indices, num_rows)
    return _ops.scatter_rows(y, indices, num_rows)


@torch.library.register_fake("moe_fp8::scatter_rows")
def _(y, indices, num_rows):
    check_scatter_rows(y, indices, num_rows)
    return y.new_empty((num_rows, y.shape[1]))


def check_dequantize_rows(q, scale, block, out_dtype, op="dequantize_rows"):
    check_tensor(op, "q", q, dim=2)
    check_tensor(op, "scale", scale, dim=2, dtype=torch.float32)
    check_same_device(op, "q", q, scale=scale)
    _require(q.dtype in FP8_DTYPES, lambda: f"{op}: expected q of dtype float8_e4m3fn, float8_e4m3fnuz or "
             f"float8_e5m2, got {_dtype_name(q.dtype)}")
    check_int(op, "block", block, lo=1)
    _require(out_dtype in QUANT_IN_DTYPES,
             lambda: f"{op}: expected out_dtype bfloat16, float16 or float32, got {_dtype_name(out_dtype)}")
    rows, cols = q.shape
    blocks = 0 if cols == 0 else (cols - 1) // block + 1
    _require(tuple(scale.shape) == (rows, blocks),
             lambda: f"{op}: expected scale of shape ({rows}, {blocks}) (a scale per row and block of {block} "
             f"columns), got {tuple(scale.shape)}")


def dequantize_rows(q: Tensor, scale: Tensor, block: int, out_dtype: torch.dtype) -> Tensor:
    """``y[r, c] = q[r, c] * scale[r, c // block]``: q (R, D) fp8, scale (R, ceil(D /
    block)) float32 (1x128 blocks: ``block=128``; one scale a row: ``block=D``); the
    fp32 product rounded once to ``out_dtype`` (bf16, fp16 or fp32), as
    ``(q.float() * scale).to(out_dtype)`` in one pass."""
    check_dequantize_rows(q, scale, block, out_dtype)
    return _ops.dequantize_rows(q, scale, block, out_dtype)


@torch.library.register_fake("moe_fp8::dequantize_rows")
def _(q, scale, block, out_dtype):
    check_dequantize_rows(q, scale, block, out_dtype)
    return q.new_empty(q.shape, dtype=out_dtype)


def check_sum_rows(x, indices, offs, op="sum_rows"):
    check_tensor(op, "x", x, dim=2)
    _require(x.dtype in QUANT_IN_DTYPES,
             lambda: f"{op}: expected x of dtype bfloat16, float16 or float32, got {_dtype_name(x.dtype)}")
    check_index(op, "indices", indices)
    check_index(op, "offs", offs)
    check_same_device(op, "x", x, indices=indices, offs=offs)
    check_rows_alloc(op, "the output", offs.shape[0], x)


def sum_rows(x: Tensor, indices: Tensor, offs: Tensor) -> Tensor:
    """``y[t] = x[indices[j]]`` summed over j in ``[offs[t-1], offs[t])`` (``offs[-1]``
    = 0; ``indices[j] == -1`` adds nothing), added in order of j to +0, each partial sum
    rounded to x's dtype (bf16, fp16 or fp32). With each token's rows listed in ascending
    order, that is autograd's backward of the gather ``x[token]`` (index_put with
    accumulate; on CUDA for rows of more than 64 elements, where torch also rounds each
    sum), in one pass, without a sort of the gradient rows."""
    check_sum_rows(x, indices, offs)
    return _ops.sum_rows(x, indices, offs)


@torch.library.register_fake("moe_fp8::sum_rows")
def _(x, indices, offs):
    check_sum_rows(x, indices, offs)
    return x.new_empty((offs.shape[0], x.shape[1]))


def _check_scores(op, scores, x):
    check_tensor(op, "scores", scores, dim=1)
    _require(scores.dtype == torch.float32,
             lambda: f"{op}: expected scores of dtype float32, got {_dtype_name(scores.dtype)}")
    _require(scores.shape[0] == x.shape[0],
             lambda: f"{op}: expected scores of {x.shape[0]} elements (one a row of x), got {scores.shape[0]}")
    check_same_device(op, "x", x, scores=scores)


def check_combine_rows(x, scores, indices, offs, op="combine_rows"):
    check_sum_rows(x, indices, offs, op)
    _check_scores(op, scores, x)


def combine_rows(x: Tensor, scores: Tensor, indices: Tensor, offs: Tensor) -> Tensor:
    """:func:`sum_rows` of the rows ``x[i] * scores[i]`` (fp32 ``scores``, one a row of
    x; each fp32 product rounded to x's dtype): torchtitan's combine (an fp32 multiply,
    a cast, then CUDA's deterministic ``scatter_add``, which is index_put with
    accumulate: the same bits for rows of more than 64 elements) in one pass."""
    check_combine_rows(x, scores, indices, offs)
    return _ops.combine_rows(x, scores, indices, offs)


@torch.library.register_fake("moe_fp8::combine_rows")
def _(x, scores, indices, offs):
    check_combine_rows(x, scores, indices, offs)
    return x.new_empty((offs.shape[0], x.shape[1]))


def check_combine_rows_backward(grad, x, scores, token, op="combine_rows_backward"):
    check_tensor(op, "grad", grad, dim=2)
    check_tensor(op, "x", x, dim=2)
    _require(x.dtype in QUANT_IN_DTYPES,
             lambda: f"{op}: expected x of dtype bfloat16, float16 or float32, got {_dtype_name(x.dtype)}")
    _require(grad.dtype == x.dtype and grad.shape[1] == x.shape[1],
             lambda: f"{op}: expected grad of x's dtype and columns ({_dtype_name(x.dtype)}, {x.shape[1]}), got "
                     f"{_dtype_name(grad.dtype)} with {grad.shape[1]} columns")
    _check_scores(op, scores, x)
    check_index(op, "token", token)
    _require(token.shape[0] == x.shape[0],
             lambda: f"{op}: expected token of {x.shape[0]} elements (one a row of x), got {token.shape[0]}")
    check_same_device(op, "x", x, grad=grad, token=token)


def combine_rows_backward(grad: Tensor, x: Tensor, scores: Tensor, token: Tensor) -> Tuple[Tensor, Tensor]:
    """The gradients of :func:`combine_rows` for x's row i of token ``token[i]`` (-1:
    none): ``grad[token[i]] * scores[i]`` (fp32, rounded to x's dtype: autograd's bits
    for torchtitan's combine) and the fp32 dot of ``grad[token[i]]`` and ``x[i]`` (in
    a fixed order, DESIGN §8); zeros for a row of no token."""
    check_combine_rows_backward(grad, x, scores, token)
    return _ops.combine_rows_backward(grad, x, scores, token)


@torch.library.register_fake("moe_fp8::combine_rows_backward")
def _(grad, x, scores, token):
    check_combine_rows_backward(grad, x, scores, token)
    return x.new_empty(x.shape), scores.new_empty((x.shape[0],))
