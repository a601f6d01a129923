"""Differentiable grouped GEMM for MoE experts: a drop-in for
``torch._grouped_mm(A, B_t, offs=offs)`` that trains in FP8 (DESIGN §5).

    out = grouped_mm(A, B_t, offs)                      # recipe="fp8_rowwise"
    out = grouped_mm(A, B_t, offs, recipe="bf16")       # the torch._grouped_mm baseline

fp8_rowwise: every operand is quantized with this package's kernels and multiplied by
PyTorch's FP8 grouped GEMM::

    forward  out    = A_q(rows) @ B_t_q(cols over K)
    dgrad    grad_A = grad_out_q(rows) @ B_q(cols over N)
    wgrad    grad_B = grad_out_q(cols per group)^T @ A_q(cols per group)

Where the FP8 grouped GEMM is not available (a CPU, a GPU before sm90) the same
quantized operands are dequantized and multiplied in fp32 ("emulated"), so results and
gradients are the same math; :func:`grouped_mm_backend` says which path runs. The fp8
recipe never silently falls back to bf16 math.

Token groups of any size work without a host sync (``pad_groups=True``, the default;
DESIGN §8). The only FP8 GEMM that needs aligned groups is the weight gradient, whose
contraction runs over the tokens of a group (16-byte aligned pieces of K); its
operands are quantized straight into the padded layout (group starts rounded up to
16 rows, zero rows between), so no padded copy is ever written. The forward and the
input gradient group the M rows of a 2-D x 3-D GEMM, which PyTorch's CUDA grouped
GEMMs take at any size (their per-group pointers only need 16-byte aligned rows, i.e.
K % 16 == 0: see aten/src/ATen/native/cuda/GroupMMCommon.cuh), so they run
unpadded. On ROCm, where that is not established, the input is padded and the output
unpadded around the aligned path instead. With ``pad_groups=False`` every group
size must be a multiple of 16; set ``MOE_FP8_DEBUG=1`` to check them (that syncs).
No op here syncs with the host otherwise, and the whole function works under
``torch.compile(fullgraph=True)``.
"""

import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops, token_groups
from .platform import default_fp8_dtype

RECIPES = ("fp8_rowwise", "bf16")
GROUP_ALIGNMENT = 16


def grouped_mm_backend(device: torch.device) -> str:
    """``"fp8_gemm"`` when the FP8 grouped GEMM runs on ``device`` (CUDA sm90+ or a
    ROCm GPU with a torch that has it), else ``"emulated"`` (dequantize + fp32 GEMM)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "emulated"
    has_op = hasattr(torch, "_scaled_grouped_mm") or hasattr(F, "scaled_grouped_mm")
    if torch.version.hip:
        return "fp8_gemm" if has_op else "emulated"
    major, _ = torch.cuda.get_device_capability(device)
    return "fp8_gemm" if has_op and major >= 9 else "emulated"


def _scaled_grouped_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs: Tensor, out_dtype) -> Tensor:
    """PyTorch's FP8 grouped GEMM with decode scales (rowwise for 2-D x 3-D; flat
    per-group scales for 2-D x 2-D), whichever entry point this torch has."""
    if hasattr(torch, "_scaled_grouped_mm"):
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype, use_fast_accum=True)
    rowwise = F.ScalingType.RowWise
    return F.scaled_grouped_mm(a, b, scale_a, rowwise, scale_b, rowwise, offs=offs, output_dtype=out_dtype, use_fast_accum=True)


def _row_groups(offs: Tensor, m: int):
    """Group index of each of the m rows and whether the row is inside a group (rows
    past offs[-1] are not part of the product). No host sync."""
    rows = torch.arange(m, device=offs.device, dtype=offs.dtype)
    g = torch.searchsorted(offs, rows, right=True)
    return g.clamp(max=max(offs.numel() - 1, 0)), g < offs.numel()


# The emulated GEMMs multiply the dequantized fp8 operands with fp32 accumulation.
# On CUDA they use torch._grouped_mm in bf16, which holds fp8 x power-of-two scale
# exactly. On the CPU, a bf16 grouped GEMM is not available everywhere (and its fake
# kernel rejects fp32), so the CPU computes every expert densely in fp32 and keeps
# each row's own group: E times the flops, fine for an emulation, and traceable.
def _emulated_2d3d(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    if a.is_cuda:
        return torch._grouped_mm(a.bfloat16(), b.bfloat16(), offs=offs).float()
    # Rows past offs[-1] come out as the last group's product here; _mm_2d3d zeroes
    # them on every path.
    g, _ = _row_groups(offs, a.shape[0])
    full = torch.einsum("mk,ekn->emn", a, b)
    return full.gather(0, g.long()[None, :, None].expand(1, a.shape[0], b.shape[2])).squeeze(0)


def _emulated_2d2d(a_t: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    if a_t.is_cuda:
        return torch._grouped_mm(a_t.bfloat16(), b.bfloat16(), offs=offs).float()
    g, inside = _row_groups(offs, b.shape[0])
    onehot = F.one_hot(g.long(), offs.numel()).to(a_t.dtype) * inside[:, None]  # (M, E)
    return torch.einsum("nm,me,mk->enk", a_t, onehot, b)


def _mm_2d3d(qa, sa, qb, sb, offs, out_dtype, emulated: bool) -> Tensor:
    """(M, K) x (E, K, N) -> (M, N); sa (M,), sb (E, N). Rows past offs[-1] are zero
    (the grouped GEMMs leave them unwritten; zeroing only touches those rows)."""
    if not emulated:
        out = _scaled_grouped_mm(qa, qb, sa, sb, offs, out_dtype)
    else:
        out = _emulated_2d3d(qa.float() * sa[:, None], qb.float() * sb[:, None, :], offs).to(out_dtype)
    return ops.zero_rows_past_groups_(out, offs)


def _mm_2d2d(qa_t, sa, qb, sb, offs, out_dtype, emulated: bool) -> Tensor:
    """(N, M) x (M, K) grouped along M -> (G, N, K); sa (G, N), sb (G, K)."""
    if not emulated:
        return _scaled_grouped_mm(qa_t, qb, sa.reshape(-1), sb.reshape(-1), offs, out_dtype)
    g, _ = _row_groups(offs, qb.shape[0])
    return _emulated_2d2d(qa_t.float() * sa[g].t(), qb.float() * sb[g], offs).to(out_dtype)


class _Fp8RowwiseGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, B_t, offs, out_dtype, fp8_dtype, emulated, pad_wgrad):
        qa, sa = ops.quantize_rowwise(A, fp8_dtype)
        qb, sb = ops.quantize_experts_fwd(B_t, fp8_dtype)
        ctx.save_for_backward(A, B_t, offs)
        ctx.fp8_dtype = fp8_dtype
        ctx.emulated = emulated
        ctx.pad_wgrad = pad_wgrad
        return _mm_2d3d(qa, sa.squeeze(-1), qb, sb.squeeze(1), offs, out_dtype, emulated)

    @staticmethod
    def backward(ctx, grad_out):
        A, B_t, offs = ctx.saved_tensors
        f8, emulated = ctx.fp8_dtype, ctx.emulated
        grad_out = grad_out.contiguous()
        grad_A = grad_B_t = None
        if ctx.needs_input_grad[0]:
            qg, sg = ops.quantize_rowwise(grad_out, f8)
            qw, sw = ops.quantize_experts_bwd(B_t, f8)  # (E, N, K) column-major
            grad_A = _mm_2d3d(qg, sg.squeeze(-1), qw, sw.squeeze(1), offs, A.dtype, emulated)
        if ctx.needs_input_grad[1]:
            # Unaligned groups (pad_groups) or an M that is not a multiple of 16: both
            # operands go straight into the padded layout.
            starts, wgrad_offs = None, offs
            if ctx.pad_wgrad:
                starts, wgrad_offs = ops.padded_group_offsets(offs, A.shape[0], GROUP_ALIGNMENT)
            layout = dict(padded_starts=starts, alignment=GROUP_ALIGNMENT)
            if grad_out.dtype == A.dtype:
                qg_c, sg_c, qa_c, sa_c = ops.quantize_jagged_colwise_dual(grad_out, A, offs, f8, **layout)
            else:
                qg_c, sg_c = ops.quantize_jagged_colwise(grad_out, offs, f8, **layout)
                qa_c, sa_c = ops.quantize_jagged_colwise(A, offs, f8, **layout)
            grad_B = _mm_2d2d(qg_c.t(), sg_c, qa_c, sa_c, wgrad_offs, B_t.dtype, emulated)  # (E, N, K)
            grad_B_t = grad_B.transpose(-2, -1)
        return grad_A, grad_B_t, None, None, None, None, None


def _check_debug_alignment(offs: Tensor) -> None:
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).cpu()  # host-sync-ok: MOE_FP8_DEBUG only
    bad = (sizes % GROUP_ALIGNMENT != 0).nonzero().flatten().tolist()  # host-sync-ok: MOE_FP8_DEBUG only
    if bad:
        raise ValueError(
            f"grouped_mm: expected group sizes that are multiples of {GROUP_ALIGNMENT} for the fp8 GEMM, "
            f"got {sizes[bad[0]].item()} for group {bad[0]}"  # host-sync-ok: MOE_FP8_DEBUG only
        )


def grouped_mm(
    A: Tensor,
    B_t: Tensor,
    offs: Tensor,
    *,
    recipe: str = "fp8_rowwise",
    out_dtype: torch.dtype = torch.bfloat16,
    fp8_dtype: Optional[torch.dtype] = None,
    pad_groups: bool = True,
) -> Tensor:
    """Grouped ``A @ B_t[e]`` over the token groups of ``offs``, differentiable in A and B_t.

    A (M, K) row-major (bf16 or fp32), B_t (E, K, N) in any per-expert layout (the
    transpose of an (E, N, K) weight is the common case), ``offs`` int32 (E,) with the
    cumulative end row of each group (DESIGN §3). Returns (M, N) in ``out_dtype``.
    Rows past ``offs[-1]`` belong to no group: their output and gradient are zero.

    ``pad_groups`` (fp8 recipe): groups of any size, no host sync (see the module
    docstring for how, and bench/RESULTS.md for the cost: within noise of aligned
    groups on H200). With ``pad_groups=False`` every group size must be a multiple of
    16 (M need not be). The bf16 recipe is ``torch._grouped_mm`` as is, whose
    backward needs groups that are multiples of 8.
    """
    if recipe not in RECIPES:
        raise ValueError(f"grouped_mm: expected recipe in {RECIPES}, got {recipe!r}")
    if recipe == "bf16":
        return torch._grouped_mm(A, B_t, offs=offs)
    if A.dim() != 2 or B_t.dim() != 3:
        raise ValueError(f"grouped_mm: expected A 2-D and B_t 3-D, got {A.dim()}-D and {B_t.dim()}-D")
    if A.shape[1] != B_t.shape[1]:
        raise ValueError(f"grouped_mm: expected A (M, K) and B_t (E, K, N) with the same K, got {tuple(A.shape)} and {tuple(B_t.shape)}")
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] != B_t.shape[0]:
        raise ValueError(f"grouped_mm: expected offs int32 of shape ({B_t.shape[0]},), got {offs.dtype} {tuple(offs.shape)}")
    if not pad_groups and os.environ.get("MOE_FP8_DEBUG") == "1":
        _check_debug_alignment(offs)
    emulated = grouped_mm_backend(A.device) == "emulated"
    f8 = fp8_dtype if fp8_dtype is not None else default_fp8_dtype(A.device if A.is_cuda else None)
    if pad_groups and not emulated and torch.version.hip:
        # Pad the input, run the aligned path, unpad the output (all differentiable).
        A_p, starts, ends = token_groups.pad_token_groups(A, offs, GROUP_ALIGNMENT)
        out_p = _Fp8RowwiseGroupedMM.apply(A_p, B_t, ends, out_dtype, f8, emulated, False)
        return token_groups.unpad_token_groups(out_p, offs, starts, A.shape[0])
    # The weight-gradient GEMM reads its operands column-major, with the token count as
    # the row stride, which must be a multiple of 16 bytes: an M that is not (rows past
    # offs[-1]) takes the padded layout even with aligned groups. M is static: no sync.
    pad_wgrad = pad_groups or A.shape[0] % GROUP_ALIGNMENT != 0
    return _Fp8RowwiseGroupedMM.apply(A, B_t, offs, out_dtype, f8, emulated, pad_wgrad)
