"""FP8 token dispatch (DESIGN §12): tokens are quantized once, before they are copied to
their k experts, into the W13 forward GEMM's left operand. With expert parallelism they
cross the all-to-all as fp8 data with their scales (fp8_blockwise: 1x128 blocks, about
52% of bf16's bytes; fp8_rowwise: one scale a row, about 50%); without it (no splits)
the fp8 rows are gathered locally. The combine and the backward's gradient all-to-all
stay bf16, as in DeepSeek-V3.

    rows = fp8_dispatch(x, token_idx, recipe, group, input_splits, output_splits, perm)
    rows = fp8_dispatch(x, token_idx, recipe)  # no splits: local, rows[j] = x[token_idx[j]]
    out = moe_fp8_ext.experts(rows, w1, w3, w2, offs, recipe=recipe)

``rows`` is an :class:`Fp8Rows`: it has the shape and dtype of the bf16 rows it
replaces, is read by :func:`moe_fp8_ext.experts` as its forward operand as is, and its
gradient (bf16) flows back through the reverse all-to-all to x, where each token's rows
are summed in one pass (``sum_rows``: the bits of autograd's backward of
``x[token_idx]``, without its sort of the gradient rows). W1/W3's weight gradient
needs x in the other orientation (128x1 blocks per token group for fp8_blockwise, one
scale per group and column for fp8_rowwise): the experts layer makes it from the
dispatched values, dequantized (the values the forward GEMM read; a second rounding to
fp8, as DeepSeek-V3 requantizes its cached 1x128 activations). The forward output and
the input gradient are the bits of the bf16 dispatch; W1's and W3's gradients are
within a second fp8 rounding of them.

Without fp8, :func:`gather` makes the same rows in bf16, with x's gradient summed in
one pass as above. The combine (:func:`combine`, bf16) weights each returned row by its
routing score and sums each token's rows in one pass (``combine_rows``), with the bits of
torchtitan's combine on CUDA, without its copies and sort of the rows; its backward is
one pass too (``combine_rows_backward``).

Both trace under ``torch.compile(fullgraph=True)`` (torchtitan compiles its blocks so):
``Fp8Rows`` is a traceable tensor subclass, the all-to-all is the functional collective,
and the split sizes may be unbacked ints (read to the host in the graph). A graph break
between the dispatch and the experts layer (FSDP2's hooks of an experts module sharded
on its own) works too: the rows' gradient is an ``Fp8Rows`` holding it, the type a
compiled graph's backward takes for its output.
"""

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor

from .ops._checks import _require
from .recipes import Fp8Blockwise, Fp8Rowwise, Recipe, get_recipe

__all__ = ["Fp8Rows", "combine", "fp8_dispatch", "fp8_rows_operand", "gather"]

_ops = torch.ops.moe_fp8


def _check_recipe(recipe: Union[str, Recipe], op: str) -> Recipe:
    """The recipe (a name or a Recipe): fp8_blockwise or fp8_rowwise, else ValueError."""
    recipe = get_recipe(recipe, op)
    if not isinstance(recipe, (Fp8Blockwise, Fp8Rowwise)):
        raise ValueError(f"{op}: expected recipe fp8_blockwise or fp8_rowwise for an fp8 dispatch, got {recipe.name!r}")
    return recipe


def _quantize_rows(recipe: Recipe, x: Tensor, fp8_dtype) -> Tuple[Tensor, Tensor]:
    """x (T, D) as the recipe's left operand, as row-indexed tensors: uint8 (T, D) and
    fp32 row-major scales (T, c)."""
    q, s = recipe.quantize(x, fp8_dtype)[0]
    s = s.contiguous() if s.dim() == 2 else s[:, None]  # (blockwise's is column-major)
    return q.view(torch.uint8), s.contiguous()


def _lhs(recipe: Recipe, q: Tensor, s: Tensor) -> Tuple[Tensor, Tensor]:
    """The recipe's left operand from the row-indexed tensors."""
    if isinstance(recipe, Fp8Blockwise):
        return q, s.t().contiguous().t()
    return q, s[:, 0].contiguous()


def _whole(t: Tensor, size) -> bool:
    """Whether a view of ``t`` to ``size`` is t itself."""
    return list(size) == list(t.shape) or (len(size) == t.dim() and sum(d == -1 for d in size) == 1
                                           and all(d in (-1, n) for d, n in zip(size, t.shape)))


_GRADIENT = ""  # (made_for of an Fp8Rows that is the rows' gradient, a plain tensor in a wrapper)


class Fp8Rows(Tensor):
    """Dispatched token rows (R, D) as the recipe's fp8 left operand: what
    :func:`moe_fp8_ext.experts` reads instead of quantizing. Shape and dtype are those
    of the bf16 rows; it has no values of its own (any op on it raises).

    Their gradient is an Fp8Rows too, holding it in the rows' dtype (:meth:`gradient`;
    any op reads it as that tensor): a compiled graph whose output the rows are (a graph
    break before the experts layer) takes a gradient of the output's type."""

    @staticmethod
    def __new__(cls, q: Tensor, s: Tensor, dtype: torch.dtype, recipe: Recipe):
        return Tensor._make_wrapper_subclass(cls, q.shape, dtype=dtype, device=q.device)

    def __init__(self, q: Tensor, s: Tensor, dtype: torch.dtype, recipe: Recipe):
        # q in its fp8 dtype; s row-major (R, c); made for the recipe's kind (its name: a
        # string, where dynamo may make a recipe's int fields symbolic)
        self._q, self._s, self._made_for = q, s, recipe.name

    @staticmethod
    def _make(q: Tensor, s: Tensor, dtype: torch.dtype, made_for: str) -> "Fp8Rows":
        t = Tensor._make_wrapper_subclass(Fp8Rows, q.shape, dtype=dtype, device=q.device)
        t._q, t._s, t._made_for = q, s, made_for
        return t

    @staticmethod
    def gradient(g: Tensor) -> "Fp8Rows":
        """The rows' gradient ``g`` (R, D) in its wrapper."""
        return _gradient(g)

    def __tensor_flatten__(self):  # (traceable: dynamo and AOT autograd see q and s)
        return ["_q", "_s"], (self.dtype, self._made_for)

    # A compiled graph's backward takes its outputs' gradients in the form these say.
    def __coerce_tangent_metadata__(self):
        return self if self._made_for == _GRADIENT else Fp8Rows.gradient(torch.empty_like(self._q, dtype=self.dtype))

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        same = self._made_for == _GRADIENT and expected_metadata == (self.dtype, _GRADIENT)
        return self if same and expected_type in (None, Fp8Rows) else None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8Rows._make(inner["_q"], inner["_s"], *meta)

    def __repr__(self):
        if self._made_for == _GRADIENT:
            return f"Fp8Rows(gradient={self._q!r})"
        return f"Fp8Rows(shape={tuple(self.shape)}, dtype={self.dtype}, recipe={self._made_for!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        t = args[0] if args else None
        # Aliases pass: detach, and the whole view autograd makes of a Function's input returned as is (FSDP2's
        # hook on the inputs of a module it wraps).
        if isinstance(t, Fp8Rows) and (func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) or (
                func == torch.ops.aten.view.default and _whole(t, args[1]))):
            return Fp8Rows._make(t._q, t._s, t.dtype, t._made_for)
        leaves = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Fp8Rows)]
        if all(a._made_for == _GRADIENT for a in leaves):  # (gradients compute as the tensors they hold)
            args, kwargs = pytree.tree_map_only(Fp8Rows, lambda a: a._q, (args, kwargs or {}))
            return func(*args, **kwargs)
        raise TypeError(f"{func}: token rows dispatched in fp8 (moe_fp8_ext.dispatch) are read by "
                        "moe_fp8_ext.experts only; they hold no high-precision values")

    def dequantize(self) -> Tensor:
        """The values the forward GEMM reads (fp32 products), in the rows' dtype."""
        q, s = self._q, self._s
        if q.shape[1] == 0:
            return q.new_empty(q.shape, dtype=self.dtype)
        return _ops.dequantize_rows(q, s, 128 if s.shape[1] > 1 else q.shape[1], self.dtype)


@torch._dynamo.allow_in_graph  # (in the graph as one call: dynamo does not trace a wrapper's construction)
def _gradient(g: Tensor) -> Fp8Rows:
    return Fp8Rows._make(g, g.new_empty((g.shape[0], 0), dtype=torch.float32), g.dtype, _GRADIENT)


def fp8_rows_operand(recipe: Recipe, fp8_dtype: torch.dtype, x: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """The experts layer's forward left operand where ``x`` is :class:`Fp8Rows` (made
    for ``recipe`` and ``fp8_dtype``, else an error); None for any other tensor."""
    if not isinstance(x, Fp8Rows):
        return None
    if x._made_for != recipe.name or x._q.dtype != fp8_dtype:
        raise ValueError(f"experts: expected rows dispatched for recipe {recipe.name!r} in {fp8_dtype}, "
                         f"got {x._made_for!r} in {x._q.dtype}")
    return _lhs(recipe, x._q, x._s)


def _all_to_all(t: Tensor, out_splits: List[int], in_splits: List[int], group_name: str) -> Tensor:
    # (the functional collective, by group name: traceable, where a process group is not)
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_to_all_single(t.contiguous(), out_splits, in_splits, group_name))


def _token_rows(token_idx: Tensor, num_tokens: int) -> Tuple[Tensor, Tensor]:
    """The rows of each token of ``token_idx`` (int32, -1: none), ascending: row indices
    and their ends per token, for ``sum_rows`` and ``combine_rows``."""
    token, rows = torch.sort(token_idx, stable=True)
    ends = torch.searchsorted(token, torch.arange(1, num_tokens + 1, dtype=token.dtype, device=token.device),
                              out_int32=True)
    return torch.where(token >= 0, rows.to(torch.int32), -1), ends  # (a -1 token, a padding row: nothing)


def _gather_backward(grad: Tensor, token_idx: Tensor, num_tokens: int) -> Tensor:
    """x's gradient for rows ``x[token_idx]`` (-1: a zero row): each token's rows summed in
    ascending order (the sums of autograd's index_put with accumulate), in one pass."""
    return _ops.sum_rows(grad, *_token_rows(token_idx, num_tokens))


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_idx):
        ctx.num_tokens = x.shape[0]
        ctx.save_for_backward(token_idx)
        return x[token_idx.long()]

    @staticmethod
    def backward(ctx, grad):
        (token_idx,) = ctx.saved_tensors
        return _gather_backward(grad.contiguous(), token_idx, ctx.num_tokens), None


def gather(x: Tensor, token_idx: Tensor) -> Tensor:
    """The rows ``x[token_idx]`` (x (T, D), ``token_idx`` (N,) int32 or int64 in [0, T)),
    differentiable in x: its gradient sums each token's rows in ascending order in one
    pass (``sum_rows``), the sums of autograd's ``index_put`` without its sort of the rows."""
    if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        got = f"a {x.dim()}-D {x.dtype} tensor" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"gather: expected x a 2-D bf16, fp16 or fp32 tensor, got {got}")
    if not isinstance(token_idx, Tensor) or token_idx.dim() != 1 or token_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gather: expected token_idx 1-D int32 or int64, got {getattr(token_idx, 'dtype', token_idx)}")
    return _Gather.apply(x, token_idx.to(torch.int32))


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, scores, token_idx, num_tokens):
        ctx.save_for_backward(y, scores, token_idx)
        return _ops.combine_rows(y, scores, *_token_rows(token_idx, num_tokens))

    @staticmethod
    def backward(ctx, grad):
        y, scores, token_idx = ctx.saved_tensors
        grad_y, grad_scores = _ops.combine_rows_backward(grad.contiguous(), y, scores, token_idx)
        return grad_y, grad_scores, None, None


def combine(y: Tensor, scores: Tensor, token_idx: Tensor, num_tokens: int) -> Tensor:
    """``out[t]`` = the sum over rows j of token t (``token_idx[j] == t``; -1: no token) of
    ``y[j] * scores[j]``: torchtitan's combine (the product in fp32, rounded to y's dtype,
    the terms added in ascending j, each sum rounded: the bits of its CUDA deterministic
    scatter_add for rows of more than 64 elements), in one pass forward and one
    backward. Differentiable in y and scores (any float dtype; the product is fp32)."""
    if not isinstance(y, Tensor) or y.dim() != 2 or y.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"combine: expected y a 2-D bf16, fp16 or fp32 tensor, got {getattr(y, 'shape', y)}")
    def shapes():
        return (f"combine: expected scores (float) and token_idx of shape ({y.shape[0]},), got {scores.dtype} "
                f"{tuple(scores.shape)} and {tuple(token_idx.shape)}")

    if scores.dim() != 1 or token_idx.dim() != 1 or not scores.is_floating_point():
        raise ValueError(shapes())
    for n in (scores.shape[0], token_idx.shape[0]):  # (y's rows may come from an all-to-all: unbacked)
        _require(n == y.shape[0], shapes, ValueError)
    if token_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"combine: expected token_idx int32 or int64, got {token_idx.dtype}")
    return _Combine.apply(y, scores.float(), token_idx.to(torch.int32), num_tokens)


# In the graph as one node: dynamo would trace its backward with a gradient of the
# output's type (Fp8Rows); autograd gives it a plain one.
@torch._dynamo.allow_in_graph
class _Fp8Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_idx, recipe, fp8_dtype, group_name, in_splits, out_splits, perm):
        ctx.group_name, ctx.in_splits, ctx.out_splits = group_name, in_splits, out_splits
        ctx.num_tokens, ctx.local = x.shape[0], in_splits is None
        ctx.received = token_idx.shape[0] if ctx.local else sum(out_splits)
        ctx.save_for_backward(token_idx, perm)
        q, s = _quantize_rows(recipe, x, fp8_dtype)  # each token once, before its k copies
        q, s = _ops.gather_rows(q, token_idx), _ops.gather_rows(s, token_idx)
        if not ctx.local:
            q, s = (_all_to_all(t, out_splits, in_splits, group_name) for t in (q, s))
        if perm is not None:
            q, s = _ops.gather_rows(q, perm), _ops.gather_rows(s, perm)
        return Fp8Rows(q.view(fp8_dtype), s, x.dtype, recipe)

    @staticmethod
    def backward(ctx, grad):
        token_idx, perm = ctx.saved_tensors
        if isinstance(grad, Fp8Rows) and grad._made_for == _GRADIENT:  # (see Fp8Rows.gradient)
            grad = grad._q
        grad = grad.contiguous()
        if perm is not None:
            grad = _ops.scatter_rows(grad, perm, ctx.received)
        if not ctx.local:
            grad = _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group_name)
        return _gather_backward(grad, token_idx, ctx.num_tokens), None, None, None, None, None, None, None


def fp8_dispatch(x: Tensor, token_idx: Tensor, recipe: Union[str, Recipe], group=None, input_splits: Optional[List[int]] = None,
                 output_splits: Optional[List[int]] = None, perm: Optional[Tensor] = None, fp8_dtype=None) -> Fp8Rows:
    """Send the rows ``x[token_idx]`` (x (T, D) this rank's tokens, ``token_idx`` int32
    (N,), the token of each routed row in send order) to the ranks of ``group`` in fp8:
    ``input_splits``/``output_splits`` as for ``all_to_all_single``; ``perm`` int32
    (optional) reorders the received rows (``y[j] = received[perm[j]]``, -1: a zero
    row). Without splits (and group) the rows stay local: ``y[j] = x[token_idx[j]]``.
    Returns the rows as :class:`Fp8Rows`, differentiable in x (its gradient comes back
    through the reverse all-to-all in x's dtype)."""
    recipe = _check_recipe(recipe, "fp8_dispatch")
    if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_dispatch: expected x a 2-D bf16, fp16 or fp32 tensor, got {getattr(x, 'shape', x)}")
    for name, t in (("token_idx", token_idx), ("perm", perm)):
        if t is not None and (t.dtype != torch.int32 or t.dim() != 1):
            raise ValueError(f"fp8_dispatch: expected {name} int32 1-D, got {t.dtype} {tuple(t.shape)}")
    local = input_splits is None and output_splits is None
    if local and group is not None:
        raise ValueError("fp8_dispatch: expected input_splits and output_splits with a group")
    if not local and (input_splits is None or output_splits is None):
        raise ValueError("fp8_dispatch: expected both input_splits and output_splits, or neither (a local dispatch)")
    if not local:  # (under torch.compile the splits may be unbacked ints: then a run-time assert)
        _require(sum(input_splits) == token_idx.shape[0], lambda: (
            f"fp8_dispatch: expected input_splits summing to {token_idx.shape[0]} (the rows sent), "
            f"got {sum(input_splits)}"), ValueError)
    f8 = fp8_dtype or recipe.default_fp8_dtype(x.device)
    splits = (None, None) if local else (list(input_splits), list(output_splits))
    group_name = None if local else (group or dist.group.WORLD).group_name
    return _Fp8Dispatch.apply(x, token_idx, recipe, f8, group_name, *splits, perm)
