"""Variants' traces -> ``AbResult`` with a diagnosis (DSD310-DSD314).

The reading, in order: peak lower without offload_param -> the parameter gather dominates (DSD310); peak
unchanged or OOM either way -> activations and output buffers (DSD311); speed collapsing or host memory
exploding with offload -> the CPU-GPU transfer (DSD312); OOM only without offload_param -> offloading is what
makes it fit (DSD315); the inference-only config lowering the peak -> the training parts cost memory (DSD314);
otherwise nothing decisive (DSD313). Differences under 10% are noise.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dsdoctor.findings import Finding, Phrase, sort_findings
from dsdoctor.i18n import LANGS, message_table, pick
from dsdoctor.report.render import (
    Style,
    findings_markdown,
    findings_omitted,
    findings_text,
    markdown_table,
    text_table,
)
from dsdoctor.trace.ending import ending_text, evidence_text
from dsdoctor.trace.report import TraceResult
from dsdoctor.units import human_bytes

TEXT = message_table("trace.diagnose_ab.TEXT")  # the texts live in dsdoctor/messages.json
NOISE = 0.10
# ab's main diagnosis, the first of these it found: the expert's verdict in numbers (DSD346) comes before
# the single comparisons it is drawn from (DSD310, DSD312) and before "nothing changed decisively" (DSD313)
PRIORITY = ("DSD320", "DSD316", "DSD317", "DSD332", "DSD346", "DSD311", "DSD310", "DSD312", "DSD315", "DSD314",
            "DSD313")
FAILED = ("oom", "hang", "error", "timeout", "killed")  # a run that did not get to its end


@dataclass
class VariantResult:
    name: str
    description: str
    status: str  # ok, oom, hang, error
    peak_gpu_bytes: int | None
    peak_host_bytes: int | None
    tokens_per_s: float | None
    wall_s: float
    returncode: int | None
    offload_param: str | None
    stopped: list[str] = field(default_factory=list)  # "rank 1 in generate#0 (infer.py:40 in main, ...)", "rank 0 OOM in init"
    findings: list[str] = field(default_factory=list)  # codes found in this variant's trace
    report: str | None = None  # the variant's own report.json, relative to the ab directory
    # the inference peak: max over ranks of generate phases (allocated GPU bytes; host RSS). The A/B compares
    # these, so that how the script happens to load the model (e.g. built whole on the GPU) does not decide.
    generate_peak_gpu_bytes: int | None = None
    generate_peak_host_bytes: int | None = None
    shape: dict | None = None  # model config, workload, ranks and path the trace recorded (ab_verdict)
    optimizer: str | None = None  # the optimizer DeepSpeed built, else the one the config asked for
    config_source: str | None = None  # the config file the run passed, when it passed one
    endings: list[dict] = field(default_factory=list)  # how each rank that did not finish ended (trace/ending.py)
    tokens_per_s_kind: str | None = None  # "steady" (generates after the first) or "first" (one generate)
    host_total_bytes: int | None = None  # the host's memory, and the GPU's, as the ranks saw them: the headroom
    gpu_total_bytes: int | None = None

    @classmethod
    def from_trace(cls, name: str, description: str, t: TraceResult, report: str | None) -> VariantResult:
        stopped = [f"rank {r.rank} in {r.stopped_in}" + (f" ({r.where})" if r.where else "")
                   for r in t.ranks if r.stopped_in and r.status in ("timeout", "hang")]
        stopped += [f"rank {r.rank} OOM in " + next((p["label"] for p in r.phases if p.get("error")), "?")
                    for r in t.ranks if r.status == "oom" and (r.ending or {}).get("kind") != "oom-killer"]
        endings = [dict(r.ending, rank=r.rank) for r in t.ranks
                   if r.ending and r.ending.get("kind") not in ("finished", None)]
        stopped += [f"rank {e['rank']} {ending_text(e, 'en')}" for e in endings
                    if e["kind"] not in ("hang", "timeout", "cuda-oom")]
        offload = next((r.offload_param for r in t.ranks if r.offload_param), None)
        gen = [p for r in t.ranks for p in r.phases if p.get("name") == "generate"]
        gen_gpu = max((p["peak_gpu_allocated_bytes"] for p in gen if p.get("peak_gpu_allocated_bytes")), default=None)
        gen_host = max((p["peak_host_bytes"] for p in gen if p.get("peak_host_bytes")), default=None)
        from dsdoctor.trace.ab_verdict import shape_of

        passed = next((r.config_passed for r in t.ranks if r.config_passed), None) or {}
        optimizer = next((r.optimizer for r in t.ranks if r.optimizer), None) or passed.get("optimizer")
        source = passed.get("source")
        return cls(name, description, t.status, t.peak_gpu_bytes, t.peak_host_bytes, t.tokens_per_s, t.wall_s,
                   t.returncode, offload or passed.get("offload_param"), stopped, [f.code for f in t.findings],
                   report, gen_gpu, gen_host, shape_of(t), optimizer,
                   source if isinstance(source, str) and source not in ("dict", "kwargs") else None, endings,
                   t.ranks[0].tokens_per_s_kind if t.ranks else None,
                   next((r.host_total_bytes for r in t.ranks if r.host_total_bytes), None),
                   max((p.get("gpu_total_bytes") or 0 for r in t.ranks for p in r.phases), default=0) or None)

    def headroom(self) -> dict:
        """{"host"/"gpu": (peak, total, the fraction left free)} where both the peak and the total are known."""
        out = {}
        for kind, peak, total in (("host", self.peak_host_bytes, self.host_total_bytes),
                                  ("gpu", self.peak_gpu_bytes, self.gpu_total_bytes)):
            if peak and total:
                out[kind] = (peak, total, max(0.0, 1 - peak / total))
        return out

    def headroom_text(self) -> str:
        """The table's headroom column: "host 78%, GPU 40%" free at the peak."""
        return ", ".join(f"{'GPU' if k == 'gpu' else k} {free:.0%}" for k, (_, _, free) in self.headroom().items()) \
            or "-"

    def failure(self) -> dict | None:
        """How this run failed, as its first failing rank ended (a {lang: text}), or None when it ran."""
        if self.status not in FAILED:
            return None
        order = ("oom-killer", "signal", "cuda-oom", "host-oom", "exception", "collective-timeout", "hang", "timeout")
        root = min(self.endings, key=lambda e: order.index(e["kind"]) if e["kind"] in order else len(order),
                   default=None)
        if root is None:
            return {lang: self.status.upper() for lang in LANGS}
        texts = {}
        for lang in LANGS:
            text = ending_text(root, lang)
            evidence = evidence_text(root, lang) if root["kind"] in ("oom-killer", "signal") else ""
            texts[lang] = f"{text} ({evidence})" if evidence else text
        return texts

    def stopped_text(self, lang: str) -> str:
        """The "how it ended" column: each rank that did not finish, in ``lang``."""
        if not self.endings:
            return "; ".join(self.stopped) or "-"
        return "; ".join(f"rank {e['rank']} {ending_text(e, lang)}" for e in self.endings)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class AbResult:
    command: list[str]
    variants: list[VariantResult]
    findings: list[Finding]  # the diagnosis (DSD310-DSD314) and the as-is variant's own trace findings
    out_dir: str | None = None

    @property
    def diagnosis(self) -> Finding | None:
        for code in PRIORITY:
            for f in self.findings:
                if f.code == code:
                    return f
        return None

    def to_dict(self, lang: str = "en") -> dict:
        d = self.diagnosis
        return {
            "command": self.command,
            "variants": [v.to_dict() for v in self.variants],
            "diagnosis": d.to_dict(lang) if d else None,
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)],
            "out_dir": self.out_dir,
        }

    def _rows(self, lang: str = "en"):
        for v in self.variants:
            kind = pick(TEXT[f"tps-{v.tokens_per_s_kind}"], lang) if v.tokens_per_s_kind in ("steady", "first") else "-"
            yield (v.name, v.status, human_bytes(v.generate_peak_gpu_bytes), human_bytes(v.peak_gpu_bytes),
                   human_bytes(v.peak_host_bytes), v.headroom_text(),
                   "-" if v.tokens_per_s is None else f"{v.tokens_per_s:.1f}", kind, f"{v.wall_s:.1f}s",
                   v.stopped_text(lang))

    def _head(self, lang):
        return pick(TEXT["head"], lang)

    def to_text(self, lang: str = "en", style: Style | None = None) -> str:
        style = style or Style()
        out = [f"dsdoctor ab: {' '.join(self.command)}\n\n", text_table(self._head(lang), list(self._rows(lang))), "\n"]
        d = self.diagnosis
        if d:
            out.append(f"{pick(TEXT['diagnosis'], lang)}: {d.code} {d.message(lang)}\n  {style.arrow} {d.fix(lang)}\n\n")
        out.append(findings_text(self.findings, lang, style))
        if self.out_dir:
            out.append(f"files: {self.out_dir}/report.json, report.md, <variant>/report.json\n")
        return "".join(out)

    def to_markdown(self, lang: str = "en") -> str:
        d = self.diagnosis
        out = [f"# dsdoctor ab\n\n`{' '.join(self.command)}`\n\n", markdown_table(self._head(lang), list(self._rows(lang)))]
        if d:
            out.append(f"\n**{pick(TEXT['Diagnosis'], lang)}: {d.code}** {d.message(lang)}\n\n→ {d.fix(lang)}\n")
        if not findings_omitted():
            out += ["\n## Findings\n\n", findings_markdown(self.findings, lang)]
        return "".join(out)


REWRITTEN_AT = ("deepspeed.initialize", "HfDeepSpeedConfig")
NOT_CONFIG_VARIANTS = ("gather-once",)  # variants the observer applies inside generate, not to the config


def not_applied(name: str, t: TraceResult, following: list[str], ran: list[str]) -> Finding | None:
    """DSD320 when the variants cannot change this run: after ``as-is``, when no rank handed a config that the
    observer can rewrite to deepspeed.initialize or HfDeepSpeedConfig; after any other variant, when no rank
    received that variant's config. None when ab can go on."""
    seen = [c for r in t.ranks for c in r.configs_seen]
    following = [f for f in following if f not in NOT_CONFIG_VARIANTS]
    if name in NOT_CONFIG_VARIANTS:  # applied at generate, not to the config: nothing to check here
        return None
    if name == "as-is":
        if not following or any(c.get("api") in REWRITTEN_AT and c.get("rewritable") for c in seen):
            return None
        variant = ", ".join(following)
    elif any(c.get("variant_applied") == name for c in seen):
        return None
    else:
        variant = name
    apis = {c.get("api") for c in seen}
    if "deepspeed.init_inference" in apis:
        why, advice = Phrase("why-init-inference"), Phrase("advice-plan")
    elif apis & set(REWRITTEN_AT):
        why, advice = Phrase("why-not-rewritable"), Phrase("advice-dict")
    elif t.status != "ok" and not seen:
        why, advice = Phrase("why-ended", {"status": t.status}), Phrase("advice-trace")
    else:
        why, advice = Phrase("why-none"), Phrase("advice-no-config")
    return Finding("DSD320", {"variant": variant, "why": why, "ran": ", ".join(ran), "advice": advice})


def _metric(v: VariantResult, gpu: bool):
    """The inference (generate) peak when the variant reached generate, else its whole-run peak."""
    if gpu:
        return v.generate_peak_gpu_bytes or v.peak_gpu_bytes
    return v.generate_peak_host_bytes or v.peak_host_bytes


def _summary(variants: list[VariantResult], gpu: bool) -> str:
    parts = []
    for v in variants:
        m = _metric(v, gpu)
        rate = f", {v.tokens_per_s:.1f} tok/s" if v.tokens_per_s else ""
        parts.append(f"{v.name} {v.status.upper() if v.status != 'ok' else human_bytes(m)}{rate}")
    return "; ".join(parts)


def _lower(a, b) -> bool:
    """a is clearly lower than b."""
    return a is not None and b is not None and a < b * (1 - NOISE)


def diagnose(variants: list[VariantResult]) -> list[Finding]:
    gpu = any(v.peak_gpu_bytes is not None for v in variants)
    kind = Phrase("gpu" if gpu else "host")
    by = {v.name: v for v in variants}
    base, nop, split = by.get("as-is"), by.get("no-offload-param"), by.get("split")
    out: list[Finding] = []

    if base and nop and base.offload_param:
        out += _offload_findings(base, nop, gpu, kind)
    if base and split:
        out += _split_findings(base, split, gpu, kind)
    from dsdoctor.trace.loop_rules import gather_once_diagnosis

    out += gather_once_diagnosis(variants, gpu)
    decisive = fix_verdict(variants, gpu) or same_failure(variants, out)
    if decisive is not None:
        out.append(decisive)
    if not any(f.code in ("DSD310", "DSD311", "DSD312", "DSD314", "DSD315", "DSD316", "DSD317", "DSD332")
               for f in out):
        out.append(Finding("DSD313", {"summary": _summary(variants, gpu)}))
    from dsdoctor.trace.ab_verdict import findings as verdict_findings

    out += verdict_findings(variants, _machine_profile())
    return sort_findings(out)


def _offload_findings(base: VariantResult, nop: VariantResult, gpu: bool, kind) -> list[Finding]:
    """DSD310/311/312/315: as-is against the same config without offload_param."""
    out: list[Finding] = []
    b, n = _metric(base, gpu), _metric(nop, gpu)
    if base.status == "oom" and nop.status == "oom":
        out.append(Finding("DSD311", {"with_": "OOM", "without": "OOM", "oom": Phrase("oom-both")}))
    elif base.status == "oom" and nop.status == "ok":
        out.append(Finding("DSD310", {"with_": "OOM", "without": human_bytes(n)}))
    elif base.status == "ok" and nop.status == "oom":
        rate = f", {base.tokens_per_s:.1f} tokens/s" if base.tokens_per_s else ""
        out.append(Finding("DSD315", {"without": "OOM", "with_": human_bytes(b), "kind": kind,
                                      "speed": rate}))
    elif base.status == "ok" and nop.status == "ok":
        if _lower(n, b):
            out.append(Finding("DSD310", {"with_": human_bytes(b), "without": human_bytes(n)}))
        what = []
        if base.tokens_per_s and nop.tokens_per_s and base.tokens_per_s < 0.5 * nop.tokens_per_s:
            what.append(Phrase("slower", {"before": nop.tokens_per_s, "after": base.tokens_per_s}))
        if gpu and _lower(nop.peak_host_bytes, (base.peak_host_bytes or 0) / 1.5 / (1 - NOISE)):
            what.append(Phrase("host-grows", {"before": human_bytes(nop.peak_host_bytes),
                                              "after": human_bytes(base.peak_host_bytes)}))
        if what:
            both = what[0] if len(what) == 1 else Phrase("both", {"a": what[0], "b": what[1]})
            out.append(Finding("DSD312", {"what": both}))
    return out


def _split_findings(base: VariantResult, split: VariantResult, gpu: bool, kind) -> list[Finding]:
    """DSD314: the split config against as-is."""
    out: list[Finding] = []
    b, s = _metric(base, gpu), _metric(split, gpu)
    speed = ""
    if base.tokens_per_s and split.tokens_per_s:
        speed = f" ({base.tokens_per_s:.1f} -> {split.tokens_per_s:.1f} tokens/s)"
    if base.status == "oom" and split.status == "ok":
        out.append(Finding("DSD314", {"variant": split.name, "kind": kind, "before": "OOM",
                                      "after": human_bytes(s), "speed": speed}))
    elif base.status == "ok" and split.status == "ok" and _lower(s, b):
        out.append(Finding("DSD314", {"variant": split.name, "kind": kind, "before": human_bytes(b),
                                      "after": human_bytes(s), "speed": speed}))
    elif base.status == "ok" and split.status == "ok" and gpu and _lower(split.peak_host_bytes,
                                                                            base.peak_host_bytes):
        out.append(Finding("DSD314", {"variant": split.name, "kind": Phrase("host"), "before":
                                      human_bytes(base.peak_host_bytes), "after":
                                      human_bytes(split.peak_host_bytes), "speed": speed}))
    return out


MIN_HEADROOM = 0.25  # a variant that ran with less of the failing memory left free only survives
MEMORY_ENDINGS = {"oom-killer": "host", "host-oom": "host", "cuda-oom": "gpu"}
MEMORY = {"host": "mem-host", "gpu": "mem-gpu"}  # DSD316's phrase for each


def _cause(base: VariantResult, gpu: bool) -> str | None:
    """The memory that ended the run as-is ("host" or "gpu"), or None when it did not end for memory."""
    for e in base.endings:
        if e["kind"] in MEMORY_ENDINGS:
            return MEMORY_ENDINGS[e["kind"]]
    return ("gpu" if gpu else "host") if base.status == "oom" else None


def only_survives(base: VariantResult, v: VariantResult, gpu: bool) -> Phrase | None:
    """Why ``v`` runs without removing what ended the run as-is (a phrase), or None when it removes it: as-is ran
    out of memory and ``v`` still builds the optimizer as-is built, or ends with less than a quarter of that
    memory free."""
    cause = _cause(base, gpu)
    if cause is None:
        return None
    if base.optimizer and v.optimizer:
        return Phrase("keeps-optimizer", {"optimizer": v.optimizer})
    peak, total, free = v.headroom().get(cause, (None, None, 1.0))
    if free < MIN_HEADROOM:
        return Phrase("tight", {"kind": Phrase(MEMORY[cause]), "peak": human_bytes(peak), "total": human_bytes(total)})
    return None


def _better(runs: list[VariantResult], gpu: bool, base: VariantResult | None = None) -> VariantResult:
    """Of the variants that ran, the one to use, weighed as an expert does: one that removes the cause of the
    failure as-is before one that only survives it (``only_survives``); then the fastest (tokens/s), and among
    those within the noise of it the one that needs less memory (GPU peak, then host peak), so offload is
    kept only where it is what makes the run fit, and pin_memory is whichever measured better."""
    if base is not None:
        runs = [v for v in runs if only_survives(base, v, gpu) is None] or runs
    fastest = max((v.tokens_per_s or 0) for v in runs)
    close = [v for v in runs if (v.tokens_per_s or 0) >= fastest * (1 - NOISE)] or runs
    return min(close, key=lambda v: ((_metric(v, True) or 0) if gpu else 0, v.peak_host_bytes or 0))


def _headroom_phrases(v: VariantResult) -> list[Phrase]:
    return [Phrase("headroom", {"kind": Phrase(MEMORY[k]), "peak": human_bytes(peak), "total": human_bytes(total),
                                "free": f"{free:.0%}"}) for k, (peak, total, free) in v.headroom().items()]


def _changes(base: VariantResult, best: VariantResult, gpu: bool) -> list[Phrase]:
    """What the fix changes, as measured: optimizer, offload, the peaks where the failed run was above them, the
    headroom left, the speed."""
    changes = []
    if (base.optimizer or None) != (best.optimizer or None):
        changes.append(Phrase("optimizer", {"before": base.optimizer or "none", "after": best.optimizer or "none"}))
    if (base.offload_param or None) != (best.offload_param or None):
        changes.append(Phrase("offload", {"before": base.offload_param or "none", "after": best.offload_param or "none"}))
    # a failed run's peak is where it died: worth saying only when it was above what the fix needs
    if best.peak_host_bytes and _lower(best.peak_host_bytes, base.peak_host_bytes):
        changes.append(Phrase("host", {"before": human_bytes(base.peak_host_bytes), "after":
                                       human_bytes(best.peak_host_bytes)}))
    if gpu and best.peak_gpu_bytes and _lower(best.peak_gpu_bytes, base.peak_gpu_bytes):
        changes.append(Phrase("gpu", {"before": human_bytes(base.peak_gpu_bytes), "after":
                                      human_bytes(best.peak_gpu_bytes)}))
    changes += _headroom_phrases(best)
    if best.tokens_per_s:
        kind = TEXT.get(f"tps-{best.tokens_per_s_kind}") or TEXT["tps-first"]
        changes.append(Phrase("speed", {"tps": f"{best.tokens_per_s:.1f}", "kind": kind}))
    return changes


def fix_verdict(variants: list[VariantResult], gpu: bool) -> Finding | None:
    """DSD316: the run as-is fails and a config variant runs to the end: that variant is the fix (one that
    removes the cause before one that only survives it)."""
    by = {v.name: v for v in variants}
    base = by.get("as-is")
    if base is None or base.status not in FAILED:
        return None
    others = [v for v in variants if v.name != "as-is" and v.name not in NOT_CONFIG_VARIANTS]
    runs = [v for v in others if v.status == "ok"]
    if not runs:
        return None
    best = _better(runs, gpu, base)
    changes = _changes(base, best, gpu)
    for v in runs:
        why = only_survives(base, v, gpu) if v is not best else None
        if why is not None:
            changes.append(Phrase("survives", {"variant": v.name, "why": why}))
    also = [v.name for v in runs if v is not best and only_survives(base, v, gpu) is None]
    failing = [v.name for v in others if v.status != "ok"]
    if also:
        changes.append(Phrase("also", {"names": ", ".join(also)}))
    if failing:
        changes.append(Phrase("still-fails", {"names": ", ".join(failing)}))
    return Finding("DSD316", {"variant": best.name, "failed": base.failure(), "changes": Phrase.join("sep", changes),
                              "fix": _fix_phrase(best.name, base.config_source)})


END_STATE_FIXES = {"split-no-offload": "fix-split-no-offload", "plain": "fix-plain"}


def _fix_phrase(name: str, config: str | None) -> Phrase:
    if name == "split":
        return Phrase("fix-split", {"config": config or "CONFIG"})
    if name == "no-offload-param":
        return Phrase("fix-no-offload-param")
    if name in END_STATE_FIXES:
        return Phrase(END_STATE_FIXES[name], {"config": config or "CONFIG"})
    if name in ("pin-memory-on", "pin-memory-off"):
        return Phrase("fix-pin", {"value": "true" if name == "pin-memory-on" else "false"})
    if name.startswith("prefetch="):
        return Phrase("fix-prefetch", {"value": name.split("=", 1)[1]})
    return Phrase("fix-other", {"variant": name})


def same_failure(variants: list[VariantResult], found: list[Finding]) -> Finding | None:
    """DSD317: every variant failed, and the same way (out-of-memory everywhere is DSD311's reading)."""
    if len(variants) < 2 or any(v.status not in FAILED for v in variants) or \
            any(f.code in ("DSD311", "DSD320") for f in found):
        return None
    kinds = {_root_kind(v) for v in variants}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind in ("oom-killer", "cuda-oom", "host-oom") or variants[0].status == "oom":
        advice = Phrase("advice-oom")
    elif kind in ("hang", "collective-timeout"):
        advice = Phrase("advice-hang")
    else:
        advice = Phrase("advice-error")
    return Finding("DSD317", {"failed": variants[0].failure(), "advice": advice})


def _root_kind(v: VariantResult) -> str:
    kinds = [e["kind"] for e in v.endings if e["kind"] != "by-launcher"]
    return kinds[0] if kinds else v.status


def _machine_profile():
    try:
        from dsdoctor.calibrate.profile import find_profile

        return find_profile()
    except Exception:  # the verdict stands without measured bandwidths
        return None
