"""One anatomy for every finding dsdoctor reports, from every command.

A ``Rule`` is the static part (code, name, severity, message and fix templates, long explanation, each in
English and Chinese). A ``Finding`` is one occurrence: the rule's code plus the concrete values that fill
the templates. Rules live in small ``rules.py`` modules next to the code that detects them and register
themselves here, so ``dsdoctor explain CODE`` knows them all without importing torch.
"""
from __future__ import annotations

import importlib
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from dsdoctor.errors import InputError, one_line
from dsdoctor.i18n import pick

SEVERITIES = ("info", "warning", "error")  # ascending


def severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity)


@dataclass(frozen=True)
class Rule:
    code: str  # stable: DSD101
    name: str  # the bad pattern, kebab-case: optimizer-in-inference
    severity: str  # error: crash, OOM or wrong output; warning: waste; info: advice
    message: dict[str, str]  # one line, str.format template over the finding's values
    fix: dict[str, str]  # imperative, str.format template
    explanation: dict[str, str]  # What it does / Why is this bad? / Example / Use instead

    def __post_init__(self):
        assert self.severity in SEVERITIES, self.severity
        for part in (self.message, self.fix, self.explanation):
            assert set(part) == {"en", "zh"}, (self.code, part.keys())


RULES: dict[str, Rule] = {}

# Modules whose import registers rules. Torch-free by contract.
RULE_MODULES = (
    "dsdoctor.config.rules",
    "dsdoctor.plan.rules",
    "dsdoctor.trace.rules",
    "dsdoctor.checkpoint.rules",
    "dsdoctor.compare.rules",
)


def rule(code: str, name: str, severity: str, *, message: dict, fix: dict, explanation: dict) -> Rule:
    """Define and register a rule (called at import time of a rules module)."""
    if code in RULES and RULES[code].name != name:
        raise ValueError(f"duplicate finding code {code}")
    r = Rule(code, name, severity, message, fix, explanation)
    RULES[code] = r
    return r


def all_rules() -> dict[str, Rule]:
    for module in RULE_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:  # a capability not built yet
            if not exc.name or not module.startswith(exc.name):
                raise
    return dict(sorted(RULES.items()))


class _Values(dict):
    """Leaves unknown placeholders visible instead of raising KeyError."""

    def __missing__(self, key):
        return "{" + key + "}"


@dataclass
class Finding:
    code: str
    values: dict[str, Any] = field(default_factory=dict)
    severity: str | None = None  # None: the rule's; a detector may raise or lower it with reason

    @property
    def rule(self) -> Rule:
        if self.code not in RULES:
            all_rules()
        return RULES[self.code]

    @property
    def effective_severity(self) -> str:
        return self.severity or self.rule.severity

    def message(self, lang: str = "en") -> str:
        # values come from untrusted files: one line, control characters escaped
        return one_line(pick(self.rule.message, lang).format_map(_Values(self.values)))

    def fix(self, lang: str = "en") -> str:
        return one_line(pick(self.rule.fix, lang).format_map(_Values(self.values)))

    def to_dict(self, lang: str = "en") -> dict:
        return {
            "code": self.code,
            "name": self.rule.name,
            "severity": self.effective_severity,
            "message": self.message(lang),
            "fix": self.fix(lang),
            "values": _jsonable(self.values),
        }


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (-severity_rank(f.effective_severity), f.code))


def exit_code(findings: list[Finding], fail_on: str = "error") -> int:
    """0 clean, 1 when a finding is at or above ``fail_on``."""
    if fail_on not in SEVERITIES:
        raise InputError(f"--fail-on must be one of {', '.join(SEVERITIES)}, not {fail_on!r}")
    threshold = severity_rank(fail_on)
    return 1 if any(severity_rank(f.effective_severity) >= threshold for f in findings) else 0


def explanation_sections(text: str) -> list[tuple[str, str]]:
    """Split an explanation into (heading, body) pairs. Headings are ``## Title`` lines, or unindented lines
    followed by an indented body (both styles occur); bodies are dedented and re-joined."""
    import textwrap

    lines = text.strip("\n").splitlines()
    sections: list[tuple[str, list[str]]] = []
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        is_heading = line.startswith("#") or (
            line.strip() and not line[0].isspace() and nxt[:1].isspace() and len(line) < 40)
        if is_heading:
            sections.append((line.lstrip("#").strip(), []))
        elif sections:
            sections[-1][1].append(line)
        else:
            sections.append(("", [line]))
    return [(h, textwrap.dedent("\n".join(body)).strip()) for h, body in sections]


def explain(code: str, lang: str = "en") -> str:
    """The long explanation of a finding code (``dsdoctor explain DSD101``); also accepts the rule name."""
    rules = all_rules()
    key = code.strip().upper()
    r = rules.get(key) or next((x for x in rules.values() if x.name == code.strip().lower()), None)
    if r is None:
        known = ", ".join(rules) or "none"
        raise InputError(f"unknown finding code {code!r}", hint=f"known codes: {known}")
    head = f"{r.code} {r.name} ({r.severity})"
    parts = [head, "=" * len(head), ""]
    for heading, body in explanation_sections(pick(r.explanation, lang)):
        if heading:
            width = sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in heading)
            parts += [heading, "-" * width]
        parts += [body, ""]
    return "\n".join(parts)
