"""The measured band of plan's memory figures: measured / predicted over the archived GPU runs, per path family.

``band.json`` beside this module is data, with its provenance (runs, GPUs, dates, count), recomputed by
``scripts/band.py`` from every archived GPU run a bench re-estimates (``scripts/guard.py`` ``REESTIMATES``);
``summarize`` is the one computation, shared by that script and by the runs ``plan --measure`` adds to a
machine profile. Plan's upper figure is the prediction times the band's worst case (never below the
prediction); the fit verdict is "fits" when the upper figure fits, "edge" when only the prediction does.

Which band a path gets (``Bands.for_path``), first that applies: runs of this exact shape measured on this
machine (``plan --measure``); this machine's runs of the family, once it holds ``MIN_HERE`` of them; the
archived family; else "unmeasured": the widest archived band (never optimistic).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from dsdoctor import door

FIGURES = ("allocated", "reserved")
MIN_HERE = 3  # this machine's runs of a family that replace the archived band for it
DATA = Path(__file__).with_name("band.json")


def family(path: str) -> str:
    """The path family a band is kept for: tp groups (``tp2x4``) are tp; every other path is its own."""
    return "tp" if path.startswith("tp") else path


def shape_key(model: dict, path: str, batch: int, prompt_len: int, new_tokens: int, gpus: int, dtype: str) -> str:
    """What identifies one measured run's shape: the model's config, the path and the workload."""
    text = json.dumps([model, path, batch, prompt_len, new_tokens, gpus, dtype], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def summarize(rows: list[dict]) -> dict:
    """Per family and figure: the count, the lowest and highest measured / predicted, and where the runs come
    from. A row: ``family``, ``figure``, ``predicted``, ``measured`` (bytes), ``run``, ``gpu``, ``date``; with
    ``bound`` "at least", ``measured`` is only a lower bound (a capped run that ran out of memory needed more
    than its cap): it can raise the worst case, never the low end (``bounds`` counts them)."""
    out: dict = {}
    for r in rows:
        if not r.get("predicted") or not r.get("measured"):
            continue
        ratio = r["measured"] / r["predicted"]
        b = out.setdefault(r["family"], {}).setdefault(r["figure"], {"n": 0, "low": None, "high": ratio,
                                                                      "runs": [], "gpus": [], "dates": []})
        b["n"] += 1
        b["high"] = max(b["high"], ratio)
        if r.get("bound") == "at least":
            b["bounds"] = b.get("bounds", 0) + 1
        else:
            b["low"] = ratio if b["low"] is None else min(b["low"], ratio)
        for key, value in (("runs", r.get("run")), ("gpus", r.get("gpu")), ("dates", r.get("date"))):
            if value and value not in b[key]:
                b[key] = sorted([*b[key], value])
    for figures in out.values():
        for b in figures.values():
            b["low"], b["high"] = _rounded(b["high"] if b["low"] is None else b["low"], b["high"])
    return {f: out[f] for f in sorted(out)}


def _rounded(low: float, high: float) -> tuple[float, float]:
    """Four decimals, outwards: the worst case is never rounded below what was measured."""
    return math.floor(round(low * 1e4, 6)) / 1e4, math.ceil(round(high * 1e4, 6)) / 1e4


@dataclass(frozen=True)
class Band:
    low: float  # measured / predicted, lowest
    high: float  # and highest: the worst case
    n: int
    source: str  # archived | here (this machine's runs) | exact (this shape, measured here) | unmeasured | pool
    # (pool: a serving engine's reserved, the share of the GPU it is told to take)

    def upper(self, predicted: int) -> int:
        """The prediction times the worst case, never below the prediction."""
        return math.ceil(predicted * max(self.high, 1.0))

    def to_dict(self) -> dict:
        return {"low": self.low, "high": self.high, "n": self.n, "source": self.source}


def _band(entry: dict, source: str) -> Band:
    return Band(float(entry["low"]), float(entry["high"]), int(entry["n"]), source)


def archived() -> dict:
    """The package's band data (``band.json``)."""
    return json.loads(door.read_text(DATA, door.PACKAGE_DATA))


class Bands:
    """The bands one plan uses: the archived data, this machine's runs (a profile's ``runs``), this shape."""

    def __init__(self, data: dict, runs: list | None = None, shape: dict | None = None):
        self.families = data.get("families", {})
        self.runs = runs or []
        self.shape = shape  # model, batch, prompt_len, new_tokens, gpus, dtype: for runs of this exact shape
        self.widest = {fig: Band(min((f[fig]["low"] for f in self.families.values() if fig in f), default=1.0),
                                 max((f[fig]["high"] for f in self.families.values() if fig in f), default=1.0),
                                 0, "unmeasured") for fig in FIGURES}

    def for_path(self, name: str) -> dict:
        fam = family(name)
        key = shape_key(path=name, **self.shape) if self.shape else None
        exact = [r for r in self.runs if r.get("shape") == key and r.get("path") == name]
        here = [r for r in self.runs if r.get("family") == fam and r.get("observed") == "fits"]
        bands = {}
        for fig in FIGURES:
            if exact:
                bands[fig] = _exact(exact, fig)
            elif len(here) >= MIN_HERE:
                bands[fig] = _band(summarize(_rows(here))[fam][fig], "here")
            elif fig in self.families.get(fam, {}):
                bands[fig] = _band(self.families[fam][fig], "archived")
            else:
                bands[fig] = self.widest[fig]
        return bands


def _rows(runs: list) -> list[dict]:
    return [{"family": r["family"], "figure": fig, "predicted": r["predicted"][fig], "measured": r["measured"][fig]}
            for r in runs for fig in FIGURES]


def _exact(runs: list, fig: str) -> Band:
    """This shape measured here: the band of its finished runs; a run that ran out of memory under a cap shows
    the path needs more than that cap, so the worst case rises above it."""
    ratios = [r["measured"][fig] / r["predicted"][fig] for r in runs if r.get("observed") == "fits"]
    for r in runs:
        if r.get("observed") == "oom" and fig == "reserved" and r.get("cap_bytes"):
            ratios.append((r["cap_bytes"] + 1) / r["predicted"][fig])
    if not ratios:
        return Band(1.0, 1.0, 0, "exact")
    return Band(*_rounded(min(ratios), max(ratios)), len(runs), "exact")


def load_bands(profile, shape: dict | None) -> Bands:
    """The bands of one plan: the package's data, the profile's runs (``plan --measure``), the planned shape."""
    runs = list(getattr(profile, "runs", None) or [])
    return Bands(archived(), runs, shape)
