"""The machine profile ``dsdoctor calibrate`` writes and ``plan``/``diagnose`` read: measured figures of one
machine, keyed by a fingerprint of its hardware. Torch-free (``plan`` must not import torch).

Schema (``"schema": "dsdoctor-machine-profile/1"``):
  fingerprint   sha256 prefix of the hardware description below (what a cache file is named by)
  machine       cpu_model, cpu_count, host_memory_gib, gpus: [{name, memory_mib}]; host: a hash of the host name
                (not in the fingerprint: two hosts of one kind share it, not their speed; calibrate/recheck.py)
  software      torch, transformers, deepspeed, cuda (information, not part of the fingerprint)
  calibrated_at ISO-8601 UTC; duration_s
  measured      figure name -> number (bytes/s, seconds, FLOP/s, bytes); see FIGURES
  not_measured  figure name -> why (no GPU, one GPU, no nvme_path, DeepSpeed missing, ...)
  runs          memory runs ``plan --measure`` made here (``RUN_KEYS``): plan's band for this machine (plan/band.py)
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.errors import InputError, one_line
from dsdoctor.machine import meminfo, nvidia_smi_gpus

SCHEMA = "dsdoctor-machine-profile/1"

# figure -> (unit, what it is). Every figure the speed and memory models read.
FIGURES = {
    "h2d_pinned": ("B/s", "host-to-device copy from pinned memory"),
    "h2d_pageable": ("B/s", "host-to-device copy from pageable memory"),
    "d2h_pinned": ("B/s", "device-to-host copy to pinned memory"),
    "d2h_pageable": ("B/s", "device-to-host copy to pageable memory"),
    "h2d_latency_s": ("s", "one small pinned host-to-device copy"),
    "hbm_copy": ("B/s", "device memory copy (read + write)"),
    "hbm_weight_read": ("B/s", "weight bytes read per second by a batch-1 matmul (decode)"),
    "matmul_flops": ("FLOP/s", "bf16 matmul, prefill-like shape"),
    "matmul_flops_square": ("FLOP/s", "bf16 matmul 8192^3"),
    "attention_flops": ("FLOP/s", "causal SDPA at a prefill shape"),
    "eager_layer_s": ("s", "eager decoder layer, batch 1, negligible arithmetic"),
    "eager_token_s": ("s", "generate's per-token work outside the layers, batch 1"),
    "eager_layer_s_b16": ("s", "eager decoder layer at batch 16"),
    "eager_layer_s_b64": ("s", "eager decoder layer at batch 64"),
    "eager_token_s_b16": ("s", "generate's per-token work at batch 16"),
    "eager_token_s_b64": ("s", "generate's per-token work at batch 64"),
    "zero3_module_s": ("s", "ZeRO-3 fetch/release hooks per module and forward, one GPU"),
    "zero3_offload_module_s": ("s", "the same with offload_param (pinned), beyond the bytes copied"),
    "allgather_bus_bw": ("B/s", "NCCL all-gather bus bandwidth, large messages"),
    "allgather_latency_s": ("s", "NCCL all-gather of a small message"),
    "allreduce_bus_bw": ("B/s", "NCCL all-reduce bus bandwidth, large messages"),
    "allreduce_latency_s": ("s", "NCCL all-reduce of a small message"),
    "autotp_allreduce_s": ("s", "deepspeed.comm inference all-reduce of one decode step's hidden states"),
    "nvme_read": ("B/s", "sequential read of a file under nvme_path"),
    "context_bytes": ("B", "device memory used outside the caching allocator (CUDA context, cuBLAS)"),
    "host_memcpy": ("B/s", "host memory copy"),
    "cpu_matmul_flops": ("FLOP/s", "fp32 matmul on the CPU"),
}

# what a measurement of real hardware can be, per unit: a figure outside is a damaged or crafted profile (a
# bandwidth of 0 or 1e-300 B/s would make every plan divide by it)
PLAUSIBLE = {"B/s": (1e5, 1e16), "s": (0.0, 3600.0), "FLOP/s": (1e6, 1e19), "B": (0.0, 2.0**50)}


def machine_description(gpus=None) -> dict:
    """What the fingerprint hashes: hardware only, read without torch."""
    cpu = platform.processor() or ""
    for line in (door.read_proc("/proc/cpuinfo") or b"").decode("ascii", "replace").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    if gpus is None:
        gpus = [{"name": g.name, "memory_mib": g.total_bytes // 2**20} for g in nvidia_smi_gpus(respect_visible=False)]
    mem = meminfo().get("MemTotal", 0)
    return {"cpu_model": cpu, "cpu_count": os.cpu_count(), "host_memory_gib": round(mem / 2**30), "gpus": gpus}


def fingerprint(machine: dict) -> str:
    text = json.dumps({k: machine.get(k) for k in ("cpu_model", "cpu_count", "host_memory_gib", "gpus")},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("DSDOCTOR_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "dsdoctor" if xdg else Path.home() / ".cache" / "dsdoctor"


def cache_path(fp: str) -> Path:
    return cache_dir() / f"machine-{fp}.json"


# one run of ``plan --measure``: the path and shape it ran, plan's figures and what the GPU measured
RUN_KEYS = {"path": str, "family": str, "shape": str, "model_type": str, "batch": int, "prompt_len": int,
            "new_tokens": int, "gpu": str, "gpu_memory": int, "cap_bytes": int, "observed": str, "date": str,
            "predicted": dict, "measured": dict, "first_tokens_per_s": float, "steady_tokens_per_s": float}
RUN_OBSERVED = ("fits", "oom")
MAX_RUNS = 200


def _valid_run(r) -> bool:
    if not isinstance(r, dict) or r.get("observed") not in RUN_OBSERVED:
        return False
    for k, t in RUN_KEYS.items():
        v = r.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float) if t is float else t)):
            return False
    figures = [(r.get(part) or {}).get(k) for part in ("predicted", "measured") for k in ("allocated", "reserved")]
    return all(isinstance(r.get(k), str) for k in ("path", "family", "shape")) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**50 for v in figures)


def _runs(value, where: str) -> list:
    """The ``runs`` of a profile, checked: a damaged or crafted one is refused, not half read."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_RUNS:
        raise InputError(f"{where}: 'runs' must be a list of at most {MAX_RUNS} measured runs")
    for i, r in enumerate(value):
        if not _valid_run(r):
            raise InputError(f"{where}: runs[{i}] is not a run plan --measure recorded (path, family, shape, observed "
                             f"{' or '.join(RUN_OBSERVED)}, predicted and measured allocated and reserved bytes)")
    return value


@dataclass
class MachineProfile:
    fingerprint: str
    machine: dict
    calibrated_at: str
    measured: dict
    not_measured: dict = field(default_factory=dict)
    software: dict = field(default_factory=dict)
    duration_s: float | None = None
    source: str | None = None  # the file it was read from
    runs: list = field(default_factory=list)  # memory runs plan --measure made here (RUN_KEYS)

    def get(self, name: str, default=None):
        v = self.measured.get(name)
        return default if v is None else v

    @property
    def date(self) -> str:
        return (self.calibrated_at or "")[:10]

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "fingerprint": self.fingerprint, "machine": self.machine,
                "software": self.software, "calibrated_at": self.calibrated_at, "duration_s": self.duration_s,
                "measured": self.measured, "not_measured": self.not_measured,
                **({"runs": self.runs} if self.runs else {})}

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> MachineProfile:
        where = source or "machine profile"
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise InputError(f"{where}: not a dsdoctor machine profile (schema {SCHEMA!r} expected)",
                             hint="write one with: dsdoctor calibrate --out FILE")
        measured = d.get("measured")
        if not isinstance(measured, dict):
            raise InputError(f"{where}: 'measured' must be an object of figures")
        clean = {}
        for k, v in measured.items():
            if k not in FIGURES:
                continue  # a newer dsdoctor's figure: ignore, do not fail
            if v is None:
                continue
            low, high = PLAUSIBLE[FIGURES[k][0]]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
                raise InputError(f"{where}: measured.{k} must be a number from {low:g} to {high:g} "
                                 f"{FIGURES[k][0]}, not {one_line(repr(v), 40)}")
            clean[k] = float(v)
        not_measured = d.get("not_measured") or {}
        if not isinstance(not_measured, dict):
            raise InputError(f"{where}: 'not_measured' must be an object")
        machine = d.get("machine") or {}
        if not isinstance(machine, dict):
            raise InputError(f"{where}: 'machine' must be an object")
        fp = d.get("fingerprint") or fingerprint(machine)
        return cls(str(fp), machine, str(d.get("calibrated_at") or ""), clean,
                   {str(k): str(v) for k, v in not_measured.items()}, d.get("software") or {}, d.get("duration_s"),
                   source, _runs(d.get("runs"), where))


def load_profile(path) -> MachineProfile:
    """A machine profile file (``plan --machine FILE``, or the cache): a bounded regular file (a FIFO or
    ``/dev/zero`` is refused at once), UTF-8 JSON of bounded depth, in the profile schema."""
    p = Path(path)
    text = door.read_text(p, door.MACHINE_PROFILE)
    door.json_bound(text, p, door.MACHINE_PROFILE)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InputError(f"{p}: machine profile is not valid JSON: {exc}") from None
    except RecursionError:
        raise InputError(f"{p}: machine profile is nested too deeply") from None
    door.check_tree(data, p, door.MACHINE_PROFILE)
    return MachineProfile.from_dict(data, str(p))


def profile_text(profile: MachineProfile) -> str:
    return json.dumps(profile.to_dict(), indent=2) + "\n"


def save_profile(profile: MachineProfile, path) -> Path:
    """Write the per-machine cache file atomically (a reader never sees half a profile)."""
    return door.write_cache_file(path, profile_text(profile))


def write_profile(profile: MachineProfile, path, force: bool = False) -> Path:
    """Write ``calibrate --out FILE``: a new file, or with ``force`` a regular file that is replaced."""
    return door.atomic_write_text(path, profile_text(profile), force=force, create_parent=True)


def find_profile(machine: dict | None = None) -> MachineProfile | None:
    """The cached profile of this machine (same fingerprint), or None. A damaged cache file is ignored with
    a warning on stderr (``dsdoctor calibrate`` rewrites it): it must not break every plan on the machine."""
    fp = fingerprint(machine or machine_description())
    p = cache_path(fp)
    if not os.path.lexists(p):
        return None
    try:
        prof = load_profile(p)
    except (InputError, ValueError, TypeError, AttributeError) as exc:
        why = exc.one_line() if isinstance(exc, InputError) else f"{type(exc).__name__}: {exc}"
        print(f"dsdoctor: warning: ignoring the cached machine profile ({one_line(why, 300)}); "
              "dsdoctor calibrate rewrites it", file=sys.stderr)
        return None
    return prof if prof.fingerprint == fp else None
