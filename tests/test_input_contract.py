"""The input contract (DESIGN §3, issue 16), table-driven: every public op of a family
× every class of bad input gives either a clear error ("<op>: expected ...") or a
result equal to moe_fp8_ext.reference, element for element — never garbage.

A row of the table is an OpCase: the callable, a builder of valid arguments, the
reference, and the mutators that turn valid arguments into one case of a class. The
generic classes come from the roles of the arguments (`data_mutators`,
`index_mutators`, `size_mutators`; `edge_mutators`: valid data holding each edge
class of the quantizers, NaN to subnormal maxima, DESIGN §4-§7); op-specific ones
are listed next to the op. New families join by appending OpCases to CASES.

Outputs are poisoned: CPU allocations are filled with 0x5a by glibc (mallopt
M_PERTURB, the in-process MALLOC_PERTURB_), GPU ones with 0xff (conftest.poison), so an
element an op forgets to write differs from the reference. The outcome counts
(clear / correct / vague / wrong / refused / clamped) are printed at the end of the
session (`pytest -s` or the terminal summary); a crash takes the process down, so a
completed run means 0 crashes.
"""

import collections
import ctypes
import dataclasses
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

import moe_fp8_ext as M
from moe_fp8_ext import reference as ref

from conftest import HAS_CUDA, poison
from edge_data import edge_matrix, steps

I32 = torch.int32
DEBUG = os.environ.get("MOE_FP8_DEBUG") == "1"

# Outcome of every (case, mutator, device), for the session summary.
OUTCOMES: "collections.Counter[str]" = collections.Counter()
BY_CLASS: Dict[Tuple[str, str], "collections.Counter[str]"] = collections.defaultdict(collections.Counter)
BAD: List[str] = []


def _perturb_cpu_allocations() -> None:
    """glibc fills every later malloc with 0x5a (165 ^ 0xff), as MALLOC_PERTURB_=165."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-6, 165)  # M_PERTURB
    except (OSError, AttributeError):
        pass


_perturb_cpu_allocations()


def i32(*v, device="cpu"):
    return torch.tensor(v, dtype=I32, device=device)


def data(rows, cols, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).to(dtype).to(device)


# ---- the table ------------------------------------------------------------------------


@dataclasses.dataclass
class Mut:
    cls: str  # the input class: dtype, rank, none, device, meta, strides, int32, empty, content, args, inplace, edge
    label: str
    apply: Callable[[Dict[str, Any], str], Dict[str, Any]]  # (valid args, device) -> args of this case
    valid: bool = False  # a valid input: the result must equal the reference
    content: bool = False  # invalid only through index content: a GPU clamps it (checked with MOE_FP8_DEBUG=1)
    expect: Optional[Callable[[Dict[str, Any]], Any]] = None  # the expected result where the reference can't run
    devices: Tuple[str, ...] = ("cpu", "cuda")


@dataclasses.dataclass
class OpCase:
    name: str  # the op name every error message must carry
    fn: Callable[..., Any]  # called with the argument values in order
    build: Callable[[str], Dict[str, Any]]  # device -> valid arguments (ordered)
    reference: Callable[[Dict[str, Any]], Any]  # CPU arguments -> expected outputs
    mutators: List[Mut]
    also_named: Tuple[str, ...] = ()  # ops a Python-level function is built on: their messages count as clear
    label: str = ""

    @property
    def id(self):
        return self.name + (f"[{self.label}]" if self.label else "")


def setarg(name, value):
    """A mutator body: argument `name` replaced by value(args, device) (or a constant)."""

    def apply(args, device):
        out = dict(args)
        out[name] = value(args, device) if callable(value) else value
        return out

    return apply


def other_devices(device):
    return [d for d in ("cpu", "cuda") if d != device and (d == "cpu" or HAS_CUDA)]


def device_mutators(names):
    """Each tensor on meta, and on the other real device, while the rest stay put; and
    every tensor on meta at once (a valid call of the fake: shapes must match)."""
    muts = []
    for n in names if len(names) > 1 else ():
        muts.append(Mut("meta", f"{n} on meta", setarg(n, lambda a, d, n=n: a[n].to("meta"))))
        for other in ("cpu", "cuda"):
            muts.append(
                Mut("device", f"{n} on {other}", setarg(n, lambda a, d, n=n, o=other: a[n].to(o)),
                    devices=tuple(x for x in ("cpu", "cuda") if x != other))
            )

    def all_meta(args, device):
        return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}

    muts.append(Mut("meta", "all on meta (the fake)", all_meta, valid=True))
    return muts


def data_mutators(n):
    """A 2-D data tensor of any dtype: wrong ranks, None; valid other dtypes and strides."""
    return [
        Mut("rank", f"{n} 0-D", setarg(n, lambda a, d: torch.tensor(1.5, device=d))),
        Mut("rank", f"{n} 1-D", setarg(n, lambda a, d, n=n: a[n][0])),
        Mut("rank", f"{n} 3-D", setarg(n, lambda a, d, n=n: a[n].unsqueeze(0))),
        Mut("none", f"{n} None", setarg(n, None)),
        Mut("dtype", f"{n} float32", setarg(n, lambda a, d, n=n: a[n].float()), valid=True),
        Mut("dtype", f"{n} int8", setarg(n, lambda a, d, n=n: (a[n].float() * 10).to(torch.int8)), valid=True),
        Mut("dtype", f"{n} float8_e4m3fn", setarg(n, lambda a, d, n=n: a[n].to(torch.float8_e4m3fn)), valid=True),
        Mut("dtype", f"{n} complex64", setarg(n, lambda a, d, n=n: a[n].to(torch.complex64)), valid=True),
        Mut("strides", f"{n} column-major", setarg(n, lambda a, d, n=n: a[n].t().contiguous().t()), valid=True),
        Mut("strides", f"{n} every other column", setarg(n, lambda a, d, n=n: a[n].repeat(1, 2)[:, ::2]), valid=True),
        Mut("empty", f"{n} with 0 columns", setarg(n, lambda a, d, n=n: a[n][:, :0]), valid=True),
    ]


def _strided(t):
    """The values of t in a view of stride 2 (-7 between them): the kernels must read
    the values, not the memory after the data pointer (issue 66)."""
    return torch.stack([t, torch.full_like(t, -7)], 1)[:, 0]


def index_mutators(n):
    """An int32 1-D index tensor: other dtypes and ranks, None; valid strides."""
    return [
        Mut("dtype", f"{n} int64", setarg(n, lambda a, d, n=n: a[n].long())),
        Mut("dtype", f"{n} float32", setarg(n, lambda a, d, n=n: a[n].float())),
        Mut("rank", f"{n} 2-D", setarg(n, lambda a, d, n=n: a[n].unsqueeze(0))),
        Mut("rank", f"{n} 0-D", setarg(n, lambda a, d: torch.tensor(3, dtype=I32, device=d))),
        Mut("none", f"{n} None", setarg(n, None)),
        Mut("strides", f"{n} strided (every other element)", setarg(n, lambda a, d, n=n: _strided(a[n])), valid=True),
    ]


# tests/edge_data.py's edge classes, a group at a time so every block (and reduction set) of any geometry holds the
# group's class: NaN of either sign with payloads, +-Inf, maxima of exactly 448 * 2^k or 240 * 2^k, subnormal maxima,
# maxima near the dtype's limit, -0.0 / zero blocks.
EDGE_GROUPS = {
    "NaN (+, -, payloads)": ("nan", "-nan", "snan"),
    "+-Inf": ("inf", "-inf"),
    "maxima 448*2^k, 240*2^k": ("exact448", "exact240"),
    "subnormal maxima": ("subnormal",),
    "maxima near the dtype's limit": ("huge",),
    "-0.0 and zero blocks": ("-zero", "zero", "normal"),
}


def edge_mutators(names):
    """Valid data of every edge class (all of `names` at once: they share a dtype), cut
    into blocks of 32 along the last dim: in fp32, and the NaN and Inf groups (whose
    bits the input conversion carries) in bf16 and fp16 too. tests/test_edges.py has
    every class in every dtype and layout, against the reference and CPU against GPU."""

    def make(t, dt, classes, seed, device):
        rows, cols = t.numel() // max(t.shape[-1], 1), t.shape[-1]
        x = edge_matrix(rows, cols, dt, steps(rows, 1), steps(cols, 32), seed, classes)
        return x.view(t.shape).to(device)

    muts = []
    for label, classes in EDGE_GROUPS.items():
        for dt in (torch.float32,) + ((torch.bfloat16, torch.float16) if "Inf" in label or "NaN" in label else ()):
            def apply(a, d, classes=classes, dt=dt):
                return {**a, **{n: make(a[n], dt, classes, i, d) for i, n in enumerate(names)}}

            muts.append(Mut("edge", f"{', '.join(names)}: {label} ({str(dt).replace('torch.', '')})", apply,
                            valid=True))
    return muts


def size_mutators(n, huge_ok=False):
    """A size argument: negative, None, and (unless huge_ok) sizes whose products
    overflow or do not fit the index type."""
    muts = [
        Mut("args", f"{n} = -1", setarg(n, -1)),
        Mut("none", f"{n} None", setarg(n, None)),
    ]
    if not huge_ok:
        muts += [
            Mut("args", f"{n} = 2**62+1", setarg(n, 2**62 + 1)),
            Mut("int32", f"{n} = 2**63-1", setarg(n, 2**63 - 1)),
        ]
    return muts


def alignment_mutators(n="alignment"):
    return [
        Mut("args", f"{n} = 0", setarg(n, 0)),
        Mut("args", f"{n} = 3", setarg(n, 3)),
        Mut("args", f"{n} = 2048", setarg(n, 2048)),
        Mut("args", f"{n} = -16", setarg(n, -16)),
        Mut("none", f"{n} None", setarg(n, None)),
        Mut("args", f"{n} = 1", setarg(n, 1), valid=True),
        Mut("args", f"{n} = 1024", setarg(n, 1024), valid=True),
    ]


def offs_content_mutators(n="offs", rows_of="x"):
    """Bad content of offs (cumulative group ends in [0, M], non-decreasing)."""
    return [
        Mut("content", f"{n} decreasing", setarg(n, lambda a, d: i32(20, 10, 30, 40, device=d)), content=True),
        Mut("content", f"{n} negative", setarg(n, lambda a, d: i32(-5, 10, 30, 40, device=d)), content=True),
        Mut("content", f"{n} past M", setarg(n, lambda a, d: i32(5, 10, 30, 41, device=d)), content=True),
        Mut("content", f"{n} int32 extremes", setarg(n, lambda a, d: i32(-(2**31), 2**31 - 1, 30, 40, device=d)),
            content=True),
    ]


# ---- references of the token-group family -------------------------------------------------

OFFS = (5, 5, 23, 40)  # an empty group, an empty tail: M = 40
M_ROWS, D_COLS, ALIGN = 40, 24, 16


def _ref_pad_at(x, offs, starts, rows):
    out = torch.zeros((rows, x.shape[1]), dtype=x.dtype)
    lo = 0
    for p, hi in zip(starts.tolist(), offs.tolist()):
        out[p : p + hi - lo] = x[lo:hi]
        lo = hi
    return out


def _ref_zero_rows(x, offs):
    y = x.clone()
    y[(offs[-1].item() if offs.numel() else 0) :] = 0
    return y


def _valid_layout(device, dtype=torch.bfloat16):
    x = data(M_ROWS, D_COLS, dtype)
    offs = i32(*OFFS)
    xp, starts, _ends = ref.pad_token_groups(x, offs, ALIGN)
    return x.to(device), offs.to(device), xp.to(device), starts.to(device)


def _big_rows(device, rows):
    """A (rows, 1) uint8 tensor past int32 rows, without the memory: an expanded view."""
    return torch.full((1, 1), 7, dtype=torch.uint8, device=device).expand(rows, 1)


def _empty_groups(names):
    """G = 0: every index tensor of `names` empty (a valid layout with no groups)."""

    def apply(args, device):
        out = dict(args)
        for n in names:
            out[n] = torch.zeros(0, dtype=I32, device=device)
        return out

    return apply


def _pad_case(fn, label):
    def build(device):
        x, offs, _, _ = _valid_layout(device)
        return {"x": x, "offs": offs, "alignment": ALIGN}

    muts = (
        data_mutators("x") + index_mutators("offs") + device_mutators(["x", "offs"]) + alignment_mutators()
        + offs_content_mutators()
        + [
            Mut("empty", "G = 0", _empty_groups(["offs"]), valid=True),
            Mut("empty", "M = 0", lambda a, d: {**a, "x": a["x"][:0], "offs": i32(0, 0, device=d)}, valid=True),
            Mut("content", "offs ends before M", setarg("offs", lambda a, d: i32(3, 9, device=d)), valid=True),
            Mut("int32", "x rows 2^31-8 (padded rows past int32)",
                lambda a, d: {**a, "x": _big_rows(d, 2**31 - 8), "offs": i32(2**31 - 8, device=d)}),
        ]
    )
    return OpCase("pad_token_groups", fn, build, lambda a: ref.pad_token_groups(a["x"], a["offs"], a["alignment"]),
                  muts, label=label)


def _unpad_case(fn, label):
    def build(device):
        _, offs, xp, starts = _valid_layout(device)
        return {"x_padded": xp, "offs": offs, "padded_starts": starts, "num_tokens": M_ROWS}

    def big_expect(a):
        small = a["x_padded"][:256].contiguous()
        return ref.unpad_token_groups(small, a["offs"], a["padded_starts"], a["num_tokens"])

    muts = (
        data_mutators("x_padded") + index_mutators("offs") + index_mutators("padded_starts")
        + device_mutators(["x_padded", "offs", "padded_starts"]) + size_mutators("num_tokens")
        + offs_content_mutators()
        + [
            Mut("empty", "G = 0", _empty_groups(["offs", "padded_starts"]), valid=True),
            Mut("args", "num_tokens past offs[-1]", setarg("num_tokens", 50), valid=True),
            Mut("args", "num_tokens before offs[-1]", setarg("num_tokens", 30), content=True),
            Mut("args", "padded_starts shorter than offs", setarg("padded_starts", lambda a, d: a["padded_starts"][:2])),
            Mut("content", "padded_starts overlapping", setarg("padded_starts", lambda a, d: i32(0, 5, 5, 16, device=d)),
                content=True),
            Mut("content", "padded_starts negative", setarg("padded_starts", lambda a, d: i32(-16, 0, 16, 32, device=d)),
                content=True),
            Mut("content", "padded_starts past the rows",
                setarg("padded_starts", lambda a, d: i32(0, 16, 16, 2**31 - 1, device=d)), content=True),
            Mut("int32", "x_padded rows 2^31+16 (valid: offs are int32)",
                lambda a, d: {**a, "x_padded": _big_rows(d, 2**31 + 16)}, valid=True, expect=big_expect),
        ]
    )
    return OpCase(
        "unpad_token_groups", fn, build,
        lambda a: ref.unpad_token_groups(a["x_padded"], a["offs"], a["padded_starts"], a["num_tokens"]), muts,
        label=label,
    )


def _pad_at_case():
    def build(device):
        x, offs, xp, starts = _valid_layout(device)
        return {"x": x, "offs": offs, "padded_starts": starts, "num_padded_rows": xp.shape[0]}

    muts = (
        data_mutators("x") + index_mutators("offs") + index_mutators("padded_starts")
        + device_mutators(["x", "offs", "padded_starts"]) + size_mutators("num_padded_rows")
        + offs_content_mutators()
        + [
            Mut("empty", "G = 0", _empty_groups(["offs", "padded_starts"]), valid=True),
            Mut("args", "num_padded_rows larger", setarg("num_padded_rows", 200), valid=True),
            Mut("args", "num_padded_rows too small", setarg("num_padded_rows", 40), content=True),
            Mut("args", "padded_starts shorter than offs", setarg("padded_starts", lambda a, d: a["padded_starts"][:2])),
            Mut("content", "padded_starts overlapping", setarg("padded_starts", lambda a, d: i32(0, 3, 3, 16, device=d)),
                content=True),
            Mut("content", "padded_starts decreasing", setarg("padded_starts", lambda a, d: i32(32, 16, 16, 0, device=d)),
                content=True),
        ]
    )
    return OpCase(
        "pad_token_groups_at", torch.ops.moe_fp8.pad_token_groups_at, build,
        lambda a: _ref_pad_at(a["x"], a["offs"], a["padded_starts"], a["num_padded_rows"]), muts, label="op",
    )


def _padded_offsets_case(fn, label):
    def build(device):
        return {"offs": i32(*OFFS, device=device), "num_tokens": M_ROWS, "alignment": ALIGN}

    muts = (
        index_mutators("offs") + device_mutators(["offs"]) + alignment_mutators() + size_mutators("num_tokens")
        + offs_content_mutators()
        + [
            Mut("empty", "G = 0", _empty_groups(["offs"]), valid=True),
            Mut("int32", "offs [2^31-1], 2^31 tokens (padded end 2^31)",
                lambda a, d: {**a, "offs": i32(2**31 - 1, device=d), "num_tokens": 2**31}),
            Mut("int32", "2^31-1 tokens in 4 groups", lambda a, d: {**a, "num_tokens": 2**31 - 1}),
        ]
    )
    return OpCase("padded_group_offsets", fn, build, lambda a: ref.padded_group_offsets(a["offs"], a["alignment"]),
                  muts, label=label)


COUNTS = (3, 0, 2, 5, 1, 4, 0, 2)  # 2 ranks x 4 experts, rank-major


def _permute_case(fn, label):
    def build(device):
        return {"counts": i32(*COUNTS, device=device), "experts_per_rank": 4, "num_ranks": 2, "alignment": ALIGN,
                "max_len": M.padded_rows(sum(COUNTS), 4, ALIGN)}

    muts = (
        index_mutators("counts") + device_mutators(["counts"]) + alignment_mutators()
        + size_mutators("max_len", huge_ok=True)
        + [
            Mut("args", "alignment = 1024, max_len to match",
                lambda a, d: {**a, "alignment": 1024, "max_len": M.padded_rows(sum(COUNTS), 4, 1024)}, valid=True),
            Mut("args", "max_len = 2^31", setarg("max_len", 2**31)),
            Mut("args", "max_len larger", setarg("max_len", 500), valid=True),
            Mut("content", "max_len too small", setarg("max_len", 40), content=True),
            Mut("args", "experts_per_rank = 0", setarg("experts_per_rank", 0)),
            Mut("args", "num_ranks = -1", setarg("num_ranks", -1)),
            Mut("args", "num_ranks = 2**62+1 (product wraps)", lambda a, d: {**a, "num_ranks": 2**62 + 1}),
            Mut("args", "ranks * experts > 2^20", lambda a, d: {**a, "experts_per_rank": 2**11, "num_ranks": 2**10}),
            Mut("args", "counts shorter than ranks * experts", setarg("counts", lambda a, d: a["counts"][:6])),
            Mut("none", "experts_per_rank None", setarg("experts_per_rank", None)),
            Mut("content", "counts negative", setarg("counts", lambda a, d: i32(3, 0, -2, 5, 1, 4, 0, 2, device=d)),
                content=True),
            Mut("int32", "counts near 2^31", setarg("counts", lambda a, d: i32(2**31 - 1, 0, 2, 5, 1, 4, 0, 2, device=d)),
                content=True),
            Mut("empty", "no tokens", setarg("counts", lambda a, d: i32(0, 0, 0, 0, 0, 0, 0, 0, device=d)), valid=True),
        ]
    )
    muts = [m for m in muts if m.label != "alignment = 1024"]
    return OpCase(
        "permute_indices", fn, build,
        lambda a: ref.permute_indices(a["counts"], a["experts_per_rank"], a["num_ranks"], a["alignment"], a["max_len"]),
        muts, label=label,
    )


IDX = (3, -1, 0, 39, 7, -1, 12)


def _gather_case(fn, label):
    def build(device):
        return {"x": data(M_ROWS, D_COLS, device=device), "indices": i32(*IDX, device=device)}

    def big_expect(a):
        return ref.gather_rows(a["x"][:1].contiguous(), a["indices"].clamp(max=0))

    muts = (
        data_mutators("x") + index_mutators("indices") + device_mutators(["x", "indices"])
        + [
            Mut("empty", "no indices", setarg("indices", lambda a, d: i32(device=d)), valid=True),
            Mut("empty", "x with 0 rows, all padding", lambda a, d: {**a, "x": a["x"][:0], "indices": i32(-1, -1, device=d)},
                valid=True),
            Mut("content", "index past the rows", setarg("indices", lambda a, d: i32(3, 40, device=d)), content=True),
            Mut("content", "index < -1", setarg("indices", lambda a, d: i32(3, -2, device=d)), content=True),
            Mut("int32", "x rows 2^31+16 (expanded)",
                lambda a, d: {"x": _big_rows(d, 2**31 + 16), "indices": i32(0, -1, 2**31 - 1, device=d)}, valid=True,
                expect=big_expect),
        ]
    )
    return OpCase("gather_rows", fn, build, lambda a: ref.gather_rows(a["x"], a["indices"]), muts, label=label)


def _scatter_case(fn, label, name="scatter_rows", num="num_rows", also=()):
    def build(device):
        return {"y": data(len(IDX), D_COLS, device=device), "indices": i32(*IDX, device=device), num: M_ROWS}

    muts = (
        data_mutators("y") + index_mutators("indices") + device_mutators(["y", "indices"]) + size_mutators(num)
        + [
            Mut("int32", f"{num} = 2^31", setarg(num, 2**31)),
            Mut("args", "indices longer than y", setarg("indices", lambda a, d: i32(*IDX, 1, device=d))),
            Mut("empty", "no rows", lambda a, d: {**a, "y": a["y"][:0], "indices": i32(device=d)}, valid=True),
            Mut("empty", f"{num} = 0, all padding",
                lambda a, d: {**a, "indices": torch.full((len(IDX),), -1, dtype=I32, device=d), num: 0}, valid=True),
            Mut("content", "duplicate index", setarg("indices", lambda a, d: i32(3, -1, 0, 39, 3, -1, 12, device=d)),
                content=True),
            Mut("content", "index past num_rows", setarg(num, 20), content=True),
        ]
    )
    return OpCase(name, fn, build, lambda a: ref.scatter_rows(a["y"], a["indices"], a[num]), muts, also_named=also,
                  label=label)


def _zero_rows_case(fn, label):
    def build(device):
        return {"x": data(M_ROWS, D_COLS, device=device), "offs": i32(5, 23, 30, device=device)}

    muts = (
        [m for m in data_mutators("x") if m.label not in ("x column-major", "x every other column")]
        + index_mutators("offs") + device_mutators(["x", "offs"]) + offs_content_mutators()
        + [
            Mut("strides", "x column-major", setarg("x", lambda a, d: a["x"].t().contiguous().t())),
            Mut("empty", "G = 0 (every row zeroed)", _empty_groups(["offs"]), valid=True),
            Mut("inplace", "x expanded (self-overlapping)", setarg("x", lambda a, d: a["x"][:1].expand(M_ROWS, D_COLS))),
            Mut("inplace", "x a leaf requiring grad", setarg("x", lambda a, d: a["x"].float().requires_grad_())),
            Mut("inplace", "x rows 2^31+16 (expanded)", lambda a, d: {**a, "x": _big_rows(d, 2**31 + 16)}),
        ]
    )
    return OpCase("zero_rows_past_groups_", fn, build, lambda a: _ref_zero_rows(a["x"], a["offs"]), muts, label=label)


def _zero_rows_op(x, offs):
    torch.ops.moe_fp8.zero_rows_past_groups_(x, offs)
    return x


def _permute_and_pad_case():
    def build(device):
        return {"x": data(sum(COUNTS), D_COLS, device=device), "counts": i32(*COUNTS, device=device),
                "experts_per_rank": 4, "num_ranks": 2, "alignment": ALIGN}

    def reference(a):
        max_len = M.padded_rows(a["x"].shape[0], a["experts_per_rank"], a["alignment"])
        idx, _sizes, ends = ref.permute_indices(a["counts"], a["experts_per_rank"], a["num_ranks"], a["alignment"], max_len)
        return ref.gather_rows(a["x"], idx), ends, idx

    muts = (
        data_mutators("x") + index_mutators("counts") + device_mutators(["x", "counts"]) + alignment_mutators()
        + [
            Mut("args", "num_ranks = 2**62+1", setarg("num_ranks", 2**62 + 1)),
            Mut("args", "experts_per_rank = 0", setarg("experts_per_rank", 0)),
            Mut("content", "counts negative", setarg("counts", lambda a, d: i32(3, 0, -2, 5, 1, 4, 0, 2, device=d)),
                content=True),
            Mut("content", "counts past the rows of x", setarg("counts", lambda a, d: i32(3, 0, 2, 5, 1, 4, 0, 9, device=d)),
                content=True),
        ]
    )
    return OpCase("permute_and_pad", M.permute_and_pad, build, reference, muts,
                  also_named=("permute_indices",))


# ---- the quantization ops: the rowwise recipe and MXFP8 ---------------------------------

F8 = torch.float8_e4m3fn


def quant_data_mutators(n, rank=2):
    """A floating input of a quantization op (bf16, fp16, fp32; any strides): wrong
    ranks, None, dtypes the kernels do not read; valid other dtypes and layouts."""
    def wrong_rank(a, d, n=n):
        t = a[n]
        return t.unsqueeze(0) if rank == 2 else t[0]

    return [
        Mut("rank", f"{n} 0-D", setarg(n, lambda a, d: torch.tensor(1.5, device=d))),
        Mut("rank", f"{n} 1-D", setarg(n, lambda a, d, n=n: a[n].flatten())),
        Mut("rank", f"{n} {rank + 1 if rank == 2 else rank - 1}-D", setarg(n, wrong_rank)),
        Mut("none", f"{n} None", setarg(n, None)),
        Mut("dtype", f"{n} float32", setarg(n, lambda a, d, n=n: a[n].float()), valid=True),
        Mut("dtype", f"{n} float16", setarg(n, lambda a, d, n=n: a[n].half()), valid=True),
        Mut("dtype", f"{n} float64", setarg(n, lambda a, d, n=n: a[n].double())),
        Mut("dtype", f"{n} int8", setarg(n, lambda a, d, n=n: (a[n].float() * 10).to(torch.int8))),
        Mut("dtype", f"{n} float8_e4m3fn", setarg(n, lambda a, d, n=n: a[n].to(torch.float8_e4m3fn))),
        Mut("dtype", f"{n} complex64", setarg(n, lambda a, d, n=n: a[n].to(torch.complex64))),
        Mut("strides", f"{n} transposed layout",
            setarg(n, lambda a, d, n=n: a[n].transpose(-2, -1).contiguous().transpose(-2, -1)), valid=True),
        Mut("strides", f"{n} every other column", setarg(n, lambda a, d, n=n: a[n].repeat_interleave(2, -1)[..., ::2]),
            valid=True),
    ]


def fp8_dtype_mutators(public):
    """fp8_dtype, the dtype of the output: the three fp8 encodings, nothing else."""
    muts = [
        Mut("args", "fp8_dtype float8_e5m2", setarg("fp8_dtype", torch.float8_e5m2), valid=True),
        Mut("args", "fp8_dtype float8_e4m3fnuz", setarg("fp8_dtype", torch.float8_e4m3fnuz), valid=True),
        Mut("args", "fp8_dtype int8", setarg("fp8_dtype", torch.int8)),
        Mut("args", "fp8_dtype bfloat16", setarg("fp8_dtype", torch.bfloat16)),
        Mut("args", "fp8_dtype float8_e8m0fnu", setarg("fp8_dtype", torch.float8_e8m0fnu)),
        Mut("args", "fp8_dtype 'e4m3'", setarg("fp8_dtype", "e4m3")),
        Mut("args", "pow2_scale False", setarg("pow2_scale", False), valid=True),
        Mut("args", "pow2_scale 'yes'", setarg("pow2_scale", "yes")),
    ]
    if public:
        muts.append(Mut("args", "fp8_dtype None (the default)", setarg("fp8_dtype", None), valid=True))
    else:
        muts.append(Mut("args", "fp8_dtype None", setarg("fp8_dtype", None)))
    return muts


def _fp8(a):
    return a["fp8_dtype"] if a["fp8_dtype"] is not None else M.default_fp8_dtype()


def _meta_expect(*shapes_dtypes):
    """The expected outputs of a fake where no reference can run: shapes and dtypes."""
    return lambda a: tuple(torch.empty(s, dtype=t, device="meta") for s, t in shapes_dtypes)


def _rowwise_case(fn, label, public):
    def build(device):
        return {"x": data(M_ROWS, D_COLS, device=device), "fp8_dtype": F8, "pow2_scale": True}

    muts = (
        quant_data_mutators("x") + fp8_dtype_mutators(public) + device_mutators(["x"]) + edge_mutators(["x"])
        + [
            Mut("empty", "x with 0 rows", setarg("x", lambda a, d: a["x"][:0]), valid=True),
            Mut("empty", "x with 0 columns", setarg("x", lambda a, d: a["x"][:, :0]), valid=True),
            Mut("int32", "x rows 2^31+16 on meta (the fake's shapes)",
                setarg("x", lambda a, d: torch.empty(2**31 + 16, 4, dtype=torch.bfloat16, device="meta")), valid=True,
                expect=_meta_expect(((2**31 + 16, 4), F8), ((2**31 + 16, 1), torch.float32))),
        ]
    )
    return OpCase("quantize_rowwise", fn, build,
                  lambda a: ref.quantize_rowwise(a["x"], _fp8(a), a["pow2_scale"]), muts, label=label)


E_EXPERTS, K_IN, N_OUT = 3, 24, 16


def _experts_case(fn, label, public, name):
    rdim = 1 if name == "quantize_experts_fwd" else 2

    def build(device):
        return {"b_t": data(E_EXPERTS * K_IN, N_OUT, device=device).view(E_EXPERTS, K_IN, N_OUT), "fp8_dtype": F8,
                "pow2_scale": True}

    def many_experts(a, d):
        # E > 65535 through an expanded view, in the layout that takes the "cols" shape
        b = data(2 * 3, 1, device=d).view(1, 2, 3)
        return b.transpose(1, 2).contiguous().transpose(1, 2).expand(70000, 2, 3) if rdim == 2 else b.expand(70000, 2, 3)

    def many_experts_rows(a, d):
        # the same E in the layout of the "rows" shape: no limit there
        b = data(2 * 3, 1, device=d).view(1, 2, 3)
        return b.expand(70000, 2, 3) if rdim == 2 else b.transpose(1, 2).contiguous().transpose(1, 2).expand(70000, 2, 3)

    muts = (
        quant_data_mutators("b_t", rank=3) + fp8_dtype_mutators(public) + device_mutators(["b_t"])
        + edge_mutators(["b_t"])
        + [
            Mut("strides", "b_t permuted (K, E, N)", setarg("b_t", lambda a, d: a["b_t"].permute(1, 0, 2).contiguous()
                                                           .permute(1, 0, 2)), valid=True),
            Mut("empty", "E = 0", setarg("b_t", lambda a, d: a["b_t"][:0]), valid=True),
            Mut("empty", "K = 0", setarg("b_t", lambda a, d: a["b_t"][:, :0]), valid=True),
            Mut("empty", "N = 0", setarg("b_t", lambda a, d: a["b_t"][:, :, :0]), valid=True),
            Mut("int32", "E = 70000 (cols shape: at most 65535)", setarg("b_t", many_experts)),
            Mut("int32", "E = 70000 (rows shape)", setarg("b_t", many_experts_rows), valid=True),
        ]
    )
    refn = ref.quantize_experts_fwd if rdim == 1 else ref.quantize_experts_bwd
    return OpCase(name, fn, build, lambda a: refn(a["b_t"], _fp8(a), a["pow2_scale"]), muts, label=label)


def _padded_starts(offs, alignment, device):
    return ref.padded_group_offsets(offs.cpu(), alignment)[0].to(device)


def _jagged_ref(a, xs):
    fd, pow2 = _fp8(a), a["pow2_scale"]
    out = []
    for n in xs:
        if a.get("padded_starts") is None:
            out += ref.quantize_jagged_colwise(a[n], a["offs"], fd, pow2)
        else:
            out += ref.quantize_jagged_colwise_padded(a[n], a["offs"], a["alignment"], fd, pow2)
    return tuple(out)


def _with_alignment(al):
    """alignment = al with padded_starts of that layout (a valid padded call)."""
    def apply(a, d):
        return {**a, "alignment": al, "padded_starts": _padded_starts(a["offs"], al, d)}

    return apply


def _jagged_case(fn, label, public, padded, dual=False):
    name = "quantize_jagged_colwise_dual" if dual else "quantize_jagged_colwise"
    xs = ["x1", "x2"] if dual else ["x"]

    def build(device):
        out = {}
        for i, n in enumerate(xs):
            out[n] = data(M_ROWS, D_COLS if i == 0 else 8, device=device, seed=i)
        offs = i32(*OFFS, device=device)
        out.update({"offs": offs, "fp8_dtype": F8, "pow2_scale": True,
                    "padded_starts": _padded_starts(offs, ALIGN, device) if padded else None, "alignment": ALIGN})
        return out

    muts = []
    for n in xs:
        muts += [m for m in quant_data_mutators(n) if not (dual and m.cls == "dtype" and m.valid)]
        muts.append(Mut("empty", f"{n} with 0 columns", setarg(n, lambda a, d, n=n: a[n][:, :0]), valid=True))
    if dual:  # one dtype for both: the valid dtypes change both operands
        for t in (torch.float32, torch.float16):
            muts.append(Mut("dtype", f"x1 and x2 {str(t).replace('torch.', '')}",
                            lambda a, d, t=t: {**a, "x1": a["x1"].to(t), "x2": a["x2"].to(t)}, valid=True))
    tensors = xs + ["offs"] + (["padded_starts"] if padded else [])
    muts += fp8_dtype_mutators(public) + index_mutators("offs") + device_mutators(tensors) + offs_content_mutators()
    muts += edge_mutators(xs)
    rows0 = {n: (lambda a, d, n=n: a[n][:0]) for n in xs}
    muts += [
        Mut("empty", "G = 0", _empty_groups(["offs"] + (["padded_starts"] if padded else [])), valid=True),
        Mut("empty", "M = 0", lambda a, d: {**a, **{n: f(a, d) for n, f in rows0.items()}, "offs": i32(0, 0, device=d),
                                            **({"padded_starts": i32(0, 0, device=d)} if padded else {})}, valid=True),
        Mut("content", "offs ends before M", lambda a, d: {**a, "offs": i32(3, 9, device=d), **(
            {"padded_starts": i32(0, 16, device=d)} if padded else {})}, valid=True),
    ]
    if dual:
        muts += [
            Mut("dtype", "x1 and x2 of two dtypes", setarg("x2", lambda a, d: a["x2"].float())),
            Mut("args", "x2 with other rows", setarg("x2", lambda a, d: a["x2"][:30])),
            Mut("args", "x1 with 0 columns, x2 too", lambda a, d: {**a, "x1": a["x1"][:, :0], "x2": a["x2"][:, :0]},
                valid=True),
        ]
    if padded:
        muts += [m for m in index_mutators("padded_starts") if m.cls != "none"] + [
            Mut("none", "padded_starts None (the unpadded layout)", setarg("padded_starts", None), valid=True),
            Mut("args", "alignment = 0", setarg("alignment", 0)),
            Mut("args", "alignment = 3", setarg("alignment", 3)),
            Mut("args", "alignment = 2048", setarg("alignment", 2048)),
            Mut("args", "alignment = -16", setarg("alignment", -16)),
            Mut("none", "alignment None", setarg("alignment", None)),
            Mut("args", "alignment = 1 (its layout)", _with_alignment(1), valid=True),
            Mut("args", "alignment = 1024 (its layout)", _with_alignment(1024), valid=True),
            Mut("args", "padded_starts shorter than offs", setarg("padded_starts", lambda a, d: a["padded_starts"][:2])),
            Mut("content", "padded_starts overlapping (0, 3, ..)", setarg("padded_starts", lambda a, d: i32(
                0, 3, 3, 32, device=d)), content=True),
            Mut("content", "padded_starts of alignment 8", setarg("padded_starts", lambda a, d: _padded_starts(
                a["offs"], 8, d)), content=True),
            Mut("content", "padded_starts decreasing", setarg("padded_starts", lambda a, d: i32(32, 16, 16, 0, device=d)),
                content=True),
            Mut("content", "padded_starts past the rows", setarg("padded_starts", lambda a, d: i32(
                0, 16, 16, 2**31 - 1, device=d)), content=True),
            Mut("int32", "x rows 2^31-8 (padded rows past int32)",
                lambda a, d: {**a, **{n: torch.ones(1, 1, dtype=torch.bfloat16, device=d).expand(2**31 - 8, 1) for n in xs},
                              "offs": i32(2**31 - 8, device=d), "padded_starts": i32(0, device=d)}),
            Mut("int32", "alignment 1024, 2^21 groups on meta (padded rows past int32)",
                lambda a, d: {**a, **{n: a[n].to("meta") for n in xs},
                              "offs": torch.empty(2**21, dtype=I32, device="meta"),
                              "padded_starts": torch.empty(2**21, dtype=I32, device="meta"), "alignment": 1024}),
        ]
    else:
        muts += [
            Mut("none", "padded_starts None, alignment 0 (unused)", setarg("alignment", 0), valid=True),
        ]
    return OpCase(name, fn, build, lambda a: _jagged_ref(a, xs), muts, label=label)


# MXFP8: blocks of 32 along the contraction dimension.
MX_ROWS, MX_K = 40, 64
MX_OFFS = (32, 32, 96)  # group sizes multiples of 32, an empty group, a tail: M = 128


def optional_index_mutators(n):
    """An optional int32 index tensor (the token groups of MXFP8): None is the
    ungrouped call, a valid input."""
    return [m for m in index_mutators(n) if m.cls != "none"] + [
        Mut("none", f"{n} None (ungrouped)", setarg(n, None), valid=True)]


def rounding_mutators():
    return [
        Mut("args", "rounding 'floor'", setarg("rounding", "floor"), valid=True),
        Mut("args", "rounding 'nearest'", setarg("rounding", "nearest")),
        Mut("args", "rounding 'RCEIL'", setarg("rounding", "RCEIL")),
        Mut("args", "rounding None", setarg("rounding", None)),
        Mut("args", "rounding 1", setarg("rounding", 1)),
    ]


def _mx_rowwise_case(fn, label, blocked, grouped):
    def build(device):
        out = {"x": data(MX_ROWS, MX_K, device=device), "rounding": "rceil", "blocked": blocked}
        out["offs"] = i32(*OFFS, device=device) if grouped else None
        return out

    def reference(a):
        return ref.quantize_mxfp8_rowwise(a["x"], a["rounding"], a["blocked"], a["offs"])

    muts = (
        [m for m in quant_data_mutators("x") if m.label != "x every other column"] + rounding_mutators()
        + device_mutators(["x", "offs"] if grouped else ["x"]) + edge_mutators(["x"])
        + [
            Mut("strides", "x every other column", setarg("x", lambda a, d: a["x"].repeat(1, 2)[:, ::2]), valid=True),
            Mut("args", "K = 48 (not a multiple of 32)", setarg("x", lambda a, d: a["x"][:, :48])),
            Mut("empty", "x with 0 rows", lambda a, d: {**a, "x": a["x"][:0], **(
                {"offs": i32(0, 0, device=d)} if grouped else {})}, valid=True),
            Mut("empty", "x with 0 columns", setarg("x", lambda a, d: a["x"][:, :0]), valid=True),
        ]
    )
    if grouped:
        muts += optional_index_mutators("offs") + offs_content_mutators() + [
            Mut("empty", "G = 0", _empty_groups(["offs"]), valid=True),
            Mut("args", "offs with blocked=False", setarg("blocked", False)),
            Mut("int32", "x rows 2^31-64 (grouped scale rows past int32)",
                lambda a, d: {**a, "x": torch.ones(1, 32, dtype=torch.bfloat16, device=d).expand(2**31 - 64, 32),
                              "offs": i32(2**31 - 64, device=d)}),
        ]
    else:
        muts.append(Mut("args", "blocked 'yes'", setarg("blocked", "yes")))
    return OpCase("quantize_mxfp8_rowwise", fn, build, reference, muts, label=label)


def _mx_colwise_case(fn, label, blocked, mode):
    """mode: "plain" (M % 32 == 0), "grouped" (offs, sizes multiples of 32) or "padded"
    (offs of any sizes, padded_starts and alignment: q in the padded layout)."""

    def build(device):
        if mode == "padded":
            offs = i32(*OFFS, device=device)
            return {"x": data(M_ROWS, D_COLS, device=device), "rounding": "rceil", "blocked": blocked, "offs": offs,
                    "padded_starts": _padded_starts(offs, 32, device), "alignment": 32}
        rows = 128 if mode == "grouped" else 96
        return {"x": data(rows, D_COLS, device=device), "rounding": "rceil", "blocked": blocked,
                "offs": i32(*MX_OFFS, device=device) if mode == "grouped" else None, "padded_starts": None,
                "alignment": None}

    def reference(a):
        if a["padded_starts"] is not None:
            return ref.quantize_mxfp8_colwise_padded(a["x"], a["offs"], a["alignment"], a["rounding"], a["blocked"])
        return ref.quantize_mxfp8_colwise(a["x"], a["rounding"], a["blocked"], a["offs"])

    tensors = ["x"] + (["offs"] if mode != "plain" else []) + (["padded_starts"] if mode == "padded" else [])
    muts = quant_data_mutators("x") + rounding_mutators() + device_mutators(tensors) + edge_mutators(["x"]) + [
        Mut("empty", "x with 0 columns", setarg("x", lambda a, d: a["x"][:, :0]), valid=True),
    ]
    if mode == "plain":
        muts += [
            Mut("args", "M = 40 (not a multiple of 32)", setarg("x", lambda a, d: a["x"][:40])),
            Mut("empty", "x with 0 rows", setarg("x", lambda a, d: a["x"][:0]), valid=True),
            Mut("args", "padded_starts without offs", lambda a, d: {**a, "padded_starts": i32(0, device=d),
                                                                     "alignment": 32}),
            Mut("args", "alignment without padded_starts", setarg("alignment", 32)),
        ]
    if mode == "grouped":
        muts += optional_index_mutators("offs") + offs_content_mutators() + [
            # G = 0: every row is past the last group, so q and the scales are zero
            # (reference.quantize_mxfp8_colwise quantizes all rows when offs is empty)
            Mut("empty", "G = 0 (every row past the groups: zeros)", _empty_groups(["offs"]), valid=True,
                expect=lambda a: ref.quantize_mxfp8_colwise(torch.zeros_like(a["x"]), a["rounding"], a["blocked"],
                                                            a["offs"])),
            Mut("content", "a group of 40 rows", setarg("offs", lambda a, d: i32(40, 96, device=d)), content=True),
            Mut("args", "M = 120 (not a multiple of 32)", lambda a, d: {**a, "x": a["x"][:120],
                                                                        "offs": i32(32, 96, device=d)}),
            Mut("args", "alignment without padded_starts", setarg("alignment", 32)),
            Mut("int32", "x rows 2^31-32 (blocked group starts past int32)" if blocked else "x rows 2^31-32 on meta",
                lambda a, d: {**a, "x": torch.ones(1, 1, dtype=torch.bfloat16, device=d if blocked else "meta")
                              .expand(2**31 - 32, 1), "offs": i32(2**31 - 32, device=d if blocked else "meta")},
                valid=not blocked, expect=None if blocked else _meta_expect(
                    ((2**31 - 32, 1), torch.float8_e4m3fn), ((1, (2**31 - 32) // 32), torch.float8_e8m0fnu))),
        ]
    if mode == "padded":
        muts += index_mutators("offs") + index_mutators("padded_starts") + offs_content_mutators() + [
            Mut("empty", "G = 0", _empty_groups(["offs", "padded_starts"]), valid=True),
            Mut("args", "alignment = 0", setarg("alignment", 0)),
            Mut("args", "alignment = 16", setarg("alignment", 16)),
            Mut("args", "alignment = 96", setarg("alignment", 96)),
            Mut("args", "alignment = 2048", setarg("alignment", 2048)),
            Mut("args", "alignment = -32", setarg("alignment", -32)),
            Mut("args", "alignment 'a'", setarg("alignment", "a")),
            Mut("args", "alignment = 128 (its layout)", _with_alignment(128), valid=True),
            Mut("args", "alignment None", setarg("alignment", None)),
            Mut("args", "padded_starts shorter than offs", setarg("padded_starts", lambda a, d: a["padded_starts"][:2])),
            Mut("content", "padded_starts overlapping (0, 3, ..)", setarg("padded_starts", lambda a, d: i32(
                0, 3, 3, 64, device=d)), content=True),
            Mut("content", "padded_starts of alignment 16", setarg("padded_starts", lambda a, d: _padded_starts(
                a["offs"], 16, d)), content=True),
            Mut("int32", "x rows 2^31-8 (padded rows past int32)",
                lambda a, d: {**a, "x": torch.ones(1, 1, dtype=torch.bfloat16, device=d).expand(2**31 - 8, 1),
                              "offs": i32(2**31 - 8, device=d), "padded_starts": i32(0, device=d)}),
        ]
    return OpCase("quantize_mxfp8_colwise", fn, build, reference, muts, label=label)


def _mx_experts_case(fn, label, blocked):
    def build(device):
        return {"b": data(E_EXPERTS * MX_K, N_OUT, device=device).view(E_EXPERTS, MX_K, N_OUT), "rounding": "rceil",
                "blocked": blocked}

    muts = (
        quant_data_mutators("b", rank=3) + rounding_mutators() + device_mutators(["b"]) + edge_mutators(["b"])
        + [
            Mut("strides", "b the transpose of (E, N, K)", setarg("b", lambda a, d: a["b"].transpose(1, 2).contiguous()
                                                                  .transpose(1, 2)), valid=True),
            Mut("args", "K = 48 (not a multiple of 32)", setarg("b", lambda a, d: a["b"][:, :48])),
            # blocked scales of E = 0 experts: (0, ceil128(N) * ceil4(K/32)) as for any E
            # (reference.quantize_mxfp8_experts returns (0, 0))
            Mut("empty", "E = 0", setarg("b", lambda a, d: a["b"][:0]), valid=True,
                expect=(lambda a: (ref.quantize_mxfp8_experts(a["b"], a["rounding"])[0],
                                   torch.empty(0, 128 * 4, dtype=torch.float8_e8m0fnu))) if blocked else None),
            Mut("empty", "N = 0", setarg("b", lambda a, d: a["b"][:, :, :0]), valid=True),
            Mut("empty", "K = 0", setarg("b", lambda a, d: a["b"][:, :0]), valid=True),
            Mut("int32", "E = 70000 (at most 65535)",
                setarg("b", lambda a, d: data(32, 3, device=d).view(1, 32, 3).expand(70000, 32, 3))),
        ]
    )
    return OpCase("quantize_mxfp8_experts", fn, build,
                  lambda a: ref.quantize_mxfp8_experts(a["b"], a["rounding"], a["blocked"]), muts, label=label)


def _quant_cases():
    out = []
    for public in (True, False):
        lab = "public" if public else "op"
        wrap = (lambda c: c) if public else raw
        out.append(wrap(_rowwise_case(M.quantize_rowwise if public else _ops.quantize_rowwise, lab, public)))
        for name in ("quantize_experts_fwd", "quantize_experts_bwd"):
            out.append(wrap(_experts_case(getattr(M if public else _ops, name), lab, public, name)))
        for padded in (False, True):
            for dual in (False, True):
                name = "quantize_jagged_colwise_dual" if dual else "quantize_jagged_colwise"
                out.append(wrap(_jagged_case(getattr(M if public else _ops, name),
                                             lab + ("-padded" if padded else ""), public, padded, dual)))
        fr = M.quantize_mxfp8_rowwise if public else _ops.quantize_mxfp8_rowwise
        out.append(wrap(_mx_rowwise_case(fr, lab + "-linear", False, False)))
        out.append(wrap(_mx_rowwise_case(fr, lab + "-blocked", True, False)))
        out.append(wrap(_mx_rowwise_case(fr, lab + "-blocked-groups", True, True)))
        fc = M.quantize_mxfp8_colwise if public else _ops.quantize_mxfp8_colwise
        for mode in ("plain", "grouped", "padded"):
            for blocked in (False, True):
                out.append(wrap(_mx_colwise_case(fc, f"{lab}-{mode}" + ("-blocked" if blocked else ""), blocked, mode)))
        fe = M.quantize_mxfp8_experts if public else _ops.quantize_mxfp8_experts
        for blocked in (False, True):
            out.append(wrap(_mx_experts_case(fe, lab + ("-blocked" if blocked else ""), blocked)))
    return out



# ---- the FP8 blockwise family (DESIGN §6) ------------------------------------------------

BW_ROWS, BW_OFFS = 260, (128, 128, 250)  # non-empty groups start at multiples of 128; a tail


def _bw_fp8_mutators(public):
    return [m for m in fp8_dtype_mutators(public) if "pow2_scale" not in m.label]


def _bw_lhs_case(fn, label, public):
    def build(device):
        return {"x": data(M_ROWS, 300, device=device), "fp8_dtype": F8}

    muts = (
        quant_data_mutators("x") + _bw_fp8_mutators(public) + device_mutators(["x"]) + edge_mutators(["x"])
        + [
            Mut("empty", "x with 0 rows", setarg("x", lambda a, d: a["x"][:0]), valid=True),
            Mut("empty", "x with 0 columns", setarg("x", lambda a, d: a["x"][:, :0]), valid=True),
            Mut("args", "K = 1 (a 1-element block)", setarg("x", lambda a, d: a["x"][:, :1]), valid=True),
            Mut("args", "K = 128 (whole blocks)", setarg("x", lambda a, d: a["x"][:, :128]), valid=True),
            Mut("int32", "x rows 2^31+16 on meta (the fake's shapes)",
                setarg("x", lambda a, d: torch.empty(2**31 + 16, 4, dtype=torch.bfloat16, device="meta")), valid=True,
                expect=_meta_expect(((2**31 + 16, 4), F8), ((2**31 + 16, 1), torch.float32))),
        ]
    )
    return OpCase("quantize_blockwise_act_lhs", fn, build,
                  lambda a: ref.quantize_blockwise_act_lhs(a["x"], _fp8(a)), muts, label=label)


def _bw_cols_case(fn, name, label, public, mode):
    """mode: "plain", "grouped" (offs, non-empty groups starting at multiples of 128) or
    "padded" (offs of any sizes, padded_starts and alignment: q in the padded layout)."""

    def build(device):
        if mode == "padded":
            offs = i32(*OFFS, device=device)
            return {"x": data(M_ROWS, D_COLS, device=device), "fp8_dtype": F8, "offs": offs,
                    "padded_starts": _padded_starts(offs, 128, device), "alignment": 128}
        rows = BW_ROWS if mode == "grouped" else 130
        return {"x": data(rows, D_COLS, device=device), "fp8_dtype": F8,
                "offs": i32(*BW_OFFS, device=device) if mode == "grouped" else None, "padded_starts": None,
                "alignment": None}

    refn = getattr(ref, name)

    def reference(a):
        return refn(a["x"], _fp8(a), a["offs"], a["alignment"] if a["padded_starts"] is not None else None)

    tensors = ["x"] + (["offs"] if mode != "plain" else []) + (["padded_starts"] if mode == "padded" else [])
    muts = quant_data_mutators("x") + _bw_fp8_mutators(public) + device_mutators(tensors) + edge_mutators(["x"]) + [
        Mut("empty", "x with 0 columns", setarg("x", lambda a, d: a["x"][:, :0]), valid=True),
    ]
    if mode == "plain":
        muts += [
            Mut("args", "M = 1", setarg("x", lambda a, d: a["x"][:1]), valid=True),
            Mut("args", "M = 128", setarg("x", lambda a, d: a["x"][:128]), valid=True),
            Mut("empty", "x with 0 rows", setarg("x", lambda a, d: a["x"][:0]), valid=True),
            Mut("args", "padded_starts without offs", lambda a, d: {**a, "padded_starts": i32(0, device=d),
                                                                     "alignment": 128}),
            Mut("args", "alignment without padded_starts", setarg("alignment", 128)),
        ]
    if mode == "grouped":
        muts += optional_index_mutators("offs") + offs_content_mutators() + [
            Mut("empty", "G = 0 (every row past the groups: zeros)", _empty_groups(["offs"]), valid=True),
            Mut("empty", "x with 0 rows", lambda a, d: {**a, "x": a["x"][:0], "offs": i32(0, 0, device=d)},
                valid=True),
            Mut("args", "a last group of 1 row", setarg("offs", lambda a, d: i32(128, 129, device=d)), valid=True),
            Mut("content", "a group starting at row 100", setarg("offs", lambda a, d: i32(100, 260, device=d)),
                content=True),
            Mut("content", "a group starting at row 250 after an empty one",
                setarg("offs", lambda a, d: i32(250, 250, 260, device=d)), content=True),
            Mut("args", "alignment without padded_starts", setarg("alignment", 128)),
        ]
    if mode == "padded":
        muts += index_mutators("offs") + index_mutators("padded_starts") + offs_content_mutators() + [
            Mut("empty", "G = 0", _empty_groups(["offs", "padded_starts"]), valid=True),
            Mut("args", "alignment = 0", setarg("alignment", 0)),
            Mut("args", "alignment = 32", setarg("alignment", 32)),
            Mut("args", "alignment = 384", setarg("alignment", 384)),
            Mut("args", "alignment = 2048", setarg("alignment", 2048)),
            Mut("args", "alignment = -128", setarg("alignment", -128)),
            Mut("args", "alignment 'a'", setarg("alignment", "a")),
            Mut("args", "alignment = 256 (its layout)", _with_alignment(256), valid=True),
            Mut("args", "alignment = 1024 (its layout)", _with_alignment(1024), valid=True),
            Mut("args", "alignment None", setarg("alignment", None)),
            Mut("args", "padded_starts shorter than offs", setarg("padded_starts", lambda a, d: a["padded_starts"][:2])),
            Mut("content", "padded_starts overlapping (0, 3, ..)", setarg("padded_starts", lambda a, d: i32(
                0, 3, 3, 128, device=d)), content=True),
            Mut("content", "padded_starts of alignment 16", setarg("padded_starts", lambda a, d: _padded_starts(
                a["offs"], 16, d)), content=True),
            Mut("int32", "x rows 2^31-8 (padded rows past int32)",
                lambda a, d: {**a, "x": torch.ones(1, 1, dtype=torch.bfloat16, device=d).expand(2**31 - 8, 1),
                              "offs": i32(2**31 - 8, device=d), "padded_starts": i32(0, device=d)}),
        ]
    return OpCase(name, fn, build, reference, muts, label=label)


def _blockwise_cases():
    out = []
    for public in (True, False):
        lab = "public" if public else "op"
        wrap = (lambda c: c) if public else raw
        out.append(wrap(_bw_lhs_case(M.quantize_blockwise_act_lhs if public else _ops.quantize_blockwise_act_lhs,
                                     lab, public)))
        for name in ("quantize_blockwise_act_rhs", "quantize_blockwise_act_transposed_lhs"):
            for mode in ("plain", "grouped", "padded"):
                out.append(wrap(_bw_cols_case(getattr(M if public else _ops, name), name, f"{lab}-{mode}", public,
                                              mode)))
    return out


def raw(case: OpCase) -> OpCase:
    """The same row for the torch.ops entry point: a None tensor never reaches it (the
    dispatcher itself answers "tensor does not have a device", before any kernel or
    fake), so that class is left to the public functions; so are the edge rows (the
    public functions run the same op on them)."""
    keep_none = ("alignment", "num_", "max_len", "experts")
    case.mutators = [m for m in case.mutators if m.cls != "edge" and not (
        m.cls == "none" and not any(k in m.label for k in keep_none))]
    return case


_ops = torch.ops.moe_fp8
CASES: List[OpCase] = [
    _pad_case(M.pad_token_groups, "public"),
    raw(_pad_case(_ops.pad_token_groups, "op")),
    _unpad_case(M.unpad_token_groups, "public"),
    raw(_unpad_case(_ops.unpad_token_groups, "op")),
    raw(_pad_at_case()),
    _padded_offsets_case(M.padded_group_offsets, "public"),
    raw(_padded_offsets_case(_ops.padded_group_offsets, "op")),
    _permute_case(M.permute_indices, "public"),
    raw(_permute_case(_ops.permute_indices, "op")),
    _gather_case(M.gather_rows, "public"),
    raw(_gather_case(_ops.gather_rows, "op")),
    _scatter_case(M.scatter_rows, "public"),
    raw(_scatter_case(_ops.scatter_rows, "op")),
    _zero_rows_case(M.zero_rows_past_groups_, "public"),
    raw(_zero_rows_case(_zero_rows_op, "op")),
    _permute_and_pad_case(),
    _scatter_case(M.unpermute, "", name="unpermute", num="num_tokens", also=("scatter_rows", "gather_rows")),
] + _quant_cases() + _blockwise_cases()


# ---- running one case -------------------------------------------------------------------


def _to_cpu(v):
    if isinstance(v, torch.Tensor) and v.device.type != "meta":
        if v.dim() == 2 and v.stride(0) == 0:  # an expanded view: copy one row, not 2^31
            return v[:1].detach().cpu().expand(v.shape)
        return v.detach().cpu()
    return v


def _flatten(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    return [out]


def _same(got, want, shapes_only):
    """Every element equal (bytes, so NaN codes and -0 count), or on meta the shapes,
    dtypes and strides' contiguity."""
    g, w = _flatten(got), _flatten(want)
    if len(g) != len(w):
        return False
    for a, b in zip(g, w):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return False
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if shapes_only:
            continue
        a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
        if a.numel() and not torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)):
            return False
    return True


def _clear(case, err):
    msg = str(err)
    names = (case.name,) + case.also_named
    return isinstance(err, (RuntimeError, ValueError, TypeError)) and any(n in msg for n in names) and (
        "expected" in msg.lower()
    )


def classify(case: OpCase, mut: Mut, device: str) -> Tuple[str, str]:
    """(outcome, detail): clear (a bad input refused with a clear message), correct (a
    valid input, equal to the reference), vague (refused, unclear message), wrong
    (a bad input accepted, or a result that differs), refused (a valid input
    refused), clamped (bad index content on a GPU without MOE_FP8_DEBUG=1: the
    kernels clamp, DESIGN §3)."""
    args = mut.apply(case.build(device), device)
    poison(device)
    try:
        out = case.fn(*args.values())
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (the classification is the point)
        detail = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if mut.valid:
            return "refused", detail
        return ("clear" if _clear(case, e) else "vague"), detail
    if not mut.valid:
        if mut.content and device != "cpu" and not DEBUG:
            return "clamped", "returned (GPU, no MOE_FP8_DEBUG)"
        return "wrong", "returned a result for a bad input"
    cpu_args = {k: _to_cpu(v) for k, v in args.items()}
    shapes_only = any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in cpu_args.values())
    if shapes_only:  # the fake's shapes against the reference of the same valid call on CPU
        cpu_args = case.build("cpu")
    expected = mut.expect(cpu_args) if mut.expect else case.reference(cpu_args)
    return ("correct", "") if _same(out, expected, shapes_only) else ("wrong", "differs from the reference")


def _params(device):
    out = []
    for case in CASES:
        for mut in case.mutators:
            if device not in mut.devices:
                continue
            if mut.cls == "device" and not HAS_CUDA:
                continue
            marks = [pytest.mark.gpu] if device == "cuda" else []
            out.append(pytest.param(case, mut, device, id=f"{device}-{case.id}-{mut.cls}-{mut.label}", marks=marks))
    return out


PARAMS = _params("cpu") + (_params("cuda") if HAS_CUDA else [])


@pytest.mark.parametrize("case, mut, device", PARAMS)
def test_input_contract(case, mut, device):
    outcome, detail = classify(case, mut, device)
    OUTCOMES[outcome] += 1
    BY_CLASS[(device, mut.cls)][outcome] += 1
    if outcome not in ("clear", "correct", "clamped"):
        BAD.append(f"{outcome:8s} {device} {case.id}: {mut.label}: {detail}")
    assert outcome in ("clear", "correct", "clamped"), f"{outcome}: {detail}"


def summary_lines():
    lines = ["input contract outcomes: " + ", ".join(f"{k}={OUTCOMES[k]}" for k in
                                                     ("clear", "correct", "vague", "wrong", "refused", "clamped"))]
    for (device, cls), c in sorted(BY_CLASS.items()):
        lines.append(f"  {device:4s} {cls:8s} " + " ".join(f"{k}={v}" for k, v in sorted(c.items())))
    lines += ["  " + b for b in BAD]
    return lines


@pytest.fixture(scope="module", autouse=True)
def _contract_summary(request):
    """Prints the outcome counts after the module's tests (through the terminal
    reporter, so they show without -s); also to $MOE_FP8_CONTRACT_SUMMARY if set."""
    yield
    if not sum(OUTCOMES.values()):
        return
    text = "\n".join(summary_lines())
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\n" + text)
    else:
        print(text)
    path = os.environ.get("MOE_FP8_CONTRACT_SUMMARY")
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
