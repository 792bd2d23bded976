"""trace and ab of a real 2-rank ZeRO-3 run on the CPU accelerator (host memory stands in for GPU memory).

The script under test reuses a ZeRO-3 offload *training* config and is run unchanged."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from dsdoctor.findings import all_rules
from dsdoctor.proctree import deepspeed_shm_files
from tests.helpers import SCRIPTS, deepspeed_env, free_port, reached_in_time, run_cli

SCRIPT = SCRIPTS / "infer_tiny.py"
CONFIG = SCRIPTS / "train_zero3_offload.json"
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")

pytestmark = pytest.mark.deepspeed


HANG_S = 60  # the hang test's first --timeout; idle, the ranks reach the barrier in well under that


def _deepspeed(*script_args):
    return [DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", "2", str(SCRIPT), "--config", str(CONFIG),
            *script_args]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_hang_is_caught_and_every_rank_is_ended(tmp_path):
    """Ranks ask for different lengths without synced_gpus, then meet at a barrier: the classic hang.

    The watchdog must fire after the ranks got there. When rank 0 had not reached the barrier by then (a
    loaded machine starts DeepSpeed ranks slowly), the run is repeated with a longer --timeout."""
    for limit in (HANG_S, 4 * HANG_S):
        ready = tmp_path / f"ready-{limit}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
               "--config", str(CONFIG), "--hang", "--ready", str(ready)]  # torchrun: ranks live in sessions of their own
        start = time.time()
        r = run_cli("trace", "-q", "--format", "json", "--timeout", str(limit), "-o", str(tmp_path / f"t{limit}"),
                    "--", *cmd, env=deepspeed_env(), timeout=limit + 180)
        if reached_in_time(ready, start, limit):
            break
    assert reached_in_time(ready, start, limit), f"rank 0 did not reach the barrier within {limit}s"
    data = json.loads(r.stdout)
    assert r.returncode == 1 and data["status"] == "hang", r.stderr[-3000:]
    ranks = {x["rank"]: x for x in data["ranks"]}
    assert ranks[1]["status"] == "hang" and ranks[1]["stopped_in"] == "generate#0"
    assert ranks[0]["stopped_in"] == "after generate#0" and "infer_tiny.py" in ranks[0]["where"]
    assert "barrier" in ranks[0]["where"]
    codes = [f["code"] for f in data["findings"]]
    assert codes.count("DSD306") == 2 and "DSD301" in codes
    assert all(_gone(x["pid"]) for x in data["ranks"]), "a rank was left running"


@pytest.mark.timeout(3 * 400 + 200)
@pytest.mark.serial  # checks what dsdoctor unlinks from /dev/shm: alone (tests/conftest.py says why)
def test_training_config_traced_and_abd_unchanged(tmp_path):
    """One ab run (3 variants, 2 ranks each); its as-is variant is the full trace of the reused training config.

    The script raises a CUDA-style OOM inside generate when offload_param is off (a real GPU OOM cannot happen
    on the CPU), so no-offload-param must come back as an `oom` result, not a crash."""
    out = tmp_path / "ab"
    command = _deepspeed("--oom-without-offload", "--no-synced-gpus")
    port = command[command.index("--master_port") + 1]
    r = run_cli("ab", "-q", "--format", "json", "--timeout", "400", "-o", str(out), "--", *command,
                env=deepspeed_env(), timeout=3 * 400 + 100)  # three variants, each under its own watchdog
    assert deepspeed_shm_files(port) == set()  # 3 launches x 2 CPU ranks on this port, none left in /dev/shm
    data = json.loads(r.stdout)
    by = {v["name"]: v for v in data["variants"]}
    assert list(by) == ["as-is", "no-offload-param", "split"], r.stderr[-3000:]
    assert by["as-is"]["status"] == "ok" and by["split"]["status"] == "ok", r.stderr[-3000:]
    assert by["no-offload-param"]["status"] == "oom"  # a result, not a crash
    assert "DSD307" in by["no-offload-param"]["findings"]
    assert "rank 0 OOM in generate#0" in by["no-offload-param"]["stopped"]
    assert all(v["peak_host_bytes"] > 0 for v in data["variants"])
    assert by["as-is"]["tokens_per_s"] > 0 and by["no-offload-param"]["tokens_per_s"] is None
    assert data["diagnosis"]["code"] == "DSD315"  # OOM only without offload_param: offloading makes it fit
    assert "without offload_param the run is out of memory (OOM)" in data["diagnosis"]["message"]
    assert r.returncode == 1  # the as-is run's own findings count: DSD301 is an error
    assert "DSD301" in {f["code"] for f in data["findings"]}
    assert (out / "report.md").read_text().startswith("# dsdoctor ab")
    # ab reads the peak: the as-is generate peak split into plan's parts for the recorded shape (CPU: host RSS)
    attribution = next(f for f in data["findings"] if f["code"] == "DSD345")["message"]
    assert "as-is (zero3-offload, host)" in attribution and "KV cache" in attribution and "unexplained" in attribution
    assert by["as-is"]["shape"]["batch"] >= 1 and by["as-is"]["shape"]["model_config"]["model_type"] == "llama"

    # the as-is variant: what took effect, as DeepSpeed built it, rank by rank
    asis = json.loads((out / "as-is" / "report.json").read_text())
    assert [x["rank"] for x in asis["ranks"]] == [0, 1]
    for rank in asis["ranks"]:
        assert rank["zero_stage"] == 3 and rank["configured_stage"] == 3
        assert rank["optimizer"] == "DeepSpeedZeroOptimizer_Stage3" and rank["base_optimizer"] == "AdamW"
        assert rank["optimizer_state_bytes"] > 0
        assert (rank["offload_param"], rank["offload_optimizer"]) == ("cpu", "cpu")
        assert rank["dtype"] == "fp32" and rank["tp_size"] == 1 and rank["world_size"] == 2
        assert rank["synced_gpus"] is False
        assert [p["label"] for p in rank["phases"]] == ["load", "init", "generate#0"]
        gen = rank["phases"][2]
        assert gen["new_tokens"] == 16 and gen["tokens_per_s"] > 0
        assert rank["peak_host_bytes"] > 100 * 2**20 and rank["peak_gpu_bytes"] is None  # no CUDA here
        assert rank["peak_phase"] and rank["timeline"]
        assert rank["config_passed"]["source"] == str(CONFIG) and rank["config_passed"]["variant_applied"] is None
    codes = {f["code"] for f in asis["findings"]}
    assert {"DSD301", "DSD304"} <= codes  # generate without synced_gpus on 2 ZeRO-3 ranks
    assert ("DSD101" in codes) == ("DSD101" in all_rules())  # the config doctor's code, once merged
    assert {p.name for p in (out / "as-is").iterdir()} >= {"report.json", "report.md", "timeline.html", "output.log",
                                                           "timeline-rank-0.png", "timeline-rank-1.png", "records"}
    assert '"generated": 8' in (out / "as-is" / "output.log").read_text()

    # the rewrite happened in-process, the file is untouched
    split = json.loads((out / "split" / "report.json").read_text())
    assert split["variant"] == "split" and all(x["optimizer"] is None for x in split["ranks"])
    assert all(x["config_passed"]["variant_applied"] == "split" for x in split["ranks"])
    nop = json.loads((out / "no-offload-param" / "report.json").read_text())
    assert all(x["offload_param"] is None and x["offload_optimizer"] == "cpu" for x in nop["ranks"])
    assert "optimizer" in json.loads(CONFIG.read_text())
