"""FP8 rowwise quantization (DESIGN §5): rows, expert weights in both orientations (one read where
the L2 budget allows), per-token-group columns. Each wrapper has its fake (meta) implementation
beside it, so the ops trace under ``torch.compile``.

Each op's argument checks are one function (the rules and order of
csrc/rowwise/rowwise_ops.cpp), run by its wrapper before any shape is read and by its fake, so a
meta tensor among CPU/CUDA ones or a bad argument under torch.compile fails as the real kernel
does.
"""

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _C
from ._checks import (
    _dtype,
    _dtype_name,
    _require,
    check_as_bf16,
    check_fp8_dtype,
    check_jagged_layout,
    check_quant_input,
)

_ops = torch.ops.moe_fp8

__all__ = [
    "dual_cat_reads_once",
    "quantize_experts_bwd",
    "quantize_experts_bwd_cat",
    "quantize_experts_dual_cat",
    "quantize_experts_fwd",
    "quantize_experts_fwd_cat",
    "quantize_jagged_colwise",
    "quantize_jagged_colwise_dual",
    "quantize_rowwise",
    "quantize_rowwise_jagged_dual",
]

def check_quantize_rowwise(x, fp8_dtype, op="quantize_rowwise"):
    check_quant_input(op, "x", x, 2)
    check_fp8_dtype(op, fp8_dtype)


def quantize_rowwise(x: Tensor, fp8_dtype: Optional[torch.dtype] = None, pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    """Quantize each row of ``x`` (M, K) (bf16/fp16/fp32, any strides).

    Returns ``q`` (M, K) row-major in ``fp8_dtype`` and ``scale`` (M, 1) float32,
    the amax of each row mapped to the fp8 max.
    """
    check_quantize_rowwise(x, fp8_dtype)
    return _ops.quantize_rowwise(x, _dtype(fp8_dtype, x), pow2_scale)


def _rowwise_outputs(x, fp8_dtype):
    m, k = x.shape
    return x.new_empty((m, k), dtype=fp8_dtype), x.new_empty((m, 1), dtype=torch.float32)


@torch.library.register_fake("moe_fp8::quantize_rowwise")
def _(x, fp8_dtype, pow2_scale=True):
    check_quantize_rowwise(x, fp8_dtype)
    return _rowwise_outputs(x, fp8_dtype)


MAX_EXPERTS_COLS = 65535  # experts of the "cols" shape: one grid dimension


def check_quantize_experts(b_t, fp8_dtype, rdim, op, as_bf16=False):
    """b_t (E, K, N) reduced over dim rdim; E <= 65535 where the kernel takes the
    "cols" shape (rdim not the contiguous dimension), as rowwise_ops.cpp decides."""
    check_quant_input(op, "b_t", b_t, 3)
    check_as_bf16(op, "b_t", b_t, as_bf16)
    check_fp8_dtype(op, fp8_dtype)
    e, r, c = b_t.shape[0], b_t.shape[rdim], b_t.shape[3 - rdim]
    if e == 0 or c == 0 or (b_t.stride(rdim) == 1 and r > 1):
        return
    _require(e <= MAX_EXPERTS_COLS, lambda: f"{op}: expected at most {MAX_EXPERTS_COLS} experts, got {e}")


def quantize_experts_fwd(b_t: Tensor, fp8_dtype: Optional[torch.dtype] = None, pow2_scale: bool = True,
                         as_bf16: bool = False) -> Tuple[Tensor, Tensor]:
    """Quantize expert weights ``b_t`` (E, K, N), the right operand of ``A @ B_t``,
    over K for every (e, n).

    Returns ``q`` (E, K, N) column-major per expert (strides (K·N, 1, K)) and
    ``scale`` (E, 1, N) float32. Any input layout; the fast paths are B_t
    column-major (the transpose of an (E, N, K) weight) and row-major. ``as_bf16``:
    ``b_t`` fp32 read as ``b_t.to(torch.bfloat16)`` (those bits, without the copy).
    """
    check_quantize_experts(b_t, fp8_dtype, 1, "quantize_experts_fwd", as_bf16)
    return _ops.quantize_experts_fwd(b_t, _dtype(fp8_dtype, b_t), pow2_scale, as_bf16)


def _experts_fake(b_t, fp8_dtype, rdim, op, as_bf16=False):
    """q (E, R, C) column-major per expert and scale (E, 1, C), R = b_t.shape[rdim]."""
    check_quantize_experts(b_t, fp8_dtype, rdim, op, as_bf16)
    e, r, c = b_t.shape[0], b_t.shape[rdim], b_t.shape[3 - rdim]
    q = b_t.new_empty_strided((e, r, c), (r * c, 1, r), dtype=fp8_dtype)
    return q, b_t.new_empty((e, 1, c), dtype=torch.float32)


@torch.library.register_fake("moe_fp8::quantize_experts_fwd")
def _(b_t, fp8_dtype, pow2_scale=True, as_bf16=False):
    return _experts_fake(b_t, fp8_dtype, 1, "quantize_experts_fwd", as_bf16)


def check_quantize_experts_cat(b_ts, fp8_dtype, op="quantize_experts_fwd_cat", rdim=1, as_bf16=False):
    """Each weight (E, K, N_i) as quantize_experts_fwd (rdim 1) or _bwd (rdim 2) takes
    it, all of one dtype, device, E and K (rowwise_ops.cpp's rules, in its words)."""
    _require(isinstance(b_ts, (list, tuple)) and len(b_ts) > 0,
             lambda: f"{op}: expected at least one weight, got none")
    if rdim == 2:
        _require(len(b_ts) <= 2, lambda: f"{op}: expected one or two weights, got {len(b_ts)}")
    check_fp8_dtype(op, fp8_dtype)
    b0 = b_ts[0]
    for i, b in enumerate(b_ts):
        check_quantize_experts(b, fp8_dtype, rdim, op)
        _require(b.dtype == b0.dtype and b.device == b0.device,
                 lambda: f"{op}: expected every weight of one dtype and device, got {_dtype_name(b0.dtype)} on "
                         f"{b0.device} and {_dtype_name(b.dtype)} on {b.device} (weight {i})")
        _require(b.shape[0] == b0.shape[0] and b.shape[1] == b0.shape[1],
                 lambda: f"{op}: expected every weight of shape (E, K, N_i) with the E and K of the first, "
                         f"({b0.shape[0]}, {b0.shape[1]}, .), got ({b.shape[0]}, {b.shape[1]}, {b.shape[2]}) "
                         f"(weight {i})")
    check_as_bf16(op, "b_t", b0, as_bf16)


def quantize_experts_fwd_cat(b_ts: Sequence[Tensor], fp8_dtype: Optional[torch.dtype] = None,
                             pow2_scale: bool = True, as_bf16: bool = False) -> Tuple[Tensor, Tensor]:
    """``quantize_experts_fwd`` of the concatenation of the weights ``b_ts`` (each
    (E, K, N_i)) along N, written straight into one operand (no copy of the weights or
    of their fp8 codes): ``q`` (E, K, ΣN_i) column-major per expert and ``scale``
    (E, 1, ΣN_i), each weight's part bit for bit its own ``quantize_experts_fwd`` (the
    scales never span two weights). The experts layer's W1/W3 operand. ``as_bf16``: as
    :func:`quantize_experts_fwd`'s."""
    check_quantize_experts_cat(b_ts, fp8_dtype, as_bf16=as_bf16)
    return _ops.quantize_experts_fwd_cat(list(b_ts), _dtype(fp8_dtype, b_ts[0]), pow2_scale, as_bf16)


def _cat_outputs(b_ts, fp8_dtype, bwd):
    """Empty (q, scale) of quantize_experts_fwd_cat (bwd=False) or _bwd_cat: the fakes."""
    e, k = b_ts[0].shape[0], b_ts[0].shape[1]
    n = sum(b.shape[2] for b in b_ts)
    if bwd:
        q = b_ts[0].new_empty_strided((e, n, k), (n * k, 1, n), dtype=fp8_dtype)
    else:
        q = b_ts[0].new_empty_strided((e, k, n), (k * n, 1, k), dtype=fp8_dtype)
    return q, b_ts[0].new_empty((e, 1, k if bwd else n), dtype=torch.float32)


@torch.library.register_fake("moe_fp8::quantize_experts_fwd_cat")
def _(b_ts, fp8_dtype, pow2_scale=True, as_bf16=False):
    check_quantize_experts_cat(b_ts, fp8_dtype, as_bf16=as_bf16)
    return _cat_outputs(b_ts, fp8_dtype, bwd=False)


def quantize_experts_bwd_cat(b_ts: Sequence[Tensor], fp8_dtype: Optional[torch.dtype] = None,
                             pow2_scale: bool = True, as_bf16: bool = False) -> Tuple[Tensor, Tensor]:
    """``quantize_experts_bwd`` of the concatenation of one or two weights ``b_ts``
    (each (E, K, N_i)) along N, the reduced dimension, so each (e, k) scale spans both:
    ``q`` (E, ΣN_i, K) column-major per expert and ``scale`` (E, 1, K), bit for bit
    ``quantize_experts_bwd(torch.cat(b_ts, dim=2))``. Two weights of one layout with N
    strided (the transposes of row-major (E, N_i, K) weights, e.g. torchtitan's w1 and
    w3) are read in place; other layouts quantize a copy. The experts layer's backward
    operand of W1 and W3 together (one input-gradient GEMM). ``as_bf16``: as
    :func:`quantize_experts_fwd`'s."""
    check_quantize_experts_cat(b_ts, fp8_dtype, "quantize_experts_bwd_cat", 2, as_bf16)
    return _ops.quantize_experts_bwd_cat(list(b_ts), _dtype(fp8_dtype, b_ts[0]), pow2_scale, as_bf16)


@torch.library.register_fake("moe_fp8::quantize_experts_bwd_cat")
def _(b_ts, fp8_dtype, pow2_scale=True, as_bf16=False):
    check_quantize_experts_cat(b_ts, fp8_dtype, "quantize_experts_bwd_cat", 2, as_bf16)
    return _cat_outputs(b_ts, fp8_dtype, bwd=True)


def _check_dual_cat(b_ts, fp8_dtype):
    for rdim in (1, 2):  # the rules of both ops it may run (rdim 2: one or two weights)
        check_quantize_experts_cat(b_ts, fp8_dtype, "quantize_experts_dual_cat", rdim)


def dual_cat_reads_once(b_ts: Sequence[Tensor]) -> bool:
    """Whether ``quantize_experts_dual_cat(b_ts)`` runs the one-read kernel (the rule of
    rowwise_ops.cpp in Python, with the extension's L2 budget (docs/TUNING.md);
    tests/test_rowwise.py checks the two agree)."""
    if not 1 <= len(b_ts) <= 2 or not b_ts[0].is_cuda or b_ts[0].element_size() != 2:
        return False
    e, k = b_ts[0].shape[0], b_ts[0].shape[1]
    n = sum(b.shape[2] for b in b_ts)
    if e == 0 or k == 0 or n % 16 or k % 16:
        return False
    for b in b_ts:
        if b.shape[2] == 0 or b.stride(1) != 1 or b.stride(0) % 8 or b.stride(2) % 8 or b.data_ptr() % 16:
            return False
    return 2 * n * k * b_ts[0].element_size() <= _C.dual_l2_budget(b_ts[0].get_device())


def quantize_experts_dual_cat(b_ts: Sequence[Tensor], fp8_dtype: Optional[torch.dtype] = None,
                              pow2_scale: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both operands of one or two weights ``b_ts`` (each (E, K, N_i)) at once:
    ``(q_fwd, s_fwd, q_bwd, s_bwd)``, bit for bit ``quantize_experts_fwd_cat(b_ts)``
    followed by ``quantize_experts_bwd_cat(b_ts)``. The experts layer's weight operands.

    One-read kernel (DESIGN §5): weights on a GPU stored (E, N_i, K) with K contiguous
    (``b_t = W.transpose(-2, -1)``, torchtitan's layout), bf16 or fp16, N and K multiples
    of 16, whose two experts' matrices fit the L2 budget are read from DRAM once: a tile
    is read again from L2 once its expert's amaxes are complete. The budget is the
    extension's L2 budget (docs/TUNING.md): by default three fifths of L2 (16 MB a
    matrix on an H100). Anything else runs the two ops."""
    _check_dual_cat(b_ts, fp8_dtype)
    return _ops.quantize_experts_dual_cat(list(b_ts), _dtype(fp8_dtype, b_ts[0]), pow2_scale)


@torch.library.register_fake("moe_fp8::quantize_experts_dual_cat")
def _(b_ts, fp8_dtype, pow2_scale=True):
    _check_dual_cat(b_ts, fp8_dtype)
    return _cat_outputs(b_ts, fp8_dtype, bwd=False) + _cat_outputs(b_ts, fp8_dtype, bwd=True)


def quantize_experts_bwd(b_t: Tensor, fp8_dtype: Optional[torch.dtype] = None, pow2_scale: bool = True,
                         as_bf16: bool = False) -> Tuple[Tensor, Tensor]:
    """Quantize the same expert weights for the input gradient ``grad_A = grad_out @ B``
    (B = ``b_t.transpose(-2, -1)``, (E, N, K)), over N for every (e, k).

    Returns ``q`` (E, N, K) column-major per expert (strides (N·K, 1, N)) and
    ``scale`` (E, 1, K) float32. ``as_bf16``: as :func:`quantize_experts_fwd`'s.
    """
    check_quantize_experts(b_t, fp8_dtype, 2, "quantize_experts_bwd", as_bf16)
    return _ops.quantize_experts_bwd(b_t, _dtype(fp8_dtype, b_t), pow2_scale, as_bf16)


@torch.library.register_fake("moe_fp8::quantize_experts_bwd")
def _(b_t, fp8_dtype, pow2_scale=True, as_bf16=False):
    return _experts_fake(b_t, fp8_dtype, 2, "quantize_experts_bwd", as_bf16)


def check_quantize_jagged_colwise(x, offs, fp8_dtype, padded_starts, alignment, op="quantize_jagged_colwise"):
    check_quant_input(op, "x", x, 2)
    check_fp8_dtype(op, fp8_dtype)
    return check_jagged_layout(x, offs, padded_starts, alignment, op)


def quantize_jagged_colwise(
    x: Tensor,
    offs: Tensor,
    fp8_dtype: Optional[torch.dtype] = None,
    pow2_scale: bool = True,
    padded_starts: Optional[Tensor] = None,
    alignment: int = 16,
) -> Tuple[Tensor, Tensor]:
    """Quantize each column of ``x`` (M, D) separately within every token group.

    ``offs`` is int32 (G,), the cumulative end row of each group (DESIGN §3); empty
    groups are fine. Returns ``q`` (M, D) column-major (strides (1, M)) and ``scale``
    (G, D) float32. Rows past ``offs[-1]`` get q = 0. Invalid ``offs`` raises on CPU
    (and on GPU with ``MOE_FP8_DEBUG=1``); on GPU it is clamped, never out of bounds.

    With ``padded_starts`` (from :func:`padded_group_offsets` or
    :func:`pad_token_groups` with the same ``alignment``: the gap-free layout, each
    group where the previous one's padded rows end; other starts raise on the CPU and
    with ``MOE_FP8_DEBUG=1``), ``q`` is written in the padded layout instead: ``R = ceil((M + G·alignment)/alignment)·alignment`` rows,
    group g at rows ``[padded_starts[g], padded_starts[g] + round_up(n_g, alignment))``
    and zeros everywhere else: bit for bit ``quantize_jagged_colwise(pad_token_groups(x,
    offs, alignment)[0], padded_ends)``, without writing the padded bf16 copy.
    """
    check_quantize_jagged_colwise(x, offs, fp8_dtype, padded_starts, alignment)
    return _ops.quantize_jagged_colwise(x, offs, _dtype(fp8_dtype, x), pow2_scale, padded_starts, alignment)


def _jagged_outputs(x, offs, fp8_dtype, rows):
    d = x.shape[1]
    q = x.new_empty_strided((rows, d), (1, rows), dtype=fp8_dtype)
    return q, x.new_empty((offs.shape[0], d), dtype=torch.float32)


@torch.library.register_fake("moe_fp8::quantize_jagged_colwise")
def _(x, offs, fp8_dtype, pow2_scale=True, padded_starts=None, alignment=16):
    rows = check_quantize_jagged_colwise(x, offs, fp8_dtype, padded_starts, alignment)
    return _jagged_outputs(x, offs, fp8_dtype, rows)


def check_quantize_jagged_colwise_dual(x1, x2, offs, fp8_dtype, padded_starts, alignment,
                                       op="quantize_jagged_colwise_dual"):
    check_quant_input(op, "x1", x1, 2)
    check_quant_input(op, "x2", x2, 2)
    check_fp8_dtype(op, fp8_dtype)
    if x1.dtype != x2.dtype:
        raise RuntimeError(f"{op}: expected x1 and x2 of one dtype, got {_dtype_name(x1.dtype)} and "
                           f"{_dtype_name(x2.dtype)}")
    _require(x1.shape[0] == x2.shape[0],
             lambda: f"{op}: expected x1 and x2 with the same number of rows, got {x1.shape[0]} and {x2.shape[0]}")
    return check_jagged_layout(x1, offs, padded_starts, alignment, op, xname="x1", x2=x2)


def quantize_jagged_colwise_dual(
    x1: Tensor,
    x2: Tensor,
    offs: Tensor,
    fp8_dtype: Optional[torch.dtype] = None,
    pow2_scale: bool = True,
    padded_starts: Optional[Tensor] = None,
    alignment: int = 16,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`quantize_jagged_colwise` of ``x1`` (M, D1) and ``x2`` (M, D2) (one dtype,
    one ``offs``, one layout) in a single launch: both operands of the weight-gradient
    GEMM ``grad_B[g] = grad_out[g]^T @ A[g]``. Returns ``(q1, scale1, q2, scale2)``."""
    check_quantize_jagged_colwise_dual(x1, x2, offs, fp8_dtype, padded_starts, alignment)
    return _ops.quantize_jagged_colwise_dual(x1, x2, offs, _dtype(fp8_dtype, x1), pow2_scale, padded_starts, alignment)


@torch.library.register_fake("moe_fp8::quantize_jagged_colwise_dual")
def _(x1, x2, offs, fp8_dtype, pow2_scale=True, padded_starts=None, alignment=16):
    rows = check_quantize_jagged_colwise_dual(x1, x2, offs, fp8_dtype, padded_starts, alignment)
    q1, s1 = _jagged_outputs(x1, offs, fp8_dtype, rows)
    q2, s2 = _jagged_outputs(x2, offs, fp8_dtype, rows)
    return q1, s1, q2, s2


def check_quantize_rowwise_jagged_dual(x, offs, fp8_dtype, padded_starts, alignment):
    return check_quantize_jagged_colwise(x, offs, fp8_dtype, padded_starts, alignment,
                                         op="quantize_rowwise_jagged_dual")


def quantize_rowwise_jagged_dual(
    x: Tensor,
    offs: Tensor,
    fp8_dtype: Optional[torch.dtype] = None,
    pow2_scale: bool = True,
    padded_starts: Optional[Tensor] = None,
    alignment: int = 16,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(*quantize_rowwise(x), *quantize_jagged_colwise(x, offs, ...))``, bit for bit:
    the operand of a token-grouped tensor's forward (or dgrad) GEMM and its operand of
    the weight-gradient GEMM, ``(q_rows, scale_rows, q_cols, scale_cols)``.

    It runs the two ops, one call (the fp8_rowwise recipe's ``quantize`` of both orientations).
    """
    check_quantize_rowwise_jagged_dual(x, offs, fp8_dtype, padded_starts, alignment)
    return _ops.quantize_rowwise_jagged_dual(x, offs, _dtype(fp8_dtype, x), pow2_scale, padded_starts, alignment)


@torch.library.register_fake("moe_fp8::quantize_rowwise_jagged_dual")
def _(x, offs, fp8_dtype, pow2_scale=True, padded_starts=None, alignment=16):
    rows = check_quantize_rowwise_jagged_dual(x, offs, fp8_dtype, padded_starts, alignment)
    return (*_rowwise_outputs(x, fp8_dtype), *_jagged_outputs(x, offs, fp8_dtype, rows))
