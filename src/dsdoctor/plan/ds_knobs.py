"""The DeepSpeed config knobs that change an inference plan, from a config file or a plain dict.

The config doctor (``dsdoctor.config``) owns reading DeepSpeed configs; when it is installed this module
asks it for the effective settings. Without it, a small reader of the same keys is used, so ``plan
--config`` works on its own. Defaults are DeepSpeed 0.19.8's (``runtime/zero/config.py``).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from dsdoctor import inputs
from dsdoctor.errors import InputError

PREFETCH_BUCKET = 50_000_000
PERSISTENCE_THRESHOLD = 100_000
MAX_LIVE = 1_000_000_000
MAX_REUSE = 1_000_000_000
REDUCE_BUCKET = 500_000_000
NVME_BUFFER_COUNT = 5
NVME_BUFFER_SIZE = 100_000_000


@dataclass
class DsKnobs:
    zero_stage: int = 0
    offload_param: str | None = None  # None, "cpu", "nvme"
    offload_param_pin_memory: bool = True
    offload_optimizer: str | None = None
    has_optimizer: bool = False
    prefetch_bucket_size: int = PREFETCH_BUCKET
    param_persistence_threshold: int = PERSISTENCE_THRESHOLD
    max_live_parameters: int = MAX_LIVE
    max_reuse_distance: int = MAX_REUSE
    reduce_bucket_size: int = REDUCE_BUCKET
    nvme_buffer_count: int = NVME_BUFFER_COUNT
    nvme_buffer_size: int = NVME_BUFFER_SIZE
    source: str | None = None  # the config file, if any

    def to_dict(self) -> dict:
        return asdict(self)


def _eff(value):
    """The effective value of a config-doctor ``Value`` wrapper, or the value itself."""
    return getattr(value, "effective", value)


def _num(value, default):
    value = _eff(value)
    if value is None or value == "auto" or isinstance(value, bool):
        return default
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return default


def _device(value):
    value = _eff(value)
    if value in (None, "none", "auto", ""):
        return None
    return str(value)


def knobs_from_dict(knobs: dict, source: str | None = None) -> DsKnobs:
    """From a flat dict of knob names (the field names of ``DsKnobs``); unknown names raise."""
    unknown = set(knobs) - set(DsKnobs.__dataclass_fields__)
    if unknown:
        raise InputError(f"unknown plan knobs: {', '.join(sorted(unknown))}")
    out = DsKnobs(source=source)
    for key, value in knobs.items():
        setattr(out, key, value)
    return out


def knobs_from_effective(eff, source: str | None = None) -> DsKnobs:
    """From ``dsdoctor.config.effective.effective_settings(raw)`` (attribute names fixed by contract)."""
    op = getattr(eff, "offload_param", None)
    oo = getattr(eff, "offload_optimizer", None)
    stage = _num(getattr(eff, "zero_stage", 0), 0)
    return DsKnobs(
        zero_stage=stage,
        # DeepSpeed ignores offload_param below stage 3
        offload_param=_device(getattr(op, "device", None)) if op is not None and stage == 3 else None,
        offload_param_pin_memory=bool(_eff(getattr(op, "pin_memory", True))) if op is not None else True,
        offload_optimizer=_device(getattr(oo, "device", None)) if oo is not None else None,
        has_optimizer=bool(_eff(getattr(eff, "has_optimizer", False))),
        prefetch_bucket_size=_num(getattr(eff, "prefetch_bucket_size", None), PREFETCH_BUCKET),
        param_persistence_threshold=_num(getattr(eff, "param_persistence_threshold", None), PERSISTENCE_THRESHOLD),
        max_live_parameters=_num(getattr(eff, "max_live_parameters", None), MAX_LIVE),
        reduce_bucket_size=_num(getattr(eff, "reduce_bucket_size", None), REDUCE_BUCKET),
        source=source,
    )


def _pick(section: dict, *names, default=None):
    for n in names:
        if n in section:
            return section[n]
    return default


def knobs_from_ds_config(raw: dict, source: str | None = None) -> DsKnobs:
    """Minimal reader of a raw DeepSpeed config dict, with DeepSpeed's semantics for "auto"
    (dropped: the field keeps its default) and the accepted spellings."""
    if not isinstance(raw, dict):
        raise InputError("a DeepSpeed config must be a JSON object", path=source)
    zero = raw.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise InputError("zero_optimization must be an object", path=source)
    op = zero.get("offload_param") or {}
    oo = zero.get("offload_optimizer") or {}
    stage = _num(zero.get("stage"), 0)
    offload_param = _device(op.get("device")) if isinstance(op, dict) else None
    nvme_count = _num(op.get("buffer_count"), NVME_BUFFER_COUNT) if isinstance(op, dict) else NVME_BUFFER_COUNT
    nvme_size = _num(op.get("buffer_size"), NVME_BUFFER_SIZE) if isinstance(op, dict) else NVME_BUFFER_SIZE
    pin = op.get("pin_memory", True) if isinstance(op, dict) else True
    return DsKnobs(
        zero_stage=stage,
        offload_param=offload_param if stage == 3 else None,  # ignored below stage 3
        offload_param_pin_memory=bool(pin) if pin != "auto" else True,
        offload_optimizer=_device(oo.get("device")) if isinstance(oo, dict) else None,
        has_optimizer=isinstance(raw.get("optimizer"), dict) and bool(raw.get("optimizer")),
        prefetch_bucket_size=_num(_pick(zero, "stage3_prefetch_bucket_size", "prefetch_bucket_size"), PREFETCH_BUCKET),
        param_persistence_threshold=_num(
            _pick(zero, "stage3_param_persistence_threshold", "param_persistence_threshold"), PERSISTENCE_THRESHOLD),
        max_live_parameters=_num(_pick(zero, "stage3_max_live_parameters", "max_live_parameters"), MAX_LIVE),
        max_reuse_distance=_num(_pick(zero, "stage3_max_reuse_distance", "max_reuse_distance"), MAX_REUSE),
        reduce_bucket_size=_num(zero.get("reduce_bucket_size"), REDUCE_BUCKET),
        nvme_buffer_count=nvme_count,
        nvme_buffer_size=nvme_size,
        source=source,
    )


def _read_config_file(path: str) -> dict:
    text = inputs.read_text(path, "DeepSpeed config file")  # regular files only, bounded size
    try:
        import hjson  # DeepSpeed parses configs with hjson

        data = hjson.loads(text, object_pairs_hook=_no_duplicates(path))
    except ImportError:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"invalid JSON at line {exc.lineno}: {exc.msg}", path=path) from None
    except InputError:
        raise
    except Exception as exc:  # hjson.HjsonDecodeError
        raise InputError(f"invalid config: {exc}", path=path) from None
    inputs.check_tree(data, path)
    return json.loads(json.dumps(data))


def _no_duplicates(path):
    def hook(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise InputError(f"duplicate key {k!r}", path=path)
            seen[k] = v
        return seen

    return hook


def load_knobs(config: str | os.PathLike | dict | None) -> DsKnobs | None:
    """Knobs of a DeepSpeed config (a path or a dict); None when there is no config."""
    if config is None:
        return None
    source = None if isinstance(config, dict) else os.fspath(config)
    try:  # the config doctor, when it is installed
        from dsdoctor.config.effective import effective_settings
        from dsdoctor.config.load import load_config

        raw = load_config(config).raw
        return knobs_from_effective(effective_settings(raw), source=source)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("dsdoctor.config"):
            raise
    raw = config if isinstance(config, dict) else _read_config_file(source)
    return knobs_from_ds_config(raw, source=source)
