"""DSD322: ZeRO-3 prefetching switched off by a prefetch bucket or live-parameter budget of 0."""
from __future__ import annotations

import json

import pytest

from dsdoctor.config.check import check
from tests.helpers import run_cli

BASE = {"train_micro_batch_size_per_gpu": 1}


def _codes(zero):
    return {f.code: f for f in check(dict(BASE, zero_optimization=zero)).findings}


def test_zero_knobs_switch_prefetch_off():
    found = _codes({"stage": 3, "stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0})
    f = found["DSD322"]
    assert f.message() == ("zero_optimization.stage3_prefetch_bucket_size = 0, zero_optimization.stage3_max_live_"
                           "parameters = 0: ZeRO-3 prefetches nothing, so every layer waits for its own all-gather")
    assert "50.00M" in f.fix() and "1.00B" in f.fix() and "预取" in f.message("zh")


def test_unprefixed_spelling_and_only_under_stage_3():
    unprefixed = _codes({"stage": 3, "max_live_parameters": 0})["DSD322"]
    assert "zero_optimization.max_live_parameters = 0" in unprefixed.message()
    assert "DSD322" not in _codes({"stage": 2, "stage3_prefetch_bucket_size": 0})
    assert "DSD322" not in _codes({"stage": 3, "stage3_prefetch_bucket_size": 1e7})
    assert "DSD322" not in _codes({"stage": 3})


@pytest.mark.process
def test_check_cli_reports_it(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(dict(BASE, zero_optimization={"stage": 3, "stage3_prefetch_bucket_size": 0})))
    r = run_cli("check", cfg, "--format", "json", "--fail-on", "warning")
    assert r.returncode == 1, r.stderr
    assert "DSD322" in {f["code"] for f in json.loads(r.stdout)["findings"]}
    assert "What it does" in run_cli("explain", "DSD322").stdout
