"""A ``deepspeed.init_inference(config=...)`` dict read the way DeepSpeed 0.19.8's ``DeepSpeedInferenceConfig``
(``deepspeed/inference/config.py``) reads it: what takes effect (dtype, tensor parallelism, kernel injection, ...)
and every key or value its pydantic models (extra keys forbidden) would reject. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dsdoctor.config.schema import INFERENCE, check_section, lookup, unknown

# DtypeEnum spellings (inference/config.py) -> our name
DTYPE_SPELLINGS = {
    "fp16": ("torch.float16", "fp16", "float16", "half"),
    "fp32": ("torch.float32", "fp32", "float32", "float"),
    "bf16": ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
    "int8": ("torch.int8", "int8"),
}

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


def _section(raw: dict, name: str, where: str, invalid: list) -> dict:
    """Validate a nested model (extra keys forbidden); returns the valid values read."""
    errors, ok = check_section(raw, f"init_inference.{name}", f"{where}.", INFERENCE)
    invalid += errors
    return ok


def read_inference_config(raw: dict) -> InferenceSettings:
    errors, top = check_section(raw, "init_inference", "", INFERENCE)
    invalid = [e for e in errors if e not in unknown(errors)]  # its unknown keys are DSD104's
    dtype, dtype_set = _dtype(raw, invalid)
    tp_size, tp_source = 1, None
    for key in ("tensor_parallel", "tp"):
        if isinstance(raw.get(key), dict):
            got = _section(raw[key], "tensor_parallel", key, invalid)
            if got.get("tp_size", 1) > 1 and got.get("enabled", True):
                tp_size, tp_source = got["tp_size"], f"{key}.tp_size"
    if tp_source is None and top.get("mp_size", 1) > 1:
        tp_size, tp_source = top["mp_size"], f"mp_size (deprecated: {lookup('init_inference.mp_size').replaced_by})"
    for key, name in (("moe", "moe"), ("quant", "quant"), ("checkpoint_config", "checkpoint_config"),
                      ("ckpt_config", "checkpoint_config")):
        if isinstance(raw.get(key), dict):
            _section(raw[key], name, key, invalid)
    ckpt, zero = raw.get("checkpoint"), raw.get("zero")
    if isinstance(zero, dict):
        invalid += unknown(check_section(zero, "zero_optimization", "zero.", INFERENCE)[0])
    else:
        zero = None
    settings = InferenceSettings(
        dtype=dtype, dtype_set=dtype_set, tp_size=tp_size, tp_source=tp_source,
        kernel_inject=top.get("replace_with_kernel_inject", False), enable_cuda_graph=top.get("enable_cuda_graph", False),
        max_out_tokens=top.get("max_out_tokens", 1024),
        checkpoint=ckpt if isinstance(ckpt, str) else ("dict" if isinstance(ckpt, dict) else None),
        zero=zero, invalid=invalid, zero_source="zero" if zero is not None else None,
    )
    return settings if zero is not None else _with_handed_zero(raw, settings)


def _dtype(raw: dict, invalid: list) -> tuple[str, bool]:
    if "dtype" not in raw:
        return "fp16", False
    value = raw["dtype"]
    if not isinstance(value, str):
        invalid.append(("dtype", f"must be a string such as \"bf16\", not {value!r} (TypeError in the validator)"))
    elif dtype_name(value) is None:
        invalid.append(("dtype", f"'{value}' is not a valid DtypeEnum: use fp16, bf16, fp32 or int8 "
                                 "(or torch.float16, bfloat16, ...)"))
    else:
        return dtype_name(value), True
    return "fp16", True


def _with_handed_zero(raw: dict, settings: InferenceSettings) -> InferenceSettings:
    """A ZeRO (training) config handed to init_inference as ``args=`` (or its alias ``config``): the
    DeepSpeedInferenceConfig takes it as the model's config, and its zero_optimization does nothing there."""
    for key in ("args", "config"):
        handed = raw.get(key)
        if isinstance(handed, dict) and isinstance(handed.get("zero_optimization"), dict):
            settings.zero, settings.zero_source = dict(handed["zero_optimization"]), key
            break
    return settings
