"""FP8 rowwise grouped GEMMs for Hopper (DESIGN §5): our CUTLASS kernels
(csrc/gemm/rowwise_grouped_sm90*.cu) in place of ``torch._scaled_grouped_mm`` for the
fp8_rowwise recipe. The same operands and math as PyTorch's kernel (fp8 e4m3 with fast
accumulation, ``out = bf16((acc * scale_a) * scale_b)``), with a CUTLASS configuration
picked per GEMM shape where PyTorch's kernel has one fixed heuristic; per-group sizes and
pointers built on the GPU from ``offs`` (no host sync; CUDA-graph capturable).

* :func:`rowwise_grouped_mm_2d3d` (forward, dgrad): ``out[rows of g] = (a[rows of g] *
  scale_a[rows]) @ (b[g] * scale_b[g])``; a (M, K) float8_e4m3fn row-major, scale_a
  (M,), b (E, K, N) float8_e4m3fn column-major per expert, scale_b (E, N); any group
  sizes; rows past ``offs[-1]`` come out zero.
* :func:`rowwise_grouped_mm_2d2d` (wgrad): ``out[g] = (a[:, tokens of g] * scale_a[g]) @
  (b[tokens of g, :] * scale_b[g])``; a (N, M) row-major, scale_a (E, N), b (M, K)
  column-major, scale_b (E, K); every non-empty group starts at a multiple of 16 tokens
  (the padded layout of DESIGN §3); an empty group gives zeros.
* :func:`rowwise_grouped_mm_2d2d_add_`: the same product added to an fp32 ``out`` in
  place (a weight gradient into its main gradient), before any rounding to bf16.

The recipe calls them where :func:`in_use` says so: a Hopper GPU (compute capability
9.0) of a build with the sm_90a kernels, unless the recipe asks for PyTorch's kernel
(``Fp8Rowwise(gemm_kernel="torch")``). Their fakes (below) let them trace under
``torch.compile(fullgraph=True)``.
"""

import functools

import torch
from torch import Tensor

from .blockwise_gemm import _check_common as _bw_check_common
from .blockwise_gemm import (_check_add_out, _check_config, _check_int32, _check_ld, _check_shape, _check_unit_stride,
                             _stride_or, available_on)
from .ops import INT64_MAX

_ops = torch.ops.moe_fp8
OP_2D3D = "rowwise_grouped_mm_2d3d"
OP_2D2D = "rowwise_grouped_mm_2d2d"
CONFIGS = 6  # csrc/gemm/rowwise_grouped_sm90.cuh: MOE_FP8_RW_CONFIGS


@functools.lru_cache(maxsize=None)
def _built() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_fp8::{OP_2D3D}", "CUDA")


# A constant for torch.compile (dynamo cannot trace the dispatcher query; the answer
# never changes in a process): the kernels are built and CUDA device `index` is a Hopper.
@torch.compiler.assume_constant_result
def _built_for(index: int) -> bool:
    return _built() and torch.cuda.get_device_capability(index) == (9, 0)


_AVAILABLE: dict = {}  # (device type, index) -> available(device), eager calls


def available(device=None) -> bool:
    """Whether our rowwise grouped GEMMs run on ``device`` (default: the current CUDA
    device): an NVIDIA GPU of compute capability (9, 0) and a build with the sm_90a kernels
    (remembered per device in eager mode: blockwise_gemm.available_on)."""
    return available_on(device, _built_for, _AVAILABLE)


def in_use(a: Tensor) -> bool:
    """Whether the fp8_rowwise recipe (``gemm_kernel="auto"``) runs its GEMMs on these
    kernels for operand ``a``: :func:`available` on its device, and e4m3fn (a constant
    under torch.compile)."""
    return a.dtype == torch.float8_e4m3fn and available(a.device)


def _check_common(op, a, scale_a, b, scale_b, offs, b_rank, out_dtype, config):
    _bw_check_common(op, a, scale_a, b, scale_b, offs, b_rank, out_dtype, scale_ranks=False)
    _check_config(op, config, CONFIGS)


def _check_out_bytes(op, e, n, k):
    nbytes = e * n * k * 2  # the C++ op's check_alloc of out
    if isinstance(nbytes, int) and nbytes > INT64_MAX:  # symbolic sizes (compile): the real op checks
        raise RuntimeError(f"{op}: expected out (E, N, K) = ({e}, {n}, {k}) to fit in int64 bytes")


def check_rowwise_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype, config=-1):
    """The checks of :func:`rowwise_grouped_mm_2d3d` (those of the C++ op, in its
    order); returns (M, N)."""
    op = OP_2D3D
    _check_common(op, a, scale_a, b, scale_b, offs, 3, out_dtype, config)
    m, k = a.shape
    e, n = b.shape[0], b.shape[2]
    if b.shape[1] != k:
        raise RuntimeError(f"{op}: expected b of shape (E, K, N) with K = {k} (the columns of a), got {list(b.shape)}")
    _check_shape(op, "scale_a", scale_a, (m,))
    _check_shape(op, "scale_b", scale_b, (e, n))
    if offs.numel() != e:
        raise RuntimeError(f"{op}: expected offs of shape ({e},) (one group per expert of b), got ({offs.numel()},)")
    _check_unit_stride(op, "a", a, 1, "row-major")
    _check_unit_stride(op, "scale_a", scale_a, 0, "contiguous")
    _check_unit_stride(op, "b", b, 1, "column-major per expert")
    _check_unit_stride(op, "scale_b", scale_b, 1, "row-major")
    if k % 16:
        raise RuntimeError(f"{op}: expected K (the columns of a) to be a multiple of 16 (16-byte rows for TMA), got {k}")
    if n % 8:
        raise RuntimeError(f"{op}: expected N (the columns of b) to be a multiple of 8 (16-byte bf16 output rows), "
                           f"got {n}")
    _check_ld(op, "a.stride(0)", _stride_or(a, 0, k), k, 16)
    _check_ld(op, "b.stride(2)", _stride_or(b, 2, k), k, 16)
    sbe = _stride_or(b, 0, 0)
    if sbe % 16:
        raise RuntimeError(f"{op}: expected b.stride(0) to be a multiple of 16 (16-byte aligned experts), got {sbe}")
    _check_int32(op, "M", m)
    _check_int32(op, "N", n)
    _check_int32(op, "K", k)
    return m, n


def check_rowwise_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype, config=-1, op=OP_2D2D):
    """The checks of :func:`rowwise_grouped_mm_2d2d` (errors named for ``op``); returns (E, N, K)."""
    _check_common(op, a, scale_a, b, scale_b, offs, 2, out_dtype, config)
    n, m = a.shape
    k, e = b.shape[1], offs.numel()
    if b.shape[0] != m:
        raise RuntimeError(f"{op}: expected b of shape (M, K) with M = {m} (the columns of a), got {list(b.shape)}")
    _check_shape(op, "scale_a", scale_a, (e, n))
    _check_shape(op, "scale_b", scale_b, (e, k))
    _check_unit_stride(op, "a", a, 1, "row-major")
    _check_unit_stride(op, "b", b, 0, "column-major")
    _check_unit_stride(op, "scale_a", scale_a, 1, "row-major")
    _check_unit_stride(op, "scale_b", scale_b, 1, "row-major")
    if k % 8:
        raise RuntimeError(f"{op}: expected K (the columns of b) to be a multiple of 8 (16-byte bf16 output rows), "
                           f"got {k}")
    m16 = -(-m // 16) * 16
    _check_ld(op, "a.stride(0)", _stride_or(a, 0, m16), m, 16)
    _check_ld(op, "b.stride(1)", _stride_or(b, 1, m16), m, 16)
    _check_int32(op, "M", m)
    _check_int32(op, "N", n)
    _check_int32(op, "K", k)
    _check_out_bytes(op, e, n, k)
    return e, n, k


def _check_device(op, a):
    if not available(a.device):
        raise RuntimeError(
            f"{op}: expected CUDA tensors on a GPU of compute capability 9.0 (Hopper) in a build with the sm_90a "
            f"kernels (see moe_fp8_ext.rowwise_gemm.available), got device {a.device}")


def rowwise_grouped_mm_2d3d(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, offs: Tensor,
                            out_dtype: torch.dtype = torch.bfloat16, config: int = -1) -> Tensor:
    """Grouped ``a @ b[g]`` over token groups of rows (forward and dgrad of a grouped
    linear), FP8 with rowwise decode scales; returns out (M, N) bf16 row-major. Operands
    as the fp8_rowwise recipe makes them (``quantize_rowwise``, ``quantize_experts_fwd``
    / ``_bwd``); needs K % 16 == 0 and N % 8 == 0. ``config``: -1 picks by shape, 0..5
    forces one (for sweeps)."""
    check_rowwise_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype, config)
    _check_device(OP_2D3D, a)
    return _ops.rowwise_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype, config)


@torch.library.register_fake("moe_fp8::rowwise_grouped_mm_2d3d")
def _(a, scale_a, b, scale_b, offs, out_dtype, config=-1):
    m, n = check_rowwise_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype, config)
    return a.new_empty((m, n), dtype=torch.bfloat16)


def rowwise_grouped_mm_2d2d(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, offs: Tensor,
                            out_dtype: torch.dtype = torch.bfloat16, config: int = -1) -> Tensor:
    """Grouped ``a[:, tokens of g] @ b[tokens of g, :]`` contracting over token groups
    (the weight gradient of a grouped linear), FP8 with per-(group, row) and
    per-(group, column) decode scales; returns out (E, N, K) bf16. Operands as the
    fp8_rowwise recipe makes them (``quantize_jagged_colwise`` with ``padded_starts``);
    needs K % 8 == 0 and 16-byte aligned rows of a and columns of b."""
    check_rowwise_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype, config)
    _check_device(OP_2D2D, a)
    return _ops.rowwise_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype, config)


@torch.library.register_fake("moe_fp8::rowwise_grouped_mm_2d2d")
def _(a, scale_a, b, scale_b, offs, out_dtype, config=-1):
    e, n, k = check_rowwise_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype, config)
    return a.new_empty((e, n, k), dtype=torch.bfloat16)


OP_2D2D_ADD = "rowwise_grouped_mm_2d2d_add_"


def check_rowwise_grouped_mm_2d2d_add_(out, a, scale_a, b, scale_b, offs):
    """The checks of :func:`rowwise_grouped_mm_2d2d_add_` (those of the 2d2d op, then out's)."""
    op = OP_2D2D_ADD
    e, n, k = check_rowwise_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, torch.bfloat16, op=op)
    _check_add_out(op, out, a, (e, n, k))


def rowwise_grouped_mm_2d2d_add_(out: Tensor, a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor,
                                 offs: Tensor) -> None:
    """:func:`rowwise_grouped_mm_2d2d` added to ``out`` (E, N, K) float32 in place:
    ``out[g] += (acc * scale_a) * scale_b``, one IEEE fp32 add of the scaled product
    before any rounding to bf16 (from zeros, ``out`` rounded to bf16 is the bf16 op's
    output). An empty group leaves its ``out[g]`` as it is. The weight gradient added to a
    main gradient; the cooperative 128x256 configuration (the bf16 op's pick)."""
    check_rowwise_grouped_mm_2d2d_add_(out, a, scale_a, b, scale_b, offs)
    _check_device(OP_2D2D_ADD, a)
    _ops.rowwise_grouped_mm_2d2d_add_(out, a, scale_a, b, scale_b, offs)


@torch.library.register_fake("moe_fp8::rowwise_grouped_mm_2d2d_add_")
def _(out, a, scale_a, b, scale_b, offs):
    check_rowwise_grouped_mm_2d2d_add_(out, a, scale_a, b, scale_b, offs)
