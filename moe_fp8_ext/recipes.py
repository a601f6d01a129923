"""Training recipes for :func:`moe_fp8_ext.grouped_mm`: one :class:`Recipe` per way of
running the three grouped GEMMs of an MoE expert linear (DESIGN §5-§8).

    from moe_fp8_ext.recipes import RECIPES, get_recipe, register_recipe
    get_recipe("fp8_rowwise").alignment        # 16
    register_recipe(MyRecipe(name="my_recipe", alignment=32))
    grouped_mm(A, B_t, offs, recipe="my_recipe")

``grouped_mm`` holds ONE autograd Function that knows nothing about scales or formats:
it asks the recipe for each operand, hands the operands back to the recipe's GEMMs, and
keeps what the recipe wants for backward. Adding a recipe (MXFP8, FP8 blockwise) is a
new subclass registered here; ``grouped_mm.py`` does not change.

Registered: ``"fp8_rowwise"`` (:class:`Fp8Rowwise`, DESIGN §5), ``"mxfp8"``
(:class:`Mxfp8`, DESIGN §7: e8m0 scales per 32 elements, the sm100 GEMM on capability
10.x, emulated elsewhere), ``"fp8_blockwise"`` (:class:`Fp8Blockwise`, DESIGN §6: 1x128 /
128x128 blocks, our CUTLASS grouped GEMM on sm90, emulated elsewhere) and ``"bf16"`` (:class:`Bf16`, ``torch._grouped_mm`` in the
inputs' dtype, the baseline).
"""

import dataclasses
import os
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import blockwise as _bw
from . import mxfp8 as _mx
from . import ops
from . import rowwise_gemm as _rowwise_gemm
from . import swiglu as _sw
from .mxfp8 import MX_BLOCK
from .platform import default_fp8_dtype, remembered_per_device

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
    overriding the methods below; the defaults are the high-precision ones.

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
    - **Reading the weight once.** Where ``reads_weights_once([B_t])`` (asked in eager
      mode only: it may read data pointers, which do not trace) grouped_mm calls
      ``rhs_dual_cat([B_t])`` for both weight operands in the forward; where nothing
      of the weight is to be kept for the backward (no input gradient follows, or
      ``MOE_FP8_HOLD_WEIGHT_OPERANDS=0``), ``rhs_fwd_only`` instead of ``rhs_fwd``.
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
      under ``torch.compile(fullgraph=True)`` (except ``reads_weights_once``, above).
    """

    name: str
    alignment: int = 1
    #: what the GEMM computes in, for messages ("fp8", "bf16")
    gemm: str = "fp8"

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

    # Whether grouped_mm and the experts layer make a token-grouped tensor's
    # weight-gradient operand together with its forward (or dgrad) one
    # (lhs_with_wgrad_operand) and keep that fp8 operand for the backward instead of the
    # tensor: fp8 saved activations (DESIGN §10).
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

    # Whether the experts layer runs the input gradient through W1 and W3 as ONE GEMM
    # (grad_h13 @ [W1; W3], operands from lhs_swiglu_backward_joint and rhs_bwd_cat),
    # instead of two GEMMs summed. A recipe sets it where both operands come without a
    # copy (its scales may then span both halves).
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
        forward one). Asked in eager mode only: it may look at data pointers and sizes.
        Default: no."""
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


# The emulated GEMMs multiply dequantized fp8 operands with fp32 accumulation. On CUDA
# they use torch._grouped_mm in bf16, which holds fp8 x power-of-two scale exactly. On
# the CPU, a bf16 grouped GEMM is not available everywhere (and its fake kernel rejects
# fp32), so the CPU computes every expert densely in fp32 and keeps each row's own
# group: E times the flops, fine for an emulation, and traceable. A recipe whose
# dequantized values are not exact in bf16 (non-pow2 scales) gets bf16-rounded operands
# on CUDA: an emulation, not a bit-exact model of the fp8 GEMM.
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


# ---- fp8 rowwise (DESIGN §5) -----------------------------------------------------------

_BACKENDS: Dict[tuple, str] = {}  # (recipe, device type, index) -> Fp8Rowwise.backend, eager calls


def has_scaled_grouped_mm() -> bool:
    return hasattr(torch, "_scaled_grouped_mm") or hasattr(F, "scaled_grouped_mm")


def scaled_grouped_mm_rowwise(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs: Tensor, out_dtype) -> Tensor:
    """PyTorch's FP8 grouped GEMM with decode scales (rowwise for 2-D x 3-D; flat
    per-group scales for 2-D x 2-D), whichever entry point this torch has."""
    if hasattr(torch, "_scaled_grouped_mm"):
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype, use_fast_accum=True)
    rowwise = F.ScalingType.RowWise
    return F.scaled_grouped_mm(a, b, scale_a, rowwise, scale_b, rowwise, offs=offs, output_dtype=out_dtype, use_fast_accum=True)


@dataclasses.dataclass(frozen=True)
class Fp8Rowwise(Recipe):
    """FP8 with one scale per row of A / grad_out, per (expert, output column) of the
    weights, and per (group, column) for the weight gradient (DESIGN §5); power-of-two
    scales unless ``pow2_scale=False``.

    Operands: ``(q, scale)`` with scale (M,) for ``lhs``, (E, N) / (E, K) for the
    weights, (E, D) per group for the wgrad pair. GEMM: ``torch._scaled_grouped_mm``
    (``"fp8_gemm"``) on CUDA sm90+ and ROCm GPUs whose torch has it, else emulated.
    That GEMM writes bfloat16 only (torch's f8f8bf16 grouped kernel; its meta kernel
    checks the same): ``out_dtype`` must be bfloat16 there, while the emulation also
    writes float16 and float32.
    """

    name: str = "fp8_rowwise"
    alignment: int = 16
    pow2_scale: bool = True

    def backend(self, device):
        # asked three or four times a grouped_mm or experts call: remembered per device
        return remembered_per_device(_BACKENDS, torch.device(device), self._backend, self)

    def _backend(self, device):
        if device.type != "cuda" or not torch.cuda.is_available():
            return "emulated"
        if torch.version.hip:
            return "fp8_gemm" if has_scaled_grouped_mm() else "emulated"
        major, _ = torch.cuda.get_device_capability(device)
        return "fp8_gemm" if has_scaled_grouped_mm() and major >= 9 else "emulated"

    def out_dtypes(self, backend, in_dtype):
        return (torch.bfloat16,) if backend == "fp8_gemm" else FLOAT_DTYPES

    def fp8_dtypes(self, backend, device):
        if backend == "fp8_gemm":  # what torch's scaled grouped GEMM takes on this GPU
            return (default_fp8_dtype(torch.device(device)),)
        return FP8_DTYPES

    def check_inputs(self, A, B_t):
        k, n = B_t.shape[1], B_t.shape[2]
        if self.backend(A.device) == "fp8_gemm" and (k % 16 or n % 16):
            raise ValueError(f"grouped_mm: expected K and N to be multiples of 16 for the fp8 GEMM on {A.device} "
                             f"(16-byte aligned fp8 rows), got K={k}, N={n}")

    def pads_token_groups(self, backend):
        # PyTorch's CUDA grouped GEMMs take M groups of any size (per-group pointers
        # only need 16-byte aligned rows, K % 16 == 0: aten/src/ATen/native/cuda/
        # GroupMMCommon.cuh). On ROCm that is not established: pad there.
        return backend == "fp8_gemm" and bool(torch.version.hip)

    def lhs(self, x, fp8_dtype):
        q, s = _ops.quantize_rowwise(x, fp8_dtype, self.pow2_scale)
        return q, s.squeeze(-1)

    def rhs_fwd(self, b_t, fp8_dtype):
        q, s = _ops.quantize_experts_fwd(b_t, fp8_dtype, self.pow2_scale)
        return q, s.squeeze(1)

    def rhs_fwd_cat(self, b_ts, fp8_dtype):
        # One scale per (expert, output column) over K: each part quantizes alone, with
        # the bits of the concatenation, written in place into the one operand.
        q, s = _ops.quantize_experts_fwd_cat(list(b_ts), fp8_dtype, self.pow2_scale)
        return q, s.squeeze(1)

    def rhs_bwd(self, saved, fp8_dtype):
        q, s = _ops.quantize_experts_bwd(saved["B_t"], fp8_dtype, self.pow2_scale)  # (E, N, K) column-major
        return q, s.squeeze(1)

    def lhs_swiglu(self, h13, fp8_dtype):
        q, s = _sw.swiglu_quantize_rowwise(h13, fp8_dtype, self.pow2_scale)  # = lhs(swiglu(h13)), bit for bit
        return q, s.squeeze(-1)

    def lhs_swiglu_backward(self, grad_h, h13, fp8_dtype):
        g13, q1, s1, q3, s3 = _sw.swiglu_backward_quantize_rowwise(grad_h, h13, fp8_dtype, self.pow2_scale)
        return g13, (q1, s1.squeeze(-1)), (q3, s3.squeeze(-1))

    # One scale per row of grad_h13 and per (expert, column) of [W1; W3] over both
    # halves: written by one kernel each, no copy.
    joint_w13_dgrad = True

    def lhs_swiglu_backward_joint(self, grad_h, h13, fp8_dtype):
        g13, q, s, h = _sw.swiglu_backward_with_h_quantize_rowwise(grad_h, h13, fp8_dtype, self.pow2_scale)
        return g13, (q, s.squeeze(-1)), h

    def rhs_bwd_cat(self, b_ts, fp8_dtype):
        q, s = _ops.quantize_experts_bwd_cat(list(b_ts), fp8_dtype, self.pow2_scale)  # (E, ΣN, K) column-major
        return q, s.squeeze(1)

    def reads_weights_once(self, b_ts):
        return ops.dual_cat_reads_once(b_ts)

    def rhs_dual_cat(self, b_ts, fp8_dtype):
        qf, sf, qb, sb = _ops.quantize_experts_dual_cat(list(b_ts), fp8_dtype, self.pow2_scale)
        return (qf, sf.squeeze(1)), (qb, sb.squeeze(1))

    def wgrad_operands(self, grad_out, saved, offs, fp8_dtype, padded_starts):
        A = saved["A"]
        if grad_out.dtype == A.dtype:
            qg, sg, qa, sa = _ops.quantize_jagged_colwise_dual(grad_out, A, offs, fp8_dtype, self.pow2_scale,
                                                               padded_starts, self.alignment)
            return self.wgrad_operands_from((qg, sg), (qa, sa))
        return self.wgrad_operands_from(self.wgrad_operand(grad_out, offs, fp8_dtype, padded_starts),
                                        self.wgrad_operand(A, offs, fp8_dtype, padded_starts))

    # (q (M, D) column-major, scale (G, D)) per tensor; the GEMM takes grad_out's transposed.
    keeps_fp8_activations = True

    def wgrad_operand(self, x, offs, fp8_dtype, padded_starts):
        return _ops.quantize_jagged_colwise(x, offs, fp8_dtype, self.pow2_scale, padded_starts, self.alignment)

    def wgrad_operands_from(self, grad, a):
        (qg, sg), (qa, sa) = grad, a
        return (qg.t(), sg), (qa, sa)

    def reads_activations_once(self, x=None):
        # (read when called: a trace-time constant under torch.compile)
        return os.environ.get("MOE_FP8_ONE_READ_ACTIVATIONS") == "1"

    def lhs_with_wgrad_operand(self, x, offs, fp8_dtype, padded_starts):
        # The two quantizations, or one read of x where that kernel is switched on
        # (MOE_FP8_ONE_READ_ACTIVATIONS=1); the same bits either way.
        qr, sr, qc, sc = _ops.quantize_rowwise_jagged_dual(x, offs, fp8_dtype, self.pow2_scale, padded_starts,
                                                           self.alignment)
        return (qr, sr.squeeze(-1)), (qc, sc)

    def mm_2d3d_zeroes_tail(self, backend):
        # Our GEMM's table kernel zeroes the rows past offs[-1]; behind PyTorch's GEMM,
        # which leaves them unwritten, mm_2d3d zeroes them itself.
        return backend == "fp8_gemm"

    def mm_2d3d(self, lhs, rhs, offs, out_dtype, backend):
        (qa, sa), (qb, sb) = lhs, rhs
        if backend == "fp8_gemm":
            if out_dtype == torch.bfloat16 and _rowwise_gemm.in_use(qa):
                return _ops.rowwise_grouped_mm_2d3d(qa, sa, qb, sb, offs, out_dtype)
            return _zero_tail(scaled_grouped_mm_rowwise(qa, qb, sa, sb, offs, out_dtype), offs)
        return emulated_grouped_mm_2d3d(qa.float() * sa[:, None], qb.float() * sb[:, None, :], offs).to(out_dtype)

    def mm_2d2d(self, grad_t, a, offs, out_dtype, backend):
        (qg_t, sg), (qa, sa) = grad_t, a  # (N, M), (E, N); (M, K), (E, K)
        if backend == "fp8_gemm":
            if out_dtype == torch.bfloat16 and _rowwise_gemm.in_use(qa):
                return _ops.rowwise_grouped_mm_2d2d(qg_t, sg, qa, sa, offs, out_dtype)
            return scaled_grouped_mm_rowwise(qg_t, qa, sg.reshape(-1), sa.reshape(-1), offs, out_dtype)
        g, _ = row_groups(offs, qa.shape[0])
        return emulated_grouped_mm_2d2d(qg_t.float() * sg[g].t(), qa.float() * sa[g], offs).to(out_dtype)

    def wgrad_lhs_rows(self, grad_t, start, stop):
        qg_t, sg = grad_t  # (N, M) row-major, (E, N)
        return qg_t[start:stop], sg[:, start:stop]


# ---- bf16: torch._grouped_mm, the baseline ---------------------------------------------


def _gemm_ready(x: Tensor) -> Tensor:
    """x itself when torch._grouped_mm takes its layout (row- or column-major in the
    last two dims), else a row-major copy. Expanded views (a stride of 0, e.g. the
    gradient of ``out.sum()``) are what torch's own _grouped_mm backward trips on."""
    s, n = x.stride(), x.shape
    row = s[-1] == 1 and s[-2] >= max(1, n[-1])
    col = s[-2] == 1 and s[-1] >= max(1, n[-2])
    return x if row or col else x.contiguous()


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
    gemm: str = "bf16"

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

    def lhs(self, x, fp8_dtype):
        return _gemm_ready(x)

    def rhs_fwd(self, b_t, fp8_dtype):
        return _gemm_ready(b_t)

    def rhs_bwd(self, saved, fp8_dtype):
        return _gemm_ready(saved["B_t"].transpose(-2, -1))

    def wgrad_operands(self, grad_out, saved, offs, fp8_dtype, padded_starts):
        A = _gemm_ready(saved["A"])
        grad_out = _gemm_ready(grad_out)
        if padded_starts is not None:  # only if a subclass sets an alignment
            rows = ops.padded_rows(A.shape[0], offs.shape[0], self.alignment)
            A = _ops.pad_token_groups_at(A.contiguous(), offs, padded_starts, rows)
            grad_out = _ops.pad_token_groups_at(grad_out.contiguous(), offs, padded_starts, rows)
        return grad_out.t(), A

    def mm_2d3d(self, lhs, rhs, offs, out_dtype, backend):
        return torch._grouped_mm(lhs, rhs, offs=offs)

    def mm_2d2d(self, grad_t, a, offs, out_dtype, backend):
        return torch._grouped_mm(grad_t, a, offs=offs)

    def wgrad_lhs_rows(self, grad_t, start, stop):
        return grad_t[start:stop]


# ---- MXFP8 (DESIGN §7) -----------------------------------------------------------------
#
# The sm100 GEMM reads e8m0 scales in the blocked (128x4-tile swizzled) layout that the
# quantization kernels write directly. The emulation dequantizes the SAME operands: it
# reads the blocked scales back through the inverse index (pure torch views and gathers,
# no host sync, traceable), so it multiplies exactly the scales the GEMM would read and
# any layout mismatch shows up as a numerics failure on every device.


def _ceil_to(x, m):
    return (x + m - 1) // m * m


def unblock_scales(b: Tensor, rows: int, cols: int) -> Tensor:
    """The inverse of the blocked layout (DESIGN §7) as float32: ``b`` holds
    ceil128(rows) * ceil4(cols) scales in blocked order (any shape, contiguous) ->
    (ceil128(rows), ceil4(cols)), padding included. Pure views: element (r, c) sits at
    ((r//128)*(C'/4) + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4."""
    rp, cp = _ceil_to(rows, 128), _ceil_to(cols, 4)
    t = b.float().reshape(rp // 128, cp // 4, 32, 4, 4)  # [r//128, c//4, r%32, (r%128)//32, c%4]
    return t.permute(0, 3, 2, 1, 4).reshape(rp, cp)


def unblock_scales_m_groups(b: Tensor, offs: Tensor, m: int, cols: int) -> Tensor:
    """float32 (m, cols) scales of the rows of a token-grouped operand from the M-group
    blocked layout (group g's rows from row sum_{j<g} ceil128(n_j) of one blocked
    (b.shape[0], ceil4(cols)) matrix). Rows past offs[-1] read some in-bounds scale."""
    # b: (m + 128 G, ceil4(cols)); every group's 128-row tiles end within it, but the
    # buffer need not be whole tiles: pad it with zeros to whole tiles to view it.
    rows = _ceil_to(b.shape[0], 128)
    flat = F.pad(b.reshape(-1).float(), (0, (rows - b.shape[0]) * b.shape[1]))
    plain = unblock_scales(flat, rows, b.shape[1])
    ends = offs.long()
    starts = F.pad(ends[:-1], (1, 0))
    blocked_starts = F.pad(torch.cumsum(_ceil_to(ends - starts, 128), 0)[:-1], (1, 0))
    g, _ = row_groups(offs, m)
    g = g.long()
    src = blocked_starts[g] + torch.arange(m, device=b.device) - starts[g]
    return plain.index_select(0, src.clamp(0, plain.shape[0] - 1))[:, :cols]


def unblock_scales_k_groups(b: Tensor, offs: Tensor, rows: int, blocks: int) -> Tensor:
    """float32 (rows, blocks) scales of a weight-gradient operand whose token groups (the
    contraction, ends ``offs``, multiples of 32) run along the columns, from the K-group
    layout: group g's (rows, n_g/32) scales are a blocked matrix of their own, stored
    from flat offset ceil128(rows) * sum_{j<g} ceil4(n_j/32). Blocks past offs[-1]: 0."""
    rp = _ceil_to(rows, 128)
    flat = b.reshape(-1)
    ends = offs.long() // MX_BLOCK
    starts = F.pad(ends[:-1], (1, 0))
    width = _ceil_to(ends - starts, 4)  # each group's padded block-columns
    col0 = F.pad(torch.cumsum(width, 0)[:-1], (1, 0))
    t = torch.arange(blocks, device=b.device)
    g = torch.searchsorted(ends, t, right=True)
    inside = g < ends.numel()
    g = g.clamp(max=ends.numel() - 1)
    lb = t - starts[g]  # block within its group
    r = torch.arange(rows, device=b.device)[:, None]
    idx = (rp * col0[g] + ((r // 128) * (width[g] // 4) + lb // 4) * 512
           + (r % 32) * 16 + ((r % 128) // 32) * 4 + lb % 4)
    idx = torch.where(inside, idx, torch.zeros_like(idx)).clamp(0, flat.numel() - 1)
    s = flat.float()[idx.reshape(-1)].reshape(rows, blocks)
    return torch.where(inside, s, torch.zeros_like(s))


def unblock_scales_experts(b: Tensor, rows: int, cols: int) -> Tensor:
    """float32 (E, rows, cols) from the per-expert blocked layout (E, ceil128(rows) * ceil4(cols))."""
    e = b.shape[0]
    rp, cp = _ceil_to(rows, 128), _ceil_to(cols, 4)
    t = b.float().reshape(e, rp // 128, cp // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5)
    return t.reshape(e, rp, cp)[:, :rows, :cols]


def _expand_blocks(s: Tensor) -> Tensor:
    """One scale per 32 elements along the last dim -> one per element."""
    return s.repeat_interleave(MX_BLOCK, dim=-1)


def scaled_grouped_mm_mxfp8(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs: Tensor, out_dtype) -> Tensor:
    """PyTorch's MXFP8 grouped GEMM (sm100 only: callers gate on capability 10.x; on sm90
    torch 2.11 launches its sm100 kernel and the CUDA context dies). Eager:
    ``F.scaled_grouped_mm`` with BlockWise1x32 scales in the SWIZZLE_32_4_4 (blocked)
    layout. Under torch.compile: ``torch._scaled_grouped_mm``, the same kernel (it
    dispatches on e8m0 scales, as torch's own MXFP8 grouped tests call it), because
    torch 2.13's ``_scaled_grouped_mm_v2`` has no fake implementation to trace with."""
    if hasattr(F, "scaled_grouped_mm") and not (torch.compiler.is_compiling() and hasattr(torch, "_scaled_grouped_mm")):
        mx, swz = F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4
        return F.scaled_grouped_mm(a, b, scale_a, mx, scale_b, mx, swizzle_a=swz, swizzle_b=swz, offs=offs,
                                   output_dtype=out_dtype)
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)


@dataclasses.dataclass(frozen=True)
class Mxfp8(Recipe):
    """MXFP8 (OCP microscaling, DESIGN §7): e4m3fn data, one e8m0 scale per 32
    consecutive elements of each contraction, ``rounding`` "rceil" (default; the scale
    rounds up, no block saturates) or "floor" (OCP's rule:
    ``dataclasses.replace(get_recipe("mxfp8"), name="mxfp8_floor", rounding="floor")``).

    Operands, scales always in the blocked layout the sm100 GEMM reads, written by the
    quantization kernels themselves:
    ``lhs`` rowwise with the M-group layout of ``offs`` (A forward, grad_out dgrad);
    ``rhs_fwd`` / ``rhs_bwd`` per expert along K / along N; ``wgrad_operands`` colwise
    per token group (K-group layout), quantized straight into the padded layout with
    ``padded_starts`` (alignment 32: any group sizes with ``pad_groups=True``, no sync).
    The M-group layout needs the offs, which ``lhs`` does not get: ``lhs`` returns its
    input unquantized and ``mm_2d3d`` quantizes it (:meth:`quantize_lhs`) with the offs
    it is handed, the groups of that very product.

    GEMM: ``F.scaled_grouped_mm(..., BlockWise1x32, ..., SWIZZLE_32_4_4)``
    (``"mxfp8_gemm"``) on CUDA capability 10.x only, writing bfloat16; everywhere else
    (CPU, sm90, ROCm) ``"emulated"``: the same quantized operands, their blocked scales
    read back through the inverse layout, dequantized, fp32 grouped GEMM. K and N must
    be multiples of 32. Data is always float8_e4m3fn.
    """

    name: str = "mxfp8"
    alignment: int = 32
    rounding: str = "rceil"

    def backend(self, device):
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip:
            return "emulated"
        major, _ = torch.cuda.get_device_capability(device)
        # Capability 10.x ONLY: torch's MXFP8 grouped GEMM is an sm100 kernel, and on
        # sm90 torch 2.11 launches it anyway (the CUDA context dies).
        return "mxfp8_gemm" if major == 10 and has_scaled_grouped_mm() else "emulated"

    def out_dtypes(self, backend, in_dtype):
        return (torch.bfloat16,) if backend == "mxfp8_gemm" else FLOAT_DTYPES

    def fp8_dtypes(self, backend, device):
        return (torch.float8_e4m3fn,)

    def default_fp8_dtype(self, device):
        return torch.float8_e4m3fn

    def check_inputs(self, A, B_t):
        if self.rounding not in _mx.ROUNDINGS:
            raise ValueError(f"grouped_mm: expected recipe {self.name!r} with rounding \"rceil\" or \"floor\", "
                             f"got {self.rounding!r}")
        k, n = B_t.shape[1], B_t.shape[2]
        if k % MX_BLOCK or n % MX_BLOCK:
            raise ValueError(f"grouped_mm: expected K and N to be multiples of {MX_BLOCK} for recipe {self.name!r} "
                             f"(MXFP8 blocks of {MX_BLOCK} along each contraction: K forward, N for grad_A), "
                             f"got K={k}, N={n}")

    def pads_token_groups(self, backend):
        # torch's MXFP8 grouped GEMM is only tested (by torch and torchao) with M groups
        # that are multiples of 32: pad them on the real GEMM. The emulation takes any.
        return backend == "mxfp8_gemm"

    def lhs(self, x, fp8_dtype):
        return x  # deferred: mm_2d3d quantizes it with the offs of the M-group scale layout

    def rhs_fwd(self, b_t, fp8_dtype):
        return _mx.quantize_mxfp8_experts(b_t, self.rounding, blocked=True)  # (E, K, N) col-major

    def rhs_bwd(self, saved, fp8_dtype):
        return _mx.quantize_mxfp8_experts(saved["B_t"].transpose(-2, -1), self.rounding, blocked=True)  # (E, N, K)

    def wgrad_operands(self, grad_out, saved, offs, fp8_dtype, padded_starts):
        layout = dict(padded_starts=padded_starts, alignment=None if padded_starts is None else self.alignment)
        qg, sg = _mx.quantize_mxfp8_colwise(grad_out, self.rounding, True, offs, **layout)  # (Mp, N) col-major
        qa, sa = _mx.quantize_mxfp8_colwise(saved["A"], self.rounding, True, offs, **layout)  # (Mp, K) col-major
        return (qg.t(), sg), (qa, sa)

    def quantize_lhs(self, x: Tensor, offs: Tensor) -> Tuple[Tensor, Tensor]:
        return _mx.quantize_mxfp8_rowwise(x, self.rounding, blocked=True, offs=offs)

    def mm_2d3d(self, lhs, rhs, offs, out_dtype, backend):
        qa, sa = self.quantize_lhs(lhs, offs)  # (M, Kc) row-major, M-group blocked scales
        qb, sb = rhs  # (E, Kc, Nout) column-major, (E, ceil128(Nout) * ceil4(Kc/32))
        if backend == "mxfp8_gemm":
            return scaled_grouped_mm_mxfp8(qa, qb, sa, sb, offs, out_dtype)
        m, kc = qa.shape
        nout = qb.shape[2]
        sa_plain = unblock_scales_m_groups(sa, offs, m, kc // MX_BLOCK)  # (M, Kc/32)
        sb_plain = unblock_scales_experts(sb, nout, kc // MX_BLOCK)  # (E, Nout, Kc/32)
        a = qa.float() * _expand_blocks(sa_plain)
        b = qb.float() * _expand_blocks(sb_plain).transpose(-2, -1)
        return emulated_grouped_mm_2d3d(a, b, offs).to(out_dtype)

    def mm_2d2d(self, grad_t, a, offs, out_dtype, backend):
        (qg_t, sg), (qa, sa) = grad_t, a  # (N, Mp) row-major, (Mp, K) column-major; K-group blocked scales
        if backend == "mxfp8_gemm":
            return scaled_grouped_mm_mxfp8(qg_t, qa, sg, sa, offs, out_dtype)
        n, mp = qg_t.shape
        k = qa.shape[1]
        sg_plain = unblock_scales_k_groups(sg, offs, n, mp // MX_BLOCK)  # (N, Mp/32)
        sa_plain = unblock_scales_k_groups(sa, offs, k, mp // MX_BLOCK)  # (K, Mp/32)
        g_t = qg_t.float() * _expand_blocks(sg_plain)
        a_ = qa.float() * _expand_blocks(sa_plain).t()
        return emulated_grouped_mm_2d2d(g_t, a_, offs).to(out_dtype)


# ---- FP8 blockwise (DESIGN §6) ----------------------------------------------------------


def _expand_tiles(s: Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> Tensor:
    """Block scales (..., R', C') -> one per element (..., rows, cols)."""
    if block_rows > 1:
        s = s.repeat_interleave(block_rows, dim=-2)
    if block_cols > 1:
        s = s.repeat_interleave(block_cols, dim=-1)
    return s[..., :rows, :cols]


@dataclasses.dataclass(frozen=True)
class Fp8Blockwise(Recipe):
    """FP8 blockwise (DeepSeek-V3 style, DESIGN §6): activations in 1x128 blocks along
    each contraction, weights in 128x128 tiles, exact fp32 decode scales (no power-of-two
    rounding); e4m3fn (or e4m3fnuz in the emulation: the MI300 format).

    Operands (the layouts of :mod:`moe_fp8_ext.blockwise`): ``lhs`` 1x128 rows
    (``quantize_blockwise_act_lhs``); the weights 128x128, BOTH orientations from one read
    in the forward (``quantize_blockwise_weight_dual``): the transposed one is kept for
    the backward (fp8, instead of requantizing the bf16 weight; on ctx until the dgrad
    GEMM has used it where grouped_mm may hold it there, see ``_may_free_early``, else
    saved; only the forward one, ``rhs_fwd_only``, where no input gradient follows or
    ``MOE_FP8_HOLD_WEIGHT_OPERANDS=0``); ``wgrad_operands``
    grad_outᵀ in 1x128 blocks along the tokens and A in 128x1 blocks along the tokens,
    straight into the padded layout (alignment 128: any group sizes with
    ``pad_groups=True``, no sync). Where the padded layout is used, A's (and
    grad_out's) two operands come from one read (``quantize_blockwise_act_dual``) and
    A's fp8 weight-gradient operand is saved instead of A (``keeps_fp8_activations``).
    Weights concatenated along N (the experts layer's W1 and W3, a hidden size a
    multiple of 128) are quantized straight into one operand by the ``_cat`` weight ops,
    both orientations from one read, and the layer's input gradient through them is one
    GEMM (``joins_w13_dgrad``). In the experts layer on a GPU, h's and grad_h13's two
    operands are made together too (``makes_swiglu_operands``).

    GEMM: this package's CUTLASS grouped blockwise GEMM (:mod:`moe_fp8_ext.blockwise_gemm`,
    ``"blockwise_gemm"``) on CUDA capability 9.0 when built with it, writing bfloat16;
    elsewhere ``"emulated"`` (dequantize, fp32 grouped GEMM; on CUDA via a bf16 GEMM, so
    the exact fp32 scale products are rounded to bf16 there). PyTorch 2.11 has no
    grouped blockwise GEMM.
    """

    name: str = "fp8_blockwise"
    alignment: int = 128

    def backend(self, device):
        from . import blockwise_gemm

        device = torch.device(device)
        if device.type == "cuda" and blockwise_gemm.available(device):  # (remembered per device)
            return "blockwise_gemm"
        return "emulated"

    def out_dtypes(self, backend, in_dtype):
        return (torch.bfloat16,) if backend == "blockwise_gemm" else FLOAT_DTYPES

    def fp8_dtypes(self, backend, device):
        if backend == "blockwise_gemm":
            return (torch.float8_e4m3fn,)
        return (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

    def default_fp8_dtype(self, device):
        if self.backend(device) == "blockwise_gemm":
            return torch.float8_e4m3fn
        return default_fp8_dtype(device if device.type == "cuda" else None)

    def check_inputs(self, A, B_t):
        k, n = B_t.shape[1], B_t.shape[2]
        if self.backend(A.device) == "blockwise_gemm" and (k % 16 or n % 16):
            raise ValueError(f"grouped_mm: expected K and N to be multiples of 16 for the blockwise GEMM on {A.device} "
                             f"(16-byte aligned fp8 rows for TMA), got K={k}, N={n}")

    def lhs(self, x, fp8_dtype):
        return _ops.quantize_blockwise_act_lhs(x, fp8_dtype)

    def rhs_fwd(self, b_t, fp8_dtype):
        return _ops.quantize_blockwise_weight_dual(b_t, fp8_dtype)  # (q, s) (E, K, N) and (q, s) (E, N, K)

    def rhs_fwd_only(self, b_t, fp8_dtype):
        return _ops.quantize_blockwise_weight_rhs(b_t, fp8_dtype)  # the dual's forward half, bit for bit

    def reads_weights_once(self, b_ts):
        return _bw.weight_cat_ok(b_ts)  # quantize_blockwise_weight_dual(_cat)

    def rhs_fwd_cat(self, b_ts, fp8_dtype):
        # Every part but the last of whole 128-column tiles (W1's hidden size a multiple
        # of 128): each part's tiles are the concatenation's, written in place, no copy.
        if not _bw.weight_cat_ok(b_ts):
            return super().rhs_fwd_cat(b_ts, fp8_dtype)
        return _ops.quantize_blockwise_weight_rhs_cat(list(b_ts), fp8_dtype)

    def rhs_bwd_cat(self, b_ts, fp8_dtype):
        if not _bw.weight_cat_ok(b_ts):
            return super().rhs_bwd_cat(b_ts, fp8_dtype)
        return _ops.quantize_blockwise_weight_transposed_rhs_cat(list(b_ts), fp8_dtype)

    # The experts layer's input gradient through W1 and W3 as one GEMM, grad_h13 @
    # [W1; W3] (contraction 2H), where the hidden size is a multiple of 128: grad_h13's
    # 1x128 blocks (lhs of the whole of it) and [W1; W3]'s 128x128 tiles (the _cat weight
    # ops, no copy) are then those of the halves. Other hidden sizes would need a bf16
    # copy of [W1; W3] (tiles spanning both): two GEMMs over the halves there.
    joint_w13_dgrad = True

    def joins_w13_dgrad(self, w1, w3):
        return _bw.weight_cat_ok([w1.transpose(-2, -1), w3.transpose(-2, -1)])

    def rhs_dual_cat(self, b_ts, fp8_dtype):
        if not _bw.weight_cat_ok(b_ts):
            return super().rhs_dual_cat(b_ts, fp8_dtype)
        if len(b_ts) == 1:
            qf, sf, qb, sb = _ops.quantize_blockwise_weight_dual(b_ts[0], fp8_dtype)
        else:
            qf, sf, qb, sb = _ops.quantize_blockwise_weight_dual_cat(list(b_ts), fp8_dtype)
        return (qf, sf), (qb, sb)

    def save_for_backward(self, A, B_t, lhs, rhs):
        if len(rhs) == 4:  # rhs_fwd's: the transposed half kept in fp8 for the backward
            return {"A": A, "q_bwd": rhs[2], "s_bwd": rhs[3]}
        # rhs_dual_cat's forward half (grouped_mm holds the backward half on ctx until the
        # dgrad GEMM) or rhs_fwd_only's: B_t (no copy) is saved for the backward's.
        return {"A": A, "B_t": B_t}

    def rhs_bwd(self, saved, fp8_dtype):
        if "q_bwd" in saved:
            return saved["q_bwd"], saved["s_bwd"]
        return _ops.quantize_blockwise_weight_transposed_rhs(saved["B_t"], fp8_dtype)

    def wgrad_operands(self, grad_out, saved, offs, fp8_dtype, padded_starts):
        alignment = None if padded_starts is None else self.alignment
        qg, sg = _ops.quantize_blockwise_act_transposed_lhs(grad_out, fp8_dtype, offs, padded_starts,
                                                            alignment)  # (N, Mp), (N, Mp/128)
        qa, sa = _ops.quantize_blockwise_act_rhs(saved["A"], fp8_dtype, offs, padded_starts,
                                                 alignment)  # (Mp, K) col-major, (Mp/128, K)
        return (qg, sg), (qa, sa)

    # (q (Mp, D) column-major, scale (Mp/128, D)) per tensor, act_rhs's layouts; the GEMM
    # takes grad_out's transposed: act_transposed_lhs's tensors, the same bytes.
    keeps_fp8_activations = True

    def wgrad_operand(self, x, offs, fp8_dtype, padded_starts):
        alignment = None if padded_starts is None else self.alignment
        return _ops.quantize_blockwise_act_rhs(x, fp8_dtype, offs, padded_starts, alignment)

    def wgrad_operands_from(self, grad, a):
        (qg, sg), (qa, sa) = grad, a
        return (qg.t(), sg.t()), (qa, sa)

    def reads_activations_once(self, x=None):
        # quantize_blockwise_act_dual's one read (in the padded layout, which the callers use)
        return x is None or _bw.act_dual_reads_once(x)

    def lhs_with_wgrad_operand(self, x, offs, fp8_dtype, padded_starts):
        alignment = None if padded_starts is None else self.alignment
        ql, sl, qr, sr = _ops.quantize_blockwise_act_dual(x, fp8_dtype, offs, padded_starts, alignment)
        return (ql, sl), (qr, sr)

    # h's and grad_h13's two operands from one read each (the SwiGLU op, then act_dual) where that
    # kernel runs (a GPU, bf16/fp16, hidden a multiple of 8): no h in the backward, grad_h13 read
    # once on the joint path; in-kernel SwiGLU was slower (docs/decisions/015-swiglu-in-act-dual.md).
    def makes_swiglu_operands(self, h13):
        return _bw.act_dual_reads_once(h13) and (h13.shape[1] // 2) % 8 == 0

    def mm_2d3d_zeroes_tail(self, backend):
        return backend == "blockwise_gemm"  # (its table kernel zeroes those rows)

    def mm_2d3d(self, lhs, rhs, offs, out_dtype, backend):
        (qa, sa), (qb, sb) = lhs, rhs[:2]
        if backend == "blockwise_gemm":
            return _ops.blockwise_grouped_mm_2d3d(qa, sa, qb, sb, offs, out_dtype)
        m, k = qa.shape
        n = qb.shape[2]
        a = qa.float() * _expand_tiles(sa, m, k, 1, _bw.BW_BLOCK)
        b = qb.float() * _expand_tiles(sb, k, n, _bw.BW_BLOCK, _bw.BW_BLOCK)
        return emulated_grouped_mm_2d3d(a, b, offs).to(out_dtype)

    def mm_2d2d(self, grad_t, a, offs, out_dtype, backend):
        (qg, sg), (qa, sa) = grad_t, a  # (N, Mp) row-major, (Mp, K) column-major
        if backend == "blockwise_gemm":
            return _ops.blockwise_grouped_mm_2d2d(qg, sg, qa, sa, offs, out_dtype)
        n, mp = qg.shape
        k = qa.shape[1]
        g_t = qg.float() * _expand_tiles(sg, n, mp, 1, _bw.BW_BLOCK)
        a_ = qa.float() * _expand_tiles(sa, mp, k, _bw.BW_BLOCK, 1)
        return emulated_grouped_mm_2d2d(g_t, a_, offs).to(out_dtype)

    def wgrad_lhs_rows(self, grad_t, start, stop):
        qg, sg = grad_t  # (N, Mp) row-major, (N, Mp/128) column-major
        return qg[start:stop], sg[start:stop]


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


register_recipe(Fp8Rowwise())
register_recipe(Bf16())
register_recipe(Mxfp8())
register_recipe(Fp8Blockwise())
