"""trace, ab and diagnose on small scripts that follow real inference scripts' patterns (tests/scripts/):
an encoder-decoder model, a model loaded twice, ranks that finish before the timeout, a script that needs a
launcher, a config DeepSpeed rejects, init_inference, and the records-level rules behind them."""
from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time
from pathlib import Path

import pytest

from dsdoctor.trace.observer.recorder import Recorder
from dsdoctor.trace.records import read_records
from dsdoctor.trace.report import run_status, summarize_rank
from dsdoctor.trace.run_rules import clip, trace_findings
from tests.helpers import SCRIPTS, deepspeed_env, free_port, reached_in_time, run_cli

DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")


def _trace(tmp_path, *command, timeout_s=None, env=None, fail_on="error"):
    flags = ["--timeout", str(timeout_s)] if timeout_s else []
    r = run_cli("trace", "-q", "--format", "json", "--fail-on", fail_on, *flags, "-o", str(tmp_path / "t"), "--",
                *map(str, command), env=env, timeout=300)
    return r, json.loads(r.stdout) if r.stdout.strip() else None


# ---------------------------------------------------------------- real processes without DeepSpeed ranks

@pytest.mark.process
def test_encoder_decoder_tokens_are_the_decoder_output_not_output_minus_prompt(tmp_path):
    """T5's generate returns the decoder start token + new tokens; the prompt (20 tokens) is not in it."""
    r, data = _trace(tmp_path, sys.executable, SCRIPTS / "t5_generate.py")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "output shape (3, 6)" in (tmp_path / "t" / "output.log").read_text()
    (rank,) = data["ranks"]
    gen = next(p for p in rank["phases"] if p["name"] == "generate")
    assert gen["new_tokens"] == 3 * 5  # 3 sequences x 5 new tokens (6 returned, one is the start token)
    assert gen["tokens_per_s"] == pytest.approx(gen["new_tokens"] / gen["duration_s"])
    assert rank["tokens_per_s"] == pytest.approx(gen["tokens_per_s"])
    assert rank["workload"] == {"batch": 3, "prompt_len": 20, "max_new_tokens": 5, "encoder_decoder": True,
                                "new_tokens": 5}
    model = rank["model_captured"]
    assert model["model_class"] == "T5ForConditionalGeneration" and model["is_encoder_decoder"] is True
    assert model["config"]["d_model"] == 32 and model["num_params"] > 0


@pytest.mark.process
def test_a_model_loaded_twice_gives_two_numbered_load_phases(tmp_path):
    r, data = _trace(tmp_path, sys.executable, SCRIPTS / "load_twice.py")
    assert r.returncode == 0, r.stderr[-2000:]
    (rank,) = data["ranks"]
    assert [p["label"] for p in rank["phases"]] == ["load#0", "load#1", "generate#0"]
    # the model the run generates with is the larger of the two: that is the one diagnose plans for
    assert rank["model_captured"]["config"]["num_hidden_layers"] == 2


@pytest.mark.process
def test_ranks_that_finished_before_the_timeout_are_finished_not_hung(tmp_path):
    """Both ranks exit successfully; only the launcher is still running when the watchdog fires (a run whose
    ranks had not both exited by then, on a loaded machine, is repeated with a longer --timeout)."""
    for limit in (20, 80):
        ready, attempt = tmp_path / f"ready-{limit}", tmp_path / str(limit)
        attempt.mkdir()
        start = time.time()
        r, data = _trace(attempt, sys.executable, SCRIPTS / "ranks_exit_before_timeout.py", ready,
                         timeout_s=limit)
        if reached_in_time(ready, start, limit):
            break
    assert r.returncode == 0, r.stderr[-2000:]
    assert data["status"] == "ok"
    assert sorted((x["rank"], x["status"], x["stopped_in"]) for x in data["ranks"]) == [(0, "ok", None),
                                                                                       (1, "ok", None)]
    codes = [f["code"] for f in data["findings"]]
    assert "DSD319" in codes and "DSD306" not in codes and "DSD318" not in codes
    lingered = next(f for f in data["findings"] if f["code"] == "DSD319")
    assert lingered["message"] == f"every rank finished (rank 0, 1) but the command was still running after {limit}s"


def test_timeline_page_says_why_it_has_no_chart_without_matplotlib(tmp_path, monkeypatch):
    from dsdoctor.trace.plot import write_timelines
    from dsdoctor.trace.report import RankSummary, TraceResult

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rank = RankSummary(rank=0, host="h", pid=1, status="ok", timeline=[[0.0, 1, None, None]])
    result = TraceResult(["python", "x.py"], "ok", 0, 1.0, None, [rank], [])
    assert write_timelines(result, tmp_path) == ["timeline.html"]
    page = (tmp_path / "timeline.html").read_text()
    assert "matplotlib is not installed" in page and "<img" not in page


# ---------------------------------------------------------------- records -> statuses and findings

@pytest.fixture
def records_dir(tmp_path):
    yield tmp_path
    try:
        faulthandler.unregister(signal.SIGUSR1)
    except Exception:
        pass


def _rank(directory, monkeypatch, rank, world=2):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return Recorder(str(directory))


def _stack(rec, user_line, innermost):
    Path(rec.path[: -len(".jsonl")] + ".stack.txt").write_text(
        "Current thread 0x1 (most recent call first):\n"
        f'  File "/venv/lib/python3.11/site-packages/{innermost[0]}", line 7 in {innermost[1]}\n'
        f'  File "/home/me/infer.py", line {user_line} in main\n')


def _read(directory, timed_out, returncode=None):
    records = read_records(directory)
    ranks = [summarize_rank(r, timed_out) for r in records]
    status = run_status(ranks, returncode, timed_out, "")
    return ranks, status, trace_findings(ranks, records, status, returncode, 8, "log", "", timed_out=timed_out)


GATHER = ("torch/distributed/distributed_c10d.py", "all_gather_into_tensor")
BARRIER = ("torch/distributed/distributed_c10d.py", "barrier")


def test_healthy_ranks_on_the_same_line_at_the_timeout_are_a_timeout_not_a_hang(records_dir, monkeypatch):
    for r in (0, 1):
        rec = _rank(records_dir, monkeypatch, r)
        rec.begin("generate", api="generate", synced_gpus=True, zero3_partitioned=True, world_size=2)
        rec._fh.close()  # killed by the watchdog: no phase end, no exit
        _stack(rec, 40, GATHER)
    ranks, status, findings = _read(records_dir, timed_out=True)
    assert status == "timeout" and [r.status for r in ranks] == ["timeout", "timeout"]
    assert all(r.in_collective for r in ranks)
    codes = [f.code for f in findings]
    assert "DSD318" in codes and "DSD306" not in codes
    text = next(f for f in findings if f.code == "DSD318")
    assert "rank 0 in generate#0 (infer.py:40 in main, waiting in all_gather_into_tensor)" in text.message()
    assert "collective" not in text.fix()  # no advice about diverging collectives


def test_ranks_waiting_on_each_other_at_different_points_are_a_hang(records_dir, monkeypatch):
    rec0 = _rank(records_dir, monkeypatch, 0)
    t = rec0.begin("generate", api="generate", synced_gpus=False, zero3_partitioned=True, world_size=2)
    rec0.end(t, new_tokens=8)
    rec0._fh.close()
    _stack(rec0, 52, BARRIER)
    rec1 = _rank(records_dir, monkeypatch, 1)
    rec1.begin("generate", api="generate", synced_gpus=False, zero3_partitioned=True, world_size=2)
    rec1._fh.close()
    _stack(rec1, 40, GATHER)
    ranks, status, findings = _read(records_dir, timed_out=True)
    assert status == "hang" and [r.status for r in ranks] == ["hang", "hang"]
    codes = [f.code for f in findings]
    assert codes.count("DSD306") == 2 and "DSD301" in codes and "DSD318" not in codes


def test_a_rank_that_exited_is_never_part_of_a_hang(records_dir, monkeypatch):
    rec0 = _rank(records_dir, monkeypatch, 0)
    rec0.close()  # exited successfully
    rec1 = _rank(records_dir, monkeypatch, 1)
    rec1.begin("generate", api="generate", synced_gpus=True, zero3_partitioned=False, world_size=2)
    rec1._fh.close()
    _stack(rec1, 40, ("torch/nn/modules/linear.py", "forward"))  # computing, not waiting
    ranks, status, findings = _read(records_dir, timed_out=True)
    assert status == "timeout" and [r.status for r in ranks] == ["ok", "timeout"]
    msg = next(f for f in findings if f.code == "DSD318").message()
    assert "rank 0 had finished" in msg and "rank 1 in generate#0" in msg
    assert not any(f.code == "DSD306" for f in findings)


def _config_event(rec, api, summary, **extra):
    rec.write("config", api=api, source="dict", config={"zero_optimization": {"stage": summary.get("stage")}},
              summary=summary, **extra)


def test_load_peak_advice_fits_a_script_that_already_creates_hfdeepspeedconfig_first(records_dir, monkeypatch):
    rec = _rank(records_dir, monkeypatch, 0, world=1)
    _config_event(rec, "HfDeepSpeedConfig", {"stage": 3}, is_zero3=True)
    t = rec.begin("load", api="LlamaForCausalLM.from_pretrained")
    rec.end(t)
    rec.close()
    ranks, _, findings = _read(records_dir, timed_out=False, returncode=0)
    ranks[0].peak_phase, ranks[0].peak_host_bytes = "load", 10
    from dsdoctor.trace.run_rules import _peak_finding

    peak = _peak_finding(ranks, read_records(records_dir))
    assert "already partitioned" in peak.fix() and "build the model inside ZeRO-3" not in peak.fix()


def test_init_peak_advice_for_init_inference_never_says_split(records_dir, monkeypatch):
    rec = _rank(records_dir, monkeypatch, 0, world=1)
    rec.write("config", api="deepspeed.init_inference", source="kwargs", config={"dtype": "torch.float16"},
              summary={"tp_size": 1}, rewritable=False)
    t = rec.begin("init", api="deepspeed.init_inference")
    rec.end(t, engine={"engine": "InferenceEngine", "zero_stage": 0, "optimizer": None})
    rec.close()
    records = read_records(records_dir)
    ranks = [summarize_rank(r, False) for r in records]
    ranks[0].peak_phase, ranks[0].peak_host_bytes = "init", 10
    from dsdoctor.trace.run_rules import _peak_finding

    peak = _peak_finding(ranks, records)
    assert "init_inference" in peak.fix() and "split" not in peak.fix()


def test_split_variant_of_a_stage_2_config_records_what_it_passed(records_dir, monkeypatch):
    """ab's split of a stage-2 training config passes stage 0: DSD302 compares with that, not the original."""
    from dsdoctor.trace.observer import hooks

    monkeypatch.setenv("PYTHON_DSDOCTOR_AB_VARIANT", json.dumps({"name": "split"}))
    rec = _rank(records_dir, monkeypatch, 0, world=1)
    original = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    new = hooks._rewrite(original)
    hooks._write_config(rec, "deepspeed.initialize", "dict", new, original, rewritable=True)
    t = rec.begin("init", api="deepspeed.initialize")
    rec.end(t, engine={"zero_stage": 0, "optimizer": None})
    rec.close()
    records = read_records(records_dir)
    (event,) = records[0].configs
    assert event["summary"]["stage"] == 0 and event["summary_before_variant"]["stage"] == 2
    assert event["variant_applied"] == "split" and event["variant_changed"] is True
    ranks, _, findings = _read(records_dir, timed_out=False, returncode=0)
    assert ranks[0].configured_stage == 0 and "DSD302" not in [f.code for f in findings]


def test_error_text_is_cut_at_a_word_boundary():
    text = "DeepSpeedConfigError: " + " ".join(f"word{i}" for i in range(100))
    cut = clip(text, 60)
    assert len(cut) <= 60 and cut.endswith("...")
    assert cut[:-3].split()[-1] in text.split()  # the last word is whole
    assert clip("short message", 60) == "short message"


# ---------------------------------------------------------------- DeepSpeed in one process (no launcher)

@pytest.mark.deepspeed
def test_a_script_that_needs_a_launcher_is_told_so(tmp_path):
    r, data = _trace(tmp_path, sys.executable, SCRIPTS / "needs_launcher.py", env=deepspeed_env())
    assert r.returncode == 1 and data["status"] == "error", r.stderr[-2000:]
    (finding,) = [f for f in data["findings"] if f["code"] == "DSD321"]
    assert "deepspeed --num_gpus N" in finding["fix"] and "torchrun --nproc_per_node N" in finding["fix"]
    assert "DSD308" not in [f["code"] for f in data["findings"]]


@pytest.mark.deepspeed
@pytest.mark.parametrize("where", ["initialize", "hf"])
def test_a_config_deepspeed_rejects_gets_the_config_doctors_finding(tmp_path, where):
    extra = ["--hf"] if where == "hf" else []
    r, data = _trace(tmp_path, sys.executable, SCRIPTS / "rejected_config.py", free_port(), *extra,
                     env=deepspeed_env())
    assert r.returncode == 1 and data["status"] == "error", r.stderr[-2000:]
    codes = [f["code"] for f in data["findings"]]
    assert "DSD114" in codes and "DSD308" not in codes
    rejected = next(f for f in data["findings"] if f["code"] == "DSD114")
    assert rejected["message"].startswith("zero_optimization.stage3_prefetch_bucket_size: DeepSpeed rejects")
    assert "3686.4" in rejected["message"]
    rank = data["ranks"][0]
    assert rank["config_captured"]["zero_optimization"]["stage3_prefetch_bucket_size"] == 0.9 * 64**2
    failed = next(p for p in rank["phases"] if p["error"])
    assert failed["name"] == ("load" if where == "hf" else "init")


@pytest.mark.deepspeed
def test_ab_stops_when_the_config_never_reaches_deepspeed_initialize(tmp_path):
    out = tmp_path / "ab"
    r = run_cli("ab", "-q", "--format", "json", "-o", str(out), "--", sys.executable,
                str(SCRIPTS / "init_inference_tiny.py"), env=deepspeed_env(), timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    data = json.loads(r.stdout)
    assert [v["name"] for v in data["variants"]] == ["as-is"]  # nothing run twice under another label
    assert data["diagnosis"]["code"] == "DSD320"
    assert "no-offload-param, split" in data["diagnosis"]["message"]
    assert "init_inference" in data["diagnosis"]["message"]
    assert not (out / "split").exists() and (out / "as-is" / "report.json").is_file()


def test_an_init_failure_the_config_does_not_explain_stays_dsd308(records_dir, monkeypatch):
    rec = _rank(records_dir, monkeypatch, 0, world=1)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}  # DSD101 (an error), but DeepSpeed accepts it
    rec.write("config", api="deepspeed.initialize", source="dict", config=cfg, summary={"stage": 3})
    t = rec.begin("init", api="deepspeed.initialize")
    rec.end(t, error=RuntimeError("the disk is full " * 30))
    rec.close()
    ranks, status, findings = _read(records_dir, timed_out=False, returncode=1)
    assert status == "error" and [f.code for f in findings if f.effective_severity == "error"] == ["DSD308"]
    detail = next(f for f in findings if f.code == "DSD308").values["detail"]
    assert detail.endswith("...") and detail[:-3].split()[-1] in {"the", "disk", "is", "full"}  # between words


@pytest.mark.deepspeed
def test_ab_split_of_a_stage_2_config_in_code_compares_with_what_it_passed(tmp_path):
    """split writes stage 0 for a stage-2 training config: its DSD302 check uses that, not the original."""
    out = tmp_path / "ab"
    r = run_cli("ab", "-q", "--format", "json", "--variants", "as-is,split", "--timeout", "400", "-o", str(out), "--",
                DEEPSPEED, "--num_gpus", "2", "--master_port", free_port(), SCRIPTS / "infer_config_in_code.py",
                "--stage", "2", "--optimizer", env=deepspeed_env(), timeout=900)
    data = json.loads(r.stdout)
    assert [v["status"] for v in data["variants"]] == ["ok", "ok"], r.stderr[-3000:]
    split = json.loads((out / "split" / "report.json").read_text())
    for rank in split["ranks"]:
        assert rank["zero_stage"] == 0 and rank["configured_stage"] == 0 and rank["optimizer"] is None
        assert rank["config_passed"]["variant_applied"] == "split"
        assert rank["config_captured"]["zero_optimization"] == {"stage": 0}
    assert "DSD302" not in {f["code"] for f in split["findings"]}
    as_is = json.loads((out / "as-is" / "report.json").read_text())
    assert {x["zero_stage"] for x in as_is["ranks"]} == {2} and all(x["optimizer"] for x in as_is["ranks"])
