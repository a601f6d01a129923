"""Training recipes for :func:`moe_fp8_ext.grouped_mm`: one :class:`Recipe` per way of
running the three grouped GEMMs of an MoE expert linear (DESIGN §5-§8).

    from moe_fp8_ext.recipes import RECIPES, Fp8Rowwise, get_recipe, register_recipe
    get_recipe("fp8_rowwise").alignment        # 16
    grouped_mm(A, B_t, offs, recipe=Fp8Rowwise(pow2_scale=False))
    register_recipe(MyRecipe(name="my_recipe", alignment=32))
    grouped_mm(A, B_t, offs, recipe="my_recipe")

A recipe is a frozen dataclass: a name, an alignment, and the user fields of its kind
(``Fp8Rowwise(pow2_scale, gemm_kernel, hold_weight_operands)``, ``Mxfp8(rounding)``,
``Fp8Blockwise(hold_weight_operands, dswiglu_in_gemm)``); ``dataclasses.replace`` makes a variant.
``grouped_mm`` and the experts layer know nothing about scales or formats: one
``quantize`` call per tensor asks the recipe for the orientations it needs, and the
recipe's GEMMs multiply them. Adding a recipe is a subclass of :class:`Recipe` with
``quantize``, ``quantize_weights``, ``mm_2d3d`` and ``mm_2d2d`` (the contract is in
:mod:`moe_fp8_ext.recipes.base`; the fused variants have defaults), registered by name;
nothing else changes.

Registered: ``"fp8_rowwise"`` (:class:`Fp8Rowwise`, DESIGN §5), ``"mxfp8"``
(:class:`Mxfp8`, DESIGN §7: e8m0 scales per 32 elements, the sm100 GEMM on capability
10.x, emulated elsewhere), ``"fp8_blockwise"`` (:class:`Fp8Blockwise`, DESIGN §6: 1x128 /
128x128 blocks, our CUTLASS grouped GEMM on sm90, emulated elsewhere) and ``"bf16"``
(:class:`Bf16`, ``torch._grouped_mm`` in the inputs' dtype, the baseline). One module
each: ``rowwise``, ``mxfp8``, ``blockwise``, ``bf16``.
"""

from .base import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    RECIPES,
    SAME_READ,
    Groups,
    Operand,
    Recipe,
    _zero_tail,
    emulated_grouped_mm_2d2d,
    emulated_grouped_mm_2d3d,
    get_recipe,
    joined_bwd,
    joined_fwd,
    register_recipe,
    row_groups,
)
from .bf16 import Bf16, _gemm_ready
from .blockwise import Fp8Blockwise, _expand_tiles
from .mxfp8 import (
    Mxfp8,
    _ceil_to,
    _expand_blocks,
    scaled_grouped_mm_mxfp8,
    unblock_scales,
    unblock_scales_experts,
    unblock_scales_k_groups,
    unblock_scales_m_groups,
)
from .rowwise import (
    _BACKENDS,
    Fp8Rowwise,
    has_scaled_grouped_mm,
    scaled_grouped_mm_rowwise,
)

__all__ = [
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "RECIPES",
    "SAME_READ",
    "Groups",
    "Bf16",
    "Fp8Blockwise",
    "Fp8Rowwise",
    "Mxfp8",
    "Operand",
    "Recipe",
    "emulated_grouped_mm_2d2d",
    "emulated_grouped_mm_2d3d",
    "get_recipe",
    "joined_bwd",
    "joined_fwd",
    "has_scaled_grouped_mm",
    "register_recipe",
    "row_groups",
    "scaled_grouped_mm_mxfp8",
    "scaled_grouped_mm_rowwise",
    "unblock_scales",
    "unblock_scales_experts",
    "unblock_scales_k_groups",
    "unblock_scales_m_groups",
]
_PRIVATE = (_BACKENDS, _ceil_to, _expand_blocks, _expand_tiles, _gemm_ready, _zero_tail)  # (re-exported for tests)

register_recipe(Fp8Rowwise())
register_recipe(Bf16())
register_recipe(Mxfp8())
register_recipe(Fp8Blockwise())
