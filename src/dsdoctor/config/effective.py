"""What a DeepSpeed config really does: the effective value of every setting that matters at inference.

Every value has three states: ``unset`` (the key is absent), ``auto`` (the string "auto") and ``set``. The
effective value follows DeepSpeed 0.19.x:

* inside its pydantic sections (``zero_optimization``, ``offload_*``, ``fp16``, ``bf16``,
  ``tensor_parallel``) an ``"auto"`` is dropped before validation, so the field takes its default
  (``runtime/config_utils.py``): ``"stage": "auto"`` is stage 0, ``"enabled": "auto"`` is off;
* ``"auto"`` in top-level numbers (batch sizes, ``gradient_clipping``) and in optimizer/scheduler params is
  passed through and crashes later with a ``TypeError``.

``filler="hf-trainer"`` reads the config the way the HF Trainer / accelerate fill it instead
(``transformers/integrations/deepspeed.py``): batch sizes, precision and optimizer params come from
``TrainingArguments``, and the hidden-size keys become ``hidden**2``, ``0.9*hidden**2`` and ``10*hidden``.

No torch, no deepspeed: this module is on the path of ``dsdoctor check``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsdoctor.config.schema import (  # noqa: F401  (_as_bool, _as_int re-exported: other modules read them here)
    DEPRECATED_REPLACED,
    REMOVED_TOP_LEVEL_KEYS,
    REMOVED_ZERO_KEYS,
    STAGE3_ALIASES,
    ZERO,
    _as_bool,
    _as_int,
    _bad,
    check_section,
    check_value,
    fields,
    spellings,
    unknown,
)
from dsdoctor.errors import InputError

UNSET, AUTO, SET = "unset", "auto", "set"
FILLERS = ("deepspeed", "hf-trainer")
DEVICES = ("none", "cpu", "nvme")

@dataclass
class Value:
    """One setting: where it was read, its raw state, and what takes effect."""

    key: str  # dotted path as written in the config (the spelling found, or the canonical one when unset)
    state: str  # unset | auto | set
    raw: Any  # what the file says (None when unset)
    value: Any  # what takes effect (None: decided elsewhere, e.g. by TrainingArguments or the model)
    default: Any = None  # DeepSpeed's default
    note: str = ""  # how "auto" is resolved, for humans

    def to_dict(self) -> dict:
        return {"key": self.key, "state": self.state, "raw": self.raw, "value": self.value, "default": self.default,
                "note": self.note}


@dataclass
class Offload:
    device: str  # none | cpu | nvme
    pin_memory: bool
    nvme_path: str | None
    buffer_count: int
    buffer_size: int | None = None  # offload_param only
    max_in_cpu: int | None = None  # offload_param only
    ratio: float | None = None  # offload_optimizer only
    present: bool = False  # the section is in the config (even if device none)
    values: dict[str, Value] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.device != "none"

    def to_dict(self) -> dict:
        d = {"device": self.device, "pin_memory": self.pin_memory, "nvme_path": self.nvme_path,
             "buffer_count": self.buffer_count}
        if self.buffer_size is not None:
            d["buffer_size"] = self.buffer_size
            d["max_in_cpu"] = self.max_in_cpu
        if self.ratio is not None:
            d["ratio"] = self.ratio
        return d


@dataclass
class Effective:
    filler: str
    zero_stage: int
    offload_param: Offload
    offload_optimizer: Offload
    dtype: str  # bf16 | fp16 | fp32
    tp_size: int
    tp_source: str | None  # the key that set tp_size > 1 (mp_size, tensor_parallel.tp_size, tensor_parallel.autotp_size)
    has_optimizer: bool
    optimizer_type: str | None
    has_scheduler: bool
    scheduler_type: str | None
    prefetch_bucket_size: int | None  # None: filled from the model's hidden size (hf-trainer filler)
    param_persistence_threshold: int | None
    max_live_parameters: int | None
    max_reuse_distance: int | None
    reduce_bucket_size: int | None
    sub_group_size: int | None
    values: dict[str, Value] = field(default_factory=dict)  # canonical name -> Value, provenance of each
    invalid_keys: list[tuple[str, str]] = field(default_factory=list)  # (dotted key, why DeepSpeed rejects it)
    disabled_keys: list[str] = field(default_factory=list)  # top-level keys "commented out" with a leading _

    @property
    def autos(self) -> list[Value]:
        return [v for v in self.values.values() if v.state == AUTO]

    def to_dict(self) -> dict:
        return {
            "filler": self.filler,
            "zero_stage": self.zero_stage,
            "offload_param": self.offload_param.to_dict(),
            "offload_optimizer": self.offload_optimizer.to_dict(),
            "dtype": self.dtype,
            "tp_size": self.tp_size,
            "tp_source": self.tp_source,
            "has_optimizer": self.has_optimizer,
            "optimizer_type": self.optimizer_type,
            "has_scheduler": self.has_scheduler,
            "scheduler_type": self.scheduler_type,
            "stage3": {
                "prefetch_bucket_size": self.prefetch_bucket_size,
                "param_persistence_threshold": self.param_persistence_threshold,
                "max_live_parameters": self.max_live_parameters,
                "max_reuse_distance": self.max_reuse_distance,
            },
            "reduce_bucket_size": self.reduce_bucket_size,
            "sub_group_size": self.sub_group_size,
            "values": {k: v.to_dict() for k, v in self.values.items()},
        }


def _bool_or_false(value: Any) -> bool:
    try:
        return _as_bool("", value)
    except InputError:
        return False


def _as_stage(key: str, value: Any) -> int:
    try:
        stage = _as_int(key, value)
    except InputError:
        raise _bad(key, f"ZeRO stage must be 0, 1, 2 or 3, not {value!r}") from None
    if stage not in (0, 1, 2, 3):
        raise _bad(key, f"ZeRO stage must be 0, 1, 2 or 3, not {value!r}")
    return stage


def _as_device(key: str, value: Any) -> str:
    if value is None:
        raise _bad(key, "offload device must be \"none\", \"cpu\" or \"nvme\", not null")
    if value not in DEVICES:  # DeepSpeed's enum is case-sensitive
        raise _bad(key, f"offload device must be \"none\", \"cpu\" or \"nvme\", not {value!r}")
    return value


def _section(raw: dict, key: str, where: str) -> dict | None:
    value = raw.get(key)
    if value is None or value == AUTO:
        return None
    if not isinstance(value, dict):
        raise _bad(f"{where}{key}", f"must be an object, not {type(value).__name__} {value!r}")
    return value


def _read_soft(section, keys, where, parse, default, *, canonical):
    """``_read`` for values whose errors ``check_section`` already collected: a bad value reads as the default."""
    try:
        return _read(section, keys, where, parse, default, canonical=canonical)
    except InputError:
        key = next(k for k in keys if k in section)
        return Value(f"{where}{key}", SET, section[key], default, default, note="invalid: DeepSpeed rejects it")


def _read(section: dict | None, keys: tuple[str, ...], where: str, parse, default, *, canonical: str) -> Value:
    """Read the first spelling present; "auto" drops to the default (DeepSpeedConfigModel)."""
    if section is not None:
        for k in keys:
            if k in section:
                raw = section[k]
                path = f"{where}{k}"
                if raw == AUTO:
                    return Value(path, AUTO, raw, default, default, note="dropped by DeepSpeed: default applies")
                return Value(path, SET, raw, parse(path, raw), default)
    return Value(f"{where}{canonical}", UNSET, None, default, default)


# --- the reading ---------------------------------------------------------------------------------------

def effective_settings(raw: dict, filler: str = "deepspeed", *, hidden_size: int | None = None) -> Effective:
    """Effective settings of the DeepSpeed config dict ``raw`` as ``filler`` leaves it.

    ``filler="deepspeed"``: raw ``deepspeed.initialize`` (nothing fills "auto").
    ``filler="hf-trainer"``: the HF Trainer / accelerate fill "auto"; ``hidden_size`` (from the model) fills
    the three hidden-size keys, else they are reported as ``None`` (decided by the model).
    Raises ``InputError`` for values DeepSpeed would reject (wrong types, stage 9, device "gpu").
    """
    if filler not in FILLERS:
        raise ValueError(f"filler must be one of {FILLERS}, not {filler!r}")
    if not isinstance(raw, dict):
        raise InputError(f"a DeepSpeed config is an object, not {type(raw).__name__}")
    hf = filler == "hf-trainer"
    values: dict[str, Value] = {}
    invalid: list[tuple[str, str]] = []

    for key in raw:
        if key in REMOVED_TOP_LEVEL_KEYS:
            invalid.append((key, "removed in DeepSpeed 0.19: DeepSpeedConfig raises DeepSpeedConfigError"))

    zero = _zero_section(raw, values)
    zw = "zero_optimization."
    if zero is not None:
        _zero_errors(zero, invalid)
    stage_v = _read(zero, ("stage",), zw, lambda k, v: _as_stage(k, v), 0, canonical="stage")
    values["zero_stage"] = stage_v
    stage = stage_v.value

    def knob(canonical: str, hidden_fill) -> Value:
        f = ZERO[canonical]
        v = _read_soft(zero, f.spellings, zw, lambda k, x: check_value(f, k, x), f.default, canonical=f.spellings[0])
        if hf and v.state == AUTO and hidden_fill is not None:
            if canonical != "reduce_bucket_size" and stage != 3:
                v.note = "HF Trainer fills it only for stage 3: default applies"
            elif hidden_size:
                v.value = hidden_fill(hidden_size)
                v.note = "filled by the HF Trainer from the model's hidden_size"
            else:
                v.value = None
                v.note = "filled by the HF Trainer from the model's hidden_size (pass --model)"
        return v

    values["reduce_bucket_size"] = knob("reduce_bucket_size", lambda h: h * h)
    values["prefetch_bucket_size"] = knob("prefetch_bucket_size", lambda h: int(0.9 * h * h))
    values["param_persistence_threshold"] = knob("param_persistence_threshold", lambda h: 10 * h)
    values["max_live_parameters"] = knob("max_live_parameters", None)
    values["max_reuse_distance"] = knob("max_reuse_distance", None)
    values["sub_group_size"] = knob("sub_group_size", None)

    offload_param = _offload(zero, "offload_param", values, invalid, param=True)
    offload_optimizer = _offload(zero, "offload_optimizer", values, invalid, param=False)

    dtype = _dtype(raw, values, hf, invalid)
    tp_size, tp_source = _tensor_parallel(raw, values)

    has_optimizer, optimizer_type = _optional_section(raw, "optimizer")
    has_scheduler, scheduler_type = _optional_section(raw, "scheduler")
    _top_level_numbers(raw, values, hf)
    for key in ("optimizer", "scheduler"):  # their params left "auto" (a crash in DeepSpeed)
        params = raw[key].get("params") if isinstance(raw.get(key), dict) else None
        for pk, pv in (params.items() if isinstance(params, dict) else ()):
            if pv == AUTO:
                note = "filled by the HF Trainer" if hf else "not filled: TypeError in DeepSpeed"
                values[f"{key}.params.{pk}"] = Value(f"{key}.params.{pk}", AUTO, pv, None, None, note=note)

    disabled = [k for k in raw if k.startswith("_") and k[1:] in spellings("")]

    return Effective(
        filler=filler, zero_stage=stage, offload_param=offload_param, offload_optimizer=offload_optimizer,
        dtype=dtype, tp_size=tp_size, tp_source=tp_source, has_optimizer=has_optimizer,
        optimizer_type=optimizer_type, has_scheduler=has_scheduler, scheduler_type=scheduler_type,
        prefetch_bucket_size=values["prefetch_bucket_size"].value,
        param_persistence_threshold=values["param_persistence_threshold"].value,
        max_live_parameters=values["max_live_parameters"].value,
        max_reuse_distance=values["max_reuse_distance"].value,
        reduce_bucket_size=values["reduce_bucket_size"].value,
        sub_group_size=values["sub_group_size"].value,
        values=values, invalid_keys=invalid, disabled_keys=disabled,
    )


def _zero_section(raw: dict, values: dict) -> dict | None:
    """zero_optimization: absent -> None, a bool -> the legacy format (true is stage 1)."""
    zraw = raw.get("zero_optimization")
    if isinstance(zraw, bool):
        return {"stage": 1 if zraw else 0}
    if zraw == AUTO:  # DeepSpeed would fail on a string section; treated as absent, reported as auto
        values["zero_optimization"] = Value("zero_optimization", AUTO, zraw, None)
        return None
    return _section(raw, "zero_optimization", "")


def _optional_section(raw: dict, key: str) -> tuple[bool, str | None]:
    """optimizer / scheduler: present (not empty), and its type."""
    section = raw.get(key)
    if section is None or section == {}:
        return False, None
    if not isinstance(section, dict):
        raise _bad(key, f"must be an object, not {type(section).__name__} {section!r}")
    return True, (str(section["type"]) if section.get("type") is not None else None)


def _zero_errors(zero: dict, invalid: list) -> None:
    """What DeepSpeedZeroConfig rejects: removed and unknown keys, a knob given twice, a deprecated key with
    the key that replaces it (DeepSpeed asserts, config_utils.py), then the values of wrong types."""
    zw = "zero_optimization."
    errors, _ok = check_section(zero, "zero_optimization", zw)
    rejected = dict(unknown(errors))
    for k in zero:
        if k in REMOVED_ZERO_KEYS:
            invalid.append((zw + k, "removed in DeepSpeed 0.19: DeepSpeedConfig raises DeepSpeedConfigError"))
        elif zw + k in rejected:
            invalid.append((zw + k, rejected[zw + k] + (" (a leading underscore does not disable a key inside "
                                                        "zero_optimization)" if k.startswith("_") else "")))
    for canonical, alias in STAGE3_ALIASES.items():
        if canonical in zero and alias in zero:
            invalid.append((zw + canonical, f"given twice, as {alias} and {canonical}"))
    for old, new_names in DEPRECATED_REPLACED.items():  # both given, even as null
        if zero.get(old, AUTO) != AUTO and any(zero.get(n, AUTO) != AUTO for n in new_names):
            invalid.append((zw + old, f"deprecated spelling given together with {new_names[0]}, which replaces "
                                      "it: DeepSpeed asserts they cannot be provided together"))
    invalid += [e for e in errors if e[0] not in rejected]


def _top_level_numbers(raw: dict, values: dict, hf: bool) -> None:
    """Batch sizes and gradient clipping: DeepSpeed passes "auto" through and crashes; the Trainer fills them."""
    for key, kind in ((f.name, f.type) for f in fields("") if f.type in ("count", "number")):
        rv = raw.get(key)
        if key not in raw:
            values[key] = Value(key, UNSET, None, None, None)
        elif rv == AUTO:
            note = "filled by the HF Trainer from TrainingArguments" if hf else "not filled: TypeError in DeepSpeed"
            values[key] = Value(key, AUTO, rv, None, None, note=note)
        elif kind == "number":
            if isinstance(rv, bool) or not isinstance(rv, (int, float)):
                raise _bad(key, f"must be a number, not {rv!r}")
            values[key] = Value(key, SET, rv, rv, None)
        else:  # read with get_scalar_param: no conversion, a string or a float breaks the arithmetic
            if isinstance(rv, bool) or not isinstance(rv, int):
                raise _bad(key, f"must be an integer, not {rv!r} (DeepSpeed does not convert it)")
            values[key] = Value(key, SET, rv, _as_int(key, rv, minimum=1), None)


def _offload(zero: dict | None, name: str, values: dict, invalid: list, *, param: bool) -> Offload:
    zw = "zero_optimization."
    where, rows = f"{zw}{name}.", {f.name: f for f in fields(zw + name)}
    section = _section(zero, name, zw) if zero is not None else None
    if zero is not None and zero.get(name) == AUTO:
        values[f"{name}.section"] = Value(zw + name, AUTO, AUTO, None, None, note="dropped by DeepSpeed: no offload")
    if section is not None:
        errors, _ok = check_section(section, zw + name, where)
        invalid += [e for e in errors if e not in unknown(errors)] + unknown(errors)

    def read(n: str) -> Value:
        f = rows[n]
        return _read_soft(section, (n,), where, lambda k, v: check_value(f, k, v), f.default, canonical=n)

    off = Offload(device="none", pin_memory=True, nvme_path=None, buffer_count=0, present=section is not None)
    for n in ("device", "pin_memory", "nvme_path", "buffer_count", *(("buffer_size", "max_in_cpu") if param
                                                                    else ("ratio",))):
        if n == "device":
            v = _read(section, (n,), where, _as_device, rows[n].default, canonical=n)
        elif n == "nvme_path":
            v = _read(section, (n,), where, lambda k, x: None if x is None else str(x), None, canonical=n)
        else:
            v = read(n)
        setattr(off, n, v.value)
        if n in ("device", "pin_memory", "nvme_path", "buffer_count"):
            values[f"{name}.{n}"] = off.values[n] = v
    legacy = next(f.name for f in fields(zw[:-1]) if f.replaced_by == name)  # cpu_offload_param, cpu_offload
    if zero is not None and not off.present and zero.get(legacy) not in (None, AUTO) and _bool_or_false(zero[legacy]):
        off.device, off.present = "cpu", True  # DeepSpeed maps the legacy boolean when the new key is absent
        values[f"{name}.device"] = Value(zw + legacy, SET, zero[legacy], "cpu", "none")
    return off


def _precision_errors(section: dict, name: str, key: str, invalid: list) -> None:
    """DeepSpeedFP16Config / DeepSpeedBF16Config validation (runtime/precision_config.py), collected."""
    errors, ok = check_section(section, name, f"{key}.")
    invalid += errors
    if name == "fp16" and ok.get("enabled", False) and ok.get("loss_scale", 0) == 0:
        for k in ("loss_scale_window", "min_loss_scale"):
            if k in ok and ok[k] <= 0:
                invalid.append((f"{key}.{k}", "must be > 0 with dynamic loss scaling (loss_scale 0): a ValidationError "
                                              "in DeepSpeed"))


def _dtype(raw: dict, values: dict, hf: bool, invalid: list) -> str:
    """fp16 / bf16 sections as DeepSpeed reads them (``bf16``, else the old ``bfloat16`` spelling)."""
    enabled = {}
    for name, keys in (("fp16", ("fp16",)), ("bf16", ("bf16", "bfloat16"))):
        key = next((k for k in keys if raw.get(k) is not None), keys[0])
        section = _section(raw, key, "")
        _precision_errors(section or {}, name, key, invalid)
        v = _read(section, ("enabled",), f"{key}.", _as_bool, False, canonical="enabled")
        if hf and v.state == AUTO:
            v.value = None
            v.note = "filled by the HF Trainer from --" + name
        values[f"{name}.enabled"] = v
        enabled[name] = v.value
    if enabled["fp16"] and enabled["bf16"]:
        raise InputError("fp16.enabled and bf16.enabled are both true; DeepSpeed asserts they cannot both be enabled")
    if enabled["bf16"]:
        return "bf16"
    if enabled["fp16"]:
        return "fp16"
    return "fp32"


def _tensor_parallel(raw: dict, values: dict) -> tuple[int, str | None]:
    """The largest tensor-parallel degree any spelling asks for, and the key that asks for it."""
    found: list[tuple[int, str]] = []
    tp = raw.get("tensor_parallel")
    if isinstance(tp, dict):
        for k in ("autotp_size", "tp_size"):
            if k in tp and tp[k] != AUTO:
                found.append((_as_int(f"tensor_parallel.{k}", tp[k]), f"tensor_parallel.{k}"))
        inner = tp.get("tp")
        if isinstance(inner, dict) and inner.get("tp_size") not in (None, AUTO):
            found.append((_as_int("tensor_parallel.tp.tp_size", inner["tp_size"]), "tensor_parallel.tp.tp_size"))
    elif isinstance(tp, int) and not isinstance(tp, bool):
        found.append((_as_int("tensor_parallel", tp), "tensor_parallel"))
    if raw.get("mp_size") not in (None, AUTO):
        found.append((_as_int("mp_size", raw["mp_size"]), "mp_size"))
    size, source = max(found, default=(1, None))
    if size <= 1:
        size, source = 1, None
    values["tp_size"] = Value(source or "tensor_parallel.autotp_size", SET if source else UNSET,
                              size if source else None, size, 1)
    return size, source
