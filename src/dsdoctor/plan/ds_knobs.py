"""The DeepSpeed config knobs that change an inference plan, built from the config doctor's typed reading.

There is one reader of DeepSpeed configs: ``dsdoctor.config`` (``load_config`` -> ``LoadedConfig.effective``,
DeepSpeed 0.19.8's semantics for "auto", aliases and defaults). This module only picks the fields a memory
and speed plan needs out of that ``Effective``.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from dsdoctor.config.effective import Effective
from dsdoctor.config.load import LoadedConfig, load_config
from dsdoctor.config.schema import ZERO_DEFAULTS
from dsdoctor.errors import InputError

# DeepSpeed 0.19.8's defaults (runtime/zero/config.py, runtime/zero/offload_config.py)
NVME_BUFFER_COUNT = 5
NVME_BUFFER_SIZE = 100_000_000


@dataclass
class DsKnobs:
    zero_stage: int = 0
    offload_param: str | None = None  # None, "cpu", "nvme"
    offload_param_pin_memory: bool = True
    offload_optimizer: str | None = None
    has_optimizer: bool = False
    prefetch_bucket_size: int = ZERO_DEFAULTS["prefetch_bucket_size"]
    param_persistence_threshold: int = ZERO_DEFAULTS["param_persistence_threshold"]
    max_live_parameters: int = ZERO_DEFAULTS["max_live_parameters"]
    max_reuse_distance: int = ZERO_DEFAULTS["max_reuse_distance"]
    reduce_bucket_size: int = ZERO_DEFAULTS["reduce_bucket_size"]
    nvme_buffer_count: int = NVME_BUFFER_COUNT
    nvme_buffer_size: int = NVME_BUFFER_SIZE
    source: str | None = None  # the config file, if any

    def to_dict(self) -> dict:
        return asdict(self)


def knobs_from_dict(knobs: dict, source: str | None = None) -> DsKnobs:
    """From a flat dict of knob names (the field names of ``DsKnobs``); unknown names raise."""
    unknown = set(knobs) - set(DsKnobs.__dataclass_fields__)
    if unknown:
        raise InputError(f"unknown plan knobs: {', '.join(sorted(unknown))}")
    out = DsKnobs(source=source)
    for key, value in knobs.items():
        setattr(out, key, value)
    return out


def _or_default(value, name: str) -> int:
    return ZERO_DEFAULTS[name] if value is None else int(value)


def knobs_from_effective(eff: Effective, source: str | None = None) -> DsKnobs:
    """From the raw-DeepSpeed reading ``LoadedConfig.effective("deepspeed")``."""
    op, oo = eff.offload_param, eff.offload_optimizer
    stage = eff.zero_stage
    return DsKnobs(
        zero_stage=stage,
        # DeepSpeed ignores offload_param below stage 3
        offload_param=op.device if op.enabled and stage == 3 else None,
        offload_param_pin_memory=bool(op.pin_memory),
        offload_optimizer=oo.device if oo.enabled else None,
        has_optimizer=eff.has_optimizer,
        prefetch_bucket_size=_or_default(eff.prefetch_bucket_size, "prefetch_bucket_size"),
        param_persistence_threshold=_or_default(eff.param_persistence_threshold, "param_persistence_threshold"),
        max_live_parameters=_or_default(eff.max_live_parameters, "max_live_parameters"),
        max_reuse_distance=_or_default(eff.max_reuse_distance, "max_reuse_distance"),
        reduce_bucket_size=_or_default(eff.reduce_bucket_size, "reduce_bucket_size"),
        nvme_buffer_count=NVME_BUFFER_COUNT if op.buffer_count is None else int(op.buffer_count),
        nvme_buffer_size=NVME_BUFFER_SIZE if op.buffer_size is None else int(op.buffer_size),
        source=source,
    )


def load_knobs(config: str | os.PathLike | dict | LoadedConfig | None) -> DsKnobs | None:
    """Knobs of a DeepSpeed config (a path, a dict or an already loaded config); None without a config."""
    if config is None:
        return None
    loaded = config if isinstance(config, LoadedConfig) else load_config(config)
    return knobs_from_effective(loaded.effective("deepspeed"), source=loaded.path)
