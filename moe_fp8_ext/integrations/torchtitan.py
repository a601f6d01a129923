"""FP8 experts for torchtitan 0.3.0 models. Either list the converter in the model's
``converters`` (the config tree is converted before the model is built, as torchtitan's
own Float8/MXFP8 ``GroupedExperts`` converters do)::

    from moe_fp8_ext.integrations.torchtitan import ExpertsConverter
    converters=[ExpertsConverter.Config(recipe="fp8_blockwise")]

or convert a built model, before or after torchtitan parallelized it::

    from moe_fp8_ext.integrations.torchtitan import convert
    convert(model, recipe="fp8_blockwise")

Every ``GroupedExperts`` becomes a subclass whose ``forward`` runs
:func:`moe_fp8_ext.experts` (W1 and W3 as one GEMM, fused SwiGLU, W2). Parameters,
state_dict keys, initialization, optimizer state and sharding stay as they are, and
token groups of any size work, so no padding is added. A module this cannot convert is
an error, never a module left in bf16. The MoE layer's token dispatcher, torchtitan's
all-to-all or local one, becomes :class:`OnePassTokenDispatcher`: the same rows, with
its gather's backward and its combine in one pass each (torchtitan's bits on CUDA; a
gain that is not FP8's). ``torchtitan_dispatcher=True`` keeps torchtitan's.

``shared_experts=True`` converts each MoE layer's shared experts (torchtitan's SwiGLU
``FeedForward``) too: they run as one expert that every token goes to, with the same
recipe. They are not tensor-parallel here, and FSDP2 gathers them in bf16.

FP8 communication (fp8_blockwise and fp8_rowwise): ``fp8_all_gather`` makes FSDP2
all-gather the expert weights as fp8 (:mod:`moe_fp8_ext.fsdp`; convert before
``fully_shard``), ``fp8_dispatch`` makes the dispatcher
:class:`Fp8AllToAllTokenDispatcher`, which quantizes each token once and sends (or,
without expert parallelism, gathers) the routed rows as fp8 (:mod:`moe_fp8_ext.dispatch`).
"""

from dataclasses import dataclass, field, fields
from typing import List, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts
from torchtitan.models.common.token_dispatcher import (
    AllToAllDispatchMetadata,
    AllToAllTokenDispatcher,
    LocalDispatchMetadata,
    LocalTokenDispatcher,
)

from .. import fsdp as _fsdp
from ..dispatch import _check_recipe, combine, fp8_dispatch, gather
from ..experts import _check, experts, offsets_from_counts
from ..recipes import Recipe, get_recipe
from ..weight_cache import WeightCache, share_versions_in_state_dict, weight_keys

__all__ = ["ExpertsConverter", "Fp8AllToAllTokenDispatcher", "OnePassTokenDispatcher", "build_moe", "convert",
           "unconvert"]

_NAMES = ("w1_EFD", "w3_EFD", "w2_EDF")
_FFN_NAMES = ("w1", "w3", "w2")  # (FeedForward's Linear modules: weight (out, in), no bias)


def _local(p: Tensor) -> Tensor:
    return p.to_local() if hasattr(p, "to_local") else p  # (a DTensor under expert parallelism)


def _fp8_forward(self, x_RD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
    if torch.compiler.is_compiling() and any(_fsdp.in_dtensor(getattr(self, n)) for n in _NAMES):
        return _fp8_forward_eager(self, x_RD, num_tokens_per_expert_E)  # (to_local included)
    return _fp8_forward_impl(self, x_RD, num_tokens_per_expert_E)


@torch.compiler.disable(reason=_fsdp.DTENSOR_EAGER_REASON)
def _fp8_forward_eager(self, x_RD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
    return _fp8_forward_impl(self, x_RD, num_tokens_per_expert_E)


def _fp8_forward_impl(self, x_RD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
    offs = offsets_from_counts(num_tokens_per_expert_E, x_RD.shape[0], "GroupedExperts")
    ws = [_local(getattr(self, n)) for n in _NAMES]
    _fsdp.check_wrapped(self, ws)
    return _run_experts(self, x_RD, ws, offs, [(self, _NAMES)]).to(x_RD.dtype)


def _run_experts(self, x: Tensor, ws, offs: Tensor, key_sources) -> Tensor:
    """moe_fp8_ext.experts with the module's recipe and cache on x and ws (w1, w3, w2);
    ``key_sources``: (module, parameter names) pairs whose versions key the cache."""
    recipe, cache = self.moe_fp8_recipe, self.moe_fp8_weight_cache
    cache = None if torch.compiler.is_compiling() else cache  # (compiled: experts uses none)
    if recipe.precision == "bf16":  # torchtitan's casts; the fp8 recipes quantize fp32 weights directly
        x, *ws = (t.bfloat16() for t in (x, *ws))
    keys = sum((weight_keys(m, names) for m, names in key_sources), ()) if cache is not None else None
    return experts(x, *ws, offs, recipe=recipe, weight_cache=cache, weight_keys=keys)


def _shared_forward(self, x: Tensor) -> Tensor:
    """torchtitan's ``FeedForward`` (shared experts) as one expert that every token goes
    to: :func:`moe_fp8_ext.experts` on x's rows with one group."""
    ws = [getattr(self, n).weight for n in _FFN_NAMES]
    if any(hasattr(w, "to_local") for w in ws):
        raise RuntimeError("shared experts converted by moe_fp8_ext: expected plain weights at forward, got DTensors "
                           "(tensor parallelism, or FSDP2 applied to a Linear itself); convert with "
                           "shared_experts=False")
    x_TD = x.reshape(-1, x.shape[-1])
    offs = torch.full((1,), x_TD.shape[0], dtype=torch.int32, device=x.device)
    out = _run_experts(self, x_TD, [w.unsqueeze(0) for w in ws], offs,
                       [(getattr(self, n), ("weight",)) for n in _FFN_NAMES])
    return out.view(*x.shape[:-1], out.shape[-1]).type_as(x)


def _configure(module, recipe: Recipe, reuse_weights: bool) -> None:
    module.moe_fp8_recipe = recipe
    module.moe_fp8_weight_cache = WeightCache() if reuse_weights else None
    if reuse_weights:
        share_versions_in_state_dict(module)


_CLASSES = {}


def _new_converted(base: type):
    cls = converted_class(base)
    return cls.__new__(cls)


def converted_class(base: type) -> type:
    """The subclass of ``base`` (a ``GroupedExperts`` class, or a ``FeedForward`` one:
    shared experts) that runs :func:`moe_fp8_ext.experts`; its ``Config`` adds
    ``moe_fp8_recipe``, ``moe_fp8_reuse_weights`` and ``moe_fp8_all_gather`` (experts
    only) to ``base.Config``. One class per base; instances pickle by their base (the
    class itself is made at run time)."""
    if base not in _CLASSES:
        shared = issubclass(base, FeedForward)

        @dataclass(kw_only=True, slots=True)
        class Config(base.Config):
            moe_fp8_recipe: Union[str, Recipe] = "fp8_rowwise"
            moe_fp8_reuse_weights: bool = False
            moe_fp8_all_gather: bool = False

        def __init__(self, config):
            base.__init__(self, config)
            if shared:  # (the built Linears: a converter listed after ours may have changed their configs)
                _check_linears(self, base.__name__)
            elif (name := _overridden(type(self), GroupedExperts)) is not None:  # (a converter after ours subclassed it)
                raise TypeError(f"ExpertsConverter: {type(self).__name__} overrides {name}, which moe_fp8_ext.experts "
                                "would not run; list moe_fp8_ext's converter alone for the routed experts")
            recipe = get_recipe(config.moe_fp8_recipe, "ExpertsConverter")
            _check_recipe_runs(base.__name__, recipe, self, "ExpertsConverter")
            _configure(self, recipe, config.moe_fp8_reuse_weights)
            if config.moe_fp8_all_gather:
                if shared:
                    raise ValueError("ExpertsConverter: the fp8 all-gather is for the routed experts' weights; "
                                     "expected moe_fp8_all_gather=False for shared experts")
                _fsdp.fp8_all_gather(self)

        def __reduce_ex__(self, protocol):
            return _new_converted, (base,), self.__getstate__()

        def parallelize(self, parallel_dims):  # (shared experts: spmd_types TP leaves no trace on the weights)
            if parallel_dims.tp_enabled:
                raise RuntimeError(f"{base.__name__} converted with shared_experts: the FP8 forward does not run "
                                   "tensor parallelism; convert with shared_experts=False")
            return base.parallelize(self, parallel_dims)

        name = f"Fp8{base.__name__}"
        _CLASSES[base] = type(name, (base,), {
            "Config": Config, "__init__": __init__, "forward": _shared_forward if shared else _fp8_forward,
            "__reduce_ex__": __reduce_ex__, **({"parallelize": parallelize} if shared else {}),
            "_moe_fp8_base": base, "__module__": __name__, "__qualname__": name})
    return _CLASSES[base]


def _overridden(base: type, kind: type) -> Optional[str]:
    """The compute method (forward, or torchtitan's ``_grouped_mm`` seam) that class
    ``base`` overrides from ``kind``, else None: the converted forward would not run it."""
    for name in ("forward", "_grouped_mm"):
        if hasattr(kind, name) and getattr(base, name) is not getattr(kind, name) and not (
                name == "forward" and base.forward in (_fp8_forward, _shared_forward)):
            return name
    return None


def _check_convertible(fqn: str, module, recipe: Recipe) -> None:
    """Errors that would otherwise come at the first forward, or never."""
    cls = type(module)
    name = _overridden(cls, GroupedExperts) or _overridden(getattr(cls, "_moe_fp8_base", cls), GroupedExperts)
    if name is not None:
        raise TypeError(f"convert: expected {fqn or 'the model'} to be a GroupedExperts with torchtitan's SwiGLU forward, "
                        f"got {type(module).__name__}, which overrides {name} (moe_fp8_ext.experts would not compute it)")
    _check_recipe_runs(fqn or "the model", recipe, module)


def _check_recipe_runs(where: str, recipe: Recipe, module, op: str = "convert") -> None:
    """That ``recipe`` runs on the weights of ``module`` (experts, or a FeedForward as one
    expert) as the layer reads them (shapes and dtypes, on meta tensors)."""
    ws = ([getattr(module, n).weight.unsqueeze(0) for n in _FFN_NAMES] if isinstance(module, FeedForward)
          else [getattr(module, n) for n in _NAMES])
    x = torch.empty((0, ws[0].shape[-1]), dtype=torch.bfloat16, device="meta")
    meta = [torch.empty(w.shape, dtype=torch.bfloat16 if recipe.precision == "bf16" else w.dtype, device="meta")
            for w in ws]
    offs = torch.empty((meta[0].shape[0],), dtype=torch.int32, device="meta")
    try:
        _check(x, *meta, offs, recipe, recipe.backend(ws[0].device), None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{op}: {where} cannot run recipe {recipe.name!r}: {e}") from None


def _check_linear(where: str, cls: type, bias: bool) -> None:
    """A shared expert's Linear (class, or config's class): its forward is never called,
    so it must be nn.Linear's, without bias."""
    if not issubclass(cls, torch.nn.Linear) or cls.forward is not torch.nn.Linear.forward:
        raise TypeError(f"convert: expected {where} to be a Linear with nn.Linear's forward for shared_experts (the "
                        f"FP8 forward does not call it), got {cls.__name__}")
    if bias:
        raise TypeError(f"convert: expected {where} without bias for shared_experts (moe_fp8_ext.experts has none)")


def _check_linears(module, where: str) -> None:
    """The three Linears of a FeedForward as built: nn.Linear's forward, no bias, SwiGLU shapes."""
    for n in _FFN_NAMES:
        lin = getattr(module, n)
        _check_linear(f"{where}.{n}", type(lin), lin.bias is not None)
    w1, w3, w2 = (getattr(module, n).weight for n in _FFN_NAMES)
    if w1.shape != w3.shape or w2.shape != w1.shape[::-1]:
        raise ValueError(f"convert: {where} is not a SwiGLU FeedForward: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, "
                         f"w2 {tuple(w2.shape)}")


def _check_shared_convertible(fqn: str, module, recipe: Recipe) -> None:
    """_check_convertible for shared experts. Their Linears' forwards are not called: a
    Linear may carry no hooks, and an instance forward only ``parallelize``'s, without
    tensor parallelism (its redistributions are then no-ops)."""
    base = type(module)
    if not isinstance(module, FeedForward) or base.forward not in (FeedForward.forward, _shared_forward):
        raise TypeError(f"convert: expected {fqn} to be a FeedForward with torchtitan's SwiGLU forward for "
                        f"shared_experts, got {base.__name__}" + (", which overrides forward"
                                                                  if isinstance(module, FeedForward) else ""))
    _check_linears(module, fqn)
    for n in _FFN_NAMES:
        lin, where = getattr(module, n), f"{fqn}.{n}"
        if lin._forward_hooks or lin._forward_pre_hooks:
            raise TypeError(f"convert: {where} has forward hooks, which the FP8 forward of shared_experts would "
                            "not run")
        try:
            dims = _parallel_dims(where, lin)
        except RuntimeError:
            raise RuntimeError(f"convert: {where} has a forward set on the instance that the FP8 forward of "
                               "shared_experts would not call; convert with shared_experts=False") from None
        if dims is not None and dims.tp_enabled:
            raise RuntimeError(f"convert: {where} is tensor-parallel; shared_experts does not run tensor "
                               "parallelism: convert with shared_experts=False")
    _check_recipe_runs(fqn, recipe, module)


def _join(fqn: str, name: str) -> str:
    return f"{fqn}.{name}" if fqn else name


def _shared(model: torch.nn.Module, converted_only: bool):
    """(fqn, module) of the shared experts of every MoE layer in ``model``; with
    ``converted_only``, those converted already."""
    return [(_join(fqn, "shared_experts"), m.shared_experts) for fqn, m in model.named_modules()
            if isinstance(m, MoE) and m.shared_experts is not None
            and (not converted_only or hasattr(type(m.shared_experts), "_moe_fp8_base"))]


def _parallel_dims(fqn: str, module):
    """torchtitan's ``Module.parallelize`` stores a ``forward`` on the instance that
    wraps the bound forward of the class it had then (input/output redistribution
    around an optional local_map): it would keep running that forward after a class
    swap. The ParallelDims it was made with, to rebuild it around the converted forward;
    None without such a wrapper; an error for an instance forward of any other kind."""
    wrapped = module.__dict__.get("forward")
    if wrapped is None:
        return None
    names = getattr(wrapped, "__code__", None) and wrapped.__code__.co_freevars
    cells = dict(zip(names or (), (c.cell_contents for c in (wrapped.__closure__ or ()))))
    parallel_dims = cells.get("parallel_dims")
    if (getattr(wrapped, "__name__", "") != "forward_with_redistribution" or parallel_dims is None
            or cells.get("self") is not module or not hasattr(module, "_maybe_wrap_with_local_region")):
        raise RuntimeError(
            f"convert: {fqn or 'the model'} has a forward set on the instance ({wrapped!r}) that this version cannot "
            "rebuild around the FP8 forward; convert before parallelizing: list "
            "moe_fp8_ext.integrations.torchtitan.ExpertsConverter.Config in the model's converters, or call "
            "convert(model) right after building it")
    return parallel_dims


def _swap_class(module, cls, parallel_dims) -> None:
    module.__class__ = cls
    if parallel_dims is not None:
        del module.forward
        module.forward = _redistributing(module, parallel_dims)


def _redistributing(self, parallel_dims):
    """``Module.parallelize``'s wrapper, around the forward of ``self``'s class now."""
    fn = self._maybe_wrap_with_local_region(self.forward, parallel_dims)

    def forward_with_redistribution(*args, **kwargs):
        args, kwargs = self._redistribute_inputs(parallel_dims, args, kwargs)
        outputs = fn(*args, **kwargs)
        return self._redistribute_outputs(parallel_dims, outputs)

    return forward_with_redistribution


def convert(model: torch.nn.Module, recipe: Union[str, Recipe] = "fp8_rowwise", *, reuse_weights: bool = False,
            fp8_all_gather: bool = False, fp8_dispatch: bool = False, shared_experts: bool = False,
            torchtitan_dispatcher: bool = False) -> int:
    """Convert every torchtitan ``GroupedExperts`` in ``model`` (the model itself
    included) to run :func:`moe_fp8_ext.experts` with ``recipe``, in place; returns how
    many were converted. The token dispatcher of each MoE layer whose experts it converts,
    torchtitan's all-to-all or local one, becomes :class:`OnePassTokenDispatcher` (the same
    rows; its gather's backward and combine in one pass), or with ``torchtitan_dispatcher``
    stays (or is again) torchtitan's; other dispatchers are kept. Converting again changes
    the recipe (of shared experts converted before too), except where the weights
    all-gather in fp8 (RuntimeError), and the dispatcher. Works before
    or after torchtitan's ``parallelize`` and FSDP2. ``reuse_weights``: a
    :class:`~moe_fp8_ext.WeightCache` per module (opt-in: see
    :mod:`moe_fp8_ext.weight_cache` for the writes it cannot see). ``fp8_all_gather``
    (before FSDP2) and ``fp8_dispatch``: FP8 communication; ``shared_experts``: the MoE
    layers' shared experts too, counted (the module docstring). Raises ValueError for an
    unknown recipe or shapes the recipe cannot run, TypeError for a GroupedExperts or
    FeedForward subclass with another forward (or ``_grouped_mm``) or a token dispatcher
    other than torchtitan's all-to-all or local one, RuntimeError where a parallelized
    forward cannot be rebuilt or the weights are already sharded for an fp8 all-gather."""
    r = get_recipe(recipe, "convert")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert: expected a torch.nn.Module, got {type(model).__name__}")
    found = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)]
    shared = _shared(model, converted_only=not shared_experts)
    if fp8_dispatch and torchtitan_dispatcher:
        raise ValueError("convert: fp8_dispatch sends the tokens through our dispatcher; expected "
                         "torchtitan_dispatcher=False with it")
    dispatchers = [] if torchtitan_dispatcher else _dispatchers(model, r, fp8_dispatch)
    ours = _our_dispatchers(model) if torchtitan_dispatcher else []
    dims = []
    checks = [(fqn, m, _check_convertible) for fqn, m in found] + [
        (fqn, m, _check_shared_convertible) for fqn, m in shared]
    for fqn, module, check in checks:  # every check before any change
        check(fqn, module, r)
        old = getattr(module, "moe_fp8_recipe", None)
        if getattr(module, "moe_fp8_all_gather", False) and old != r:
            raise RuntimeError(f"convert: {fqn or 'the model'} all-gathers its weights in fp8 for recipe {old.name!r} "
                               f"(fp8_all_gather), which it keeps; to change it to {r!r}, convert before "
                               "fp8_all_gather")
        dims.append(_parallel_dims(fqn, module))
    if fp8_all_gather and found:
        if reuse_weights:
            raise ValueError("convert: expected reuse_weights=False with fp8_all_gather (the gathered fp8 weights are "
                             "what is reused, while FSDP2 keeps them unsharded)")
        for fqn, module in found:
            _fsdp.check_module(module, r, _NAMES, fqn or "the model")
    for (fqn, module), parallel_dims in zip(found + shared, dims):
        _swap_class(module, converted_class(getattr(type(module), "_moe_fp8_base", type(module))), parallel_dims)
        _configure(module, r, reuse_weights)
    if fp8_all_gather:
        _fsdp.fp8_all_gather(model)
    for d in dispatchers:  # (a local one has no mesh: ours is local without one)
        if not isinstance(d, OnePassTokenDispatcher):  # (torchtitan's class, which unconvert restores)
            d.moe_fp8_base = type(d)
        d.__class__, d.ep_mesh = Fp8AllToAllTokenDispatcher if fp8_dispatch else OnePassTokenDispatcher, getattr(
            d, "ep_mesh", None)
        if fp8_dispatch:
            d.recipe = r
        else:
            d.__dict__.pop("recipe", None)
    for d in ours:
        _restore_dispatcher(d)
    return len(found) + (len(shared) if shared_experts else 0)


def _our_dispatchers(model: torch.nn.Module) -> list:
    """The token dispatchers of ``model`` that are ours."""
    return [m.token_dispatcher for m in model.modules()
            if isinstance(getattr(m, "token_dispatcher", None), OnePassTokenDispatcher)]


def _restore_dispatcher(d) -> None:
    """Our dispatcher ``d`` as torchtitan's again (the class it was converted from)."""
    d.__class__ = d.__dict__.pop("moe_fp8_base", AllToAllTokenDispatcher)
    d.__dict__.pop("recipe", None)


def _check_fp8_dispatch(recipe: Recipe, where: str) -> None:
    """fp8_dispatch's recipe: fp8 and, on this machine's GPU, taking token groups unpadded
    (the dispatched rows cannot be padded after the fact)."""
    _check_recipe(recipe, where)
    backend = recipe.backend(torch.device("cuda")) if torch.cuda.is_available() else None
    if backend and recipe.alignment > 1 and recipe.pads_token_groups(backend):
        raise NotImplementedError(f"{where}: recipe {recipe.name!r} pads token groups on this GPU ({backend}), and "
                                  "fp8_dispatch sends them unpadded: convert without fp8_dispatch")


def _dispatchers(model: torch.nn.Module, recipe: Recipe, fp8: bool):
    """The token dispatchers of ``model``'s MoE layers whose experts are converted that
    become ours: torchtitan's all-to-all or local one (or already ours); any other is
    kept, or with ``fp8`` (an fp8 dispatch with ``recipe``) an error."""
    if fp8:
        _check_fp8_dispatch(recipe, "convert")
    found = []
    for fqn, m in model.named_modules():
        d = getattr(m, "token_dispatcher", None)
        if d is None or not isinstance(getattr(m, "inner_experts", None), GroupedExperts):
            continue
        if type(d) in _SWAPPED:
            found.append(d)
        elif fp8:
            raise TypeError(f"convert: expected {fqn}.token_dispatcher to be torchtitan's AllToAllTokenDispatcher or "
                            f"LocalTokenDispatcher for fp8_dispatch, got {type(d).__name__}")
    return found


def unconvert(model: torch.nn.Module) -> int:
    """Undo :func:`convert`: the modules run torchtitan's own forward again (RuntimeError,
    nothing changed, where weights all-gather in fp8)."""
    found = [(fqn, m) for fqn, m in model.named_modules() if hasattr(type(m), "_moe_fp8_base")]
    for fqn, m in found:
        if getattr(m, "moe_fp8_all_gather", False):
            raise RuntimeError(f"unconvert: {fqn or 'the model'} all-gathers its weights in fp8 (fp8_all_gather); "
                               "torchtitan's forward cannot read them")
    dims = [_parallel_dims(fqn, m) for fqn, m in found]
    for (fqn, module), parallel_dims in zip(found, dims):
        _swap_class(module, type(module)._moe_fp8_base, parallel_dims)
        del module.moe_fp8_recipe, module.moe_fp8_weight_cache
    for d in _our_dispatchers(model):
        _restore_dispatcher(d)
    return len(found)


class ExpertsConverter(QuantizationConverter):
    """torchtitan model converter: every ``GroupedExperts.Config`` in the model's config
    tree becomes the config of :func:`converted_class`, so the model is built with
    moe_fp8_ext's experts and ``parallelize`` wraps their forward."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: Union[str, Recipe] = "fp8_rowwise"
        """fp8_rowwise, fp8_blockwise, mxfp8 or bf16 (moe_fp8_ext.recipes.RECIPES), or a
        Recipe, e.g. ``Fp8Blockwise(hold_weight_operands=True)``."""
        reuse_weights: bool = False
        """Reuse quantized weights until the optimizer step (moe_fp8_ext.weight_cache)."""
        fp8_all_gather: bool = False
        """FSDP2 all-gathers the expert weights in fp8 (moe_fp8_ext.fsdp)."""
        fp8_dispatch: bool = False
        """The routed tokens are quantized once and dispatched in fp8, sent under expert
        parallelism and gathered locally without it (Fp8AllToAllTokenDispatcher)."""
        torchtitan_dispatcher: bool = False
        """Keep torchtitan's token dispatcher; by default it becomes OnePassTokenDispatcher
        (the same rows; its gather's backward and combine in one pass each)."""
        shared_experts: bool = False
        """The MoE layers' shared experts (FeedForward) run moe_fp8_ext.experts too."""
        filter_fqns: List[str] = field(default_factory=list)
        """Experts whose fully qualified name contains one of these stay as they are."""

    def __init__(self, config: Config):
        self.config = config
        recipe = get_recipe(config.recipe, "ExpertsConverter")  # (an unknown name fails here, not at build)
        if config.fp8_dispatch:
            _check_fp8_dispatch(recipe, "ExpertsConverter")
            if config.torchtitan_dispatcher:
                raise ValueError("ExpertsConverter: fp8_dispatch sends the tokens through our dispatcher; expected "
                                 "torchtitan_dispatcher=False with it")
        if config.fp8_all_gather:
            _fsdp.check_recipe(recipe, "ExpertsConverter")
            if config.reuse_weights:
                raise ValueError("ExpertsConverter: expected reuse_weights=False with fp8_all_gather")

    def convert(self, model_config):
        cfg = self.config
        changes = []  # (parent, attribute, new config): every check before any change
        for fqn, config, parent, attr in model_config.traverse(GroupedExperts.Config):
            if not any(f in fqn for f in cfg.filter_fqns):
                changes.append((parent, attr, _converted_config(
                    config, fqn or "the model", GroupedExperts, moe_fp8_recipe=cfg.recipe,
                    moe_fp8_reuse_weights=cfg.reuse_weights, moe_fp8_all_gather=cfg.fp8_all_gather)))
        for fqn, moe, _, _ in model_config.traverse(MoE.Config):  # (converted before: the new recipe, as convert)
            config, where = moe.shared_experts, _join(fqn, "shared_experts")
            if config is None or any(f in where for f in cfg.filter_fqns) or not (
                    cfg.shared_experts or hasattr(type(config)._owner, "_moe_fp8_base")):
                continue
            for n in _FFN_NAMES:
                lin = getattr(config, n)
                _check_linear(f"{where}.{n}", type(lin)._owner, lin.bias)
            changes.append((moe, "shared_experts", _converted_config(
                config, where, FeedForward, moe_fp8_recipe=cfg.recipe, moe_fp8_reuse_weights=cfg.reuse_weights)))
        for parent, attr, new in changes:
            model_config = _replace(model_config, parent, attr, new)
        for fqn, routed, _, _ in model_config.traverse(RoutedExperts.Config):
            config = routed.token_dispatcher  # (of every MoE layer whose experts were converted)
            if not hasattr(getattr(type(routed.inner_experts), "_owner", None), "_moe_fp8_base"):
                continue
            ours = isinstance(config, OnePassTokenDispatcher.Config)
            values = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "recipe"}
            if cfg.torchtitan_dispatcher:
                if ours:  # (converted again with it: torchtitan's dispatcher)
                    routed.token_dispatcher = AllToAllTokenDispatcher.Config(**values)
                continue
            if type(config) not in (c.Config for c in _SWAPPED):
                if cfg.fp8_dispatch:
                    raise TypeError(f"ExpertsConverter: expected {fqn}.token_dispatcher to be torchtitan's "
                                    f"AllToAllTokenDispatcher or LocalTokenDispatcher for fp8_dispatch, got "
                                    f"{type(config).__qualname__}")
                continue
            routed.token_dispatcher = (Fp8AllToAllTokenDispatcher.Config(**values, recipe=cfg.recipe)
                                       if cfg.fp8_dispatch else OnePassTokenDispatcher.Config(**values))
        return model_config


def _converted_config(config, where: str, kind: type, **options):
    """The config of ``converted_class`` for ``config`` (a ``kind`` with torchtitan's
    forward, else an error), its fields kept and ``options`` added."""
    base = type(config)._owner
    base = getattr(base, "_moe_fp8_base", base)
    name = _overridden(base, kind)
    if name is not None:
        raise TypeError(f"ExpertsConverter: expected {where} to be a {kind.__name__} with torchtitan's SwiGLU forward, "
                        f"got {base.__name__}, which overrides {name}")
    values = {f.name: getattr(config, f.name) for f in fields(config)}
    values.update(options)  # (a config converted before: the new options)
    return converted_class(base).Config(**values)


def _replace(root, parent, attr, new):
    if parent is None:
        return new
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
    return root


def _routed_order(topk_scores_TK: Tensor, topk_expert_ids_TK: Tensor, top_k: int):
    """torchtitan's order of the routed rows (by expert, each expert's in token order):
    the token of each row and its score."""
    order = torch.argsort(topk_expert_ids_TK.view(-1), stable=True)
    return order // top_k, topk_scores_TK.view(-1)[order]


class OnePassTokenDispatcher(AllToAllTokenDispatcher):
    """torchtitan's all-to-all token dispatcher (local without expert parallelism, as its
    ``LocalTokenDispatcher``): the same rows in the same order, with x's gradient summed
    in one pass (:func:`moe_fp8_ext.dispatch.gather`) and the combine in one pass each
    way (:func:`moe_fp8_ext.dispatch.combine`: torchtitan's bits on CUDA, without its
    fp32 copy of the routed rows and its sort of them). ``convert`` swaps it in."""

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        pass

    def _local_reorder(self, x_TD, topk_scores_TK, topk_expert_ids_TK):
        token_idx, scores = _routed_order(topk_scores_TK, topk_expert_ids_TK, self.top_k)
        return gather(x_TD, token_idx), token_idx, scores

    def combine(self, routed_output_RD, metadata, x_TD):
        routed = routed_output_RD
        if self.ep_mesh is not None:  # (torchtitan's unpermute and all-to-all back)
            routed = self._unpermute(routed, metadata.input_shape, metadata.permuted_indices)
            routed = self._combine_token_exchange(routed, self.ep_mesh.get_group(), metadata.input_splits,
                                                  metadata.output_splits)
        return combine(routed, metadata.topk_scores_experts_sorted_N, metadata.token_indices_experts_sorted_N,
                       x_TD.shape[0])


class Fp8AllToAllTokenDispatcher(OnePassTokenDispatcher):
    """:class:`OnePassTokenDispatcher` sending the routed tokens as the first expert
    GEMM's fp8 operand (:func:`moe_fp8_ext.dispatch.fp8_dispatch`: each token quantized
    once, fp8 data + scales); the experts read them as they arrive. Without expert
    parallelism the fp8 rows are gathered locally. The combine stays bf16."""

    @dataclass(kw_only=True, slots=True)
    class Config(OnePassTokenDispatcher.Config):
        recipe: Union[str, Recipe] = "fp8_blockwise"

    def __init__(self, config: Config):
        super().__init__(config)
        self.recipe = get_recipe(config.recipe, "Fp8AllToAllTokenDispatcher")
        _check_fp8_dispatch(self.recipe, "Fp8AllToAllTokenDispatcher")

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        token_idx, scores = _routed_order(topk_scores_TK, topk_expert_ids_TK, self.top_k)
        if self.ep_mesh is None:  # (the rows are gathered here, nothing is sent)
            rows = fp8_dispatch(x_TD, token_idx.to(torch.int32), self.recipe)
            metadata = LocalDispatchMetadata(token_indices_experts_sorted_N=token_idx,
                                             topk_scores_experts_sorted_N=scores)
            return rows, num_local_tokens_per_expert_E, metadata
        ep = self.ep_mesh.size()
        group = self.ep_mesh.get_group()
        counts = num_local_tokens_per_expert_E.to(torch.int32)
        with torch.no_grad():
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=group)
            splits = torch.stack([counts.view(ep, -1).sum(1), recv.view(ep, -1).sum(1)])
            in_splits, out_splits = splits.tolist()  # host-sync-ok: all-to-all split sizes, as torchtitan's
        received = sum(out_splits)
        # torchtitan's rank-major -> expert-major order (its _permute, on rows of no width)
        _, _, perm, counts_e = self._permute(x_TD.new_empty((received, 0)), recv)
        rows = fp8_dispatch(x_TD, token_idx.to(torch.int32), self.recipe, group, in_splits, out_splits,
                            perm=perm.to(torch.int32))
        metadata = AllToAllDispatchMetadata(
            token_indices_experts_sorted_N=token_idx, topk_scores_experts_sorted_N=scores,
            input_shape=torch.Size((received, x_TD.shape[1])), permuted_indices=perm, input_splits=in_splits,
            output_splits=out_splits)
        return rows, counts_e, metadata


# (the dispatchers convert makes ours)
_SWAPPED = (AllToAllTokenDispatcher, LocalTokenDispatcher, OnePassTokenDispatcher, Fp8AllToAllTokenDispatcher)


def build_moe(dim: int, hidden: int, experts: int, top_k: int = 2, *, device="cpu", dtype=torch.bfloat16,
              seed: int = 0, shared_experts: bool = True, all_to_all: bool = False, converter=None) -> torch.nn.Module:
    """A torchtitan 0.3.0 ``MoE`` layer (top-k router, token dispatcher, GroupedExperts,
    shared experts) built from torchtitan's own configs, every weight drawn from
    N(0, 1/fan_in) with ``seed``: the layer the tests, benchmarks and
    ``scripts/tools/train_curve.py`` convert. ``all_to_all``: torchtitan's all-to-all dispatcher
    (local without expert parallelism) instead of the local one; ``converter``: a model
    converter config applied to the config tree first."""
    import torchtitan.models.common.moe as tt_moe
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

    def lin(i, o):
        return Linear.Config(in_features=i, out_features=o, bias=False)

    dispatcher = (AllToAllTokenDispatcher if all_to_all else LocalTokenDispatcher).Config(num_experts=experts, top_k=top_k)
    cfg = tt_moe.MoE.Config(
        num_experts=experts,
        routed_experts=tt_moe.RoutedExperts.Config(
            inner_experts=tt_moe.GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts),
            token_dispatcher=dispatcher),
        router=tt_moe.TokenChoiceTopKRouter.Config(num_experts=experts, gate=lin(dim, experts), top_k=top_k),
        shared_experts=FeedForward.Config(w1=lin(dim, hidden), w2=lin(hidden, dim), w3=lin(dim, hidden))
        if shared_experts else None,
    )
    if converter is not None:
        cfg = converter.build().convert(cfg)
    moe = cfg.build()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return moe.to(device=device, dtype=dtype)
