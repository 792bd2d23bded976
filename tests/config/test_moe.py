"""check with a mixture-of-experts model under ZeRO-3: every expert gathered per forward (DSD117, with the figures
of the one parameter counter), and the hang of one-module-per-expert blocks where the user's transformers has them
(DSD118, naming the block class to make a ZeRO-3 leaf)."""
import json
import shutil

import pytest

from dsdoctor.config.check import check
from dsdoctor.model.moe import BLOCK_CLASS, SKIPS_UNCHOSEN_4X, hang_risk
from dsdoctor.model.spec import load_model_spec
from dsdoctor.units import human_bytes
from tests.helpers import ROOT, run_cli

ARCH = ROOT / "tests" / "data" / "arch_configs"
Z3 = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}


def _model(tmp_path, name):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    shutil.copy(ARCH / f"{name}.json", d / "config.json")
    return d


def _found(result):
    return {f.code: f for f in result.findings}


def test_zero3_inference_on_qwen3_moe_says_every_expert_is_gathered_with_the_counted_figures(tmp_path):
    found = _found(check(Z3, model=_model(tmp_path, "qwen3-30b-a3b"), versions={"transformers": "5.24.0"}))
    f = found["DSD117"]
    assert f.values["experts"] == 128 and f.values["top_k"] == 8 and f.values["layers"] == 48
    # 30.53B total, 3.35B active per token, bf16
    assert f.values["gathered"] == "56.9 GiB" and f.values["active"] == "6.2 GiB" and f.values["ratio"] == "9.1"
    assert "expert parallelism" in f.fix() and "--enable-expert-parallel" in f.fix()
    assert "DSD118" not in found  # transformers 5: fused experts, gathered whole on every rank


@pytest.mark.parametrize("name,model_type,cls", [
    ("qwen3-30b-a3b", "qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    ("mixtral-8x7b", "mixtral", "MixtralSparseMoeBlock"),
    ("deepseek-v2-lite", "deepseek_v2", "DeepseekV2MoE"),
    ("deepseek-v3", "deepseek_v3", "DeepseekV3MoE"),
    ("qwen1.5-moe-a2.7b", "qwen2_moe", "Qwen2MoeSparseMoeBlock"),
])
def test_transformers_4_names_the_block_class_to_make_a_zero3_leaf(tmp_path, name, model_type, cls):
    """Before DeepSpeed made any block a leaf by itself (0.17), every family that skips unchosen experts."""
    f = _found(check(Z3, model=_model(tmp_path, name), versions={"transformers": "4.57.6", "deepspeed": "0.17.0"}))
    f = f["DSD118"]
    assert f.values["cls"] == cls and f.values["transformers"] == "4.57.6"
    assert f"from transformers.models.{model_type}.modeling_{model_type} import {cls}" in f.fix()
    assert f"set_z3_leaf_modules(model, [{cls}])" in f.fix()


def test_deepspeed_makes_mixtral_and_qwen_blocks_leaves_by_itself_but_not_deepseek(tmp_path):
    """DeepSpeed 0.19.8's zero_optimization.leaf_module defaults list Mixtral, Qwen2-MoE, Qwen3-MoE (measured: 4.57.6's
    Mixtral finishes on 2 CPU ranks); a config that empties the list loses them."""
    versions = {"transformers": "4.57.6", "deepspeed": "0.19.8"}
    for name in ("qwen3-30b-a3b", "mixtral-8x7b", "qwen1.5-moe-a2.7b"):
        assert "DSD118" not in _found(check(Z3, model=_model(tmp_path, name), versions=versions)), name
    assert "DSD118" in _found(check(Z3, model=_model(tmp_path, "deepseek-v2-lite"), versions=versions))
    emptied = dict(Z3, zero_optimization={"stage": 3, "leaf_module": {"classes": []}})
    assert "DSD118" in _found(check(emptied, model=_model(tmp_path, "mixtral-8x7b"), versions=versions))
    named = dict(Z3, zero_optimization={"stage": 3, "leaf_module": {"classes": ["MixtralSparseMoeBlock"]}})
    assert "DSD118" not in _found(check(named, model=_model(tmp_path, "mixtral-8x7b"), versions=versions))


def test_families_that_run_every_expert_or_index_tensors_do_not_hang(tmp_path):
    """OLMoE 4.x loops over every expert; gpt-oss indexes its 3-D tensors: no DSD118, DSD117 still."""
    for name in ("olmoe-1b-7b", "gpt-oss-20b"):
        found = _found(check(Z3, model=_model(tmp_path, name), versions={"transformers": "4.57.6"}))
        assert "DSD117" in found and "DSD118" not in found, name
    assert set(SKIPS_UNCHOSEN_4X) < set(BLOCK_CLASS)
    assert not hang_risk(None, "mixtral", (4, 57, 6))
    assert hang_risk(load_model_spec(ARCH / "deepseek-v3.json").moe, "deepseek_v3", None, (0, 19, 8))


def test_no_moe_finding_for_a_dense_model_or_below_stage_3(tmp_path):
    dense = _found(check(Z3, model=_model(tmp_path, "llama-2-7b"), versions={"transformers": "4.57.6"}))
    assert not {"DSD117", "DSD118"} & set(dense)
    z2 = dict(Z3, zero_optimization={"stage": 2})
    moe = _found(check(z2, model=_model(tmp_path, "mixtral-8x7b"), versions={"transformers": "4.57.6"}))
    assert not {"DSD117", "DSD118"} & set(moe)


def test_training_under_zero3_gets_the_hang_but_not_the_inference_gather(tmp_path):
    found = _found(check(Z3, mode="train", model=_model(tmp_path, "deepseek-v2-lite"),
                         versions={"transformers": "4.57.6", "deepspeed": "0.19.8"}))
    assert "DSD118" in found and "DSD117" not in found


@pytest.mark.process
def test_the_cli_prints_both_in_chinese_too(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(Z3))
    r = run_cli("check", str(cfg), "--model", str(_model(tmp_path, "qwen3-30b-a3b")), "--transformers-version",
                "4.57.6", "--deepspeed-version", "0.17.0", "--lang", "zh")
    assert r.returncode == 1, r.stderr
    assert "DSD117" in r.stdout and "每次前向都 gather 全部专家" in r.stdout
    assert "DSD118" in r.stdout and "set_z3_leaf_modules(model, [Qwen3MoeSparseMoeBlock])" in r.stdout


@pytest.mark.process
def test_check_prints_the_one_count_for_every_held_out_moe(tmp_path):
    """check's model line and DSD117 for configs no other test uses: the counter's figures (tests/model/test_moe.py
    holds them within 2% of transformers' meta-device model)."""
    held_out = sorted((ROOT / "tests" / "data" / "moe_held_out").glob("*.json"))
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(Z3))
    for path in held_out:
        d = tmp_path / path.stem
        d.mkdir()
        shutil.copy(path, d / "config.json")
        r = run_cli("check", str(cfg), "--model", str(d), "--format", "json", "--transformers-version", "5.24.0")
        assert r.returncode == 0, r.stderr  # DSD117 is a warning
        out, spec = json.loads(r.stdout), load_model_spec(path)
        assert (out["model"]["num_params"], out["model"]["active_params"]) == (spec.num_params, spec.active_params)
        f = next(f for f in out["findings"] if f["code"] == "DSD117")
        assert f["values"]["experts"] == spec.moe.num_experts and f["values"]["layers"] == len(spec.moe.moe_layers)
        assert f["values"]["gathered"] == human_bytes(spec.num_params * 2), path.stem
        assert f["values"]["active"] == human_bytes(spec.active_params * 2), path.stem
