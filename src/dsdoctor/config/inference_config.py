"""A ``deepspeed.init_inference(config=...)`` dict read the way DeepSpeed 0.19.8's ``DeepSpeedInferenceConfig``
(``deepspeed/inference/config.py``) reads it: what takes effect (dtype, tensor parallelism, kernel injection, ...)
and every key or value its pydantic models (extra keys forbidden) would reject. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dsdoctor.config.effective import _as_bool, _as_int
from dsdoctor.config.schema import ZERO_FIELDS
from dsdoctor.errors import InputError

# DtypeEnum spellings (inference/config.py) -> our name
DTYPE_SPELLINGS = {
    "fp16": ("torch.float16", "fp16", "float16", "half"),
    "fp32": ("torch.float32", "fp32", "float32", "float"),
    "bf16": ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
    "int8": ("torch.int8", "int8"),
}
_BOOLS = {"replace_with_kernel_inject", "kernel_inject", "enable_cuda_graph", "use_triton", "triton_autotune",
          "triangular_masking", "tm", "keep_module_on_host", "set_empty_params", "return_tuple", "transposed_mode"}
_INTS = {"mp_size": None, "training_mp_size": None, "ep_size": None, "max_out_tokens": 1, "max_tokens": 1,
         "min_out_tokens": None, "min_tokens": None}
TP_FIELDS = {"enabled": "bool", "tp_size": "int", "tp_grain_size": "int", "mpu": None, "tp_group": None}
MOE_FIELDS = {"enabled": "bool", "ep_size": "int", "moe_experts": None, "num_experts": None, "type": None,
              "ep_mp_group": None, "ep_group": None, "expert_group": None}
QUANT_FIELDS = {"enabled": "bool", "activation": None, "weight": None, "qkv": None}
CKPT_FIELDS = {"checkpoint_dir": None, "save_mp_checkpoint_path": None, "base_dir": None}


@dataclass
class InferenceSettings:
    dtype: str  # fp16 (the default) | bf16 | fp32 | int8
    dtype_set: bool
    tp_size: int
    tp_source: str | None
    kernel_inject: bool
    enable_cuda_graph: bool
    max_out_tokens: int
    checkpoint: str | None
    zero: dict | None  # the zero section as written (it does nothing there), or a ZeRO config's in args/config
    invalid: list[tuple[str, str]] = field(default_factory=list)
    zero_source: str | None = None  # "zero" (the legacy section), "args" or "config" (a ZeRO config handed there)

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "dtype_set": self.dtype_set, "tp_size": self.tp_size, "tp_source": self.tp_source,
                "replace_with_kernel_inject": self.kernel_inject, "enable_cuda_graph": self.enable_cuda_graph,
                "max_out_tokens": self.max_out_tokens, "checkpoint": self.checkpoint, "zero_ignored": self.zero,
                "invalid": [list(x) for x in self.invalid]}


def dtype_name(value) -> str | None:
    for name, spellings in DTYPE_SPELLINGS.items():
        if value in spellings:
            return name
    return None


def _section(raw: dict, where: str, fields: dict, invalid: list) -> dict:
    """Validate a nested model (extra keys forbidden); returns the valid scalars read."""
    out = {}
    for k, v in raw.items():
        path = f"{where}.{k}"
        if k not in fields:
            invalid.append((path, "unknown key: the model forbids extra keys (ValidationError)"))
            continue
        try:
            if fields[k] == "bool":
                out[k] = _as_bool(path, v)
            elif fields[k] == "int":
                out[k] = _as_int(path, v, minimum=-(2**63))
        except InputError as exc:
            invalid.append((path, exc.problem.split(": ", 1)[-1] + " (ValidationError)"))
    return out


def read_inference_config(raw: dict) -> InferenceSettings:  # noqa: C901,PLR0912,PLR0915
    invalid: list[tuple[str, str]] = []
    for k, v in raw.items():
        if k in _BOOLS:
            try:
                _as_bool(k, v)
            except InputError as exc:
                invalid.append((k, exc.problem.split(": ", 1)[-1] + " (ValidationError)"))
        elif k in _INTS:
            try:
                n = _as_int(k, v, minimum=-(2**63))
                if _INTS[k] is not None and n < _INTS[k]:
                    invalid.append((k, f"must be > 0, not {n} (ValidationError)"))
            except InputError as exc:
                invalid.append((k, exc.problem.split(": ", 1)[-1] + " (ValidationError)"))
    dtype, dtype_set = "fp16", "dtype" in raw
    if dtype_set:
        value = raw["dtype"]
        if not isinstance(value, str):
            invalid.append(("dtype", f"must be a string such as \"bf16\", not {value!r} (TypeError in the validator)"))
        elif dtype_name(value) is None:
            invalid.append(("dtype", f"'{value}' is not a valid DtypeEnum: use fp16, bf16, fp32 or int8 "
                                     "(or torch.float16, bfloat16, ...)"))
        else:
            dtype = dtype_name(value)
    tp_size, tp_source = 1, None
    for key in ("tensor_parallel", "tp"):
        tp = raw.get(key)
        if tp is None:
            continue
        if not isinstance(tp, dict):
            invalid.append((key, f"must be an object, not {type(tp).__name__}"))
            continue
        got = _section(tp, key, TP_FIELDS, invalid)
        if got.get("tp_size", 1) > 1 and got.get("enabled", True):
            tp_size, tp_source = got["tp_size"], f"{key}.tp_size"
    if tp_source is None and "mp_size" in raw:
        try:
            mp = _as_int("mp_size", raw["mp_size"], minimum=-(2**63))
            if mp > 1:
                tp_size, tp_source = mp, "mp_size (deprecated: tensor_parallel.tp_size)"
        except InputError:
            pass
    moe = raw.get("moe")
    if isinstance(moe, dict):
        _section(moe, "moe", MOE_FIELDS, invalid)
    elif moe is not None and not isinstance(moe, bool):
        invalid.append(("moe", f"must be true/false or an object, not {moe!r}"))
    quant = raw.get("quant")
    if isinstance(quant, dict):
        _section(quant, "quant", QUANT_FIELDS, invalid)
    elif quant is not None:
        invalid.append(("quant", f"must be an object, not {quant!r}"))
    for key in ("checkpoint_config", "ckpt_config"):
        if isinstance(raw.get(key), dict):
            _section(raw[key], key, CKPT_FIELDS, invalid)
    ckpt = raw.get("checkpoint")
    if ckpt is not None and not isinstance(ckpt, (str, dict)):
        invalid.append(("checkpoint", f"must be a path or an object, not {ckpt!r}"))
    zero = raw.get("zero")
    if zero is not None:
        if not isinstance(zero, dict):
            invalid.append(("zero", f"must be an object, not {zero!r}"))
            zero = None
        else:
            for k in zero:
                if k not in ZERO_FIELDS and zero[k] != "auto":
                    invalid.append((f"zero.{k}", "unknown key: DeepSpeedZeroConfig forbids extra keys (ValidationError)"))
    for key in ("injection_policy", "injection_dict", "config", "args"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            invalid.append((key, f"must be an object, not {raw[key]!r}"))

    def flag(*keys, default=False):
        for k in keys:
            if k in raw:
                try:
                    return _as_bool(k, raw[k])
                except InputError:
                    return default
        return default

    try:
        max_out = _as_int("max_out_tokens", raw.get("max_out_tokens", raw.get("max_tokens", 1024)), minimum=-(2**63))
    except InputError:
        max_out = 1024
    settings = InferenceSettings(
        dtype=dtype, dtype_set=dtype_set, tp_size=tp_size, tp_source=tp_source,
        kernel_inject=flag("replace_with_kernel_inject", "kernel_inject"), enable_cuda_graph=flag("enable_cuda_graph"),
        max_out_tokens=max_out, checkpoint=ckpt if isinstance(ckpt, str) else ("dict" if isinstance(ckpt, dict) else None),
        zero=zero, invalid=invalid, zero_source="zero" if zero is not None else None,
    )
    return settings if zero is not None else _with_handed_zero(raw, settings)


def _with_handed_zero(raw: dict, settings: InferenceSettings) -> InferenceSettings:
    """A ZeRO (training) config handed to init_inference as ``args=`` (or its alias ``config``): the
    DeepSpeedInferenceConfig takes it as the model's config, and its zero_optimization does nothing there."""
    for key in ("args", "config"):
        handed = raw.get(key)
        if isinstance(handed, dict) and isinstance(handed.get("zero_optimization"), dict):
            settings.zero, settings.zero_source = dict(handed["zero_optimization"]), key
            break
    return settings
