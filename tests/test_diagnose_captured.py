"""diagnose -- COMMAND without --config/--model: the report is about what that run passed to DeepSpeed (the
config captured at deepspeed.initialize / HfDeepSpeedConfig / init_inference), the model it built and the
workload it generated with; never about the bundled example."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import SCRIPTS, deepspeed_env, free_port, run_cli

DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
BUNDLED_ONLY = {"DSD101", "DSD102", "DSD105", "DSD203"}  # what the bundled 7B training example reports


def _diagnose(out, *command, env=None):
    r = run_cli("diagnose", "--out", str(out), "--format", "json", "--timeout", "400", "--", *map(str, command),
                env=env, timeout=600)
    return r, json.loads(r.stdout) if r.stdout.strip() else None


@pytest.mark.process
def test_hfdeepspeedconfig_dict_in_code_is_captured_and_diagnosed(tmp_path):
    out = tmp_path / "d"
    r, data = _diagnose(out, sys.executable, SCRIPTS / "generate_plain.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert data["sources"]["config"] == "captured from HfDeepSpeedConfig: a dict built in the script"
    assert data["sources"]["model"].startswith("captured from the run: LlamaForCausalLM")
    assert data["sources"]["workload"] == "batch 3, prompt 5 tokens, 4 new tokens (from the run)"
    assert json.loads((out / "ds_config_captured.json").read_text()) == {
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    model = json.loads((out / "model" / "config.json").read_text())
    assert model["hidden_size"] == 32 and model["architectures"] == ["LlamaForCausalLM"]
    steps = {(s["step"], i): s for i, s in enumerate(data["steps"])}
    check = steps[("effective", 0)]
    assert check["status"] == "done" and check["summary"].startswith("ZeRO stage 3, offload_param cpu")
    assert not BUNDLED_ONLY & {f["code"] for f in data["findings"]}
    assert "bundled example" not in (out / "report.md").read_text()


def test_bundled_example_says_so():
    from dsdoctor.diagnose import DiagnoseResult

    r = DiagnoseResult("ex.json", "llama-7b", "out", [], None, sources={"config": "bundled example",
                                                                      "model": "bundled example"})
    assert "bundled example" in r.to_markdown() and "bundled example" in r.to_text()
    assert "内置示例" in r.to_markdown("zh")


@pytest.mark.deepspeed
def test_two_rank_script_with_its_config_in_code_is_reported_on_its_own_terms(tmp_path):
    out = tmp_path / "d"
    r, data = _diagnose(out, DEEPSPEED, "--num_gpus", "2", "--master_port", free_port(),
                        SCRIPTS / "infer_config_in_code.py", "--batch", "2", "--new-tokens", "8",
                        env=deepspeed_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert data["sources"]["config"] == "captured from deepspeed.initialize: a dict built in the script"
    assert data["sources"]["workload"] == "batch 2, prompt 6 tokens, 8 new tokens (from the run)"
    assert json.loads((out / "ds_config_captured.json").read_text()) == {
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    traced = next(s for s in data["steps"] if s["step"] == "effective" and "trace" in s["data"])["data"]["trace"]
    assert [x["zero_stage"] for x in traced["ranks"]] == [3, 3]
    captured = traced["ranks"][0]["model_captured"]
    assert captured["model_class"] == "LlamaForCausalLM" and captured["num_params"] > 0
    assert captured["num_params"] // 10**6 == 0 and str(round(captured["num_params"] / 1e6, 2)) in \
        data["sources"]["model"]
    plan = next(s for s in data["steps"] if s["step"] == "need-zero3")
    assert plan["status"] == "done"
    split = next(s for s in data["steps"] if s["step"] == "split")
    assert split["status"] == "done" and split["data"]["config"]["zero_optimization"]["stage"] == 3
    codes = {f["code"] for f in data["findings"]}
    assert not BUNDLED_ONLY & codes, codes  # only this run's findings: no optimizer, no "auto"
    report = (out / "report.md").read_text()
    assert "bundled example" not in report and "train_zero3_offload" not in report


@pytest.mark.deepspeed
def test_init_inference_script_is_not_told_to_split(tmp_path):
    out = tmp_path / "d"
    r, data = _diagnose(out, sys.executable, SCRIPTS / "init_inference_tiny.py", env=deepspeed_env())
    assert r.returncode == 0, r.stderr[-3000:]
    steps = data["steps"]
    assert steps[0]["step"] == "effective" and steps[0]["status"] == "skipped"
    assert "init_inference" in steps[0]["summary"]
    split = next(s for s in steps if s["step"] == "split")
    assert split["status"] == "skipped" and not (out / "ds_inference.json").exists()
    assert not any("dsdoctor split" in f["fix"] for f in data["findings"])
    assert data["sources"]["model"].startswith("captured from the run: LlamaForCausalLM")
    exit_step = next(s for s in steps if s["step"] == "exit")
    assert "does not use ZeRO-3" in exit_step["summary"]  # nothing to leave


def test_workload_flags_win_then_the_run_then_defaults_that_fit_the_model():
    from dsdoctor.diagnose_inputs import _workload

    run = {"batch": 2, "prompt_len": 6, "new_tokens": 8}
    assert _workload(None, None, None, run) == (2, 6, 8, "from the run")
    assert _workload(4, None, None, run)[:3] == (4, 6, 8)
    assert _workload(None, None, None, None) == (1, 512, 128, "defaults")
    b, p, n, _ = _workload(None, None, None, None, max_positions=128)  # a small model, no generate observed
    assert p + n <= 128 and p > n > 0


@pytest.mark.process
def test_encoder_decoder_run_is_not_planned_as_a_decoder(tmp_path):
    out = tmp_path / "d"
    r, data = _diagnose(out, sys.executable, SCRIPTS / "t5_generate.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert data["sources"]["config"].startswith("the run passed no config")
    assert "T5ForConditionalGeneration" in data["sources"]["model"] and "encoder-decoder" in data["sources"]["model"]
    plan = next(s for s in data["steps"] if s["step"] == "need-zero3")
    assert plan["status"] == "skipped" and "encoder-decoder" in plan["summary"]
    assert data["sources"]["workload"] == "batch 3, prompt 20 tokens, 5 new tokens (from the run)"


# ms-swift's swift/llm/ds_config/zero3_offload.json (a public training config, "auto" everywhere the HF Trainer
# fills in): passed unchanged to an inference script, the run dies at load
SWIFT_ZERO3_OFFLOAD = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def _tiny_model_dir(path: Path) -> Path:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from tiny_models import LLAMA
    finally:
        sys.path.remove(str(SCRIPTS))
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(LLAMA, architectures=["LlamaForCausalLM"])))
    return path


@pytest.mark.deepspeed
def test_a_run_that_dies_at_load_still_ends_with_a_way_out(tmp_path):
    """The unchanged script builds its model under HfDeepSpeedConfig with ms-swift's zero3_offload.json: zero.Init
    raises on the "auto" batch size before any model exists, and the run never generates. ab (run because the run
    failed, on CPU ranks too) finds that split runs; its trace says the model, dtype and workload (batch 4,
    prompt 24, 8 new tokens, as the command said), so step 2 plans and step 5 gives the way out with its code,
    each saying where its inputs came from."""
    (tmp_path / "zero3_offload.json").write_text(json.dumps(SWIFT_ZERO3_OFFLOAD))
    model = _tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "d"
    r, data = _diagnose(out, sys.executable, SCRIPTS / "infer_flags.py", "--config", tmp_path / "zero3_offload.json",
                        "--model", model, "--batch", "4", "--prompt-len", "24", "--new-tokens", "8", "--hf",
                        env=deepspeed_env())
    assert data is not None, r.stderr[-3000:]
    steps = {s["step"]: s for s in data["steps"] if not (s["step"] == "effective" and "trace" in s["data"])}
    traced = next(s for s in data["steps"] if s["step"] == "effective" and "trace" in s["data"])
    assert traced["data"]["trace"]["status"] == "error"  # died at load: no model, no generate
    assert not traced["data"]["trace"]["ranks"][0]["model_captured"]
    assert steps["ab"]["status"] == "done" and data["findings"]
    fix = next(f for f in data["findings"] if f["code"] == "DSD316")
    assert fix["message"].startswith("split runs where as-is raised TypeError"), fix["message"]
    assert data["sources"]["model"].startswith("captured from ab's variant split: LlamaForCausalLM")
    assert data["sources"]["workload"] == "batch 4, prompt 24 tokens, 8 new tokens (from ab's variant split)"
    plan = steps["need-zero3"]
    assert plan["status"] == "done", plan["summary"]
    assert "Inputs: model captured from ab's variant split" in plan["summary"]
    assert plan["data"]["inputs"]["workload"].startswith("batch 4, prompt 24 tokens, 8 new tokens")
    way_out = steps["exit"]
    assert way_out["status"] == "done" and way_out["data"]["path"] == data["recommended_path"] == "plain"
    assert "from_pretrained" in way_out["data"]["code"] and "Inputs: model" in way_out["summary"]
    summary = data["summary"]
    assert summary["before"]["path"] == "as-is (measured)" and summary["before"]["fits"] is False
    assert summary["after"]["path"] == "plain" and summary["actions"]
    assert "split runs where as-is raised TypeError" in summary["verdict"]


def test_the_commands_own_flags_say_the_model_and_workload():
    from dsdoctor.diagnose_inputs import _workload, command_flags

    cmd = ["deepspeed", "--num_gpus", "2", "infer.py", "--model_name_or_path=/m", "--batch-size", "4",
           "--max_new_tokens", "32", "--prompt-len", "1024", "--dtype", "bf16", "--batch", "x"]
    flags = command_flags(cmd)
    assert flags == {"model": "/m", "model flag": "--model_name_or_path", "batch": 4, "new_tokens": 32,
                     "prompt_len": 1024, "dtype": "bf16"}
    assert _workload(None, None, None, [(None, "the run"), (flags, "the command line")]) == \
        (4, 1024, 32, "from the command line")
    assert _workload(2, None, None, [({"batch": 3, "prompt_len": 5}, "the run"), (flags, "the command line")])[3] \
        == "batch given, prompt from the run, new tokens from the command line"
