"""FP8 rowwise quantization (DESIGN §5): rows, expert weights in both orientations (one read where
the L2 budget allows), per-token-group columns."""

from . import (dual_cat_reads_once, quantize_experts_bwd, quantize_experts_bwd_cat, quantize_experts_dual_cat,
                quantize_experts_fwd, quantize_experts_fwd_cat, quantize_jagged_colwise, quantize_jagged_colwise_dual,
                quantize_rowwise, quantize_rowwise_jagged_dual)

__all__ = [
    "dual_cat_reads_once",
    "quantize_experts_bwd",
    "quantize_experts_bwd_cat",
    "quantize_experts_dual_cat",
    "quantize_experts_fwd",
    "quantize_experts_fwd_cat",
    "quantize_jagged_colwise",
    "quantize_jagged_colwise_dual",
    "quantize_rowwise",
    "quantize_rowwise_jagged_dual",
]
