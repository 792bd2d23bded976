"""trace/ab without DeepSpeed ranks: variants, records -> report -> findings, the ab diagnosis, the CLI's
failure paths, the observer in a real single-process transformers run, and the watchdog."""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from dsdoctor.errors import InputError
from dsdoctor.trace import variants as V
from dsdoctor.trace.diagnose_ab import VariantResult, diagnose
from dsdoctor.trace.observer.recorder import Recorder
from dsdoctor.trace.records import read_records
from dsdoctor.trace.report import _where_in_stack, run_status, summarize_rank
from dsdoctor.trace.run_rules import trace_findings
from tests.helpers import ROOT, SCRIPTS, reached_in_time, run_cli

TRAIN = json.loads((SCRIPTS / "train_zero3_offload.json").read_text())
GiB = 1024**3


# ---------------------------------------------------------------- variants

def test_variants_rewrite_copies_and_never_mutates():
    before = json.dumps(TRAIN, sort_keys=True)
    nop = V.apply_variant("no-offload-param", TRAIN)
    assert "offload_param" not in nop["zero_optimization"]
    assert nop["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    split = V.apply_variant("split", TRAIN)
    assert "optimizer" not in split and "scheduler" not in split
    assert "offload_optimizer" not in split["zero_optimization"]
    assert split["zero_optimization"]["stage"] == 3 and split["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert V.apply_variant("pin-memory-off", TRAIN)["zero_optimization"]["offload_param"]["pin_memory"] is False
    assert V.apply_variant("prefetch=1e7", TRAIN)["zero_optimization"]["stage3_prefetch_bucket_size"] == 10**7
    assert json.dumps(TRAIN, sort_keys=True) == before


def test_parse_variants_defaults_and_errors():
    assert [v.name for v in V.parse_variants(None)] == ["as-is", "no-offload-param", "split"]
    assert [v.name for v in V.parse_variants("as-is, prefetch=5e7")] == ["as-is", "prefetch=5e7"]
    with pytest.raises(InputError, match="unknown variant 'offload'"):
        V.parse_variants("as-is,offload")
    with pytest.raises(InputError, match="given twice"):
        V.parse_variants("split,split")
    with pytest.raises(InputError, match="not a number"):
        V.parse_variants("prefetch=lots")


# ---------------------------------------------------------------- records -> findings

@pytest.fixture
def recorder(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    rec = Recorder(str(tmp_path))
    yield rec
    rec.close()
    faulthandler.unregister(signal.SIGUSR1)


def _write_run(rec: Recorder, configured_stage, effective_stage, synced, pinned):
    cfg = {"zero_optimization": {"stage": configured_stage}}
    rec.write("config", api="deepspeed.initialize", source="ds.json", config=cfg,
              summary={"stage": configured_stage})
    token = rec.begin("init", api="deepspeed.initialize")
    rec.end(token, engine={"zero_stage": effective_stage, "optimizer": None, "offload_param": "cpu",
                           "offload_optimizer": None, "dtype": "bf16", "tp_size": 1, "world_size": 2})
    rec.write("zero_shards_to_init_inference", files=["/ck/global_step5/zero_pp_rank_1_mp_rank_00_model_states.pt"])
    token = rec.begin("generate", api="generate", synced_gpus=synced, zero3_partitioned=True, world_size=2,
                      batch=2, prompt_len=4)
    rec.end(token, new_tokens=16)
    # a phase end as a GPU rank writes it (pinned host memory is only known with CUDA)
    rec.write("phase_start", phase="generate", index=1, host_rss=GiB)
    rec.write("phase_end", phase="generate", index=1, duration_s=2.0, peak_host_rss=2 * GiB,
              peak_gpu_reserved=30 * GiB, pinned_host_bytes=pinned, new_tokens=8)


def _findings(directory, timed_out=False, returncode=0):
    records = read_records(directory)
    ranks = [summarize_rank(r, timed_out) for r in records]
    status = run_status(ranks, returncode, timed_out, "")
    return ranks, status, trace_findings(ranks, records, status, returncode, 10, "out/output.log", "")


def test_report_from_records_finds_each_problem(tmp_path, recorder):
    _write_run(recorder, "auto", 0, synced=False, pinned=recorder_total(recorder))
    recorder.close()
    ranks, status, findings = _findings(tmp_path)
    codes = {f.code: f for f in findings}
    assert status == "ok" and len(ranks) == 1
    r = ranks[0]
    assert (r.rank, r.zero_stage, r.configured_stage, r.offload_param, r.synced_gpus) == (1, 0, "auto", "cpu", False)
    assert r.peak_gpu_bytes == 30 * GiB and r.peak_phase == "generate#1"
    assert [p["label"] for p in r.phases] == ["init", "generate#0", "generate#1"]
    assert r.phases[1]["new_tokens"] == 16 and r.phases[1]["tokens_per_s"] > 0
    assert codes["DSD302"].message() == 'the config ds.json asks for ZeRO stage "auto" but DeepSpeed ran stage 0'
    assert codes["DSD301"].values["ranks"] == "1"
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt" in codes["DSD303"].message()
    assert codes["DSD305"].values["percent"] == 100
    assert codes["DSD304"].message() == "peak GPU memory 30.0 GiB on rank 1 happened during generate#1"
    assert "峰值" in codes["DSD304"].message("zh")


def recorder_total(rec):
    from dsdoctor.trace.observer.recorder import host_total

    return host_total()


def test_clean_run_has_only_the_peak_finding(tmp_path, recorder):
    _write_run(recorder, 3, 3, synced=True, pinned=1024)
    recorder.close()
    ranks, status, findings = _findings(tmp_path)
    assert [f.code for f in findings] == ["DSD303", "DSD304"]  # the shard read stays an error


def test_killed_rank_reports_where_it_stopped(tmp_path, recorder):
    token = recorder.begin("generate", api="generate", synced_gpus=True, zero3_partitioned=True, world_size=2)
    del token  # the rank never comes back: no phase_end, no exit
    recorder._fh.close()
    (Path(recorder.path[: -len(".jsonl")] + ".stack.txt")).write_text(STACK)
    ranks, status, findings = _findings(tmp_path, timed_out=True, returncode=-15)
    assert status == "hang" and ranks[0].status == "hang" and ranks[0].stopped_in == "generate#0"
    hang = next(f for f in findings if f.code == "DSD306")
    assert hang.message() == ("rank 1 stopped in generate#0 and did not finish within 10s "
                              "(infer.py:42 in main, waiting in all_gather_into_tensor)")


STACK = """Thread 0x00007f01 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait

Current thread 0x00007f00 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3 in all_gather_into_tensor
  File "/venv/lib/python3.11/site-packages/deepspeed/runtime/zero/partition_parameters.py", line 9 in fetch
  File "/home/me/infer.py", line 42 in main
  File "/home/me/infer.py", line 50 in <module>
"""


def test_where_in_stack_picks_the_main_thread_and_the_user_frame():
    assert _where_in_stack(STACK) == "infer.py:42 in main, waiting in all_gather_into_tensor"
    assert _where_in_stack(None) is None and _where_in_stack("garbage") is None


def test_truncated_record_line_is_tolerated(tmp_path, recorder):
    _write_run(recorder, 3, 3, synced=True, pinned=None)
    recorder._fh.write('{"event": "phase_start", "phase": "gen')  # killed mid-write
    recorder._fh.flush()
    ranks, _, _ = _findings(tmp_path)
    assert len(ranks[0].phases) == 3


# ---------------------------------------------------------------- ab diagnosis

def _v(name, status="ok", gpu=None, host=None, tps=None, offload="cpu"):
    return VariantResult(name, name, status, gpu, host, tps, 1.0, 0 if status == "ok" else 1, offload)


@pytest.mark.parametrize("rows,code", [
    # the expert's verdict (DSD346) leads whenever it can be drawn: here gathering dominates (DSD310's reading)
    ([_v("as-is", gpu=40 * GiB, tps=10), _v("no-offload-param", gpu=31 * GiB, tps=11)], "DSD346"),
    # as-is fails where a variant runs: that is decisive, the variant is the fix (issue 21); DSD310's reading stays
    ([_v("as-is", "oom"), _v("no-offload-param", gpu=31 * GiB)], "DSD316"),
    ([_v("as-is", "oom"), _v("no-offload-param", "oom")], "DSD311"),
    # ... and here the host-to-device copy (DSD312's reading)
    ([_v("as-is", gpu=20 * GiB, tps=3), _v("no-offload-param", gpu=30 * GiB, tps=41)], "DSD346"),
    ([_v("as-is", gpu=20 * GiB, host=90 * GiB, tps=30), _v("no-offload-param", gpu=30 * GiB, host=20 * GiB, tps=31)],
     "DSD346"),
    ([_v("as-is", gpu=20 * GiB, tps=30), _v("split", gpu=12 * GiB, tps=30)], "DSD314"),
    ([_v("as-is", gpu=20 * GiB, tps=4), _v("no-offload-param", "oom"), _v("split", gpu=19 * GiB, tps=4)], "DSD315"),
    ([_v("as-is", gpu=20 * GiB, tps=30), _v("no-offload-param", gpu=21 * GiB, tps=31),
      _v("split", gpu=19.5 * GiB, tps=30)], "DSD313"),
    ([_v("as-is", host=2 * GiB, offload=None), _v("no-offload-param", host=1 * GiB, offload=None)], "DSD313"),
])
def test_ab_diagnosis_table(rows, code):
    from dsdoctor.trace.diagnose_ab import AbResult

    result = AbResult(["python", "x.py"], rows, diagnose(rows))
    assert result.diagnosis.code == code
    assert result.to_dict("zh")["diagnosis"]["message"]
    head = result.to_text("en").split("diagnosis: ", 1)[1].splitlines()[0]
    assert head.startswith(code)
    if code == "DSD316":  # the reading it supersedes as the diagnosis is still reported beside it
        assert "DSD310" in {f.code for f in result.findings}
        assert head.startswith("DSD316 no-offload-param runs where as-is OOM") and \
            "delete zero_optimization.offload_param" in result.to_text("en")
    if code == "DSD346":  # the single comparison it is drawn from is still reported beside it
        assert {"DSD310", "DSD312"} & {f.code for f in result.findings}
        assert head.split(" ", 1)[1].startswith(("gathering dominates", "host-to-device bottleneck"))


# ---------------------------------------------------------------- CLI and real processes

@pytest.mark.process
def test_cli_failure_paths_are_one_line_and_exit_2(tmp_path):
    r = run_cli("trace", "-o", str(tmp_path / "a"))
    assert r.returncode == 2 and r.stderr.startswith("dsdoctor: error: no command given") and "Traceback" not in r.stderr
    r = run_cli("ab", "--variants", "as-is,bogus", "-o", str(tmp_path / "b"), "--", "true")
    assert r.returncode == 2 and "unknown variant 'bogus'" in r.stderr
    r = run_cli("trace", "-o", str(tmp_path / "c"), "--", "no-such-command-xyz")
    assert r.returncode == 2 and "command not found: no-such-command-xyz" in r.stderr
    assert not (tmp_path / "c").exists()  # nothing half-written
    (tmp_path / "d").mkdir()
    r = run_cli("trace", "-o", str(tmp_path / "d"), "--", "true")
    assert r.returncode == 2 and "--force" in r.stderr
    r = run_cli("trace", "--timeout", "-1", "-o", str(tmp_path / "e"), "--", "true")
    assert r.returncode == 2 and "--timeout" in r.stderr


@pytest.mark.process
def test_trace_plain_transformers_generate_and_chained_sitecustomize(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "site-ran"
    (site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(site)])}
    out = tmp_path / "t"
    r = run_cli("trace", "-q", "--format", "json", "-o", str(out), "--", sys.executable,
                str(SCRIPTS / "generate_plain.py"), env=env, timeout=240)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["status"] == "ok" and marker.read_text() == "yes"  # the site's own sitecustomize still ran
    (rank,) = data["ranks"]
    assert [p["label"] for p in rank["phases"]] == ["load", "generate#0"]
    gen = rank["phases"][1]
    assert gen["new_tokens"] == 12 and gen["tokens_per_s"] > 0 and rank["peak_host_bytes"] > 0
    assert rank["zero_stage"] is None and rank["optimizer"] is None and rank["synced_gpus"] is False  # 1 process
    passed = rank["config_passed"]
    assert (passed["api"], passed["stage"], passed["offload_param"]) == ("HfDeepSpeedConfig", 3, "cpu")
    assert {f["code"] for f in data["findings"]} == {"DSD304"}
    assert "generated 4 zero3 True" in (out / "output.log").read_text()
    assert json.loads((out / "report.json").read_text())["ranks"][0]["rank"] == 0
    assert (out / "report.md").read_text().startswith("# dsdoctor trace")
    assert (out / "timeline-rank-0.png").stat().st_size > 1000 and (out / "timeline.html").is_file()


@pytest.mark.process
def test_observer_that_cannot_record_never_breaks_the_program(tmp_path):
    import subprocess

    blocker = tmp_path / "file"
    blocker.write_text("x")
    from dsdoctor.trace.launch import observed_env

    env = observed_env(blocker / "records")  # a path under a file: the recorder cannot be created
    env["RANK"] = "0"
    r = subprocess.run([sys.executable, "-c", "print('user program ran')"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout == "user program ran\n"
    assert "dsdoctor: cannot record this rank" in r.stderr


@pytest.mark.process
def test_watchdog_ends_the_whole_tree_and_says_where(tmp_path):
    """A script that sleeps past the timeout: a timeout (DSD318, a warning), not a hang; where it was."""
    # the watchdog must fire after the script reached its wait (it writes the pid file just before): what is
    # asserted is where the rank waits, not how fast a loaded machine starts Python, so a run whose script
    # got there late is repeated with a longer --timeout
    for limit in (30, 120):
        pidfile = tmp_path / f"pids-{limit}"
        start = time.time()
        r = run_cli("trace", "-q", "--timeout", str(limit), "--format", "json", "--fail-on", "warning", "-o",
                    str(tmp_path / f"t{limit}"), "--", sys.executable, str(SCRIPTS / "hang_tree.py"), str(pidfile),
                    env={"RANK": "0"}, timeout=limit + 90)
        if reached_in_time(pidfile, start, limit):
            break
    assert r.returncode == 1, r.stderr
    data = json.loads(r.stdout)
    assert data["status"] == "timeout"
    (rank,) = data["ranks"]
    assert rank["status"] == "timeout" and rank["stopped_in"] == "before any observed call"
    assert rank["where"] == "hang_tree.py:12 in wait_for_peer, waiting in wait_for_peer"
    assert rank["in_collective"] is False
    codes = [f["code"] for f in data["findings"]]
    assert "DSD318" in codes and "DSD306" not in codes
    timeout = next(f for f in data["findings"] if f["code"] == "DSD318")
    assert "rank 0 before any observed call (hang_tree.py:12 in wait_for_peer" in timeout["message"]
    grandchild = int(pidfile.read_text())
    assert not _running(grandchild), "the grandchild in its own session was left running"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------- observer pieces, in-process (no patching)

def test_initialize_config_is_found_and_rewritten_without_touching_the_callers_args(tmp_path):
    import argparse
    import inspect

    from dsdoctor.trace.observer.hooks import _resolve_initialize_config

    def initialize(args=None, model=None, optimizer=None, model_parameters=None, config=None, config_params=None):
        pass

    path = tmp_path / "ds.json"
    path.write_text("{\n  // hjson comment, as DeepSpeed accepts\n  \"zero_optimization\": {\"stage\": 3}\n}\n")
    ns = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    bound = inspect.signature(initialize).bind_partial(ns, model="m")
    cfg, source, setter = _resolve_initialize_config(bound)
    assert cfg == {"zero_optimization": {"stage": 3}} and source == str(path)
    setter({"zero_optimization": {"stage": 0}})
    assert bound.arguments["config"] == {"zero_optimization": {"stage": 0}}
    assert bound.arguments["args"].deepspeed_config is None and ns.deepspeed_config == str(path)

    bound = inspect.signature(initialize).bind_partial(model="m", config_params={"train_batch_size": 2})
    cfg, source, setter = _resolve_initialize_config(bound)
    assert (cfg, source) == ({"train_batch_size": 2}, "dict")


def test_optimizer_state_bytes_counts_each_buffer_once():
    import torch

    from dsdoctor.trace.observer.hooks import _optimizer_state_bytes

    class Bucket:
        buffer = torch.empty(100, dtype=torch.float32)

    class Opt:
        flat = torch.zeros(1000, dtype=torch.float32)
        fp32_partitioned_groups_flat = [flat[:600], flat[600:]]  # two views of one storage
        grad_partitions_flat_buffer = torch.zeros(250, dtype=torch.float32)
        ipg_buckets = {torch.bfloat16: Bucket()}

    assert _optimizer_state_bytes(Opt()) == 4000 + 1000 + 400


@pytest.mark.process
def test_help_and_rules_never_import_torch():
    import subprocess

    code = ("import sys; from dsdoctor.cli.main import build_parser; build_parser(); import dsdoctor.findings, "
            "dsdoctor.trace.variants, dsdoctor.trace.report, dsdoctor.trace.run_rules, dsdoctor.trace.diagnose_ab; "
            "sys.exit(1 if {'torch', 'deepspeed', 'transformers'} & set(sys.modules) else 0)")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=60)
    assert r.returncode == 0
