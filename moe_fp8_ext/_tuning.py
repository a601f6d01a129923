"""Private tuning overrides, for tests and sweeps; not API (docs/TUNING.md).

Each knob replaces one launch choice of the C++ library, process-wide, with the string
syntax of the table in docs/TUNING.md; ``None`` means unset (the library's own choice).
Every valid setting gives the same bits; only the speed changes.

    with override(cols_plan="2,256"):
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from moe_fp8_ext import _C

KNOBS = ("cols_plan", "cols_block_plan", "rows_gather", "rows_runs", "rows_dynamic", "dual_l2_bytes")


def get(name: str) -> str | None:
    """The value of knob ``name``, or None where unset."""
    return _C._get_tuning(name)


@contextlib.contextmanager
def override(**knobs: str | int | None) -> Iterator[None]:
    """Set the given knobs (None unsets one) for the body; the previous values come back on exit."""
    for name in knobs:
        if name not in KNOBS:
            raise ValueError(f"moe_fp8_ext._tuning.override: expected one of {', '.join(KNOBS)}, got {name!r}")
    previous: dict[str, str | None] = {}
    try:
        for name, value in knobs.items():
            previous[name] = _C._set_tuning(name, None if value is None else str(value))
        yield
    finally:
        for name, value in previous.items():
            _C._set_tuning(name, value)
