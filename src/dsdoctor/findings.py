"""One anatomy for every finding dsdoctor reports, from every command.

A ``Rule`` is the static part: code, name, severity, a one-line message and an imperative fix (both
``str.format`` templates over the finding's values), and a long explanation in four sections (What it does /
Why is this bad? / Example / Use instead), each in English and Chinese. Rules are data: each package keeps
the rules its detectors report in its ``rules.json`` (``config/rules.json`` holds DSD1xx, ...), loaded once
when this module is imported, so ``dsdoctor explain CODE`` knows them all without importing torch. A
``Finding`` is one occurrence: the rule's code plus the concrete values that fill the templates.
``docs/architecture.md`` says how to add one.

An entry of a ``rules.json``::

    "DSD1xx": {
     "name": "kebab-name", "severity": "warning",
     "message": {"en": "... {value} ...", "zh": "... {value} ..."},
     "fix": {"en": "...", "zh": "..."},
     "phrases": {"host": {"en": "host", "zh": "..."}},               (optional)
     "explanation": {"en": {"what": [lines], "why": [lines], "example": [lines], "instead": [lines]},
                     "zh": {...the same four sections...}}}

Finding values carry no language: numbers, names, sizes, or a ``Phrase`` (a key into the rule's ``phrases``
table plus the values that fill it) where the wording differs by language, or a ``{lang: text}`` dict of UI text
that another module renders (``i18n.fill`` of a messages.json entry, such as how a rank ended).
"""
from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsdoctor import door
from dsdoctor.errors import InputError, one_line
from dsdoctor.i18n import LANGS, message_table, pick

SEVERITIES = ("info", "warning", "error")  # ascending
# the four sections of every explanation, in this order (ruff's rule docs); headings in messages.json
SECTIONS = ("what", "why", "example", "instead")
SECTION_HEADINGS = message_table("findings.SECTION_HEADINGS")
# the packages that keep rules (in their rules.json): each holds the rules its detectors report
RULE_PACKAGES = ("config", "plan", "trace", "checkpoint", "compare")
_HERE = Path(__file__).parent


def severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity)


@dataclass(frozen=True)
class Rule:
    code: str  # stable: DSD101
    name: str  # the bad pattern, kebab-case: optimizer-in-inference
    severity: str  # error: crash, OOM or wrong output; warning: waste; info: advice
    message: dict[str, str]  # one line, str.format template over the finding's values
    fix: dict[str, str]  # imperative, str.format template
    explanation: dict[str, tuple[str, ...]]  # per language: the bodies of SECTIONS, in order
    phrases: dict[str, dict[str, str]] = field(default_factory=dict)  # Phrase key -> {"en", "zh"} template


RULES: dict[str, Rule] = {}


def _texts(code: str, what: str, value) -> dict[str, str]:
    if not isinstance(value, dict) or set(value) != set(LANGS):
        raise ValueError(f"{code}: {what} needs exactly the languages {LANGS}")
    return dict(value)


def add_rule(code: str, entry: dict) -> Rule:
    """The one way a rule comes to exist: an entry as a ``rules.json`` holds it (see the module docstring)."""
    known = {"name", "severity", "message", "fix", "phrases", "explanation"}
    if set(entry) - known or not {"name", "severity", "message", "fix", "explanation"} <= set(entry):
        raise ValueError(f"{code}: a rule has {sorted(known)} ('phrases' optional), not {sorted(entry)}")
    if entry["severity"] not in SEVERITIES:
        raise ValueError(f"{code}: severity {entry['severity']!r} is not one of {SEVERITIES}")
    if code in RULES:
        raise ValueError(f"duplicate finding code {code}")
    explanation = _texts(code, "explanation", entry["explanation"])
    for lang, sections in explanation.items():
        if not isinstance(sections, dict) or tuple(sections) != SECTIONS:
            raise ValueError(f"{code}: the {lang} explanation needs the sections {SECTIONS}, in that order")
        explanation[lang] = tuple("\n".join(sections[k]) for k in SECTIONS)
    r = Rule(code, entry["name"], entry["severity"], _texts(code, "message", entry["message"]),
             _texts(code, "fix", entry["fix"]), explanation,
             {k: _texts(code, f"phrase {k!r}", v) for k, v in entry.get("phrases", {}).items()})
    RULES[code] = r
    return r


def rules_file(package: str) -> Path:
    return _HERE / package / "rules.json"


def _load() -> None:
    for package in RULE_PACKAGES:
        for code, entry in json.loads(door.read_text(rules_file(package), door.PACKAGE_DATA)).items():
            add_rule(code, entry)


_load()


def all_rules() -> dict[str, Rule]:
    return dict(sorted(RULES.items()))


@dataclass
class Phrase:
    """A language-free finding value: a key into the rule's ``phrases`` table and the values that fill it."""

    key: str
    values: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def join(key: str, items: list) -> Any:
        """``items`` joined by the rule's two-place phrase ``key`` (``{a}; {b}``): "" for none, the item for one."""
        if not items:
            return ""
        return items[0] if len(items) == 1 else Phrase(key, {"a": items[0], "b": Phrase.join(key, items[1:])})


class _Values(dict):
    """Leaves unknown placeholders visible instead of raising KeyError."""

    def __missing__(self, key):
        return "{" + key + "}"


@dataclass
class Finding:
    code: str
    values: dict[str, Any] = field(default_factory=dict)
    severity: str | None = None  # None: the rule's; a detector may raise or lower it with reason
    deletes: tuple[str, ...] = ()  # config keys (dotted paths) whose deletion is the fix: split deletes them

    @property
    def rule(self) -> Rule:
        return RULES[self.code]

    @property
    def effective_severity(self) -> str:
        return self.severity or self.rule.severity

    def localized_values(self, lang: str = "en") -> dict[str, Any]:
        """The values with every ``Phrase`` rendered in ``lang``."""
        return {k: self._render(v, lang) for k, v in self.values.items()}

    def _render(self, value, lang: str):
        if isinstance(value, Phrase):
            inner = _Values({k: self._render(v, lang) for k, v in value.values.items()})
            return pick(self.rule.phrases[value.key], lang).format_map(inner)
        if isinstance(value, dict) and set(value) == set(LANGS):  # UI text from messages.json, filled (i18n.fill)
            return value[lang] if lang in value else value["en"]
        return value

    def message(self, lang: str = "en") -> str:
        # values come from untrusted files: one line, control characters escaped
        return one_line(pick(self.rule.message, lang).format_map(_Values(self.localized_values(lang))))

    def fix(self, lang: str = "en") -> str:
        return one_line(pick(self.rule.fix, lang).format_map(_Values(self.localized_values(lang))))

    def to_dict(self, lang: str = "en") -> dict:
        return {
            "code": self.code,
            "name": self.rule.name,
            "severity": self.effective_severity,
            "message": self.message(lang),
            "fix": self.fix(lang),
            "values": _jsonable(self.localized_values(lang)),
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
    for section, body in zip(SECTIONS, pick(r.explanation, lang)):
        heading = pick(SECTION_HEADINGS[section], lang)
        width = sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in heading)
        parts += [heading, "-" * width, body, ""]
    return "\n".join(parts)
