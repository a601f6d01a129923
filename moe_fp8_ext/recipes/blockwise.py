"""The fp8_blockwise recipe (DESIGN §6): 1x128 activation blocks, 128x128 weight tiles,
exact fp32 decode scales."""

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from .. import blockwise as _bw
from ..platform import default_fp8_dtype
from .base import (
    FLOAT_DTYPES,
    SAME_READ,
    Recipe,
    _zero_tail,
    add_on_column_views,
    check_fields,
    emulated_grouped_mm_2d2d,
    emulated_grouped_mm_2d3d,
    gemm_on_column_views,
    joined_bwd,
    joined_fwd,
)

_ops = torch.ops.moe_fp8

def _expand_tiles(s: Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> Tensor:
    """Block scales (..., R', C') -> one per element (..., rows, cols)."""
    if block_rows > 1:
        s = s.repeat_interleave(block_rows, dim=-2)
    if block_cols > 1:
        s = s.repeat_interleave(block_cols, dim=-1)
    return s[..., :rows, :cols]


class W13Interleaved(NamedTuple):
    """[W1; W3]'s forward operand interleaved by 128 hidden columns (``quantize_w13``), the
    fused SwiGLU GEMM's (``mm_2d3d_swiglu``)."""

    q: Tensor
    s: Tensor


@dataclasses.dataclass(frozen=True)
class Fp8Blockwise(Recipe):
    """FP8 blockwise (DeepSeek-V3 style, DESIGN §6): activations in 1x128 blocks along
    each contraction, weights in 128x128 tiles, exact fp32 decode scales (no power-of-two
    rounding); e4m3fn (or e4m3fnuz in the emulation: the MI300 format).

    Operands (the layouts of :mod:`moe_fp8_ext.blockwise`): rowwise 1x128 blocks along the
    contraction; colwise 128x1 blocks along the tokens, straight into the padded layout
    (alignment 128: any group sizes with ``pad_groups=True``, no sync), both from one read
    where ``quantize_blockwise_act_dual`` reads once (a GPU; ``colwise=SAME_READ``). The
    weights 128x128: a tile and its transpose share the scale, so one read makes both
    (``quantize_blockwise_weight_dual``); weights joined along N (W1 and W3, hidden a
    multiple of 128) go straight into one operand (the ``_cat`` ops), and the layer's
    input gradient through them is one GEMM (``joins_w13_dgrad``).

    GEMM: this package's CUTLASS grouped blockwise GEMM (:mod:`moe_fp8_ext.blockwise_gemm`,
    ``"blockwise_gemm"``) on CUDA capability 9.0 when built with it, writing bfloat16;
    elsewhere ``"emulated"`` (dequantize, fp32 grouped GEMM; on CUDA via a bf16 GEMM, so
    the exact fp32 scale products are rounded to bf16 there). PyTorch 2.11 has no
    grouped blockwise GEMM.

    ``hold_weight_operands`` (default False): True makes each weight's input-gradient
    operand with the forward one (the dual ops' one read) and holds it until the input
    gradient: 3·E·hidden·dim fp8 bytes a layer saved for the backward, for a few percent
    of a step (docs/decisions/050).
    """

    name: str = "fp8_blockwise"
    alignment: int = 128
    hold_weight_operands: bool = False
    # W2's input-gradient GEMM with the dSwiGLU in its epilogue (mm_2d3d_dswiglu): bit for bit the composed path,
    # slower than it (record 038), so off.
    dswiglu_in_gemm: bool = False

    def __post_init__(self):
        check_fields(self, ("hold_weight_operands", "dswiglu_in_gemm"))

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

    def joins_w13_dgrad(self, w1, w3):
        # One GEMM grad_h13 @ [W1; W3] where the hidden size is a multiple of 128: the 1x128 blocks of grad_h13 and
        # the 128x128 tiles of [W1; W3] (_cat weight ops, no copy) are then the halves'. Otherwise two GEMMs.
        return _bw.weight_cat_ok([w1.transpose(-2, -1), w3.transpose(-2, -1)])

    def quantize(self, x, fp8_dtype, groups=None, *, rowwise=True, colwise=False):
        # colwise: (q (Mp, D) column-major, scale (Mp/128, D)), 128x1 blocks along the tokens
        if colwise == SAME_READ:  # quantize_blockwise_act_dual's one read (in the padded layout)
            colwise = rowwise and _bw.act_dual_reads_once(x)
        if colwise:
            offs, starts = groups
            alignment = None if starts is None else self.alignment
            if rowwise:
                ql, sl, qr, sr = _ops.quantize_blockwise_act_dual(x, fp8_dtype, offs, starts, alignment)
                return (ql, sl), (qr, sr)
            return None, _ops.quantize_blockwise_act_rhs(x, fp8_dtype, offs, starts, alignment)
        return (_ops.quantize_blockwise_act_lhs(x, fp8_dtype) if rowwise else None), None

    def quantize_weights(self, b_ts, fp8_dtype, *, fwd=True, bwd=False):
        # A tile and its transpose share the scale: one read makes both. Joined weights go straight into one operand
        # where every part but the last is of whole 128-column tiles (W1's hidden size); else a joined copy.
        b_ts = list(b_ts)
        cat_ok = _bw.weight_cat_ok(b_ts)
        if bwd == SAME_READ:
            bwd = fwd and cat_ok
        if fwd and bwd and cat_ok:
            qf, sf, qb, sb = (_ops.quantize_blockwise_weight_dual(b_ts[0], fp8_dtype) if len(b_ts) == 1
                              else _ops.quantize_blockwise_weight_dual_cat(b_ts, fp8_dtype))
            return (qf, sf), (qb, sb)
        f = b = None
        if fwd:
            f = (_ops.quantize_blockwise_weight_rhs(joined_fwd(b_ts), fp8_dtype) if len(b_ts) == 1 or not cat_ok
                 else _ops.quantize_blockwise_weight_rhs_cat(b_ts, fp8_dtype))
        if bwd:
            b = (_ops.quantize_blockwise_weight_transposed_rhs(joined_bwd(b_ts), fp8_dtype) if len(b_ts) == 1 or not cat_ok
                 else _ops.quantize_blockwise_weight_transposed_rhs_cat(b_ts, fp8_dtype))
        return f, b

    def mm_2d3d(self, lhs, rhs, offs, out_dtype, backend):
        (qa, sa), (qb, sb) = lhs, rhs
        if backend == "blockwise_gemm":  # (its table kernel zeroes the tail rows)
            return _ops.blockwise_grouped_mm_2d3d(qa, sa, qb, sb, offs, out_dtype)
        m, k = qa.shape
        n = qb.shape[2]
        a = qa.float() * _expand_tiles(sa, m, k, 1, _bw.BW_BLOCK)
        b = qb.float() * _expand_tiles(sb, k, n, _bw.BW_BLOCK, _bw.BW_BLOCK)
        return _zero_tail(emulated_grouped_mm_2d3d(a, b, offs).to(out_dtype), offs)

    mm_2d2d_parts = gemm_on_column_views  # (per-column scales: a GEMM on each part's view)
    mm_2d2d_parts_add_ = add_on_column_views

    def swiglu_in_gemm(self, hidden_dim, device):
        # W1 and W3 of one hidden size, a multiple of 128, interleaved by 128 in the forward operand; a padded layout
        # of 128-row blocks (DESIGN §6, §10)
        return (hidden_dim > 0 and hidden_dim % _bw.BW_BLOCK == 0 and self.alignment == _bw.BW_BLOCK
                and self.backend(device) == "blockwise_gemm")

    def quantize_w13(self, b_ts, fp8_dtype, *, bwd=False):
        # The SwiGLU GEMM's forward operand where it runs (the input-gradient one keeps [W1; W3])
        b_ts = list(b_ts)
        w = b_ts[0]
        if not (len(b_ts) == 2 and w.dim() == 3 and b_ts[1].shape == w.shape
                and self.swiglu_in_gemm(w.shape[-1], w.device)):
            return self.quantize_weights(b_ts, fp8_dtype, bwd=bwd)
        if bwd:  # (SAME_READ: the dual reads once)
            qf, sf, qb, sb = _ops.quantize_blockwise_weight_dual_cat(b_ts, fp8_dtype, True)
            return W13Interleaved(qf, sf), (qb, sb)
        return W13Interleaved(*_ops.quantize_blockwise_weight_rhs_cat(b_ts, fp8_dtype, True)), None

    def mm_2d3d_swiglu(self, tensors, offs, out_dtype, backend, fp8_dtype, groups, *, colwise=False):
        # One GEMM writes h13 and both of h's operands (blockwise_grouped_mm_swiglu), bit for bit the composed path's.
        if not isinstance(tensors[1], W13Interleaved):
            return super().mm_2d3d_swiglu(tensors, offs, out_dtype, backend, fp8_dtype, groups, colwise=colwise)
        ((qa, sa), rhs13), starts = tensors, groups[1]
        tensors.clear()
        if starts is None:  # (h's colwise operand is made all the same, then dropped: the op has no switch for it)
            starts = _ops.padded_group_offsets(offs, qa.shape[0], self.alignment)[0]
        h13, qr, sr, qc, sc = _ops.blockwise_grouped_mm_swiglu(qa, sa, rhs13.q, rhs13.s, offs, starts)
        return h13, (qr, sr), ((qc, sc) if colwise else None)

    def mm_2d3d_dswiglu(self, tensors, offs, out_dtype, backend, fp8_dtype, groups, *, joint, with_h=False,
                        colwise=False):
        # With dswiglu_in_gemm, one GEMM writes grad_h13's two operands (blockwise_grouped_mm_dswiglu), bit for bit
        # the composed path's, where both are wanted (one input-gradient GEMM, W13's weight gradient in the padded
        # layout) and h is not.
        h13 = tensors[2]
        if not (self.dswiglu_in_gemm and joint and colwise and not with_h and groups[1] is not None
                and backend == "blockwise_gemm"
                and out_dtype == torch.bfloat16 and h13.dtype == torch.bfloat16
                and self.swiglu_in_gemm(h13.shape[1] // 2, h13.device)):
            del h13
            return super().mm_2d3d_dswiglu(tensors, offs, out_dtype, backend, fp8_dtype, groups, joint=joint,
                                           with_h=with_h, colwise=colwise)
        ((qa, sa), (qb, sb), _), h13 = tensors, h13.contiguous()
        tensors.clear()
        qr, sr, qc, sc = _ops.blockwise_grouped_mm_dswiglu(qa, sa, qb, sb, offs, h13, groups[1])
        return None, (qr, sr), None, (qc, sc)

    def mm_2d2d_add_(self, out, grad, a, offs, out_dtype, backend):
        if backend != "blockwise_gemm":
            return super().mm_2d2d_add_(out, grad, a, offs, out_dtype, backend)
        (qg, sg), (qa, sa) = grad, a  # (as mm_2d2d) the fp32 accumulator added to out by the GEMM
        _ops.blockwise_grouped_mm_2d2d_add_(out, qg.t(), sg.t(), qa, sa, offs)

    def mm_2d2d(self, grad, a, offs, out_dtype, backend):
        (qg, sg), (qa, sa) = grad, a  # (Mp, N), (Mp, K) column-major; scales (Mp/128, N), (Mp/128, K)
        qg, sg = qg.t(), sg.t()  # (N, Mp) row-major: act_transposed_lhs's layout, the same bytes
        if backend == "blockwise_gemm":
            return _ops.blockwise_grouped_mm_2d2d(qg, sg, qa, sa, offs, out_dtype)
        n, mp = qg.shape
        k = qa.shape[1]
        g_t = qg.float() * _expand_tiles(sg, n, mp, 1, _bw.BW_BLOCK)
        a_ = qa.float() * _expand_tiles(sa, mp, k, _bw.BW_BLOCK, 1)
        return emulated_grouped_mm_2d2d(g_t, a_, offs).to(out_dtype)
