"""Generation inside training (trace/loop.py, the gather-once ab variant) and traces across nodes.

The real runs: a PPO-style loop (generate, loss, backward, step) under ZeRO-3 on 2 CPU ranks, ab'd as-is
against gather-once; two torchrun agents (--nnodes 2, c10d on localhost, one rank each), each under its own
``dsdoctor trace`` into one shared --out. The unit tests feed hand-written records."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsdoctor.errors import InputError
from dsdoctor.findings import all_rules
from dsdoctor.trace.diagnose_ab import VariantResult, diagnose
from dsdoctor.trace.multinode import nodes_of
from dsdoctor.trace.records import read_records
from dsdoctor.trace.report import summarize_rank
from dsdoctor.trace.run_rules import trace_findings
from tests.helpers import SCRIPTS, deepspeed_env, free_port, run_cli

PPO = SCRIPTS / "ppo_loop.py"
PPO_CONFIG = SCRIPTS / "ppo_zero3.json"
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")


# ------------------------------------------------------------------ unit: records -> loop summary

def _write_records(path: Path, train: bool, optimizer: str | None = "DeepSpeedZeroOptimizer_Stage3",
                   gather_once: str | None = None, reference_model: bool = False) -> Path:
    t = 1000.0
    lines = [{"event": "start", "t": t, "rank": 0, "host": "h", "pid": 1, "world_size": 2},
             {"event": "phase_start", "t": t, "phase": "init", "index": 0, "api": "deepspeed.initialize"},
             {"event": "phase_end", "t": t + 1, "phase": "init", "index": 0, "duration_s": 1.0,
              "engine": {"zero_stage": 3, "optimizer": optimizer, "world_size": 2}}]
    if reference_model:  # DeepSpeed-Chat style: a frozen reference model initialized after the actor
        lines += [{"event": "phase_start", "t": t + 1, "phase": "init", "index": 1, "api": "deepspeed.initialize"},
                  {"event": "phase_end", "t": t + 1, "phase": "init", "index": 1, "duration_s": 0.1,
                   "engine": {"zero_stage": 3, "optimizer": None, "world_size": 2}}]
    t += 1
    for i in range(2):
        info = {"zero3_partitioned": True, "world_size": 2, "batch": 2, "prompt_len": 6,
                "gather_bytes_per_forward": 1000, "param_bytes": 1200, "param_element_size": 4,
                "model_shape": {"layers": 2, "kv_heads": 2, "head_dim": 16}, "synced_gpus": True}
        if gather_once:
            info["gather_once"] = gather_once
        lines.append({"event": "phase_start", "t": t, "phase": "generate", "index": i, **info})
        lines.append({"event": "phase_end", "t": t + 3, "phase": "generate", "index": i, "duration_s": 3.0,
                      "new_tokens": 16, "forwards": 8})
        t += 3
        if train:
            lines.append({"event": "train", "t": t + 0.5, "kind": "backward", "duration_s": 0.5})
            lines.append({"event": "train", "t": t + 1, "kind": "step", "duration_s": 0.1})
        t += 1
    lines.append({"event": "exit", "t": t})
    path.mkdir(parents=True, exist_ok=True)
    (path / "rank-0.h.1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _trace(tmp_path, **kw):
    recs = read_records(_write_records(tmp_path / "r", **kw))
    ranks = [summarize_rank(r, False) for r in recs]
    return ranks, trace_findings(ranks, recs, "ok", 0, None, None, "")


def test_a_loop_gets_its_cost_and_no_optimizer_leftover(tmp_path):
    ranks, findings = _trace(tmp_path, train=True)
    lp = ranks[0].loop
    assert lp["generates"] == 2 and lp["steps"] == 2 and lp["backwards"] == 2
    first = lp["per_generate"][0]
    assert first["gathered_bytes"] == 8 * 1000  # forwards x partitioned bytes per forward
    assert first["iteration_s"] == pytest.approx(4.0) and first["share"] == pytest.approx(0.75)
    assert lp["per_generate"][1]["iteration_s"] == pytest.approx(4.0)  # the last: to its step
    codes = [f.code for f in findings]
    assert "DSD330" in codes and "DSD101" not in codes
    f = next(f for f in findings if f.code == "DSD330")
    assert "6.00s of 8.00s (75%)" in f.message() and "8 forwards" in f.message()
    assert "dsdoctor ab --variants as-is,gather-once" in f.fix()
    assert "ZeRO-3" in f.message("zh")


def test_a_loop_with_a_reference_model_initialized_last(tmp_path):
    ranks, findings = _trace(tmp_path, train=True, reference_model=True)
    assert ranks[0].loop is not None and "DSD330" in [f.code for f in findings]


def test_inference_with_an_optimizer_is_still_a_leftover(tmp_path):
    ranks, findings = _trace(tmp_path, train=False)
    assert ranks[0].loop is None
    codes = [f.code for f in findings]
    assert "DSD330" not in codes
    assert ("DSD101" in codes) == ("DSD101" in all_rules())  # the config doctor's code, where it is merged


def test_a_loop_already_gathered_is_told_so(tmp_path):
    ranks, findings = _trace(tmp_path, train=True, gather_once="applied")
    codes = [f.code for f in findings]
    assert "DSD331" in codes and "DSD330" not in codes
    assert ranks[0].loop["per_generate"][0]["gathered_bytes"] == 1200  # one whole gather


def _variant(name, tps, peak):
    return VariantResult(name, "", "ok", None, peak, tps, 1.0, 0, None, generate_peak_host_bytes=peak)


def test_ab_diagnosis_puts_gather_once_beside_as_is():
    found = diagnose([_variant("as-is", 10.0, 500 << 20), _variant("gather-once", 25.0, 600 << 20)])
    f = next(f for f in found if f.code == "DSD332")
    assert "25.0 tokens/s against 10.0" in f.message() and "2.50x" in f.message()
    assert "DSD313" not in [x.code for x in found]


def test_ab_advice_follows_a_measured_slower_gather_once(tmp_path):
    """A gather-once measured slower than as-is is not recommended: DSD332 says keep the run, and the as-is
    trace's DSD330 yields to the measurement instead of recommending the gather."""
    from dsdoctor.trace.loop_rules import follow_measurement

    found = diagnose([_variant("as-is", 25.0, 500 << 20), _variant("gather-once", 10.0, 600 << 20)])
    f = next(f for f in found if f.code == "DSD332")
    assert f.effective_severity == "info" and "unwrap_model_for_generation" not in f.fix()
    assert f.fix().startswith("keep the rollout as it is") and "10.0 against 25.0" in f.fix()
    assert "保持 rollout 原样" in f.fix("zh")
    _ranks, as_is = _trace(tmp_path, train=True)
    dsd330 = next(x for x in as_is if x.code == "DSD330")
    assert "unwrap_model_for_generation" in dsd330.fix()  # the trace alone still says gather once
    followed = next(x for x in follow_measurement(found, as_is) if x.code == "DSD330")
    assert "measured gathering once slower" in followed.fix() and "unwrap_model_for_generation" not in followed.fix()
    assert followed.message() == dsd330.message()


def test_ab_advice_follows_a_measured_faster_gather_once(tmp_path):
    found = diagnose([_variant("as-is", 10.0, 500 << 20), _variant("gather-once", 25.0, 600 << 20)])
    f = next(f for f in found if f.code == "DSD332")
    assert f.effective_severity == "warning" and "unwrap_model_for_generation" in f.fix()
    from dsdoctor.trace.loop_rules import follow_measurement

    _ranks, as_is = _trace(tmp_path, train=True)
    assert follow_measurement(found, as_is) == as_is
    even = diagnose([_variant("as-is", 10.0, 500 << 20), _variant("gather-once", 10.5, 600 << 20)])
    f = next(f for f in even if f.code == "DSD332")
    assert f.effective_severity == "info" and "no faster" in f.fix()


@pytest.mark.parametrize("cmd, want", [
    (["torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "x.py", "--nnodes", "9"], (2, 1)),
    (["python", "-m", "torch.distributed.run", "--nnodes=1:3", "--node_rank=0", "x.py"], (3, 0)),
    (["torchrun", "--nproc-per-node", "2", "x.py"], None),
    (["torchrun", "--nnodes", "1", "x.py"], None),
    (["deepspeed", "--num_nodes", "2", "x.py"], None),
])
def test_nodes_of_a_command(cmd, want):
    assert nodes_of(cmd) == want


@pytest.mark.parametrize("cmd", [["torchrun", "--nnodes", "2", "x.py"],
                                 ["torchrun", "--nnodes", "2", "--node-rank", "2", "x.py"],
                                 ["torchrun", "--nnodes", "two", "--node-rank", "0", "x.py"]])
def test_nodes_of_refuses_what_cannot_be_kept_apart(cmd):
    with pytest.raises(InputError):
        nodes_of(cmd)


@pytest.mark.process
def test_report_only_needs_node_directories(tmp_path):
    r = run_cli("trace", "--report-only", str(tmp_path))
    assert r.returncode == 2 and "node-K" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("trace", "--report-only", str(tmp_path / "missing"))
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.process
def test_multinode_command_without_node_rank_is_bad_input(tmp_path):
    r = run_cli("trace", "-o", str(tmp_path / "t"), "--", sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "x.py")
    assert r.returncode == 2 and "--node-rank" in r.stderr
    assert not (tmp_path / "t").exists()


# ------------------------------------------------------------------ real DeepSpeed on 2 CPU ranks

def _tokens(log: Path) -> dict:
    """Each rank's final JSON object. The ranks run with ``python -u``, so ``print`` writes the object and its
    newline separately and two ranks' lines can run together: decode each object where it starts."""
    out, text, decoder = {}, log.read_text(), json.JSONDecoder()
    start = text.find('{"rank"')
    while start != -1:
        try:
            d, end = decoder.raw_decode(text, start)
            out[d["rank"]] = d
        except ValueError:  # not an object: e.g. a warning that quotes the script's print line
            end = start + 1
        start = text.find('{"rank"', end)
    return out


@pytest.mark.deepspeed
def test_ppo_loop_traced_and_abd_with_gather_once(tmp_path):
    """One ab run: the as-is variant is the full trace of the loop; the defaults turn into as-is,gather-once."""
    out = tmp_path / "ab"
    cmd = [DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", "2", str(PPO), "--config", str(PPO_CONFIG)]
    r = run_cli("ab", "-q", "--format", "json", "--timeout", "400", "-o", str(out), "--", *cmd,
                env=deepspeed_env(), timeout=900)
    data = json.loads(r.stdout)
    by = {v["name"]: v for v in data["variants"]}
    assert list(by) == ["as-is", "gather-once"], r.stderr[-3000:]
    assert all(v["status"] == "ok" for v in by.values()), r.stderr[-3000:]

    trace = json.loads((out / "as-is" / "report.json").read_text())
    codes = [f["code"] for f in trace["findings"]]
    assert "DSD330" in codes and "DSD101" not in codes
    for rank in trace["ranks"]:
        lp = rank["loop"]
        assert lp["generates"] == 3 and lp["steps"] == 3 and lp["backwards"] == 3
        assert all(g["forwards"] == 8 and g["gathered_bytes"] == 8 * lp["gather_bytes_per_forward"] > 0
                   for g in lp["per_generate"])
        assert all(0 < g["share"] <= 1 for g in lp["per_generate"])

    once = json.loads((out / "gather-once" / "report.json").read_text())
    assert all(g["gather_once"] == "applied" for r_ in once["ranks"] for g in r_["loop"]["per_generate"])
    assert "DSD331" in [f["code"] for f in once["findings"]]
    assert data["diagnosis"]["code"] == "DSD332"
    # same tokens in every iteration, and training went on the same way after the hooks came back
    a, b = _tokens(out / "as-is" / "output.log"), _tokens(out / "gather-once" / "output.log")
    assert sorted(a) == [0, 1] and a == b


@pytest.mark.deepspeed
def test_a_loop_that_already_gathers_is_told_so(tmp_path):
    """DeepSpeed's own unwrap_model_for_generation around generate: every parameter whole at generate."""
    out = tmp_path / "t"
    cmd = [DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", "2", str(PPO), "--config", str(PPO_CONFIG),
           "--iters", "2", "--unwrap"]
    r = run_cli("trace", "-q", "--format", "json", "--timeout", "900", "-o", str(out), "--", *cmd,
                env=deepspeed_env(), timeout=1000)  # the watchdog only for a hung run: generous on a loaded machine
    data = json.loads(r.stdout)
    assert data["status"] == "ok", r.stderr[-3000:]
    codes = [f["code"] for f in data["findings"]]
    assert "DSD331" in codes and "DSD330" not in codes and "DSD101" not in codes
    for rank in data["ranks"]:
        assert all(g["already_gathered"] and g["gathered_bytes"] == 0 for g in rank["loop"]["per_generate"])


def _agent(out: Path, node: int, port: int):
    cmd = [sys.executable, "-m", "dsdoctor", "trace", "-q", "--format", "json", "--timeout", "900", "-o",
           str(out), "--", sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
           str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
           "--rdzv-id", f"dsdoctor-test-{port}", str(SCRIPTS / "infer_tiny.py"), "--config",
           str(SCRIPTS / "train_zero3_offload.json")]
    return subprocess.Popen(cmd, env=deepspeed_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.deepspeed
def test_two_torchrun_nodes_into_one_report(tmp_path):
    out, port = tmp_path / "t", free_port()
    agents = [_agent(out, 0, port)]
    time.sleep(1.0)  # the second node joins a little later, as a real one would
    agents.append(_agent(out, 1, port))
    results = []
    try:
        for a in agents:
            stdout, stderr = a.communicate(timeout=1000)
            results.append((a.returncode, stdout, stderr))
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    for rc, _stdout, stderr in results:
        assert rc in (0, 1), stderr[-3000:]
    head, other = json.loads(results[0][1]), json.loads(results[1][1])
    assert head["status"] == "ok" and sorted(r["rank"] for r in head["ranks"]) == [0, 1]
    assert len(other["ranks"]) == 1 and other["out_dir"].endswith("node-1")
    report = json.loads((out / "report.json").read_text())
    assert sorted(r["rank"] for r in report["ranks"]) == [0, 1] and sorted(report["nodes"]) == ["node-0", "node-1"]
    assert all(report["nodes"][n]["returncode"] == 0 for n in report["nodes"])
    for node in ("node-0", "node-1"):  # each node kept its own part
        assert len(list((out / node / "records").glob("rank-*.jsonl"))) == 1
        assert (out / node / "output.log").is_file()
    assert json.loads((out / "node-1" / "report.json").read_text())["ranks"] == other["ranks"]
    r = run_cli("trace", "--report-only", str(out), "--format", "json")  # node 0's report is there: not replaced
    assert r.returncode == 2 and "report" in r.stderr and "--force" in r.stderr
    r = run_cli("trace", "--report-only", str(out), "--format", "json", "--force")
    assert r.returncode in (0, 1) and sorted(x["rank"] for x in json.loads(r.stdout)["ranks"]) == [0, 1]


def test_gather_once_no_faster_is_only_info():
    found = diagnose([_variant("as-is", 10.0, 500 << 20), _variant("gather-once", 10.5, 600 << 20)])
    f = next(f for f in found if f.code == "DSD332")
    assert f.effective_severity == "info"


@pytest.mark.process
def test_torch_backward_and_optimizer_step_are_seen_without_an_engine(tmp_path):
    out = tmp_path / "t"
    r = run_cli("trace", "-q", "--format", "json", "-o", str(out), "--", sys.executable,
                str(SCRIPTS / "torch_loop.py"), timeout=300)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    (rec,) = read_records(out / "records")
    kinds = [(e["kind"]) for e in rec.train]
    assert kinds.count("backward") == 2 and kinds.count("step") == 2
    assert len([p for p in rec.phases if p.name == "generate"]) == 2
    # no DeepSpeed engine, no optimizer built by it: not a ZeRO-3 loop, and nothing claims one
    assert json.loads(r.stdout)["ranks"][0]["loop"] is None
