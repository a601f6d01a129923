"""Token-group building blocks (DESIGN §8): the padded layout's offsets and size, the expert-parallel
permutation, row gather and scatter. The differentiable helpers are top-level names."""

from . import gather_rows, padded_group_offsets, padded_rows, permute_indices, scatter_rows, zero_rows_past_groups_

__all__ = [
    "gather_rows",
    "padded_group_offsets",
    "padded_rows",
    "permute_indices",
    "scatter_rows",
    "zero_rows_past_groups_",
]
