"""FP8 blockwise quantization of activations (DESIGN §6): DeepSeek-style 1x128 and
128x1 blocks, one fp32 *decode* scale per block (``x ≈ q.float() * scale``) with the
exact ratio ``scale = 1 / (fp8_max / max(amax, 1e-12))`` (no power-of-two rounding).

The layouts are those of torchao's Triton kernels of the same names (so a user can
switch), for any sizes: a dimension that is not a multiple of 128 ends in a partial
block whose amax is taken over its valid part. ``fp8_dtype=None`` picks
:func:`moe_fp8_ext.default_fp8_dtype` (``float8_e4m3fnuz`` on MI300); e4m3fn, e4m3fnuz
and e5m2 are all accepted. Each wrapper has its fake implementation beside it, so the
ops trace under ``torch.compile(fullgraph=True)``.
"""

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .ops import (
    _dtype,
    _dtype_name,
    check_as_bf16,
    check_block_jagged,
    check_fp8_dtype,
    check_quant_input,
)

_ops = torch.ops.moe_fp8
BW_BLOCK = 128


# ---- argument checks shared by each wrapper and its fake (the rules and order of
# csrc/blockwise/blockwise_ops.cpp; "<op>: expected X, got Y"). The content of offs
# and padded_starts is the kernel's to check.


def _cdiv(a, b):
    return -(-a // b)


def check_quantize_blockwise_act_lhs(x, fp8_dtype, op="quantize_blockwise_act_lhs"):
    check_quant_input(op, "x", x, 2)
    check_fp8_dtype(op, fp8_dtype)


def check_quantize_blockwise_act_cols(x, fp8_dtype, offs, padded_starts, alignment, op):
    """The checks of the two transposing ops; returns the rows of q: M, or the padded
    rows."""
    check_quant_input(op, "x", x, 2)
    check_fp8_dtype(op, fp8_dtype)
    return check_block_jagged(op, x, offs, padded_starts, alignment, BW_BLOCK)


# ---- quantize_blockwise_act_lhs --------------------------------------------------------


def quantize_blockwise_act_lhs(x: Tensor, fp8_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """1x128 blocks along the rows of ``x`` (M, K), any strides (the left operand of a
    GEMM contracting over K). Returns q (M, K) row-major and scale (M, ceil(K/128))
    float32, column-major (strides (1, M)), as ``torch._scaled_mm`` reads a 1x128
    operand."""
    check_quantize_blockwise_act_lhs(x, fp8_dtype)
    return _ops.quantize_blockwise_act_lhs(x, _dtype(fp8_dtype, x))


def _lhs_fake(x, fp8_dtype):
    m, k = x.shape
    q = x.new_empty((m, k), dtype=fp8_dtype)
    return q, x.new_empty_strided((m, _cdiv(k, BW_BLOCK)), (1, torch.sym_max(m, 1)), dtype=torch.float32)


@torch.library.register_fake("moe_fp8::quantize_blockwise_act_lhs")
def _(x, fp8_dtype):
    check_quantize_blockwise_act_lhs(x, fp8_dtype)
    return _lhs_fake(x, fp8_dtype)


# ---- quantize_blockwise_act_rhs / quantize_blockwise_act_transposed_lhs ----------------


def _cols_fake(x, fp8_dtype, offs, padded_starts, alignment, transposed, op):
    r = check_quantize_blockwise_act_cols(x, fp8_dtype, offs, padded_starts, alignment, op)
    k = x.shape[1]
    c = _cdiv(r, BW_BLOCK)
    if transposed:
        q = x.new_empty((k, r), dtype=fp8_dtype)
        s = x.new_empty_strided((k, c), (1, torch.sym_max(k, 1)), dtype=torch.float32)
    else:
        q = x.new_empty_strided((r, k), (1, torch.sym_max(r, 1)), dtype=fp8_dtype)
        s = x.new_empty((c, k), dtype=torch.float32)
    return q, s


def quantize_blockwise_act_rhs(x: Tensor, fp8_dtype: Optional[torch.dtype] = None, offs: Optional[Tensor] = None,
                               padded_starts: Optional[Tensor] = None,
                               alignment: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """128x1 blocks down the columns of ``x`` (M, K), any strides (the right operand
    of a GEMM contracting over the M tokens, e.g. the weight gradient). Returns q
    (M, K) column-major (strides (1, M)) and scale (ceil(M/128), K) float32 row-major.

    With ``offs`` (int32 token-group ends, DESIGN §3) blocks restart at each group's
    first row: every non-empty group must start at a multiple of 128 (its last block
    may be partial); rows past the last group get q = 0 and zero scales. With
    ``padded_starts`` and ``alignment`` (a multiple of 128; from
    :func:`moe_fp8_ext.padded_group_offsets`: gap-free, each group where the previous
    one's padded rows end; other starts raise on the CPU and with ``MOE_FP8_DEBUG=1``)
    q is written in the padded layout of
    :func:`moe_fp8_ext.pad_token_groups` from the unpadded ``x``, for any group sizes:
    R = padded_rows(M, G, alignment) rows, scale (R/128, K)."""
    check_quantize_blockwise_act_cols(x, fp8_dtype, offs, padded_starts, alignment, "quantize_blockwise_act_rhs")
    return _ops.quantize_blockwise_act_rhs(x, _dtype(fp8_dtype, x), offs, padded_starts, alignment)


@torch.library.register_fake("moe_fp8::quantize_blockwise_act_rhs")
def _(x, fp8_dtype, offs=None, padded_starts=None, alignment=None):
    return _cols_fake(x, fp8_dtype, offs, padded_starts, alignment, False, "quantize_blockwise_act_rhs")


def quantize_blockwise_act_transposed_lhs(x: Tensor, fp8_dtype: Optional[torch.dtype] = None,
                                          offs: Optional[Tensor] = None, padded_starts: Optional[Tensor] = None,
                                          alignment: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """``x`` (M, K) transposed and quantized in 1x128 blocks along M (the left operand
    of the weight gradient ``grad_out^T @ x``): q (K, M) row-major and scale
    (K, ceil(M/128)) float32 column-major (strides (1, K)). The same blocks and the same
    bytes as :func:`quantize_blockwise_act_rhs`: ``q == rhs_q.t()`` and ``scale ==
    rhs_scale.t()``. Token groups (``offs``, ``padded_starts``, ``alignment``) as there."""
    op = "quantize_blockwise_act_transposed_lhs"
    check_quantize_blockwise_act_cols(x, fp8_dtype, offs, padded_starts, alignment, op)
    return _ops.quantize_blockwise_act_transposed_lhs(x, _dtype(fp8_dtype, x), offs, padded_starts, alignment)


@torch.library.register_fake("moe_fp8::quantize_blockwise_act_transposed_lhs")
def _(x, fp8_dtype, offs=None, padded_starts=None, alignment=None):
    return _cols_fake(x, fp8_dtype, offs, padded_starts, alignment, True, "quantize_blockwise_act_transposed_lhs")


# ---- quantize_blockwise_act_dual ---------------------------------------------------------


def check_quantize_blockwise_act_dual(x, fp8_dtype, offs, padded_starts, alignment):
    op = "quantize_blockwise_act_dual"
    if not isinstance(offs, Tensor):
        raise TypeError(f"{op}: expected offs to be a Tensor, got {type(offs).__name__}")
    return check_quantize_blockwise_act_cols(x, fp8_dtype, offs, padded_starts, alignment, op)


def quantize_blockwise_act_dual(x: Tensor, fp8_dtype: Optional[torch.dtype] = None, offs: Optional[Tensor] = None,
                                padded_starts: Optional[Tensor] = None,
                                alignment: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(*quantize_blockwise_act_lhs(x), *quantize_blockwise_act_rhs(x, offs=offs, ...))``
    bit for bit: a token-grouped activation's left operand of the forward (or dgrad)
    GEMM and its operand of the weight-gradient GEMM, ``(q_lhs, scale_lhs, q_rhs,
    scale_rhs)``. ``offs`` is required; ``padded_starts``/``alignment`` as for
    :func:`quantize_blockwise_act_rhs` (the gap-free padded layout).

    With the padded layout and a 2-byte ``x`` whose rows are 16-byte aligned (K a
    multiple of 8, contiguous columns; :func:`act_dual_reads_once`), a GPU writes all
    four from ONE read of ``x``:
    every 128x128 tile taken at a 128-row step of a padded group holds whole 1x128 and
    128x1 blocks. Elsewhere (CPU, fp32, other strides, unpadded groups) it runs the two
    ops."""
    check_quantize_blockwise_act_dual(x, fp8_dtype, offs, padded_starts, alignment)
    return _ops.quantize_blockwise_act_dual(x, _dtype(fp8_dtype, x), offs, padded_starts, alignment)


def act_dual_reads_once(x: Tensor) -> bool:
    """Whether :func:`quantize_blockwise_act_dual` reads ``x`` once (given the padded
    layout): a GPU, bf16/fp16 rows of a multiple of 8 contiguous columns, 16-byte
    aligned (no data pointer read: it traces)."""
    # (Under torch.compile the offset is not asked: torch 2.11's dynamo cannot trace
    # storage_offset(). The op itself runs its two kernels where the offset is odd.)
    return (x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
            and x.shape[1] % 8 == 0 and (x.shape[1] <= 1 or x.stride(1) == 1) and x.stride(0) % 8 == 0
            and (torch.compiler.is_compiling() or x.storage_offset() % 8 == 0))


@torch.library.register_fake("moe_fp8::quantize_blockwise_act_dual")
def _(x, fp8_dtype, offs, padded_starts=None, alignment=None):
    check_quantize_blockwise_act_dual(x, fp8_dtype, offs, padded_starts, alignment)
    q_lhs, s_lhs = _lhs_fake(x, fp8_dtype)
    return (q_lhs, s_lhs, *_cols_fake(x, fp8_dtype, offs, padded_starts, alignment, False,
                                      "quantize_blockwise_act_dual"))


# ---- quantize_blockwise_weight_rhs / _transposed_rhs / _dual (128x128 tiles) ----------


def check_quantize_blockwise_weight(w, fp8_dtype, op, as_bf16=False):
    """The checks of the weight ops: w (M, N) or (E, M, N), bf16/fp16/fp32."""
    check_quant_input(op, "w", w, None)
    check_as_bf16(op, "w", w, as_bf16)
    if w.dim() not in (2, 3):
        raise RuntimeError(f"{op}: expected w to be 2-D (M, N) or 3-D (E, M, N), got {w.dim()}-D")
    check_fp8_dtype(op, fp8_dtype)


def _col_major(w, rows, cols, dtype):
    """(..., rows, cols) column-major per matrix, the batch dims of w in front."""
    lead = tuple(w.shape[:-2])
    r1 = torch.sym_max(rows, 1)
    stride = ((rows * cols,) if lead else ()) + (1, r1)
    return w.new_empty_strided(lead + (rows, cols), stride, dtype=dtype)


def _weight_fake(w, fp8_dtype, op, which, as_bf16=False):
    check_quantize_blockwise_weight(w, fp8_dtype, op, as_bf16)
    m, n = w.shape[-2:]
    tm, tn = _cdiv(m, BW_BLOCK), _cdiv(n, BW_BLOCK)
    out = []
    if which in (0, 2):
        out += [_col_major(w, m, n, fp8_dtype), _col_major(w, tm, tn, torch.float32)]
    if which in (1, 2):
        out += [_col_major(w, n, m, fp8_dtype), _col_major(w, tn, tm, torch.float32)]
    return tuple(out)


def quantize_blockwise_weight_rhs(w: Tensor, fp8_dtype: Optional[torch.dtype] = None,
                                  as_bf16: bool = False) -> Tuple[Tensor, Tensor]:
    """128x128 tiles of ``w`` (M, N), or (E, M, N) per expert, any strides (the right
    operand of a 1x128 x 128x128 GEMM). Returns q (M, N) column-major and scale
    (ceil(M/128), ceil(N/128)) float32 column-major, torchao's
    ``triton_fp8_blockwise_weight_quant_rhs`` layouts; a partial tile's amax is over
    its valid part. ``as_bf16``: ``w`` fp32 read as ``w.to(torch.bfloat16)`` (those
    bits, without the copy)."""
    op = "quantize_blockwise_weight_rhs"
    check_quantize_blockwise_weight(w, fp8_dtype, op, as_bf16)
    return _ops.quantize_blockwise_weight_rhs(w, _dtype(fp8_dtype, w), as_bf16)


@torch.library.register_fake("moe_fp8::quantize_blockwise_weight_rhs")
def _(w, fp8_dtype, as_bf16=False):
    return _weight_fake(w, fp8_dtype, "quantize_blockwise_weight_rhs", 0, as_bf16)


def quantize_blockwise_weight_transposed_rhs(w: Tensor, fp8_dtype: Optional[torch.dtype] = None,
                                             as_bf16: bool = False) -> Tuple[Tensor, Tensor]:
    """``w``^T (w (M, N) or (E, M, N)) in 128x128 tiles: q (N, M) column-major (the
    bytes of a row-major w) and scale (ceil(N/128), ceil(M/128)) column-major, torchao's
    ``triton_fp8_blockwise_weight_quant_transposed_rhs`` layouts. ``as_bf16``: as
    :func:`quantize_blockwise_weight_rhs`'s."""
    op = "quantize_blockwise_weight_transposed_rhs"
    check_quantize_blockwise_weight(w, fp8_dtype, op, as_bf16)
    return _ops.quantize_blockwise_weight_transposed_rhs(w, _dtype(fp8_dtype, w), as_bf16)


@torch.library.register_fake("moe_fp8::quantize_blockwise_weight_transposed_rhs")
def _(w, fp8_dtype, as_bf16=False):
    return _weight_fake(w, fp8_dtype, "quantize_blockwise_weight_transposed_rhs", 1, as_bf16)


def quantize_blockwise_weight_dual(w: Tensor,
                                   fp8_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both orientations of ``w`` from one read (a tile and its transpose share the
    scale): (q, scale) of :func:`quantize_blockwise_weight_rhs` and of
    :func:`quantize_blockwise_weight_transposed_rhs`."""
    op = "quantize_blockwise_weight_dual"
    check_quantize_blockwise_weight(w, fp8_dtype, op)
    return _ops.quantize_blockwise_weight_dual(w, _dtype(fp8_dtype, w))


@torch.library.register_fake("moe_fp8::quantize_blockwise_weight_dual")
def _(w, fp8_dtype):
    return _weight_fake(w, fp8_dtype, "quantize_blockwise_weight_dual", 2)


# ---- the weight ops of a concatenation (the experts layer's W1 / W3) ------------------------


def _cat_mismatch(ws, op):
    """The first rule of the ``_cat`` weight ops that a weight of ``ws`` breaks against
    the first one (blockwise_ops.cpp's order and words), as (exception type, message);
    None where every weight keeps them."""
    w0 = ws[0]
    for i, w in enumerate(ws):
        if not isinstance(w, Tensor):
            return TypeError, f"{op}: expected every weight to be a Tensor, got {type(w).__name__} (weight {i})"
        if w.dtype != w0.dtype or w.device != w0.device:
            return RuntimeError, (f"{op}: expected every weight of one dtype and device, got {_dtype_name(w0.dtype)} "
                                  f"on {w0.device} and {_dtype_name(w.dtype)} on {w.device} (weight {i})")
        if w.dim() != w0.dim() or w.shape[:-1] != w0.shape[:-1]:
            return RuntimeError, (f"{op}: expected every weight of the shape of the first but its last size, "
                                  f"{list(w0.shape)}, got {list(w.shape)} (weight {i})")
        if i + 1 < len(ws) and w.shape[-1] % BW_BLOCK:
            return RuntimeError, (f"{op}: expected every weight but the last to have a multiple of {BW_BLOCK} "
                                  f"columns (whole 128x128 tiles of the concatenation), got {w.shape[-1]} (weight {i})")
    return None


def weight_cat_ok(ws: Sequence[Tensor]) -> bool:
    """Whether the ``_cat`` weight ops take ``ws``: one or more 2-D or 3-D weights of one
    dtype, device and shape but the last size, each but the last a multiple of 128
    columns (no tile of the concatenation spans two weights)."""
    return (isinstance(ws, (list, tuple)) and len(ws) > 0 and isinstance(ws[0], Tensor) and ws[0].dim() in (2, 3)
            and _cat_mismatch(ws, "weight_cat_ok") is None)


def check_quantize_blockwise_weight_cat(ws, fp8_dtype, op, as_bf16=False):
    """The first weight as the weight ops check it, then each weight against it."""
    if not isinstance(ws, (list, tuple)) or not ws:
        raise RuntimeError(f"{op}: expected at least one weight, got none")
    check_quantize_blockwise_weight(ws[0], fp8_dtype, op, as_bf16)
    bad = _cat_mismatch(ws, op)
    if bad is not None:
        raise bad[0](bad[1])


def _check_interleave(ws, op):
    """blockwise_ops.cpp's rule of ``interleave``: weights of one width (so each a multiple
    of 128, by the rule of the concatenation)."""
    for i, w in enumerate(ws):
        if w.shape[-1] != ws[0].shape[-1]:
            raise RuntimeError(f"{op}: expected every weight of one width to interleave them, got {ws[0].shape[-1]} "
                               f"and {w.shape[-1]} columns (weight {i})")


def _run_cat(op, ws, fp8_dtype, interleave=None, as_bf16=None):
    # (None: an argument the op does not take)
    check_quantize_blockwise_weight_cat(ws, fp8_dtype, op, bool(as_bf16))
    if interleave:
        _check_interleave(ws, op)
    flags = [f for f in (interleave, as_bf16) if f is not None]
    return getattr(_ops, op)(list(ws), _dtype(fp8_dtype, ws[0]), *flags)


def quantize_blockwise_weight_rhs_cat(ws: Sequence[Tensor], fp8_dtype: Optional[torch.dtype] = None,
                                      interleave: bool = False, as_bf16: bool = False) -> Tuple[Tensor, Tensor]:
    """:func:`quantize_blockwise_weight_rhs` of ``torch.cat(ws, dim=-1)``, bit for bit,
    without the copy: each weight (M, N_i) or (E, M, N_i) (one dtype and device, the
    same E and M) is read once and written straight into its columns of the outputs.
    Every weight but the last must have a multiple of 128 columns, so that no 128x128
    tile spans two of them. The experts layer's W1 / W3 forward operand.
    ``interleave``: the weights (all of one width, a multiple of 128) interleaved by 128
    columns instead, chunk j of weight p at column block j·P + p (the operand of
    :func:`moe_fp8_ext.blockwise_gemm.blockwise_grouped_mm_swiglu`). ``as_bf16``: as
    :func:`quantize_blockwise_weight_rhs`'s."""
    return _run_cat("quantize_blockwise_weight_rhs_cat", ws, fp8_dtype, interleave, as_bf16)


def _cat_fake(ws, fp8_dtype, op, which, interleave=False, as_bf16=False):
    check_quantize_blockwise_weight_cat(ws, fp8_dtype, op, as_bf16)
    if interleave:
        _check_interleave(ws, op)
    n = sum(w.shape[-1] for w in ws)
    return _weight_fake(ws[0].new_empty(tuple(ws[0].shape[:-1]) + (n,)), fp8_dtype, op, which, as_bf16)


@torch.library.register_fake("moe_fp8::quantize_blockwise_weight_rhs_cat")
def _(ws, fp8_dtype, interleave=False, as_bf16=False):
    return _cat_fake(ws, fp8_dtype, "quantize_blockwise_weight_rhs_cat", 0, interleave, as_bf16)


def quantize_blockwise_weight_transposed_rhs_cat(ws: Sequence[Tensor], fp8_dtype: Optional[torch.dtype] = None,
                                                 as_bf16: bool = False) -> Tuple[Tensor, Tensor]:
    """:func:`quantize_blockwise_weight_transposed_rhs` of ``torch.cat(ws, dim=-1)``, bit
    for bit, without the copy (the rules of :func:`quantize_blockwise_weight_rhs_cat`):
    the experts layer's joint W1 / W3 input-gradient operand (E, ΣN_i, M)."""
    return _run_cat("quantize_blockwise_weight_transposed_rhs_cat", ws, fp8_dtype, as_bf16=as_bf16)


@torch.library.register_fake("moe_fp8::quantize_blockwise_weight_transposed_rhs_cat")
def _(ws, fp8_dtype, as_bf16=False):
    return _cat_fake(ws, fp8_dtype, "quantize_blockwise_weight_transposed_rhs_cat", 1, as_bf16=as_bf16)


def quantize_blockwise_weight_dual_cat(ws: Sequence[Tensor], fp8_dtype: Optional[torch.dtype] = None,
                                       interleave: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`quantize_blockwise_weight_dual` of ``torch.cat(ws, dim=-1)``, bit for bit:
    both orientations of the concatenation, each weight read once (the rules of
    :func:`quantize_blockwise_weight_rhs_cat`; ``interleave`` applies to the forward
    operand only, the transposed one keeps the concatenation's order)."""
    return _run_cat("quantize_blockwise_weight_dual_cat", ws, fp8_dtype, interleave)


@torch.library.register_fake("moe_fp8::quantize_blockwise_weight_dual_cat")
def _(ws, fp8_dtype, interleave=False):
    return _cat_fake(ws, fp8_dtype, "quantize_blockwise_weight_dual_cat", 2, interleave)
