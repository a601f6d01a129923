"""The bf16 recipe: ``torch._grouped_mm`` for each product, the high-precision baseline."""

import dataclasses

import torch
from torch import Tensor

from .. import ops
from .base import (
    Recipe,
    _zero_tail,
    check_fields,
    gemm_on_column_views,
    joined_bwd,
    joined_fwd,
)

_ops = torch.ops.moe_fp8

def _major(x: Tensor, dim: int) -> bool:
    """Whether x's last two dims are laid out with ``dim`` (-1: row-major, -2: column-major)
    contiguous and the other dim's stride a 16-byte multiple (torch._grouped_mm's rule)."""
    other = -3 - dim
    s = x.stride()
    return s[dim] == 1 and s[other] >= max(1, x.shape[dim]) and s[other] % (16 // x.element_size()) == 0


def _gemm_ready(x: Tensor) -> Tensor:
    """A weight x itself when torch._grouped_mm takes its layout (row- or column-major),
    else a row-major copy. Expanded views (a stride of 0, e.g. the gradient of
    ``out.sum()``) are what torch's own _grouped_mm backward trips on."""
    return x if _major(x, -1) or _major(x, -2) else x.contiguous()


def _token_strided(x: Tensor) -> Tensor:
    """x (M, N), an activation, row-major: its token groups run along the strided dim and
    need no alignment (torch._grouped_mm's CUDA kernel asserts 16-byte group sizes along
    a contiguous one)."""
    return x if _major(x, -1) else x.contiguous()


@dataclasses.dataclass(frozen=True)
class Bf16(Recipe):
    """The high-precision baseline: ``torch._grouped_mm`` for each of the three products,
    in the inputs' dtype (bf16, or fp16/fp32 where torch has those: the CPU). Our own
    backward (torch's stumbles on expanded gradients such as that of ``out.sum()``).
    ``out_dtype`` must be A's dtype (torch._grouped_mm writes nothing else); there is
    no ``fp8_dtype``. Groups of any size: the weight gradient contracts over the token
    dim with it as the outer (strided) dim, so group starts need no alignment.
    """

    name: str = "bf16"
    alignment: int = 1
    precision = "bf16"  # (a class attribute: Recipe.precision)

    def __post_init__(self):
        check_fields(self)

    def backend(self, device):
        return "grouped_mm"

    def out_dtypes(self, backend, in_dtype):
        return (in_dtype,)

    def default_out_dtype(self, in_dtype):
        return in_dtype

    def check_inputs(self, A, B_t):
        if A.dtype != B_t.dtype:
            raise ValueError(f"grouped_mm: expected A and B_t of one dtype for recipe 'bf16' (torch._grouped_mm), "
                             f"got {A.dtype} and {B_t.dtype}")
        per_16_bytes = 16 // A.element_size()
        k, n = B_t.shape[1], B_t.shape[2]
        if k % per_16_bytes or n % per_16_bytes:
            raise ValueError(f"grouped_mm: expected K and N to be multiples of {per_16_bytes} for recipe 'bf16' with "
                             f"{A.dtype} (torch._grouped_mm needs 16-byte aligned rows), got K={k}, N={n}")

    def quantize(self, x, fp8_dtype, groups=None, *, rowwise=True, colwise=False):
        col, x = None, _token_strided(x)
        if colwise is True:
            col = x
            offs, starts = groups
            if starts is not None:  # only if a subclass sets an alignment
                rows = ops.padded_rows(x.shape[0], offs.shape[0], self.alignment)
                col = _ops.pad_token_groups_at(col.contiguous(), offs, starts, rows)
        return (x if rowwise else None), col

    def quantize_weights(self, b_ts, fp8_dtype, *, fwd=True, bwd=False):
        f = _gemm_ready(joined_fwd(b_ts)) if fwd else None
        b = _gemm_ready(joined_bwd(b_ts).transpose(-2, -1)) if bwd is True else None
        return f, b

    def mm_2d3d(self, lhs, rhs, offs, out_dtype, backend):
        return _zero_tail(torch._grouped_mm(lhs, rhs, offs=offs), offs)

    mm_2d2d_parts = gemm_on_column_views  # (per-column scales: a GEMM on each part's view)

    def mm_2d2d(self, grad, a, offs, out_dtype, backend):
        return torch._grouped_mm(grad.t(), a, offs=offs)
