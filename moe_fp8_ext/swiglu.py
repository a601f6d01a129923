"""SwiGLU of the experts layer (DESIGN §10), fused: ``h = silu(h1) * h3`` of
``h13 = [h1 | h3]`` (M, 2·hidden) and its gradient, each optionally fused with the FP8
rowwise quantization of its result, so the experts layer reads h13 once per direction
instead of running five to eight elementwise passes and a quantization pass.

The math is the bf16 module's, rounded where autograd would round (every intermediate
tensor to the input dtype): forward ``R(R(silu(h1)) * h3)``, backward
``[R(silu_backward(R(g * h3), h1)) | R(g * R(silu(h1))))]``, with ``exp`` computed by
additions and multiplications only (``reference.exp_f32``, within 2 ulp in fp32), so
the CPU twin, the CUDA kernel and ``reference.py`` agree to the bit. Against torch's
own ``silu`` bf16 and fp16 outputs differ by at most one ulp, and rarely; fp32 ones
by a few ulp (the ``exp``).
The quantized variants return exactly ``quantize_rowwise`` of the values they compute
(q row-major, scale (M, 1) fp32 decode scales). Inputs: bf16, fp16 or fp32; a
non-unit column stride is copied first. Each wrapper has its fake beside it, so the ops
trace under ``torch.compile(fullgraph=True)``.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from .ops import _dtype, _dtype_name, _require, check_fp8_dtype, check_quant_input

_ops = torch.ops.moe_fp8

__all__ = ["swiglu", "swiglu_backward", "swiglu_backward_quantize_rowwise", "swiglu_backward_with_h_quantize_rowwise",
           "swiglu_quantize_rowwise"]


# ---- argument checks shared by each wrapper and its fake (swiglu_ops.cpp's rules) -----


def check_h13(op: str, h13) -> None:
    check_quant_input(op, "h13", h13, 2)
    _require(h13.shape[1] % 2 == 0,
             lambda: f"{op}: expected h13 with an even number of columns [h1 | h3], got {h13.shape[1]}")
    _require(h13.shape[0] < 2**31, lambda: f"{op}: expected fewer than 2^31 rows, got {h13.shape[0]}")


def check_grad(op: str, grad_h, h13) -> None:
    check_quant_input(op, "grad_h", grad_h, 2)
    _require(grad_h.dtype == h13.dtype,
             lambda: f"{op}: expected grad_h of h13's dtype {_dtype_name(h13.dtype)}, got {_dtype_name(grad_h.dtype)}")
    _require(grad_h.device == h13.device,
             lambda: f"{op}: expected grad_h on {h13.device} (the device of h13), got {grad_h.device}")
    _require(grad_h.shape[0] == h13.shape[0] and 2 * grad_h.shape[1] == h13.shape[1],
             lambda: f"{op}: expected grad_h of shape ({h13.shape[0]}, {h13.shape[1] // 2}) for h13 of shape "
                     f"({h13.shape[0]}, {h13.shape[1]}), got ({grad_h.shape[0]}, {grad_h.shape[1]})")


def check_backward_quant(op: str, grad_h, h13, fp8_dtype) -> None:
    check_h13(op, h13)
    check_grad(op, grad_h, h13)
    check_fp8_dtype(op, fp8_dtype)


# ---- forward ---------------------------------------------------------------------------


def swiglu(h13: Tensor) -> Tensor:
    """``silu(h1) * h3`` of ``h13 = [h1 | h3]`` (M, 2·hidden): (M, hidden), h13's dtype."""
    check_h13("swiglu", h13)
    return _ops.swiglu(h13)


@torch.library.register_fake("moe_fp8::swiglu")
def _(h13):
    check_h13("swiglu", h13)
    return h13.new_empty((h13.shape[0], h13.shape[1] // 2))


def swiglu_quantize_rowwise(h13: Tensor, fp8_dtype: Optional[torch.dtype] = None,
                            pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    """``quantize_rowwise(swiglu(h13))`` in one read of h13, without writing h:
    q (M, hidden) row-major in ``fp8_dtype``, scale (M, 1) float32."""
    op = "swiglu_quantize_rowwise"
    check_h13(op, h13)
    check_fp8_dtype(op, fp8_dtype)
    return _ops.swiglu_quantize_rowwise(h13, _dtype(fp8_dtype, h13), pow2_scale)


@torch.library.register_fake("moe_fp8::swiglu_quantize_rowwise")
def _(h13, fp8_dtype, pow2_scale=True):
    op = "swiglu_quantize_rowwise"
    check_h13(op, h13)
    check_fp8_dtype(op, fp8_dtype)
    m, hidden = h13.shape[0], h13.shape[1] // 2
    return h13.new_empty((m, hidden), dtype=fp8_dtype), h13.new_empty((m, 1), dtype=torch.float32)


# ---- backward --------------------------------------------------------------------------


def swiglu_backward(grad_h: Tensor, h13: Tensor) -> Tensor:
    """The gradient of ``swiglu`` w.r.t. h13 for the incoming ``grad_h`` (M, hidden):
    ``grad_h13`` (M, 2·hidden) = [grad_h1 | grad_h3], h13's dtype."""
    check_h13("swiglu_backward", h13)
    check_grad("swiglu_backward", grad_h, h13)
    return _ops.swiglu_backward(grad_h, h13)


@torch.library.register_fake("moe_fp8::swiglu_backward")
def _(grad_h, h13):
    check_h13("swiglu_backward", h13)
    check_grad("swiglu_backward", grad_h, h13)
    return h13.new_empty(h13.shape)


def swiglu_backward_quantize_rowwise(grad_h: Tensor, h13: Tensor, fp8_dtype: Optional[torch.dtype] = None,
                                     pow2_scale: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``swiglu_backward`` and the rowwise fp8 of each half, in one pass:
    (grad_h13, q1, scale1, q3, scale3) with ``(q1, scale1) = quantize_rowwise(grad_h13[:, :hidden])``
    and ``(q3, scale3)`` the same of the second half, bit for bit."""
    check_backward_quant("swiglu_backward_quantize_rowwise", grad_h, h13, fp8_dtype)
    return _ops.swiglu_backward_quantize_rowwise(grad_h, h13, _dtype(fp8_dtype, h13), pow2_scale)


@torch.library.register_fake("moe_fp8::swiglu_backward_quantize_rowwise")
def _(grad_h, h13, fp8_dtype, pow2_scale=True):
    check_backward_quant("swiglu_backward_quantize_rowwise", grad_h, h13, fp8_dtype)
    m, hidden = h13.shape[0], h13.shape[1] // 2
    q = [h13.new_empty((m, hidden), dtype=fp8_dtype) for _ in range(2)]
    s = [h13.new_empty((m, 1), dtype=torch.float32) for _ in range(2)]
    return h13.new_empty(h13.shape), q[0], s[0], q[1], s[1]


def swiglu_backward_with_h_quantize_rowwise(grad_h: Tensor, h13: Tensor, fp8_dtype: Optional[torch.dtype] = None,
                                            pow2_scale: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``swiglu_backward``, the rowwise fp8 of grad_h13 as a whole and ``swiglu(h13)``
    from one read of h13: (grad_h13, q, scale, h) with ``(q, scale) =
    quantize_rowwise(grad_h13)`` (one scale per row over both halves: the left operand
    of ONE input-gradient GEMM against W1 and W3 together) and h bit for bit
    ``swiglu(h13)`` (the operand of W2's weight gradient, which the experts backward
    would otherwise recompute from h13)."""
    check_backward_quant("swiglu_backward_with_h_quantize_rowwise", grad_h, h13, fp8_dtype)
    return _ops.swiglu_backward_with_h_quantize_rowwise(grad_h, h13, _dtype(fp8_dtype, h13), pow2_scale)


@torch.library.register_fake("moe_fp8::swiglu_backward_with_h_quantize_rowwise")
def _(grad_h, h13, fp8_dtype, pow2_scale=True):
    check_backward_quant("swiglu_backward_with_h_quantize_rowwise", grad_h, h13, fp8_dtype)
    m, hidden = h13.shape[0], h13.shape[1] // 2
    return (h13.new_empty(h13.shape), h13.new_empty(h13.shape, dtype=fp8_dtype),
            h13.new_empty((m, 1), dtype=torch.float32), h13.new_empty((m, hidden)))
