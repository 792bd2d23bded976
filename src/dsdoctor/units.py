"""The one bounded reader of numbers and versions from flags, job files and launch lines (``number``,
``version``); byte sizes: parse '80GiB', '5GB', '1.5e9'; print 12.3 GiB, 7.07B (a count), 1.25s, 0.31 (a rate)."""
from __future__ import annotations

import math
import re

from dsdoctor.errors import InputError, printable

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


# Bounds far beyond any real run (past them the arithmetic describes nothing): every reader of these asks here.
MAX_GPUS = 512  # a plan is for one model-parallel group; past this the tp/ZeRO arithmetic only burns time
MAX_BATCH = 1 << 20
MAX_TOKENS = 1 << 24
MAX_SECONDS = 30 * 86400  # a timeout or a time budget


def _plain(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _shown(value) -> str:
    return printable(repr(value))[:40]


def number(value, what: str, *, low: float = 0, high: float, whole: bool = True, path=None) -> int | float:
    """``value`` (an int, a float or its text) as a finite number in [low, high], an int when ``whole``: every
    number from a flag, a job file or a launch line is read here. Anything else (a bool, NaN, ``1e400``, a
    fraction where a count is asked, out of range) is one InputError naming ``what`` (and ``path``)."""
    v = value
    if isinstance(v, str):
        text = v.strip()
        try:
            v = int(text) if re.fullmatch(r"[+-]?\d{1,30}", text) else float(text[:400])
        except ValueError:
            raise InputError(f"{what} must be a number, not {_shown(value)}", path=path) from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"{what} must be a number, not {_shown(value)}", path=path)
    if not math.isfinite(v):
        raise InputError(f"{what} must be a finite number, not {_shown(value)}", path=path)
    if whole and v != int(v):
        raise InputError(f"{what} must be a whole number, not {_shown(value)}", path=path)
    if not low <= v <= high:
        raise InputError(f"{what} is {_shown(value)}; it must be between {_plain(low)} and {_plain(high)}", path=path)
    return int(v) if whole else float(v)


_VERSION = re.compile(r"v?\d{1,4}(?:\.\d{1,6}){0,3}(?:\.?(?:a|b|rc|dev|post)\d{0,6})*(?:\+[A-Za-z0-9.]{1,32})?")


def version(text, what: str = "version", path=None) -> str:
    """A release number such as ``4.44.2`` (``0.15.0rc1``, ``2.5.1+cu121``): at most 64 characters, digits,
    dots and the usual release suffixes only; else one InputError naming ``what``."""
    if not isinstance(text, str) or len(text) > 64 or not _VERSION.fullmatch(text.strip()):
        raise InputError(f"{what} must look like 4.44.2, not {_shown(text)}", path=path)
    return text.strip()


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
