"""How a run ended, per rank, with evidence (trace/ending.py), and the A/B verdict drawn from it.

The records-level cases build the JSON lines a real rank writes (the observer's Recorder) and the output a real
launcher prints (DeepSpeed's launch.py, torchrun's error summary, NCCL's watchdog, a CUDA OOM); the process
cases at the end run real CPU DeepSpeed ranks: a rank killed by SIGKILL once deepspeed.initialize built an
optimizer, one that raises at initialize (an "auto" batch size), one that hangs. In each, ab names the
variant that runs as the fix."""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from dsdoctor.trace import ending
from dsdoctor.trace.diagnose_ab import AbResult, VariantResult, diagnose
from dsdoctor.trace.observer.recorder import Recorder
from dsdoctor.trace.records import read_records
from dsdoctor.trace.report import TraceResult, run_status, settle_timeout, summarize_rank
from dsdoctor.trace.run_rules import trace_findings
from tests.helpers import SCRIPTS, deepspeed_env, free_port, run_cli

GiB = 1024**3
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
SCRIPT = SCRIPTS / "fails_with_training_config.py"
TRAIN = SCRIPTS / "train_zero3_offload.json"

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
            "1.23 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the "
            "allocated memory 70.12 GiB is allocated by PyTorch, and 6.50 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
CUDA_OOM_OLD = ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB already "
                "allocated; 3.75 MiB free; 14.75 GiB reserved in total by PyTorch)")
NCCL = ("[rank1]:[E1201 05:47:50.383 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=5, OpType=ALLGATHER, NumelIn=4096, NumelOut=8192, Timeout(ms)=600000) ran for "
        "600123 milliseconds before timing out.")
TORCHRUN = """Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_05:47:50
  host      : gpu-node
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
"""


# ---------------------------------------------------------------- reading the output

def test_allocator_figures_from_both_spellings_of_the_cuda_oom_text():
    f = ending.allocator_figures(CUDA_OOM)
    assert f["tried"] == 2 * GiB and f["unallocated"] == int(6.5 * GiB) and f["free"] == int(1.23 * GiB)
    assert f["allocated"] == int(70.12 * GiB) and f["fragmentation"] is True  # 6.5 GiB held, 2 GiB asked
    old = ending.allocator_figures(CUDA_OOM_OLD)
    assert old["tried"] == 20 * 2**20 and old["unallocated"] == int(14.75 * GiB) - int(14.56 * GiB)
    assert ending.allocator_figures("RuntimeError: something else") is None


def test_exit_codes_as_launchers_and_shells_pass_them_on():
    assert ending.decode_exit(-9) == {"exit_code": -9, "signal": "SIGKILL"}
    assert ending.decode_exit(247)["signal"] == "SIGKILL"  # the DeepSpeed launcher's sys.exit(-9)
    assert ending.decode_exit(137)["signal"] == "SIGKILL"  # a shell's 128 + 9
    assert ending.decode_exit(1) == {"exit_code": 1, "signal": None}
    ds = "[ERROR] [launch.py:259:sigkill_handler] ['/usr/bin/python', '-u', 'infer.py', '--local_rank=1'] exits " \
         "with return code = -9"
    assert ending.launcher_exit_codes(ds)["by_local_rank"] == {1: -9}
    codes = ending.launcher_exit_codes(TORCHRUN)
    assert codes["by_rank"] == {1: -9} and codes["by_pid"] == {4242: -9}


def test_collective_timeouts_and_the_last_exception_line():
    assert ending.collective_timeout(NCCL) == "NCCL ALLGATHER after 600000 ms (watchdog)"
    assert ending.collective_timeout("RuntimeError: [pair.cc:598] Timed out waiting 1800000ms for recv operation "
                                     "to complete") == "gloo recv after 1800000 ms"
    tail = ("noise\nTraceback (most recent call last):\n  File \"x.py\", line 3, in <module>\n    f()\n"
            "TypeError: '>' not supported between instances of 'str' and 'int'\n[launch.py] exits")
    assert ending.last_exception_line(tail) == "TypeError: '>' not supported between instances of 'str' and 'int'"
    assert ending.last_exception_line("no traceback here") is None


# ---------------------------------------------------------------- records -> endings

@pytest.fixture
def records_dir(tmp_path):
    yield tmp_path
    try:
        faulthandler.unregister(signal.SIGUSR1)
    except Exception:
        pass


def _rank(directory, monkeypatch, rank, world=2, local=None):
    """A rank's recorder as its own process would have it (a pid of its own: each rank is a process)."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank if local is None else local))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    real = os.getpid
    monkeypatch.setattr(os, "getpid", lambda: 40000 + rank)
    try:
        return Recorder(str(directory))
    finally:
        monkeypatch.setattr(os, "getpid", real)


def _killed_in_init(directory, monkeypatch, rank, rss):
    rec = _rank(directory, monkeypatch, rank)
    rec.write("config", api="deepspeed.initialize", source="train.json", config={"optimizer": {"type": "AdamW"}},
              summary={"stage": 3, "optimizer": "AdamW", "offload_param": "cpu"}, rewritable=True)
    rec.begin("init", api="deepspeed.initialize")
    rec.write("samples", data=[[time.time(), rss, None, None]])  # the sampler's last row before the kill
    rec._fh.close()  # SIGKILL: no phase end, no exit event
    return rec


def _read(directory, ev: ending.Evidence):
    records = read_records(directory)
    ranks = [summarize_rank(r, ev.timed_out) for r in records]
    ending.apply_progress(ranks, ev.progress)
    status = run_status(ranks, ev.returncode, ev.timed_out, ev.output_tail)
    ending.describe(ranks, records, ev)
    status = ending.refine_status(status, ranks)
    findings = trace_findings(ranks, records, status, ev.returncode, 60, "log", ev.output_tail,
                              timed_out=ev.timed_out)
    return ranks, status, findings


LAUNCH = ("[ERROR] [launch.py:259:sigkill_handler] ['/usr/bin/python', '-u', 'infer.py', '--local_rank=0'] exits "
          "with return code = -9\n")
COUNTER = "/sys/fs/cgroup/process/memory.events"


def test_kernel_oom_killer_read_from_the_cgroup_counter(records_dir, monkeypatch):
    _killed_in_init(records_dir, monkeypatch, 0, 120 * GiB)
    _killed_in_init(records_dir, monkeypatch, 1, 1 * GiB)
    ev = ending.Evidence(247, False, LAUNCH, None, {"file": COUNTER, "count": 3}, {"file": COUNTER, "count": 4},
                         {"bytes": 125 * GiB, "source": "MemTotal"})
    ranks, status, findings = _read(records_dir, ev)
    assert status == "oom"
    by = {r.rank: r.ending for r in ranks}
    assert by[0]["kind"] == "oom-killer" and by[0]["signal"] == "SIGKILL" and by[0]["phase"] == "init"
    assert by[0]["oom_evidence"]["kind"] == "counter" and by[1]["kind"] == "by-launcher"
    f = next(f for f in findings if f.code == "DSD325")
    assert f.message() == ("rank 0 was killed by the kernel OOM killer (SIGKILL) in init: exit code -9 (DeepSpeed "
                           "launcher); the kernel OOM killer: cgroup v2 memory.events oom_kill 3 -> 4 during the run")
    assert "dsdoctor split" in f.fix() and f.message("zh").startswith("rank 0 被内核 OOM killer 杀掉")
    assert not any(f.code in ("DSD307", "DSD308") for f in findings)


def test_no_readable_counter_then_host_memory_near_the_limit_says_so(records_dir, monkeypatch):
    _killed_in_init(records_dir, monkeypatch, 0, 60 * GiB)
    _killed_in_init(records_dir, monkeypatch, 1, 60 * GiB)
    ev = ending.Evidence(247, False, LAUNCH, None, None, None, {"bytes": 125 * GiB, "source": "MemTotal"})
    ranks, status, findings = _read(records_dir, ev)
    assert status == "oom" and ranks[0].ending["oom_evidence"]["kind"] == "near-limit"
    msg = next(f for f in findings if f.code == "DSD325").message()
    assert "most likely the kernel OOM killer (no readable oom_kill counter)" in msg and "96%" in msg


def test_a_sigkill_without_oom_evidence_is_killed_not_oom(records_dir, monkeypatch):
    _killed_in_init(records_dir, monkeypatch, 0, 1 * GiB)
    _killed_in_init(records_dir, monkeypatch, 1, 1 * GiB)
    ev = ending.Evidence(247, False, LAUNCH, None, {"file": COUNTER, "count": 0}, {"file": COUNTER, "count": 0},
                         {"bytes": 125 * GiB, "source": "MemTotal"})
    ranks, status, findings = _read(records_dir, ev)
    assert status == "killed" and ranks[0].ending["kind"] == "signal"
    f = next(f for f in findings if f.code == "DSD325")
    assert "no sign of the kernel OOM killer: cgroup v2 memory.events oom_kill unchanged at 0" in f.message()
    assert "find what sent SIGKILL" in f.fix()
    text = TraceResult(["deepspeed", "x.py"], status, 247, 1.0, None, ranks, findings).to_text()
    assert "How the ranks ended" not in text and "was killed by SIGKILL in init" in text


def test_cuda_oom_with_fragmentation_advises_expandable_segments(records_dir, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    rec = _rank(records_dir, monkeypatch, 0, world=1)
    t = rec.begin("generate", api="generate")

    class OutOfMemoryError(RuntimeError):
        pass

    rec.end(t, error=OutOfMemoryError(CUDA_OOM))
    rec.close()
    ranks, status, findings = _read(records_dir, ending.Evidence(1, False, ""))
    assert status == "oom" and ranks[0].ending["kind"] == "cuda-oom"
    f = next(f for f in findings if f.code == "DSD326")
    assert "asking for 2.0 GiB with 1.2 GiB free, while 6.5 GiB was reserved by PyTorch but unallocated" in f.message()
    assert f.fix().startswith("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert "DSD307" in [x.code for x in findings]  # the OOM itself, as before


def test_an_nccl_watchdog_timeout_is_named(records_dir, monkeypatch):
    rec = _rank(records_dir, monkeypatch, 1)
    t = rec.begin("generate", api="generate")
    rec.end(t, error=RuntimeError("NCCL communicator was aborted on rank 1. " + NCCL))
    rec.close()
    ranks, status, findings = _read(records_dir, ending.Evidence(1, False, NCCL))
    f = next(f for f in findings if f.code == "DSD327")
    assert f.message() == "rank 1: a collective timed out in generate#0: NCCL ALLGATHER after 600000 ms (watchdog)"
    assert "DSD308" not in [x.code for x in findings]


def test_an_exception_ending_carries_its_last_line(records_dir, monkeypatch):
    rec = _rank(records_dir, monkeypatch, 0, world=1)
    t = rec.begin("init", api="deepspeed.initialize")
    rec.end(t, error=TypeError("can't multiply sequence by non-int of type 'str'\nmore text"))
    rec.close()
    ranks, _status, _findings = _read(records_dir, ending.Evidence(1, False, ""))
    assert ending.ending_text(ranks[0].ending) == "raised TypeError: can't multiply sequence by non-int of type " \
                                                  "'str' in init"


# ---------------------------------------------------------------- hang or slow

def _running(directory, monkeypatch, rank, user_line, innermost):
    rec = _rank(directory, monkeypatch, rank)
    rec.begin("init" if rank == 0 else "generate", api="x")
    rec._fh.close()
    Path(rec.path[: -len(".jsonl")] + ".stack.txt").write_text(
        "Current thread 0x1 (most recent call first):\n"
        f'  File "/venv/lib/python3.11/site-packages/{innermost[0]}", line 7 in {innermost[1]}\n'
        f'  File "/home/me/infer.py", line {user_line} in main\n')
    return rec


def test_ranks_waiting_on_each_other_but_one_still_working_is_slow_not_a_hang(records_dir, monkeypatch):
    """The loaded 2-core machine: rank 0 still compiles an op (CPU time rises), rank 1 waits for it."""
    r0 = _running(records_dir, monkeypatch, 0, 10, ("torch/utils/cpp_extension.py", "_jit_compile"))
    r1 = _running(records_dir, monkeypatch, 1, 40, ("torch/distributed/distributed_c10d.py", "barrier"))
    progress = {r0.pid: {"cpu_s": 1.6, "window_s": 3.0, "stack_still": True},
                r1.pid: {"cpu_s": 0.01, "window_s": 3.0, "stack_still": True}}
    ranks, status, findings = _read(records_dir, ending.Evidence(None, True, "", progress=progress))
    assert status == "timeout" and [r.status for r in ranks] == ["timeout", "timeout"]
    msg = next(f for f in findings if f.code == "DSD318").message()
    assert "still working (1.60s of CPU in 3.0s): a slow run, not a hang" in msg and "standing still" in msg
    # the same ranks with no progress anywhere: a hang, and DSD306 says what the watchdog saw
    r0_still = dict(progress[r0.pid], cpu_s=0.0)
    ranks, status, findings = _read(records_dir, ending.Evidence(None, True, "", progress={r0.pid: r0_still,
                                                                                          r1.pid: progress[r1.pid]}))
    assert status == "hang" and [r.status for r in ranks] == ["hang", "hang"]
    assert all("no progress in 3.0s" in f.message() for f in findings if f.code == "DSD306")


def test_progress_rules():
    assert ending.progressing({"cpu_s": 0.0, "window_s": 3, "stack_still": False}) is True  # the stack moved
    assert ending.progressing({"cpu_s": 2.0, "window_s": 3, "stack_still": True}) is True  # working in place
    assert ending.progressing({"cpu_s": 2.9, "window_s": 3, "stack_still": True, "in_collective": True}) is False
    assert ending.progressing({"cpu_s": 0.01, "window_s": 3, "stack_still": True}) is False
    assert ending.progressing(None) is None


def test_settle_without_evidence_keeps_the_old_rule():
    from dsdoctor.trace.report import RankSummary

    a = RankSummary(rank=0, host="h", pid=1, status="timeout", stopped_in="init", user_frame="x:1", in_collective=True)
    b = RankSummary(rank=1, host="h", pid=2, status="timeout", stopped_in="generate#0", user_frame="x:2")
    settle_timeout([a, b])
    assert (a.status, b.status) == ("hang", "hang")


# ---------------------------------------------------------------- the A/B verdict from endings

def _failed(name, kind, **end):
    v = VariantResult(name, name, {"oom-killer": "oom", "signal": "killed", "exception": "error",
                                   "hang": "hang"}[kind], None, 90 * GiB, None, 30.0, 247, "cpu",
                      optimizer="DeepSpeedZeroOptimizer_Stage3", config_source="train.json")
    v.endings = [dict({"kind": kind, "phase": "init", "signal": "SIGKILL", "exit_code": -9, "rank": 0,
                       "evidence": None, "detail": None}, **end)]
    return v


def _ran(name, host, tps, optimizer=None, offload="cpu", gpu=None):
    return VariantResult(name, name, "ok", gpu, host, tps, 20.0, 0, offload, optimizer=optimizer,
                         tokens_per_s_kind="steady")


def test_a_variant_that_runs_where_as_is_is_killed_is_the_fix():
    rows = [_failed("as-is", "oom-killer", oom_evidence={"kind": "near-limit", "used": 122 * GiB,
                                                         "limit": 125 * GiB, "limit_source": "MemTotal"}),
            _failed("no-offload-param", "oom-killer"), _ran("split", 22 * GiB, 8.1)]
    result = AbResult(["deepspeed", "infer.py"], rows, diagnose(rows))
    d = result.diagnosis
    assert d.code == "DSD316" and d.effective_severity == "error"
    assert d.message().startswith("split runs where as-is was killed by the kernel OOM killer (SIGKILL) in init")
    assert "optimizer DeepSpeedZeroOptimizer_Stage3 -> none" in d.message()
    assert "peak host 90.0 GiB -> 22.0 GiB" in d.message() and "8.1 tokens/s (steady state)" in d.message()
    assert "still fails: no-offload-param" in d.message()
    assert d.fix() == ("use the inference-only config: dsdoctor split train.json -o ds_infer.json, and pass "
                       "ds_infer.json to deepspeed.initialize")
    assert "DSD313" not in [f.code for f in result.findings] and d.message("zh")
    assert "was killed by the kernel OOM killer" in result.to_text()  # the "how it ended" column


def test_of_several_variants_that_run_the_faster_then_the_leaner_is_named():
    rows = [_failed("as-is", "exception", detail="TypeError: x"), _ran("no-offload-param", 30 * GiB, 9.0,
                                                                          optimizer="AdamW", offload=None),
            _ran("split", 20 * GiB, 8.9)]
    d = AbResult(["python", "x.py"], rows, diagnose(rows)).diagnosis
    assert d.code == "DSD316" and d.message().startswith("split runs where as-is raised TypeError: x in init")
    assert "also runs: no-offload-param" in d.message()


def test_every_variant_failing_alike_is_not_inconclusive():
    rows = [_failed("as-is", "hang", detail="infer.py:4"), _failed("split", "hang", detail="infer.py:4")]
    d = AbResult(["python", "x.py"], rows, diagnose(rows)).diagnosis
    assert d.code == "DSD317" and "the config variants are not the cause" in d.message()
    assert "synced_gpus=True" in d.fix()


def test_offload_only_if_it_does_not_fit_without_and_pin_memory_as_measured():
    from dsdoctor.trace.ab_verdict import findings as verdict_findings

    def v(name, tps, offload="cpu", host=1 * GiB):
        return VariantResult(name, name, "ok", 50 * 2**20, host, tps, 10.0, 0, offload,
                             generate_peak_gpu_bytes=50 * 2**20, generate_peak_host_bytes=host)

    got = {f.code: f for f in verdict_findings([v("as-is", 2.0), v("no-offload-param", 20.0, offload=None)])}
    assert got["DSD346"].fix().startswith("drop offload_param: the model fits without it")
    oom = VariantResult("no-offload-param", "n", "oom", None, None, None, 1.0, 1, None)
    slow_unpinned = [v("as-is", 9.0, host=30 * GiB), oom, v("pin-memory-off", 2.0, host=90 * GiB)]
    got = {f.code: f for f in verdict_findings(slow_unpinned)}
    assert "DSD346" not in got or "pin_memory on" in got["DSD346"].fix()


# ---------------------------------------------------------------- real ranks: ab names the fix

def _ab(tmp_path, variants, timeout, *command):
    r = run_cli("ab", "-q", "--format", "json", "--variants", variants, "--timeout", str(timeout),
                "-o", str(tmp_path / "ab"), "--", *map(str, command), env=deepspeed_env(), timeout=1500)
    return r, json.loads(r.stdout) if r.stdout.strip() else None


@pytest.mark.process
@pytest.mark.deepspeed
def test_ab_names_split_when_as_is_is_killed_after_building_an_optimizer(tmp_path):
    r, data = _ab(tmp_path, "as-is,no-offload-param,split", 400, DEEPSPEED, "--master_port", free_port(),
                  "--num_gpus", "2", SCRIPT, "--config", TRAIN, "--how", "kill")
    assert data is not None, r.stderr[-3000:]
    by = {v["name"]: v for v in data["variants"]}
    assert by["as-is"]["status"] in ("killed", "oom") and by["no-offload-param"]["status"] == by["as-is"]["status"]
    assert by["split"]["status"] == "ok", r.stderr[-3000:]
    killed = next(e for e in by["as-is"]["endings"] if e["kind"] in ("signal", "oom-killer"))
    assert killed["signal"] == "SIGKILL" and killed["exit_code"] == -9 and killed["phase"] == "after init"
    assert killed["evidence"] == {"kind": "launcher", "source": "deepspeed", "code": -9}
    assert by["as-is"]["returncode"] == 247  # the DeepSpeed launcher's exit status for a rank's -9
    d = data["diagnosis"]
    assert d["code"] == "DSD316" and d["message"].startswith("split runs where as-is was killed")
    assert "optimizer DeepSpeedZeroOptimizer_Stage3 -> none" in d["message"]
    assert "still fails: no-offload-param" in d["message"] and "dsdoctor split" in d["fix"]
    asis = json.loads((tmp_path / "ab" / "as-is" / "report.json").read_text())
    assert "DSD325" in {f["code"] for f in asis["findings"]}
    assert by["split"]["tokens_per_s_kind"] == "steady"  # two generates: the first and the steady state


@pytest.mark.process
@pytest.mark.deepspeed
def test_ab_names_split_when_as_is_raises_at_initialize(tmp_path):
    config = json.loads(TRAIN.read_text())
    config.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")  # HF Trainer leftovers
    (tmp_path / "auto.json").write_text(json.dumps(config))
    r, data = _ab(tmp_path, "as-is,split", 400, sys.executable, SCRIPT, "--config", tmp_path / "auto.json",
                  "--how", "none")
    assert data is not None, r.stderr[-3000:]
    by = {v["name"]: v for v in data["variants"]}
    assert by["as-is"]["status"] == "error" and by["split"]["status"] == "ok", r.stderr[-3000:]
    raised = by["as-is"]["endings"][0]
    assert raised["kind"] == "exception" and raised["phase"] == "init" and raised["detail"].startswith("TypeError")
    d = data["diagnosis"]
    assert d["code"] == "DSD316" and d["message"].startswith("split runs where as-is raised TypeError")
    assert "optimizer AdamW -> none" in d["message"] and "auto.json" in d["fix"]


@pytest.mark.process
@pytest.mark.deepspeed
def test_ab_names_split_when_as_is_hangs(tmp_path):
    r, data = _ab(tmp_path, "as-is,split", 240, DEEPSPEED, "--master_port", free_port(), "--num_gpus", "2",
                  SCRIPT, "--config", TRAIN, "--how", "hang")
    assert data is not None, r.stderr[-3000:]
    by = {v["name"]: v for v in data["variants"]}
    assert by["as-is"]["status"] == "hang" and by["split"]["status"] == "ok", r.stderr[-3000:]
    assert all(e["kind"] == "hang" for e in by["as-is"]["endings"])
    d = data["diagnosis"]
    assert d["code"] == "DSD316" and d["message"].startswith("split runs where as-is hung")
    asis = json.loads((tmp_path / "ab" / "as-is" / "report.json").read_text())
    hung = [f for f in asis["findings"] if f["code"] == "DSD306"]
    assert hung and all("no progress in" in f["message"] for f in hung)


# ---------------------------------------------------------------- what a measurement is

def test_tokens_per_s_is_the_steady_state_and_the_first_generate_is_said_apart(records_dir, monkeypatch):
    rec = _rank(records_dir, monkeypatch, 0, world=1)
    for _ in range(3):
        t = rec.begin("generate", api="generate", batch=4, prompt_len=8)
        rec.end(t, new_tokens=64)
    rec.close()
    records = read_records(records_dir)
    for p, seconds in zip(records[0].phases, (3.0, 1.0, 1.0)):  # the first generate is three times slower
        p.duration_s = seconds
    (rank,) = [summarize_rank(r, False) for r in records]
    assert rank.tokens_per_s == pytest.approx(64.0) and rank.tokens_per_s_kind == "steady"
    assert rank.first_tokens_per_s == pytest.approx(64 / 3) and rank.first_extra_s == pytest.approx(2.0)
    text = TraceResult(["python", "x.py"], "ok", 0, 1.0, None, [rank], []).to_text()
    assert "tokens/s: the steady state (every generate after the first); the first generate ran at 21.3" in text
    records[0].phases = records[0].phases[:1]
    single = summarize_rank(records[0], False)
    assert single.tokens_per_s_kind == "first" and single.tokens_per_s == pytest.approx(64 / 3)


def test_run_peak_gpu_is_the_reserved_peak_and_the_peak_phase_comes_from_live_tensors(records_dir, monkeypatch):
    """ab's "run peak GPU (reserved)" column showed the allocated peak (2.6 GiB where 3.75 were reserved)."""
    rec = _rank(records_dir, monkeypatch, 0, world=1)
    for name, alloc, reserved in (("load", 1.0, 1.2), ("generate", 2.81, 3.75)):
        t = rec.begin(name, api=name)
        rec.end(t, peak_gpu_allocated=int(alloc * GiB), peak_gpu_reserved=int(reserved * GiB))
    rec.close()
    (rank,) = [summarize_rank(r, False) for r in read_records(records_dir)]
    assert rank.peak_gpu_bytes == int(3.75 * GiB) and rank.peak_gpu_allocated_bytes == int(2.81 * GiB)
    assert rank.peak_phase == "generate#0"


@pytest.mark.process
@pytest.mark.deepspeed
@pytest.mark.parametrize("where", ["zero", "args"])
def test_trace_sees_a_zero_config_handed_to_init_inference(tmp_path, where):
    """init_inference(model, config={"zero": ...}) and init_inference(model, args=<a ZeRO config>) both run
    and ignore the ZeRO part: trace reports DSD122 with the deepspeed.initialize config that was meant."""
    r = run_cli("trace", "-q", "--format", "json", "-o", str(tmp_path / "t"), "--", sys.executable,
                str(SCRIPTS / "init_inference_tiny.py"), "--zero-in", where, env=deepspeed_env(), timeout=300)
    data = json.loads(r.stdout)
    assert data["status"] == "ok", r.stderr[-3000:]
    f = next(f for f in data["findings"] if f["code"] == "DSD122")
    assert ("ZeRO config in args" in f["message"]) == (where == "args")
    assert f["values"]["config_dict"]["zero_optimization"]["offload_param"]["device"] == "cpu"
    captured = data["ranks"][0]["config_captured"]
    assert (captured.get("zero") if where == "zero" else captured["args"]["zero_optimization"])["stage"] == 3
