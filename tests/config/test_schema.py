"""The one schema table (``config/schema.py``) against DeepSpeed's own pydantic models: every section's keys,
aliases, value types and bounds, defaults and deprecations, so the table cannot drift from the installed
DeepSpeed. DeepSpeed is imported here only: the static commands that read the table never import it."""
import importlib
import typing

import pytest

from dsdoctor.config import schema
from dsdoctor.errors import InputError

MODELS = {
    "zero_optimization": "deepspeed.runtime.zero.config:DeepSpeedZeroConfig",
    "zero_optimization.offload_param": "deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadParamConfig",
    "zero_optimization.offload_optimizer": "deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadOptimizerConfig",
    "fp16": "deepspeed.runtime.precision_config:DeepSpeedFP16Config",
    "bf16": "deepspeed.runtime.precision_config:DeepSpeedBF16Config",
    "weight_quantization": "deepspeed.inference.config:WeightQuantConfig",
    "init_inference": "deepspeed.inference.config:DeepSpeedInferenceConfig",
    "init_inference.tensor_parallel": "deepspeed.inference.config:DeepSpeedTPConfig",
    "init_inference.moe": "deepspeed.inference.config:DeepSpeedMoEConfig",
    "init_inference.quant": "deepspeed.inference.config:QuantizationConfig",
    "init_inference.checkpoint_config": "deepspeed.inference.config:InferenceCheckpointConfig",
}


def _model(section):
    module, name = MODELS[section].split(":")
    return getattr(importlib.import_module(module), name)


def _their_type(info):
    """DeepSpeed's annotation and bounds in the table's words (None: a type the table names on its own)."""
    ann, meta = info.annotation, {type(m).__name__ for m in info.metadata}
    if ann is bool:
        return "bool"
    if ann == typing.Optional[bool]:  # noqa: UP045  (DeepSpeed's annotation, as written)
        return "bool?"
    if ann is int:
        return "int>0" if "Gt" in meta else "int>=0" if "Ge" in meta else "int"
    if ann is float:
        return "ratio" if {"Ge", "Le"} <= meta else "float"
    return None


def test_every_section_of_the_table_is_compared():
    assert set(schema.SECTIONS) == set(MODELS) | {""}


@pytest.mark.parametrize("section", MODELS)
def test_keys_and_aliases_match_deepspeed(section):
    theirs = {n: {f.alias} - {None, n} for n, f in _model(section).model_fields.items()}
    assert {f.name: set(f.aliases) for f in schema.fields(section)} == theirs


@pytest.mark.parametrize("section", MODELS)
def test_types_and_bounds_match_deepspeed(section):
    for f in schema.fields(section):
        theirs = _their_type(_model(section).model_fields[f.name])
        ours = {"int!": "int", "float>=0": "float"}.get(f.type, f.type)
        assert theirs is None or ours == theirs, f.path
        assert theirs is not None or f.type not in schema.CHECKED[:8], f.path


def _plain(value):
    value = getattr(value, "value", value)  # an enum: its value
    return str(value) if type(value).__module__ == "torch" else value


@pytest.mark.parametrize("section", MODELS)
def test_defaults_match_deepspeed(section):
    import torch  # DeepSpeed's default dtype is a torch.dtype

    from dsdoctor.config.inference_config import DTYPE_SPELLINGS

    model = _model(section)
    for f in schema.fields(section):
        theirs = _plain(model.model_fields[f.name].get_default(call_default_factory=True))
        if f.type == "dtype":
            assert theirs == str(torch.float16) and theirs in DTYPE_SPELLINGS[f.default]
        elif isinstance(theirs, (bool, int, float, str, list, dict, type(None))):
            assert f.default == theirs and isinstance(f.default, bool) == isinstance(theirs, bool), f.path
        else:  # a nested model's instance: the table holds the section (None or {})
            assert f.type in ("obj", "any") and f.default in (None, {}), f.path


@pytest.mark.parametrize("section", MODELS)
def test_deprecations_match_deepspeed(section):
    """``new=X`` where DeepSpeed moves the value to X (and asserts when both are given); ``deprecated`` where it
    only warns."""
    model = _model(section)
    for f in schema.fields(section):
        extra = model.model_fields[f.name].json_schema_extra or {}
        moves = extra.get("deprecated") and extra.get("new_param") and extra.get("set_new_param", True)
        assert f.replaced_by == (extra["new_param"] if moves else None), f.path
        assert f.deprecated == bool(extra.get("deprecated")), f.path


def test_removed_keys_match_deepspeed():
    from deepspeed.runtime import config as ds_config

    assert schema.REMOVED_TOP_LEVEL_KEYS == set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert schema.REMOVED_ZERO_KEYS == set(ds_config._REMOVED_ZERO_CONFIG_KEYS)


def test_split_rows_have_reasons_in_both_languages():
    rows = [f for s in schema.SECTIONS for f in schema.fields(s) if f.split]
    assert {f.path for f in rows} >= {"optimizer", "zero_optimization.offload_optimizer", "fp16.loss_scale"}
    for f in rows:
        assert f.split in ("drop", "keep", "resolve") and f.reason["en"] and f.reason["zh"], f.path
        assert not f.training_only or f.split == "drop", f.path


@pytest.mark.parametrize("path,row", [
    ("zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.prefetch_bucket_size"),
    ("bfloat16.enabled", "bf16.enabled"), ("tm", None), ("zero_optimization.mics_shard_size", None),
    ("zero_optimization.offload_param.pin_memory", "zero_optimization.offload_param.pin_memory"),
    ("nosuch.key", None), ("bf16.loss_scale", None)])
def test_lookup_reads_every_spelling(path, row):
    f = schema.lookup(path)
    assert (f.path if f else None) == row


@pytest.mark.parametrize("kind,value,ok", [
    ("bool", "yes", True), ("bool", 2, None), ("bool?", None, None), ("int>0", 0, None), ("int>=0", "12", 12),
    ("int!", True, None), ("int", True, 1), ("ratio", 1.5, None), ("ratio", 0.5, 0.5), ("float>=0", "2.5", 2.5),
    ("float>=0", float("inf"), None), ("obj", [], None), ("obj", None, None), ("str|obj", "x", "x")])
def test_check_value_reads_like_pydantic_lax_mode(kind, value, ok):
    f = schema.Field("s", "k", kind, None)
    try:
        got = schema.check_value(f, "s.k", value)
    except InputError as exc:
        assert ok is None and exc.problem.startswith("s.k: ")
        return
    assert got == ok


def test_check_section_drops_auto_and_names_unknown_keys():
    errors, ok = schema.check_section({"enabled": "auto", "tp_size": "x", "bogus": 1, "tp_grain_size": 8},
                                      "init_inference.tensor_parallel", "tp.", schema.INFERENCE)
    assert ok == {"tp_grain_size": 8}
    assert [e[0] for e in errors] == ["tp.tp_size", "tp.bogus"]
    assert errors[1][1] == "unknown key: the model forbids extra keys (ValidationError)"


@pytest.mark.parametrize("config", [
    {"enable_cuda_graph": "auto", "tensor_parallel": {"tp_size": "auto"}},  # "auto" is dropped: accepted
    {"max_out_tokens": 0}, {"max_tokens": 8, "tm": "no"}, {"tensor_parallel": 4}, {"tp": {"tp_size": "x"}},
    {"moe": 3}, {"moe": {"num_experts": [2], "bogus": 1}}, {"checkpoint": 5}, {"ckpt_config": {"base_dir": "a"}},
    {"zero": {"stage": 3, "bogus": 1}}, {"dtype": "bf16", "replace_with_kernel_inject": "yes", "mp_size": 2}])
def test_init_inference_reader_rejects_what_deepspeed_rejects(config):
    from deepspeed.inference.config import DeepSpeedInferenceConfig

    from dsdoctor.config.inference_config import read_inference_config

    try:
        DeepSpeedInferenceConfig(**config)
        rejected = False
    except Exception:  # pydantic's ValidationError, or DeepSpeed's own assertion
        rejected = True
    assert bool(read_inference_config(config).invalid) == rejected


@pytest.mark.parametrize("zero", [{"zenflow": 5}, {"reduce_bucket_size": 0}, {"stage3_max_live_parameters": "auto"},
                                  {"overlap_comm": None, "module_granularity_threshold": -4}])
def test_zero_reader_rejects_what_deepspeed_rejects(zero):
    from deepspeed.runtime.zero.config import get_zero_config

    from dsdoctor.config.effective import effective_settings

    try:
        get_zero_config({"zero_optimization": zero})
        rejected = False
    except Exception:
        rejected = True
    eff = effective_settings({"zero_optimization": zero})
    assert bool(eff.invalid_keys) == rejected
    assert eff.reduce_bucket_size == 500_000_000  # a rejected knob reads as its default, as every other
