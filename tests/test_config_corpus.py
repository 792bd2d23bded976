"""Every real config in the corpus: it loads, and dsdoctor's effective stage and offload devices equal what
DeepSpeed's own config models (and accelerate's plugin, for accelerate YAMLs) compute for it."""
import os
from pathlib import Path

import pytest

from dsdoctor.config.check import INIT_INFERENCE_ALL_KEYS, check
from dsdoctor.config.effective import (
    BF16_FIELDS, FP16_FIELDS,
    OFFLOAD_OPTIMIZER_FIELDS, OFFLOAD_PARAM_FIELDS, REMOVED_TOP_LEVEL_KEYS, REMOVED_ZERO_KEYS, ZERO_FIELDS,
    effective_settings,
)
from dsdoctor.config.load import load_config
from tests.helpers import CORPUS as _HELPERS_CORPUS

# tests.helpers.CORPUS is <repo>/../shared/...: right for /work/main, not for a worktree under /work/wt
CORPUS = next((p for p in (Path(os.environ.get("DSDOCTOR_CORPUS", _HELPERS_CORPUS)), _HELPERS_CORPUS,
                           Path("/work/shared/corpus/ds_configs")) if p.is_dir()), _HELPERS_CORPUS)
if not CORPUS.is_dir():
    pytest.skip(f"config corpus not found at {CORPUS}", allow_module_level=True)
FILES = sorted(p for p in CORPUS.iterdir() if p.name != "INDEX.tsv")


def _model_keys(model):
    return {n for n in model.model_fields} | {f.alias for f in model.model_fields.values() if f.alias}


def test_corpus_is_there():
    assert len(FILES) >= 40


def test_key_tables_match_deepspeed_models():
    from deepspeed.inference.config import DeepSpeedInferenceConfig
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig,
    )

    assert ZERO_FIELDS == _model_keys(DeepSpeedZeroConfig)
    assert OFFLOAD_PARAM_FIELDS == _model_keys(DeepSpeedZeroOffloadParamConfig)
    assert OFFLOAD_OPTIMIZER_FIELDS == _model_keys(DeepSpeedZeroOffloadOptimizerConfig)
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

    assert FP16_FIELDS == _model_keys(DeepSpeedFP16Config) and BF16_FIELDS == _model_keys(DeepSpeedBF16Config)
    assert INIT_INFERENCE_ALL_KEYS == _model_keys(DeepSpeedInferenceConfig)
    assert REMOVED_TOP_LEVEL_KEYS == set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert REMOVED_ZERO_KEYS == set(ds_config._REMOVED_ZERO_CONFIG_KEYS)


def _deepspeed_reading(raw):
    """(stage, offload_param device, offload_optimizer device, dtype) per DeepSpeed 0.19.8, or the error."""
    from deepspeed.runtime.config import _reject_removed_config_keys
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
    from deepspeed.runtime.zero.config import get_zero_config

    _reject_removed_config_keys(raw)
    z = get_zero_config(raw)
    bf16 = get_bfloat16_config(raw).enabled
    fp16 = get_float16_config(raw).enabled
    return (int(z.stage), z.offload_param.device if z.offload_param else "none",
            z.offload_optimizer.device if z.offload_optimizer else "none",
            "bf16" if bf16 else "fp16" if fp16 else "fp32")


@pytest.mark.parametrize("path", FILES, ids=[p.name[:70] for p in FILES])
def test_corpus_effective_matches_deepspeed(path):
    loaded = load_config(path)
    eff = effective_settings(loaded.raw)
    ours = (eff.zero_stage, eff.offload_param.device, eff.offload_optimizer.device, eff.dtype)
    try:
        theirs = _deepspeed_reading(loaded.raw)
    except Exception as exc:  # DeepSpeed rejects the config: we must say so (DSD114), with the same key
        assert eff.invalid_keys, f"DeepSpeed rejects {path.name} ({exc}) but dsdoctor found nothing"
        first_key = eff.invalid_keys[0][0].split(".")[-1]
        assert first_key in str(exc) or "removed" in str(exc)
        codes = {f.code for f in check(loaded).findings}
        assert "DSD114" in codes
        return
    assert ours == theirs
    assert not eff.invalid_keys, eff.invalid_keys
    check(loaded).to_dict("zh")  # every corpus file renders


ACCELERATE = [p for p in FILES if "accelerate_configs" in p.name or "accelerate_ds_zero3" in p.name]


@pytest.mark.parametrize("path", ACCELERATE, ids=[p.name[:70] for p in ACCELERATE])
def test_accelerate_yaml_matches_accelerate_plugin(path, monkeypatch):
    import yaml
    from accelerate.utils import DeepSpeedPlugin

    data = yaml.safe_load(path.read_text())
    ds = data["deepspeed_config"]
    for var in [v for v in os.environ if v.startswith("ACCELERATE_")]:
        monkeypatch.delenv(var)
    plugin = DeepSpeedPlugin(
        zero_stage=ds.get("zero_stage"), offload_param_device=ds.get("offload_param_device"),
        offload_optimizer_device=ds.get("offload_optimizer_device"),
        gradient_accumulation_steps=ds.get("gradient_accumulation_steps"),
        gradient_clipping=ds.get("gradient_clipping"), zero3_save_16bit_model=ds.get("zero3_save_16bit_model"),
    )
    theirs = plugin.deepspeed_config
    ours = load_config(path).raw
    assert ours["zero_optimization"] == theirs["zero_optimization"]
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert ours[key] == theirs[key]
    eff = effective_settings(ours)
    assert (eff.zero_stage, eff.offload_param.device) == _deepspeed_reading(theirs)[:2]
