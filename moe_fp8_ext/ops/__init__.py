"""The raw ops, one namespace a family: ``moe_fp8_ext.ops.rowwise``, ``.blockwise``,
``.mxfp8``, ``.swiglu``, ``.token_groups`` (the ``torch.ops.moe_fp8.*`` schemas are in
csrc/bindings.cpp). Each wrapper has its fake (meta) implementation right beside it, so
the ops trace under ``torch.compile``; the argument checks the wrappers and the fakes
share are in ``_checks``. Importing this package registers the fakes of the rowwise and
token-group ops (the other families register theirs in ``moe_fp8_ext.blockwise``,
``.mxfp8`` and ``.swiglu``).

All scales are *decode* scales: ``x ≈ q.float() * scale``. The rowwise ops' scales are
exact powers of two with ``pow2_scale`` (the default); blockwise scales are fp32, MXFP8's
e8m0. ``fp8_dtype=None`` picks
:func:`moe_fp8_ext.default_fp8_dtype`.
"""

from ._checks import (  # noqa: F401
    FP8_DTYPES,
    INT32_MAX,
    INT64_MAX,
    MAX_JAGGED_GROUPS,
    QUANT_IN_DTYPES,
    _check_padded_starts,
    _dtype,
    _dtype_name,
    _require,
    check_alignment,
    check_as_bf16,
    check_block_jagged,
    check_counts_where_cheap,
    check_fp8_dtype,
    check_index,
    check_int,
    check_jagged_layout,
    check_quant_input,
    check_rows_alloc,
    check_same_device,
    check_tensor,
    checked_padded_rows,
    content_checked,
    debug_checks,
    padded_rows,
)
from .rowwise import (  # noqa: F401
    MAX_EXPERTS_COLS,
    check_quantize_experts,
    check_quantize_experts_cat,
    check_quantize_jagged_colwise,
    check_quantize_jagged_colwise_dual,
    check_quantize_rowwise,
    check_quantize_rowwise_jagged_dual,
    dual_cat_reads_once,
    quantize_experts_bwd,
    quantize_experts_bwd_cat,
    quantize_experts_dual_cat,
    quantize_experts_fwd,
    quantize_experts_fwd_cat,
    quantize_jagged_colwise,
    quantize_jagged_colwise_dual,
    quantize_rowwise,
    quantize_rowwise_jagged_dual,
)
from .token_groups import (  # noqa: F401
    check_dequantize_rows,
    check_gather_rows,
    check_pad_token_groups,
    check_pad_token_groups_at,
    check_padded_group_offsets,
    check_permute_indices,
    check_scatter_rows,
    check_unpad_token_groups,
    check_zero_rows_past_groups_,
    dequantize_rows,
    gather_rows,
    padded_group_offsets,
    permute_indices,
    scatter_rows,
    zero_rows_past_groups_,
)
