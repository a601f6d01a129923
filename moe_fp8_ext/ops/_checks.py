"""Argument checks shared by the op wrappers and their fake kernels, every family.

The same rules and messages as csrc/core/op_checks.h ("<op>: expected X, got Y"), so
that a wrapper fails before it reads a shape and a fake kernel (torch.compile, meta
tensors) refuses what the real kernel refuses. Content checks of index tensors stay in
the kernels (a fake cannot read data).
"""

import os
from typing import Optional

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_true

from ..platform import default_fp8_dtype

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


def _require(cond, message, error: type = RuntimeError) -> None:
    """error(message()) unless cond. A condition on sizes that torch.compile cannot
    decide while tracing (unbacked: rows after an all-to-all) becomes a run-time assert
    (its message: dynamo takes closures of constants only)."""
    if cond is True:
        return
    if not isinstance(cond, (bool, torch.SymBool)):
        cond = bool(cond)
    if not guard_or_true(cond):
        raise error(message())
    torch._check(cond)


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


def debug_checks() -> bool:
    """``MOE_FP8_DEBUG=1``: checks that sync with the GPU run."""
    return os.environ.get("MOE_FP8_DEBUG") == "1"


def content_checked(t: Tensor) -> bool:
    """Whether a check may read ``t``'s values: on the CPU always, on a GPU only with
    ``MOE_FP8_DEBUG=1`` (it syncs); never while tracing (the values are not known)."""
    return (t.device.type == "cpu" or debug_checks()) and not torch.compiler.is_compiling()


def check_counts_where_cheap(op: str, name: str, counts: Tensor, num_tokens: int) -> None:
    """Token counts >= 0 summing to at most ``num_tokens`` (the rows of x), where
    :func:`content_checked`; on a GPU otherwise the ops clamp (DESIGN §3)."""
    if counts.numel() and content_checked(counts):
        low, total = int(counts.min()), int(counts.sum(dtype=torch.int64))  # host-sync-ok: CPU or MOE_FP8_DEBUG only
        if low < 0 or total > num_tokens:
            raise ValueError(f"{op}: expected {name} >= 0 summing to at most {num_tokens} (the rows of x), got a "
                             f"minimum of {low} and a sum of {total}")


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


def padded_rows(num_tokens: int, groups: int, alignment: int) -> int:
    """Rows of the padded layout: ``ceil((num_tokens + groups·alignment)/alignment)·alignment``."""
    return -(-(num_tokens + groups * alignment) // alignment) * alignment


QUANT_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


def check_quant_input(op: str, name: str, t, dim: int) -> None:
    """A floating input of a quantization op: a ``dim``-D bf16/fp16/fp32 tensor."""
    check_tensor(op, name, t, dim=dim)
    if t.dtype not in QUANT_IN_DTYPES:
        raise RuntimeError(f"{op}: expected {name} of dtype bfloat16, float16 or float32, got {_dtype_name(t.dtype)}")


def check_as_bf16(op: str, name: str, t: Tensor, as_bf16: bool) -> None:
    """``as_bf16`` (the weight quantizers): ``t`` fp32, read as ``t.to(torch.bfloat16)``."""
    if as_bf16 and t.dtype != torch.float32:
        raise RuntimeError(f"{op}: expected {name} of dtype float32 to read it as bfloat16 (as_bf16=True), got "
                           f"{_dtype_name(t.dtype)}")


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
