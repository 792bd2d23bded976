"""Every ``--flag`` a user-facing text names is one the command it names accepts (issue 31.3).

The texts: every value of ``messages.json`` and every rule's message, fix, phrases and explanation, in both
languages. A flag belongs to the nearest command named before it in the same clause (a clause ends at a
backtick, ``)``, ``;`` or the end of a sentence): ``dsdoctor plan --loop`` is plan's, ``deepspeed --num_gpus 2`` is
the launcher's. A flag with no command named (``pass --model``) must be accepted by every command that can show
the text: the commands that report the rule's package (``REPORTERS``) or render the message table
(``TABLE_READERS``). Explanations are shown by ``dsdoctor explain`` apart from any run: there only flags with a
dsdoctor command named are held. dsdoctor's flags use hyphens, so a bare flag with an underscore
(``--enable_hybrid_engine``) is another program's; the few other foreign flags are listed with their owners."""
from __future__ import annotations

import argparse
import json
import re
import sys

import pytest

from dsdoctor.cli.main import COMMANDS, build_parser
from dsdoctor.findings import RULE_PACKAGES, rules_file
from tests.helpers import ROOT

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9_]")
# a command that owns the flags after it: dsdoctor's subcommands, and the other programs texts name
COMMAND = re.compile(r"\bdsdoctor (?P<dsdoctor>[a-z]+)\b|(?<![\w./-])(?P<other>deepspeed|torchrun|python3?|nvidia-smi|"
                     r"vllm|accelerate|main\.py|infer\.py|sglang)\s")
CLAUSE_END = re.compile(r"`|\)|;|。|；|\. |\n")
# which commands show the findings of each rules package
REPORTERS = {"config": ("check", "split", "diagnose", "trace", "ab"), "plan": ("plan", "diagnose"),
             "trace": ("trace", "ab", "diagnose"), "checkpoint": ("merge", "verify", "diagnose"),
             "compare": ("compare",)}
# which commands render each messages.json table (a table not listed: every command)
TABLE_READERS = {
    "calibrate.": ("calibrate", "env"), "checkpoint.merge.": ("merge", "diagnose"),
    "checkpoint.verify.": ("verify", "diagnose"), "compare.": ("compare",), "config.check.": ("check", "diagnose"),
    "config.split": ("split", "diagnose"), "config.schema.REASONS": ("split", "diagnose"), "diagnose.": ("diagnose",),
    "plan.": ("plan", "diagnose"),
    "trace.": ("trace", "ab", "diagnose"),
}
# a label shown only when that very flag was given to that command
ONLY_WITH_ITS_FLAG = {"plan.result.TEXT.source --transformers-version": ("plan",)}
# other programs' flags named without their program
FOREIGN = {"--deepspeed": "the HF Trainer's and training scripts' argument naming the DeepSpeed config"}


def _accepted() -> dict[str, set[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {k for k in p._option_string_actions if k.startswith("--")} for name, p in sub.choices.items()}


ACCEPTED = _accepted()


def _texts():
    """(where, text, commands that show it, whether bare flags count) for every text in both languages."""
    def walk(value, where):
        if isinstance(value, str):
            yield where, value
        elif isinstance(value, dict):
            for k, v in value.items():
                yield from walk(v, f"{where}.{k}")
        elif isinstance(value, list):
            for v in value:
                yield from walk(v, where)

    messages = json.loads((ROOT / "src" / "dsdoctor" / "messages.json").read_text(encoding="utf-8"))
    for table, entries in messages.items():
        readers = next((r for prefix, r in TABLE_READERS.items() if table.startswith(prefix)), tuple(COMMANDS))
        for key, entry in entries.items():
            where = f"{table}.{key}"
            for path, text in walk(entry, where):
                yield path, text, ONLY_WITH_ITS_FLAG.get(where, readers), True
    for package in RULE_PACKAGES:
        for code, rule in json.loads(rules_file(package).read_text(encoding="utf-8")).items():
            for part in ("message", "fix", "phrases", "explanation"):
                for path, text in walk(rule.get(part, {}), f"{package}.{code}.{part}"):
                    yield path, text, REPORTERS[package], part != "explanation"


def _owner(text: str, at: int) -> tuple[str, str] | None:
    """("dsdoctor", command) or ("other", program) named before ``at`` in the same clause, else None."""
    start = max((m.end() for m in CLAUSE_END.finditer(text, 0, at)), default=0)
    found = None
    for m in COMMAND.finditer(text, start, at):
        if m.group("dsdoctor") in COMMANDS:
            found = ("dsdoctor", m.group("dsdoctor"))
        elif m.group("other"):
            found = ("other", m.group("other"))
    return found


def problems() -> list[str]:
    out = []
    for where, text, readers, bare_counts in _texts():
        for m in FLAG.finditer(text):
            flag, owner = m.group(), _owner(text, m.start())
            if owner is not None and owner[0] == "other":
                continue
            if owner is not None:
                if flag not in ACCEPTED[owner[1]]:
                    out.append(f"{where}: dsdoctor {owner[1]} has no {flag}: {text[:120]!r}")
                continue
            if not bare_counts or "_" in flag or flag in FOREIGN:
                continue
            missing = [c for c in readers if flag not in ACCEPTED[c]]
            if missing:
                out.append(f"{where}: {flag} with no command named, and {', '.join(missing)} (which show it) do "
                           f"not take it: {text[:120]!r}")
    return out


def test_every_flag_a_text_names_is_accepted_by_its_command():
    assert problems() == []


def test_dsdoctor_flags_have_no_underscore():
    """The rule above that reads a bare ``--a_b`` as another program's flag holds only while this does."""
    assert not [(c, f) for c, flags in ACCEPTED.items() for f in flags if "_" in f]


@pytest.mark.parametrize("text, owner", [
    ("run dsdoctor plan --loop --job FILE", ("dsdoctor", "plan")),
    ("`dsdoctor ab -- deepspeed --num_gpus 2 infer.py`", ("other", "deepspeed")),
    ("pass --gpu-name", None),
    ("`dsdoctor plan --model m` then `--gpus`", None),
    ("(dsdoctor plan --loop); pass --machine", None),
])
def test_owner_reads_the_clause(text, owner):
    assert _owner(text, text.rindex("--")) == owner


def test_the_check_finds_a_flag_its_command_lacks(monkeypatch):
    """The check fails on the texts issue 31 measured: a --gpu-name named for every reporter of DSD122."""
    monkeypatch.setattr(sys.modules[__name__], "_texts", lambda: iter([
        ("config.DSD122.phrases.x.en", "bf16 assumed (pass --gpu-name)", REPORTERS["config"], True),
        ("plan.DSD205.fix.en", "dsdoctor diagnose --h2d-bandwidth 20GB/s", REPORTERS["plan"], True),
        ("trace.DSD306.explanation.en.what", "the watchdog (`--timeout`)", REPORTERS["trace"], False)]))
    found = problems()
    assert len(found) == 2
    assert "--gpu-name with no command named" in found[0] and "split" in found[0] and "check" not in found[0]
    assert "dsdoctor diagnose has no --h2d-bandwidth" in found[1]
