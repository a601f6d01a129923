"""The :class:`Recipe` protocol that :func:`moe_fp8_ext.grouped_mm` and the experts
layer drive, the registry of recipes by name, and the emulated grouped GEMMs
(dequantized operands, fp32 accumulation) every recipe can fall back to.
"""

import dataclasses
from typing import Any, Dict, Optional, Tuple

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


#: Opaque to grouped_mm: whatever a recipe's quantizer returns and its GEMM consumes
#: (a tensor, or a tuple of data and scales in the recipe's own layout).
Operand = Any

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How ``grouped_mm(A, B_t, offs)`` computes its three products. Base class: a recipe
    is a frozen dataclass (hashable, so ``torch.compile`` treats it as a constant)
    overriding the methods below; the defaults are the high-precision ones. Its fields
    are what a user sets (``name``, ``alignment`` and each recipe's own, e.g.
    ``Fp8Rowwise(pow2_scale=False)``); ``dataclasses.replace`` makes a variant, which
    ``grouped_mm``, ``experts``, ``GroupedExperts`` and the torchtitan converter take as
    is or, registered, by name.

    The products, with A (M, K), B_t (E, K, N), grad_out (M, N) and token groups
    ``offs`` along M::

        forward  out    = mm_2d3d(lhs(A),        rhs_fwd(B_t),   offs)   (M, N)
        dgrad    grad_A = mm_2d3d(lhs(grad_out), rhs_bwd(saved), offs)   (M, K)
        wgrad    grad_B = mm_2d2d(*wgrad_operands(grad_out, saved, offs)) (E, N, K)

    Contract (what grouped_mm relies on, and nothing more):

    - **Operands are opaque.** ``lhs``/``rhs_fwd``/``rhs_bwd``/``wgrad_operands`` return
      whatever this recipe's ``mm_2d3d``/``mm_2d2d`` consume: rowwise returns
      ``(q, scale (M,))``; MXFP8 would return ``(q, e8m0 scales in the blocked layout)``;
      blockwise ``(q, scale (M, K/128))``. Scale shapes never reach grouped_mm.
    - **Roles.** ``lhs(x)``: a 2-D (rows, D) operand grouped along its rows (A in the
      forward, grad_out in dgrad), contracted over D. ``rhs_fwd(B_t)``: the weights
      (E, K, N) contracted over K. ``rhs_bwd(saved)``: the same weights in backward
      orientation (E, N, K), contracted over N. ``wgrad_operands(grad_out, saved, offs,
      ..., padded_starts)``: the pair (grad_out^T, A) contracted over the tokens of each
      group. With ``padded_starts`` (from ``ops.padded_group_offsets(offs, M,
      alignment)``) both are laid out in the padded layout of DESIGN §8
      (``ops.padded_rows(M, E, alignment)`` rows, group starts multiples of
      ``alignment``, zeros in between), and ``mm_2d2d`` gets the padded ends as offs.
    - **Saved state.** ``save_for_backward(A, B_t, lhs_op, rhs_op)`` returns a dict of
      tensors (None allowed); grouped_mm saves them with ``ctx.save_for_backward`` and
      hands the dict back, by name, to ``rhs_bwd`` and ``wgrad_operands``. The default
      keeps the high-precision ``A`` and ``B_t`` (requantized in backward); a recipe
      may keep fp8 operands instead, under its own names. ``"B_t"`` is read by
      ``rhs_bwd`` alone and ``"A"`` by ``wgrad_operands`` alone: grouped_mm replaces
      them with None where that gradient will not be computed, and replaces ``"A"``
      with its fp8 weight-gradient operand under ``keeps_fp8_activations``. Whatever
      ``rhs_bwd`` needs must be saved even where the forward also made the backward
      operand (``rhs_dual_cat``, held on ctx): a second backward (``retain_graph``)
      calls ``rhs_bwd``.
    - **Reading the weight once.** Where ``reads_weights_once([B_t])`` (grouped_mm asks
      in eager mode only; the experts layer under compile too, where it must trace or
      answer False) grouped_mm calls
      ``rhs_dual_cat([B_t])`` for both weight operands in the forward; where nothing
      of the weight is to be kept for the backward (no input gradient follows, or
      ``hold_weight_operands`` is False), ``rhs_fwd_only`` instead of ``rhs_fwd``.
    - **GEMMs.** ``mm_2d3d(lhs, rhs, offs, out_dtype, backend)`` -> (M, N) and
      ``mm_2d2d(grad_t, a, offs, out_dtype, backend)`` -> (E, N, K); rows past
      ``offs[-1]`` may hold anything (grouped_mm and the experts layer zero them after
      the GEMM unless ``mm_2d3d_zeroes_tail(backend)``), ``out_dtype`` is one
      of ``out_dtypes(backend, ...)``. ``backend`` is what :meth:`backend` said for the
      device: the real GEMM or ``"emulated"`` (dequantize, then an fp32 grouped GEMM,
      :func:`emulated_grouped_mm_2d3d` / :func:`emulated_grouped_mm_2d2d`). A recipe
      never falls back to bf16 math silently.
    - **Alignment.** ``alignment``: the group-size multiple the recipe's GEMMs need
      where groups are the contraction (wgrad), or the M groups too when
      :meth:`pads_token_groups` says so (then grouped_mm pads A, runs the aligned
      path, and unpads the output). 1 = any group size, no padded layout.
    - **Formats.** ``fp8_dtype`` reaches the quantizing methods resolved (grouped_mm
      and the experts layer pass :func:`~moe_fp8_ext.grouped_mm.resolve_fp8_dtype`'s
      answer: one of ``fp8_dtypes(backend, device)``, never None); the registered
      recipes hand it to the ops as is. Their operands come from this package's ops
      and go to its ops, so they call them through ``torch.ops.moe_fp8`` (the C++ ops
      check their arguments; the Python wrappers' checks, the same ones, run in the
      fakes under torch.compile).
    - No method syncs with the host or reads tensor values in Python; each must trace
      under ``torch.compile(fullgraph=True)`` (``reads_weights_once``: see above).
    """

    name: str
    alignment: int = 1

    # Class attributes, not fields (no annotation: a field's place in the constructor would follow the base's).
    #: What the GEMMs compute in ("fp8", "bf16"): for messages; the torchtitan converter casts a "bf16" recipe's inputs.
    precision = "fp8"
    #: Whether a forward may make the weight's input-gradient operand and hold it until then (where
    #: ``reads_weights_once``); a field of the recipes whose forward can (Fp8Rowwise, Fp8Blockwise). False: nothing
    #: derived from a weight lives from a forward to its backward (the backward quantizes it again).
    hold_weight_operands = True

    # ---- where and how it runs -----------------------------------------------------
    def backend(self, device: torch.device) -> str:
        """The name of the GEMM path that runs on ``device``; ``"emulated"`` is the
        dequantize + fp32 grouped GEMM every recipe supports everywhere."""
        return "emulated"

    def out_dtypes(self, backend: str, in_dtype: torch.dtype) -> Tuple[torch.dtype, ...]:
        """The dtypes the GEMM of ``backend`` can write, for inputs of ``in_dtype``."""
        return FLOAT_DTYPES

    def default_out_dtype(self, in_dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16

    def fp8_dtypes(self, backend: str, device: torch.device) -> Tuple[torch.dtype, ...]:
        """The fp8 dtypes accepted for ``fp8_dtype``; empty: the recipe does not
        quantize, and ``fp8_dtype`` must be None."""
        return ()

    def default_fp8_dtype(self, device: torch.device) -> Optional[torch.dtype]:
        return default_fp8_dtype(device if device.type == "cuda" else None) if self.fp8_dtypes("emulated", device) else None

    def check_inputs(self, A: Tensor, B_t: Tensor) -> None:
        """Recipe-specific checks on top of grouped_mm's (ranks, K, offs, devices,
        A and B_t floating point): raise ``ValueError("grouped_mm: expected ...")``."""

    def pads_token_groups(self, backend: str) -> bool:
        """Whether the 2-D x 3-D GEMM of ``backend`` needs M groups that are multiples
        of ``alignment`` (grouped_mm then pads A and unpads the output)."""
        return False

    # ---- operands ------------------------------------------------------------------
    def lhs(self, x: Tensor, fp8_dtype) -> Operand:
        raise NotImplementedError

    def rhs_fwd(self, b_t: Tensor, fp8_dtype) -> Operand:
        raise NotImplementedError

    def rhs_fwd_only(self, b_t: Tensor, fp8_dtype) -> Operand:
        """``rhs_fwd`` where nothing of the weight is to be kept for an input gradient
        (none is computed, or its operand is made in the backward). Default: ``rhs_fwd``;
        a recipe whose ``rhs_fwd`` makes more (fp8_blockwise: both orientations)
        overrides it."""
        return self.rhs_fwd(b_t, fp8_dtype)

    def rhs_fwd_cat(self, b_ts, fp8_dtype) -> Operand:
        """``rhs_fwd`` of the weights ``b_ts`` (each (E, K, N_i)) concatenated along N
        (the experts layer's fused W1/W3 GEMM). Default: quantize the concatenation (a
        copy with K contiguous); a recipe whose weight scales never span N overrides it
        to quantize each part and concatenate the operands. (``rhs_fwd_only``: the
        backward operand of a concatenation is ``rhs_bwd_cat``'s.)"""
        return self.rhs_fwd_only(torch.cat([b.transpose(-2, -1) for b in b_ts], dim=1).transpose(-2, -1), fp8_dtype)

    def save_for_backward(self, A: Tensor, B_t: Tensor, lhs: Operand, rhs: Operand) -> Dict[str, Optional[Tensor]]:
        return {"A": A, "B_t": B_t}

    def rhs_bwd(self, saved: Dict[str, Tensor], fp8_dtype) -> Operand:
        raise NotImplementedError

    def wgrad_operands(self, grad_out: Tensor, saved: Dict[str, Tensor], offs: Tensor, fp8_dtype,
                       padded_starts: Optional[Tensor]) -> Tuple[Operand, Operand]:
        raise NotImplementedError

    # Whether grouped_mm and the experts layer make a token-grouped tensor's wgrad operand with its forward (or
    # dgrad) one (lhs_with_wgrad_operand) and keep that fp8 operand for the backward instead of the tensor: fp8
    # saved activations (DESIGN §10).
    keeps_fp8_activations = False

    def wgrad_operand(self, x: Tensor, offs: Tensor, fp8_dtype, padded_starts: Optional[Tensor]) -> Operand:
        """One tensor's operand of the weight-gradient GEMM (x (M, D) contracted over the
        tokens of each group), for :meth:`wgrad_operands_from`."""
        raise NotImplementedError

    def wgrad_operands_from(self, grad: Operand, a: Operand) -> Tuple[Operand, Operand]:
        """``wgrad_operands`` from the two tensors' :meth:`wgrad_operand`."""
        raise NotImplementedError

    def lhs_with_wgrad_operand(self, x: Tensor, offs: Tensor, fp8_dtype,
                               padded_starts: Optional[Tensor]) -> Tuple[Operand, Operand]:
        """``(lhs(x), wgrad_operand(x, ...))``. Default: the two calls."""
        return self.lhs(x, fp8_dtype), self.wgrad_operand(x, offs, fp8_dtype, padded_starts)

    def reads_activations_once(self, x: Optional[Tensor] = None) -> bool:
        """Whether :meth:`lhs_with_wgrad_operand` reads its tensor (``x``, when given)
        once (then the backward makes grad_out's two operands together although the
        wgrad one then lives through the dgrad GEMM; otherwise it makes the wgrad one
        when it is needed). Default: no."""
        return False

    # ---- the experts layer's SwiGLU (DESIGN §10) -----------------------------------
    def lhs_swiglu(self, h13: Tensor, fp8_dtype) -> Operand:
        """``lhs(silu(h1) * h3)`` for ``h13 = [h1 | h3]``: the left operand of the W2
        forward GEMM. Default: the fused SwiGLU kernel, then ``lhs``; a recipe whose
        ``lhs`` the SwiGLU kernel can compute on the way overrides it (one read of h13,
        h never written)."""
        return self.lhs(_sw.swiglu(h13), fp8_dtype)

    def lhs_swiglu_backward(self, grad_h: Tensor, h13: Tensor, fp8_dtype) -> Tuple[Tensor, Operand, Operand]:
        """``(grad_h13, lhs(grad_h1), lhs(grad_h3))``: the gradient through the SwiGLU
        (kept for the weight gradient) and the left operands of the two dgrad GEMMs.
        Default: the fused kernel, then ``lhs`` of each half."""
        g13 = _sw.swiglu_backward(grad_h, h13)
        hidden = h13.shape[1] // 2
        return g13, self.lhs(g13[:, :hidden], fp8_dtype), self.lhs(g13[:, hidden:], fp8_dtype)

    def lhs_swiglu_backward_with_h(self, grad_h: Tensor, h13: Tensor,
                                   fp8_dtype) -> Tuple[Tensor, Operand, Operand, Tensor]:
        """``lhs_swiglu_backward`` and h = ``silu(h1) * h3`` (the operand of W2's weight
        gradient): the two kernels."""
        return (*self.lhs_swiglu_backward(grad_h, h13, fp8_dtype), _sw.swiglu(h13))

    # Whether the experts layer runs the input gradient through W1 and W3 as ONE GEMM, grad_h13 @ [W1; W3]
    # (operands from lhs_swiglu_backward_joint and rhs_bwd_cat), not two summed. A recipe sets it where both
    # operands come without a copy (its scales may then span both halves).
    joint_w13_dgrad = False

    def joins_w13_dgrad(self, w1: Tensor, w3: Tensor) -> bool:
        """Whether the experts layer joins the input gradient through these W1 and W3
        (each (E, hidden, dim)). Default: ``joint_w13_dgrad``."""
        return self.joint_w13_dgrad

    def lhs_swiglu_backward_joint(self, grad_h: Tensor, h13: Tensor, fp8_dtype) -> Tuple[Tensor, Operand, Tensor]:
        """``(grad_h13, lhs(grad_h13), h)``: the gradient through the SwiGLU, the left
        operand of the one input-gradient GEMM against W1 and W3 together, and h for
        W2's weight gradient. Default: the two kernels, then ``lhs``."""
        g13 = _sw.swiglu_backward(grad_h, h13)
        return g13, self.lhs(g13, fp8_dtype), _sw.swiglu(h13)

    def makes_swiglu_operands(self, h13: Tensor) -> bool:
        """Whether the experts layer, with fp8 saved activations (keeps_fp8_activations,
        the padded layout), makes h's two fp8 operands together in the forward
        (:meth:`lhs_with_wgrad_operand` of ``swiglu(h13)``: W2's weight-gradient one is
        kept, so the backward computes no h) and, where the input gradient through W1
        and W3 is one GEMM, the backward's grad_h13 without h (``swiglu_backward``, then
        grad_h and h13 dropped) and its two operands together when W1/W3 need gradients
        (grad_h13 read once, then dropped), instead of ``lhs_swiglu`` /
        ``lhs_swiglu_backward_joint``. For a recipe whose ``lhs_with_wgrad_operand``
        reads its tensor once and which has no fused SwiGLU quantization of its own.
        h13: the W13 GEMM's output. Default: no."""
        return False

    def rhs_bwd_cat(self, b_ts, fp8_dtype) -> Operand:
        """``rhs_bwd`` of the weights ``b_ts`` (each (E, K, N_i)) concatenated along N,
        the contraction of the input gradient. Default: of a concatenated copy."""
        return self.rhs_bwd({"B_t": torch.cat(b_ts, dim=2)}, fp8_dtype)

    def reads_weights_once(self, b_ts) -> bool:
        """Whether ``rhs_dual_cat(b_ts)`` reads the weights once for both operands (then
        grouped_mm and the experts layer make a weight's backward operand with its
        forward one). The experts layer asks it under torch.compile too: there it must
        trace (shapes only) or answer False. Default: no."""
        return False

    def rhs_dual_cat(self, b_ts, fp8_dtype) -> Tuple[Operand, Operand]:
        """``(rhs_fwd_cat(b_ts), rhs_bwd_cat(b_ts))``. Default: the two calls."""
        return self.rhs_fwd_cat(b_ts, fp8_dtype), self.rhs_bwd_cat(b_ts, fp8_dtype)

    # ---- GEMMs ---------------------------------------------------------------------
    def mm_2d3d(self, lhs: Operand, rhs: Operand, offs: Tensor, out_dtype: torch.dtype, backend: str) -> Tensor:
        raise NotImplementedError

    def mm_2d3d_zeroes_tail(self, backend: str) -> bool:
        """Whether ``mm_2d3d`` on ``backend`` writes the rows past offs[-1] with zeros
        itself, for the non-decreasing offs its callers pass (``device_offs``), so that
        they launch no zeroing kernel after it. Default: no."""
        return False

    def mm_2d2d(self, grad_t: Operand, a: Operand, offs: Tensor, out_dtype: torch.dtype, backend: str) -> Tensor:
        raise NotImplementedError

    def wgrad_lhs_rows(self, grad_t: Operand, start: int, stop: int) -> Optional[Operand]:
        """``grad_t``'s operand for the rows [start, stop) of ``mm_2d2d``'s output, as a
        view (the gradient of one weight of a concatenation, e.g. W1 of [W1; W3], in a
        tensor of its own); None where the layout cannot take a part without a copy."""
        return None


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
def emulated_grouped_mm_2d3d(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """fp32 (M, K) x (E, K, N) grouped along M -> fp32 (M, N). Rows past offs[-1] are
    not zero here (grouped_mm zeroes them)."""
    if a.is_cuda:
        return torch._grouped_mm(a.bfloat16(), b.bfloat16(), offs=offs).float()
    g, _ = row_groups(offs, a.shape[0])
    full = torch.einsum("mk,ekn->emn", a, b)
    return full.gather(0, g.long()[None, :, None].expand(1, a.shape[0], b.shape[2])).squeeze(0)


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

