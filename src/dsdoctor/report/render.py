"""The one result protocol, its renderers and its report writer.

Every result type (check, split, plan, trace, ab, merge, verify, compare, diagnose, env) is a small dataclass
with ``findings`` and the three methods of ``Result``. A missing ``style`` means ``Style()`` everywhere: the
text has the same content with or without one; only the glyphs change. These helpers render the parts every
result has (findings, tables); ``render`` picks the format and ``write_report`` writes the report files.
Results go to stdout; logs and hints to stderr.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dsdoctor.findings import Finding, sort_findings
from dsdoctor.i18n import message_table, pick

FORMATS = ("text", "json", "markdown")


@dataclass(frozen=True)
class Style:
    """Glyphs, with an ASCII fallback for consoles that cannot encode them (GBK/cp936, latin-1)."""

    error: str = "✗"
    warning: str = "⚠"
    info: str = "ℹ"
    ok: str = "✓"
    arrow: str = "→"

    @classmethod
    def for_stream(cls, stream=None) -> Style:
        stream = stream or sys.stdout
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            "✗⚠ℹ✓→".encode(encoding)
        except (UnicodeEncodeError, LookupError):
            return ASCII
        return cls()


ASCII = Style(error="x", warning="!", info="i", ok="ok", arrow="->")


class Result(Protocol):
    findings: list[Finding]

    def to_dict(self, lang: str = "en") -> dict: ...

    def to_text(self, lang: str = "en", style: Style | None = None) -> str: ...  # None: Style()

    def to_markdown(self, lang: str = "en") -> str: ...


TEXT = message_table("report.render.TEXT")  # the words around the findings


def to_json(data) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False, sort_keys=False) + "\n"


def findings_text(findings: list[Finding], lang: str, style: Style) -> str:
    if not findings:
        return f"{style.ok} " + pick(TEXT["no findings"], lang) + "\n"
    lines = []
    for f in sort_findings(findings):
        sev = f.effective_severity
        glyph = getattr(style, sev)
        lines.append(f"{glyph} {f.code} [{sev}] {f.message(lang)}")
        lines.append(f"    {style.arrow} {f.fix(lang)}")
    lines.append(pick(TEXT["details"], lang))
    return "\n".join(lines) + "\n"


_OMIT_FINDINGS = contextvars.ContextVar("dsdoctor_omit_findings", default=False)


@contextlib.contextmanager
def without_findings():
    """Render a result's Markdown without its findings (a report that lists them once elsewhere)."""
    token = _OMIT_FINDINGS.set(True)
    try:
        yield
    finally:
        _OMIT_FINDINGS.reset(token)


def findings_omitted() -> bool:
    return _OMIT_FINDINGS.get()


def findings_markdown(findings: list[Finding], lang: str) -> str:
    if _OMIT_FINDINGS.get():
        return ""
    if not findings:
        return "_" + pick(TEXT["no findings markdown"], lang) + "_\n"
    head = pick(TEXT["head markdown"], lang)
    rows = [(f.code, f.effective_severity, f.message(lang), f.fix(lang)) for f in sort_findings(findings)]
    return markdown_table(head, rows)


def _md_cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(head, rows) -> str:
    out = ["| " + " | ".join(_md_cell(h) for h in head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def text_table(head, rows) -> str:
    """Aligned plain-text table (East Asian wide characters counted as two columns)."""
    import unicodedata

    def width(s: str) -> int:
        return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in s)

    cells = [[str(c) for c in head]] + [[str(c) for c in r] for r in rows]
    widths = [max(width(row[i]) for row in cells) for i in range(len(head))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c + " " * (widths[i] - width(c)) for i, c in enumerate(row)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def render(result: Result, fmt: str, lang: str, stream=None) -> str:
    """The text of ``result`` in ``fmt``."""
    if fmt == "json":
        return to_json(result.to_dict(lang))
    if fmt == "markdown":
        return result.to_markdown(lang)
    return result.to_text(lang, Style.for_stream(stream))


def write_report(result: Result, directory, lang: str = "en", *, also_markdown: tuple[str, ...] = (),
                 html_title: str | None = None) -> None:
    """The one report writer: ``report.json`` and ``report.md`` in ``lang`` into ``directory``, plus
    ``report.<lang>.md`` for each of ``also_markdown`` and ``report.html`` (images inlined) with a title."""
    from dsdoctor import door

    directory = Path(directory)
    markdown = result.to_markdown(lang)
    door.write_new(directory / "report.json", to_json(result.to_dict(lang)))
    door.write_new(directory / "report.md", markdown)
    for other in also_markdown:
        door.write_new(directory / f"report.{other}.md", result.to_markdown(other))
    if html_title:
        from dsdoctor.report.html import markdown_to_html

        door.write_new(directory / "report.html", markdown_to_html(markdown, html_title, base=directory))
