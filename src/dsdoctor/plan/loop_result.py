"""The result of planning an RL job (``plan_job``): the arrangements compared, the per-GPU parts of the given
and the recommended one, the recommendation with its setting changes and code, the findings (DSD230-DSD233).
One serializable type for text, JSON and Markdown."""
from __future__ import annotations

from dataclasses import dataclass, field

from dsdoctor.config.rl import ROLES
from dsdoctor.findings import Finding, Phrase, sort_findings
from dsdoctor.i18n import message_table, pick
from dsdoctor.plan import findings as plan_findings
from dsdoctor.plan.loop_arrange import Candidate, changes, engine_label
from dsdoctor.plan.loop_code import job_code, job_ds_configs
from dsdoctor.plan.loop_memory import Hold, Phase
from dsdoctor.plan.result import banded
from dsdoctor.report.render import Style, findings_markdown, findings_text, markdown_table, text_table
from dsdoctor.units import human_bytes, human_count

TEXT = message_table("plan.loop_result.TEXT")
LABELS = message_table("plan.result.LABELS")
PART_LABELS = message_table("plan.loop_result.PARTS")
SHOWN = 8  # rows in the table
CPU_ADAM_ELEMENTS_PER_S = 1e9  # DeepSpeedCPUAdam per rank (an assumption the result states)


def part_label(key: str, lang: str) -> str:
    """``actor:weights`` -> "actor weights"; ``rollout:kv_cache`` -> "rollout KV cache"."""
    bits = key.split(":")
    leaf = bits[-1]
    text = PART_LABELS.get(leaf) or LABELS.get(leaf)
    words = [pick(TEXT["role " + b], lang) if ("role " + b) in TEXT else b for b in bits[:-1]]
    return " ".join(words + [pick(text, lang) if text else leaf])


@dataclass
class Arrangement:
    """One arrangement of the job evaluated (``JobModel.evaluate``): on one GPU of the group that needs the most,
    the phases of an iteration and what decides fits, and the seconds of an iteration per training GPU; the row
    the result shows (``changes``: against the job as given; ``given``: it is the job as given)."""
    candidate: Candidate
    group: str
    world: int  # the group's GPUs
    phases: list  # loop_memory.Phase: rollout, experience, train; the peak is the largest
    gpu_need_bytes: int  # the peak phase + allocator slack + CUDA context + NCCL: what decides fits
    limits: list  # gpu, host, engine: what it does not fit
    host_peak_bytes: int
    seconds: dict  # rollout, experience, train
    samples_per_s: float
    rollout_tokens_per_s: float
    notes: list = field(default_factory=list)
    changes: list = field(default_factory=list)  # (setting, from, to)
    given: bool = False
    upper_bytes: int | None = None  # the need's upper figure: the band's worst case (plan/band.py)
    band: dict | None = None  # figure -> the band it takes (an RL job: the widest, unmeasured)
    verdict: str = "fits"  # fits | edge (only the prediction fits) | does not fit
    outside_bytes: int = 0  # of the need, outside the caching allocator: CUDA context(s), NCCL

    @property
    def fits(self) -> bool:
        return not self.limits

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def gpu_peak_bytes(self) -> int:  # allocated peak of the worst group's worst phase
        return self.peak.total

    @property
    def iteration_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def arrangement(self) -> str:
        return label(self.candidate)[0]

    @property
    def holds(self) -> dict:  # role -> hold label
        return label(self.candidate)[1]

    @property
    def engine(self) -> str:
        return engine_label(self.candidate.engine)

    def to_dict(self) -> dict:
        return {"arrangement": self.arrangement, "holds": self.holds, "engine": self.engine,
                "fits": self.fits, "verdict": self.verdict, "limits": list(self.limits),
                "gpu_peak_bytes": self.gpu_peak_bytes, "gpu_need_bytes": self.gpu_need_bytes,
                "upper_bytes": self.upper_bytes, "band": self.band, "peak_at": self.peak.name,
                "phases": {p.name: p.total for p in self.phases}, "breakdown": dict(self.peak.parts),
                "host_peak_bytes": self.host_peak_bytes, "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "iteration_s": round(self.iteration_s, 3), "samples_per_s": round(self.samples_per_s, 3),
                "rollout_tokens_per_s": round(self.rollout_tokens_per_s, 1),
                "changes": [{"setting": s, "from": a, "to": b} for s, a, b in self.changes],
                "code_change": self.candidate.code_change, "given": self.given, "notes": list(self.notes)}


def label(cand) -> tuple[str, dict]:
    order = {r: i for i, r in enumerate(ROLES)}
    holds = {role: h.label for role, h in sorted(cand.holds.items(), key=lambda rh: order.get(rh[0], 99))}
    text = ", ".join(f"{role} {h}" for role, h in holds.items()) + f"; {engine_label(cand.engine)}"
    return text, holds


@dataclass
class JobRecommendation:
    arrangement: str | None
    why: dict
    changes: list
    code: str | None
    ds_configs: dict  # role -> the DeepSpeed config it runs with

    def to_dict(self, lang: str) -> dict:
        return {"arrangement": self.arrangement, "why": pick(self.why, lang) if self.why else None,
                "changes": [{"setting": s, "from": a, "to": b} for s, a, b in self.changes], "code": self.code,
                "ds_configs": self.ds_configs}


@dataclass
class JobPlanResult:
    job: dict
    models: list  # one dict per model: role, source, params, how it was read, trainable, given hold
    workload: dict
    hardware: object
    rows: list[Arrangement]
    given: Arrangement | None
    recommended: JobRecommendation
    findings: list[Finding]
    assumptions: list

    def to_dict(self, lang: str = "en") -> dict:
        return {"job": self.job, "models": self.models, "workload": self.workload,
                "hardware": self.hardware.to_dict(), "given": self.given.to_dict() if self.given else None,
                "arrangements": [r.to_dict() for r in self.rows], "recommended": self.recommended.to_dict(lang),
                "assumptions": self.assumptions,
                "findings": [f.to_dict(lang) for f in sort_findings(self.findings)]}

    # ------------------------------------------------------------ rendering
    def _header(self, lang: str) -> list[str]:
        t = lambda k: pick(TEXT[k], lang)  # noqa: E731
        j, w, h = self.job, self.workload, self.hardware
        lines = [t("job").format(framework=j.get("framework") or t("no framework"), source=j.get("source") or "-",
                                 models=len(self.models), gpus=h.gpus, gpu_memory=human_bytes(h.gpu_memory),
                                 host=human_bytes(h.host_memory))]
        for m in self.models:
            lines.append("  " + t("model line").format(
                role=pick(TEXT["role " + m["role"]], lang), params=human_count(m["params"]), source=m["source"],
                how=t("how " + m["how"]), kind=t("trainable" if m["trainable"] else "frozen"),
                hold=m["given"] or "-"))
        lines.append(t("workload").format(batch=w["batch"], prompt=w["prompt_len"], new=w["new_tokens"],
                                          dtype=w["dtype"], train=w["train_batch"]))
        return lines

    def _table_rows(self, ok: str, no: str, lang: str, edge: str):
        rows = []
        for r in self.rows:
            mark = ("*" if r.arrangement == self.recommended.arrangement else "") + ("=" if r.given else "")
            fit = edge if r.verdict == "edge" else ok if r.fits else f"{no} " + ",".join(r.limits)
            rows.append((mark + r.arrangement, fit, banded(r.gpu_need_bytes, r.band, "reserved", lang),
                         pick(TEXT["phase " + r.peak.name], lang),
                         human_bytes(r.host_peak_bytes), f"{r.iteration_s:.1f}", f"{r.samples_per_s:.2f}",
                         f"{r.rollout_tokens_per_s:.0f}"))
        return rows

    def _parts(self, r: Arrangement, lang: str) -> str:
        parts = sorted(r.peak.parts.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{part_label(k, lang)} {human_bytes(v)}" for k, v in parts)

    def _detail_lines(self, lang: str) -> list[str]:
        t = lambda k: pick(TEXT[k], lang)  # noqa: E731
        out, rec = [], self._recommended_row()
        for row in [self.given] * (self.given is not None) + [rec] * (rec is not None and rec is not self.given):
            head = t("given") if row.given else t("recommended")
            out.append(t("parts head").format(which=head, phase=t("phase " + row.peak.name),
                                              peak=human_bytes(row.gpu_peak_bytes)))
            out.append("  " + self._parts(row, lang))
            totals = {p.name: p.total for p in row.phases}
            out.append("  " + t("phases").format(**{k: human_bytes(totals.get(k)) for k in
                                                   ("rollout", "experience", "train")}))
        return out

    def _recommended_row(self) -> Arrangement | None:
        return next((r for r in self.rows if r.arrangement == self.recommended.arrangement), None)

    def to_text(self, lang: str = "en", style: Style | None = None) -> str:
        style = style or Style()
        out = ["\n".join(self._header(lang)) + "\n",
               text_table(pick(TEXT["head"], lang), self._table_rows(style.ok, style.error, lang,
                                                                    f"{style.warning} {pick(TEXT['edge'], lang)}")),
               pick(TEXT["legend"], lang) + "\n", "\n".join(self._detail_lines(lang)) + "\n"]
        rec = self.recommended
        if rec.arrangement:
            out.append(f"{pick(TEXT['recommended'], lang)}: {rec.arrangement}: {pick(rec.why, lang)}\n")
            if rec.changes:
                out.append(pick(TEXT["changes"], lang) + ": " + change_text(rec.changes) + "\n")
            if rec.code:
                out.append(rec.code.rstrip() + "\n")
        if self.assumptions:
            out.append(pick(TEXT["assumed"], lang) + ": " + "; ".join(self.assumptions) + "\n")
        out.append(findings_text(self.findings, lang, style))
        return "\n".join(x for x in out if x)

    def to_markdown(self, lang: str = "en") -> str:
        out = [pick(TEXT["title"], lang), "  \n".join(self._header(lang)), "\n\n",
               markdown_table(pick(TEXT["head"], lang), self._table_rows(pick(TEXT["yes"], lang), pick(TEXT["no"], lang),
                                                                          lang, pick(TEXT["edge"], lang))), "\n"]
        out += [line + "  \n" for line in self._detail_lines(lang)]
        rec = self.recommended
        if rec.arrangement:
            out.append(f"\n**{pick(TEXT['recommended'], lang)}**: `{rec.arrangement}`: {pick(rec.why, lang)}\n\n")
            if rec.code:
                out.append(f"```\n{rec.code}```\n\n")
        out.append(findings_markdown(self.findings, lang))
        return "".join(out)


def change_text(changes: list) -> str:
    """"--actor_zero_stage 2 -> 3; ...", or "actor stage 3" where there is nothing to compare with."""
    return "; ".join(f"{s} {_show(b)}" if a is None and b is not None else f"{s} {_show(a)} -> {_show(b)}"
                     for s, a, b in changes)


def _show(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return "-" if v is None else str(v)


# ------------------------------------------------------------------ building it

def _shown(rows: list, chosen, base) -> list:
    """The given, the recommended, and per rollout engine the fastest that fits (else the smallest)."""
    picked = [r for r in (base, chosen) if r is not None]
    by_engine: dict = {}
    for r in rows:
        engine = r.candidate.engine
        by_engine.setdefault(engine_label(engine).split(" (")[0] + ("" if engine.colocate else " apart"), []).append(r)
    for group in by_engine.values():
        fit = [r for r in group if r.fits]
        picked.append(max(fit, key=lambda r: r.samples_per_s) if fit else min(group, key=lambda r: r.gpu_need_bytes))
    seen, out = set(), []
    for r in picked:  # one row per arrangement as DeepSpeed runs it (settings without effect fold together)
        if r.arrangement not in seen:
            seen.add(r.arrangement)
            out.append(r)
    return sorted(out[:SHOWN], key=lambda r: (not r.fits, -r.samples_per_s))


def _recommendation(job, resolved, hw, wl, train_batch, base, chosen) -> tuple[JobRecommendation, float | None]:
    """The recommendation of the chosen arrangement, and how much faster than the job as given it is."""
    base_cand = base.candidate if base else None
    ch = changes(chosen.candidate, base_cand)
    same = base is not None and chosen.arrangement == base.arrangement
    compared = base is not None and base.fits and not same  # faster than a job as given that runs
    speedup = chosen.samples_per_s / base.samples_per_s if compared and base.samples_per_s else None
    why = {lang: pick(TEXT["why edge" if chosen.verdict == "edge" else "why"], lang).format(
        need=human_bytes(chosen.gpu_need_bytes), capacity=human_bytes(hw.gpu_memory), upper=human_bytes(chosen.upper_bytes),
                                                samples=f"{chosen.samples_per_s:.2f}",
                                                rollout=f"{chosen.rollout_tokens_per_s:.0f}")
           + (pick(TEXT["why faster"], lang).format(x=f"{speedup:.2f}") if speedup else "")
           for lang in ("en", "zh")}
    code = None if same and not ch else job_code(job, resolved, chosen.candidate, ch, wl.dtype, train_batch)
    return JobRecommendation(chosen.arrangement, why, ch, code,
                             job_ds_configs(job, chosen.candidate, wl.dtype, train_batch)), speedup


def _findings(hw, base, chosen, smallest, rec: JobRecommendation, speedup, figures, profile) -> list[Finding]:
    """DSD205 (what was assumed), DSD233 (nothing fits), DSD232 (a faster arrangement), DSD230 (as given it
    does not fit)."""
    found = plan_findings.config_findings([], None, None, None, hw, figures, profile)
    capacity = human_bytes(hw.gpu_memory)
    if chosen is None:
        found.append(Finding("DSD233", {"need": human_bytes(smallest.gpu_need_bytes), "capacity": capacity,
                                        "arrangement": smallest.arrangement, "phase": smallest.peak.name,
                                        "parts": _top_parts(smallest), "gpus": hw.gpus}))
    elif base is not None and rec.changes:
        found.append(Finding("DSD232", {
            "arrangement": rec.arrangement, "that_fits": Phrase("edge" if chosen.verdict == "edge" else "that fits"),
            "need": human_bytes(chosen.gpu_need_bytes), "capacity": capacity,
            "samples": f"{chosen.samples_per_s:.2f}",
            "than_given": Phrase("faster", {"x": f"{speedup:.2f}"}) if speedup else Phrase("given-unfit"),
            "changes": change_text(rec.changes)}))
    if base is not None and not base.fits:
        fix = Phrase("fix-change-edge" if chosen.verdict == "edge" else "fix-change",
                     {"arrangement": rec.arrangement, "changes": change_text(rec.changes)}) if chosen else Phrase("fix-none")
        found.append(Finding("DSD230", {"arrangement": base.arrangement, "need": human_bytes(base.gpu_need_bytes),
                                        "capacity": capacity, "limits": ", ".join(base.limits),
                                        "phase": base.peak.name, "parts": _top_parts(base), "fix": fix}))
    return found + _edge(hw, chosen)


def _edge(hw, chosen) -> list[Finding]:
    """DSD234 when the recommended arrangement fits by its prediction only (none fits outright): what to run
    under which cap (plan --measure runs no RL job)."""
    if chosen is None or chosen.verdict != "edge":
        return []
    cap = Phrase("measure cap", {"what": Phrase("one iteration"), "cap": human_bytes(hw.gpu_memory - chosen.outside_bytes)})
    return [plan_findings.edge_finding(chosen.arrangement, chosen.gpu_need_bytes, chosen.upper_bytes, hw.gpu_memory,
                                       chosen.band["reserved"], cap, None)]


ASSUMPTIONS = ["gather-once and the hybrid engine at plain generate speed (an upper bound: DeepSpeed's "
               "unwrap_model_for_generation measured 0.34x plain on one H200, 1.5B; ab measures yours)",
               "the caching allocator's reserve beyond the training step's allocated peak is not modelled "
               "(one H200 reserved 1.26-1.35x it, BENCHMARKS.md): keep headroom or set "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]


def build_result(job, resolved, hw, wl, train_batch, rows, base, chosen, figures, profile) -> JobPlanResult:
    """The result of a job's plan: ``rows`` every arrangement evaluated, ``base`` the job as given (or None),
    ``chosen`` the recommended one (or None)."""
    shown = _shown(rows, chosen, base)
    for r in shown:
        r.given = r is base
        r.changes = [] if r.given else changes(r.candidate, base.candidate if base else None)
    rec, speedup = JobRecommendation(None, {}, [], None, {}), None
    if chosen is not None:
        rec, speedup = _recommendation(job, resolved, hw, wl, train_batch, base, chosen)
    smallest = min(rows, key=lambda r: r.gpu_need_bytes) if rows else None
    found = _findings(hw, base, chosen, smallest, rec, speedup, figures, profile)
    models = [{"role": m.role, "source": resolved[m.role].source, "params": resolved[m.role].params,
               "how": resolved[m.role].how, "trainable": m.trainable,
               "given": given_label(m)} for m in job.models]
    assumptions = [f"CPU Adam {CPU_ADAM_ELEMENTS_PER_S:.0e} elements/s per rank", *ASSUMPTIONS, *job.notes]
    workload = {"batch": wl.batch, "prompt_len": wl.prompt_len, "new_tokens": wl.new_tokens, "dtype": wl.dtype,
                "train_batch": train_batch}
    jd = {"framework": job.framework, "source": job.source, "engine": job.engine and job.engine.to_dict(),
          "gpus": hw.gpus}
    return JobPlanResult(jd, models, workload, hw, shown, base, rec, found, assumptions)  # base is always shown


def given_label(m) -> str | None:
    """How the job holds a model as given (None: it names no stage)."""
    if m.stage is None:
        return None
    return Hold(m.stage, m.offload_param, m.offload_optimizer).effective(m.trainable).label


def _top_parts(row: Arrangement, n: int = 3) -> str:
    parts = sorted(row.peak.parts.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {human_bytes(v)}" for k, v in parts)
