"""The experts layer's SwiGLU and its gradient (DESIGN §10), each optionally fused with the rowwise
fp8 of its result."""

from ..swiglu import (swiglu, swiglu_backward, swiglu_backward_quantize_rowwise,
                      swiglu_backward_with_h_quantize_rowwise, swiglu_quantize_rowwise)

__all__ = [
    "swiglu",
    "swiglu_backward",
    "swiglu_backward_quantize_rowwise",
    "swiglu_backward_with_h_quantize_rowwise",
    "swiglu_quantize_rowwise",
]
