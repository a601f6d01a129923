"""The raw ops, one namespace a family: ``moe_fp8_ext.ops.rowwise``, ``.blockwise``,
``.mxfp8``, ``.swiglu``, ``.token_groups`` (the ``torch.ops.moe_fp8.*`` schemas are in
csrc/bindings.cpp). This module holds the FP8 rowwise wrappers (DESIGN §5) and the
argument checks every wrapper and fake kernel shares; each wrapper has its fake (meta)
implementation right beside it so the ops trace under ``torch.compile``.

All scales are *decode* scales: ``x ≈ q.float() * scale``. With ``pow2_scale`` (the
default) every scale is an exact power of two. ``fp8_dtype=None`` picks
:func:`moe_fp8_ext.default_fp8_dtype`.
"""

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _C
from ..platform import default_fp8_dtype

_ops = torch.ops.moe_fp8

# ---- argument checks shared by the wrappers and the fakes ------------------------------
# The same rules and messages as csrc/core/op_checks.h ("<op>: expected X, got Y"), so
# that a wrapper fails before it reads a shape and a fake kernel (torch.compile, meta
# tensors) refuses what the real kernel refuses. Content checks of index tensors stay
# in the kernels (a fake cannot read data).

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


# c10's names of the dtypes, as the C++ checks print them ("got Long").
_C10_NAMES = {
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.float64: "Double", torch.float32: "Float", torch.float16: "Half",
    torch.bfloat16: "BFloat16",
}


def _dtype_name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _require(cond, message) -> None:
    """RuntimeError(message()) unless cond. A plain branch (not torch._check), so
    that dynamo traces it into the compiled graph's guards (torch._check's message
    closure may only hold constants)."""
    if not cond:
        raise RuntimeError(message())


def check_tensor(op: str, name: str, t, dim: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> None:
    """``t`` is a Tensor (TypeError otherwise) of rank ``dim`` and dtype ``dtype``."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: expected {name} to be a Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise RuntimeError(f"{op}: expected {name} to be a {dim}-D tensor, got {t.dim()}-D")
    if dtype is not None and t.dtype != dtype:
        raise RuntimeError(f"{op}: expected {name} of dtype {str(dtype).replace('torch.', '')}, got {_dtype_name(t.dtype)}")


def check_index(op: str, name: str, t) -> None:
    """An int32 1-D index tensor (offs, padded_starts, indices, counts)."""
    check_tensor(op, name, t, dim=1, dtype=torch.int32)


def check_same_device(op: str, ref_name: str, ref: Tensor, **others: Optional[Tensor]) -> None:
    """Every tensor of one call on the device of ``ref`` (None skipped): a meta offs
    with CPU data must not fall through to the fake kernel."""
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise RuntimeError(f"{op}: expected {name} on {ref.device} (the device of {ref_name}), got {t.device}")


def check_int(op: str, name: str, v, lo: int = 0, hi: int = INT64_MAX) -> None:
    """An integer argument (int or SymInt) in [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
        raise TypeError(f"{op}: expected {name} to be an int, got {type(v).__name__}")
    _require(v >= lo, lambda: f"{op}: expected {name} in [{lo}, {hi}], got {v}")
    _require(v <= hi, lambda: f"{op}: expected {name} in [{lo}, {hi}], got {v}")


def check_alignment(op: str, alignment) -> None:
    if isinstance(alignment, bool) or not isinstance(alignment, int):
        raise TypeError(f"{op}: expected alignment to be an int, got {type(alignment).__name__}")
    if not (1 <= alignment <= 1024 and alignment & (alignment - 1) == 0):
        raise RuntimeError(f"{op}: expected alignment to be a power of two in [1, 1024], got {alignment}")


def check_rows_alloc(op: str, what: str, rows, like: Tensor) -> None:
    """An output of ``rows`` rows shaped like ``like``'s rows fits in int64 bytes."""
    nbytes = rows * like.shape[1] * like.element_size()
    if isinstance(nbytes, int) and nbytes > INT64_MAX:  # symbolic sizes: the real kernel checks
        raise RuntimeError(f"{op}: expected {what} ({rows} rows) to fit in int64 bytes, got {nbytes}")


def checked_padded_rows(op: str, rows, groups, alignment: int):
    """:func:`padded_rows`, checked to fit in int32 (padded offsets are int32; a static
    bound, whatever offs holds)."""
    total = rows + groups * alignment
    _require(
        total <= INT32_MAX,
        lambda: f"{op}: expected the padded layout of {rows} rows in {groups} groups aligned to {alignment} to fit "
        f"in int32 (rows + groups * alignment <= 2^31-1, padded offsets are int32), got {total}",
    )
    r = padded_rows(rows, groups, alignment)
    _require(r <= INT32_MAX, lambda: f"{op}: expected the padded rows to fit in int32 (at most 2^31-1), got {r}")
    return r



# ---- the FP8 rowwise recipe (DESIGN §5) -------------------------------------------------
# Each op's argument checks are one function (the rules and order of
# csrc/rowwise/rowwise_ops.cpp), run by its wrapper before any shape is read and by its
# fake, so a meta tensor among CPU/CUDA ones or a bad argument under torch.compile
# fails as the real kernel does.

QUANT_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


def check_quant_input(op: str, name: str, t, dim: int) -> None:
    """A floating input of a quantization op: a ``dim``-D bf16/fp16/fp32 tensor."""
    check_tensor(op, name, t, dim=dim)
    if t.dtype not in QUANT_IN_DTYPES:
        raise RuntimeError(f"{op}: expected {name} of dtype bfloat16, float16 or float32, got {_dtype_name(t.dtype)}")


def check_fp8_dtype(op: str, fp8_dtype) -> None:
    """The dtype of q: one of the three fp8 encodings (None: the default, resolved by
    the wrapper)."""
    if fp8_dtype is None:
        return
    if not isinstance(fp8_dtype, torch.dtype):
        raise TypeError(f"{op}: expected fp8_dtype to be a torch.dtype, got {type(fp8_dtype).__name__}")
    if fp8_dtype not in FP8_DTYPES:
        raise RuntimeError(
            f"{op}: expected fp8_dtype float8_e4m3fn, float8_e4m3fnuz or float8_e5m2, got {_dtype_name(fp8_dtype)}"
        )


def _dtype(fp8_dtype: Optional[torch.dtype], ref: Tensor) -> torch.dtype:
    return fp8_dtype if fp8_dtype is not None else default_fp8_dtype(ref.device if ref.is_cuda else None)


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


def check_quantize_experts(b_t, fp8_dtype, rdim, op):
    """b_t (E, K, N) reduced over dim rdim; E <= 65535 where the kernel takes the
    "cols" shape (rdim not the contiguous dimension), as rowwise_ops.cpp decides."""
    check_quant_input(op, "b_t", b_t, 3)
    check_fp8_dtype(op, fp8_dtype)
    e, r, c = b_t.shape[0], b_t.shape[rdim], b_t.shape[3 - rdim]
    if e == 0 or c == 0 or (b_t.stride(rdim) == 1 and r > 1):
        return
    _require(e <= MAX_EXPERTS_COLS, lambda: f"{op}: expected at most {MAX_EXPERTS_COLS} experts, got {e}")


def quantize_experts_fwd(b_t: Tensor, fp8_dtype: Optional[torch.dtype] = None, pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    """Quantize expert weights ``b_t`` (E, K, N), the right operand of ``A @ B_t``,
    over K for every (e, n).

    Returns ``q`` (E, K, N) column-major per expert (strides (K·N, 1, K)) and
    ``scale`` (E, 1, N) float32. Any input layout; the fast paths are B_t
    column-major (the transpose of an (E, N, K) weight) and row-major.
    """
    check_quantize_experts(b_t, fp8_dtype, 1, "quantize_experts_fwd")
    return _ops.quantize_experts_fwd(b_t, _dtype(fp8_dtype, b_t), pow2_scale)


def _experts_fake(b_t, fp8_dtype, rdim, op):
    """q (E, R, C) column-major per expert and scale (E, 1, C), R = b_t.shape[rdim]."""
    check_quantize_experts(b_t, fp8_dtype, rdim, op)
    e, r, c = b_t.shape[0], b_t.shape[rdim], b_t.shape[3 - rdim]
    q = b_t.new_empty_strided((e, r, c), (r * c, 1, r), dtype=fp8_dtype)
    return q, b_t.new_empty((e, 1, c), dtype=torch.float32)


@torch.library.register_fake("moe_fp8::quantize_experts_fwd")
def _(b_t, fp8_dtype, pow2_scale=True):
    return _experts_fake(b_t, fp8_dtype, 1, "quantize_experts_fwd")


def check_quantize_experts_cat(b_ts, fp8_dtype, op="quantize_experts_fwd_cat", rdim=1):
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


def quantize_experts_fwd_cat(b_ts: Sequence[Tensor], fp8_dtype: Optional[torch.dtype] = None,
                             pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    """``quantize_experts_fwd`` of the concatenation of the weights ``b_ts`` (each
    (E, K, N_i)) along N, written straight into one operand (no copy of the weights or
    of their fp8 codes): ``q`` (E, K, ΣN_i) column-major per expert and ``scale``
    (E, 1, ΣN_i), each weight's part bit for bit its own ``quantize_experts_fwd`` (the
    scales never span two weights). The experts layer's W1/W3 operand."""
    check_quantize_experts_cat(b_ts, fp8_dtype)
    return _ops.quantize_experts_fwd_cat(list(b_ts), _dtype(fp8_dtype, b_ts[0]), pow2_scale)


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
def _(b_ts, fp8_dtype, pow2_scale=True):
    check_quantize_experts_cat(b_ts, fp8_dtype)
    return _cat_outputs(b_ts, fp8_dtype, bwd=False)


def quantize_experts_bwd_cat(b_ts: Sequence[Tensor], fp8_dtype: Optional[torch.dtype] = None,
                             pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    """``quantize_experts_bwd`` of the concatenation of one or two weights ``b_ts``
    (each (E, K, N_i)) along N, the reduced dimension, so each (e, k) scale spans both:
    ``q`` (E, ΣN_i, K) column-major per expert and ``scale`` (E, 1, K), bit for bit
    ``quantize_experts_bwd(torch.cat(b_ts, dim=2))``. Two weights of one layout with N
    strided (the transposes of row-major (E, N_i, K) weights, e.g. torchtitan's w1 and
    w3) are read in place; other layouts quantize a copy. The experts layer's backward
    operand of W1 and W3 together (one input-gradient GEMM)."""
    check_quantize_experts_cat(b_ts, fp8_dtype, "quantize_experts_bwd_cat", 2)
    return _ops.quantize_experts_bwd_cat(list(b_ts), _dtype(fp8_dtype, b_ts[0]), pow2_scale)


@torch.library.register_fake("moe_fp8::quantize_experts_bwd_cat")
def _(b_ts, fp8_dtype, pow2_scale=True):
    check_quantize_experts_cat(b_ts, fp8_dtype, "quantize_experts_bwd_cat", 2)
    return _cat_outputs(b_ts, fp8_dtype, bwd=True)


def _check_dual_cat(b_ts, fp8_dtype):
    for rdim in (1, 2):  # the rules of both ops it may run (rdim 2: one or two weights)
        check_quantize_experts_cat(b_ts, fp8_dtype, "quantize_experts_dual_cat", rdim)


def dual_cat_reads_once(b_ts: Sequence[Tensor]) -> bool:
    """Whether ``quantize_experts_dual_cat(b_ts)`` runs the one-read kernel (the rule of
    rowwise_ops.cpp in Python, with the budget asked of the extension, which reads
    ``MOE_FP8_DUAL_L2_BYTES``; tests/test_rowwise.py checks the two agree)."""
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

    One-read kernel (DESIGN §10): weights on a GPU stored (E, N_i, K) with K contiguous
    (``b_t = W.transpose(-2, -1)``, torchtitan's layout), bf16 or fp16, N and K multiples
    of 16, whose two experts' matrices fit the L2 budget are read from DRAM once: a tile
    is read again from L2 once its expert's amaxes are complete. The budget is
    ``MOE_FP8_DUAL_L2_BYTES``: unset or "l2" = three fifths of L2 (16 MB a matrix on an
    H100), a byte count, or 0 = never. Measured 1.12-1.40x faster than the two ops on an
    H100 where it applies (bench/RESULTS.md). Anything else runs the two ops."""
    _check_dual_cat(b_ts, fp8_dtype)
    return _ops.quantize_experts_dual_cat(list(b_ts), _dtype(fp8_dtype, b_ts[0]), pow2_scale)


@torch.library.register_fake("moe_fp8::quantize_experts_dual_cat")
def _(b_ts, fp8_dtype, pow2_scale=True):
    _check_dual_cat(b_ts, fp8_dtype)
    return _cat_outputs(b_ts, fp8_dtype, bwd=False) + _cat_outputs(b_ts, fp8_dtype, bwd=True)


def quantize_experts_bwd(b_t: Tensor, fp8_dtype: Optional[torch.dtype] = None, pow2_scale: bool = True) -> Tuple[Tensor, Tensor]:
    """Quantize the same expert weights for the input gradient ``grad_A = grad_out @ B``
    (B = ``b_t.transpose(-2, -1)``, (E, N, K)), over N for every (e, k).

    Returns ``q`` (E, N, K) column-major per expert (strides (N·K, 1, N)) and
    ``scale`` (E, 1, K) float32.
    """
    check_quantize_experts(b_t, fp8_dtype, 2, "quantize_experts_bwd")
    return _ops.quantize_experts_bwd(b_t, _dtype(fp8_dtype, b_t), pow2_scale)


@torch.library.register_fake("moe_fp8::quantize_experts_bwd")
def _(b_t, fp8_dtype, pow2_scale=True):
    return _experts_fake(b_t, fp8_dtype, 2, "quantize_experts_bwd")


MAX_JAGGED_GROUPS = 65534


def check_jagged_layout(x, offs, padded_starts, alignment, op, xname="x", **more):
    """offs (and padded_starts with alignment) of a jagged quantization of x (and the
    other operands in ``more``, on x's device): returns the rows of q, M or the padded
    rows (checked to fit in int32). As quant_glue.h's check_offs + jagged_layout; the
    content of offs and padded_starts is the kernel's to check."""
    check_index(op, "offs", offs)
    check_same_device(op, xname, x, **more, offs=offs)
    if x.shape[1] > 0 or any(t.shape[1] > 0 for t in more.values()):
        _require(offs.shape[0] <= MAX_JAGGED_GROUPS,
                 lambda: f"{op}: expected at most {MAX_JAGGED_GROUPS} groups, got {offs.shape[0]}")
    if padded_starts is None:
        return x.shape[0]
    check_alignment(op, alignment)
    rows = checked_padded_rows(op, x.shape[0], offs.shape[0], alignment)
    _check_padded_starts(op, offs, padded_starts)
    check_same_device(op, xname, x, padded_starts=padded_starts)
    return rows


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


def padded_rows(num_tokens: int, groups: int, alignment: int) -> int:
    """Rows of the padded layout: ``ceil((num_tokens + groups·alignment)/alignment)·alignment``."""
    return -(-(num_tokens + groups * alignment) // alignment) * alignment


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

    By default this runs the two ops. With ``MOE_FP8_ONE_READ_ACTIVATIONS=1``, on a GPU
    that has the kernel (CUDA; DESIGN §10) and with ``padded_starts`` (the padded
    layout the recipes use), both come from ONE read of ``x``: each group is read from
    DRAM once for its amaxes and again, from L2, for both outputs, so it needs a mean
    group (M/G rows) whose bf16 bytes fit twice in the L2 budget of
    ``MOE_FP8_DUAL_L2_BYTES``; larger groups, fp32 input, or no padded layout run the
    two ops (the same bits). Off by default: on the H100 it measured 0.87-0.93x the
    two ops' speed (bench/RESULTS.md).
    """
    check_quantize_rowwise_jagged_dual(x, offs, fp8_dtype, padded_starts, alignment)
    return _ops.quantize_rowwise_jagged_dual(x, offs, _dtype(fp8_dtype, x), pow2_scale, padded_starts, alignment)


@torch.library.register_fake("moe_fp8::quantize_rowwise_jagged_dual")
def _(x, offs, fp8_dtype, pow2_scale=True, padded_starts=None, alignment=16):
    rows = check_quantize_rowwise_jagged_dual(x, offs, fp8_dtype, padded_starts, alignment)
    return (*_rowwise_outputs(x, fp8_dtype), *_jagged_outputs(x, offs, fp8_dtype, rows))


# ---- token groups (DESIGN §8) ----------------------------------------------------------
# Raw ops; the differentiable versions are in moe_fp8_ext.token_groups. Each op's
# argument checks are one function, run by its wrapper (before any shape is read) and
# by its fake.


def check_pad_token_groups(x, offs, alignment, op="pad_token_groups"):
    check_tensor(op, "x", x, dim=2)
    check_index(op, "offs", offs)
    check_same_device(op, "x", x, offs=offs)
    check_alignment(op, alignment)
    r = checked_padded_rows(op, x.shape[0], offs.shape[0], alignment)
    check_rows_alloc(op, "the padded output", r, x)
    return r


@torch.library.register_fake("moe_fp8::pad_token_groups")
def _(x, offs, alignment):
    r = check_pad_token_groups(x, offs, alignment)
    g = offs.shape[0]
    return x.new_empty((r, x.shape[1])), offs.new_empty((g,)), offs.new_empty((g,))


def check_block_jagged(op, x, offs, padded_starts, alignment, block):
    """The token groups of a transposing quantization with blocks of ``block`` rows
    (MXFP8 32, blockwise 128), as quant_glue.h's jagged_cols: offs, and padded_starts
    with an alignment that is a multiple of the block, come together. Returns the rows
    of q: M, or the padded rows (checked to fit in int32). The unpadded form's own
    rules (group sizes or starts) are the recipe's to check."""
    if offs is None and padded_starts is not None:
        raise RuntimeError(f"{op}: expected padded_starts only with offs")
    if (padded_starts is None) != (alignment is None):
        raise RuntimeError(f"{op}: expected padded_starts and alignment together, got only "
                           f"{'padded_starts' if padded_starts is not None else 'alignment'}")
    m = x.shape[0]
    if offs is None:
        return m
    check_index(op, "offs", offs)
    check_same_device(op, "x", x, offs=offs)
    g = offs.shape[0]
    _require(g <= MAX_JAGGED_GROUPS, lambda: f"{op}: expected at most {MAX_JAGGED_GROUPS} groups, got {g}")
    if padded_starts is None:
        return m
    if isinstance(alignment, bool) or not isinstance(alignment, (int, torch.SymInt)):
        raise TypeError(f"{op}: expected alignment to be an int, got {type(alignment).__name__}")
    _require(alignment >= block and alignment % block == 0,
             lambda: f"{op}: expected alignment to be a multiple of {block}, got {alignment}")
    check_alignment(op, alignment)
    q_rows = checked_padded_rows(op, m, g, alignment)
    _check_padded_starts(op, offs, padded_starts)
    check_same_device(op, "x", x, padded_starts=padded_starts)
    return q_rows


def _check_padded_starts(op, offs, padded_starts):
    check_index(op, "padded_starts", padded_starts)
    _require(
        padded_starts.shape[0] == offs.shape[0],
        lambda: f"{op}: expected padded_starts of shape ({offs.shape[0]},) like offs, got ({padded_starts.shape[0]},)",
    )


def check_pad_token_groups_at(x, offs, padded_starts, num_padded_rows, op="pad_token_groups_at"):
    check_tensor(op, "x", x, dim=2)
    check_index(op, "offs", offs)
    check_index(op, "padded_starts", padded_starts)
    check_same_device(op, "x", x, offs=offs, padded_starts=padded_starts)
    check_int(op, "num_padded_rows", num_padded_rows)
    check_rows_alloc(op, "the padded output", num_padded_rows, x)
    _check_padded_starts(op, offs, padded_starts)


@torch.library.register_fake("moe_fp8::pad_token_groups_at")
def _(x, offs, padded_starts, num_padded_rows):
    check_pad_token_groups_at(x, offs, padded_starts, num_padded_rows)
    return x.new_empty((num_padded_rows, x.shape[1]))


def check_unpad_token_groups(x_padded, offs, padded_starts, num_tokens, op="unpad_token_groups"):
    check_tensor(op, "x_padded", x_padded, dim=2)
    check_index(op, "offs", offs)
    check_index(op, "padded_starts", padded_starts)
    check_same_device(op, "x_padded", x_padded, offs=offs, padded_starts=padded_starts)
    check_int(op, "num_tokens", num_tokens)
    check_rows_alloc(op, "the output", num_tokens, x_padded)
    _check_padded_starts(op, offs, padded_starts)


@torch.library.register_fake("moe_fp8::unpad_token_groups")
def _(x_padded, offs, padded_starts, num_tokens):
    check_unpad_token_groups(x_padded, offs, padded_starts, num_tokens)
    return x_padded.new_empty((num_tokens, x_padded.shape[1]))


def check_padded_group_offsets(offs, num_tokens, alignment, op="padded_group_offsets"):
    check_index(op, "offs", offs)
    check_alignment(op, alignment)
    check_int(op, "num_tokens", num_tokens)
    checked_padded_rows(op, num_tokens, offs.shape[0], alignment)


def padded_group_offsets(offs: Tensor, num_tokens: int, alignment: int = 16) -> Tuple[Tensor, Tensor]:
    """``(padded_starts, padded_ends)`` of the layout :func:`pad_token_groups` builds for
    ``num_tokens`` tokens grouped by ``offs``: each group's size rounded up to
    ``alignment``, cumulated. One small kernel, no sync."""
    check_padded_group_offsets(offs, num_tokens, alignment)
    return _ops.padded_group_offsets(offs, num_tokens, alignment)


@torch.library.register_fake("moe_fp8::padded_group_offsets")
def _(offs, num_tokens, alignment):
    check_padded_group_offsets(offs, num_tokens, alignment)
    return offs.new_empty(offs.shape), offs.new_empty(offs.shape)


def check_permute_indices(counts, experts_per_rank, num_ranks, alignment, max_len, op="permute_indices"):
    check_index(op, "tokens_per_expert_group", counts)
    check_int(op, "experts_per_rank", experts_per_rank, lo=1)
    check_int(op, "num_ranks", num_ranks, lo=1)
    groups = experts_per_rank * num_ranks
    if groups > 2**20:
        raise RuntimeError(f"{op}: expected num_ranks * experts_per_rank <= 2^20, got {groups}")
    check_alignment(op, alignment)
    check_int(op, "max_len", max_len, hi=INT32_MAX)
    _require(
        counts.shape[0] == groups,
        lambda: f"{op}: expected tokens_per_expert_group of shape ({groups},) = num_ranks * experts_per_rank, "
        f"got ({counts.shape[0]},)",
    )


def permute_indices(
    tokens_per_expert_group: Tensor, experts_per_rank: int, num_ranks: int, alignment: int, max_len: int
) -> Tuple[Tensor, Tensor, Tensor]:
    """Index map from the rank-major order tokens arrive in after an all-to-all to the
    expert-major, padded order the grouped GEMM wants (DESIGN §8), in one launch.

    ``tokens_per_expert_group`` int32 (num_ranks·experts_per_rank,): the tokens each
    rank sent to each local expert, rank-major. Returns ``indices`` int32 (max_len,):
    the source row of every slot, -1 for a padding slot (a zero row); ``padded_sizes``
    and ``padded_ends`` int32 (experts_per_rank,): each expert's tokens rounded up to
    ``alignment``, and at least ``alignment`` (an expert with no tokens still gets a
    group). ``max_len = num_tokens + experts_per_rank·alignment`` always holds every
    slot; a ``max_len`` too small for the padded slots is an error on the CPU and with
    ``MOE_FP8_DEBUG=1`` (on a GPU otherwise, slots past ``max_len`` are dropped)."""
    check_permute_indices(tokens_per_expert_group, experts_per_rank, num_ranks, alignment, max_len)
    return _ops.permute_indices(tokens_per_expert_group, experts_per_rank, num_ranks, alignment, max_len)


@torch.library.register_fake("moe_fp8::permute_indices")
def _(counts, experts_per_rank, num_ranks, alignment, max_len):
    check_permute_indices(counts, experts_per_rank, num_ranks, alignment, max_len)
    return counts.new_empty((max_len,)), counts.new_empty((experts_per_rank,)), counts.new_empty((experts_per_rank,))


def check_zero_rows_past_groups_(x, offs, op="zero_rows_past_groups_"):
    check_tensor(op, "x", x, dim=2)
    check_index(op, "offs", offs)
    check_same_device(op, "x", x, offs=offs)
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise RuntimeError(f"{op}: expected x with a unit stride along dim 1, got strides {x.stride()}")
    # at::has_internal_overlap's "Yes" (a dim of size > 1 with stride 0: an expanded
    # view); the cases it calls too hard to tell are let through, as torch's in-place
    # ops do. Written out so that dynamo traces it.
    if any(n > 1 and s == 0 for n, s in zip(x.shape, x.stride())):
        raise RuntimeError(
            f"{op}: expected x without internal overlap (each element its own memory, as torch's in-place ops "
            f"require), got sizes {tuple(x.shape)} and strides {x.stride()}"
        )
    if torch.is_grad_enabled() and x.requires_grad and x.is_leaf:
        raise RuntimeError(
            f"{op}: expected x that is not a leaf requiring grad (an in-place write would bypass autograd), got a "
            "leaf with requires_grad=True"
        )


def zero_rows_past_groups_(x: Tensor, offs: Tensor) -> Tensor:
    """In place: rows of ``x`` (M, D) at or past ``offs[-1]`` (no group holds them)
    become zeros; only those rows are touched. Returns ``x``. Like torch's in-place
    ops, refuses an ``x`` whose elements share memory (an expanded view) and a leaf
    that requires grad."""
    check_zero_rows_past_groups_(x, offs)
    _ops.zero_rows_past_groups_(x, offs)
    return x


@torch.library.register_fake("moe_fp8::zero_rows_past_groups_")
def _(x, offs):
    check_zero_rows_past_groups_(x, offs)
    return None


def check_gather_rows(x, indices, op="gather_rows"):
    check_tensor(op, "x", x, dim=2)
    check_index(op, "indices", indices)
    check_same_device(op, "x", x, indices=indices)


def gather_rows(x: Tensor, indices: Tensor) -> Tensor:
    """``y[j] = x[indices[j]]``, a zero row where ``indices[j] == -1``. Any dtype."""
    check_gather_rows(x, indices)
    return _ops.gather_rows(x, indices)


@torch.library.register_fake("moe_fp8::gather_rows")
def _(x, indices):
    check_gather_rows(x, indices)
    return x.new_empty((indices.shape[0], x.shape[1]))


def check_scatter_rows(y, indices, num_rows, op="scatter_rows"):
    check_tensor(op, "y", y, dim=2)
    check_index(op, "indices", indices)
    check_same_device(op, "y", y, indices=indices)
    check_int(op, "num_rows", num_rows, hi=INT32_MAX)
    check_int(op, "the rows of y", y.shape[0], hi=INT32_MAX)  # (slots of the inverse map are int32)
    _require(
        indices.shape[0] == y.shape[0],
        lambda: f"{op}: expected indices of shape ({y.shape[0]},) (a row of y each), got {tuple(indices.shape)}",
    )
    check_rows_alloc(op, "the output", num_rows, y)


def scatter_rows(y: Tensor, indices: Tensor, num_rows: int) -> Tensor:
    """The inverse of :func:`gather_rows`: ``x[indices[j]] = y[j]`` for every
    ``indices[j] != -1`` (each row at most once), zero rows elsewhere; x has
    ``num_rows`` rows. Any dtype."""
    check_scatter_rows(y, indices, num_rows)
    return _ops.scatter_rows(y, indices, num_rows)


@torch.library.register_fake("moe_fp8::scatter_rows")
def _(y, indices, num_rows):
    check_scatter_rows(y, indices, num_rows)
    return y.new_empty((num_rows, y.shape[1]))
