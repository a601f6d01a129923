"""Token groups (DESIGN §8): sync-free padding of token groups to the alignment the
FP8 grouped GEMMs need, and the expert-parallel permutation, all differentiable.

    xp, starts, ends = pad_token_groups(x, offs, alignment=16)   # (R, D), R static
    y = unpad_token_groups(yp, offs, starts, x.shape[0])

    xe, ends, idx = permute_and_pad(x, counts, experts_per_rank, num_ranks)
    x_back = unpermute(ye, idx, x.shape[0])

No function here syncs with the host: every output size is a static bound
(``R = ceil((M + G·alignment)/alignment)·alignment`` padded rows), so they work under
``torch.compile(fullgraph=True)`` and in CUDA graphs. Each pad is the backward of its
unpad and the other way round; the permutation's backward is the inverse scatter.
Any dtype (bf16, fp16, fp32, fp8, ...): the kernels move bytes.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from .ops import (
    check_alignment,
    check_counts_where_cheap,
    check_index,
    check_int,
    check_pad_token_groups,
    check_same_device,
    check_scatter_rows,
    check_tensor,
    check_unpad_token_groups,
    padded_rows,
)

_ops = torch.ops.moe_fp8


class _Pad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offs, alignment):
        xp, starts, ends = _ops.pad_token_groups(x, offs, alignment)
        ctx.save_for_backward(offs, starts)
        ctx.num_tokens = x.shape[0]
        ctx.mark_non_differentiable(starts, ends)
        return xp, starts, ends

    @staticmethod
    def backward(ctx, grad_xp, _g_starts, _g_ends):
        offs, starts = ctx.saved_tensors
        return _ops.unpad_token_groups(grad_xp.contiguous(), offs, starts, ctx.num_tokens), None, None


class _Unpad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xp, offs, padded_starts, num_tokens):
        x = _ops.unpad_token_groups(xp, offs, padded_starts, num_tokens)
        ctx.save_for_backward(offs, padded_starts)
        ctx.padded_rows = xp.shape[0]
        return x

    @staticmethod
    def backward(ctx, grad_x):
        offs, starts = ctx.saved_tensors
        return _ops.pad_token_groups_at(grad_x.contiguous(), offs, starts, ctx.padded_rows), None, None, None


def pad_token_groups(x: Tensor, offs: Tensor, alignment: int = 16) -> Tuple[Tensor, Tensor, Tensor]:
    """Copy every token group of ``x`` (M, D) to a start that is a multiple of
    ``alignment`` (a power of two, 1..1024), zero-filling the padding rows.

    ``offs`` int32 (G,): cumulative group ends (DESIGN §3), empty groups allowed.
    Returns ``(x_padded, padded_starts, padded_ends)``: x_padded has the static
    :func:`padded_rows` rows (rows past ``padded_ends[-1]`` are zero too), each group's
    padded size is its size rounded up to ``alignment`` (an empty group stays empty),
    and ``padded_ends`` is the ``offs`` to give the grouped GEMM. Differentiable in x.
    """
    check_pad_token_groups(x, offs, alignment)
    return _Pad.apply(x, offs, alignment)


def unpad_token_groups(x_padded: Tensor, offs: Tensor, padded_starts: Tensor, num_tokens: int) -> Tensor:
    """The inverse of :func:`pad_token_groups`: the (num_tokens, D) rows of every group
    back from their padded places (rows past ``offs[-1]`` are zero). Differentiable."""
    check_unpad_token_groups(x_padded, offs, padded_starts, num_tokens)
    return _Unpad.apply(x_padded, offs, padded_starts, num_tokens)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices):
        ctx.save_for_backward(indices)
        ctx.num_rows = x.shape[0]
        return _ops.gather_rows(x, indices)

    @staticmethod
    def backward(ctx, grad_y):
        (indices,) = ctx.saved_tensors
        return _ops.scatter_rows(grad_y.contiguous(), indices, ctx.num_rows), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, indices, num_rows):
        ctx.save_for_backward(indices)
        return _ops.scatter_rows(y, indices, num_rows)

    @staticmethod
    def backward(ctx, grad_x):
        (indices,) = ctx.saved_tensors
        return _ops.gather_rows(grad_x.contiguous(), indices), None, None


def permute_and_pad(
    x: Tensor,
    tokens_per_expert_group: Tensor,
    experts_per_rank: int,
    num_ranks: int,
    alignment: int = 16,
    max_len: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Reorder tokens that arrived rank-major from an all-to-all (rank 0's tokens for
    local experts 0, 1, ..., then rank 1's, ...) into expert-major groups padded to
    ``alignment``, ready for :func:`moe_fp8_ext.grouped_mm`.

    ``tokens_per_expert_group`` int32 (num_ranks·experts_per_rank,), rank-major, must
    sum to at most ``x.shape[0]`` (checked on the CPU and with ``MOE_FP8_DEBUG=1``; on a
    GPU otherwise, slots past x's rows are zero rows). Returns ``(x_permuted, padded_ends, indices)``:
    x_permuted has ``max_len`` rows (default: the static bound ``M +
    experts_per_rank·alignment``, rounded up to ``alignment``), padding rows zero;
    ``padded_ends`` is the grouped GEMM's ``offs``; ``indices`` feed :func:`unpermute`.
    Every expert gets at least ``alignment`` rows. Differentiable in x.
    """
    op = "permute_and_pad"
    check_tensor(op, "x", x, dim=2)
    check_index(op, "tokens_per_expert_group", tokens_per_expert_group)
    check_same_device(op, "x", x, tokens_per_expert_group=tokens_per_expert_group)
    check_int(op, "experts_per_rank", experts_per_rank, lo=1)
    check_int(op, "num_ranks", num_ranks, lo=1)
    check_alignment(op, alignment)
    check_counts_where_cheap(op, "tokens_per_expert_group", tokens_per_expert_group, x.shape[0])
    if max_len is None:
        max_len = padded_rows(x.shape[0], experts_per_rank, alignment)
    indices, _sizes, ends = _ops.permute_indices(tokens_per_expert_group, experts_per_rank, num_ranks, alignment, max_len)
    return _Gather.apply(x, indices), ends, indices


def unpermute(y: Tensor, indices: Tensor, num_tokens: int) -> Tensor:
    """The inverse of :func:`permute_and_pad`: rows of ``y`` (expert-major, padded) back
    to the rank-major order, (num_tokens, D); padding rows are dropped. Differentiable."""
    check_scatter_rows(y, indices, num_tokens, op="unpermute")
    return _Scatter.apply(y, indices, num_tokens)


def router_counts(tokens: int, experts: int, seed: int = 0) -> Tensor:
    """Tokens per expert as a router with load balancing gives them: a multinomial over
    softly skewed expert probabilities, unaligned sizes summing to `tokens` (int64, CPU).
    The group sizes of the main job (``python -m moe_fp8_ext``) and the benchmarks."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(0.5 * torch.randn(experts, generator=g), 0)
    return torch.bincount(torch.multinomial(p, tokens, replacement=True, generator=g), minlength=experts)
