"""The answer a report leads with: one verdict, the two or three things to do with their commands, and what plan
predicts before and after (GPU peak, host peak, tokens/s for the machine).

Built from what the diagnosis already found (diagnose.py hands the parts over), never recomputed: the verdict
names the traced run's ending when it failed, ab's decisive verdict when there is one, the config's errors and
step 2's answer; the actions are step 5's way out (its commands), then what confirms it on the user's run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dsdoctor.i18n import LANGS, fill, message_table, pick
from dsdoctor.report.render import markdown_table
from dsdoctor.units import human_bytes

TEXT = message_table("report.summary.TEXT")  # the texts live in dsdoctor/messages.json
MAX_ACTIONS = 3


def _sep(lang: str) -> str:
    """What joins two sentences: a space in English, nothing in Chinese (pick() would fall back on the empty one)."""
    return TEXT["sep"].get(lang, TEXT["sep"]["en"])


@dataclass
class Action:
    title: dict  # {lang: text}
    commands: list[str] = field(default_factory=list)

    def to_dict(self, lang: str) -> dict:
        return {"title": pick(self.title, lang), "commands": self.commands}


@dataclass
class Summary:
    verdict: dict  # {lang: text}
    actions: list[Action]
    before: dict | None = None  # {"path", "gpu_peak_bytes", "host_peak_bytes", "tokens_per_s", "fits"}
    after: dict | None = None

    def to_dict(self, lang: str = "en") -> dict:
        return {"verdict": pick(self.verdict, lang), "actions": [a.to_dict(lang) for a in self.actions],
                "before": self.before, "after": self.after}

    def _rows(self, lang: str) -> list[tuple]:
        def cells(key, show):
            return tuple(show(side.get(key)) if side else "-" for side in (self.before, self.after))

        def rate(v):
            return "-" if v is None else f"{v:.1f}"

        return [(pick(TEXT["gpu"], lang), *cells("gpu_peak_bytes", human_bytes)),
                (pick(TEXT["host"], lang), *cells("host_peak_bytes", human_bytes)),
                (pick(TEXT["tps"], lang), *cells("tokens_per_s", rate))]

    def _head(self, lang: str) -> list[str]:
        def side(key, part):
            if not part:
                return pick(TEXT[key], lang).format(path="-")
            text = pick(TEXT[key], lang).format(path=part["path"])
            return text + ("" if part.get("fits", True) else pick(TEXT["does not fit"], lang))
        return [pick(TEXT["predicted"], lang), side("before", self.before), side("after", self.after)]

    def to_markdown(self, lang: str = "en") -> str:
        """A blockquote (the HTML report's summary box): verdict, numbered actions, before -> after."""
        # a space after the label in every language: "**结论：**该" would not close the bold (CommonMark)
        lines = [f"**{pick(TEXT['verdict'], lang)}** {pick(self.verdict, lang)}", ""]
        if self.actions:
            lines += [f"**{pick(TEXT['what to do'], lang)}**", ""]
            for n, a in enumerate(self.actions, 1):
                lines.append(f"{n}. {pick(a.title, lang)}" + "".join(f" `{c}`" for c in a.commands[:2]))
            lines.append("")
        if self.before or self.after:
            lines += markdown_table(self._head(lang), self._rows(lang)).rstrip("\n").splitlines()
        return "".join(f"> {x}\n" if x else ">\n" for x in lines) + "\n"

    def to_text(self, lang: str = "en") -> str:
        lines = [f"{pick(TEXT['verdict'], lang)}{_sep(lang)}{pick(self.verdict, lang)}"]
        for n, a in enumerate(self.actions, 1):
            lines.append(f"  {n}. {pick(a.title, lang)}")
            lines += [f"     $ {c}" for c in a.commands[:2]]
        if self.before or self.after:
            (_, b_gpu, a_gpu), (_, b_host, a_host), (_, b_tps, a_tps) = self._rows(lang)
            before = (self.before or {}).get("path", "-")
            after = (self.after or {}).get("path", "-")
            lines.append("  " + pick(TEXT["text before after"], lang).format(
                before=before, after=after, gpu=f"{b_gpu} -> {a_gpu}", host=f"{b_host} -> {a_host}",
                tps=f"{b_tps} -> {a_tps}"))
        return "\n".join(lines) + "\n"


def path_figures(plan_result, name: str | None) -> dict | None:
    """What plan predicts for one of its paths (tokens/s for the machine: replicas x per rank)."""
    p = plan_result.path(name) if plan_result is not None and name else None
    if p is None:
        return None
    return {"path": p.name, "gpu_peak_bytes": p.gpu_peak_bytes, "host_peak_bytes": p.host_peak_bytes,
            "tokens_per_s": round(p.tokens_per_s * p.replicas, 3), "fits": p.fits, "verdict": p.verdict,
            "upper_bytes": p.upper_bytes}


MEASURED_AS = {"plain": "plain", "split-no-offload": "zero3", "split": "zero3-offload"}  # ab variant -> plan path


def measured_figures(variant) -> dict:
    """What ab measured for one variant (an ``ab`` VariantResult): its peaks and tokens/s, "fits" when it ran."""
    return {"path": f"{variant.name} (measured)", "gpu_peak_bytes": variant.peak_gpu_bytes,
            "host_peak_bytes": variant.peak_host_bytes, "tokens_per_s": variant.tokens_per_s,
            "fits": variant.status == "ok"}


def before_after(plan_result, path: str | None, current: str | None, ab_result=None) -> tuple:
    """(before, after): the way out as plan predicts it (step 5's path), or as ab measured it where ab ran that
    path's variant (or, without a plan, ab's fix); before is the run as-is where ab measured it, else plan's
    figures for the path the user's setup is."""
    runs = {v.name: v for v in (ab_result.variants if ab_result is not None else [])}
    base = runs.get("as-is")
    before = measured_figures(base) if base is not None else \
        (path_figures(plan_result, current) if current != path else None)
    measured = next((v for name, v in runs.items() if MEASURED_AS.get(name) == path and v.status == "ok"), None)
    fix = ab_result.diagnosis if ab_result is not None else None
    if measured is None and plan_result is None and fix is not None and fix.code == "DSD316":
        measured = runs.get(str(fix.values.get("variant")))
    after = measured_figures(measured) if measured is not None else path_figures(plan_result, path)
    return before, after


def verdict(*, failed_run: tuple | None = None, ab=None, config_errors=(), plan_result=None,
            path: str | None = None, current: str | None = None) -> dict:
    """The verdict, one paragraph per language: how the traced run ended when it failed (``failed_run``: the
    rank that ended it and {lang: how}, read by the caller from trace's endings), ab's decisive finding, the
    config's error findings, and whether this inference needs ZeRO-3 (step 2's answer)."""
    parts: list[dict] = []
    if failed_run is not None:
        rank, how = failed_run
        parts.append(fill(TEXT["run failed"], rank=rank, how=how))
    if ab is not None:
        parts.append({lang: ab.message(lang) + "." for lang in LANGS})
    if config_errors:
        names = ", ".join(f"{f.code} {f.rule.name}" for f in config_errors[:3])
        parts.append(fill(TEXT["config errors"], n=len(config_errors), names=names))
    chosen = path_figures(plan_result, path)
    if plan_result is not None and chosen is None:
        parts.append(TEXT["nothing fits"])
    elif chosen is not None:
        needs = path.startswith("zero3")
        key = ("needs zero3" if needs else "no zero3") + (" edge" if chosen["verdict"] == "edge" else "")
        before = path_figures(plan_result, current) if current and current != path else None
        faster = ""
        if before and before["tokens_per_s"] and chosen["tokens_per_s"]:
            ratio = chosen["tokens_per_s"] / before["tokens_per_s"]
            faster = fill(TEXT["than"], ratio=f"{ratio:.1f}", path=current) if ratio >= 1.1 else ""
        parts.append(fill(TEXT[key], path=path, peak=human_bytes(chosen["gpu_peak_bytes"]),
                          tps=f"{chosen['tokens_per_s']:.0f}", faster=faster or {lang: "" for lang in LANGS}))
        if chosen["verdict"] == "edge":  # only the prediction fits: plan's measured band says measure it first
            parts.append(fill(TEXT["edge"], upper=human_bytes(chosen["upper_bytes"])))
    if not parts:
        parts.append(TEXT["nothing found"])
    return {lang: _sep(lang).join(p[lang] for p in parts) for lang in LANGS}
