"""FP8 blockwise grouped GEMMs for Hopper (DESIGN §6): CUTLASS's grouped GEMM with
DeepSeek-style block scales (fp32 accumulation, each 128-deep K block's partial sum
scaled on the CUDA cores), its per-group sizes and pointers built on the GPU from
``offs`` (no host sync; CUDA-graph capturable). The operands are exactly what the
quantization ops of :mod:`moe_fp8_ext.blockwise` return (decode scales,
``x ≈ q.float() * scale``):

* :func:`blockwise_grouped_mm_2d3d` (forward and dgrad): ``out[rows of g] =
  dequant(a[rows of g]) @ dequant(b[g])``; a, scale_a from
  :func:`~moe_fp8_ext.quantize_blockwise_act_lhs`, b, scale_b from
  :func:`~moe_fp8_ext.quantize_blockwise_weight_rhs` (or ``_transposed_rhs`` for dgrad)
  of a 3-D (E, K, N) weight. Any group sizes.
* :func:`blockwise_grouped_mm_2d2d` (wgrad): ``out[g] = dequant(a[:, tokens of g]) @
  dequant(b[tokens of g, :])``; a, scale_a from
  :func:`~moe_fp8_ext.quantize_blockwise_act_transposed_lhs` of grad_out (M, N), b,
  scale_b from :func:`~moe_fp8_ext.quantize_blockwise_act_rhs` of the input (M, K), both
  with the same ``offs``: every non-empty group starts at a multiple of 128 tokens.
* :func:`blockwise_grouped_mm_2d2d_add_`: the same product added to an fp32 ``out`` in
  place (a weight gradient into its main gradient), unrounded.

Only on an NVIDIA GPU of compute capability 9.0 in a build with the sm_90a kernels
(:func:`available`); elsewhere the recipe emulates. Each wrapper runs the argument
checks of csrc/gemm/blockwise_grouped_sm90.cu, and its fake (``register_fake``, beside
it) runs the same checks, so the ops trace under ``torch.compile(fullgraph=True)``.
"""

import functools

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true

from .ops import INT32_MAX, _dtype_name, check_index, check_same_device, check_tensor
from .ops._checks import _require, padded_rows
from .platform import remembered_per_device

_ops = torch.ops.moe_fp8
BW_BLOCK = 128
OP_2D3D = "blockwise_grouped_mm_2d3d"
OP_2D2D = "blockwise_grouped_mm_2d2d"
# The GEMM configurations (tile and cluster; csrc/gemm/blockwise_grouped_sm90.cu): `config`
# -1 picks one by shape, 0..n-1 forces one (tests, benchmarks). Every one gives the same
# bits.
CONFIGS_2D3D = 4  # 128x128 cluster 2x1, 128x128 1x2, 256x128 1x2, 128x256 1x2
CONFIGS_2D2D = 4  # 128x128 cluster 1x2, 128x128 2x1, 256x128 1x2, 128x256 1x2


def _cdiv(a, b):
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _built() -> bool:
    """Whether the sm_90a kernels are compiled into this build (registered for CUDA):
    asked of the dispatcher once a process (about 10 µs a query, and the recipe asks at
    every call)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_fp8::{OP_2D3D}", "CUDA")


# A constant for torch.compile, as rowwise_gemm._built_for: the kernels are built and
# CUDA device `index` is a Hopper.
@torch.compiler.assume_constant_result
def _built_for(index: int) -> bool:
    return _built() and torch.cuda.get_device_capability(index) == (9, 0)


def available_on(device, built_for, memo) -> bool:
    """Whether kernels that ``built_for(index)`` says run on CUDA device ``index`` run on
    ``device`` (default: the current CUDA device; never on ROCm); remembered per device
    in ``memo`` in eager mode (platform.remembered_per_device: the recipes ask at every
    GEMM)."""

    def decide(device):
        if torch.version.hip or not torch.cuda.is_available():
            return False
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        return dev.type == "cuda" and built_for(dev.index if dev.index is not None else torch.cuda.current_device())

    return remembered_per_device(memo, device, decide)


_AVAILABLE: dict = {}  # (device type, index) -> available(device), eager calls


def available(device=None) -> bool:
    """Whether the grouped blockwise GEMMs run on ``device`` (default: the current CUDA
    device): the sm_90a kernels are compiled into this build (registered for CUDA), and
    the device is an NVIDIA GPU of compute capability (9, 0), not ROCm."""
    return available_on(device, _built_for, _AVAILABLE)


# ---- argument checks shared by each wrapper and its fake (the rules and order of the
# C++ op; "<op>: expected X, got Y"). The content of offs is the kernel's to clamp.


def _check_common(op, a, scale_a, b, scale_b, offs, b_rank, out_dtype, scale_ranks=True):
    """The checks both Hopper grouped GEMM families share (also rowwise_gemm's, which
    checks its scales' shapes later, ``scale_ranks=False``)."""
    check_tensor(op, "a", a, dim=2)
    if scale_ranks:
        check_tensor(op, "scale_a", scale_a, dim=2)
    check_tensor(op, "b", b, dim=b_rank)
    if scale_ranks:
        check_tensor(op, "scale_b", scale_b, dim=b_rank)
    check_tensor(op, "a", a, dtype=torch.float8_e4m3fn)
    check_tensor(op, "b", b, dtype=torch.float8_e4m3fn)
    check_tensor(op, "scale_a", scale_a, dtype=torch.float32)
    check_tensor(op, "scale_b", scale_b, dtype=torch.float32)
    check_index(op, "offs", offs)
    check_same_device(op, "a", a, scale_a=scale_a, b=b, scale_b=scale_b, offs=offs)
    if offs.numel() > INT32_MAX:
        raise RuntimeError(f"{op}: expected at most 2^31-1 groups in offs, got {offs.numel()}")
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"{op}: expected out_dtype to be a torch.dtype, got {type(out_dtype).__name__}")
    if out_dtype != torch.bfloat16:
        raise RuntimeError(f"{op}: expected out_dtype bfloat16, got {_dtype_name(out_dtype)}")


def _check_config(op, config, configs):
    if not isinstance(config, int) or not -1 <= config < configs:
        raise RuntimeError(f"{op}: expected config -1 (the pick by shape) or in [0, {configs}), got {config}")


def _check_shape(op, name, t, expected):
    if tuple(t.shape) != tuple(expected):
        raise RuntimeError(f"{op}: expected {name} of shape {list(expected)}, got {list(t.shape)}")


def _stride_or(t, d, fallback):
    """The stride of dim d, or ``fallback`` where it does not matter: dim d has one
    element, or the tensor none (sizes torch.compile cannot decide: the stride)."""
    return t.stride(d) if guard_or_true(t.shape[d] > 1) and guard_or_true(t.numel() > 0) else fallback


def _check_unit_stride(op, name, t, d, layout):
    if guard_or_false(t.stride(d) != 1) and guard_or_true(t.shape[d] > 1):
        raise RuntimeError(f"{op}: expected {name} {layout} (stride({d}) == 1), got strides {list(t.stride())}")


def _check_ld(op, what, ld, lo, multiple):
    def message():
        return (f"{op}: expected {what} to be at least {lo} and a multiple of {multiple} (16-byte rows for TMA), "
                f"got {ld}")

    _require(ld >= lo, message)
    _require(ld % multiple == 0, message)


def _check_int32(op, what, v):
    def message():
        return f"{op}: expected {what} to fit in int32 (at most 2^31-1), got {v}"

    _require(v >= 0, message)
    _require(v <= INT32_MAX, message)


def check_blockwise_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype, config=-1):
    """The checks of :func:`blockwise_grouped_mm_2d3d`; returns (M, N)."""
    op = OP_2D3D
    _check_common(op, a, scale_a, b, scale_b, offs, 3, out_dtype)
    _check_config(op, config, CONFIGS_2D3D)
    m, k = a.shape
    e, n = b.shape[0], b.shape[2]
    kb, nb = _cdiv(k, BW_BLOCK), _cdiv(n, BW_BLOCK)
    if b.shape[1] != k:
        raise RuntimeError(f"{op}: expected b of shape (E, K, N) with K = {k} (the columns of a), got {list(b.shape)}")
    _check_shape(op, "scale_a", scale_a, (m, kb))
    _check_shape(op, "scale_b", scale_b, (e, kb, nb))
    if offs.numel() != e:
        raise RuntimeError(f"{op}: expected offs of shape ({e},) (one group per expert of b), got ({offs.numel()},)")
    _check_unit_stride(op, "a", a, 1, "row-major")
    _check_unit_stride(op, "scale_a", scale_a, 0, "column-major")
    _check_unit_stride(op, "b", b, 1, "column-major per expert")
    _check_unit_stride(op, "scale_b", scale_b, 1, "column-major per expert")
    if k % 16 != 0:
        raise RuntimeError(f"{op}: expected K (the columns of a) to be a multiple of 16 (16-byte rows for TMA), got {k}")
    if n % 8 != 0:
        raise RuntimeError(f"{op}: expected N (the columns of b) to be a multiple of 8 (16-byte bf16 output rows), got {n}")
    lda, lds = _stride_or(a, 0, k), _stride_or(scale_a, 1, m)
    ldb, sbe = _stride_or(b, 2, k), _stride_or(b, 0, 0)
    snb = _stride_or(scale_b, 2, kb)
    _check_ld(op, "a.stride(0)", lda, k, 16)
    _check_ld(op, "b.stride(2)", ldb, k, 16)
    if sbe % 16 != 0:
        raise RuntimeError(f"{op}: expected b.stride(0) to be a multiple of 16 (16-byte aligned experts), got {sbe}")
    _require(lds >= m, lambda: f"{op}: expected scale_a.stride(1) >= {m} (column-major), got {lds}")
    if snb < kb:
        raise RuntimeError(f"{op}: expected scale_b.stride(2) >= {kb} (column-major per expert), got {snb}")
    _check_int32(op, "M", m)
    _check_int32(op, "N", n)
    _check_int32(op, "K", k)
    _check_int32(op, "the scale_a offsets (scale_a.stride(1) * (K/128 - 1) + M)", lds * (kb - 1) + m)
    _check_int32(op, "the scale_b offsets (scale_b.stride(2) * (N/128 - 1) + K/128)", snb * (nb - 1) + kb)
    return m, n


def check_blockwise_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype, config=-1, op=OP_2D2D):
    """The checks of :func:`blockwise_grouped_mm_2d2d` (errors named for ``op``); returns (E, N, K)."""
    _check_common(op, a, scale_a, b, scale_b, offs, 2, out_dtype)
    _check_config(op, config, CONFIGS_2D2D)
    n, m = a.shape
    k = b.shape[1]
    e = offs.numel()
    mb = _cdiv(m, BW_BLOCK)
    if b.shape[0] != m:
        raise RuntimeError(f"{op}: expected b of shape (M, K) with M = {m} (the columns of a), got {list(b.shape)}")
    _check_shape(op, "scale_a", scale_a, (n, mb))
    _check_shape(op, "scale_b", scale_b, (mb, k))
    _check_unit_stride(op, "a", a, 1, "row-major")
    _check_unit_stride(op, "scale_a", scale_a, 0, "column-major")
    _check_unit_stride(op, "b", b, 0, "column-major")
    _check_unit_stride(op, "scale_b", scale_b, 1, "row-major")
    if k % 8 != 0:
        raise RuntimeError(f"{op}: expected K (the columns of b) to be a multiple of 8 (16-byte bf16 output rows), got {k}")
    m16 = _cdiv(m, 16) * 16
    lda, lds = _stride_or(a, 0, m16), _stride_or(scale_a, 1, n)
    ldb, sbr = _stride_or(b, 1, m16), _stride_or(scale_b, 0, k)
    _check_ld(op, "a.stride(0)", lda, m, 16)
    _check_ld(op, "b.stride(1)", ldb, m, 16)
    if lds < n:
        raise RuntimeError(f"{op}: expected scale_a.stride(1) >= {n} (column-major), got {lds}")
    if sbr < k:
        raise RuntimeError(f"{op}: expected scale_b.stride(0) >= {k} (row-major), got {sbr}")
    _check_int32(op, "M", m)
    _check_int32(op, "N", n)
    _check_int32(op, "K", k)
    _check_int32(op, "the scale_a offsets (scale_a.stride(1) * (M/128 - 1) + N)", lds * (mb - 1) + n)
    _check_int32(op, "the scale_b offsets (scale_b.stride(0) * (M/128 - 1) + K)", sbr * (mb - 1) + k)
    return e, n, k


def _check_device(op, a):
    """The real op needs a CUDA tensor (the fakes accept any device)."""
    if a.device.type != "cuda":
        raise RuntimeError(
            f"{op}: expected CUDA tensors on a GPU of compute capability 9.0 (Hopper; there is no "
            f"{a.device.type} kernel: see moe_fp8_ext.blockwise_gemm.available), got device {a.device}"
        )


# ---- blockwise_grouped_mm_2d3d ------------------------------------------------------------


def blockwise_grouped_mm_2d3d(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, offs: Tensor,
                              out_dtype: torch.dtype = torch.bfloat16, config: int = -1) -> Tensor:
    """Grouped ``a @ b[g]`` over token groups of rows (forward and dgrad of a grouped
    linear), FP8 with DeepSeek blockwise scales; returns out (M, N) bf16 row-major.

    * ``a`` (M, K) float8_e4m3fn row-major, ``scale_a`` (M, ceil(K/128)) float32
      column-major (strides (1, M)): 1x128 blocks (``quantize_blockwise_act_lhs``);
    * ``b`` (E, K, N) float8_e4m3fn column-major per expert (strides (K·N, 1, K)),
      ``scale_b`` (E, ceil(K/128), ceil(N/128)) float32 column-major per expert: 128x128
      tiles (``quantize_blockwise_weight_rhs`` of an (E, K, N) weight);
    * ``offs`` int32 (E,) cumulative group ends (DESIGN §3): any group sizes, empty
      groups allowed; rows past ``offs[-1]`` come out zero.

    Needs K % 16 == 0 and N % 8 == 0 (16-byte rows for TMA); a partial last K block and a
    partial last N tile are fine. fp32 accumulation; bf16 output only. ``config``: the
    GEMM configuration (tile and cluster, :data:`CONFIGS_2D3D`), -1 to pick by shape; all
    give the same bits."""
    check_blockwise_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype, config)
    _check_device(OP_2D3D, a)
    return _ops.blockwise_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype, config)


@torch.library.register_fake("moe_fp8::blockwise_grouped_mm_2d3d")
def _(a, scale_a, b, scale_b, offs, out_dtype, config=-1):
    m, n = check_blockwise_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype, config)
    return a.new_empty((m, n), dtype=torch.bfloat16)


# ---- blockwise_grouped_mm_swiglu ----------------------------------------------------------

OP_SWIGLU = "blockwise_grouped_mm_swiglu"


def check_blockwise_grouped_mm_swiglu(a, scale_a, b, scale_b, offs, padded_starts):
    """The checks of :func:`blockwise_grouped_mm_swiglu`; returns (M, 2·hidden, R)."""
    op = OP_SWIGLU
    m, n = check_blockwise_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, torch.bfloat16)
    if n % (2 * BW_BLOCK) != 0:
        raise RuntimeError(f"{op}: expected b's columns to be 2 * hidden with hidden a multiple of {BW_BLOCK} (W1 and "
                           f"W3 interleaved by {BW_BLOCK}), got {n}")
    if a.shape[1] == 0:
        raise RuntimeError(f"{op}: expected K (the columns of a) to be a positive multiple of 16 (16-byte rows for "
                           f"TMA), got 0")
    return m, n, _checked_padded_rows(op, a, offs, padded_starts, m)


def _checked_padded_rows(op, a, offs, padded_starts, m):
    """The rows of the 128-aligned padded layout of ``padded_starts`` (checked, one per group)."""
    check_index(op, "padded_starts", padded_starts)
    check_same_device(op, "a", a, padded_starts=padded_starts)
    if padded_starts.numel() != offs.numel():
        raise RuntimeError(f"{op}: expected padded_starts of shape ({offs.numel()},) like offs, got "
                           f"({padded_starts.numel()},)")
    r = padded_rows(m, offs.numel(), BW_BLOCK)
    _check_int32(op, "the padded rows", r)
    return r


def blockwise_grouped_mm_swiglu(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, offs: Tensor,
                                padded_starts: Tensor):
    """The experts layer's W13 GEMM with SwiGLU and both quantizations of h in its epilogue
    (DESIGN §6): bit for bit ``h13 = blockwise_grouped_mm_2d3d(a, ..., [W1; W3])``,
    ``h = swiglu(h13)`` and ``quantize_blockwise_act_dual(h, e4m3fn, offs, padded_starts, 128)``,
    without writing h or reading h13 back.

    * ``a``, ``scale_a``, ``offs``: as for :func:`blockwise_grouped_mm_2d3d`;
    * ``b`` (E, K, 2·hidden), ``scale_b``: the 128x128-tile operand of [W1; W3] interleaved
      by 128 hidden columns (column block 2j is W1's block j, 2j + 1 W3's), hidden a
      multiple of 128 (``quantize_blockwise_weight_rhs_cat(..., interleave=True)`` of
      [W1ᵀ, W3ᵀ]);
    * ``padded_starts`` int32 (E,): the groups' starts in the 128-aligned gap-free padded
      layout (``padded_group_offsets``), R = ``padded_rows(M, E, 128)`` rows.

    Returns ``(h13, q_rows, s_rows, q_cols, s_cols)``: h13 (M, 2·hidden) bf16 as
    [h1 | h3]; h's 1x128 operand q (M, hidden) row-major, scale (M, hidden/128) column-
    major; h's 128x1 operand in the padded layout, q (R, hidden) column-major, scale
    (R/128, hidden)."""
    check_blockwise_grouped_mm_swiglu(a, scale_a, b, scale_b, offs, padded_starts)
    _check_device(OP_SWIGLU, a)
    return _ops.blockwise_grouped_mm_swiglu(a, scale_a, b, scale_b, offs, padded_starts)


@torch.library.register_fake("moe_fp8::blockwise_grouped_mm_swiglu")
def _(a, scale_a, b, scale_b, offs, padded_starts):
    m, n, r = check_blockwise_grouped_mm_swiglu(a, scale_a, b, scale_b, offs, padded_starts)
    h = n // 2
    f8 = torch.float8_e4m3fn
    return (a.new_empty((m, n), dtype=torch.bfloat16), a.new_empty((m, h), dtype=f8),
            a.new_empty_strided((m, h // BW_BLOCK), (1, torch.sym_max(m, 1)), dtype=torch.float32),
            a.new_empty_strided((r, h), (1, torch.sym_max(r, 1)), dtype=f8),
            a.new_empty((r // BW_BLOCK, h), dtype=torch.float32))


# ---- blockwise_grouped_mm_dswiglu ---------------------------------------------------------

OP_DSWIGLU = "blockwise_grouped_mm_dswiglu"


def check_blockwise_grouped_mm_dswiglu(a, scale_a, b, scale_b, offs, h13, padded_starts):
    """The checks of :func:`blockwise_grouped_mm_dswiglu`; returns (M, hidden, R)."""
    op = OP_DSWIGLU
    m, n = check_blockwise_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, torch.bfloat16)
    if n % BW_BLOCK != 0:
        raise RuntimeError(f"{op}: expected b's columns (hidden) to be a multiple of {BW_BLOCK}, got {n}")
    if a.shape[1] == 0:
        raise RuntimeError(f"{op}: expected K (the columns of a) to be a positive multiple of 16 (16-byte rows for "
                           f"TMA), got 0")
    if h13.dtype != torch.bfloat16 or tuple(h13.shape) != (m, 2 * n) or not h13.is_contiguous():
        raise RuntimeError(f"{op}: expected h13 a contiguous bfloat16 tensor of shape ({m}, {2 * n}) ([h1 | h3]), "
                           f"got {h13.dtype} of shape {tuple(h13.shape)} and strides {h13.stride()}")
    check_same_device(op, "a", a, h13=h13)
    return m, n, _checked_padded_rows(op, a, offs, padded_starts, m)


def blockwise_grouped_mm_dswiglu(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, offs: Tensor,
                                 h13: Tensor, padded_starts: Tensor):
    """The experts layer's W2 input-gradient GEMM with dSwiGLU and both quantizations of
    grad_h13 in its epilogue (DESIGN §6): bit for bit ``grad_h = blockwise_grouped_mm_2d3d(a,
    ..., W2)``, ``grad_h13 = swiglu_backward(grad_h, h13)`` and
    ``quantize_blockwise_act_dual(grad_h13, e4m3fn, offs, padded_starts, 128)``, without
    writing grad_h or grad_h13.

    * ``a``, ``scale_a``, ``offs``: as for :func:`blockwise_grouped_mm_2d3d` (grad_out's
      1x128 operand);
    * ``b`` (E, K, hidden), ``scale_b``: W2's input-gradient operand in 128x128 tiles,
      hidden a multiple of 128;
    * ``h13`` (M, 2·hidden) bf16, contiguous: the forward's [h1 | h3];
    * ``padded_starts``: as for :func:`blockwise_grouped_mm_swiglu`.

    Returns ``(q_rows, s_rows, q_cols, s_cols)``: grad_h13's 1x128 operand q (M, 2·hidden)
    row-major, scale (M, 2·hidden/128) column-major; its 128x1 operand in the padded
    layout, q (R, 2·hidden) column-major, scale (R/128, 2·hidden)."""
    check_blockwise_grouped_mm_dswiglu(a, scale_a, b, scale_b, offs, h13, padded_starts)
    _check_device(OP_DSWIGLU, a)
    return _ops.blockwise_grouped_mm_dswiglu(a, scale_a, b, scale_b, offs, h13, padded_starts)


@torch.library.register_fake("moe_fp8::blockwise_grouped_mm_dswiglu")
def _(a, scale_a, b, scale_b, offs, h13, padded_starts):
    m, h, r = check_blockwise_grouped_mm_dswiglu(a, scale_a, b, scale_b, offs, h13, padded_starts)
    w, f8 = 2 * h, torch.float8_e4m3fn
    return (a.new_empty((m, w), dtype=f8),
            a.new_empty_strided((m, w // BW_BLOCK), (1, torch.sym_max(m, 1)), dtype=torch.float32),
            a.new_empty_strided((r, w), (1, torch.sym_max(r, 1)), dtype=f8),
            a.new_empty((r // BW_BLOCK, w), dtype=torch.float32))


# ---- blockwise_grouped_mm_2d2d ------------------------------------------------------------


def blockwise_grouped_mm_2d2d(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, offs: Tensor,
                              out_dtype: torch.dtype = torch.bfloat16, config: int = -1) -> Tensor:
    """Grouped ``a[:, tokens of g] @ b[tokens of g, :]`` contracting over token groups
    (the weight gradient of a grouped linear), FP8 with per-row / per-column scales in
    blocks of 128 tokens; returns out (E, N, K) bf16 row-major.

    * ``a`` (N, M) float8_e4m3fn row-major, ``scale_a`` (N, ceil(M/128)) float32
      column-major (strides (1, N)) (``quantize_blockwise_act_transposed_lhs`` of
      grad_out (M, N) with ``offs``);
    * ``b`` (M, K) float8_e4m3fn column-major (strides (1, M)), ``scale_b``
      (ceil(M/128), K) float32 row-major (``quantize_blockwise_act_rhs`` of the input
      (M, K) with ``offs``);
    * ``offs`` int32 (E,) cumulative group ends along the M tokens: every non-empty group
      starts at a multiple of 128 (its last block may be partial). An empty group gives
      ``out[g] = 0``; on a GPU a group that starts elsewhere is treated as empty (with
      ``MOE_FP8_DEBUG=1`` it is an error).

    Needs K % 8 == 0 (16-byte bf16 output rows) and 16-byte aligned rows of a and columns
    of b (M % 16 == 0 for contiguous operands). bf16 output only. ``config``: as for
    :func:`blockwise_grouped_mm_2d3d` (:data:`CONFIGS_2D2D`)."""
    check_blockwise_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype, config)
    _check_device(OP_2D2D, a)
    return _ops.blockwise_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype, config)


@torch.library.register_fake("moe_fp8::blockwise_grouped_mm_2d2d")
def _(a, scale_a, b, scale_b, offs, out_dtype, config=-1):
    e, n, k = check_blockwise_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype, config)
    return a.new_empty((e, n, k), dtype=torch.bfloat16)


OP_2D2D_ADD = "blockwise_grouped_mm_2d2d_add_"
CONFIGS_2D2D_ADD = 2  # 128x128 cluster 1x2, 128x128 2x1


def check_blockwise_grouped_mm_2d2d_add_(out, a, scale_a, b, scale_b, offs, config=-1):
    """The checks of :func:`blockwise_grouped_mm_2d2d_add_` (those of the 2d2d op, then out's)."""
    op = OP_2D2D_ADD
    e, n, k = check_blockwise_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, torch.bfloat16, -1, op=op)
    _check_config(op, config, CONFIGS_2D2D_ADD)
    _check_add_out(op, out, a, (e, n, k))


def _check_add_out(op, out, a, shape):
    """The fp32 main gradient a wgrad op adds into: float32, a's device, ``shape``, contiguous."""
    if not isinstance(out, Tensor) or out.dtype != torch.float32:
        raise RuntimeError(f"{op}: expected out of dtype float32, got {getattr(out, 'dtype', type(out).__name__)}")
    if out.device != a.device:
        raise RuntimeError(f"{op}: expected out on {a.device} (the device of a), got {out.device}")
    _check_shape(op, "out", out, shape)
    if not out.is_contiguous():
        raise RuntimeError(f"{op}: expected out contiguous (row-major (E, N, K)), got strides {tuple(out.stride())}")


def blockwise_grouped_mm_2d2d_add_(out: Tensor, a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, offs: Tensor,
                                   config: int = -1) -> None:
    """:func:`blockwise_grouped_mm_2d2d` added to ``out`` (E, N, K) float32 in place:
    ``out[g] += dequant(a[:, tokens of g]) @ dequant(b[tokens of g, :])``, the fp32
    accumulator added once (one rounding, IEEE, no flush to zero), never rounded to bf16
    first. An empty group leaves its ``out[g]`` as it is. The weight gradient added into an
    fp32 main gradient (Megatron's ``gradient_accumulation_fusion``): one read and one
    write of out, where the GEMM and an add would write, read and read again.
    ``config``: 0 (128x128 tiles, 1x2 clusters) or 1 (2x1), -1 picks by shape; both give
    the same bits, and ``out`` gains the bits of ``blockwise_grouped_mm_2d2d``'s output
    before its rounding to bf16."""
    check_blockwise_grouped_mm_2d2d_add_(out, a, scale_a, b, scale_b, offs, config)
    _check_device(OP_2D2D_ADD, a)
    _ops.blockwise_grouped_mm_2d2d_add_(out, a, scale_a, b, scale_b, offs, config)


@torch.library.register_fake("moe_fp8::blockwise_grouped_mm_2d2d_add_")
def _(out, a, scale_a, b, scale_b, offs, config=-1):
    check_blockwise_grouped_mm_2d2d_add_(out, a, scale_a, b, scale_b, offs, config)
