"""moe_fp8_ext: FP8 Mixture-of-Experts training kernels for PyTorch.

Importing the package loads the compiled extension, which registers the ops under
``torch.ops.moe_fp8``. The public names are in ``__all__``: the experts layer and the
grouped GEMM, the token-group helpers, the recipes and build information. The raw ops,
documented one family a module, are in ``moe_fp8_ext.ops.<family>``.
"""

import importlib.util
import os

import torch  # noqa: F401  (loads libtorch before the extension)

if importlib.util.find_spec(__name__ + "._C") is None:
    raise ImportError(
        f"moe_fp8_ext: the compiled extension moe_fp8_ext._C is missing from {os.path.dirname(__file__)}: "
        "build it with `pip install --no-build-isolation .` from the repository root "
        "(or `python setup.py build_ext --inplace` for a build in place)"
    )
from . import _C  # noqa: F401,E402  (registers torch.ops.moe_fp8.*)
from . import blockwise_gemm  # noqa: F401,E402  (the GEMMs' fakes, for torch.compile)
from . import rowwise_gemm  # noqa: F401,E402
from .experts import GroupedExperts, experts  # noqa: E402
from .grouped_mm import grouped_mm, grouped_mm_backend  # noqa: E402
from .platform import build_info, default_fp8_dtype  # noqa: E402
from .recipes import Bf16, Fp8Blockwise, Fp8Rowwise, Mxfp8, Recipe, get_recipe  # noqa: E402
from .token_groups import pad_token_groups, permute_and_pad, unpad_token_groups, unpermute  # noqa: E402
from .weight_cache import WeightCache, clear_weight_caches  # noqa: E402
from .ops import blockwise as _ops_blockwise, mxfp8 as _ops_mxfp8, rowwise as _ops_rowwise  # noqa: E402,F401
from .ops import swiglu as _ops_swiglu, token_groups as _ops_token_groups  # noqa: E402,F401  (ops.<family>)

# The raw ops live in moe_fp8_ext.ops.<family>; the top-level names are aliases of
# them, outside the public surface (__all__).
from .ops.blockwise import *  # noqa: E402,F401,F403
from .ops.mxfp8 import *  # noqa: E402,F401,F403
from .ops.rowwise import *  # noqa: E402,F401,F403
from .ops.swiglu import *  # noqa: E402,F401,F403
from .ops.token_groups import *  # noqa: E402,F401,F403

__all__ = [
    "Bf16",
    "Fp8Blockwise",
    "Fp8Rowwise",
    "GroupedExperts",
    "Mxfp8",
    "Recipe",
    "WeightCache",
    "build_info",
    "clear_weight_caches",
    "default_fp8_dtype",
    "experts",
    "get_recipe",
    "grouped_mm",
    "grouped_mm_backend",
    "pad_token_groups",
    "permute_and_pad",
    "unpad_token_groups",
    "unpermute",
]
