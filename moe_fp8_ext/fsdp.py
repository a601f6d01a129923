"""FP8 all-gather of expert weights under FSDP2 (DESIGN §12).

    from moe_fp8_ext.fsdp import fp8_all_gather
    layer = moe_fp8_ext.GroupedExperts(dim, hidden, experts, recipe="fp8_blockwise")  # or fp8_rowwise
    fp8_all_gather(layer)          # before fully_shard
    fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))

Each rank quantizes only its shard of w1, w3 and w2 (sharded on dim 0, the experts, a
shard holds whole experts: fp8_blockwise's 128x128 tiles and fp8_rowwise's scales are
shard-local) and FSDP2 all-gathers the fp8 data and the scales: about half of
bf16's bytes. A gather carries the operands its pass reads: the forward's all-gather the
forward operands, the backward's (inside autograd's backward) the transposed ones, each
quantized from the shard. W1's gather carries [W1; W3] as the layer reads it (the
forward's interleaved for the SwiGLU GEMM where it runs; fp8_rowwise's backward one with
column scales over both weights), W3's 16 bytes: the experts layer takes the operands
as they are, with no copy. A weight gathered once for both passes
(``reshard_after_forward=False``, the root module, the backward of an activation-
checkpointed forward, whose gather carries the forward's operands for the recompute,
micro-batches without resharding) gets the other operand by a transposed copy
(fp8_blockwise: a tile and its transpose share the scale) or by quantizing its
dequantized values again (fp8_rowwise: a second rounding, close to the first but not
its bits: a row's or column's largest value may round across a power of two). The bits
are otherwise those of quantizing the whole weight, cast to the mixed-precision
``param_dtype`` first as FSDP2 casts it (fp32 to bf16: read so by the quantize kernels,
no cast written).

Through FSDP2's extension points only: the parameter's data is a tensor subclass with
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (torchao's Float8 weights do the
same). The optimizer sees the high-precision shards, and ``state_dict`` entries and
checkpoints are plain high-precision tensors (sharing the shards' storage; a load that
assigns them, ``load_state_dict(assign=True)``, wraps them as the weights it replaces); every
all-gather quantizes the shard as it is then, so a step or a load is never missed, and
gathered weights live exactly as long as FSDP2 keeps a parameter unsharded
(``reshard_after_forward=False``, or ``set_reshard_after_backward(False)`` across
micro-batches). fp8_blockwise and fp8_rowwise; sharded on dim 0, the number of
experts must be a multiple of the shard group's size (FSDP2 would pad dim 0, and padded
shards cannot carry scales). Sharded on the rows (``Shard(1)``, torchtitan's placement
where the ranks outnumber the experts), FSDP2 joins the gathered fp8 itself and the
scales are gathered beside it (fp8_rowwise's column scales from amaxes reduced over the
ranks first, started by the forward's gather for the backward's: the same bits; W1 and
W3 gathered apart, joined by the layer with one copy); those scales, small, stay
between gathers, and
fp8_blockwise needs each rank's rows a multiple of 128. A one-rank shard group (expert
parallelism over every rank) sends nothing: its weights stay high precision and the
layer quantizes them. Under
``torch.compile`` (fullgraph too) the graph reads the gathered fp8 and scales as its
inputs and saves them for its backward; the backward's all-gather then carries the
forward's operands again (FSDP2 refills the storage the graph saved) and the backward
makes the transposed ones from them, as for a weight gathered once for both passes
(fp8_rowwise with power-of-two scales in traced ops, no dequantized copy held).
"""

import functools
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor

from . import reference
from .grouped_mm import saved_tensor_hooks_on
from .recipes import Fp8Blockwise, Fp8Rowwise, Recipe, _expand_tiles
from .recipes.blockwise import W13Interleaved
from .weight_cache import _fsdp_params, _key, _local, _rewrap

__all__ = ["GatheredWeight", "ShardedWeight", "fp8_all_gather", "gathered_weights"]

# Ops whose outputs stay parameter data (FSDP2's sharding and padding, to_empty,
# clone and copies); every other op computes on the wrapped tensor.
_KEEP = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.copy_.default, torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default, torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor, torch.ops.aten.clone.default, torch.ops.aten.chunk.default,
    torch.ops.aten.narrow.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
}
_KEEP_NAMES = {"spmd_types::replicate_to_varying"}  # (torchtitan's expert-parallel sharding)


def _wrapper(cls, t: Tensor, dtype: torch.dtype, requires_grad: bool = False):
    return Tensor._make_wrapper_subclass(cls, t.shape, strides=t.stride(), storage_offset=t.storage_offset(),
                                         dtype=dtype, layout=t.layout, device=t.device, requires_grad=requires_grad)


class ShardedWeight(Tensor):
    """An expert weight (E, rows, cols) whose FSDP2 all-gather sends fp8 operands:
    ``fsdp_pre_all_gather`` quantizes this rank's shard with ``recipe``. Computes as its
    high-precision tensor everywhere else. ``joint``: (the module attribute of the
    weight it is joined with, its place 0 or 1): the [W1; W3] operands (sharded on the
    experts, W1's gather carries them; on the rows, fp8_rowwise's backward scales span both)."""

    @staticmethod
    def __new__(cls, tensor: Tensor, recipe: Recipe, joint=None):
        return _wrapper(cls, tensor, tensor.dtype, tensor.requires_grad)

    def __init__(self, tensor: Tensor, recipe: Recipe, joint=None):
        self._tensor, self._recipe, self._joint = tensor, recipe, joint

    def __repr__(self):
        return f"ShardedWeight({self._tensor!r}, recipe={self._recipe.name!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, ShardedWeight))
        args, kwargs = pytree.tree_map_only(ShardedWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP and func.name() not in _KEEP_NAMES:
            return out
        return pytree.tree_map_only(Tensor, lambda t: ShardedWeight(t, first._recipe, first._joint), out)

    def __reduce_ex__(self, protocol):
        return _rebuild_sharded, (self._tensor, self._recipe, self._joint, self.requires_grad,
                                  isinstance(self, torch.nn.Parameter))

    def __tensor_flatten__(self):
        return ["_tensor"], (self._recipe, self._joint)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ShardedWeight(inner["_tensor"], *meta)

    def _other(self, module) -> "ShardedWeight":
        """The shard of the weight this one is joined with (FSDP2 has the module's sharded
        parameters set while it gathers)."""
        other = getattr(module, self._joint[0])
        other = other._local_tensor if hasattr(other, "_local_tensor") else other
        if not isinstance(other, ShardedWeight):
            raise RuntimeError(f"fp8_all_gather: expected {type(module).__name__}.{self._joint[0]} to be an "
                               f"fp8-gathered weight too, got {type(other).__name__}")
        return other

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        world = mesh.size()
        dim = _shard_dim(tuple(self.shape), tuple(outer_size), world, self._recipe)
        dtype = getattr(mp_policy, "param_dtype", None)

        def cast(w):  # as FSDP2 casts what it gathers: the bits of the bf16-gather path
            return w.to(dtype) if dtype is not None and dtype != w.dtype else w

        if world == 1:  # (FSDP2 copies a one-rank group's first input: nothing to send, plain weights)
            return (cast(self._tensor),), None
        joined = dim == 0 and self._joint is not None
        held = _Ahead.of(module).held("w13" if joined else self._joint[1] if self._joint is not None else 2)
        # A gather for the backward carries the transposed operands, unless the forward's are read
        # again: by a compiled graph's backward (from the storage FSDP2 refills now) or a recompute.
        in_backward = torch._C._current_graph_task_id() != -1
        transposed = in_backward and not (held.compiled or held.recompute)
        rowwise = isinstance(self._recipe, Fp8Rowwise)
        if joined:
            return self._pre_gather_joint(module, held, transposed, tuple(outer_size), dtype)
        group = mesh.get_group() if dim == 1 else None
        w, joint, ahead = self._tensor, None, None  # (w cast where read: see _quantize_shard's dtype)
        if rowwise and (transposed or group is not None):
            shards = [self._tensor]
            if self._joint is not None:
                other = self._other(module)
                joint = (other._tensor, self._joint[1])  # (CPU offload: on the CPU; cast where read)
                shards = [self._tensor, other._tensor][::1 if self._joint[1] == 0 else -1]
            ahead = (_Ahead.of(module), shards)
            if not transposed:  # (rows sharded: a forward starts the backward's column amaxes, if it gathers)
                w = w if _as_bf16(w, dtype) else cast(w)  # (fp32: its amaxes round as its values do)
                if not in_backward:
                    ahead[0].start_amax(shards, self._tensor, w, group)
                ahead, joint = None, None
        # Rows sharded: fp8_blockwise gathers its forward tiles for both passes (a tile and its
        # transpose share the scale); fp8_rowwise's column scales span the ranks (amaxes reduced).
        transposed = transposed and (dim == 0 or rowwise)
        q, s = _quantize_shard(self._recipe, w, transposed, joint, group if transposed and rowwise else None, ahead,
                               dtype)
        if dim == 1:  # (FSDP2 joins the ranks' rows of what it gathers: sent as bytes of the shard's shape)
            # (transposed: each expert's (cols, rows/n) as they are; the gather holds them side by side)
            f8, q = q.dtype, q.view(torch.uint8).view(self.shape)
            return (q,), (transposed, tuple(outer_size), joint is not None,
                          (f8, world, *_gather_row_scales(s, transposed, rowwise, group)), (held, None, False))
        if s.dim() == 2:  # fp8_rowwise: scales padded to one width, as FSDP2 sizes its buffers once
            s = torch.nn.functional.pad(s, (0, max(self.shape[1:]) - s.shape[1]))
        return (q, s), (transposed, tuple(outer_size), joint is not None, None, (held, None, False))

    def _pre_gather_joint(self, module, held: "_Held", transposed: bool, shape, dtype):
        """Sharded on the experts, W1's gather carries [W1; W3] as the layer reads it (the
        forward's interleaved by 128 rows where its GEMM computes the SwiGLU): no join
        after the gather. W3's carries 16 bytes (FSDP2 gathers every parameter)."""
        place, other = self._joint[1], self._other(module)
        if other.shape != self.shape:  # (alike on every rank: none hangs)
            raise ValueError(f"fp8_all_gather: expected {type(module).__name__}'s w1 and w3 sharded alike, got "
                             f"shards {tuple(self.shape)} and {tuple(other.shape)} (one placement for both)")
        if place == 1:
            return (self._tensor.new_zeros(16, dtype=torch.uint8),), (transposed, shape, False, None, (held, 1, False))
        interleave = not transposed and self._recipe.swiglu_in_gemm(self.shape[1], self._tensor.device)
        q, s = _quantize_shard(self._recipe, self._tensor, transposed, (other._tensor, 0), dtype=dtype, whole=True,
                               interleave=interleave)
        if s.dim() == 2:  # fp8_rowwise: row scales (E_l, 2 rows) and column scales (E_l, cols) padded to one width
            s = torch.nn.functional.pad(s, (0, max(2 * self.shape[1], self.shape[2]) - s.shape[1]))
        joint = transposed and isinstance(self._recipe, Fp8Rowwise)
        return (q, s), (transposed, shape, joint, None, (held, 0, interleave))

    def fsdp_post_all_gather(self, outputs: Tuple[Tensor, ...], metadata, param_dtype: torch.dtype, *,
                             out: Optional[Tensor] = None):
        if metadata is None:  # one rank: the weight as it is, quantized by the layer
            if out is None:
                return ShardedWeight(outputs[0], self._recipe, self._joint), outputs
            return
        transposed, shape, joint, rows, (held, part, interleaved) = metadata
        if part is not None:  # [W1; W3] in W1's gather, shared by both weights
            if part == 0:
                q, s = outputs
                held.fill(q, s.narrow(1, 0, q.shape[1]) if s.dim() == 2 else s, transposed, joint, interleaved)
            if out is not None:
                (out._local_tensor if hasattr(out, "_local_tensor") else out)._held = held
                return
            return (GatheredWeight(held, shape, param_dtype, self._recipe, part, device=outputs[0].device),
                    tuple(outputs))
        if rows is not None:  # rows sharded: the fp8 joined by FSDP2, the scales gathered beside it
            f8, n = rows[:2]
            q = outputs[0].view(f8)
            # (transposed: rank r's (cols, rows/n) of each expert, side by side: (E, cols, n, rows/n) viewed)
            q = (q.view(shape[0], n, shape[2], shape[1] // n).permute(0, 2, 1, 3) if transposed
                 else q.view(shape))
            s = _join_row_scales(*rows[2:])
        else:
            q, s_out = outputs
            s = s_out.narrow(1, 0, q.shape[1]) if s_out.dim() == 2 else s_out  # (fp8_rowwise: this orientation's)
        held.fill(q, s, transposed, joint)
        if out is not None:  # the same storage, refilled: this gather's views and orientation
            (out._local_tensor if hasattr(out, "_local_tensor") else out)._held = held
            return
        # (FSDP2 frees and reallocates the storage of what is returned: the whole outputs)
        return GatheredWeight(held, shape, param_dtype, self._recipe), tuple(outputs)


def _shard_dim(shard, whole, world: int, recipe: Recipe) -> int:
    """The dim FSDP2 shards a weight (E, rows, cols) on: 0 (whole experts a rank) or 1
    (rows: torchtitan's Shard(1) where the ranks outnumber the experts). Raises for any
    other layout, alike on every rank (none hangs)."""
    if world > 1 and shard == whole:  # (a mesh of several ranks that all hold all of it)
        raise RuntimeError("fp8_all_gather: a layer FSDP2 replicates, not shards, cannot all-gather in fp8; leave "
                           "fp8_all_gather off for it")
    if len(whole) == 3 and world > 1 and whole[1] % world == 0 and shard == (whole[0], whole[1] // world, whole[2]):
        if isinstance(recipe, Fp8Blockwise) and (whole[1] // world) % 128:
            raise ValueError(f"fp8_all_gather: expected each rank's rows of a weight sharded on its rows (Shard(1)) "
                             f"to be a multiple of 128 for fp8_blockwise (whole 128x128 tiles), got {whole[1]} rows "
                             f"over {world} ranks")
        return 1
    if len(whole) != 3 or whole[0] % world or shard != (whole[0] // world, whole[1], whole[2]):
        raise ValueError(f"fp8_all_gather: expected a weight of E experts sharded on dim 0 with E a multiple of the "
                         f"shard group's size {world}, or on its rows (Shard(1)), got {whole} sharded to {shard}")
    return 0


def _gather_row_scales(s: Tensor, transposed: bool, rowwise: bool, group):
    """Start gathering the scales of a weight sharded on its rows (fp8_rowwise's column
    scales are every rank's already): what _join_row_scales finishes."""
    if rowwise and transposed:
        return s, None, 0, 1
    world = dist.get_world_size(group)
    parts = s.new_empty((world * s.shape[0], *s.shape[1:]))
    work = dist.all_gather_into_tensor(parts, s.contiguous(), group=group, async_op=True)
    return parts, work, s.dim() - 1 if transposed else 1, world  # (blockwise transposed: its tile columns)


def _join_row_scales(parts: Tensor, work, dim: int, world: int) -> Tensor:
    """The whole weight's scales: the ranks' joined along the rows, in rank order."""
    if work is None:
        return parts
    work.wait()
    return torch.cat(parts.chunk(world), dim=dim)


def _whole(q: Tensor) -> Tensor:
    """The gathered fp8 (E, a, b): as it is, or the ranks' parts (E, a, n, b/n) joined."""
    return q if q.dim() == 3 else _join([q], 2)


def _join(qs: Sequence[Tensor], dim: int) -> Tensor:
    """fp8 (E, a_i, b_i) tensors joined along ``dim`` (1 or 2) into one contiguous tensor;
    along 2, each may be the ranks' parts (E, a, n, b/n) of a gather. One copy, moving
    the widest word that divides every run of bytes, offsets and strides."""
    if len(qs) == 1 and qs[0].dim() == 3:
        return qs[0].contiguous()
    if torch.compiler.is_compiling():  # (traced: no storage offsets; Inductor fuses the copies)
        parts = [q.reshape(q.shape[0], q.shape[1], -1).view(torch.uint8) for q in qs]
        return (parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim)).view(qs[0].dtype)
    qs = [q if q.stride(-1) == 1 else q.contiguous() for q in qs]
    widths = [q.shape[1] if dim == 1 else q.shape[-1] * (q.shape[2] if q.dim() == 4 else 1) for q in qs]
    e, a, b = qs[0].shape[0], qs[0].shape[1], qs[0].shape[-1]
    out = qs[0].new_empty((e, sum(widths), b) if dim == 1 else (e, a, sum(widths)))
    runs = [out.shape[-1], *(widths if dim == 2 else ()),
            *(n for q in qs for n in (q.shape[-1], q.storage_offset(), *q.stride()[:-1]))]
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if all(r % w.itemsize == 0 for r in runs))
    words, start = out.view(torch.uint8).view(word), 0
    for q, width in zip(qs, widths):
        src = q.view(torch.uint8).view(word)
        if dim == 1:
            words[:, start:start + width].copy_(src)
        else:
            step = word.itemsize
            words[..., start // step:(start + width) // step].view(src.shape).copy_(src)
        start += width
    return out.view(qs[0].dtype)


def _rebuild_sharded(tensor: Tensor, recipe: Recipe, joint, requires_grad: bool, is_param: bool) -> ShardedWeight:
    w = ShardedWeight(tensor.detach(), recipe, joint)
    return torch.nn.Parameter(w, requires_grad=requires_grad) if is_param else w.requires_grad_(requires_grad)


class _Held:
    """A gathered weight's fp8 and scales, (E, rows, cols) or, with ``transposed``,
    (E, cols, rows) (fp8 contiguous; for weights sharded on their rows, transposed, the
    ranks' parts as gathered: (E, cols, n, rows/n), see :func:`_whole`): shared by the
    weight and its aliases (FSDP2 makes several), and refilled by every all-gather.
    ``joint``: fp8_rowwise's backward column scales were made over both joined weights.
    Of W1 and W3 both (:meth:`ShardedWeight._pre_gather_joint`): [W1; W3], its rows
    ``interleaved`` by 128 or not. ``compiled``: a compiled graph read them since the
    gather (:meth:`GatheredWeight.__tensor_flatten__`); ``recompute``: a forward that
    activation checkpointing may run again in the backward did (:func:`note_forward_read`)."""

    __slots__ = ("q", "s", "transposed", "joint", "interleaved", "compiled", "recompute")

    def __init__(self, q: Optional[Tensor], s: Optional[Tensor], transposed: bool, joint: bool = False,
                 interleaved: bool = False):
        self.fill(q, s, transposed, joint, interleaved)

    def fill(self, q, s, transposed: bool, joint: bool = False, interleaved: bool = False) -> None:
        self.q, self.s, self.transposed, self.joint, self.interleaved = q, s, transposed, joint, interleaved
        self.compiled = self.recompute = False


def _part(h: _Held, p: int) -> Tuple[Tensor, Tensor]:
    """Weight p's fp8 and scales in a held [W1; W3] (views, but a copy where interleaved)."""
    q, s = h.q, h.s
    if h.interleaved:  # (the forward's: 128-row blocks of W1 and W3 in turn, tile rows likewise)
        e, rows, cols = q.shape
        return (q.view(e, rows // 256, 2, 128, cols)[:, :, p].reshape(e, rows // 2, cols),
                s.view(e, s.shape[1] // 2, 2, s.shape[2])[:, :, p])
    dim = 2 if h.transposed else 1
    n = q.shape[dim] // 2
    if s.dim() == 3:  # fp8_blockwise: tiles of 128 along that dim
        s = s.narrow(dim, p * n // 128, n // 128)
    elif not h.transposed:  # fp8_rowwise's row scales (its column scales span both weights)
        s = s.narrow(1, p * n, n)
    return q.narrow(dim, p * n, n), s


class GatheredWeight(Tensor):
    """An all-gathered expert weight (E, rows, cols) as fp8 data and scales in one
    orientation (:class:`_Held`): what ``moe_fp8_ext.experts`` reads instead of quantizing. It
    has the shape and dtype of the weight (its gradient is an ordinary tensor) and no
    values of its own: any op other than a view of the whole of it raises."""

    @staticmethod
    def __new__(cls, held: _Held, shape, dtype: torch.dtype, recipe: Recipe, part: Optional[int] = None,
                device=None):
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device or held.q.device)

    def __init__(self, held: _Held, shape, dtype: torch.dtype, recipe: Recipe, part: Optional[int] = None,
                 device=None):
        # part: W1 (0) or W3 (1) of a held [W1; W3]
        self._held, self._recipe, self._part = held, recipe, part

    def __repr__(self):
        return f"GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, recipe={self._recipe.name!r})"

    # Traceable: a compiled graph reads the fp8 and scales as its inputs (and saves them for
    # its backward, which reads them after FSDP2 refills their storage: see fsdp_pre_all_gather).
    def __tensor_flatten__(self):
        h = self._held
        h.compiled = True
        return ["_q", "_s"], (self._recipe, self._part, h.transposed, h.joint, h.interleaved, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        recipe, part, transposed, joint, interleaved, dtype = meta
        return GatheredWeight(_Held(inner["_q"], inner["_s"], transposed, joint, interleaved), outer_size, dtype,
                              recipe, part)

    @property
    def _q(self) -> Tensor:
        return self._held.q

    @property
    def _s(self) -> Tensor:
        return self._held.s

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._held.q.dtype

    def storage(self, transposed: bool, joined: bool = True) -> Optional[Tuple[Tensor, Tensor]]:
        """(fp8, scales) in storage order, (E, rows, cols) or transposed (E, cols, rows):
        the gathered tensors (``joined=False``: the ranks' parts as gathered, see
        :func:`_join`), or for fp8_blockwise a transposed copy where the gather carried
        the other orientation (None for fp8_rowwise: its scales differ)."""
        h = self._held
        q, s = (h.q, h.s) if self._part is None else _part(h, self._part)
        if h.transposed == transposed:
            return (_whole(q) if joined else q), s
        if isinstance(self._recipe, Fp8Blockwise):
            return q.transpose(-2, -1).contiguous(), s.transpose(-2, -1).contiguous()
        return None

    def dequantize(self) -> Tensor:
        """The gathered values in the weight's dtype, (E, rows, cols): products of fp8
        and power-of-two scales are exact there; other scales multiply in fp32."""
        h = self._held
        q, s = self.storage(h.transposed)
        exact = getattr(self._recipe, "pow2_scale", False)
        dt = self.dtype if exact else torch.float32
        if isinstance(self._recipe, Fp8Blockwise):
            s = _expand_tiles(s, q.shape[-2], q.shape[-1], 128, 128)
        else:
            s = s[..., None]
        w = (q.to(dt) * s.to(dt)).to(self.dtype)
        return w.transpose(-2, -1) if h.transposed else w

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        t = args[0] if args else None
        whole = isinstance(t, GatheredWeight) and (
            func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
            or (func is torch.ops.aten.view.default and tuple(args[1]) == tuple(t.shape))
            or (func is torch.ops.aten.as_strided.default and tuple(args[1]) == tuple(t.shape)
                and tuple(args[2]) == tuple(t.stride()) and (len(args) < 4 or args[3] in (0, None))))
        if whole:
            return GatheredWeight(t._held, t.shape, t.dtype, t._recipe, t._part, device=t.device)
        raise TypeError(f"{func}: an expert weight all-gathered in fp8 (moe_fp8_ext.fsdp) is read by "
                        "moe_fp8_ext.experts only; it holds no high-precision values")



# ---- the operands (layouts of moe_fp8_ext.blockwise and of the fp8_rowwise recipe) -----


def _quantize_shard(recipe: Recipe, w: Tensor, transposed: bool = False, joint=None,
                    group=None, ahead=None, dtype=None, *, whole: bool = False,
                    interleave: bool = False) -> Tuple[Tensor, Tensor]:
    """The weight shard (E_l, rows, cols) as the forward operand of ``w.transpose(-2,
    -1)`` in storage order, fp8 (E_l, rows, cols) and scales, both contiguous;
    ``transposed``: the backward operand, (E_l, cols, rows) and its scales. Scales:
    fp8_blockwise's 128x128 tiles, (E_l, ceil(rows/128), ceil(cols/128)), transposed for
    the backward; fp8_rowwise's one a row (E_l, rows), one a column (E_l, cols) for the
    backward, over both weights with ``joint`` (the other weight's shard, cast to w's
    dtype here, and this one's place), as the [W1; W3] input gradient reads them, and
    over every rank's rows with ``group`` (the shard group of weights sharded on their
    rows). ``ahead``: (:class:`_Ahead`, the shards in place order), what other gathers
    did for this one. ``dtype``: w cast to it first, where read (as FSDP2 casts what it
    gathers): fp32 to bf16 is read so by the quantize kernels, with no cast written.
    ``whole``: the operand of both weights of ``joint`` (the layer's [W1; W3]), the forward's
    ``interleave``d by 128 rows where asked (fp8_blockwise)."""
    f8 = recipe.default_fp8_dtype(w.device)
    as_bf16 = _as_bf16(w, dtype)
    cast = dtype is not None and not as_bf16
    rowwise_bwd = transposed and isinstance(recipe, Fp8Rowwise)
    if cast and not rowwise_bwd:
        w = w.to(dtype)  # (the rowwise backward's: where read)
    if whole and not rowwise_bwd:  # (the _cat ops: each weight read in place)
        b_ts = [p.transpose(-2, -1) for p in _parts(w, joint)]
        if isinstance(recipe, Fp8Rowwise):
            q, s = torch.ops.moe_fp8.quantize_experts_fwd_cat(b_ts, f8, recipe.pow2_scale, as_bf16)
            return q.transpose(-2, -1), s.squeeze(1)
        q, s = (torch.ops.moe_fp8.quantize_blockwise_weight_transposed_rhs_cat(b_ts, f8, as_bf16) if transposed
                else torch.ops.moe_fp8.quantize_blockwise_weight_rhs_cat(b_ts, f8, interleave, as_bf16))
        return q.transpose(-2, -1), s.transpose(-2, -1)
    if isinstance(recipe, Fp8Blockwise):
        op = (torch.ops.moe_fp8.quantize_blockwise_weight_transposed_rhs if transposed
              else torch.ops.moe_fp8.quantize_blockwise_weight_rhs)
        q, s = op(w.transpose(-2, -1), f8, as_bf16)
        return q.transpose(-2, -1), s.transpose(-2, -1)
    if not transposed:  # (the recipe's forward operand: quantize_weights of one part)
        q, s = torch.ops.moe_fp8.quantize_experts_fwd(w.transpose(-2, -1), f8, recipe.pow2_scale, as_bf16)
        return q.transpose(-2, -1), s.squeeze(1)
    start = 0 if joint is None or joint[1] == 0 else joint[0].shape[1]  # (w's first row in the parts)
    made = ahead[0].take("operand", ahead[1]) if ahead is not None and joint is not None else None
    if made is None:
        w = w.to(dtype) if cast else w
        parts = _parts(w, joint)
        if group is not None:  # one more row: each column's largest |value| on every rank (its scale's amax)
            started = ahead[0].take("amax", ahead[1]) if ahead is not None else None
            amax = _reduced(started) if started is not None else _column_amax(parts, group)
            parts[-1] = torch.cat([parts[-1], amax], dim=1)
        q, s = torch.ops.moe_fp8.quantize_experts_bwd_cat([p.transpose(-2, -1) for p in parts], f8, recipe.pow2_scale,
                                                          as_bf16)  # (the recipe's backward operand of the parts)
        made = q, s.squeeze(1)
        if ahead is not None and joint is not None:  # (the joined weight's gather takes its part)
            ahead[0].put("operand", ahead[1], made)
    if ahead is not None:
        ahead[0].backward = True
    q, s = made
    q = q.transpose(-2, -1)  # (E_l, cols, rows of the parts)
    return (q if whole else q[..., start:start + w.shape[1]].contiguous()), s


def _parts(w: Tensor, joint) -> list:
    """``w`` and the weight of ``joint`` (moved to w's device and dtype) in place order."""
    if joint is None:
        return [w]
    other = joint[0].to(device=w.device, dtype=w.dtype)
    return [w, other] if joint[1] == 0 else [other, w]


def _as_bf16(w: Tensor, dtype) -> bool:
    """Whether the quantize kernels read fp32 ``w`` as its cast to ``dtype`` (bf16)."""
    return dtype == torch.bfloat16 and w.dtype == torch.float32


def _abs_amax(w: Tensor) -> Tensor:
    """(E_l, 1, cols): each column's largest |value| over the rows, NaN where any is."""
    lo, hi = torch.aminmax(w, dim=1, keepdim=True)
    return torch.maximum(-lo, hi)


def _reduce_amax(a: Tensor, group, async_op: bool = False):
    """Start reducing the column amaxes ``a`` over ``group`` (the largest, NaN above all):
    as int32 bits, the order of non-negative floats, the positive NaN highest. What
    :func:`_reduced` finishes."""
    f = a.float()
    bits = torch.where(torch.isnan(f), torch.full_like(f, 0, dtype=torch.int32) + 0x7FFFFFFF, f.view(torch.int32))
    return bits, dist.all_reduce(bits, op=dist.ReduceOp.MAX, group=group, async_op=async_op), a.dtype


def _reduced(started) -> Tensor:
    bits, work, dtype = started
    if work is not None:
        work.wait()
    return bits.view(torch.float32).to(dtype)


def _column_amax(ws: Sequence[Tensor], group) -> Tensor:
    """(E_l, 1, cols) in the weights' dtype: each column's largest |value| over the rows
    of ``ws`` on every rank of ``group``, NaN where any is (a value of the weights: exact)."""
    a = _abs_amax(ws[0])
    for w in ws[1:]:
        a = torch.maximum(a, _abs_amax(w))
    return _reduced(_reduce_amax(a, group))


class _Ahead:
    """What one gather of an experts module's weights does for another. Sharded on the
    experts, the [W1; W3] operand W1's gather carries (:meth:`held`). Sharded on the
    rows, fp8_rowwise backward work, each entry taken once and keyed on the shards as
    weight_cache keys weights (a step or a load in between makes it stale):
    - W1's and W3's backward gathers make their joint operand once: the first makes it,
      the second takes its part;
    - once a backward has gathered, each forward gather starts reducing the column amaxes
      the next backward's reads (off its critical path)."""

    def __init__(self):
        self._entries, self.backward, self._held = {}, False, {}

    def held(self, slot) -> _Held:
        """The module's gathered weight in ``slot`` (0, 1, 2: W1, W3, W2; "w13": [W1; W3] in
        W1's gather, sharded on the experts), refilled by every gather of it."""
        if slot not in self._held:
            self._held[slot] = _Held(None, None, False)
        return self._held[slot]

    def __reduce__(self):
        return _Ahead, ()  # (copied and pickled empty: entries are not state)

    @staticmethod
    def of(module: torch.nn.Module) -> "_Ahead":
        ahead = module.__dict__.get("_moe_fp8_ahead")
        if ahead is None:
            ahead = module._moe_fp8_ahead = _Ahead()
        return ahead

    # One entry a kind and number of shards (a new one replaces it); the weak references
    # to the shards' storages keep a freed one's address from passing for it.
    def put(self, kind: str, shards: Sequence[Tensor], value) -> None:
        keys = [_key(t) for t in shards]
        self._entries[kind, len(shards)] = ([k for k, _ in keys], [r for _, r in keys], value)

    def take(self, kind: str, shards: Sequence[Tensor]):
        got = self._entries.pop((kind, len(shards)), None)
        if got is None or any(r.expired() for r in got[1]) or got[0] != [_key(t)[0] for t in shards]:
            return None
        return got[2]

    def start_amax(self, shards: Sequence[Tensor], mine: Tensor, w: Tensor, group) -> None:
        """A forward gather's share: the column amaxes of ``w`` (the shard ``mine`` as the
        gather reads it), reduced over the ranks with the joined weight's once both are in."""
        if not self.backward:
            return
        a = _abs_amax(w)
        if len(shards) > 1:
            other = self.take("part", [t for t in shards if t is not mine])
            if other is None:
                self.put("part", [mine], a)
                return
            a = torch.maximum(a, other)
        self.put("amax", shards, _reduce_amax(a, group, async_op=True))


def _cat(ts: Sequence[Tensor], dim: int) -> Tensor:
    return ts[0].contiguous() if len(ts) == 1 else torch.cat(ts, dim)


def _operand(ws: Sequence[GatheredWeight], transposed: bool) -> Tuple[Tensor, Tensor]:
    # The weights' storages joined along the operand's N ((E, rows, cols): dim 1;
    # transposed, (E, cols, rows): dim 2), as the operand's transposed view.
    recipe, h = ws[0]._recipe, ws[0]._held
    if [w._part for w in ws] == [0, 1] and ws[1]._held is h and h.transposed == transposed:
        # [W1; W3] as W1's gather carried it
        if isinstance(recipe, Fp8Rowwise):
            return h.q.transpose(-2, -1), h.s
        operand = h.q.transpose(-2, -1), h.s.transpose(-2, -1)
        return W13Interleaved(*operand) if h.interleaved else operand
    parts = [w.storage(transposed, joined=False) for w in ws]
    if isinstance(recipe, Fp8Rowwise) and transposed and len(ws) > 1 and not all(w._held.joint for w in ws):
        parts = [None]  # (column scales not made over the joined weights: quantized again below)
    if any(p is None for p in parts):  # (fp8_rowwise gathered for the other pass: quantized again)
        f8 = ws[0].fp8_dtype
        if transposed and recipe.pow2_scale and torch.compiler.is_compiling():
            return _requantized_columns(ws, f8)
        b_ts = [w.dequantize().transpose(-2, -1) for w in ws]
        return recipe.quantize_weights(b_ts, f8, fwd=not transposed, bwd=transposed)[int(transposed)]
    dim = 2 if transposed else 1
    q = _join([p[0] for p in parts], dim)
    if isinstance(recipe, Fp8Blockwise):
        return q.transpose(-2, -1), _cat([p[1] for p in parts], dim).transpose(-2, -1)
    # fp8_rowwise: row scales (E, rows) joined along the rows; column scales, one set over
    # all the weights (quantized together, _quantize_shard's joint)
    scales = [parts[0][1]] if transposed else [p[1] for p in parts]
    return q.transpose(-2, -1), _cat(scales, 1)


def _requantized_columns(ws: Sequence[GatheredWeight], f8: torch.dtype) -> Tuple[Tensor, Tensor]:
    """fp8_rowwise's backward operand of weights gathered for the forward, traced: the
    spec's ops (``reference``, which the kernels match bit for bit) on the dequantized
    values, which Inductor computes from the fp8 where they are read, holding no copy.
    For power-of-two scales only: the products are then exact, and so is Inductor's
    fp32 arithmetic (it keeps bf16 intermediates unrounded)."""
    vs = [w.dequantize() for w in ws]  # (E, rows_i, cols)
    amax = functools.reduce(torch.maximum, [reference.amax(v, 1) for v in vs])  # (each column over all rows)
    s, dec = reference.scales_from_amax(amax, f8, True)
    q = _cat([reference.encode(v, s, f8).transpose(-2, -1) for v in vs], 2)  # (E, cols, Σrows), contiguous
    return q.transpose(-2, -1), dec.squeeze(1)


def rhs_fwd(ws: Sequence[GatheredWeight]) -> Tuple[Tensor, Tensor]:
    """The recipe's forward operand (``quantize_weights``) of the weights' transposes (each
    (E, K, N_i), N_i the weight's rows), from their gathered fp8 (a copy where more than one)."""
    return _operand(ws, False)


def rhs_bwd(ws: Sequence[GatheredWeight]) -> Tuple[Tensor, Tensor]:
    """The recipe's input-gradient operand of the same."""
    return _operand(ws, True)


DTENSOR_EAGER_REASON = ("moe_fp8_ext: expert weights set up for the fp8 all-gather inside a DTensor are not traced "
                        "(torchtitan 0.3.0's are not DTensors); the experts layer runs them eagerly")


def in_dtensor(w) -> bool:
    """Whether ``w`` is a DTensor holding a weight set up for, or made by, the fp8 all-gather."""
    return isinstance(getattr(w, "_local_tensor", None), (ShardedWeight, GatheredWeight))


def gathered_weights(recipe: Recipe, fp8_dtype: torch.dtype, ws: Sequence[Tensor]) -> bool:
    """Whether the experts layer's weights ``ws`` came from an fp8 all-gather (all or
    none of them; made for ``recipe`` and ``fp8_dtype``, else an error)."""
    gathered = [isinstance(w, GatheredWeight) for w in ws]
    if not any(gathered):
        return False
    if not all(gathered):
        raise TypeError("experts: expected w1, w3 and w2 all all-gathered in fp8 (moe_fp8_ext.fsdp.fp8_all_gather) "
                        "or none of them")
    for w in ws:
        if w._recipe != recipe or w.fp8_dtype != fp8_dtype:
            raise ValueError(f"experts: expected weights all-gathered for recipe {recipe.name!r} in {fp8_dtype}, got "
                             f"{w._recipe.name!r} in {w.fp8_dtype}")
    hidden = ws[0].shape[1]
    if isinstance(recipe, Fp8Blockwise) and hidden % 128:
        raise ValueError(f"experts: expected a hidden size that is a multiple of 128 for weights all-gathered in fp8, "
                         f"got {hidden}")
    return True


def note_forward_read(ws: Sequence[GatheredWeight]) -> None:
    """An eager forward reads the gathered weights ``ws``. Where activation checkpointing
    may run it again in the backward (saved-tensor hooks on; grad off, as the reentrant
    form runs it; a recompute itself), the backward's gather carries the forward's
    operands again, so the recompute runs the forward's ops on its bits (selective
    checkpointing replays them)."""
    if not torch.is_grad_enabled() or saved_tensor_hooks_on() or torch._C._current_graph_task_id() != -1:
        for w in ws:  # (inside a backward: a recompute, whose module may run forward again first)
            w._held.recompute = True


def _plain_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """The weights' state_dict entries as the high-precision tensors they hold (sharing
    their storage, so a checkpoint load into them lands in the weights)."""
    for key, v in list(state_dict.items()):
        if not key.startswith(prefix) or isinstance(v, torch.nn.Parameter):  # (keep_vars: the parameters)
            continue
        local = _local(v)
        if isinstance(local, ShardedWeight):
            state_dict[key] = local._tensor if local is v else _rewrap(v, local._tensor)


def _as_sharded(t: Tensor, recipe: Recipe, joint) -> Optional[Tensor]:
    """``t`` (a tensor, or a DTensor: its shard) as a ShardedWeight; None where it is one."""
    local = _local(t)
    if isinstance(local, ShardedWeight):
        return None
    w = ShardedWeight(local.detach(), recipe, joint)
    return w if local is t else _rewrap(t, w)


def _wrap_assigned(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs,
                   *, wraps) -> None:
    """``load_state_dict(..., assign=True)`` (``set_model_state_dict`` into a meta-device
    model) makes the loaded tensors the weights: wrapped as ``fp8_all_gather`` wrapped
    them (``wraps``: name -> (recipe, joint))."""
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    for n, (recipe, joint) in wraps.items():
        v = state_dict.get(prefix + n)
        w = _as_sharded(v, recipe, joint) if isinstance(v, Tensor) else None
        if w is not None:
            state_dict[prefix + n] = w


def check_wrapped(module: torch.nn.Module, ws: Sequence[Tensor]) -> None:
    """Raise where ``module`` was set up for the fp8 all-gather but its weights lost
    the wrapper on the way (a parallelization that rebuilt them): FSDP2 would gather
    them in bf16."""
    if getattr(module, "moe_fp8_all_gather", False):
        for w in ws:
            local = w._local_tensor if hasattr(w, "_local_tensor") else w
            if not isinstance(local, (ShardedWeight, GatheredWeight)):
                raise RuntimeError(f"fp8_all_gather: {type(module).__name__}'s weights are no longer fp8-gathered "
                                   f"weights ({type(local).__name__}): something rebuilt them after fp8_all_gather; "
                                   "call it after that (before fully_shard)")


# ---- set-up ----------------------------------------------------------------------------


def _expert_weights(module: torch.nn.Module):
    """(recipe, parameter names) of an experts module: moe_fp8_ext.GroupedExperts or a
    torchtitan GroupedExperts converted by moe_fp8_ext.integrations.torchtitan."""
    if hasattr(module, "moe_fp8_recipe"):  # (shared experts converted have no such weights: FSDP2 gathers them in bf16)
        return (module.moe_fp8_recipe, ("w1_EFD", "w3_EFD", "w2_EDF")) if hasattr(module, "w1_EFD") else (None, ())
    from .experts import GroupedExperts

    if isinstance(module, GroupedExperts):
        return module.recipe, ("w1", "w3", "w2")
    return None, ()


def check_recipe(recipe: Recipe, op: str) -> None:
    if not isinstance(recipe, (Fp8Blockwise, Fp8Rowwise)):
        raise ValueError(f"{op}: expected recipe fp8_blockwise or fp8_rowwise for the fp8 all-gather, got "
                         f"{recipe.name!r}")


def check_module(module: torch.nn.Module, recipe: Recipe, names: Sequence[str], where: str) -> None:
    """What the fp8 all-gather needs of an experts module, before anything changes."""
    check_recipe(recipe, "fp8_all_gather")
    ws = [getattr(module, n) for n in names]
    for n, w in zip(names, ws):
        if w.dim() != 3:
            raise ValueError(f"fp8_all_gather: expected {where}.{n} to be 3-D (E, rows, cols), got {tuple(w.shape)}")
    # Under tensor parallelism (Shard(1) over n ranks) each rank's part: decided alike on every rank
    n = 1
    for p, size in zip(getattr(ws[0], "placements", ()), getattr(getattr(ws[0], "device_mesh", None), "shape", ())):
        n *= size if getattr(p, "dim", None) == 1 else 1
    if isinstance(recipe, Fp8Blockwise) and ws[0].shape[1] % (128 * n):
        raise ValueError(f"fp8_all_gather: {where} has a hidden size of {ws[0].shape[1]} over {n} tensor-parallel "
                         "rank(s), expected each rank's part a multiple of 128 (W1 and W3 joined at tile boundaries)")
    if _fsdp_params(module):
        raise RuntimeError(f"fp8_all_gather: {where} is already sharded by FSDP2; call it before fully_shard")


def fp8_all_gather(model: torch.nn.Module) -> int:
    """Make the expert weights of every experts module in ``model`` (the model itself
    included: ``moe_fp8_ext.GroupedExperts``, or torchtitan's converted by
    ``moe_fp8_ext.integrations.torchtitan``) all-gather in fp8 under FSDP2; returns how
    many modules. Call it before ``fully_shard``. Raises for a recipe other than
    fp8_blockwise or fp8_rowwise, fp8_blockwise with a hidden size that is not a
    multiple of 128, a module that reuses its quantized weights, and weights already
    sharded by FSDP2."""
    found = []
    for fqn, m in model.named_modules():
        recipe, names = _expert_weights(m)
        if recipe is None:
            continue
        where = fqn or "the model"
        check_module(m, recipe, names, where)
        if getattr(m, "moe_fp8_weight_cache", getattr(m, "weight_cache", None)) is not None:
            raise ValueError(f"fp8_all_gather: {where} reuses its quantized weights (reuse_weights=True); with the fp8 "
                             "all-gather the gathered operands are what is reused, while FSDP2 keeps them unsharded")
        found.append((m, names, recipe))
    for m, names, recipe in found:
        m.moe_fp8_all_gather = True
        joints = {names[0]: (names[1], 0), names[1]: (names[0], 1)}  # (w1 and w3)
        if not getattr(m, "_moe_fp8_state_dict_hook", False):
            m.register_state_dict_post_hook(_plain_state_dict)
            wraps = {n: (recipe, joints.get(n)) for n in names}
            m.register_load_state_dict_pre_hook(functools.partial(_wrap_assigned, wraps=wraps))
            m._moe_fp8_state_dict_hook = True
        for n in names:  # (a DTensor, expert parallelism: its local shard wrapped)
            w = getattr(m, n)
            data = _as_sharded(w, recipe, joints.get(n))
            if data is not None:
                setattr(m, n, torch.nn.Parameter(data, requires_grad=w.requires_grad))
    return len(found)
