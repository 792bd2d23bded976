"""``plan --measure``: run the recommended path and every path at the edge (DSD234) for the exact shape on this
machine's GPU, capped at the target GPU's memory, and put what it measured beside the prediction.

Each run is a fresh process (``calibrate/run_case.py``, the one runner bench/plan/edge_gpu.py uses too): random
weights from config.json, the path's load, two ``generate`` calls, with the caching allocator capped by
``torch.cuda.set_per_process_memory_fraction`` at the target GPU's memory less plan's memory outside the
allocator (the CUDA context the target GPU holds too). The runs go into this machine's cached profile
(``calibrate/profile.py`` ``runs``), and plan then plans again with them: a run of this shape sets its band
(``plan/band.py``), and enough runs of a family set this machine's band for it.
"""
from __future__ import annotations

import datetime as _dt
import json
import subprocess
import sys
from dataclasses import dataclass

from dsdoctor.errors import InputError
from dsdoctor.i18n import message_table, pick
from dsdoctor.plan.api import plan_request
from dsdoctor.plan.band import family, shape_key
from dsdoctor.plan.findings import measurable
from dsdoctor.report.render import Style, markdown_table, text_table
from dsdoctor.units import human_bytes, human_rate

TEXT = message_table("plan.measure.TEXT")
RUN_TIMEOUT_S = 1800


def targets(result) -> list:
    """The recommended path and every path at the edge that one process on one GPU can run."""
    chosen = result.path(result.recommended.path) if result.recommended.path else None
    rows = ([chosen] if chosen else []) + [p for p in result.paths if p.verdict == "edge" and p is not chosen]
    return [p for p in rows if measurable(p)]


def run_job(job: dict) -> dict:
    """One run in a fresh process (a fresh caching allocator); its record."""
    proc = subprocess.run([sys.executable, "-m", "dsdoctor.calibrate.run_case"], input=json.dumps(job),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"path": job["path"], "observed": "error", "phase": "start", "error": tail[0][:400]}
    return json.loads(lines[-1])


def record(p, rec: dict, job: dict, spec_raw: dict, wl, hw) -> dict:
    """The profile's record of one run (``calibrate/profile.py`` ``RUN_KEYS``)."""
    line = p.gpu_reserved_bytes + p.gpu_outside_allocator_bytes
    return {"path": p.name, "family": family(p.name), "model_type": spec_raw.get("model_type"),
            "shape": shape_key(spec_raw, p.name, wl.batch, wl.prompt_len, wl.new_tokens, hw.gpus, wl.dtype),
            "batch": wl.batch, "prompt_len": wl.prompt_len, "new_tokens": wl.new_tokens, "gpu": rec.get("device"),
            "gpu_memory": hw.gpu_memory, "cap_bytes": job["cap_bytes"], "observed": rec["observed"],
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "predicted": {"allocated": p.gpu_peak_bytes, "reserved": p.gpu_reserved_bytes,
                          "outside": p.gpu_outside_allocator_bytes, "line": line, "upper": p.upper_bytes,
                          "verdict": p.verdict, "tokens_per_s": p.tokens_per_s,
                          "first_tokens_per_s": p.first_generate_tokens_per_s},
            "measured": {"allocated": rec.get("peak_allocated"), "reserved": rec.get("peak_reserved"),
                         "outside": rec.get("outside_measured"), "alloc_retries": rec.get("alloc_retries")},
            "first_tokens_per_s": rec.get("first_tokens_per_s"), "steady_tokens_per_s": rec.get("steady_tokens_per_s")}


def _refuse_failed(rec: dict, model, path: str) -> None:
    if rec["observed"] != "error":
        return
    if rec.get("phase") == "build":
        raise InputError(f"plan --measure: transformers cannot build this model from its config.json: {rec.get('error')}",
                         path=model)
    raise InputError(f"plan --measure: the {path} run failed ({rec.get('phase')}): {rec.get('error')}")


def measure(req, run=run_job) -> MeasureResult:
    """Plan ``req`` (a ``PlanRequest``), run the paths ``targets`` names on this machine's GPU, record them in this
    machine's profile and plan again with them. No GPU here, a target GPU larger than this one or a model
    transformers cannot build: ``InputError``, one line."""
    import dataclasses

    from dsdoctor.calibrate.profile import (
        MachineProfile,
        cache_path,
        find_profile,
        fingerprint,
        machine_description,
        save_profile,
    )
    from dsdoctor.machine import nvidia_smi_gpus
    from dsdoctor.model.spec import load_model_spec

    gpus = nvidia_smi_gpus()
    if not gpus:
        raise InputError("plan --measure runs the path on this machine's GPU, and nvidia-smi lists none: "
                         "run it on a machine with the target GPU")
    result = plan_request(req)
    hw, wl = result.hardware, result.workload
    if hw.gpu_memory > gpus[0].total_bytes:
        raise InputError(f"plan --measure: the target GPU ({human_bytes(hw.gpu_memory)}) is larger than this one "
                         f"({gpus[0].name}, {human_bytes(gpus[0].total_bytes)}): a cap can only emulate a smaller GPU")
    todo = targets(result)
    if not todo:
        raise InputError("plan --measure: nothing to measure: no one-GPU plain, zero3 or zero3-offload path is "
                         "recommended or at the edge for this workload")
    raw = load_model_spec(req.model).raw
    runs = []
    for p in todo:
        job = {"config": raw, "path": p.name, "batch": wl.batch, "prompt_len": wl.prompt_len,
               "new_tokens": wl.new_tokens, "dtype": wl.dtype, "cap_bytes": hw.gpu_memory - p.gpu_outside_allocator_bytes}
        rec = run(job)
        _refuse_failed(rec, req.model, p.name)
        if not rec.get("cap_applied"):
            raise InputError("plan --measure: torch sees no CUDA GPU here (nvidia-smi does): no run was capped")
        runs.append(record(p, rec, job, raw, wl, hw))
    here = machine_description()
    profile = find_profile(here) or MachineProfile(fingerprint(here), here, "", {})
    profile.runs = (profile.runs + runs)[-200:]
    saved = save_profile(profile, cache_path(profile.fingerprint))
    after = plan_request(dataclasses.replace(req, machine=profile))
    return MeasureResult(runs, str(saved), after)


@dataclass
class MeasureResult:
    runs: list  # the profile's records of the runs made
    profile: str  # where they were recorded
    plan: object  # the plan again, with them (PlanResult)

    @property
    def findings(self) -> list:
        return self.plan.findings

    def to_dict(self, lang: str = "en") -> dict:
        return {"runs": self.runs, "profile": self.profile, "plan": self.plan.to_dict(lang)}

    def _table(self, lang: str):
        rows = []
        for r in self.runs:
            pr, me = r["predicted"], r["measured"]
            after = self.plan.path(r["path"])
            rows.append((r["path"], human_bytes(r["gpu_memory"]),
                         f"{human_bytes(pr['allocated'])} / {human_bytes(me['allocated'])}",
                         f"{human_bytes(pr['reserved'])} / {human_bytes(me['reserved'])}",
                         f"{pr['verdict']} / {r['observed']}", after.verdict if after else "-",
                         f"{human_rate(pr['first_tokens_per_s'], 1)} / {human_rate(r['first_tokens_per_s'] or 0, 1)}",
                         f"{human_rate(pr['tokens_per_s'], 1)} / {human_rate(r['steady_tokens_per_s'] or 0, 1)}"))
        return pick(TEXT["head"], lang), rows

    def to_text(self, lang: str = "en", style: Style | None = None) -> str:
        head, rows = self._table(lang)
        return (pick(TEXT["title"], lang).format(gpu=self.runs[0]["gpu"] if self.runs else "-") + "\n"
                + text_table(head, rows) + pick(TEXT["recorded"], lang).format(profile=self.profile) + "\n\n"
                + self.plan.to_text(lang, style))

    def to_markdown(self, lang: str = "en") -> str:
        head, rows = self._table(lang)
        return (f"**{pick(TEXT['title'], lang).format(gpu=self.runs[0]['gpu'] if self.runs else '-')}**\n\n"
                + markdown_table(head, rows) + "\n" + pick(TEXT["recorded"], lang).format(profile=self.profile)
                + "\n\n" + self.plan.to_markdown(lang))
