"""trace on a mixture of experts under ZeRO-3: the experts and bytes each rank gathered per MoE layer (DSD342), and
a run whose ranks gathered different experts named as such, with the leaf-module fix (DSD341).

The real runs use tests/scripts/moe_zero3.py on 2 CPU ranks: a tiny model whose MoE blocks keep one module per
expert and skip the experts no token chose (transformers 4.x's mechanism; the installed transformers 5 fuses its
experts), each rank its own prompt. On gloo the mismatched all-gathers abort a rank ("Received data size doesn't
match expected size"); on NCCL they hang. With --leaf (set_z3_leaf_modules) the same run finishes."""
from __future__ import annotations

import faulthandler
import json
import signal
import sys
from pathlib import Path

import pytest

from dsdoctor.trace.observer.recorder import Recorder
from dsdoctor.trace.records import read_records
from dsdoctor.trace.report import run_status, summarize_rank
from dsdoctor.trace.run_rules import trace_findings
from tests.helpers import SCRIPTS, deepspeed_env, free_port, run_cli

DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
SCRIPT = SCRIPTS / "moe_zero3.py"
CONFIG = SCRIPTS / "ds_zero3_infer.json"
BLOCK = {"block": "moe_zero3.SparseMoeBlock", "fused": False, "leaf": False, "experts": 8}


@pytest.fixture
def records_dir(tmp_path):
    yield tmp_path
    try:
        faulthandler.unregister(signal.SIGUSR1)
    except Exception:
        pass


def _rank(directory, monkeypatch, rank):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    return Recorder(str(directory))


def _read(directory, returncode):
    records = read_records(directory)
    ranks = [summarize_rank(r, False) for r in records]
    status = run_status(ranks, returncode, False, "")
    return trace_findings(ranks, records, status, returncode, 8, "log", "", timed_out=False)


def _write(records_dir, monkeypatch, experts_by_rank, finish):
    for rank, rows in experts_by_rank.items():
        rec = _rank(records_dir, monkeypatch, rank)
        t = rec.begin("generate", api="generate", synced_gpus=True, zero3_partitioned=True, world_size=2, moe=BLOCK)
        for forward, layer, expert in rows:
            rec.write("expert", forward=forward, layer=layer, expert=expert)
        if finish:
            rec.end(t, new_tokens=4, moe_gathers=dict(BLOCK, forwards=1, layers={
                "0": {"experts": 2, "bytes": 4096}, "1": {"experts": 2, "bytes": 4096}}))
            rec.write("exit")
        rec._fh.close()


def test_ranks_that_entered_different_experts_of_a_layer_are_named_with_the_fix(records_dir, monkeypatch):
    _write(records_dir, monkeypatch, {0: [(0, 0, 1), (0, 0, 5), (0, 1, 2), (0, 1, 3)],
                                      1: [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 5), (0, 0, 6)]}, finish=False)
    f = next(f for f in _read(records_dir, returncode=1) if f.code == "DSD341")
    msg = f.message()
    assert "layer 0 of forward 0 (rank 0: experts 1, 5; rank 1: experts 0, 1, 2, 5, 6)" in msg
    assert "SparseMoeBlock runs one module per expert" in msg
    assert "set_z3_leaf_modules(model, [SparseMoeBlock]) (from moe_zero3 import SparseMoeBlock)" in f.fix()
    assert "不同的专家" in f.message("zh")


def test_same_experts_on_every_rank_or_a_finished_run_is_no_hang(records_dir, monkeypatch):
    same = [(0, 0, 1), (0, 0, 5)]
    _write(records_dir, monkeypatch, {0: same, 1: same}, finish=False)
    assert "DSD341" not in [f.code for f in _read(records_dir, returncode=1)]


def test_a_finished_moe_generate_reports_gathers_per_rank_per_layer(tmp_path, monkeypatch):
    _write(tmp_path, monkeypatch, {0: [(0, 0, 1)], 1: [(0, 0, 2)]}, finish=True)
    found = {f.code: f for f in _read(tmp_path, returncode=0)}
    assert "DSD341" not in found  # different experts, but the run finished (the ranks agreed on sizes)
    msg = found["DSD342"].message()
    assert msg.startswith("SparseMoeBlock under ZeRO-3, generate#0: rank 0 gathered 2.0 experts per MoE layer")
    assert "8.0 KiB per forward over 2 layers, 1 forwards" in msg and "rank 1 gathered" in msg


def _trace(tmp_path, *script_args):
    cmd = [DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", "2", str(SCRIPT), "--config", str(CONFIG),
           *script_args]
    r = run_cli("trace", "-q", "--format", "json", "--timeout", "600", "-o", str(tmp_path / "t"), "--", *cmd,
                env=deepspeed_env(), timeout=800)
    return r, json.loads(r.stdout)


@pytest.mark.deepspeed
@pytest.mark.timeout(1800)
def test_per_expert_modules_that_skip_experts_break_zero3_and_the_leaf_fix_works(tmp_path):
    r, data = _trace(tmp_path / "skip")
    assert r.returncode != 0 and data["status"] != "ok", r.stderr[-3000:]
    assert "Received data size doesn't match expected size" in (tmp_path / "skip" / "t" / "output.log").read_text()
    found = {f["code"]: f for f in data["findings"]}
    assert "DSD341" in found, [f["code"] for f in data["findings"]]
    assert "set_z3_leaf_modules(model, [SparseMoeBlock])" in found["DSD341"]["fix"]

    r, data = _trace(tmp_path / "leaf", "--leaf")
    assert r.returncode in (0, 1) and data["status"] == "ok", r.stderr[-3000:]
    codes = [f["code"] for f in data["findings"]]
    assert "DSD341" not in codes and "DSD342" in codes
    msg = next(f["message"] for f in data["findings"] if f["code"] == "DSD342")
    # a leaf block is gathered whole: all 8 experts of each of the 2 layers, every forward, on both ranks
    assert "rank 0 gathered 8.0 experts per MoE layer per forward" in msg
    assert "rank 1 gathered 8.0 experts per MoE layer per forward" in msg and "over 2 layers" in msg
