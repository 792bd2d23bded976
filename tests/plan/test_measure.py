"""``plan --measure``: the refusal without a GPU (a real CLI process), the record a run leaves in the machine
profile, and the plan again with it; the runner itself on the CPU (a tiny Phi-3 under ZeRO-3: the hold-out
case that crashed edge_gpu.py). No GPU run here: on a GPU the same code runs capped at the target's memory."""
from __future__ import annotations

import json
import math
import sys

import pytest

from dsdoctor.calibrate.profile import RUN_KEYS, cache_path, fingerprint, load_profile, machine_description
from dsdoctor.errors import InputError
from dsdoctor.machine import Gpu
from dsdoctor.plan import measure as measure_mod
from dsdoctor.plan.request import PlanRequest
from tests.helpers import EXAMPLES, ROOT, deepspeed_env, run_cli, run_process

LLAMA = EXAMPLES / "llama-7b"
REQ = dict(model=str(LLAMA), gpus=1, gpu_memory="20GiB", host_memory="512GiB", gpu_name="H100", counts="formula",
           batch=2, prompt_len=512, new_tokens=16)


@pytest.mark.process
def test_refused_without_a_gpu_in_one_line(tmp_path):
    env = {"PATH": str(tmp_path), "DSDOCTOR_CACHE_DIR": str(tmp_path / "cache")}  # no nvidia-smi to find
    r = run_cli("plan", "--model", LLAMA, "--measure", "--gpu-memory", "20GiB", env=env)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) <= 2 and "GPU" in lines[0] and "Traceback" not in r.stderr
    assert r.stdout == "" and not (tmp_path / "cache").exists()  # nothing planned, nothing written


def _fake_gpu(monkeypatch, total=80 * 2**30):
    monkeypatch.setattr("dsdoctor.machine.nvidia_smi_gpus", lambda *a, **k: [Gpu(0, "NVIDIA H100 80GB HBM3", total)])


def _runner(ratio: float, observed: str = "fits"):
    jobs = []

    def run(job):
        jobs.append(job)
        return {"path": job["path"], "observed": observed, "phase": "done", "cap_applied": True,
                "device": "NVIDIA H100 80GB HBM3", "peak_allocated": 15 * 2**30,
                "peak_reserved": int(job["cap_bytes"] * ratio), "alloc_retries": 0, "outside_measured": 600 * 2**20,
                "first_tokens_per_s": 40.0, "steady_tokens_per_s": 55.0}
    return run, jobs


def test_a_measured_run_is_recorded_and_sets_this_shapes_band(tmp_path, monkeypatch):
    monkeypatch.setenv("DSDOCTOR_CACHE_DIR", str(tmp_path))
    _fake_gpu(monkeypatch)
    run, jobs = _runner(0.9)
    res = measure_mod.measure(PlanRequest(**REQ), run=run)
    assert [j["path"] for j in jobs] == [r["path"] for r in res.runs] and jobs[0]["path"] == "plain"
    job = jobs[0]
    before = res.runs[0]["predicted"]
    assert job["cap_bytes"] == 20 * 2**30 - before["outside"] and job["config"]["model_type"] == "llama"
    prof = load_profile(cache_path(fingerprint(machine_description())))  # the record survives the profile's checks
    rec = prof.runs[0]
    assert set(rec) == set(RUN_KEYS) and rec["observed"] == "fits" and rec["family"] == "plain"
    assert rec["measured"]["reserved"] == int(job["cap_bytes"] * 0.9)
    after = res.plan.path("plain")
    ratio = rec["measured"]["reserved"] / before["reserved"]
    assert after.band["reserved"] == {"low": math.floor(ratio * 1e4) / 1e4, "high": math.ceil(ratio * 1e4) / 1e4,
                                      "n": 1, "source": "exact"}
    text = res.to_text("en")
    assert "measured here" in text and "55" in text and "Recorded in" in text
    assert json.loads(json.dumps(res.to_dict()))["runs"][0]["steady_tokens_per_s"] == 55.0


def test_an_oom_at_the_cap_turns_the_path_down(tmp_path, monkeypatch):
    monkeypatch.setenv("DSDOCTOR_CACHE_DIR", str(tmp_path))
    _fake_gpu(monkeypatch)
    run, _ = _runner(1.0, observed="oom")
    res = measure_mod.measure(PlanRequest(**REQ), run=run)
    assert res.runs[0]["observed"] == "oom"
    assert res.plan.path("plain").verdict in ("edge", "does not fit")
    assert res.plan.path("plain").upper_bytes > 20 * 2**30  # it needed more than this GPU


def test_refusals_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DSDOCTOR_CACHE_DIR", str(tmp_path))
    _fake_gpu(monkeypatch, total=16 * 2**30)
    with pytest.raises(InputError, match="larger than this one"):
        measure_mod.measure(PlanRequest(**REQ), run=_runner(1.0)[0])
    _fake_gpu(monkeypatch)
    with pytest.raises(InputError, match="cannot build this model"):
        measure_mod.measure(PlanRequest(**REQ), run=lambda job: {"observed": "error", "phase": "build",
                                                                "error": "KeyError: 'llama9'"})
    assert not list(tmp_path.glob("machine-*.json"))  # a refused measurement records nothing


@pytest.mark.deepspeed
def test_the_runner_builds_phi3_under_zero3_on_the_cpu():
    """Phi-3's pad_token_id 32000: transformers' init zeroed that row of the already partitioned (empty) embedding
    under zero.Init (edge_gpu.py hold-out: IndexError: index 32000 is out of bounds for dimension 0 with size 0)."""
    phi3 = json.loads((ROOT / "tests" / "data" / "arch_configs" / "phi-3-mini-4k.json").read_text())
    phi3.update(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=6, max_position_embeddings=256, original_max_position_embeddings=256)
    job = {"config": phi3, "path": "zero3", "batch": 2, "prompt_len": 8, "new_tokens": 3, "dtype": "bf16"}
    r = run_process([sys.executable, "-m", "dsdoctor.calibrate.run_case"], env=deepspeed_env(), timeout=600,
                    input_text=json.dumps(job))
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["observed"] == "fits", rec.get("traceback") or rec
    assert rec["first_tokens_per_s"] > 0 and rec["steady_tokens_per_s"] > 0 and not rec["cap_applied"]
