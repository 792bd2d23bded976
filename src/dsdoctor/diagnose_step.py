"""A step of ``dsdoctor diagnose`` (``Step``), its texts and the small helpers every step uses."""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from dsdoctor.findings import Finding, sort_findings
from dsdoctor.i18n import fill, message_table
from dsdoctor.report.render import without_findings

# the texts live in dsdoctor/messages.json
STEP_TITLES = message_table("diagnose.STEP_TITLES")
TEXT = message_table("diagnose.TEXT")
SUMMARY = message_table("diagnose.SUMMARY")  # what each step found, per situation
SKIPPED = message_table("diagnose.SKIPPED")  # why a step was skipped


@dataclass
class Step:
    key: str
    status: str  # done, skipped, failed
    summary: dict[str, str]  # lang -> one paragraph
    findings: list[Finding] = field(default_factory=list)
    details_md: str = ""  # Markdown of the underlying result
    data: dict = field(default_factory=dict)
    artifacts: list[str] = field(default_factory=list)  # files written, relative to the report directory
    commands: list[str] = field(default_factory=list)  # what to run next

    def to_dict(self, lang: str) -> dict:
        return {
            "step": self.key, "status": self.status, "summary": self.summary.get(lang) or self.summary["en"],
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)], "data": self.data,
            "artifacts": self.artifacts, "commands": self.commands,
        }


def _shell(args) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


def _details(result, lang: str) -> str:
    """A step's full result in Markdown, its findings left out (the step lists them, once)."""
    with without_findings():
        return result.to_markdown(lang)


def _skipped(key: str, why: dict[str, str], commands: list[str] | None = None) -> Step:
    return Step(key, "skipped", fill(SUMMARY["skipped"], why=why), commands=commands or [])


def _with_inputs(summary: dict, sources: dict) -> dict:
    """A step's summary followed by where its inputs came from."""
    more = fill(SUMMARY["inputs"], model=sources.get("model"), dtype=sources.get("dtype"),
                workload=sources.get("workload"))
    return {lang: f"{text} {more[lang]}" for lang, text in summary.items()}
