"""A profile from another hour or host: plan re-times an eager layer (here a fake measurement: no GPU), scales the
host-bound figures when the host drifted, and says how old and whose the profile is."""
from __future__ import annotations

import datetime

import pytest

from dsdoctor.calibrate import recheck
from dsdoctor.calibrate.recheck import HOST_BOUND, TOLERANCE, host_id, quick_eager_layer_s, rechecked
from dsdoctor.plan.api import plan
from tests.calibrate.test_profile import FIGS, H200_MACHINE, test_profile
from tests.helpers import EXAMPLES

WHEN = "2026-12-01T01:34:51Z"
WHEN_TS = datetime.datetime(2026, 12, 1, 1, 34, 51, tzinfo=datetime.timezone.utc).timestamp()
NOW = WHEN_TS + 109.0  # a couple of minutes later
LAYER = FIGS["eager_layer_s"]


def _profile(host=None, **extra):
    machine = dict(H200_MACHINE, **({"host": host} if host else {}))
    return test_profile(dict(FIGS, eager_layer_s_b16=2 * LAYER, **extra), machine=machine, when=WHEN)


def test_a_host_that_drifted_scales_every_host_bound_figure():
    prof = _profile(host=host_id())
    fresh, info = rechecked(prof, lambda hbm: 1.7 * LAYER, now=NOW)
    assert info["rescaled"] and info["ratio"] == pytest.approx(1.7) and info["host"] == "this host"
    assert info["age_s"] == pytest.approx(109.0)
    for name in HOST_BOUND:
        if name in prof.measured:
            assert fresh.measured[name] == pytest.approx(1.7 * prof.measured[name]), name
    for name in ("hbm_weight_read", "h2d_pinned", "matmul_flops", "context_bytes"):  # device figures stay
        assert fresh.measured[name] == prof.measured[name]
    assert prof.measured["eager_layer_s"] == LAYER  # the given profile is not changed


def test_within_the_tolerance_the_profile_is_kept():
    prof = _profile()
    fresh, info = rechecked(prof, lambda hbm: (1 + TOLERANCE / 2) * LAYER)
    assert fresh is prof and not info["rescaled"] and info["now_s"] == pytest.approx((1 + TOLERANCE / 2) * LAYER)
    assert info["host"] == "unknown host"  # a profile written before calibrate recorded its host


def test_no_measurement_only_dates_the_profile_and_a_failure_is_not_fatal():
    prof = _profile(host="0123456789ab")
    fresh, info = rechecked(prof, False)
    assert fresh is prof and info["now_s"] is None and info["host"] == "another host"

    def broken(hbm):
        raise RuntimeError("CUDA error: busy")

    fresh, info = rechecked(prof, broken)
    assert fresh is prof and "CUDA error" in info["error"]


def _plan(**kw):
    return plan(EXAMPLES / "llama-7b", batch=1, prompt_len=256, new_tokens=64, gpus=1, gpu_memory="141GB",
                host_memory="1TiB", detect=False, gpu_name="H200", counts="formula", **kw)


def test_plan_rescales_and_says_so():
    prof = _profile(host=host_id())
    same = _plan(machine=prof, recheck=False)
    slow = _plan(machine=prof, recheck=lambda hbm: 1.7 * LAYER)
    assert slow.path("plain").tokens_per_s < 0.8 * same.path("plain").tokens_per_s
    assert slow.path("plain").speed_terms["eager"] == pytest.approx(1.7 * same.path("plain").speed_terms["eager"])
    assert slow.path("plain").gpu_peak_bytes == same.path("plain").gpu_peak_bytes  # memory is not the host's
    f = next(f for f in slow.findings if f.code == "DSD224")
    assert f.values["ratio"] == "1.70" and f.values["now_us"] == f"{1.7 * LAYER * 1e6:.0f}"
    assert "this host" in f.message() and "本机" in f.message("zh")
    text = slow.to_text()
    assert "calibrated on 2026-12-01" in text and "on this host" in text and "x1.70 after re-timing" in text
    assert slow.hardware.profile["freshness"]["rescaled"] is True


def test_plan_says_how_old_and_whose_a_profile_is_when_it_cannot_re_time(monkeypatch):
    monkeypatch.setattr(recheck, "_now", lambda: NOW + 3 * 86400)
    res = _plan(machine=_profile(host="0123456789ab"), recheck=False)
    f = next(f for f in res.findings if f.code == "DSD225")
    assert f.values["age"] == "3 days" and "another host" in f.message()
    assert "3 days ago on another host" in res.to_text()
    # no GPU detected here (detect=False): the default does not try to measure
    assert _plan(machine=_profile(host=host_id())).hardware.profile["freshness"]["now_s"] is None


def test_quick_measurement_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the measurement would run")
    assert quick_eager_layer_s() is None
