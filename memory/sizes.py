"""Human-facing byte sizes: "512MB", "1.5GiB", "4096".

A bare number is bytes; kB/MB/GB/TB are powers of 1000 and KiB/MiB/GiB/TiB powers of
1024 (``K``, ``M``, ``G`` alone are read as the decimal units, a bare ``B`` as bytes).
"""

from __future__ import annotations

import math
import re

from memory.errors import MemoryPlanError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(
    r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*$"
)


def parse_bytes(
    text: str | int | float, *, what: str = "size", allow_zero: bool = False
) -> int:
    """Bytes in a size such as ``"512MB"``, ``"1.5GiB"`` or ``4096``.

    Args:
        text: the size; ints are bytes.
        what: the name of the setting, for the error message.
        allow_zero: accept 0 (a disk budget of 0 forbids offload).

    Raises:
        MemoryPlanError: unparsable, negative, zero (unless allowed), or not a whole
            number of bytes.
    """
    fix = 'use a number of bytes or a size with a unit, e.g. "512MB" or "1.5GiB"'
    if isinstance(text, bool):
        raise MemoryPlanError(f"{what} {text!r} is not a size; {fix}")
    if isinstance(text, int | float):
        if isinstance(text, float) and not math.isfinite(text):
            raise MemoryPlanError(f"{what} {text!r} is not a finite size; {fix}")
        try:
            value = float(text)
        except OverflowError:
            raise MemoryPlanError(f"{what} {text!r} is too large") from None
    elif isinstance(text, str):
        stripped = text.strip()
        if stripped.startswith("-"):
            raise MemoryPlanError(f"{what} {text!r} is negative; {fix}")
        m = _SIZE.match(stripped)
        unit = m.group(3).lower() if m else None
        if not m or unit not in _UNITS:
            raise MemoryPlanError(f"cannot parse {what} {text!r}; {fix}")
        # float() of the whole literal: 10 ** int(exponent) would build a huge
        # integer for an exponent such as "1e999999999"; float() gives inf at once.
        value = float(f"{m.group(1)}e{m.group(2) or 0}") * _UNITS[unit]
    else:
        raise MemoryPlanError(f"{what} {text!r} is not a size; {fix}")
    if value < 0:
        raise MemoryPlanError(f"{what} {text!r} is negative; {fix}")
    if not math.isfinite(value):
        raise MemoryPlanError(f"{what} {text!r} is too large")
    if value != int(value):
        raise MemoryPlanError(f"{what} {text!r} is not a whole number of bytes")
    if value == 0 and not allow_zero:
        raise MemoryPlanError(f"{what} must be greater than zero, got {text!r}; {fix}")
    return int(value)


def format_bytes(n: int | float) -> str:
    """A short binary-unit rendering: ``format_bytes(3 * 2**30) == "3.00 GiB"``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"
