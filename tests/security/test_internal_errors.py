"""Issue 26, internal errors without a file named: inputs that ended a command in an internal error (a Python
exception's text, no file named) now end it as bad input (exit 2, one line naming the file or the flag) or are
read as far as they make sense.

Classes: YAML values JSON cannot hold (dates, sets, binary) in split/check/diagnose; a file-size limit
(ulimit -f) of 0; trace records written by a rank that are not what the observer writes; numbers past any
machine in flags (``ab --variants prefetch=1e400``, ``plan --gpu-memory 1e400``); rank files whose
partition_count or zero_stage is not a count."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsdoctor.checkpoint.plan import check_world_size
from dsdoctor.errors import InputError
from dsdoctor.trace.records import read_records, valid_event
from dsdoctor.trace.report import TraceResult, run_status, summarize_rank
from dsdoctor.trace.run_rules import trace_findings
from dsdoctor.trace.variants import parse_variants
from dsdoctor.units import parse_bytes
from tests.helpers import run_cli, write_model_config

HANG_GUARD_S = 120

# ---------------------------------------------------------------------------- YAML values JSON cannot hold

YAML_VALUES = {
    # file text, the key the message must name, what it must call the value
    "date": ("zero_optimization:\n  stage: 3\nwhen: 2024-01-01\n", "when", "a date"),
    "datetime": ("zero_optimization:\n  stage: 3\n  at: 2024-01-01 10:00:00\n", "zero_optimization.at",
                 "a date and time"),
    "set": ("zero_optimization:\n  stage: 3\ns: !!set {a, b}\n", "s", "a set"),
    "binary": ("zero_optimization:\n  stage: 3\nb: !!binary aGVsbG8=\n", "b", "binary data"),
    "in-list": ("zero_optimization:\n  stage: 3\nl: [1, 2024-01-01]\n", "l[1]", "a date"),
    "date-key": ("2024-01-01: 3\nzero_optimization: {stage: 3}\n", "2024", "not a string"),
}


@pytest.mark.process
@pytest.mark.parametrize("command", ["split", "check", "diagnose"])
@pytest.mark.parametrize("case", sorted(YAML_VALUES))
def test_yaml_values_json_cannot_hold_are_refused_naming_the_key(tmp_path, case, command):
    text, key, what = YAML_VALUES[case]
    cfg = tmp_path / "ds.yaml"
    cfg.write_text(text)
    out = tmp_path / "out"
    args = {"split": ("split", cfg, "-o", out),
            "check": ("check", cfg),
            "diagnose": ("diagnose", "--config", cfg, "--model", write_model_config(tmp_path / "model"),
                         "--out", out)}[command]
    r = run_cli(*args, timeout=HANG_GUARD_S)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert str(cfg) in r.stderr and key in r.stderr and what in r.stderr, r.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------- a file-size limit of 0

def _no_file_size(limit=0):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return apply


@pytest.mark.process
@pytest.mark.parametrize("command", ["split", "diagnose"])
def test_a_file_size_limit_of_0_is_one_line_naming_the_limit_and_leaves_nothing(tmp_path, command):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}))
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    args = {"split": ["split", cfg, "-o", out],
            "diagnose": ["diagnose", "--config", cfg, "--model", write_model_config(tmp_path / "model"),
                         "--out", out]}[command]
    env = dict(os.environ, PYTHONIOENCODING="utf-8", LANG="C.UTF-8")
    env.pop("DSDOCTOR_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "dsdoctor", *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=HANG_GUARD_S, preexec_fn=_no_file_size())
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)  # not killed by SIGXFSZ (-25)
    assert "file-size limit" in r.stderr and str(work) in r.stderr, r.stderr
    assert "internal error" not in r.stderr and r.stderr.count("\n") <= 2, r.stderr
    assert sorted(os.listdir(work)) == []  # no output, no lock, no temporary file


# ---------------------------------------------------------------------------- forged trace records

_KEYS = ["event", "t", "rank", "host", "pid", "world_size", "host_total", "variant", "phase", "index", "host_rss",
         "gap_peak_host_rss", "gap_peak_gpu_reserved", "duration_s", "peak_gpu_allocated", "peak_gpu_reserved",
         "gpu_used_device", "gpu_total", "peak_host_rss", "pinned_host_bytes", "new_tokens", "error", "engine",
         "model", "forwards", "new_tokens_per_seq", "data", "files", "kind", "api", "config", "summary", "source",
         "synced_gpus", "zero3_partitioned", "batch", "prompt_len", "zero_stage", "optimizer", "offload_param",
         "offload_optimizer", "dtype", "tp_size", "message", "type", "num_params", "rewritable"]
_EVENTS = ["start", "phase_start", "phase_end", "samples", "config", "model", "zero_shards_to_init_inference",
           "train", "uncaught", "exit"]
_scalars = (st.none() | st.booleans() | st.integers(-5, 2**70) | st.floats()
            | st.sampled_from(["", "x", "generate", "init", "\x1b[2J", "a\nb", "cpu", "bf16", "auto"])
            | st.sampled_from([1, 2, 0, 1.0, 1_700_000_000.0, 2**31, -1]))
_values = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4)
                       | st.dictionaries(st.sampled_from(_KEYS), kids, max_size=4), max_leaves=12)
_events = st.one_of(
    st.fixed_dictionaries({"event": st.sampled_from(_EVENTS), "t": st.floats(1.7e9, 1.7e9 + 10)},
                          optional={k: _values for k in _KEYS[2:]}),
    _values,
)
_start = st.fixed_dictionaries({"event": st.just("start"), "t": st.just(1.7e9), "rank": st.integers(0, 2),
                                "host": st.just("h"), "pid": st.just(123), "world_size": st.just(2),
                                "host_total": st.just(2**36)})
_rank_files = st.lists(st.tuples(_start, st.lists(_events, min_size=1, max_size=20)), min_size=1, max_size=2)


def _report(directory: Path, timed_out: bool, returncode):
    records = read_records(directory)
    ranks = [summarize_rank(r, timed_out) for r in records]
    status = run_status(ranks, returncode, timed_out, "tail")
    findings = trace_findings(ranks, records, status, returncode, 10.0, "out/output.log", "tail",
                              timed_out=timed_out)
    result = TraceResult(command=["x"], status=status, returncode=returncode, wall_s=1.0, timeout=10.0,
                         ranks=ranks, findings=findings, variant=None, out_dir=None, log=None, output_tail="")
    for lang in ("en", "zh"):
        result.to_text(lang)
        result.to_markdown(lang)
        json.dumps(result.to_dict(lang))
    return result


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=_rank_files, timed_out=st.booleans(), returncode=st.sampled_from([0, 1, -9, None]))
def test_forged_trace_records_never_end_the_report_in_an_exception(files, timed_out, returncode):
    with tempfile.TemporaryDirectory(prefix="dsdoctor-records-") as tmp:  # removed after every example
        for k, (start, events) in enumerate(files):
            lines = [json.dumps(x) for x in [start, *events]]
            (Path(tmp) / f"rank-{k}.h.{100 + k}.jsonl").write_text("\n".join(lines) + "\n")
        _report(Path(tmp), timed_out, returncode)


@pytest.mark.parametrize("line,kept", [
    ({"event": "phase_start", "t": 1.0}, None),  # no phase name
    ({"event": "phase_end", "phase": "generate", "t": "late"}, None),
    ({"event": 5}, None),
    ([1, 2], None),
    ({"event": "start", "rank": float("nan"), "t": 1.0}, {"event": "start", "t": 1.0}),
    ({"event": "start", "rank": 2**80, "pid": True, "t": 1.0}, {"event": "start", "t": 1.0}),
    ({"event": "start", "rank": 3.0, "t": 1.0}, {"event": "start", "rank": 3, "t": 1.0}),
    ({"event": "phase_end", "phase": "g", "t": 2.0, "peak_gpu_allocated": "1e9", "error": {"type": 5}},
     {"event": "phase_end", "phase": "g", "t": 2.0, "error": {"type": "Error", "message": ""}}),
    ({"event": "samples", "t": 1.0, "data": [[1, 2, 3, 4], [1, 2], "x", [1, None, 3, 4], [float("inf"), 1, 1, 1]]},
     {"event": "samples", "t": 1.0, "data": [[1, 2, 3, 4], [1, None, 3, 4]]}),  # None: not measured
    ({"event": "zero_shards_to_init_inference", "files": ["a", 3, None]},
     {"event": "zero_shards_to_init_inference", "files": ["a"]}),
])
def test_a_record_field_of_the_wrong_type_is_dropped(line, kept):
    assert valid_event(line) == kept


@pytest.mark.parametrize("events", [
    [{"event": "config", "api": "deepspeed.initialize", "summary": None, "config": None}],
    [{"event": "phase_start", "phase": "generate", "index": None, "t": 1.7e9 + 1},
     {"event": "phase_end", "phase": "generate", "index": None, "t": 1.7e9 + 2, "engine": None, "error": None}],
    [{"event": "samples", "data": None}, {"event": "zero_shards_to_init_inference", "files": None}],
], ids=["config", "phase", "lists"])
def test_null_fields_are_read_as_not_written(tmp_path, events):
    lines = [{"event": "start", "t": 1.7e9, "rank": 0, "host": "h", "pid": 1, "world_size": 1}, *events]
    (tmp_path / "rank-0.h.1.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    result = _report(tmp_path, False, 0)
    assert len(result.ranks) == 1


@pytest.mark.process
def test_trace_of_a_program_forging_its_records_reports_without_an_internal_error(tmp_path):
    """A real traced program writes record lines of its own into the folder the observer writes to."""
    forged = [{"event": "start", "t": 1.7e9, "rank": "0", "pid": [1]},
              {"event": "phase_start", "phase": {"x": 1}, "t": 1.7e9},
              {"event": "phase_start", "phase": "generate", "index": float("nan"), "t": 1.7e9},
              {"event": "phase_end", "phase": "generate", "index": 0, "t": 1.7e9 + 1, "peak_gpu_reserved": 1e400,
               "error": "boom", "engine": [1]},
              {"event": "samples", "data": [[1.7e9, "x", 2, 3], 7]},
              {"event": "uncaught", "error": 5}, {"event": "exit"}, [1, 2], "text", 1e400]
    script = tmp_path / "forge.py"
    script.write_text(
        "import json, os, sys\n"
        f"lines = {json.dumps([json.dumps(x) for x in forged])!r}\n"
        "d = os.environ['PYTHON_DSDOCTOR_TRACE_DIR']\n"
        "with open(os.path.join(d, 'rank-0.forged.1.jsonl'), 'w') as fh:\n"
        "    fh.write('\\n'.join(json.loads(lines)) + '\\n')\n")
    r = run_cli("trace", "-o", tmp_path / "trace", "--", sys.executable, script, timeout=HANG_GUARD_S)
    assert r.returncode in (0, 1), (r.returncode, r.stdout, r.stderr)
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert (tmp_path / "trace" / "report.md").is_file() or (tmp_path / "trace").is_dir()


# ---------------------------------------------------------------------------- numbers past any machine

@pytest.mark.parametrize("text", ["prefetch=1e400", "prefetch=nan", "prefetch=inf", "prefetch=0", "prefetch=1e13"])
def test_a_bucket_size_past_any_model_is_refused(text):
    with pytest.raises(InputError, match="bucket size must be a number of elements from 1"):
        parse_variants(text)


@pytest.mark.parametrize("text", ["1e400", "1e400GiB", "2000000000TiB", 1e400, float("nan"), 2**70])
def test_a_size_past_any_machine_is_refused(text):
    with pytest.raises(InputError, match="larger than any machine"):
        parse_bytes(text, "--gpu-memory")


@pytest.mark.process
@pytest.mark.parametrize("args,flag", [
    (("ab", "-o", "{out}", "--variants", "as-is,prefetch=1e400", "--", sys.executable, "-c", "pass"), "prefetch"),
    (("plan", "--model", "{model}", "--gpu-memory", "1e400"), "--gpu-memory"),
], ids=["ab", "plan"])
def test_flags_past_any_machine_are_one_line_exit_2(tmp_path, args, flag):
    model = write_model_config(tmp_path / "model")
    r = run_cli(*(str(a).format(model=model, out=tmp_path / "ab") for a in args), timeout=HANG_GUARD_S)
    assert r.returncode == 2 and flag in r.stderr, (r.returncode, r.stderr)
    assert "internal error" not in r.stderr and r.stderr.count("\n") <= 2, r.stderr
    assert not (tmp_path / "ab").exists()


# ---------------------------------------------------------------------------- counts in rank files

def _states(tmp_path, *optim):
    files = [tmp_path / f"bf16_zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in range(len(optim))]
    layout = SimpleNamespace(optim_files=files, tag_dir=tmp_path)
    return SimpleNamespace(layout=layout, optim=list(optim))


@pytest.mark.parametrize("pc,stage,problem", [
    ([2, "x"], 2, "invalid partition_count"),
    ([], 2, "invalid partition_count"),
    ([2, True], 2, "invalid partition_count"),
    (2, "3", "invalid zero_stage"),
    (2, 7, "invalid zero_stage"),
    (2, {"a": 1}, "invalid zero_stage"),
])
def test_rank_files_whose_counts_are_not_counts_are_named(tmp_path, pc, stage, problem):
    states = _states(tmp_path, {"partition_count": pc, "zero_stage": stage},
                     {"partition_count": pc, "zero_stage": stage})
    with pytest.raises(InputError, match=problem) as err:
        check_world_size(states)
    assert str(err.value.path) == str(states.layout.optim_files[0])


def test_partition_counts_per_group_take_the_largest(tmp_path):
    """MoE expert groups save a smaller count than the dense groups: the world is the largest."""
    states = _states(tmp_path, {"partition_count": [2, 1], "zero_stage": 2},
                     {"partition_count": [2, 1], "zero_stage": 2})
    assert check_world_size(states) == 2
