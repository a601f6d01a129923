"""MXFP8 quantization (DESIGN §7): e4m3fn data with one E8M0 scale per 32 consecutive
elements of the contraction dimension, as the sm100 block-scaled GEMMs consume it.

``rounding`` is ``"rceil"`` (default: the scale rounds up, so no block saturates) or
``"floor"`` (OCP's rule), both bit-exact with torchao 0.18's ``to_mx``. Scales are
``float8_e8m0fnu``. ``blocked=True`` returns them in the swizzled layout the GEMMs read
(128x4 tiles, torchao's ``to_blocked``), written by the quantization kernel itself;
its padding is zero. Each wrapper has its fake implementation beside it, so the ops
trace under ``torch.compile(fullgraph=True)``.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

_ops = torch.ops.moe_fp8
MX_BLOCK = 32
ROUNDINGS = ("rceil", "floor")


def _ceil(a, b):
    return -(-a // b) * b


def _check(cond, msg):
    torch._check(cond, lambda: msg)


def _common(op, x, rank, rounding, kdim_size, kname):
    name = "x" if rank == 2 else "b"  # the op's argument name, as the C++ checks say it
    _check(x.dim() == rank, f"{op}: expected {name} to be a {rank}-D tensor, got {x.dim()}-D")
    _check(x.dtype in (torch.bfloat16, torch.float16, torch.float32),
           f"{op}: expected {name} of dtype bfloat16, float16 or float32, got {x.dtype}")
    _check(rounding in ROUNDINGS, f"{op}: expected rounding \"rceil\" or \"floor\", got \"{rounding}\"")
    _check(kdim_size % MX_BLOCK == 0, f"{op}: expected {kname} to be a multiple of {MX_BLOCK}, got {kdim_size}")


def quantize_mxfp8_rowwise(x: Tensor, rounding: str = "rceil", blocked: bool = False,
                           offs: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Blocks of 32 along the rows of ``x`` (M, K) (the left operand, K the contraction;
    K % 32 == 0). Returns q (M, K) row-major and the scales: (M, K/32), or blocked as a
    (ceil128(M), ceil4(K/32)) tensor; with ``offs`` (token groups of the rows, blocked
    only) the M-group layout of the grouped GEMM: group g's scale rows start at row
    sum_{j<g} ceil128(n_j), (M + 128 G, ceil4(K/32)) in all, no host sync."""
    return _ops.quantize_mxfp8_rowwise(x, rounding, blocked, offs)


@torch.library.register_fake("moe_fp8::quantize_mxfp8_rowwise")
def _(x, rounding="rceil", blocked=False, offs=None):
    op = "quantize_mxfp8_rowwise"
    _common(op, x, 2, rounding, x.shape[-1] if x.dim() == 2 else 0, "K (x.size(1))")
    _check(offs is None or blocked, f"{op}: expected offs only with blocked=True")
    m, k = x.shape
    q = x.new_empty((m, k), dtype=torch.float8_e4m3fn)
    c = k // MX_BLOCK
    if not blocked:
        shape = (m, c)
    elif offs is None:
        shape = (_ceil(m, 128), _ceil(c, 4))
    else:
        shape = (m + 128 * offs.shape[0], _ceil(c, 4))
    return q, x.new_empty(shape, dtype=torch.float8_e8m0fnu)


def quantize_mxfp8_colwise(x: Tensor, rounding: str = "rceil", blocked: bool = False, offs: Optional[Tensor] = None,
                           padded_starts: Optional[Tensor] = None, alignment: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Blocks of 32 consecutive rows of each column of ``x`` (M, K) (a weight-gradient
    operand: the contraction runs over the M tokens). Returns q (M, K) column-major and
    scales (K, M/32), or blocked (ceil128(K), ceil4(M/32)). With ``offs`` (token groups,
    sizes multiples of 32) blocks stay inside their group, rows past the last group are
    zero, and blocked scales take the K-group layout: group g's block columns start at
    sum_{j<g} ceil4(n_j/32), (ceil128(K), ceil4(M/32) + 4 G) in all. ``padded_starts``
    and ``alignment`` (a multiple of 32) write q in the padded layout of
    :func:`moe_fp8_ext.pad_token_groups` from the unpadded x, for any group sizes."""
    return _ops.quantize_mxfp8_colwise(x, rounding, blocked, offs, padded_starts, alignment)


@torch.library.register_fake("moe_fp8::quantize_mxfp8_colwise")
def _(x, rounding="rceil", blocked=False, offs=None, padded_starts=None, alignment=None):
    op = "quantize_mxfp8_colwise"
    _check(x.dim() == 2, f"{op}: expected x to be a 2-D tensor, got {x.dim()}-D")
    m, k = x.shape
    _check((padded_starts is None) == (alignment is None), f"{op}: expected padded_starts and alignment together")
    _check(offs is not None or padded_starts is None, f"{op}: expected padded_starts only with offs")
    if padded_starts is not None:
        _check(alignment >= MX_BLOCK and alignment % MX_BLOCK == 0,
               f"{op}: expected alignment to be a multiple of {MX_BLOCK}, got {alignment}")
        g = offs.shape[0]
        q_rows = _ceil(m + g * alignment, alignment)
        _common(op, x, 2, rounding, 0, "M")
    else:
        q_rows = m
        _common(op, x, 2, rounding, m, "M (x.size(0))")
    q = x.new_empty_strided((q_rows, k), (1, max(q_rows, 1)), dtype=torch.float8_e4m3fn)
    c = q_rows // MX_BLOCK
    if not blocked:
        shape = (k, c)
    elif offs is None:
        shape = (_ceil(k, 128), _ceil(c, 4))
    else:
        shape = (_ceil(k, 128), _ceil(c, 4) + 4 * offs.shape[0])
    return q, x.new_empty(shape, dtype=torch.float8_e8m0fnu)


def quantize_mxfp8_experts(b: Tensor, rounding: str = "rceil", blocked: bool = False) -> Tuple[Tensor, Tensor]:
    """Expert weights ``b`` (E, K, N), the right operand of a GEMM contracting over K
    (dim -2; K % 32 == 0): q (E, K, N) column-major per expert and scales (E, N, K/32),
    or blocked per expert as (E, ceil128(N) * ceil4(K/32)), the shape
    ``scaled_grouped_mm`` takes. Call it on ``B_t`` for the forward and on
    ``B_t.transpose(-2, -1)`` for the input gradient."""
    return _ops.quantize_mxfp8_experts(b, rounding, blocked)


@torch.library.register_fake("moe_fp8::quantize_mxfp8_experts")
def _(b, rounding="rceil", blocked=False):
    op = "quantize_mxfp8_experts"
    _common(op, b, 3, rounding, b.shape[1] if b.dim() == 3 else 0, "K (b.size(1))")
    e, k, n = b.shape
    q = b.new_empty_strided((e, k, n), (k * n, 1, max(k, 1)), dtype=torch.float8_e4m3fn)
    c = k // MX_BLOCK
    shape = (e, _ceil(n, 128) * _ceil(c, 4)) if blocked else (e, n, c)
    return q, b.new_empty(shape, dtype=torch.float8_e8m0fnu)
