"""The fp8_rowwise recipe (DESIGN §5): one scale per row, per (expert, column) of the
weights and per (group, column) for the weight gradient."""

import dataclasses
from typing import Dict

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import ops
from .. import rowwise_gemm as _rowwise_gemm
from .. import swiglu as _sw
from ..platform import default_fp8_dtype, remembered_per_device
from .base import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    SAME_READ,
    Recipe,
    _zero_tail,
    add_on_column_views,
    check_fields,
    emulated_grouped_mm_2d2d,
    emulated_grouped_mm_2d3d,
    gemm_on_column_views,
    row_groups,
)

_ops = torch.ops.moe_fp8

GEMM_KERNELS = ("auto", "torch")  # Fp8Rowwise.gemm_kernel
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

    Operands: ``(q, scale)`` with scale (M,) rowwise, (E, N) / (E, K) for the weights,
    (G, D) colwise (one per token group and column). GEMM (``"fp8_gemm"``, on CUDA sm90+
    and ROCm GPUs whose torch has ``torch._scaled_grouped_mm``; else emulated): with
    ``gemm_kernel="auto"`` this package's CUTLASS kernels on Hopper (capability 9.0)
    where built with them (:mod:`moe_fp8_ext.rowwise_gemm`), PyTorch's elsewhere;
    ``gemm_kernel="torch"``: PyTorch's everywhere (the same math up to the order of
    fp32 sums). It writes bfloat16 only (torch's f8f8bf16 grouped kernel; its meta
    kernel checks the same): ``out_dtype`` must be bfloat16 there, while the emulation
    also writes float16 and float32.

    ``hold_weight_operands`` (default False: the backward quantizes the weight again):
    True, where one read makes both orientations of a weight
    (``quantize_experts_dual_cat``, while two experts' matrices fit the extension's L2
    budget), makes the backward operand in the forward and holds it until the input
    gradient has used it: E·N·K fp8 bytes per weight and layer saved from the forward to
    the backward, for a few percent of a step (docs/decisions/050).

        Fp8Rowwise(gemm_kernel="torch", hold_weight_operands=True)
    """

    name: str = "fp8_rowwise"
    alignment: int = 16
    pow2_scale: bool = True
    #: "auto": our grouped GEMM on Hopper where built, PyTorch's elsewhere; "torch": PyTorch's
    gemm_kernel: str = "auto"
    hold_weight_operands: bool = False

    def __post_init__(self):
        check_fields(self, ("pow2_scale", "hold_weight_operands"), {"gemm_kernel": GEMM_KERNELS})

    def _ours(self, a: Tensor) -> bool:
        """Whether the fp8 GEMM of operand ``a`` runs on our kernels (a constant under
        torch.compile)."""
        return self.gemm_kernel == "auto" and _rowwise_gemm.in_use(a)

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

    def joins_w13_dgrad(self, w1, w3):
        # One scale per row of grad_h13 and per (expert, column) of [W1; W3] over both
        # halves: written by one kernel each, no copy.
        return True

    def quantize(self, x, fp8_dtype, groups=None, *, rowwise=True, colwise=False):
        # (colwise=SAME_READ: none, the dual op runs two kernels)
        if colwise is True:
            offs, starts = groups
            if rowwise:
                qr, sr, qc, sc = _ops.quantize_rowwise_jagged_dual(x, offs, fp8_dtype, self.pow2_scale, starts,
                                                                   self.alignment)
                return (qr, sr.squeeze(-1)), (qc, sc)
            return None, _ops.quantize_jagged_colwise(x, offs, fp8_dtype, self.pow2_scale, starts, self.alignment)
        if not rowwise:
            return None, None
        q, s = _ops.quantize_rowwise(x, fp8_dtype, self.pow2_scale)
        return (q, s.squeeze(-1)), None

    def quantize_colwise_pair(self, a, b, fp8_dtype, groups):
        if a.dtype != b.dtype:
            return super().quantize_colwise_pair(a, b, fp8_dtype, groups)
        offs, starts = groups
        qa, sa, qb, sb = _ops.quantize_jagged_colwise_dual(a, b, offs, fp8_dtype, self.pow2_scale, starts,
                                                           self.alignment)
        return (qa, sa), (qb, sb)

    def quantize_weights(self, b_ts, fp8_dtype, *, fwd=True, bwd=False):
        # One scale per (expert, output column) over K: each part quantizes alone (the
        # _cat ops write it in place into one operand). One read makes both where the
        # dual kernel's rule holds (it reads data pointers and the L2 size: not traced).
        b_ts, p2 = list(b_ts), self.pow2_scale
        if bwd == SAME_READ:
            bwd = fwd and not torch.compiler.is_compiling() and ops.dual_cat_reads_once(b_ts)
            if bwd:
                qf, sf, qb, sb = _ops.quantize_experts_dual_cat(b_ts, fp8_dtype, p2)
                return (qf, sf.squeeze(1)), (qb, sb.squeeze(1))
        f = b = None
        if fwd:
            q, s = (_ops.quantize_experts_fwd(b_ts[0], fp8_dtype, p2) if len(b_ts) == 1
                    else _ops.quantize_experts_fwd_cat(b_ts, fp8_dtype, p2))
            f = (q, s.squeeze(1))
        if bwd:  # (E, ΣN, K) column-major
            q, s = (_ops.quantize_experts_bwd(b_ts[0], fp8_dtype, p2) if len(b_ts) == 1
                    else _ops.quantize_experts_bwd_cat(b_ts, fp8_dtype, p2))
            b = (q, s.squeeze(1))
        return f, b

    def quantize_swiglu(self, h13, fp8_dtype, groups=None, *, colwise=False):
        if colwise is True:
            return super().quantize_swiglu(h13, fp8_dtype, groups, colwise=True)
        q, s = _sw.swiglu_quantize_rowwise(h13, fp8_dtype, self.pow2_scale)  # = quantize(swiglu(h13)), bit for bit
        return (q, s.squeeze(-1)), None

    def quantize_swiglu_backward(self, tensors, fp8_dtype, groups=None, *, joint, with_h=False, colwise=False):
        # dSwiGLU fused with grad_h13's rowwise quantization (h too, on the joint path)
        if colwise is True:
            return super().quantize_swiglu_backward(tensors, fp8_dtype, groups, joint=joint, with_h=with_h,
                                                    colwise=True)
        grad_h, h13 = tensors
        tensors.clear()
        if joint:
            g13, q, s, h = _sw.swiglu_backward_with_h_quantize_rowwise(grad_h, h13, fp8_dtype, self.pow2_scale)
            return g13, (q, s.squeeze(-1)), (h if with_h else None), None
        h = _sw.swiglu(h13) if with_h else None
        g13, q1, s1, q3, s3 = _sw.swiglu_backward_quantize_rowwise(grad_h, h13, fp8_dtype, self.pow2_scale)
        return g13, ((q1, s1.squeeze(-1)), (q3, s3.squeeze(-1))), h, None

    def mm_2d3d(self, lhs, rhs, offs, out_dtype, backend):
        (qa, sa), (qb, sb) = lhs, rhs
        if backend == "fp8_gemm":
            if out_dtype == torch.bfloat16 and self._ours(qa):  # (its table kernel zeroes the tail rows)
                return _ops.rowwise_grouped_mm_2d3d(qa, sa, qb, sb, offs, out_dtype)
            return _zero_tail(scaled_grouped_mm_rowwise(qa, qb, sa, sb, offs, out_dtype), offs)
        out = emulated_grouped_mm_2d3d(qa.float() * sa[:, None], qb.float() * sb[:, None, :], offs).to(out_dtype)
        return _zero_tail(out, offs)

    mm_2d2d_parts = gemm_on_column_views  # (per-column scales: a GEMM on each part's view)
    mm_2d2d_parts_add_ = add_on_column_views

    def mm_2d2d_add_(self, out, grad, a, offs, out_dtype, backend):
        (qg, sg), (qa, sa) = grad, a  # (as mm_2d2d) our GEMM adds its fp32 product to out
        if backend == "fp8_gemm" and self._ours(qa):
            return _ops.rowwise_grouped_mm_2d2d_add_(out, qg.t(), sg, qa, sa, offs)
        return super().mm_2d2d_add_(out, grad, a, offs, out_dtype, backend)

    def mm_2d2d(self, grad, a, offs, out_dtype, backend):
        (qg, sg), (qa, sa) = grad, a  # (M, N) column-major, (G, N); (M, K) column-major, (G, K)
        qg_t = qg.t()
        if backend == "fp8_gemm":
            if out_dtype == torch.bfloat16 and self._ours(qa):
                return _ops.rowwise_grouped_mm_2d2d(qg_t, sg, qa, sa, offs, out_dtype)
            return scaled_grouped_mm_rowwise(qg_t, qa, sg.reshape(-1), sa.reshape(-1), offs, out_dtype)
        g, _ = row_groups(offs, qa.shape[0])
        return emulated_grouped_mm_2d2d(qg_t.float() * sg[g].t(), qa.float() * sa[g], offs).to(out_dtype)
