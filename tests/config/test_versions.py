"""Version-dependent behaviour (issue 13, item 3): the installed (or given) DeepSpeed, transformers and accelerate
versions decide whether a config runs; hybrid_engine and weight_quantization sections."""
import json
import subprocess
import sys
from importlib import metadata

import pytest

from dsdoctor.config.check import check
from dsdoctor.config.versions import resolve_versions
from tests.helpers import DATA as HELPERS_DATA
from tests.helpers import run_cli, write_model_config

DATA = HELPERS_DATA / "configs"


def codes(result):
    return {f.code: f.effective_severity for f in result.findings}


OLD = {"transformers": "4.44.2", "deepspeed": "0.15.0"}


def test_float_prefetch_bucket_from_old_transformers_on_new_deepspeed(tmp_path):
    model = write_model_config(tmp_path / "m", hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                               num_key_value_heads=32)
    r = check(DATA / "llamafactory_train_z3.yaml", versions=OLD, model=model)
    f = next(f for f in r.findings if f.code == "DSD126")
    assert f.effective_severity == "error" and f.values["suggested"] == "15099494"
    assert "4.45.0" in f.fix("en")
    assert "DSD126" not in codes(check(DATA / "llamafactory_train_z3.yaml", versions=dict(OLD, transformers="4.45.0")))
    assert "DSD126" not in codes(check(DATA / "llamafactory_train_z3.yaml", versions=dict(OLD, deepspeed="0.14.4")))


def test_a_whole_float_passes_so_no_finding(tmp_path):
    model = write_model_config(tmp_path / "m", hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                               num_key_value_heads=40)
    assert "DSD126" not in codes(check(DATA / "llamafactory_train_z3.yaml", versions=OLD, model=model))


def test_deepspeed_really_rejects_the_fractional_float_and_accepts_the_whole_one():
    """DSD126's claim, against the installed DeepSpeed (>= 0.15)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    with pytest.raises(Exception, match="int_from_float|fractional"):
        DeepSpeedZeroConfig(stage=3, stage3_prefetch_bucket_size=0.9 * 4096 * 4096)
    assert DeepSpeedZeroConfig(stage=3, stage3_prefetch_bucket_size=0.9 * 5120 * 5120).prefetch_bucket_size == 23592960


def test_raw_deepspeed_config_gets_no_float_finding():
    # nothing fills "auto" there (DSD105 says so), so no float either
    assert "DSD126" not in codes(check(DATA / "ds_z3_auto.json", versions=OLD))


def test_pin_memory_default_by_version(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert codes(check(cfg, versions={"deepspeed": "0.18.9"}))["DSD127"] == "warning"
    f = next(f for f in check(cfg, versions={"deepspeed": "0.19.5"}).findings if f.code == "DSD127")
    assert "may default" in f.message("en")
    assert "DSD127" not in codes(check(cfg, versions={"deepspeed": "0.19.8"}))
    pinned = json.loads(json.dumps(cfg))
    pinned["zero_optimization"]["offload_param"]["pin_memory"] = False
    assert "DSD127" not in codes(check(pinned, versions={"deepspeed": "0.18.9"}))


def test_installed_deepspeed_defaults_pin_memory_to_true():
    """DSD127 treats the installed 0.19.8 as pinning by default: true of its model."""
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig

    if metadata.version("deepspeed").startswith("0.19.8"):
        assert DeepSpeedZeroOffloadParamConfig().pin_memory is True


AUTOTP_Z3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
             "tensor_parallel": {"autotp_size": 2}}


def test_dsd103_says_what_the_installed_version_does():
    installed = metadata.version("deepspeed")
    f = next(f for f in check(AUTOTP_Z3).findings if f.code == "DSD103")
    assert installed in f.message("en") and "accepts AutoTP with ZeRO-3" in f.message("en")
    old = check(AUTOTP_Z3, versions={"deepspeed": "0.19.3"})
    assert codes(old)["DSD130"] == "error"
    assert "refuses" in next(f for f in old.findings if f.code == "DSD103").message("en")


@pytest.mark.process
def test_versions_read_from_metadata_without_importing(tmp_path):
    code = ("import sys; from dsdoctor.config.versions import resolve_versions; v = resolve_versions();"
            "print(v.values['deepspeed'], v.values['transformers']);"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'transformers')]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [metadata.version("deepspeed"), metadata.version("transformers")]
    assert resolve_versions({"deepspeed": "0.15.0"}).sources["deepspeed"] == "--deepspeed-version"


@pytest.mark.process
def test_bad_version_flag_is_bad_input():
    proc = run_cli("check", DATA / "ds_z3_auto.json", "--deepspeed-version", "latest")
    assert proc.returncode == 2 and "--deepspeed-version" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.process
def test_cli_version_flags_show_in_text():
    proc = run_cli("check", DATA / "llamafactory_train_z3.yaml", "--transformers-version", "4.44.2",
                   "--deepspeed-version", "0.15.0", "--lang", "en")
    assert proc.returncode == 1 and "DSD126" in proc.stdout
    assert "transformers 4.44.2 (--transformers-version)" in proc.stdout


def test_hybrid_engine_under_zero3_gathers_everything():
    r = check(DATA / "hybrid_engine_z3.json", gpus=2)
    f = next(f for f in r.findings if f.code == "DSD128")
    assert "gathers every layer" in f.message("en") and "does not divide the 2 ranks" in f.message("en")
    from deepspeed.runtime.config import DeepSpeedConfig

    assert DeepSpeedConfig(json.loads((DATA / "hybrid_engine_z3.json").read_text())).hybrid_engine.pin_parameters


def test_weight_quantization_needs_stage3_and_zero_init():
    r = check(DATA / "weight_quant_z2.json")
    assert next(f for f in r.findings if f.code == "DSD129").values["part"] == "quantized_initialization"
    z3 = json.loads((DATA / "weight_quant_z2.json").read_text())
    z3["zero_optimization"] = {"stage": 3}
    assert codes(check(z3))["DSD129"] == "info"


def test_weight_quantization_unknown_key_matches_deepspeed():
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = {"train_micro_batch_size_per_gpu": 1, "weight_quantization": {"quantized_init": {"num_bits": 4}}}
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="quantized_init"):
        DeepSpeedConfig(cfg)
    assert codes(check(cfg))["DSD114"] == "error"


def test_accelerate_runner_checks_both_fillers(tmp_path):
    (tmp_path / "ds.json").write_text((DATA / "ds_z3_auto.json").read_text())
    y = tmp_path / "acc.yaml"
    y.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n")
    new = {"transformers": "4.46.0", "deepspeed": "0.16.0"}
    f = next(f for f in check(y, versions=dict(new, accelerate="0.30.1")).findings if f.code == "DSD126")
    assert "accelerate 0.30.1" in f.message("en")
    assert "DSD126" not in codes(check(y, versions=dict(new, accelerate="0.31.0")))


def test_hybrid_engine_and_weight_quantization_show_in_the_table_and_json():
    r = check(DATA / "hybrid_engine_z3.json")
    assert r.sections["hybrid_engine"] == {"enabled": True, "pin_parameters": True, "inference_tp_size": 4}
    assert "enabled: DeepSpeedHybridEngine" in r.to_text("en")
    w = check(DATA / "weight_quant_z2.json")
    assert w.to_dict()["sections"]["weight_quantization"]["num_bits"] == 4
    assert "int4 quantized_initialization (no effect: needs stage 3)" in w.to_text("en")
