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

from dsdoctor.config.schema import (  # noqa: F401  (re-exported: other modules read them from here)
    BF16_FIELDS,
    FP16_FIELDS,
    OFFLOAD_OPTIMIZER_FIELDS,
    OFFLOAD_OPTIMIZER_TYPES,
    OFFLOAD_PARAM_FIELDS,
    OFFLOAD_PARAM_TYPES,
    REMOVED_TOP_LEVEL_KEYS,
    REMOVED_ZERO_KEYS,
    STAGE3_ALIASES,
    ZERO_DEFAULTS,
    ZERO_FIELDS,
    ZERO_TYPES,
)
from dsdoctor.errors import InputError

UNSET, AUTO, SET = "unset", "auto", "set"
FILLERS = ("deepspeed", "hf-trainer")
DEVICES = ("none", "cpu", "nvme")

def _type_errors(section: dict | None, types: dict, where: str, invalid: list, aliases: dict | None = None) -> None:
    """Append (key, why) for every scalar DeepSpeed's pydantic model would reject ("auto" is dropped there)."""
    for key, value in (section or {}).items():
        kind = types.get((aliases or {}).get(key, key))
        if kind is None or value == AUTO:
            continue
        path = f"{where}{key}"
        try:
            if kind == "optbool":
                if value is not None:
                    _as_bool(path, value)
            elif kind == "bool":
                _as_bool(path, value)
            elif kind == "ratio":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                    raise _bad(path, f"must be a number between 0 and 1, not {value!r}")
            else:
                _as_int(path, value, minimum=kind[1] if kind[1] is not None else -(2**63))
        except InputError as exc:
            invalid.append((path, exc.problem.split(": ", 1)[-1] + " (a ValidationError in DeepSpeed)"))


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


# --- value parsing (the coercions pydantic's lax mode applies) ------------------------------------------

def _bad(key: str, problem: str):
    return InputError(f"{key}: {problem}")


def _as_int(key: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool):
        out = int(value)  # pydantic accepts true/false as 1/0
    elif isinstance(value, int):
        out = value
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")) or not value.is_integer():
            raise _bad(key, f"must be a whole number, not {value!r}")
        if abs(value) >= 2**63:
            raise _bad(key, f"is too large: {value!r}")
        out = int(value)
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        out = int(value.strip())
    else:
        raise _bad(key, f"must be an integer, not {value!r}")
    if out < minimum:
        raise _bad(key, f"must be >= {minimum}, not {out}")
    return out


_TRUE = {"true", "1", "yes", "on", "t", "y"}
_FALSE = {"false", "0", "no", "off", "f", "n"}


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _bad(key, f"must be true or false, not {value!r}")


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
    """``_read`` for values whose errors ``_type_errors`` already collected: a bad value reads as the default."""
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

# deprecated zero_optimization keys with a replacing key (runtime/zero/config.py, json_schema_extra new_param)
DEPRECATED_REPLACED = {
    "cpu_offload": ("offload_optimizer",),
    "cpu_offload_param": ("offload_param",),
    "stage3_gather_fp16_weights_on_model_save": ("gather_16bit_weights_on_model_save",
                                                 "stage3_gather_16bit_weights_on_model_save"),
}


def effective_settings(raw: dict, filler: str = "deepspeed", *, hidden_size: int | None = None) -> Effective:  # noqa: C901,PLR0912,PLR0915
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

    # zero_optimization: absent -> {}, a bool -> the legacy format (true is stage 1)
    zraw = raw.get("zero_optimization")
    if isinstance(zraw, bool):
        zero: dict | None = {"stage": 1 if zraw else 0}
    elif zraw == AUTO:
        zero = None  # DeepSpeed would fail on a string section; treated as absent, reported as auto below
        values["zero_optimization"] = Value("zero_optimization", AUTO, zraw, None)
    else:
        zero = _section(raw, "zero_optimization", "")
    zw = "zero_optimization."
    if zero is not None:
        for k in zero:
            if zero[k] == AUTO and k not in REMOVED_ZERO_KEYS:
                continue  # dropped before validation
            if k in REMOVED_ZERO_KEYS:
                invalid.append((zw + k, "removed in DeepSpeed 0.19: DeepSpeedConfig raises DeepSpeedConfigError"))
            elif k not in ZERO_FIELDS:
                why = "unknown key: DeepSpeedZeroConfig forbids extra keys and raises a ValidationError"
                if k.startswith("_"):
                    why += " (a leading underscore does not disable a key inside zero_optimization)"
                invalid.append((zw + k, why))
        for canonical, alias in STAGE3_ALIASES.items():
            if canonical in zero and alias in zero:
                invalid.append((zw + canonical, f"given twice, as {alias} and {canonical}"))
        # a deprecated key and the key that replaces it, both given (even as null): DeepSpeed asserts
        # "Cannot provide deprecated parameter ... and replacing parameter ... together" (config_utils.py)
        for old, new_names in DEPRECATED_REPLACED.items():
            if zero.get(old, AUTO) != AUTO and any(zero.get(n, AUTO) != AUTO for n in new_names):
                invalid.append((zw + old, f"deprecated spelling given together with {new_names[0]}, which replaces "
                                          "it: DeepSpeed asserts they cannot be provided together"))

    _type_errors(zero, ZERO_TYPES, zw, invalid, {a: c for c, a in STAGE3_ALIASES.items()})
    stage_v = _read(zero, ("stage",), zw, lambda k, v: _as_stage(k, v), 0, canonical="stage")
    values["zero_stage"] = stage_v
    stage = stage_v.value

    def knob(canonical: str, hidden_fill) -> Value:
        keys = (STAGE3_ALIASES[canonical], canonical) if canonical in STAGE3_ALIASES else (canonical,)
        try:
            v = _read(zero, keys, zw, lambda k, x: _as_int(k, x), ZERO_DEFAULTS[canonical], canonical=keys[0])
        except InputError:  # a bad knob, already in invalid (_type_errors): carry on with the default
            key = next(k for k in keys if k in zero)
            v = Value(zw + key, SET, zero[key], ZERO_DEFAULTS[canonical], ZERO_DEFAULTS[canonical],
                      note="invalid: DeepSpeed rejects it")
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
    # legacy booleans: cpu_offload_param / cpu_offload (DeepSpeed maps them when the new key is absent)
    if zero is not None:
        if not offload_param.present and zero.get("cpu_offload_param") not in (None, AUTO):
            if _bool_or_false(zero["cpu_offload_param"]):
                offload_param.device, offload_param.present = "cpu", True
                values["offload_param.device"] = Value(zw + "cpu_offload_param", SET, zero["cpu_offload_param"], "cpu", "none")
        if not offload_optimizer.present and zero.get("cpu_offload") not in (None, AUTO):
            if _bool_or_false(zero["cpu_offload"]):
                offload_optimizer.device, offload_optimizer.present = "cpu", True
                values["offload_optimizer.device"] = Value(zw + "cpu_offload", SET, zero["cpu_offload"], "cpu", "none")

    dtype = _dtype(raw, values, hf, invalid)
    tp_size, tp_source = _tensor_parallel(raw, values)

    opt = raw.get("optimizer")
    has_optimizer = opt is not None and opt != {}
    optimizer_type = None
    if isinstance(opt, dict):
        optimizer_type = str(opt.get("type")) if opt.get("type") is not None else None
    elif has_optimizer:
        raise _bad("optimizer", f"must be an object, not {type(opt).__name__} {opt!r}")
    sched = raw.get("scheduler")
    has_scheduler = sched is not None and sched != {}
    scheduler_type = str(sched.get("type")) if isinstance(sched, dict) and sched.get("type") is not None else None
    if has_scheduler and not isinstance(sched, dict):
        raise _bad("scheduler", f"must be an object, not {type(sched).__name__} {sched!r}")

    # top-level numbers: DeepSpeed passes "auto" through and crashes; the Trainer fills them
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        if key in raw:
            rv = raw[key]
            if rv == AUTO:
                note = "filled by the HF Trainer from TrainingArguments" if hf else "not filled: TypeError in DeepSpeed"
                values[key] = Value(key, AUTO, rv, None, None, note=note)
            else:
                if key == "gradient_clipping":
                    if isinstance(rv, bool) or not isinstance(rv, (int, float)):
                        raise _bad(key, f"must be a number, not {rv!r}")
                    parsed = rv
                else:  # read with get_scalar_param: no conversion, a string or a float breaks the arithmetic
                    if isinstance(rv, bool) or not isinstance(rv, int):
                        raise _bad(key, f"must be an integer, not {rv!r} (DeepSpeed does not convert it)")
                    parsed = _as_int(key, rv, minimum=1)
                values[key] = Value(key, SET, rv, parsed, None)
        else:
            values[key] = Value(key, UNSET, None, None, None)
    # optimizer / scheduler params left "auto"
    for sect in ("optimizer", "scheduler"):
        params = raw.get(sect, {}).get("params") if isinstance(raw.get(sect), dict) else None
        if isinstance(params, dict):
            for pk, pv in params.items():
                if pv == AUTO:
                    note = "filled by the HF Trainer" if hf else "not filled: TypeError in DeepSpeed"
                    values[f"{sect}.params.{pk}"] = Value(f"{sect}.params.{pk}", AUTO, pv, None, None, note=note)

    disabled = [k for k in raw if k.startswith("_") and k[1:] in _KNOWN_TOP_LEVEL]

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


_KNOWN_TOP_LEVEL = {
    "optimizer", "scheduler", "zero_optimization", "fp16", "bf16", "bfloat16", "train_batch_size",
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "tensor_parallel",
    "activation_checkpointing", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
}


def _offload(zero: dict | None, name: str, values: dict, invalid: list, *, param: bool) -> Offload:
    zw = "zero_optimization."
    where = f"{zw}{name}."
    section = _section(zero, name, zw) if zero is not None else None
    if zero is not None and zero.get(name) == AUTO:
        values[f"{name}.section"] = Value(zw + name, AUTO, AUTO, None, None, note="dropped by DeepSpeed: no offload")
    if section is not None:
        allowed = OFFLOAD_PARAM_FIELDS if param else OFFLOAD_OPTIMIZER_FIELDS
        _type_errors(section, OFFLOAD_PARAM_TYPES if param else OFFLOAD_OPTIMIZER_TYPES, where, invalid)
        for k in section:
            if k not in allowed and section[k] != AUTO:
                invalid.append((where + k, f"unknown key: the {name} config forbids extra keys and raises a "
                                           "ValidationError"))
    dev = _read(section, ("device",), where, _as_device, "none", canonical="device")
    pin = _read_soft(section, ("pin_memory",), where, _as_bool, True, canonical="pin_memory")
    nvme = _read(section, ("nvme_path",), where, lambda k, v: None if v is None else str(v), None,
                 canonical="nvme_path")
    bcount = _read_soft(section, ("buffer_count",), where, lambda k, v: _as_int(k, v), 5 if param else 4,
                   canonical="buffer_count")
    for n, v in (("device", dev), ("pin_memory", pin), ("nvme_path", nvme), ("buffer_count", bcount)):
        values[f"{name}.{n}"] = v
    off = Offload(device=dev.value, pin_memory=pin.value, nvme_path=nvme.value, buffer_count=bcount.value,
                  present=section is not None)
    if param:
        off.buffer_size = _read_soft(section, ("buffer_size",), where, lambda k, v: _as_int(k, v), 100_000_000,
                                canonical="buffer_size").value
        off.max_in_cpu = _read_soft(section, ("max_in_cpu",), where, lambda k, v: _as_int(k, v), 1_000_000_000,
                               canonical="max_in_cpu").value
    else:
        def ratio(k, v):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise _bad(k, f"must be a number between 0 and 1, not {v!r}")
            return float(v)
        off.ratio = _read_soft(section, ("ratio",), where, ratio, 1.0, canonical="ratio").value
    off.values = {n: values[f"{name}.{n}"] for n in ("device", "pin_memory", "nvme_path", "buffer_count")}
    return off


_PRECISION_TYPES = {"loss_scale": "float", "initial_scale_power": "int", "loss_scale_window": "int",
                    "hysteresis": "int", "min_loss_scale": "int"}


def _precision_errors(section: dict, name: str, key: str, invalid: list) -> None:
    """DeepSpeedFP16Config / DeepSpeedBF16Config validation (runtime/precision_config.py), collected."""
    import math

    allowed = FP16_FIELDS if name == "fp16" else BF16_FIELDS
    values = {k: v for k, v in section.items() if v != AUTO}  # "auto" is dropped before validation
    ok: dict[str, Any] = {}
    for k, v in values.items():
        path = f"{key}.{k}"
        if k not in allowed:
            invalid.append((path, f"unknown key: the {name} config forbids extra keys and raises a ValidationError"))
            continue
        kind = _PRECISION_TYPES.get(k, "bool")
        try:
            if k == "loss_scale":
                if isinstance(v, bool):
                    raise _bad(path, "must be a number, not bool")
                try:
                    f = float(v)
                except (TypeError, ValueError):
                    raise _bad(path, f"must be a number, not {v!r}") from None
                if not math.isfinite(f) or f < 0:
                    raise _bad(path, f"must be a finite number >= 0, not {v!r}")
                ok[k] = f
            elif kind == "int":
                if k in ("loss_scale_window", "min_loss_scale"):
                    if isinstance(v, bool):
                        raise _bad(path, "must be an integer, not bool")
                    try:
                        int(v)
                    except (TypeError, ValueError, OverflowError):
                        raise _bad(path, f"must be an integer, not {v!r}") from None
                ok[k] = _as_int(path, v, minimum=-(2**63))
            else:
                ok[k] = _as_bool(path, v)
        except InputError as exc:
            invalid.append((path, exc.problem.split(": ", 1)[-1] + " (a ValidationError in DeepSpeed)"))
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
