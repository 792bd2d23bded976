"""One anatomy for every finding dsdoctor reports, from every command.

A ``Rule`` is the static part (code, name, severity, message and fix templates, long explanation, each in
English and Chinese). A ``Finding`` is one occurrence: the rule's code plus the concrete values that fill
the templates. Rules live in small ``rules.py`` modules next to the code that detects them and register
themselves here, so ``dsdoctor explain CODE`` knows them all without importing torch.

Writing a rule::

    rule("DSD1xx", "kebab-name", "warning",
         message={"en": "... {value} ...", "zh": "... {value} ..."},
         fix={"en": "...", "zh": "..."},
         explanation=explanation(en=(what, why, example, instead), zh=(what, why, example, instead)),
         phrases={"host": {"en": "host", "zh": "主机"}})  # optional

Finding values carry no language: numbers, names, sizes, or a ``Phrase`` (a key into the rule's ``phrases``
table plus the values that fill it) where the wording differs by language.
"""
from __future__ import annotations

import importlib
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from dsdoctor.errors import InputError, one_line
from dsdoctor.i18n import pick

SEVERITIES = ("info", "warning", "error")  # ascending
# the four sections of every explanation, in this order (ruff's rule docs)
SECTION_HEADINGS = {
    "en": ("What it does", "Why is this bad?", "Example", "Use instead"),
    "zh": ("作用", "为什么有问题？", "示例", "应改为"),
}


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
    phrases: dict[str, dict[str, str]] = field(default_factory=dict)  # Phrase key -> {"en", "zh"} template

    def __post_init__(self):
        assert self.severity in SEVERITIES, self.severity
        for part in (self.message, self.fix, self.explanation, *self.phrases.values()):
            assert set(part) == {"en", "zh"}, (self.code, part.keys())


def explanation(*, en: tuple[str, str, str, str], zh: tuple[str, str, str, str]) -> dict[str, str]:
    """The one explanation builder: (what it does, why is this bad, example, use instead) per language,
    rendered as Markdown sections under the same headings for every rule."""
    out = {}
    for lang, parts in (("en", en), ("zh", zh)):
        assert len(parts) == 4, parts
        out[lang] = "\n\n".join(f"## {head}\n{body.strip()}" for head, body in zip(SECTION_HEADINGS[lang], parts)) + "\n"
    return out


@dataclass
class Phrase:
    """A language-free finding value: a key into the rule's ``phrases`` table and the values that fill it."""

    key: str
    values: dict[str, Any] = field(default_factory=dict)


RULES: dict[str, Rule] = {}

# Modules whose import registers rules. Torch-free by contract.
RULE_MODULES = (
    "dsdoctor.config.rules",
    "dsdoctor.config.rules_configs",
    "dsdoctor.plan.rules",
    "dsdoctor.trace.rules",
    "dsdoctor.trace.rules_init",
    "dsdoctor.checkpoint.rules",
    "dsdoctor.compare.rules",
    "dsdoctor.calibrate.rules",
)


def rule(code: str, name: str, severity: str, *, message: dict, fix: dict, explanation: dict,
         phrases: dict | None = None) -> Rule:
    """Define and register a rule (called at import time of a rules module)."""
    if code in RULES and RULES[code].name != name:
        raise ValueError(f"duplicate finding code {code}")
    r = Rule(code, name, severity, message, fix, explanation, dict(phrases or {}))
    RULES[code] = r
    return r


def all_rules() -> dict[str, Rule]:
    for module in RULE_MODULES:
        importlib.import_module(module)
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

    def localized_values(self, lang: str = "en") -> dict[str, Any]:
        """The values with every ``Phrase`` rendered in ``lang``."""
        return {k: self._render(v, lang) for k, v in self.values.items()}

    def _render(self, value, lang: str):
        if isinstance(value, Phrase):
            inner = _Values({k: self._render(v, lang) for k, v in value.values.items()})
            return pick(self.rule.phrases[value.key], lang).format_map(inner)
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


def explanation_sections(text: str) -> list[tuple[str, str]]:
    """Split an explanation (as ``explanation()`` writes it) into (heading, body) pairs."""
    sections: list[tuple[str, list[str]]] = []
    for line in text.strip("\n").splitlines():
        if line.startswith("## "):
            sections.append((line[3:].strip(), []))
        elif sections:
            sections[-1][1].append(line)
        else:
            sections.append(("", [line]))
    return [(h, "\n".join(body).strip()) for h, body in sections]


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
