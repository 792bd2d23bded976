"""The machine profile: schema, fingerprint matching, and plan using a profile (given or cached)."""
from __future__ import annotations

import json

import pytest

from dsdoctor.calibrate.profile import (
    SCHEMA,
    MachineProfile,
    cache_path,
    find_profile,
    fingerprint,
    load_profile,
    machine_description,
    save_profile,
)
from dsdoctor.errors import InputError
from dsdoctor.plan.api import plan
from tests.helpers import EXAMPLES, run_cli

H200_MACHINE = {"cpu_model": "Test CPU", "cpu_count": 16, "host_memory_gib": 128,
                "gpus": [{"name": "NVIDIA H200", "memory_mib": 143771}]}


def test_profile(measured: dict, machine=H200_MACHINE, when="2026-12-01T01:34:51Z") -> MachineProfile:
    return MachineProfile(fingerprint(machine), machine, when, measured, {"allgather_bus_bw": "one GPU"})


# figures of the kind calibrate writes (a real H200 run's magnitudes; the tests compare profiles with each other)
FIGS = {"h2d_pinned": 55e9, "h2d_pageable": 9.5e9, "hbm_weight_read": 3.7e12, "matmul_flops": 7.4e14,
        "attention_flops": 4.9e14, "eager_layer_s": 5.3e-4, "eager_token_s": 1.8e-3, "zero3_module_s": 3.1e-4,
        "zero3_offload_module_s": 2.2e-4, "context_bytes": 632e6, "h2d_latency_s": 1.5e-5}
test_profile.__test__ = False  # a helper, not a test


def test_round_trip_and_schema(tmp_path):
    prof = test_profile(FIGS)
    path = save_profile(prof, tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["fingerprint"] == prof.fingerprint
    back = load_profile(path)
    assert back.measured == FIGS and back.date == "2026-12-01" and back.source == str(path)
    assert back.not_measured == {"allgather_bus_bw": "one GPU"}


@pytest.mark.parametrize("text, why", [
    ("not json", "not valid JSON"),
    ('{"schema": "other/1", "measured": {}}', "not a dsdoctor machine profile"),
    (json.dumps({"schema": SCHEMA, "measured": {"h2d_pinned": "fast"}}), "measured.h2d_pinned"),
    (json.dumps({"schema": SCHEMA, "measured": {"h2d_pinned": -1}}), "measured.h2d_pinned"),
    (json.dumps({"schema": SCHEMA, "measured": []}), "'measured' must be an object"),
])
def test_bad_profiles_are_input_errors(tmp_path, text, why):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(InputError) as exc:
        load_profile(p)
    assert why in str(exc.value) and str(p) in str(exc.value)


def test_unknown_figures_are_ignored_not_fatal(tmp_path):
    p = tmp_path / "newer.json"
    p.write_text(json.dumps({"schema": SCHEMA, "measured": {"h2d_pinned": 1e10, "from_the_future": 3}}))
    assert load_profile(p).measured == {"h2d_pinned": 1e10}


def test_fingerprint_is_hardware_only():
    a = fingerprint(H200_MACHINE)
    assert fingerprint(dict(H200_MACHINE, software="anything")) == a
    assert fingerprint(dict(H200_MACHINE, gpus=H200_MACHINE["gpus"] * 2)) != a
    assert fingerprint(dict(H200_MACHINE, cpu_model="Other")) != a


def test_find_profile_matches_this_machine_only(tmp_path, monkeypatch):
    monkeypatch.setenv("DSDOCTOR_CACHE_DIR", str(tmp_path))
    here = machine_description()
    assert find_profile() is None
    save_profile(test_profile(FIGS, machine=H200_MACHINE), cache_path(fingerprint(H200_MACHINE)))
    assert (find_profile() is None) == (fingerprint(here) != fingerprint(H200_MACHINE))
    save_profile(test_profile(FIGS, machine=here), cache_path(fingerprint(here)))
    found = find_profile()
    assert found is not None and found.fingerprint == fingerprint(here)
    cache_path(fingerprint(here)).write_text("{broken")  # a broken cache file is as good as none
    assert find_profile() is None


def _plan(**kw):
    return plan(EXAMPLES / "llama-7b", batch=2, prompt_len=1024, new_tokens=8, gpus=1, gpu_memory="141GB",
                host_memory="1TiB", detect=False, **kw)


def test_plan_uses_the_given_profile(tmp_path):
    slow = tmp_path / "slow.json"
    fast = tmp_path / "fast.json"
    save_profile(test_profile(FIGS), slow)
    save_profile(test_profile(dict(FIGS, h2d_pinned=4 * FIGS["h2d_pinned"])), fast)
    a, b = _plan(machine=str(slow)), _plan(machine=str(fast))
    # the same memory, faster offload on the machine with faster host-to-device copies; plain unchanged
    assert a.path("plain").gpu_peak_bytes == b.path("plain").gpu_peak_bytes
    assert b.path("zero3-offload").tokens_per_s > 1.5 * a.path("zero3-offload").tokens_per_s
    assert b.path("plain").tokens_per_s == a.path("plain").tokens_per_s
    assert a.hardware.profile["calibrated_at"] == "2026-12-01T01:34:51Z"
    assert "calibrated on 2026-12-01" in a.to_text()
    # the profile's CUDA context decides fits, not the default guess
    assert a.path("plain").gpu_outside_allocator_bytes == FIGS["context_bytes"]
    # only what the profile lacks is still called assumed: here the NVMe read rate (no --nvme-path)
    assumed = next(f for f in a.findings if f.code == "DSD205").message()
    assert "nvme_read" in assumed and "eager_layer_s" not in assumed and "h2d_bandwidth" not in assumed


def test_plan_without_profile_says_what_is_assumed():
    res = _plan()
    assert res.hardware.profile["calibrated_at"] is None
    f = next(f for f in res.findings if f.code == "DSD205")
    assert "eager_layer_s" in f.message() and "dsdoctor calibrate" in f.message()
    assert "run `dsdoctor calibrate`" in res.to_text()


@pytest.mark.process
def test_plan_cli_machine_flag_bad_file_is_exit_2(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    r = run_cli("plan", "--model", EXAMPLES / "llama-7b", "--machine", bad, "--gpus", "1")
    assert r.returncode == 2 and "not a dsdoctor machine profile" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.process
def test_plan_cli_reads_the_cached_profile(tmp_path):
    here = machine_description()
    save_profile(test_profile(FIGS, machine=here), tmp_path / f"machine-{fingerprint(here)}.json")
    r = run_cli("plan", "--model", EXAMPLES / "llama-7b", "--gpus", "1", "--format", "json",
                env={"DSDOCTOR_CACHE_DIR": str(tmp_path)})
    assert r.returncode in (0, 1), r.stderr
    assert json.loads(r.stdout)["hardware"]["profile"]["calibrated_at"] == "2026-12-01T01:34:51Z"


@pytest.mark.slow  # real forwards timed in rounds until they settle
def test_eager_overheads_measure_every_batch_in_interleaved_rounds_after_settling():
    """The real measurement on the CPU, with small layers: per-batch medians, their spread over the rounds,
    and how many runs the warm-up took to settle (at least two: two runs in a row must agree)."""
    pytest.importorskip("transformers")
    from dsdoctor.calibrate.measure import _settle, eager_overheads

    # extend_s bounds the extra rounds a noisy machine (a test running beside this one) asks for: 3 to 6 either way
    r = eager_overheads("cpu", batches=(1, 2), layer_counts=(1, 2), hidden=128, inter=256, extend_s=5.0)
    assert set(r) == {1, 2, "settle_runs", "rounds"}
    assert 3 <= r["rounds"] <= 6 and all(len(r[b]["layer_rounds_s"]) == r["rounds"] for b in (1, 2))
    for b in (1, 2):
        assert r[b]["layer_s"] >= 0 and r[b]["token_s"] >= 0 and r[b]["layer_spread"] >= 0
    assert 2 <= r["settle_runs"] <= 5
    times = iter([2.0, 1.0, 0.99, 5.0])
    assert _settle(lambda: next(times)) == 3  # 2.0 -> 1.0 differ; 1.0 -> 0.99 agree within 5%


@pytest.mark.parametrize("loop, gpus", [(False, 2), (True, 2), (False, 4)])
def test_every_planned_path_takes_its_speed_from_the_profile(loop, gpus):
    """No path keeps a generic figure where the profile measured one: a machine whose host is 4x slower per
    layer and per token, with 4x slower host copies and collectives, gives every path a lower tokens/s."""
    slow = dict(FIGS, eager_layer_s=4 * FIGS["eager_layer_s"], eager_token_s=4 * FIGS["eager_token_s"],
                h2d_pinned=FIGS["h2d_pinned"] / 4, h2d_pageable=FIGS["h2d_pageable"] / 4,
                allgather_bus_bw=100e9 / 4, allgather_latency_s=50e-6 * 4, autotp_allreduce_s=0.4e-3 * 4)
    fast = dict(FIGS, allgather_bus_bw=100e9, allgather_latency_s=50e-6, autotp_allreduce_s=0.4e-3)
    machine = dict(H200_MACHINE, gpus=H200_MACHINE["gpus"] * gpus)

    def run(figs):
        res = plan(EXAMPLES / "llama-7b", batch=2, prompt_len=256, new_tokens=16, gpus=gpus, gpu_memory="24GB",
                   host_memory="64GB", detect=False, gpu_name="H200", loop=loop,
                   machine=test_profile(figs, machine=machine))
        return {p.name: p.tokens_per_s for p in res.paths}

    a, b = run(fast), run(slow)
    assert set(a) == set(b) and len(a) >= (8 if not loop else 4)
    same = [name for name in a if not b[name] < a[name]]
    assert not same, f"paths whose speed ignores the profile: {same}"
