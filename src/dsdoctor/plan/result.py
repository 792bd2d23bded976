"""The result of ``dsdoctor plan``: one serializable type shared by text, JSON, Markdown and the plots."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dsdoctor.findings import Finding, sort_findings
from dsdoctor.i18n import message_table, pick
from dsdoctor.plan.ds_knobs import DsKnobs
from dsdoctor.plan.hardware import Hardware
from dsdoctor.plan.workload import Workload
from dsdoctor.report.render import Style, findings_markdown, findings_text, markdown_table, text_table
from dsdoctor.units import human_age, human_bytes, human_count, human_rate

# names of the breakdown parts, per language
LABELS = message_table("plan.result.LABELS")  # the texts live in dsdoctor/messages.json


TEXT = message_table("plan.result.TEXT")  # every other word of the rendered plan


def label(key: str, lang: str) -> str:
    return pick(LABELS.get(key, key), lang)


def banded(value: int, band: dict | None, figure: str, lang: str) -> str:
    """A memory figure with its measured band: ``21.3 GiB (+0%..+18%, n=25)`` (plan/band.py)."""
    b = (band or {}).get(figure)
    if not b:
        return human_bytes(value)
    return f"{human_bytes(value)} (" + pick(TEXT[f"band {b['source']}"], lang).format(
        low=f"{b['low'] - 1:+.0%}", high=f"{b['high'] - 1:+.0%}", n=b["n"]) + ")"


def searched(outright: int | None, edge: int | None, lang: str) -> str:
    """A what-fits cell: the largest that fits outright, and the largest at the edge where it is larger."""
    text = "-" if outright is None else str(outright)
    return text + pick(TEXT["edge to"], lang).format(edge=edge) if edge else text


@dataclass
class PathPlan:
    name: str
    ranks: int
    replicas: int
    gpu_peak_bytes: int
    gpu_reserved_bytes: int
    gpu_outside_allocator_bytes: int
    host_peak_bytes: int
    fits: bool
    limits: list  # why it does not fit: gpu, host
    peak_at: str
    tokens_per_s: float
    decode_tokens_per_s: float
    bound: str
    breakdown: dict
    host_breakdown: dict
    max_batch: int | None = None  # the largest that fits outright (its upper figure fits: evaluate.what_fits)
    max_prompt_len: int | None = None
    edge_batch: int | None = None  # larger ones that fit by the prediction only (edge); None: none is larger
    edge_prompt_len: int | None = None
    notes: list = field(default_factory=list)
    loading: str | None = None  # the loading method the host figures assume (plan/loading.py)
    host_file_bytes: int = 0  # mapped checkpoint pages (file-backed, reclaimable): beside host_peak_bytes
    loading_options: list = field(default_factory=list)  # every method's host memory (anonymous, file-backed)
    tp: int | None = None  # GPUs per tensor-parallel group
    estimate: bool = False  # modelled, not yet measured on a GPU
    fragmentation_bytes: int = 0  # reserved beyond allocated that the caching allocator cannot reuse
    speed_terms: dict = field(default_factory=dict)  # decode-step seconds by term
    verdict: str = "fits"  # fits | edge (only the prediction fits) | does not fit | unverified (see evaluate.fits)
    band: dict | None = None  # figure -> measured / predicted band: low, high, n, source (plan/band.py)
    upper_bytes: int | None = None  # the line's upper figure: reserved x the band's worst case + outside
    reserved_assumption: dict | None = None  # several ranks: what the reserved figure assumes (paths/base.host_ahead)
    first_generate_extra_s: float = 0.0  # the first generate of a process: this much longer (new KV lengths)
    first_generate_tokens_per_s: float = 0.0  # tokens_per_s is the steady state (a repeated generate)

    def to_dict(self) -> dict:
        return dict(asdict(self), tokens_per_s=round(self.tokens_per_s, 3),
                    decode_tokens_per_s=round(self.decode_tokens_per_s, 3))


@dataclass
class Recommendation:
    path: str | None
    why: dict  # lang -> text
    ds_config: dict | None
    code: str | None

    def to_dict(self, lang: str) -> dict:
        return {"path": self.path, "why": self.why.get(lang) or self.why.get("en"), "ds_config": self.ds_config,
                "code": self.code}


@dataclass
class PlanResult:
    model: dict
    workload: Workload
    hardware: Hardware
    knobs: DsKnobs | None
    paths: list[PathPlan]
    recommended: Recommendation
    findings: list[Finding]
    weights_only_bytes: int
    loading: dict | None = None  # the transformers release the host figures assume (plan/loading.py)
    run_dtype: str | None = None  # the dtype the emitted config and code use on this GPU

    def path(self, name: str) -> PathPlan | None:
        return next((p for p in self.paths if p.name == name), None)

    def to_dict(self, lang: str = "en") -> dict:
        return {
            "model": self.model, "workload": self.workload.to_dict(), "hardware": self.hardware.to_dict(),
            "config": self.knobs.to_dict() if self.knobs else None,
            "weights_only_bytes": self.weights_only_bytes, "loading": self.loading,
            "paths": [p.to_dict() for p in self.paths],
            "recommended": self.recommended.to_dict(lang),
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)],
        }

    def _rows(self, lang: str, ok: str, no: str, unverified: str, edge: str):
        rows = []
        for p in self.paths:
            star = "*" if p.name == self.recommended.path else ""
            star += "~" if p.estimate else ""
            fit = {"unverified": unverified, "edge": edge}.get(p.verdict) or (
                ok if p.fits else f"{no} " + ",".join(p.limits))
            rows.append((
                p.name + star, p.ranks, banded(p.gpu_peak_bytes, p.band, "allocated", lang),
                banded(p.gpu_reserved_bytes, p.band, "reserved", lang),
                human_bytes(p.host_peak_bytes), p.loading or "-", fit,
                human_rate(p.tokens_per_s, 1), searched(p.max_batch, p.edge_batch, lang),
                searched(p.max_prompt_len, p.edge_prompt_len, lang),
            ))
        return pick(TEXT["head"], lang), rows

    def _calibration(self, lang: str) -> str:
        prof = getattr(self.hardware, "profile", None) or {}
        when = prof.get("calibrated_at")
        if when:
            src = f" ({prof['source']})" if prof.get("source") else ""
            rest = prof.get("assumed") or []
            tail = pick(TEXT["assumed some"], lang) + ", ".join(rest) if rest else ""
            return pick(TEXT["calibrated"], lang).format(when=when[:10]) + src + self._freshness(prof, lang) + tail
        return pick(TEXT["not calibrated"], lang)

    @staticmethod
    def _freshness(prof: dict, lang: str) -> str:
        """How old the profile is, on which host, and whether plan re-timed this host (calibrate/recheck.py)."""
        fresh = prof.get("freshness")
        if not fresh:
            return ""
        text = pick(TEXT["profile age"], lang).format(age=human_age(fresh.get("age_s")),
                                                      host=pick(TEXT[f"profile {fresh.get('host') or 'unknown host'}"], lang))
        if fresh.get("rescaled"):
            text += pick(TEXT["profile rescaled"], lang).format(ratio=f"{fresh['ratio']:.2f}")
        elif fresh.get("now_s"):
            text += pick(TEXT["profile rechecked"], lang)
        return text

    def _header(self, lang: str) -> str:
        m, w, h = self.model, self.workload, self.hardware
        return (pick(TEXT["model"], lang).format(model_type=m["model_type"], params=human_count(m["num_params"]),
                                                 counted_by=m["counted_by"],
                                                 weights=human_bytes(self.weights_only_bytes))
                + pick(TEXT["workload"], lang).format(batch=w.batch, prompt_len=w.prompt_len,
                                                      new_tokens=w.new_tokens, dtype=w.dtype)
                + pick(TEXT["hardware"], lang).format(gpus=h.gpus, gpu_memory=human_bytes(h.gpu_memory),
                                                      host_memory=human_bytes(h.host_memory))
                + pick(TEXT["machine"], lang).format(figures=self._calibration(lang))
                + self._loading_line(lang))

    def _loading_line(self, lang: str) -> str:
        """Which transformers the host figures assume, and how it loads."""
        if not self.loading:
            return ""
        version = self.loading.get("version") or pick(TEXT["newest"], lang)
        source = self.loading.get("source") or "assumed"
        return pick(TEXT["loading"], lang).format(version=version, source=pick(TEXT.get(f"source {source}", source), lang),
                                                  behaviour=pick(TEXT[f"loader {self.loading['loader']}"], lang))

    def _first_generate(self, lang: str) -> str:
        """The speed term users see first: tok/s/rank is the steady state; the first generate takes longer."""
        p = self.path(self.recommended.path) if self.recommended.path else None
        if p is None or not p.first_generate_extra_s:
            return ""
        return pick(TEXT["first generate"], lang).format(path=p.name, extra=p.first_generate_extra_s,
                                                        first=p.first_generate_tokens_per_s, steady=p.tokens_per_s)

    def _breakdown_lines(self, lang: str) -> list[str]:
        lines = []
        for p in self.paths:
            parts = ", ".join(f"{label(k, lang)} {human_bytes(v)}" for k, v in p.breakdown.items())
            lines.append(f"  {p.name} ({pick(TEXT['peak at'], lang)} {pick(TEXT[p.peak_at], lang)}): {parts}")
        return lines

    def _host_lines(self, lang: str) -> list[str]:
        """Host memory of the recommended path (or the first) by loading method: anonymous vs file-backed."""
        p = self.path(self.recommended.path) if self.recommended.path else (self.paths[0] if self.paths else None)
        if p is None or not p.loading_options:
            return []
        lines = [pick(TEXT["host head"], lang).format(path=p.name)]
        for m in p.loading_options:
            mark = "*" if m["method"] == p.loading else " "
            rss = human_bytes(m["file_rss_bytes"])
            assumes = pick(TEXT.get(f"tag {m.get('assumes')}", m.get("assumes") or "-"), lang)
            lines.append(f"  {mark}{m['method']:<16} {human_bytes(m['anon_bytes'])}"
                         + pick(TEXT["host line"], lang).format(file=human_bytes(m["file_bytes"]), rss=rss)
                         + f" [{assumes}]")
        return lines

    def to_text(self, lang: str = "en", style: Style | None = None) -> str:
        style = style or Style()
        head, rows = self._rows(lang, style.ok, style.error, f"{style.warning} gpu?",
                                f"{style.warning} {pick(TEXT['edge'], lang)}")
        out = [self._header(lang), text_table(head, rows)]
        out.append(pick(TEXT["breakdown"], lang) + "\n" + "\n".join(self._breakdown_lines(lang)) + "\n")
        host = self._host_lines(lang)
        if host:
            out.append("\n".join(host) + "\n")
        if any(p.estimate for p in self.paths):
            out.append(pick(TEXT["estimate"], lang) + "\n")
        first = self._first_generate(lang)
        if first:
            out.append(first + "\n")
        rec = self.recommended
        if rec.path:
            out.append(f"{pick(TEXT['recommended'], lang)}: {rec.path}: {pick(rec.why, lang)}\n")
            out.append(rec.code.rstrip() + "\n")
        out.append(findings_text(self.findings, lang, style))
        return "\n".join(x for x in out if x)

    def to_markdown(self, lang: str = "en") -> str:
        head, rows = self._rows(lang, pick(TEXT["yes"], lang), pick(TEXT["no"], lang), pick(TEXT["unverified"], lang),
                                pick(TEXT["edge"], lang))
        out = [pick(TEXT["title"], lang), self._header(lang).replace("\n", "  \n"), "\n", markdown_table(head, rows), "\n"]
        brows = [(p.name, label(k, lang), human_bytes(v)) for p in self.paths for k, v in p.breakdown.items()]
        out += [markdown_table(pick(TEXT["part head"], lang), brows), "\n"]
        first = self._first_generate(lang)
        if first:
            out.append(first + "\n\n")
        rec = self.recommended
        if rec.path:
            out.append(f"**{pick(TEXT['recommended'], lang).capitalize()}**"
                       + f": `{rec.path}`: {pick(rec.why, lang)}\n\n```python\n{rec.code}```\n\n")
        out.append(findings_markdown(self.findings, lang))
        return "".join(out)
