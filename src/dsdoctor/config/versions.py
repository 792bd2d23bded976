"""Installed versions of DeepSpeed, transformers and accelerate, read from package metadata (no import: check
stays torch-free), or given on the command line to check a config for another machine."""
from __future__ import annotations

import re
from dataclasses import dataclass

from dsdoctor.units import version

PACKAGES = ("deepspeed", "transformers", "accelerate")

# Where behaviour changed (each read in the project's source or PR, see the findings that use them).
TRANSFORMERS_INT_PREFETCH = (4, 45, 0)  # transformers PR #33402: int(0.9*h*h)
ACCELERATE_INT_PREFETCH = (0, 31, 0)  # accelerate PR #2814
DEEPSPEED_PYDANTIC_V2 = (0, 15, 0)  # pydantic v2 config models: a fractional float for an int field is refused
DEEPSPEED_AUTOTP_ZERO3 = (0, 19, 4)  # PR #8167: AutoTP with ZeRO-3 accepted
DEEPSPEED_PIN_TRUE_KNOWN = (0, 19, 8)  # offload pin_memory defaults to true (PR #8207, August 2026) from here on
DEEPSPEED_PIN_FALSE_BEFORE = (0, 19, 4)  # releases up to and including 0.19.3 still default to false
# How from_pretrained loads a checkpoint (read in each release's modeling_utils.py; plan/loading.py uses them):
TRANSFORMERS_META_LOAD = (4, 51, 0)  # 4.50.0 still defaults low_cpu_mem_usage to False without a device_map (a full
# CPU copy of every weight per process); 4.51.0 pops the argument ("Not used anymore") and always builds on meta
TRANSFORMERS_FUSED_EXPERTS = (5, 0, 0)  # MoE experts as fused 3-D tensors (4.x: one module per expert)
TRANSFORMERS_DTYPE_KWARG = (4, 56, 0)  # from_pretrained(dtype=...); before it the keyword is torch_dtype
TRANSFORMERS_ZERO3_RANK0_READS = (5, 0, 0)  # under ZeRO-3 only rank 0 reads checkpoint tensors; 4.x: every rank
# calls load_state_dict(shard, map_location="cpu") for safetensors shards, one shard at a time


@dataclass
class Versions:
    values: dict  # package -> version string or None (not installed / unknown)
    sources: dict  # package -> "installed" | "--deepspeed-version" | ... | None

    def get(self, name: str) -> str | None:
        return self.values.get(name)

    def tuple(self, name: str) -> tuple | None:
        return version_tuple(self.values.get(name))

    def label(self, name: str) -> str:
        v = self.values.get(name)
        if v is None:
            return "(not installed)"
        return v + (" (installed)" if self.sources.get(name) == "installed" else "")

    def to_dict(self) -> dict:
        return {n: {"version": self.values.get(n), "source": self.sources.get(n)} for n in PACKAGES}


def version_tuple(text: str | None) -> tuple | None:
    if not text:
        return None
    m = re.match(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", str(text))
    if not m:
        return None
    return tuple(int(x or 0) for x in m.groups())


def _dist_info_versions() -> dict[str, str]:
    """name -> version from the ``NAME-VERSION.dist-info`` folders on sys.path (first one wins, as for imports).
    One directory listing per path entry: importlib.metadata.version() scans every distribution, about 80 ms a
    package in a full environment, and check must stay fast."""
    import os
    import sys

    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for n in names:
            if n.endswith((".dist-info", ".egg-info")) and "-" in n:
                dist, _, rest = n.rpartition(".")[0].partition("-")
                key = dist.lower().replace("_", "-")
                if key in PACKAGES and key not in found:
                    found[key] = rest.split("-")[0]
    return found


def installed(name: str, _cache: dict = {}) -> str | None:  # noqa: B006 - a per-process cache
    """The installed version of the distribution ``name``, or None: the one reader of installed versions
    (``check``'s version rules, ``env``, ``calibrate``'s profile)."""
    if "all" not in _cache:
        _cache["all"] = _dist_info_versions()
    if name in _cache["all"]:
        return _cache["all"][name]
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    except Exception:  # a broken dist-info is "unknown", not a crash
        return None


def resolve_versions(overrides: dict | None = None) -> Versions:
    """Installed versions, with ``overrides`` ({"deepspeed": "0.15.0", ...}) taking their place."""
    values, sources = {}, {}
    for name in PACKAGES:
        given = (overrides or {}).get(name)
        if given is not None:
            values[name], sources[name] = version(given, f"--{name}-version"), f"--{name}-version"
        else:
            v = installed(name)
            values[name], sources[name] = v, "installed" if v else None
    return Versions(values, sources)
