"""FP8 blockwise quantization (DESIGN §6): 1x128 / 128x1 activation blocks, 128x128 weight tiles,
both orientations of a tile (or an activation's two operands) from one read."""

from ..blockwise import (act_dual_reads_once, quantize_blockwise_act_dual, quantize_blockwise_act_lhs,
                         quantize_blockwise_act_rhs, quantize_blockwise_act_transposed_lhs, quantize_blockwise_weight_dual,
                         quantize_blockwise_weight_dual_cat, quantize_blockwise_weight_rhs, quantize_blockwise_weight_rhs_cat,
                         quantize_blockwise_weight_transposed_rhs, quantize_blockwise_weight_transposed_rhs_cat)

__all__ = [
    "act_dual_reads_once",
    "quantize_blockwise_act_dual",
    "quantize_blockwise_act_lhs",
    "quantize_blockwise_act_rhs",
    "quantize_blockwise_act_transposed_lhs",
    "quantize_blockwise_weight_dual",
    "quantize_blockwise_weight_dual_cat",
    "quantize_blockwise_weight_rhs",
    "quantize_blockwise_weight_rhs_cat",
    "quantize_blockwise_weight_transposed_rhs",
    "quantize_blockwise_weight_transposed_rhs_cat",
]
