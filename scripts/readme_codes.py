"""Regenerate the finding-code tables in README.md and README_zh.md from the rule registry.

    python scripts/readme_codes.py          # rewrite the tables between the markers
    python scripts/readme_codes.py --check  # exit 1 if a README is out of date (run by the tests)
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from dsdoctor.findings import all_rules
from dsdoctor.i18n import pick
from dsdoctor.report.render import markdown_table

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- codes:begin -->", "<!-- codes:end -->"
FILES = {"README.md": "en", "README_zh.md": "zh"}


def first_sentence(sections: tuple[str, ...]) -> str:
    """The first sentence of the explanation's first section ("What it does")."""
    for body in sections:
        para = " ".join(body.split("\n\n")[0].split())
        if para:
            return re.split(r"(?<=[.。])\s*(?=[A-Z\u4e00-\u9fff`(])", para, maxsplit=1)[0]
    return ""


def table(lang: str) -> str:
    head = ("Code", "Name", "Severity", "What it means") if lang == "en" else ("代码", "名称", "级别", "含义")
    rows = [(r.code, r.name, r.severity, first_sentence(pick(r.explanation, lang))) for r in all_rules().values()]
    return markdown_table(head, rows)


def updated(text: str, lang: str) -> str:
    block = f"{BEGIN}\n{table(lang)}{END}"
    return re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)


def main(argv: list[str]) -> int:
    stale = []
    for name, lang in FILES.items():
        path = ROOT / name
        text = path.read_text(encoding="utf-8")
        new = updated(text, lang)
        if new != text:
            stale.append(name)
            if "--check" not in argv:
                path.write_text(new, encoding="utf-8")
    if stale and "--check" in argv:
        print("out of date: " + ", ".join(stale) + " (run python scripts/readme_codes.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
