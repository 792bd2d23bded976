"""trace says when the model reaches deepspeed.initialize unpartitioned (HfDeepSpeedConfig created after the
model, or not kept alive) and how to fix it (issue 13, item 4)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dsdoctor.trace.observer.recorder import Recorder
from dsdoctor.trace.records import read_records
from dsdoctor.trace.report import run_status, summarize_rank
from dsdoctor.trace.run_rules import trace_findings
from tests.helpers import SCRIPTS, deepspeed_env, free_port, run_cli

DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
MiB = 2**20


def _findings(directory):
    records = read_records(directory)
    ranks = [summarize_rank(r, False) for r in records]
    return {f.code: f for f in trace_findings(ranks, records, run_status(ranks, 0, False, ""), 0, 10, None, "")}


def _run(tmp_path, *, hf_after_load: bool, oom: bool):
    rec = Recorder(str(tmp_path))
    try:
        if not hf_after_load:
            rec.write("config", api="HfDeepSpeedConfig", source="dict", config={}, summary={"stage": 3})
        token = rec.begin("load", api="LlamaForCausalLM._from_config", hf_zero3=False)
        rec.end(token, model={"zero3_partitioned": False})
        if hf_after_load:
            rec.write("config", api="HfDeepSpeedConfig", source="dict", config={}, summary={"stage": 3})
        rec.write("config", api="deepspeed.initialize", source="dict", config={}, summary={"stage": 3})
        token = rec.begin("init", api="deepspeed.initialize",
                          model_at_initialize={"params": 10, "unpartitioned": 10, "unpartitioned_bytes": 64 * MiB})
        if oom:
            rec.end(token, error=MemoryError("CUDA out of memory. Tried to allocate 64.00 MiB"))
        else:
            rec.end(token, engine={"zero_stage": 3, "optimizer": None, "offload_param": "cpu"})
    finally:
        rec.close()
    return _findings(tmp_path)


def test_created_after_from_pretrained(tmp_path):
    f = _run(tmp_path, hf_after_load=True, oom=False)
    d = f["DSD340"]
    assert d.values["unpartitioned"] == 10 and d.values["bytes"] == "64.0 MiB"
    assert "created after the model was built (LlamaForCausalLM._from_config)" in d.message("en")
    assert "HfDeepSpeedConfig(ds_config) before" in d.fix("en")
    assert "之后才创建" in d.message("zh")


def test_not_kept_alive_and_oom_at_init_is_an_error(tmp_path):
    f = _run(tmp_path, hf_after_load=False, oom=True)
    assert "no longer alive" in f["DSD340"].message("en")
    assert f["DSD340"].effective_severity == "error"  # the OOM happened in initialize


@pytest.mark.deepspeed
@pytest.mark.parametrize("order", ["after", "dropped", "before"])
def test_real_two_rank_run(tmp_path, order):
    cmd = [DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", "2", str(SCRIPTS / "unpartitioned_init.py"),
           "--config", str(SCRIPTS / "ds_zero3_infer.json"), "--order", order]
    # the watchdog is for a hung run only: a run that finishes never waits for it, and a loaded machine's slow
    # run stopped by it would be reported as a timeout or a hang
    r = run_cli("trace", "-q", "--format", "json", "--timeout", "900", "-o", str(tmp_path / "t"), "--", *cmd,
                env=deepspeed_env(), timeout=1000)
    data = json.loads(r.stdout)
    assert data["status"] == "ok", r.stderr[-3000:]
    log = (tmp_path / "t" / "output.log").read_text()
    assert f'"order": "{order}"' in log
    found = {f["code"]: f for f in data["findings"]}
    if order == "before":
        assert '"partitioned_after_init": true' in log
        assert "DSD340" not in found
        return
    f = found["DSD340"]
    assert f["values"]["unpartitioned"] == f["values"]["params"] > 0 and f["values"]["unpartitioned_bytes"] > 0
    want = "created after the model was built" if order == "after" else "no longer alive"
    assert want in f["message"] and "keep the reference alive" in f["fix"]


def test_partition_state_counts_parameters_without_zero_ids():
    import torch

    from dsdoctor.trace.observer.hooks import _partition_state

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2, bias=False))
    state = _partition_state(model)
    assert (state["params"], state["unpartitioned"]) == (3, 3)
    assert state["unpartitioned_bytes"] == (8 * 4 + 4 + 4 * 2) * 4
    model[0].weight.ds_id = 0  # as zero.Init marks what it partitioned
    assert _partition_state(model)["unpartitioned"] == 2
    assert _partition_state(None) is None


def test_zero_section_handed_to_init_inference_is_reported_at_run_time(tmp_path, monkeypatch):
    import dsdoctor.config.checks_configs as cc

    monkeypatch.setattr(cc, "this_machine_gpu", lambda: None)
    rec = Recorder(str(tmp_path))
    try:
        cfg = {"dtype": "bf16", "zero": {"stage": 3, "offload_param": {"device": "cpu"}}}
        rec.write("config", api="deepspeed.init_inference", source="dict", config=cfg, summary={"stage": 3})
        token = rec.begin("init", api="deepspeed.init_inference")
        rec.end(token, engine={"engine": "InferenceEngine", "zero_stage": 0})
    finally:
        rec.close()
    f = _findings(tmp_path)["DSD122"]
    assert f.values["config_dict"]["zero_optimization"]["offload_param"]["device"] == "cpu"
