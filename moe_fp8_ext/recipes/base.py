"""The :class:`Recipe` protocol that :func:`moe_fp8_ext.grouped_mm` and the experts
layer drive, the registry of recipes by name, and the emulated grouped GEMMs
(dequantized operands, fp32 accumulation) every recipe can fall back to.
"""

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import swiglu as _sw
from ..platform import default_fp8_dtype

_ops = torch.ops.moe_fp8


def _zero_tail(out: Tensor, offs: Tensor) -> Tensor:
    """Rows past offs[-1] are zero (for the grouped GEMMs that leave them unwritten;
    zeroing only touches those rows). In place in eager mode. Under torch.compile the
    zeroing goes on a copy: an in-place op on this Function's fp32 output dropped every
    gradient with torch 2.11 (CPU and CUDA, aot_eager and inductor alike)."""
    if torch.compiler.is_compiling():
        out = out.clone()
    _ops.zero_rows_past_groups_(out, offs)
    return out


#: Opaque to grouped_mm: whatever a recipe's quantize returns and its GEMMs consume
#: (a tensor, or a tuple of data and scales in the recipe's own layout).
Operand = Any

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


#: ``colwise=`` / ``bwd=``: that operand only where the same read of the tensor makes it (else None).
SAME_READ = "same_read"

#: A token-grouped tensor's groups: ``(offs, padded_starts)``; ``padded_starts`` (from
#: ``ops.padded_group_offsets``) lays weight-gradient operands out padded (DESIGN §8), None: not.
Groups = Tuple[Tensor, Optional[Tensor]]


def check_fields(recipe, bools: Sequence[str] = (), choices: Optional[Dict[str, Sequence[Any]]] = None) -> None:
    """A built-in recipe's fields at construction: ``bools`` are bools, ``choices`` in
    their lists, and the alignment a power-of-two multiple of the class's own (the group
    size its kernels need; not while tracing, where dynamo may rebuild a recipe with a
    symbolic alignment, one already checked)."""
    cls = type(recipe).__name__
    for f in bools:
        if not isinstance(getattr(recipe, f), bool):
            raise TypeError(f"{cls}: expected {f} to be a bool, got {getattr(recipe, f)!r}")
    for f, ok in (choices or {}).items():
        if getattr(recipe, f) not in ok:
            raise ValueError(f"{cls}: expected {f} in {tuple(ok)}, got {getattr(recipe, f)!r}")
    want, a = next(f.default for f in dataclasses.fields(recipe) if f.name == "alignment"), recipe.alignment
    if torch.compiler.is_compiling():
        return
    if isinstance(a, bool) or not isinstance(a, int) or a < want or a % want or a & (a - 1):
        raise ValueError(f"{cls}: expected alignment a power of two multiple of {want} (what its kernels need), "
                         f"got {a!r}")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How the grouped GEMMs of :func:`moe_fp8_ext.grouped_mm` and the experts layer run:
    the operands' scales, the group alignment and the GEMMs. A recipe is a frozen
    dataclass (hashable: ``torch.compile`` treats it as a constant) whose fields are what
    a user sets (``Fp8Rowwise(pow2_scale=False)``); ``dataclasses.replace`` makes a variant.

    The products, with A (M, K), B_t (E, K, N), grad_out (M, N), token groups along M::

        forward  out    = mm_2d3d(quantize(A).rowwise,        quantize_weights(B_t).fwd)
        dgrad    grad_A = mm_2d3d(quantize(grad_out).rowwise, quantize_weights(B_t).bwd)
        wgrad    grad_B = mm_2d2d(quantize(grad_out).colwise, quantize(A).colwise)   (E, N, K)

    - **One call per tensor** asks for the orientations it needs. ``quantize(x, ...,
      rowwise, colwise)``: x (M, D) grouped along its rows; rowwise is a GEMM's left
      operand (contracted over D), colwise the weight gradient's (contracted over the
      tokens of each group, padded with ``groups``' starts). ``quantize_weights(b_ts,
      ..., fwd, bwd)``: weights (E, K, N_i) joined along N; fwd contracted over K, bwd
      over N (the input gradient). ``colwise=SAME_READ`` / ``bwd=SAME_READ``: only where
      the read that makes the other makes it too (else None); the recipe knows its kernels.
    - **Operands are opaque**: a tensor or a tuple of tensors, read only by the recipe's
      GEMMs. ``mm_2d3d`` writes zeros in the rows past ``offs[-1]``.
    - **Fused variants** have defaults built from the above: ``quantize_swiglu(_backward)``,
      ``quantize_colwise_pair``, ``mm_2d2d_parts``, the experts layer's W13 GEMM with its
      SwiGLU, ``quantize_w13`` then ``mm_2d3d_swiglu`` (which may read its own layout), and
      its W2 input-gradient GEMM with the dSwiGLU, ``mm_2d3d_dswiglu``.
    - **Where it runs**: ``backend(device)`` names the GEMM path, or ``"emulated"``
      (dequantize, fp32 grouped GEMM: :func:`emulated_grouped_mm_2d3d`); a recipe never
      falls back to bf16 math silently. ``alignment``: the group-size multiple of the
      weight gradient's GEMM (1: any, no padded layout), and of the M groups too where
      ``pads_token_groups``. ``fp8_dtype`` arrives resolved (one of ``fp8_dtypes``).
    - No method syncs with the host; each traces under ``torch.compile(fullgraph=True)``.
    """

    name: str
    alignment: int = 1

    # Class attributes, not fields (no annotation: a field's place in the constructor would follow the base's).
    #: What the GEMMs compute in ("fp8", "bf16"): for messages; the torchtitan converter casts a "bf16" recipe's inputs.
    precision = "fp8"
    #: Whether a forward may make a weight's input-gradient operand (``bwd=SAME_READ``) and hold it until the
    #: backward; a field of Fp8Rowwise and Fp8Blockwise. False: the backward quantizes the weight again.
    hold_weight_operands = False

    # ---- where and how it runs -----------------------------------------------------
    def backend(self, device: torch.device) -> str:
        """The name of the GEMM path that runs on ``device``."""
        return "emulated"

    def out_dtypes(self, backend: str, in_dtype: torch.dtype) -> Tuple[torch.dtype, ...]:
        """The dtypes the GEMM of ``backend`` can write, for inputs of ``in_dtype``."""
        return FLOAT_DTYPES

    def default_out_dtype(self, in_dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16

    def fp8_dtypes(self, backend: str, device: torch.device) -> Tuple[torch.dtype, ...]:
        """The fp8 dtypes accepted for ``fp8_dtype``; empty: it must be None."""
        return ()

    def default_fp8_dtype(self, device: torch.device) -> Optional[torch.dtype]:
        return default_fp8_dtype(device if device.type == "cuda" else None) if self.fp8_dtypes("emulated", device) else None

    def check_inputs(self, A: Tensor, B_t: Tensor) -> None:
        """Recipe-specific checks on top of grouped_mm's: raise ``ValueError("grouped_mm: expected ...")``."""

    def pads_token_groups(self, backend: str) -> bool:
        """Whether the 2-D x 3-D GEMM of ``backend`` needs M groups that are multiples
        of ``alignment`` (grouped_mm then pads A and unpads the output)."""
        return False

    def joins_w13_dgrad(self, w1: Tensor, w3: Tensor) -> bool:
        """Whether the experts layer runs the input gradient through W1 and W3 (each
        (E, hidden, dim)) as ONE GEMM, grad_h13 @ [W1; W3] (both operands without a copy)."""
        return False

    # ---- operands ------------------------------------------------------------------
    def quantize(self, x: Tensor, fp8_dtype, groups: Optional[Groups] = None, *, rowwise: bool = True,
                 colwise=False) -> Tuple[Optional[Operand], Optional[Operand]]:
        """``(rowwise operand, colwise operand)`` of x (M, D), each None where not asked
        for. ``groups``: needed for colwise, and for rowwise where the scale layout
        follows the groups (mxfp8)."""
        raise NotImplementedError

    def quantize_colwise_pair(self, a: Tensor, b: Tensor, fp8_dtype, groups: Groups) -> Tuple[Operand, Operand]:
        """The colwise operands of two tensors grouped alike (a weight gradient's pair).
        Default: two ``quantize`` calls; a recipe with a two-tensor kernel overrides it."""
        return (self.quantize(a, fp8_dtype, groups, rowwise=False, colwise=True)[1],
                self.quantize(b, fp8_dtype, groups, rowwise=False, colwise=True)[1])

    def quantize_weights(self, b_ts: Sequence[Tensor], fp8_dtype, *, fwd: bool = True,
                         bwd=False) -> Tuple[Optional[Operand], Optional[Operand]]:
        """``(forward operand, input-gradient operand)`` of the weights ``b_ts`` (each
        (E, K, N_i)) joined along N, each None where not asked for."""
        raise NotImplementedError

    def swiglu_in_gemm(self, hidden_dim: int, device: torch.device) -> bool:
        """Whether the experts layer's W13 GEMM computes the SwiGLU and h's operands in its
        epilogue (:meth:`mm_2d3d_swiglu` on :meth:`quantize_w13`'s layout) for W1 and W3 of
        ``hidden_dim`` rows on ``device``; else the GEMM, then the SwiGLU kernels. Weights
        all-gathered in fp8 (moe_fp8_ext.fsdp) sharded on their rows take the latter. (The
        backward's dSwiGLU GEMM, :meth:`mm_2d3d_dswiglu`, runs where this holds and the
        recipe asks for it.)"""
        return False

    def quantize_w13(self, b_ts: Sequence[Tensor], fp8_dtype, *, bwd=False) -> Tuple[Operand, Optional[Operand]]:
        """``quantize_weights`` of ``[W1ᵀ, W3ᵀ]`` for :meth:`mm_2d3d_swiglu`, whose forward
        operand may be laid out as that method reads it. Default: ``quantize_weights``."""
        return self.quantize_weights(b_ts, fp8_dtype, bwd=bwd)

    def quantize_swiglu(self, h13: Tensor, fp8_dtype, groups: Optional[Groups] = None, *,
                        colwise=False) -> Tuple[Operand, Optional[Operand]]:
        """``quantize(silu(h1) * h3, ...)`` for ``h13 = [h1 | h3]``: the W2 forward GEMM's
        left operand (and W2's weight-gradient one). Default: the SwiGLU kernel, then
        ``quantize``; a recipe may fuse them."""
        return self.quantize(_sw.swiglu(h13), fp8_dtype, groups, colwise=colwise)

    def quantize_swiglu_backward(self, tensors: List[Tensor], fp8_dtype, groups: Optional[Groups] = None, *,
                                 joint: bool, with_h: bool = False, colwise=False):
        """The gradient through the SwiGLU, from ``tensors = [grad_h, h13]`` (emptied:
        each is dropped once read), as ``(grad_h13, lhs, h, grad_h13's colwise operand)``:
        ``lhs`` the input-gradient GEMMs' left operand, one (``joint``) or one per half
        (None: the caller quantizes each half of grad_h13 at its GEMM); ``h = swiglu(h13)``
        where ``with_h`` (else None); grad_h13 None where its colwise operand came with
        ``lhs``. Default: the SwiGLU kernels, then ``quantize`` (joint only)."""
        grad_h, h13 = tensors
        tensors.clear()
        h = _sw.swiglu(h13) if with_h else None
        g13 = _sw.swiglu_backward(grad_h, h13)
        del grad_h, h13
        if not joint:
            return g13, None, h, None
        lhs, col = self.quantize(g13, fp8_dtype, groups, colwise=colwise)
        return (g13 if col is None else None), lhs, h, col

    # ---- GEMMs ---------------------------------------------------------------------
    def mm_2d3d(self, lhs: Operand, rhs: Operand, offs: Tensor, out_dtype: torch.dtype, backend: str) -> Tensor:
        """(M, N) = lhs (M, K) x rhs (E, K, N) per group; rows past offs[-1] zero."""
        raise NotImplementedError

    def mm_2d3d_swiglu(self, tensors: List[Any], offs: Tensor, out_dtype: torch.dtype, backend: str, fp8_dtype,
                       groups: Groups, *, colwise=False) -> Tuple[Tensor, Operand, Optional[Operand]]:
        """``h13 = mm_2d3d(lhs, rhs13, ...)`` (rhs13 from :meth:`quantize_w13`) and
        ``quantize_swiglu(h13, ...)`` for ``tensors = [lhs, rhs13]`` (emptied: dropped once
        read), as ``(h13, h's rowwise operand, h's colwise operand)``. Default: the two; a
        recipe may fuse them."""
        lhs, rhs13 = tensors
        tensors.clear()
        h13 = self.mm_2d3d(lhs, rhs13, offs, out_dtype, backend)
        del lhs, rhs13
        return (h13,) + tuple(self.quantize_swiglu(h13, fp8_dtype, groups, colwise=colwise))

    def mm_2d3d_dswiglu(self, tensors: List[Any], offs: Tensor, out_dtype: torch.dtype, backend: str, fp8_dtype,
                        groups: Groups, *, joint: bool, with_h: bool = False, colwise=False):
        """``grad_h = mm_2d3d(lhs, rhs2, ...)`` (W2's input gradient) and
        ``quantize_swiglu_backward([grad_h, h13], ...)`` for ``tensors = [lhs, rhs2, h13]``
        (emptied: each dropped once read), with that method's outputs. Default: the two; a
        recipe may fuse them."""
        lhs, rhs2, h13 = tensors
        tensors.clear()
        grad_h = self.mm_2d3d(lhs, rhs2, offs, out_dtype, backend)
        del lhs, rhs2
        tensors += [grad_h, h13]
        del grad_h, h13
        return self.quantize_swiglu_backward(tensors, fp8_dtype, groups, joint=joint, with_h=with_h, colwise=colwise)

    def mm_2d2d(self, grad: Operand, a: Operand, offs: Tensor, out_dtype: torch.dtype, backend: str) -> Tensor:
        """(E, N, K) = grad (M, N)ᵀ x a (M, K) over each group's tokens (colwise operands;
        ``offs`` the padded ends where they are padded)."""
        raise NotImplementedError

    def mm_2d2d_parts(self, grad: Operand, a: Operand, offs: Tensor, out_dtype: torch.dtype, backend: str,
                      parts: Sequence[Optional[Tuple[int, int]]]) -> List[Optional[Tensor]]:
        """``mm_2d2d``'s output rows [start, stop) of each part (None: not wanted), each a
        tensor of its own (W1's and W3's gradients in their layout). Default: one GEMM,
        each part copied; :func:`gemm_on_column_views` where the operand's columns view."""
        full = self.mm_2d2d(grad, a, offs, out_dtype, backend)
        return [None if p is None else full[:, p[0]:p[1]].contiguous() for p in parts]

    def mm_2d2d_add_(self, out: Tensor, grad: Operand, a: Operand, offs: Tensor, out_dtype: torch.dtype,
                     backend: str) -> None:
        """``mm_2d2d`` added to ``out`` (float32, of its shape) in place: a weight gradient
        into a main gradient. Default: the GEMM in ``out_dtype``, then an add; a recipe
        whose GEMM adds (both fp8 recipes on Hopper) fuses them."""
        out.add_(self.mm_2d2d(grad, a, offs, out_dtype, backend))

    def mm_2d2d_parts_add_(self, outs: Sequence[Optional[Tensor]], grad: Operand, a: Operand, offs: Tensor,
                           out_dtype: torch.dtype, backend: str, parts: Sequence[Optional[Tuple[int, int]]]) -> None:
        """``mm_2d2d_parts``, each wanted part added to its out in place (``mm_2d2d_add_``)."""
        for out, part in zip(outs, self.mm_2d2d_parts(grad, a, offs, out_dtype, backend, parts)):
            if part is not None:
                out.add_(part)


def _columns(grad: Operand, p: Tuple[int, int]) -> Operand:
    """A view of a colwise operand's columns [p0, p1) (data and per-column scales alike)."""
    return grad[:, p[0]:p[1]] if isinstance(grad, Tensor) else tuple(t[:, p[0]:p[1]] for t in grad)


def gemm_on_column_views(recipe: Recipe, grad: Operand, a: Operand, offs: Tensor, out_dtype: torch.dtype,
                         backend: str, parts) -> List[Optional[Tensor]]:
    """``mm_2d2d_parts`` as one GEMM a part, on a view of grad's columns: for colwise
    operands whose tensors all have N as their last dim (data and per-column scales)."""
    return [None if p is None else recipe.mm_2d2d(_columns(grad, p), a, offs, out_dtype, backend) for p in parts]


def add_on_column_views(recipe: Recipe, outs, grad: Operand, a: Operand, offs: Tensor, out_dtype: torch.dtype,
                        backend: str, parts) -> None:
    """``mm_2d2d_parts_add_`` as ``mm_2d2d_add_`` on each part's view of grad's columns."""
    for out, p in zip(outs, parts):
        if p is not None:
            recipe.mm_2d2d_add_(out, _columns(grad, p), a, offs, out_dtype, backend)


def joined_fwd(b_ts: Sequence[Tensor]) -> Tensor:
    """The weights (E, K, N_i) joined along N, with K contiguous (a copy where more than one)."""
    return b_ts[0] if len(b_ts) == 1 else torch.cat([b.transpose(-2, -1) for b in b_ts], dim=1).transpose(-2, -1)


def joined_bwd(b_ts: Sequence[Tensor]) -> Tensor:
    """The weights (E, K, N_i) joined along N (a copy where more than one)."""
    return b_ts[0] if len(b_ts) == 1 else torch.cat(list(b_ts), dim=2)


# ---- the emulation: dequantized operands, fp32 accumulation ----------------------------


def row_groups(offs: Tensor, m: int) -> Tuple[Tensor, Tensor]:
    """Group index of each of the m rows and whether the row is inside a group (rows
    past offs[-1] are not part of the product). No host sync."""
    rows = torch.arange(m, device=offs.device, dtype=offs.dtype)
    g = torch.searchsorted(offs, rows, right=True)
    return g.clamp(max=max(offs.numel() - 1, 0)), g < offs.numel()


# Emulated GEMMs: dequantized fp8 operands, fp32 accumulation. CUDA: torch._grouped_mm in bf16, exact for fp8 x pow2
# scale (non-pow2 scales get bf16-rounded operands: not bit-exact). CPU: a bf16 grouped GEMM is not everywhere (its
# fake rejects fp32), so every expert runs densely in fp32 and each row keeps its group's: E times the flops, traceable.
@torch.autocast("cpu", enabled=False)  # (autocast would round the fp32 operands)
@torch.autocast("cuda", enabled=False)
def emulated_grouped_mm_2d3d(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """fp32 (M, K) x (E, K, N) grouped along M -> fp32 (M, N). Rows past offs[-1] are
    not zero here (grouped_mm zeroes them)."""
    if a.is_cuda:
        return torch._grouped_mm(a.bfloat16(), b.bfloat16(), offs=offs).float()
    g, _ = row_groups(offs, a.shape[0])
    full = torch.einsum("mk,ekn->emn", a, b)
    return full.gather(0, g.long()[None, :, None].expand(1, a.shape[0], b.shape[2])).squeeze(0)


@torch.autocast("cpu", enabled=False)
@torch.autocast("cuda", enabled=False)
def emulated_grouped_mm_2d2d(a_t: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """fp32 (N, M) x (M, K) grouped along M (the contraction) -> fp32 (E, N, K)."""
    if a_t.is_cuda:
        return torch._grouped_mm(a_t.bfloat16(), b.bfloat16(), offs=offs).float()
    g, inside = row_groups(offs, b.shape[0])
    # Each expert's rows selected with where, not a 0/1 product: 0 * NaN would carry a
    # NaN or Inf of one expert's tokens into every expert's gradient.
    mask = (g.long()[None, :] == torch.arange(offs.numel(), device=offs.device)[:, None]) & inside  # (E, M)
    zero = a_t.new_zeros(())
    return torch.bmm(torch.where(mask[:, None, :], a_t, zero), torch.where(mask[:, :, None], b, zero))


# ---- registry --------------------------------------------------------------------------

RECIPES: Dict[str, Recipe] = {}


def register_recipe(recipe: Recipe, *, replace: bool = False) -> Recipe:
    """Make ``recipe`` available as ``grouped_mm(..., recipe=recipe.name)``."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"register_recipe: expected a Recipe, got {type(recipe).__name__}")
    if not isinstance(recipe.alignment, int) or recipe.alignment < 1 or recipe.alignment & (recipe.alignment - 1):
        raise ValueError(f"register_recipe: expected alignment a power of two >= 1, got {recipe.alignment!r}")
    if recipe.name in RECIPES and not replace:
        raise ValueError(f"register_recipe: expected a new name, got {recipe.name!r} (already registered; pass replace=True)")
    RECIPES[recipe.name] = recipe
    return recipe


def get_recipe(name, op: str = "get_recipe") -> Recipe:
    """The registered recipe called ``name`` (a :class:`Recipe` is returned as is)."""
    if isinstance(name, Recipe):
        return name
    if not isinstance(name, str) or name not in RECIPES:
        raise ValueError(f"{op}: expected recipe in {tuple(RECIPES)} or a Recipe, got {name!r}")
    return RECIPES[name]

