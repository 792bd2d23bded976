"""Byte sizes: parse '80GiB', '5GB', '1.5e9'; print 12.3 GiB, 7.07B (a count), 1.25s, 0.31 (a rate)."""
from __future__ import annotations

import re

from dsdoctor.errors import InputError, printable

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


MAX_BYTES = 2**60  # 1 EiB: past any memory, disk or bandwidth a flag could describe


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise InputError(f"{what} must not be negative: {text}")
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise InputError(f"{what} {printable(repr(text))[:60]} is not a size like 80GiB, 80GB or 5e9")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not value <= MAX_BYTES:  # 1e400 reads as infinity, NaN compares false
        raise InputError(f"{what} {printable(str(text))[:60]} is larger than any machine has ({MAX_BYTES} bytes)")
    return int(value)


def human_bytes(n: float | int | None) -> str:
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n:.1f} TiB"


def human_count(n: float | int | None) -> str:
    if n is None:
        return "-"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return str(int(n))


def human_seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def human_rate(v: float, decimals: int = 0) -> str:
    """A rate (tokens/s) with the digits it has: ``decimals`` places from 10^(1 - decimals) up (270, or 270.1
    with one decimal), two significant digits below (0.31, never "0" for a third of a token a second)."""
    return f"{v:.{decimals}f}" if abs(v) >= 10 ** (1 - decimals) else f"{v:.2g}"


def human_age(seconds: float | None) -> str:
    """How long ago, roughly: 40 min, 5 h, 3 days ("?" when unknown)."""
    if seconds is None:
        return "?"
    if seconds < 3600:
        return f"{max(seconds, 0) / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"
