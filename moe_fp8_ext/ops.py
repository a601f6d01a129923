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


def quantize_jagged_colwise(x: Tensor, offs: Tensor, fp8_dtype: Optional[torch.dtype] = None, pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    """Quantize each column of ``x`` (M, D) separately within every token group.

    ``offs`` is int32 (G,), the cumulative end row of each group (DESIGN §3); empty
    groups are fine. Returns ``q`` (M, D) column-major (strides (1, M)) and ``scale``
    (G, D) float32. Rows past ``offs[-1]`` get q = 0. Invalid ``offs`` raises on CPU
    (and on GPU with ``MOE_FP8_DEBUG=1``); on GPU it is clamped, never out of bounds.
    """
    return _ops.quantize_jagged_colwise(x, offs, _dtype(fp8_dtype, x), pow2_scale)


def _jagged_fake(x, offs, fp8_dtype, op):
    torch._check(x.dim() == 2, lambda: f"{op}: expected x to be a 2-D tensor, got {x.dim()}-D")
    torch._check(offs.dim() == 1, lambda: f"{op}: expected offs to be a 1-D tensor, got {offs.dim()}-D")
    m, d = x.shape
    q = x.new_empty_strided((m, d), (1, m), dtype=fp8_dtype)
    return q, x.new_empty((offs.shape[0], d), dtype=torch.float32)


@torch.library.register_fake("moe_fp8::quantize_jagged_colwise")
def _(x, offs, fp8_dtype, pow2_scale=True):
    return _jagged_fake(x, offs, fp8_dtype, "quantize_jagged_colwise")


def quantize_jagged_colwise_dual(
    x1: Tensor, x2: Tensor, offs: Tensor, fp8_dtype: Optional[torch.dtype] = None, pow2_scale: bool = True
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`quantize_jagged_colwise` of ``x1`` (M, D1) and ``x2`` (M, D2) (one dtype,
    one ``offs``) in a single launch: both operands of the weight-gradient GEMM
    ``grad_B[g] = grad_out[g]^T @ A[g]``. Returns ``(q1, scale1, q2, scale2)``."""
    return _ops.quantize_jagged_colwise_dual(x1, x2, offs, _dtype(fp8_dtype, x1), pow2_scale)


@torch.library.register_fake("moe_fp8::quantize_jagged_colwise_dual")
def _(x1, x2, offs, fp8_dtype, pow2_scale=True):
    q1, s1 = _jagged_fake(x1, offs, fp8_dtype, "quantize_jagged_colwise_dual")
    q2, s2 = _jagged_fake(x2, offs, fp8_dtype, "quantize_jagged_colwise_dual")
    return q1, s1, q2, s2
