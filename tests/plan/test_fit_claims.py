"""Never optimistic at the edge (issue 29): on workloads between plan's prediction and its upper figure, every
output of plan, plan --loop, an RL job's plan and diagnose is walked, and any "fits" said of a path or an
arrangement whose upper figure does not fit fails the test; the what-fits searches answer with the upper figure
(the largest batch and prompt that fit outright, and the larger ones only at the edge); the edge's "what to do"
is the exact ``dsdoctor plan ... --measure`` line, and that line plans the same thing and measures under the cap
the finding states."""
from __future__ import annotations

import json
import re
import shlex

import pytest

from dsdoctor.plan.api import plan
from dsdoctor.plan.loop_job import plan_job
from dsdoctor.units import human_bytes
from tests.helpers import EXAMPLES, run_cli

LLAMA = EXAMPLES / "llama-7b"
CONFIG = EXAMPLES / "train_zero3_offload.json"  # ZeRO-3: DSD201 speaks of plain when plain fits
RL = EXAMPLES.parent.parent.parent / "tests" / "data" / "rl"
ONE_GPU = dict(gpus=1, host_memory="512GiB", gpu_name="H100", counts="formula", detect=False, batch=4,
               prompt_len=1024, new_tokens=64)
GiB = 2**30

# a claim that something fits, and what makes it a claim about the edge instead (per language)
FITS = {"en": re.compile(r"\bfits\b|\b(?:that|which) fit\b"), "zh": re.compile("放得下(?!与否)|装得下|能装下|能容纳")}
QUALIFIED = {"en": ("prediction", "edge", "upper figure", "not fit", "DSD234"),
             "zh": ("预测", "临界", "上限", "放不下", "DSD234")}
CLAUSES = {"en": re.compile(r"; |\n|\. "), "zh": re.compile(r"；|\n|。")}
ALIASES = {"zero2": ("ZeRO-2",)}


def unqualified_claims(text: str, lang: str, names: list[str], edge: set[str]) -> list[str]:
    """Clauses of ``text`` that say an edge path (or arrangement) fits without saying it is at the edge. Every
    name is first replaced by a token (arrangement names hold "; " themselves), longest first."""
    tokens = {}
    for i, name in enumerate(sorted(names, key=len, reverse=True)):
        token = f"@{i}@"
        text = re.sub(r"(?<![\w+-])" + re.escape(name) + r"(?![\w+-])", token, text)
        for alias in ALIASES.get(name, ()):
            text = re.sub(re.escape(alias) + r"(?![\w+-])", token, text)
        tokens[token] = name
    bad = []
    for clause in CLAUSES[lang].split(text):
        named = {tokens[t] for t in re.findall(r"@\d+@", clause)}
        if named & edge and FITS[lang].search(clause) and not any(q in clause for q in QUALIFIED[lang]):
            bad.append(clause)
    return bad


def strings(value) -> list[str]:
    """Every string in a JSON document: each text is checked on its own."""
    if isinstance(value, dict):
        return [t for v in value.values() for t in strings(v)]
    if isinstance(value, list):
        return [t for v in value for t in strings(v)]
    return [value] if isinstance(value, str) else []


def renderings(res, lang: str) -> list[str]:
    return [res.to_text(lang), res.to_markdown(lang), *strings(res.to_dict(lang))]


def check_plan(res) -> None:
    """Every rendering of a plan: no unqualified fit for an edge path; the data agrees with the verdicts."""
    edge = {p.name for p in res.paths if p.verdict == "edge"}
    assert edge, "the workload is not at the edge"
    names = [p.name for p in res.paths]
    for lang in ("en", "zh"):
        for text in renderings(res, lang):
            assert unqualified_claims(text, lang, names, edge) == []
    cap = res.hardware.gpu_memory
    for p in res.paths:  # "fits" in the data: the upper figure fits
        assert (p.verdict == "fits") == (p.fits and p.upper_bytes <= cap), p.name
        assert p.verdict != "edge" or (p.fits and p.upper_bytes > cap)


def _line(p) -> int:
    return p.gpu_reserved_bytes + p.gpu_outside_allocator_bytes


def _between(path: str, frac: float = 0.5, **kw) -> int:
    """A GPU memory between ``path``'s prediction and its upper figure (``frac`` of the way)."""
    p = plan(LLAMA, gpu_memory="80GiB", **kw).path(path)
    return int(_line(p) + frac * (p.upper_bytes - _line(p)))


def test_an_edge_path_beside_one_that_fits_outright_is_never_said_to_fit():
    res = plan(LLAMA, gpu_memory=_between("plain", config=CONFIG, **ONE_GPU), config=CONFIG, **ONE_GPU)
    assert res.path("plain").verdict == "edge" and res.path(res.recommended.path).verdict == "fits"
    check_plan(res)
    assert "DSD201" not in {f.code for f in res.findings}  # "plain fits one GPU" is not said of an edge plain
    why = res.recommended.why["en"]
    assert "next best plain" not in why and "plain" in why.split("edge, DSD234")[-1]


def test_only_edge_paths_left_the_recommendation_says_so_and_names_the_measure_command():
    res = plan(LLAMA, gpu_memory=_between("zero3-offload", 0.2, **ONE_GPU), **ONE_GPU)
    chosen = res.path(res.recommended.path)
    assert chosen.name == "zero3-offload" and chosen.verdict == "edge"
    assert res.path("plain").verdict == "does not fit"
    check_plan(res)
    assert "fits by its prediction only" in res.recommended.why["en"] and "只是按预测" in res.recommended.why["zh"]
    edge = next(f for f in res.findings if f.code == "DSD234")
    fix = edge.fix("en")
    command = re.search(r"`(dsdoctor plan [^`]+)`", fix).group(1)
    assert command.endswith(" --measure") and "--batch 4 --prompt-len 1024 --new-tokens 64" in command
    assert f"capped at {human_bytes(res.hardware.gpu_memory - chosen.gpu_outside_allocator_bytes)}" in fix
    assert "dsdoctor plan" in edge.fix("zh") and "--measure" in edge.fix("zh")


@pytest.mark.process
def test_the_measure_command_plans_the_same_thing_and_refuses_in_one_line_without_a_gpu(tmp_path):
    """The line DSD234 gives, run as it is: the plan it makes (without --measure) has the same verdicts and the
    same cap, and on this machine without a GPU --measure ends in one line with exit 2."""
    gpu_memory = _between("zero3-offload", 0.2, **ONE_GPU)
    flags = ["--model", LLAMA, "--gpus", "1", "--host-memory", "512GiB", "--gpu-name", "H100", "--counts",
             "formula", "--batch", "4", "--prompt-len", "1024", "--new-tokens", "64", "--gpu-memory", gpu_memory]
    env = {"PATH": str(tmp_path), "DSDOCTOR_CACHE_DIR": str(tmp_path / "cache")}  # no nvidia-smi, no profile
    first = run_cli("plan", *flags, "--format", "json", env=env, timeout=300)
    assert first.returncode == 0, first.stderr  # DSD234 is a warning
    data = json.loads(first.stdout)
    edge = next(f for f in data["findings"] if f["code"] == "DSD234")
    command = shlex.split(re.search(r"`(dsdoctor plan [^`]+)`", edge["fix"]).group(1))
    assert command[:2] == ["dsdoctor", "plan"] and command[-1] == "--measure"
    again = run_cli(*command[1:-1], "--format", "json", env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    redo = json.loads(again.stdout)
    assert [(p["name"], p["verdict"], p["upper_bytes"]) for p in redo["paths"]] == \
        [(p["name"], p["verdict"], p["upper_bytes"]) for p in data["paths"]]
    assert next(f for f in redo["findings"] if f["code"] == "DSD234")["fix"] == edge["fix"]
    measured = run_cli(*command[1:], env=env, timeout=300)
    assert measured.returncode == 2 and measured.stdout == ""
    lines = [ln for ln in measured.stderr.splitlines() if ln.strip()]
    assert len(lines) <= 2 and "GPU" in lines[0] and "Traceback" not in measured.stderr


def test_the_command_measures_under_the_cap_the_finding_states(tmp_path, monkeypatch):
    """``plan --measure`` with the flags of the command caps the run where DSD234 says it would."""
    from dsdoctor.machine import Gpu
    from dsdoctor.plan import measure as measure_mod
    from dsdoctor.plan.request import PlanRequest

    monkeypatch.setenv("DSDOCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("dsdoctor.machine.nvidia_smi_gpus", lambda *a, **k: [Gpu(0, "NVIDIA H100 80GB HBM3", 80 * GiB)])
    gpu_memory = _between("zero3-offload", 0.2, **ONE_GPU)
    res = plan(LLAMA, gpu_memory=gpu_memory, **ONE_GPU)
    fix = next(f for f in res.findings if f.code == "DSD234").fix("en")
    jobs = []

    def run(job):
        jobs.append(job)
        return {"path": job["path"], "observed": "fits", "phase": "done", "cap_applied": True, "device": "H100",
                "peak_allocated": 4 * GiB, "peak_reserved": 5 * GiB, "alloc_retries": 0, "outside_measured": 2**29,
                "first_tokens_per_s": 5.0, "steady_tokens_per_s": 6.0}

    req = dict(ONE_GPU, model=str(LLAMA), gpu_memory=gpu_memory, detect=True)
    measure_mod.measure(PlanRequest(**req), run=run)
    assert jobs and jobs[0]["path"] == "zero3-offload"
    assert f"capped at {human_bytes(jobs[0]['cap_bytes'])}" in fix


def test_what_fits_is_the_upper_figure_and_the_edge_beyond_it_is_said():
    gpu_memory = _between("plain", **ONE_GPU)
    res = plan(LLAMA, gpu_memory=gpu_memory, **ONE_GPU)
    p = res.path("plain")
    assert p.verdict == "edge" and p.max_batch < 4 <= p.edge_batch  # the planned batch itself is only edge
    assert p.max_prompt_len < 1024 <= p.edge_prompt_len
    row = next(ln for ln in res.to_text("en").splitlines() if ln.startswith("plain "))
    assert f"{p.max_batch} (edge {p.edge_batch})" in row and f"{p.max_prompt_len} (edge {p.edge_prompt_len})" in row
    assert f"{p.max_batch}（临界 {p.edge_batch}）" in res.to_text("zh")
    at = dict(ONE_GPU, gpu_memory=gpu_memory)
    assert plan(LLAMA, **dict(at, batch=p.max_batch)).path("plain").verdict == "fits"
    assert plan(LLAMA, **dict(at, batch=p.edge_batch)).path("plain").verdict == "edge"
    assert plan(LLAMA, **dict(at, prompt_len=p.max_prompt_len)).path("plain").verdict == "fits"
    roomy = plan(LLAMA, gpu_memory="80GiB", **ONE_GPU).path("plain")
    assert roomy.max_batch > 4 and (roomy.edge_batch is None or roomy.edge_batch > roomy.max_batch)


def test_loop_paths_carry_the_band_and_the_three_verdicts():
    kw = dict(ONE_GPU, gpus=2, loop=True, batch=2, prompt_len=256, new_tokens=64)
    roomy = plan(LLAMA, gpu_memory="80GiB", **kw).path("zero2")
    assert roomy.band["reserved"]["source"] == "unmeasured" and roomy.upper_bytes > _line(roomy)
    res = plan(LLAMA, gpu_memory=(_line(roomy) + roomy.upper_bytes) // 2, **kw)
    assert res.path("zero2").verdict == "edge"
    check_plan(res)
    assert "DSD209" not in {f.code for f in res.findings}  # "ZeRO-2 fits the actor": not at the edge
    assert res.recommended.path != "zero2" or "prediction only" in res.recommended.why["en"]
    d = res.to_dict()
    assert next(p for p in d["paths"] if p["name"] == "zero2")["verdict"] == "edge"


def test_an_rl_job_at_the_edge_says_so_in_text_json_and_findings():
    rl = dict(gpu_name="A100", host_memory="1TiB", detect=False, counts="formula")
    nothing = plan_job(RL / "dschat_step3_7b.sh", gpu_memory="1GiB", **rl)  # shows the least need of each engine
    least = min(nothing.rows, key=lambda r: r.gpu_need_bytes)
    assert least.band["reserved"]["source"] == "unmeasured" and least.upper_bytes > least.gpu_need_bytes
    r = plan_job(RL / "dschat_step3_7b.sh", gpu_memory=least.gpu_need_bytes + 2**20, **rl)
    rec = next(row for row in r.rows if row.arrangement == r.recommended.arrangement)
    assert rec.verdict == "edge" and all(row.verdict != "fits" for row in r.rows)
    holds = [row.arrangement for row in r.rows]
    edge = {row.arrangement for row in r.rows if row.verdict == "edge"}
    for lang in ("en", "zh"):
        for text in renderings(r, lang):
            assert unqualified_claims(text, lang, holds, edge) == []
    d = r.to_dict()
    assert d["recommended"]["arrangement"] == rec.arrangement
    assert [a["verdict"] for a in d["arrangements"] if a["arrangement"] == rec.arrangement] == ["edge"]
    found = {f.code: f for f in r.findings}
    assert "DSD234" in found and "one iteration of the RL job" in found["DSD234"].fix("en")
    assert human_bytes(r.hardware.gpu_memory - rec.outside_bytes) in found["DSD234"].fix("en")
    # with room, the arrangement that fits outright is chosen over a faster one at the edge
    ok = plan_job(RL / "dschat_step3_7b.sh", gpu_memory="40GiB", **rl)
    chosen = next(row for row in ok.rows if row.arrangement == ok.recommended.arrangement)
    assert chosen.verdict == "fits" and any(row.verdict == "edge" and row.samples_per_s > chosen.samples_per_s
                                            for row in ok.rows)


@pytest.mark.process
def test_diagnose_at_the_edge_says_so_and_its_actions_name_the_measure_command(tmp_path):
    kw = dict(ONE_GPU, batch=1, prompt_len=512, new_tokens=128, counts="auto", config=CONFIG)
    # this config's NVMe path predicts 1 GB less than its CPU one (no prefetch bucket): between its line and its
    # upper figure it is the one path left, at the edge (the CPU path's line is above it)
    gpu_memory = _between("zero3-offload-nvme", 0.2, **kw)
    out = tmp_path / "diag"
    proc = run_cli("diagnose", "--out", out, "--format", "json", "--gpus", "1", "--gpu-memory", gpu_memory,
                   "--host-memory", "512GiB", env={"DSDOCTOR_CACHE_DIR": str(tmp_path / "cache")}, timeout=600)
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    steps = {s["step"]: s for s in data["steps"]}
    assert steps["need-zero3"]["data"]["verdict"] == "edge"
    path = data["recommended_path"]
    for text in [*strings(data), (out / "report.md").read_text()]:
        assert unqualified_claims(text, "en", [path, "plain", "zero3"], {path}) == []
    assert path == "zero3-offload-nvme"  # --measure runs one-GPU plain, zero3 and zero3-offload: the cap is said
    edge = next(f for f in data["findings"] if f["code"] == "DSD234")
    assert "set_per_process_memory_fraction" in edge["fix"] and "set_per_process_memory_fraction" in (
        out / "report.md").read_text()
