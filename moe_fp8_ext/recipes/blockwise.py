"""The fp8_blockwise recipe (DESIGN §6): 1x128 activation blocks, 128x128 weight tiles,
exact fp32 decode scales."""

import dataclasses

import torch
from torch import Tensor

from .. import blockwise as _bw
from ..platform import default_fp8_dtype
from .base import (
    FLOAT_DTYPES,
    Recipe,
    emulated_grouped_mm_2d2d,
    emulated_grouped_mm_2d3d,
)

_ops = torch.ops.moe_fp8

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
    ``hold_weight_operands=False``: the backward quantizes the weight again); ``wgrad_operands``
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
    hold_weight_operands: bool = True

    def __post_init__(self):
        if not isinstance(self.hold_weight_operands, bool):
            raise TypeError(f"Fp8Blockwise: expected hold_weight_operands to be a bool, got {self.hold_weight_operands!r}")

    def backend(self, device):
        from .. import blockwise_gemm

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

    # One input-gradient GEMM grad_h13 @ [W1; W3] (contraction 2H) where the hidden size is a multiple of 128: the
    # 1x128 blocks of grad_h13 and 128x128 tiles of [W1; W3] (_cat weight ops, no copy) are then the halves'. Other
    # hidden sizes would need a bf16 copy of [W1; W3] (tiles spanning both): two GEMMs over the halves there.
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

