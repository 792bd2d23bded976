"""What merged weights must satisfy, one owner for ``verify`` and for every writer (``merge`` checks its own output
with these before it says ✓): names and shapes against the expected ones (DSD401-DSD404), values finite (DSD405)
and plausible (DSD413). The values are read from a buffer the caller already holds (a chunk being written), so a
writer checks in the same pass over the bytes it writes anyway."""
from __future__ import annotations

import math
import threading

from dsdoctor.findings import Finding, Phrase

# |x| above which a trained parameter is taken as damaged bytes, not a weight (DSD413 explains the choice);
# only parameters are checked, buffers may hold mask constants (-1e4, the dtype's minimum)
IMPLAUSIBLE_ABS = 1e4
# 16-bit floats: (sign-free bits of +inf, numpy's dtype); |x| orders as these bits do, NaN and Inf above
_HALF = {"bfloat16": (0x7F80, None), "float16": (0x7C00, "<f2")}
_WIDE = {"float32": "<f4", "float64": "<f8"}
_SLICE = 1 << 22


def names(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def scan(buf, dtype: str) -> float | None:
    """The largest |x| of little-endian ``dtype`` values in ``buf`` (inf when one is NaN or infinite), None for a
    dtype that is not a float. Reads the buffer twice at most (min and max carry NaN and infinities), no copy."""
    import numpy as np

    if dtype in _WIDE:
        a = np.frombuffer(buf, _WIDE[dtype])
        if not a.size:
            return 0.0
        lo, hi = float(a.min()), float(a.max())
        return max(-lo, hi) if math.isfinite(lo) and math.isfinite(hi) else math.inf
    if dtype not in _HALF:
        return None
    bits = np.frombuffer(buf, "<u2")  # the masked copy a bounded slice at a time
    top = max((int(np.bitwise_and(bits[i:i + _SLICE], 0x7FFF).max()) for i in range(0, bits.size, _SLICE)), default=0)
    inf, np_dtype = _HALF[dtype]
    if top >= inf:
        return math.inf
    if np_dtype is None:  # bfloat16: the upper half of a float32
        return float(np.array([top << 16], "<u4").view("<f4")[0])
    return float(np.array([top], "<u2").view(np_dtype)[0])


def tensor_bytes(t):
    """A torch tensor's bytes, for ``scan`` (a view: no copy of a contiguous tensor)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


class Values:
    """The largest |x| of each tensor, fed chunk by chunk (``look`` gives the feeder of one tensor), and the
    findings they make."""

    def __init__(self):
        self.peak: dict[str, float] = {}
        self._lock = threading.Lock()  # parts of one tensor are looked at on several threads

    def add(self, name: str, peak: float | None) -> None:
        if peak is not None:
            with self._lock:
                self.peak[name] = max(self.peak.get(name, 0.0), peak)

    def look(self, name: str, dtype: str):
        if dtype not in _WIDE and dtype not in _HALF:
            return None
        return lambda buf: self.add(name, scan(buf, dtype))

    def findings(self, parameters) -> list[Finding]:
        """DSD405 (NaN/Inf in any tensor), DSD413 (|x| past IMPLAUSIBLE_ABS in a parameter)."""
        out = []
        nonfinite = [n for n, p in self.peak.items() if p == math.inf]
        implausible = sorted(((p, n) for n, p in self.peak.items() if n in parameters and IMPLAUSIBLE_ABS < p < math.inf),
                             reverse=True)
        if nonfinite:
            out.append(Finding("DSD405", {"count": len(nonfinite), "names": names(sorted(nonfinite))}))
        if implausible:
            out.append(Finding("DSD413", {"count": len(implausible), "largest": f"{implausible[0][0]:.3g}",
                                          "worst": implausible[0][1], "limit": f"{IMPLAUSIBLE_ABS:g}",
                                          "names": names(sorted(n for _, n in implausible))}))
        return out


def names_and_shapes(found: dict[str, tuple], expected: dict[str, tuple], out_dir, tied_of=None, skip=(),
                     present_as=(), merge_hint=None) -> list[Finding]:
    """DSD401 (expected, not found: a tied partner or a name in ``present_as`` stands in), DSD402 (found, not
    expected, nor in ``skip``), DSD404 (empty where the expected shape is not; ``merge_hint()`` says where the
    checkpoint is), DSD403 (another shape)."""
    tied_of = tied_of or {}
    missing = [n for n in expected if n not in found and not any(m in found for m in tied_of.get(n, []))
               and n not in present_as]
    unexpected = sorted(n for n in found if n not in expected and n not in skip)
    out = []
    if missing:
        out.append(Finding("DSD401", {"count": len(missing), "out_dir": str(out_dir), "names": names(missing)}))
    if unexpected:
        out.append(Finding("DSD402", {"count": len(unexpected), "out_dir": str(out_dir), "names": names(unexpected)}))
    empty, mismatched = [], []
    for name, shape in found.items():
        want = expected.get(name)
        if want is None or tuple(shape) == tuple(want):
            continue
        if not math.prod(shape) and any(want):
            empty.append(name)
        else:
            mismatched.append(f"{name} {list(shape)} != {list(want)}")
    if empty:
        hint = merge_hint() if merge_hint is not None else Phrase("elsewhere")
        out.append(Finding("DSD404", {"count": len(empty), "names": names(empty), "merge": hint}))
    if mismatched:
        out.append(Finding("DSD403", {"count": len(mismatched), "details": names(mismatched, 3)}))
    return out
