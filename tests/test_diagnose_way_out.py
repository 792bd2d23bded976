"""diagnose gives one answer: step 5's code, commands and config are the path step 2 recommends, and the report
leads with it (the summary). In-process, on bundled model shapes: no GPU, no download."""
from __future__ import annotations

import json

import pytest

from dsdoctor.diagnose import diagnose
from tests.helpers import EXAMPLES

TRAIN = EXAMPLES / "train_zero3_offload.json"  # a ZeRO-3 offload training config reused for inference


def _steps(result):
    return {s.key: s for s in result.steps}


def test_tp_recommendation_leaves_zero3_for_tensor_parallel_groups(tmp_path):
    """Qwen2-72B on 8 x 80 GiB: plan recommends tp2x4 (four groups of two GPUs), which is not ZeRO-3."""
    r = diagnose(config=str(TRAIN), model=str(EXAMPLES / "qwen2-72b"), gpus=8, gpu_memory="80GiB",
                 host_memory="2TiB", out=str(tmp_path / "d"))
    assert r.recommended_path == "tp2x4"
    steps = _steps(r)
    way_out = steps["exit"]
    text = way_out.summary["en"]
    assert "tensor parallelism in 4 groups of 2 GPUs" in text and "no zero_optimization" in text
    assert "ZeRO-3 (" not in text and "Keep ZeRO-3" not in text
    assert not any(c.startswith(("dsdoctor merge", "dsdoctor compare", "dsdoctor verify")) for c in way_out.commands)
    assert way_out.commands[0].startswith("deepspeed --include localhost:0,1") and len(way_out.commands) == 4
    assert 'tensor_parallel={"tp_size": 2}' in way_out.data["code"] and way_out.data["config"] is None
    # one tokens/s figure everywhere: the machine's, as plan's reason gives it
    plan = steps["need-zero3"]
    machine = plan.data["recommended"]["why"].split("about ", 1)[1].split(" tokens/s", 1)[0]
    assert "per rank" not in plan.summary["en"] and f"about {machine} tokens/s" in plan.summary["en"]
    assert f"about {machine} tokens/s for the machine" in r.summary.verdict["en"]
    assert r.summary.after["path"] == "tp2x4" and r.summary.before["path"] == "zero3-offload"
    assert r.summary.actions[0].commands == way_out.commands[:4]
    md = (tmp_path / "d" / "report.md").read_text()
    assert md.index("> **Verdict:**") < md.index("## 1. What takes effect")


def test_zero3_offload_recommendation_keeps_offload_param_in_the_way_out(tmp_path):
    """A ZeRO-3 config without offload, a 7B on one 12 GiB GPU: only zero3-offload fits. The way out's config
    must offload (the split config alone would not), and nothing is merged or compared without shards."""
    config = tmp_path / "z3.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                  "zero_optimization": {"stage": 3}}))
    out = tmp_path / "d"
    r = diagnose(config=str(config), model=str(EXAMPLES / "llama-7b"), gpus=1, gpu_memory="12GiB",
                 host_memory="256GiB", out=str(out))
    assert r.recommended_path == "zero3-offload"
    way_out = _steps(r)["exit"]
    written = json.loads((out / "ds_zero3-offload.json").read_text())
    assert written["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert written == way_out.data["config"]
    assert way_out.commands == [f"deepspeed --num_gpus 1 your_infer.py --deepspeed_config {out}/ds_zero3-offload.json"]
    assert "ds_zero3-offload.json" in way_out.summary["en"] and "zero3-offload" in way_out.summary["en"]
    assert "offload_param" not in json.loads((out / "ds_inference.json").read_text())["zero_optimization"]
    assert r.summary.after["path"] == "zero3-offload" and "needs ZeRO-3" in r.summary.verdict["en"]


def test_a_zero3_paths_config_offloads_only_where_the_path_offloads():
    """The split config keeps the training config's offload_param; the way out's config follows the path:
    zero3 (it fits without offload) drops it, zero3-offload keeps the user's own offload settings."""
    from dsdoctor.diagnose_exit import _path_config

    split = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1,
             "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False},
                                   "stage3_prefetch_bucket_size": 15099494}}
    recommended = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}}
    plain_zero3 = _path_config("zero3", split, {"zero_optimization": {"stage": 3}})
    assert "offload_param" not in plain_zero3["zero_optimization"]
    assert plain_zero3["zero_optimization"]["stage3_prefetch_bucket_size"] == 15099494  # the user's knobs stay
    assert _path_config("zero3-offload", split, recommended) == split  # pin_memory false kept: measured choice
    assert "offload_param" in split["zero_optimization"]  # the input is not mutated


@pytest.mark.parametrize("kind", ["zero", "args", "plain"])
def test_init_inference_configs_are_diagnosed(tmp_path, kind):
    """An init_inference config (with the legacy zero section, with a ZeRO config handed as args=, or plain)
    goes through every step: checked as DeepSpeedInferenceConfig reads it, planned, split or skipped."""
    raw = {"dtype": "bf16", "tensor_parallel": {"tp_size": 2}}
    if kind == "zero":
        raw["zero"] = {"stage": 3, "offload_param": {"device": "cpu"}}
    elif kind == "args":
        raw["args"] = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    config = tmp_path / "inf.json"
    config.write_text(json.dumps(raw))
    out = tmp_path / "d"
    r = diagnose(config=str(config), model=str(EXAMPLES / "llama-7b"), gpus=2, out=str(out))
    steps = _steps(r)
    codes = {f.code for f in steps["effective"].findings}
    split = steps["split"]
    if kind == "plain":
        assert "DSD122" not in codes and split.status == "skipped" and "init_inference" in split.summary["en"]
        assert not (out / "ds_inference.json").exists()
    else:
        assert "DSD122" in codes and split.status == "done"
        written = json.loads((out / "ds_inference.json").read_text())
        assert written["zero_optimization"]["stage"] == 3 and "zero" not in written and "args" not in written
    assert (out / "report.html").is_file() and steps["exit"].status == "done"


def test_without_a_model_the_way_out_is_the_variant_ab_measured(tmp_path):
    """A failed run whose model nothing says (no variant generated, no --model anywhere): step 5 still answers,
    with the variant ab measured as the fix, its config written beside the report, and the summary says it."""
    from dsdoctor.config.load import load_config
    from dsdoctor.diagnose_exit import _actions, _measured_exit
    from dsdoctor.diagnose_inputs import Inputs
    from dsdoctor.report.summary import before_after
    from dsdoctor.trace.diagnose_ab import AbResult, VariantResult
    from dsdoctor.trace.diagnose_ab import diagnose as ab_diagnose

    failed = VariantResult("as-is", "as-is", "error", None, 400 * 2**20, None, 5.0, 1, "cpu", optimizer="AdamW",
                           config_source=str(TRAIN))
    failed.endings = [{"kind": "exception", "phase": "init", "rank": 0, "detail": "TypeError: x", "signal": None,
                       "exit_code": 1, "evidence": None}]
    ran = VariantResult("plain", "plain", "ok", None, 300 * 2**20, 40.0, 5.0, 0, None, tokens_per_s_kind="first")
    ab = AbResult(["python", "infer.py"], [failed, ran], ab_diagnose([failed, ran]))
    sources = {"model": "the run built no model dsdoctor could read", "dtype": "the model's config.json",
               "workload": "batch 1, prompt 512 tokens, 128 new tokens (defaults)"}
    inputs = Inputs(str(TRAIN), load_config(str(TRAIN)), None, 2, None, (1, 512, 128, "defaults"), sources)
    step = _measured_exit(ab, inputs, tmp_path, tmp_path / "out")
    assert step.status == "done" and step.data["measured"] == "plain"
    written = json.loads((tmp_path / "ds_plain.json").read_text())
    assert written == step.data["config"] and written["zero_optimization"]["stage"] == 0
    assert "optimizer" not in written
    assert step.commands == [f"deepspeed --num_gpus 2 your_infer.py --deepspeed_config {tmp_path / 'out'}/ds_plain.json"]
    assert "variant `plain` runs (40.0 tokens/s)" in step.summary["en"] and "Inputs: model the run built no" in \
        step.summary["en"] and step.summary["zh"]
    action = _actions(step, None, None, ["python", "infer.py"], ab, None)[0]
    assert "ab's variant `plain`" in action.title["en"] and action.commands == step.commands
    before, after = before_after(None, None, None, ab)
    assert before["path"] == "as-is (measured)" and not before["fits"]
    assert after == {"path": "plain (measured)", "gpu_peak_bytes": None, "host_peak_bytes": 300 * 2**20,
                     "tokens_per_s": 40.0, "fits": True}


@pytest.mark.process
def test_every_file_written_says_the_dtype_of_the_code_on_a_v100(tmp_path, monkeypatch):
    """Issue 31.3: on a V100 (no bf16) plan runs a bf16 model in fp16; the split ds_inference.json, the path's
    config and step 5's code all say fp16 (the split config said bf16 before), and every config diagnose wrote
    passes dsdoctor's own check with nothing left that a deletion fixes."""
    import os
    import stat

    from dsdoctor.config.check import check
    from dsdoctor.config.effective import effective_settings

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\ncase "$1" in *compute_cap*) echo 7.0;; *) echo "0, Tesla V100-PCIE-16GB, 16384";; '
                   "esac\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    config = tmp_path / "z3.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": "auto"},
                                  "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0,
                                                        "offload_param": {"device": "cpu"}}}))
    out = tmp_path / "d"
    # the GPU as nvidia-smi lists it (diagnose takes no --gpu-name): a 16 GiB V100
    r = diagnose(config=str(config), model=str(EXAMPLES / "qwen2-72b"), host_memory="512GiB", out=str(out))
    assert r.recommended_path == "zero3-offload"
    way_out = _steps(r)["exit"]
    assert "torch.float16" in way_out.data["code"] and "bfloat16" not in way_out.data["code"]
    written = sorted(out.glob("ds_*.json"))
    assert [p.name for p in written] == ["ds_inference.json"]  # the path's config is the split one
    for path in written:
        cfg = json.loads(path.read_text())
        assert effective_settings(cfg).dtype == "fp16", path.name
        assert "stage3_max_live_parameters" not in cfg["zero_optimization"]  # DSD322 of step 1 says delete it
        assert not [f.code for f in check(path, mode="inference", model=EXAMPLES / "qwen2-72b").findings
                    if f.deletes]
    assert "DSD322" in {f.code for f in _steps(r)["effective"].findings}
