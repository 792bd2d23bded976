from __future__ import annotations

import sys

from dsdoctor.cli.common import add_command, lang_of
from dsdoctor.findings import all_rules, explain
from dsdoctor.i18n import LANGS


def register(sub):
    p = add_command(
        sub, "explain", "print the long explanation of a finding code",
        "  dsdoctor explain DSD101\n  dsdoctor explain DSD101 --lang zh\n  dsdoctor explain --list",
    )
    p.add_argument("code", nargs="?", help="finding code (e.g. DSD101) or rule name")
    p.add_argument("--list", action="store_true", help="list every finding code")
    p.add_argument("--lang", choices=LANGS, default=None, help="language (default: from the locale)")
    p.set_defaults(func=run)


def run(args) -> int:
    lang = lang_of(args)
    if args.list or not args.code:
        for r in all_rules().values():
            sys.stdout.write(f"{r.code}  {r.severity:<7}  {r.name}\n")
        return 0
    sys.stdout.write(explain(args.code, lang))
    return 0
