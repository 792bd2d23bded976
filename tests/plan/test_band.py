"""The measured band on plan's memory figures: the data and the script that computes it, the upper figure, the
three fit verdicts, and how this machine's runs (plan --measure) tighten the band."""
from __future__ import annotations

import json
import sys

import pytest

from dsdoctor.plan.api import plan
from dsdoctor.plan.band import Band, Bands, archived, family, shape_key, summarize
from tests.helpers import EXAMPLES, ROOT, run_process

LLAMA = EXAMPLES / "llama-7b"
ONE_GPU = dict(gpus=1, host_memory="512GiB", gpu_name="H100", counts="formula", detect=False, batch=4, prompt_len=1024,
               new_tokens=64)


def test_summarize_keeps_the_extremes_and_the_provenance():
    rows = [{"family": "plain", "figure": "reserved", "predicted": 100, "measured": m, "run": r, "gpu": "H200",
             "date": d} for m, r, d in ((103, "a", "2026-12-01"), (99, "b", "2026-12-02"), (110, "a", "2026-12-01"))]
    rows.append({"family": "zero3", "figure": "allocated", "predicted": 0, "measured": 5, "run": "c"})  # no prediction
    band = summarize(rows)
    assert band == {"plain": {"reserved": {"n": 3, "low": 0.99, "high": 1.1, "runs": ["a", "b"], "gpus": ["H200"],
                                           "dates": ["2026-12-01", "2026-12-02"]}}}


def test_a_run_that_ran_out_of_memory_under_its_cap_can_only_raise_the_worst_case():
    """hold-out set 2: a capped run that ran out of memory needed more than its cap; that is a lower bound on what
    it measured, never a low end."""
    rows = [{"family": "plain", "figure": "reserved", "predicted": 100, "measured": 101, "run": "a"},
            {"family": "plain", "figure": "reserved", "predicted": 100, "measured": 97, "run": "h", "bound": "at least"},
            {"family": "plain", "figure": "reserved", "predicted": 100, "measured": 105, "run": "h", "bound": "at least"},
            {"family": "zero3", "figure": "reserved", "predicted": 100, "measured": 104, "run": "h", "bound": "at least"}]
    band = summarize(rows)
    assert (band["plain"]["reserved"]["low"], band["plain"]["reserved"]["high"]) == (1.01, 1.05)
    assert band["plain"]["reserved"]["bounds"] == 2 and band["plain"]["reserved"]["n"] == 3
    assert (band["zero3"]["reserved"]["low"], band["zero3"]["reserved"]["high"]) == (1.04, 1.04)  # bounds alone


def test_band_data_covers_every_measured_family_with_provenance():
    data = archived()
    assert set(data["families"]) == {"plain", "tp", "zero3", "zero3-offload"}
    for fam, figures in data["families"].items():
        for fig in ("allocated", "reserved"):
            b = figures[fig]
            assert b["n"] > 0 and b["low"] <= b["high"] and b["runs"] and b["gpus"] and b["dates"], (fam, fig)
    # the known misses are in the data: zero3-offload reserved up to 14% above plan on one H200 (releases a long
    # prefill holds, speed run 6; 49% before the one-rank clocks and the held split), and below it by up to 22%
    # where no hold split the largest parameter's block
    offload = data["families"]["zero3-offload"]["reserved"]
    assert 1.1 < offload["high"] < 1.2 and offload["low"] < 0.8


@pytest.mark.process
def test_band_data_is_what_the_script_computes_from_the_archives():
    """band.json equals what scripts/band.py computes from every archived run now (the benches' re-estimates: some
    minutes). After a change of the memory model or new runs: python scripts/band.py."""
    r = run_process([sys.executable, str(ROOT / "scripts" / "band.py"), "--check"], timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_upper_figure_is_never_below_the_prediction():
    assert Band(0.9, 0.97, 4, "archived").upper(1000) == 1000
    assert Band(0.99, 1.18, 4, "archived").upper(1000) == 1180 and Band(1, 1.001, 1, "here").upper(999) == 1000


def test_paths_without_runs_take_the_widest_band():
    data = archived()
    bands = Bands(data).for_path("vllm")
    high = max(f["reserved"]["high"] for f in data["families"].values())
    assert bands["reserved"] == Band(bands["reserved"].low, high, 0, "unmeasured")
    assert family("tp2x4") == "tp" and Bands(data).for_path("tp2x4")["reserved"].source == "archived"


def _run(path="plain", ratio=1.01, observed="fits", shape="s", cap=None):
    return {"path": path, "family": family(path), "shape": shape, "observed": observed, "cap_bytes": cap,
            "predicted": {"allocated": 1000, "reserved": 1000}, "measured": {"allocated": 1000, "reserved": round(1000 * ratio)}}


def test_runs_on_this_machine_tighten_the_band():
    data = archived()
    archived_high = data["families"]["plain"]["reserved"]["high"]
    two = Bands(data, [_run(ratio=1.01), _run(ratio=1.02)]).for_path("plain")["reserved"]
    assert two.source == "archived" and two.high == archived_high  # fewer than MIN_HERE: the archive's
    three = Bands(data, [_run(ratio=1.01), _run(ratio=1.02), _run(ratio=1.0)]).for_path("plain")["reserved"]
    assert three == Band(1.0, 1.02, 3, "here") and three.high < archived_high


def test_a_run_of_this_shape_sets_its_band_and_an_oom_raises_it():
    shape = {"model": {"model_type": "llama"}, "batch": 4, "prompt_len": 1024, "new_tokens": 64, "gpus": 1, "dtype": "bf16"}
    key = shape_key(path="plain", **shape)
    exact = Bands(archived(), [_run(ratio=1.005, shape=key)], shape).for_path("plain")["reserved"]
    assert exact == Band(1.005, 1.005, 1, "exact")  # 4 decimals, outwards
    assert Bands(archived(), [_run(ratio=1.005, shape="other")], shape).for_path("plain")["reserved"].source == "archived"
    oom = Bands(archived(), [_run(observed="oom", shape=key, cap=1100)], shape).for_path("plain")["reserved"]
    assert oom.upper(1000) > 1100  # it needed more than the cap it ran out of memory under


def _line(p):
    return p.gpu_reserved_bytes + p.gpu_outside_allocator_bytes


def test_three_verdicts_and_the_recommendation_prefers_an_outright_fit():
    roomy = plan(LLAMA, gpu_memory="80GiB", **ONE_GPU).path("plain")
    assert roomy.verdict == "fits" and roomy.upper_bytes > _line(roomy)
    assert roomy.band["reserved"]["source"] == "archived"
    between = (_line(roomy) + roomy.upper_bytes) // 2
    res = plan(LLAMA, gpu_memory=between, **ONE_GPU)
    p = res.path("plain")
    assert p.verdict == "edge" and p.fits  # the prediction fits, the upper figure does not
    assert res.recommended.path != "plain" and res.path(res.recommended.path).verdict == "fits"
    edge = [f for f in res.findings if f.code == "DSD234"]
    assert edge and "plain" in edge[0].values["paths"]
    text = edge[0].message("en")
    assert "by" in text and "measured band" in text
    short = plan(LLAMA, gpu_memory=_line(roomy) - 2**20, **ONE_GPU).path("plain")
    assert short.verdict == "does not fit" and not short.fits


def test_an_outright_fit_first_and_only_edge_paths_left_is_said():
    from types import SimpleNamespace

    from dsdoctor.plan.recommend import choose_tiered, why

    def row(name, verdict, tps):
        return SimpleNamespace(name=name, verdict=verdict, fits=verdict in ("fits", "edge"), estimate=False,
                               tokens_per_s=tps, replicas=1, gpu_peak_bytes=2**30)

    plain, zero3 = row("plain", "edge", 100.0), row("zero3", "fits", 20.0)
    assert choose_tiered([plain, zero3], set())[0] is zero3  # slower, but it fits outright
    plain_only = [plain, row("zero3", "edge", 20.0)]
    chosen, compared = choose_tiered(plain_only, set())
    assert chosen is plain  # only edge paths: the fastest of them, and the reason says so
    assert "dsdoctor plan --measure" in why(chosen, compared, "en") and "DSD234" in why(chosen, compared, "zh")
    assert "--measure" not in why(zero3, [plain, zero3], "en")


def test_band_is_printed_on_every_memory_figure_and_in_json():
    res = plan(LLAMA, gpu_memory="80GiB", **ONE_GPU)
    text = res.to_text("en")
    plain = res.path("plain")
    b = plain.band["reserved"]
    assert f"({b['low'] - 1:+.0%}..{b['high'] - 1:+.0%}, n={b['n']})" in text
    assert "unmeasured:" in text  # the estimates (device-map, serving engines) have no run of their own
    assert "未实测：" in res.to_text("zh") and "本机 n=" not in res.to_text("zh")
    d = json.loads(json.dumps(res.to_dict()))
    assert d["paths"][0]["band"]["reserved"]["n"] == b["n"] and d["paths"][0]["upper_bytes"] == plain.upper_bytes
    assert "unmeasured:" in res.to_markdown("en")


def test_diagnose_summary_says_edge():
    from dsdoctor.report.summary import path_figures, verdict

    roomy = plan(LLAMA, gpu_memory="80GiB", **ONE_GPU).path("plain")
    res = plan(LLAMA, gpu_memory=(_line(roomy) + roomy.upper_bytes) // 2, **ONE_GPU)
    assert path_figures(res, "plain")["verdict"] == "edge"
    text = verdict(plan_result=res, path="plain")
    assert "DSD234" in text["en"] and "--measure" in text["zh"]
    assert "DSD234" not in verdict(plan_result=res, path=res.recommended.path)["en"]
