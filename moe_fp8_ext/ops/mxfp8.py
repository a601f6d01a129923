"""MXFP8 quantization (DESIGN §7): e8m0 scales per 32 elements, plain or in the blocked layout
the sm100 GEMM reads, and the scale swizzles."""

from ..mxfp8 import (from_blocked_scales, from_blocked_scales_k_groups, from_blocked_scales_m_groups,
                     quantize_mxfp8_colwise, quantize_mxfp8_experts, quantize_mxfp8_rowwise, to_blocked_scales,
                     to_blocked_scales_k_groups, to_blocked_scales_m_groups)

__all__ = [
    "from_blocked_scales",
    "from_blocked_scales_k_groups",
    "from_blocked_scales_m_groups",
    "quantize_mxfp8_colwise",
    "quantize_mxfp8_experts",
    "quantize_mxfp8_rowwise",
    "to_blocked_scales",
    "to_blocked_scales_k_groups",
    "to_blocked_scales_m_groups",
]
