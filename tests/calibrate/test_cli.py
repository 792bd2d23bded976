"""``dsdoctor calibrate`` as a real process on a machine without a GPU: it measures what it can (host
memory copy, CPU matmul), names what it could not, and writes a profile plan can read."""
from __future__ import annotations

import json

import pytest

from dsdoctor.calibrate.profile import load_profile
from tests.helpers import run_cli

pytestmark = pytest.mark.process  # every test here runs the CLI as a process


def test_calibrate_without_gpu_writes_an_honest_profile(tmp_path):
    out = tmp_path / "m.json"
    cache = tmp_path / "cache"
    r = run_cli("calibrate", "--out", out, "--budget-s", "40", "--format", "json", "--nvme-path", tmp_path,
                env={"CUDA_VISIBLE_DEVICES": "", "DSDOCTOR_CACHE_DIR": str(cache)}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "host memcpy" in r.stderr  # progress on stderr
    data = json.loads(r.stdout)
    prof = load_profile(out)
    assert prof.measured["host_memcpy"] > 0 and prof.measured["cpu_matmul_flops"] > 0
    assert prof.measured["nvme_read"] > 0
    for gpu_figure in ("h2d_pinned", "hbm_weight_read", "matmul_flops", "eager_layer_s", "zero3_module_s",
                       "context_bytes"):
        assert gpu_figure not in prof.measured
        assert "no GPU" in prof.not_measured[gpu_figure]
    assert data["fingerprint"] == prof.fingerprint
    cached = list(cache.glob("machine-*.json"))
    assert [p.name for p in cached] == [f"machine-{prof.fingerprint}.json"]


def test_calibrate_bad_input_is_one_line_exit_2(tmp_path):
    r = run_cli("calibrate", "--out", tmp_path, "--no-cache", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and "is a directory" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("calibrate", "--nvme-path", tmp_path / "missing", "--no-cache", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and "not a directory" in r.stderr
