"""moe_fp8_ext: FP8 Mixture-of-Experts training kernels for PyTorch.

Importing the package loads the compiled extension, which registers the ops under
``torch.ops.moe_fp8``; the functions here are thin, documented wrappers.
"""

import importlib.util
import os

import torch

if importlib.util.find_spec(__name__ + "._C") is None:
    raise ImportError(
        f"moe_fp8_ext: the compiled extension moe_fp8_ext._C is missing from {os.path.dirname(__file__)}: "
        "build it with `pip install --no-build-isolation .` from the repository root "
        "(or `python setup.py build_ext --inplace` for a build in place)"
    )
from . import _C  # noqa: F401,E402  (registers torch.ops.moe_fp8.*)
from . import blockwise_gemm  # noqa: F401,E402  (the GEMMs' fakes, for torch.compile)
from . import rowwise_gemm  # noqa: F401,E402
from .blockwise import (
    quantize_blockwise_act_dual,
    quantize_blockwise_act_lhs,
    quantize_blockwise_act_rhs,
    quantize_blockwise_act_transposed_lhs,
    quantize_blockwise_weight_dual,
    quantize_blockwise_weight_dual_cat,
    quantize_blockwise_weight_rhs,
    quantize_blockwise_weight_rhs_cat,
    quantize_blockwise_weight_transposed_rhs,
    quantize_blockwise_weight_transposed_rhs_cat,
)
from .experts import GroupedExperts, WeightCache, clear_weight_caches, experts
from .grouped_mm import grouped_mm, grouped_mm_backend
from .mxfp8 import (
    from_blocked_scales,
    from_blocked_scales_k_groups,
    from_blocked_scales_m_groups,
    quantize_mxfp8_colwise,
    quantize_mxfp8_experts,
    quantize_mxfp8_rowwise,
    to_blocked_scales,
    to_blocked_scales_k_groups,
    to_blocked_scales_m_groups,
)
from .ops import (
    gather_rows,
    padded_group_offsets,
    padded_rows,
    permute_indices,
    quantize_experts_bwd,
    quantize_experts_bwd_cat,
    quantize_experts_dual_cat,
    quantize_experts_fwd,
    quantize_experts_fwd_cat,
    quantize_jagged_colwise,
    quantize_jagged_colwise_dual,
    quantize_rowwise_jagged_dual,
    quantize_rowwise,
    scatter_rows,
    zero_rows_past_groups_,
)
from .platform import build_info, default_fp8_dtype
from .swiglu import (
    swiglu,
    swiglu_backward,
    swiglu_backward_quantize_rowwise,
    swiglu_backward_with_h_quantize_rowwise,
    swiglu_quantize_rowwise,
)
from .token_groups import pad_token_groups, permute_and_pad, unpad_token_groups, unpermute

__all__ = [
    "GroupedExperts",
    "WeightCache",
    "build_info",
    "clear_weight_caches",
    "default_fp8_dtype",
    "experts",
    "from_blocked_scales",
    "from_blocked_scales_k_groups",
    "from_blocked_scales_m_groups",
    "gather_rows",
    "grouped_mm",
    "grouped_mm_backend",
    "pad_token_groups",
    "padded_group_offsets",
    "padded_rows",
    "permute_and_pad",
    "permute_indices",
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
    "quantize_experts_bwd",
    "quantize_experts_bwd_cat",
    "quantize_experts_dual_cat",
    "quantize_experts_fwd",
    "quantize_experts_fwd_cat",
    "quantize_jagged_colwise",
    "quantize_jagged_colwise_dual",
    "quantize_rowwise_jagged_dual",
    "quantize_mxfp8_colwise",
    "quantize_mxfp8_experts",
    "quantize_mxfp8_rowwise",
    "quantize_rowwise",
    "scatter_rows",
    "swiglu",
    "swiglu_backward",
    "swiglu_backward_quantize_rowwise",
    "swiglu_backward_with_h_quantize_rowwise",
    "swiglu_quantize_rowwise",
    "to_blocked_scales",
    "to_blocked_scales_k_groups",
    "to_blocked_scales_m_groups",
    "unpad_token_groups",
    "unpermute",
    "zero_rows_past_groups_",
]
