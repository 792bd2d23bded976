"""UI text and the finding anatomy: one way to store text (data with both languages, looked up by key) and one
anatomy for every rule (ruff's: code, name, severity, message with values, imperative fix, explanation in the
same four sections), from data, every rule reported somewhere."""
from __future__ import annotations

import ast
import json
import re
import string
import subprocess
import sys

import pytest

from dsdoctor.findings import RULE_PACKAGES, RULES, SECTIONS, SEVERITIES, all_rules, explain, rules_file
from dsdoctor.i18n import LANGS
from tests.helpers import ROOT

SRC = ROOT / "src" / "dsdoctor"
MESSAGES = SRC / "messages.json"
CODE = re.compile(r"DSD\d{3}")
NAME = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


def _data() -> dict[str, dict]:
    """Every rule as its rules.json holds it, with the package it lives in."""
    out: dict[str, dict] = {}
    for package in RULE_PACKAGES:
        for code, entry in json.loads(rules_file(package).read_text(encoding="utf-8")).items():
            assert code not in out, f"{code} is defined in {out.get(code, {}).get('package')} and {package}"
            out[code] = dict(entry, package=package)
    return out


DATA = _data()


def _placeholders(template: str) -> set[str]:
    return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}


def _src_strings() -> dict[str, set[str]]:
    """Every string constant in src/ (not docstrings' parts: whole constants), by file."""
    out = {}
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        out[str(path.relative_to(SRC))] = {n.value for n in ast.walk(tree)
                                           if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return out


STRINGS = _src_strings()
ALL_STRINGS = set().union(*STRINGS.values())


def test_every_rule_file_is_what_the_registry_holds():
    assert set(DATA) == set(all_rules()) == set(RULES)
    assert len(DATA) >= 92


@pytest.mark.parametrize("code", sorted(DATA))
def test_every_rule_has_the_same_anatomy(code):
    entry = DATA[code]
    assert CODE.fullmatch(code) and NAME.fullmatch(entry["name"]), code
    assert entry["severity"] in SEVERITIES
    assert list(entry) == ["name", "severity", "message", "fix", *(["phrases"] if "phrases" in entry else []),
                           "explanation", "package"], "one order of parts, for the reader"
    templates = [("message", entry["message"]), ("fix", entry["fix"])]
    templates += [(f"phrase {k}", v) for k, v in entry.get("phrases", {}).items()]
    for part, texts in templates:
        assert tuple(texts) == LANGS, (code, part)
        assert "\n" not in texts["en"] + texts["zh"], (code, part)
        assert _placeholders(texts["en"]) == _placeholders(texts["zh"]), (code, part)
        if not part.startswith("phrase") or texts["en"] + texts["zh"]:  # a phrase may be empty in both languages
            assert texts["en"].strip() and texts["zh"].strip(), (code, part)
    for lang in LANGS:
        sections = entry["explanation"][lang]
        assert tuple(sections) == SECTIONS, (code, lang)
        for key in SECTIONS:
            lines = sections[key]
            assert isinstance(lines, list) and all(isinstance(x, str) for x in lines), (code, lang, key)
            assert "".join(lines).strip() and lines[0].strip() and lines[-1].strip(), (code, lang, key)


@pytest.mark.parametrize("lang", LANGS)
def test_explain_renders_every_rule_under_the_shared_headings(lang):
    heads = json.loads(MESSAGES.read_text(encoding="utf-8"))["findings.SECTION_HEADINGS"]
    for code in DATA:
        text = explain(code, lang)
        positions = [text.index("\n" + heads[k][lang] + "\n") for k in SECTIONS]
        assert positions == sorted(positions), (code, lang)


def test_every_rule_is_reported_somewhere_and_every_reported_code_is_a_rule():
    """No rule without a detector (the old unused rule constants), no detector with a typo'd code."""
    reported = {s for s in ALL_STRINGS if CODE.fullmatch(s)}
    assert set(DATA) - reported == set(), "rules nothing reports"
    assert reported - set(DATA) == set(), "codes reported that no rules.json defines"


def test_every_phrase_is_used_by_its_detectors():
    unused = {(code, key) for code, entry in DATA.items() for key in entry.get("phrases", {})
              if key not in ALL_STRINGS}
    assert unused == set()


def test_rules_register_one_way():
    """Only findings.py turns data into rules; no module keeps rule constants or text of its own."""
    callers = [f for f, text in ((str(p.relative_to(SRC)), p.read_text(encoding="utf-8")) for p in SRC.rglob("*.py"))
               if re.search(r"\badd_rule\(", text)]
    assert callers == ["findings.py"]


def test_ui_text_is_data_with_both_languages():
    tables = json.loads(MESSAGES.read_text(encoding="utf-8"))
    for table, entries in tables.items():
        assert entries, table
        for key, texts in entries.items():
            assert tuple(texts) == LANGS, (table, key)
            en, zh = texts["en"], texts["zh"]
            assert type(en) is type(zh) and isinstance(en, (str, list)), (table, key)
            pairs = list(zip(en, zh)) if isinstance(en, list) else [(en, zh)]
            assert not isinstance(en, list) or len(en) == len(zh), (table, key)
            for a, b in pairs:
                assert a.strip() or not b.strip(), (table, key)  # an empty English text only beside an empty one
                assert _placeholders(a) == _placeholders(b), (table, key)
        assert f'"{table}"' in "".join(p.read_text(encoding="utf-8") for p in SRC.rglob("*.py")), \
            f"table {table} is read by no module"


def test_no_module_writes_chinese_text_in_code():
    """UI text in both languages lives in data (messages.json, rules.json): no Chinese in src/*.py."""
    cjk = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")
    found = {f: sorted(s for s in strings if cjk.search(s))[:3] for f, strings in STRINGS.items()
             if any(cjk.search(s) for s in strings)}
    assert found == {}


@pytest.mark.process
def test_readme_finding_tables_match_the_rule_registry():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_codes.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
