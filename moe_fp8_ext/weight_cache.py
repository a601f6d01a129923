"""Reuse of quantized expert weights while the weights are unchanged (DESIGN §10).

Gradient-accumulation micro-batches and activation-checkpoint recompute then quantize
each weight once per optimizer step instead of once per call. An entry is one quantized
operand of one or two weights, keyed on the tensors that say whether the weights
changed (:func:`weight_keys`: the parameters, or under FSDP2 the sharded parameters the
optimizer writes): their identity, version counters, storage, offset, shape, strides
and dtype, plus the recipe and fp8 dtype.

- Seen: every write autograd sees (optimizer steps, ``copy_``, ``load_state_dict``,
  checkpoint loads into FSDP2's sharded parameters or, in place, into the entries of
  the layer's ``state_dict``: :func:`share_versions_in_state_dict`), ``torch.utils.swap_tensors`` and
  ``w.data = ...`` (a new storage, never mistaken for the old one: the entry holds a
  weak reference to the old storage, so its address is not reused). Every
  ``torch.optim`` step empties every cache.
- Not seen: writes that bypass the version counter (through ``w.data``,
  ``w.untyped_storage()``, ``w.numpy()``, or under
  ``torch.autograd._unsafe_preserve_version_counter``) outside an optimizer step. Call
  :func:`clear_weight_caches` after them. This is why reuse is opt-in.
- Never cached: inference tensors (made under ``torch.inference_mode()``), which have
  no version counter.

Memory: one fp8 copy of each weight in each orientation (``WeightCache.nbytes()``),
about the bf16 weights' size, until the next optimizer step; under FSDP2 that is the
unsharded weight of every layer with a cache.
"""

import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["WeightCache", "clear_weight_caches", "share_versions_in_state_dict", "weight_keys"]

_CACHES: "weakref.WeakSet[WeightCache]" = weakref.WeakSet()
_HOOK = None


def clear_weight_caches() -> None:
    """Empty every :class:`WeightCache` (after weights were written in a way the caches
    cannot see, e.g. through ``w.data``)."""
    for c in list(_CACHES):
        c.clear()


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    clear_weight_caches()


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # (a DTensor's shard)


def _key(t: Tensor) -> Tuple[tuple, StorageWeakRef]:
    local = _local(t)
    storage = local.untyped_storage()
    return ((id(t), t._version, local._version, storage._cdata, local.storage_offset(), tuple(local.shape),
             local.stride(), local.dtype, local.device), StorageWeakRef(storage))


def _untracked(keys: Sequence[Tensor]) -> bool:
    """Whether a key has no version counter (an inference tensor, made under
    ``torch.inference_mode()``): such weights are never cached."""
    return any(k.is_inference() or _local(k).is_inference() for k in keys)


class WeightCache:
    """Quantized expert weights, reused while the weights are unchanged (the module
    docstring has the exact rule). One per layer; ``hits`` and ``misses`` count lookups."""

    def __init__(self):
        global _HOOK
        self._entries: Dict[str, tuple] = {}
        self.hits = 0
        self.misses = 0
        _CACHES.add(self)
        if _HOOK is None:
            _HOOK = register_optimizer_step_post_hook(_after_optimizer_step)

    def __reduce__(self):
        return WeightCache, ()  # (pickled and copied empty: entries are not state)

    def clear(self) -> None:
        self._entries.clear()

    def nbytes(self) -> int:
        """Bytes held by the cached operands."""
        return sum(_nbytes(op) for _, _, op in self._entries.values())

    def get(self, name: str, keys: Sequence[Tensor], tag: tuple, make):
        """The operand ``name`` if none of ``keys`` changed since it was made (and the
        recipe and fp8 dtype ``tag`` are the same), else ``make()``, kept for next time."""
        if _untracked(keys):
            return make()
        key = tuple(_key(k)[0] for k in keys) + tag
        hit = self._entries.get(name)
        if hit is not None and hit[0] == key:
            self.hits += 1
            return hit[2]
        self.misses += 1
        # The stale operand goes before its replacement is made: both alive at once
        # would add a weight-sized transient to the step.
        self._entries.pop(name, None)
        hit = None
        operand = make()
        self.put(name, keys, tag, operand)
        return operand

    def discard(self, name: str) -> None:
        self._entries.pop(name, None)

    def put(self, name: str, keys: Sequence[Tensor], tag: tuple, operand) -> None:
        """Keep ``operand`` as ``name`` (made together with another entry: the backward
        operand of a weight read once for both), not counted as a lookup."""
        if _untracked(keys):
            return
        made = [_key(k) for k in keys]
        self._entries[name] = (tuple(m[0] for m in made) + tag, tuple(m[1] for m in made), operand)


def _tensors(x):
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)


def _nbytes(op) -> int:
    """Bytes of an operand's tensors (a tensor, or tensors in nested tuples and lists)."""
    return sum(t.numel() * t.element_size() for t in _tensors(op))


def cached(cache: Optional[WeightCache], name: str, keys: Sequence[Tensor], tag: tuple, make):
    return make() if cache is None else cache.get(name, keys, tag, make)


# FSDP2 keeps, per parameter, an FSDPParam whose sharded_param is what the optimizer
# writes; the module's attribute is the unsharded parameter, rewritten by every
# all-gather without a version bump. FSDP2 has no public map from one to the other.
_FSDP_PARAMS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _fsdp_params(module: torch.nn.Module) -> Dict[str, "weakref.ref"]:
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:  # a torch without distributed
        return {}
    seen = _FSDP_PARAMS.get(module)
    if seen is not None and (seen[0] or seen[1] == len(_module_state_mapping)):
        return seen[0]  # (none found, and no FSDP state added since: none still)
    found = {}
    for ref in list(_module_state_mapping.values()):
        state = ref()
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for fp in getattr(group, "fsdp_params", ()):
                info = fp._module_info
                if info.module is module:
                    found[info.param_name] = weakref.ref(fp)
    _FSDP_PARAMS[module] = (found, len(_module_state_mapping))
    return found


def share_versions_in_state_dict(module: torch.nn.Module) -> None:
    """Make ``module``'s ``state_dict`` entries of DTensor parameters share the version
    counters of the parameters' shards (once a module): an in-place checkpoint load
    into them (``dcp.load``) is then a write a cache sees."""
    if not getattr(module, "_moe_fp8_shares_versions", False):
        module.register_state_dict_post_hook(_alias_shards)
        module._moe_fp8_shares_versions = True


def _alias_shards(module, state_dict, prefix, local_metadata) -> None:
    # DTensor's detach runs below autograd: its shard gets a version counter of its own.
    # Rebuilt around a detach of the parameter's shard made here, the entry shares it.
    for name, p in module.named_parameters():
        v = state_dict.get(prefix + name)
        if v is not None and v is not p and _local(v) is not v and type(p._local_tensor) is Tensor:
            state_dict[prefix + name] = _rewrap(v, p._local_tensor.detach())


def _rewrap(d: Tensor, local: Tensor) -> Tensor:
    """A DTensor like ``d`` (mesh, placements, shape, strides) around the shard ``local``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride())


def weight_keys(module: torch.nn.Module, names: Sequence[str]) -> Tuple[Tensor, ...]:
    """The tensors whose versions say whether ``module``'s parameters ``names`` changed:
    under FSDP2 (``fully_shard`` on the module or on a parent) the sharded parameters,
    else the parameters themselves (DTensors under expert parallelism)."""
    fsdp = _fsdp_params(module)
    keys = []
    for n in names:
        fp = fsdp[n]() if n in fsdp else None
        keys.append(fp.sharded_param if fp is not None else getattr(module, n))
    return tuple(keys)
