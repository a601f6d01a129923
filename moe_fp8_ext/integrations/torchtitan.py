"""One-line FP8 for torchtitan MoE models (torchtitan 0.3.0; the package is optional and
imported only here):

    from moe_fp8_ext.integrations.torchtitan import convert
    convert(model, recipe="fp8_rowwise")     # every GroupedExperts in the model

Each torchtitan ``GroupedExperts`` module is converted IN PLACE: its class becomes a
subclass whose ``forward`` runs :func:`moe_fp8_ext.experts` (one fused W1/W3 GEMM,
SwiGLU, W2, with the recipe's FP8 GEMMs). Everything else stays: the parameter objects
(``w1_EFD``, ``w2_EDF``, ``w3_EFD``), so state_dict keys, initialization
(``init_weights``), optimizer state and any sharding already applied. Token groups of
any size work, so torchtitan's dispatcher needs no padding swap.

Weights: torchtitan casts them to bf16 per call (``w.bfloat16()``); the converted
forward quantizes the parameters directly (fp32 or bf16, the kernels read both), so no
bf16 copy is made. DTensor parameters (expert parallelism) are used through ``to_local()``
as torchtitan does. ``reuse_weights`` (default **False**) keeps a
:class:`moe_fp8_ext.experts.WeightCache` per converted module: off by default because
torchtitan trains under FSDP2, whose all-gather rewrites the unsharded weights without
bumping their version counter, so a weight changed outside an optimizer step (a
checkpoint load) could be served stale. Turn it on without FSDP2, or with FSDP2 when the
weights change only through optimizer steps (every ``torch.optim`` step empties the
caches).
"""

from typing import Union

import torch

from ..experts import WeightCache, experts
from ..recipes import Recipe, get_recipe

_CONVERTED = {}


def _grouped_experts_classes():
    from torchtitan.models.common.moe import GroupedExperts

    return (GroupedExperts,)


def _local(p):
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _fp8_forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    w1, w2, w3 = _local(self.w1_EFD), _local(self.w2_EDF), _local(self.w3_EFD)
    out = experts(x_RD, w1, w3, w2, offs, recipe=self.moe_fp8_recipe, weight_cache=self.moe_fp8_weight_cache)
    return out.type_as(x_RD)


def _converted_class(cls):
    if cls not in _CONVERTED:
        _CONVERTED[cls] = type(f"Fp8{cls.__name__}", (cls,), {"forward": _fp8_forward, "_moe_fp8_base": cls})
    return _CONVERTED[cls]


def convert(model: torch.nn.Module, recipe: Union[str, Recipe] = "fp8_rowwise", *, reuse_weights: bool = False) -> int:
    """Convert every torchtitan ``GroupedExperts`` in ``model`` (the model itself
    included) to run :func:`moe_fp8_ext.experts` with ``recipe``; returns how many were
    converted. Converting again changes the recipe. Raises ImportError when torchtitan
    is not installed, ValueError for an unknown recipe."""
    r = get_recipe(recipe, "convert")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert: expected a torch.nn.Module, got {type(model).__name__}")
    classes = _grouped_experts_classes()
    n = 0
    for module in model.modules():
        if not isinstance(module, classes):
            continue
        base = getattr(type(module), "_moe_fp8_base", type(module))
        module.__class__ = _converted_class(base)
        module.moe_fp8_recipe = r
        module.moe_fp8_weight_cache = WeightCache() if reuse_weights else None
        n += 1
    return n


def unconvert(model: torch.nn.Module) -> int:
    """Undo :func:`convert`: the modules run torchtitan's own forward again."""
    n = 0
    for module in model.modules():
        base = getattr(type(module), "_moe_fp8_base", None)
        if base is not None:
            module.__class__ = base
            del module.moe_fp8_recipe, module.moe_fp8_weight_cache
            n += 1
    return n


def build_moe(dim: int, hidden: int, experts: int, top_k: int = 2, *, device="cpu", dtype=torch.bfloat16,
              seed: int = 0) -> torch.nn.Module:
    """A torchtitan 0.3.0 ``MoE`` layer (top-k router, LocalTokenDispatcher,
    GroupedExperts, shared experts) built from torchtitan's own configs, every weight
    drawn from N(0, 1/fan_in) with ``seed``: the unconverted layer that the tests and
    ``scripts/train_curve.py`` convert."""
    import torchtitan.models.common.moe as tt_moe
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    def lin(i, o):
        return Linear.Config(in_features=i, out_features=o, bias=False)

    cfg = tt_moe.MoE.Config(
        num_experts=experts,
        routed_experts=tt_moe.RoutedExperts.Config(
            inner_experts=tt_moe.GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=experts, top_k=top_k)),
        router=tt_moe.TokenChoiceTopKRouter.Config(num_experts=experts, gate=lin(dim, experts), top_k=top_k),
        shared_experts=FeedForward.Config(w1=lin(dim, hidden), w2=lin(hidden, dim), w3=lin(dim, hidden)),
    )
    moe = cfg.build()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return moe.to(device=device, dtype=dtype)
