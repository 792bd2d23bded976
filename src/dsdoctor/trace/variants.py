"""A/B variants: rewrites of the DeepSpeed config applied in-process where it reaches DeepSpeed.

Each variant is a name and a pure function ``dict -> dict`` (inputs are never mutated). The observer applies
the rewrite inside every rank (``deepspeed.initialize`` and ``HfDeepSpeedConfig``); the user's files stay
untouched. Torch-free.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from dsdoctor.errors import InputError

DEFAULT_VARIANTS = ("as-is", "no-offload-param", "split")


@dataclass(frozen=True)
class Variant:
    name: str
    description: str


def _zero(cfg: dict) -> dict:
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, dict):
        zero = {}
        cfg["zero_optimization"] = zero
    return zero


def _as_is(cfg: dict) -> dict:
    return cfg


def _no_offload_param(cfg: dict) -> dict:
    _zero(cfg).pop("offload_param", None)
    return cfg


def _split_no_offload(cfg: dict) -> dict:
    """The seed's end state on ZeRO-3: the inference config, weights on the GPU (no offload_param)."""
    return _no_offload_param(split_inference_config(cfg))


def _plain(cfg: dict) -> dict:
    """The seed's end state without ZeRO-3: the inference config at stage 0 (whole weights on each GPU)."""
    new = _split_no_offload(cfg)
    zero = _zero(new)
    for key in list(zero):
        if key.startswith("stage3_") or key.startswith("zero_"):
            zero.pop(key)
    zero["stage"] = 0
    return new


def split_inference_config(cfg: dict) -> dict:
    """The inference part of a training config, as ``dsdoctor split`` writes it (no optimizer, scheduler,
    offload_optimizer or training-only keys; "auto" resolved to what DeepSpeed would use)."""
    from dsdoctor.config.load import load_config
    from dsdoctor.config.split import inference_config

    new, _changes = inference_config(load_config(cfg))
    return new


def _pin_memory(value: bool):
    def rewrite(cfg: dict) -> dict:
        zero = _zero(cfg)
        for key in ("offload_param", "offload_optimizer"):
            if isinstance(zero.get(key), dict):
                zero[key]["pin_memory"] = value
        return cfg
    return rewrite


def _prefetch(size: int):
    def rewrite(cfg: dict) -> dict:
        _zero(cfg)["stage3_prefetch_bucket_size"] = size
        return cfg
    return rewrite


_FIXED = {
    "as-is": ("the config as the script passes it", _as_is),
    "no-offload-param": ("zero_optimization.offload_param removed", _no_offload_param),
    "split": ("the inference part only: no optimizer, scheduler or offload_optimizer", split_inference_config),
    # the seed's end states: ab adds them when plan says they fit (trace/end_state.py)
    "split-no-offload": ("the inference part, without offload_param (ZeRO-3, weights on the GPU)", _split_no_offload),
    "plain": ("the inference part at ZeRO stage 0: no ZeRO-3, the whole model on each GPU", _plain),
    "pin-memory-on": ("offload pin_memory true", _pin_memory(True)),
    "pin-memory-off": ("offload pin_memory false", _pin_memory(False)),
    # not a config rewrite: the observer wraps generate on a ZeRO-3 engine's module (observer/gather_once.py)
    "gather-once": ("generate with the ZeRO-3 model gathered once and its module hooks lifted (in-process)",
                    _as_is),
}
KNOWN = tuple(_FIXED) + ("prefetch=N",)


def _rewrite_for(name: str):
    if name in _FIXED:
        return _FIXED[name][1]
    if name.startswith("prefetch="):
        return _prefetch(_parse_count(name.split("=", 1)[1], name))
    raise InputError(f"unknown variant {name!r}", hint=f"known: {', '.join(KNOWN)}")


def _parse_count(text: str, name: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"variant {name!r}: {text!r} is not a number of elements like 5e7") from None
    if not 1 <= value <= MAX_BUCKET:  # NaN and the infinities too
        raise InputError(f"variant {name!r}: the bucket size must be a number of elements from 1 to "
                         f"{MAX_BUCKET:.0e}, not {text}")
    return int(value)


MAX_BUCKET = 1e12  # elements: more than any model has parameters


def parse_variants(spec: str | list[str] | None) -> list[Variant]:
    """``"as-is,no-offload-param,prefetch=1e7"`` (or a list) -> variants, validated, duplicates refused."""
    if spec is None:
        names = list(DEFAULT_VARIANTS)
    elif isinstance(spec, str):
        names = [n.strip() for n in spec.split(",") if n.strip()]
    else:
        names = [str(n).strip() for n in spec]
    if not names:
        raise InputError("no variants given", hint=f"known: {', '.join(KNOWN)}")
    out = []
    for name in names:
        _rewrite_for(name)  # validates
        if any(v.name == name for v in out):
            raise InputError(f"variant {name!r} given twice")
        desc = _FIXED[name][0] if name in _FIXED else f"stage3_prefetch_bucket_size = {name.split('=', 1)[1]}"
        out.append(Variant(name, desc))
    return out


def apply_variant(name: str, cfg: dict) -> dict:
    """The rewritten copy of ``cfg`` for variant ``name``."""
    return _rewrite_for(name)(copy.deepcopy(cfg))
