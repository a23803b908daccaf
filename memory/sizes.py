"""Human-facing byte sizes: "512MB", "1.5GiB", "4096".

A bare number is bytes; kB/MB/GB/TB are powers of 1000 and KiB/MiB/GiB/TiB powers of
1024 (``K``, ``M``, ``G`` alone are read as the decimal units, a bare ``B`` as bytes).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

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
#: The largest size accepted (2**80 bytes, about 1.2e24): anything larger is a typo,
#: and keeping sizes bounded keeps the exact arithmetic below cheap.
MAX_BYTES = 2**80
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
    too_large = f"{what} {text!r} is too large (the largest size is 2**80 bytes)"
    value: Fraction
    if isinstance(text, int):
        value = Fraction(text)
    elif isinstance(text, float):
        if not math.isfinite(text):
            raise MemoryPlanError(f"{what} {text!r} is not a finite size; {fix}")
        value = Fraction(text)
    elif isinstance(text, str):
        stripped = text.strip()
        if stripped.startswith("-"):
            raise MemoryPlanError(f"{what} {text!r} is negative; {fix}")
        m = _SIZE.match(stripped)
        unit = m.group(3).lower() if m else None
        if not m or unit not in _UNITS:
            raise MemoryPlanError(f"cannot parse {what} {text!r}; {fix}")
        value = _exact(m.group(1), m.group(2), too_large) * _UNITS[unit]
    else:
        raise MemoryPlanError(f"{what} {text!r} is not a size; {fix}")
    if value < 0:
        raise MemoryPlanError(f"{what} {text!r} is negative; {fix}")
    if value > MAX_BYTES:
        raise MemoryPlanError(too_large)
    if value.denominator != 1:
        raise MemoryPlanError(f"{what} {text!r} is not a whole number of bytes")
    if value == 0 and not allow_zero:
        raise MemoryPlanError(f"{what} must be greater than zero, got {text!r}; {fix}")
    return int(value)


def _exact(mantissa: str, exponent: str | None, too_large: str) -> Fraction:
    """The exact value of ``mantissa`` x 10**``exponent`` (decimal digits, no sign).

    Sizes are exact: a float would turn "72057594037929kB" into 72057594037928992.
    The exponent is bounded before any power is built, so "1e999999999" is refused
    at once instead of building a billion-digit integer.
    """
    digits = mantissa.replace(".", "")
    if not digits.strip("0"):
        return Fraction(0)
    whole = mantissa.split(".")[0].lstrip("0")
    # the decimal exponent of the leading digit bounds the magnitude
    try:
        exp = int(exponent or 0)
    except ValueError:  # more digits than int() converts
        exp = -(10**9) if exponent and exponent.startswith("-") else 10**9
    if whole:
        magnitude = exp + len(whole) - 1
    else:
        fraction = mantissa.split(".")[1]
        magnitude = exp - (len(fraction) - len(fraction.lstrip("0"))) - 1
    if magnitude > 30:  # >= 1e31 bytes before the unit: above MAX_BYTES
        raise MemoryPlanError(too_large)
    if magnitude < -len(digits) - 20:  # far below one byte: not whole, stays cheap
        return Fraction(1, 2)
    return Fraction(mantissa) * Fraction(10) ** exp


def format_bytes(n: int | float) -> str:
    """A short binary-unit rendering: ``format_bytes(3 * 2**30) == "3.00 GiB"``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"
