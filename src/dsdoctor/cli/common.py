"""Flags shared by several commands, and the one way results are written."""
from __future__ import annotations

import argparse
import sys

from dsdoctor.errors import one_line, printable_block
from dsdoctor.i18n import LANGS, default_lang
from dsdoctor.report.render import FORMATS, render


def add_command(sub, name: str, help: str, examples: str, description: str | None = None):
    return sub.add_parser(
        name,
        help=help,
        description=description or help,
        epilog="examples:\n" + examples.rstrip() + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_output_flags(p, fail_on: bool = True, formats=FORMATS):
    p.add_argument("--format", choices=formats, default="text", help="output format (default: text)")
    p.add_argument("--lang", choices=LANGS, default=None, help="language of messages (default: from the locale)")
    if fail_on:
        p.add_argument(
            "--fail-on", choices=("error", "warning", "info"), default="error",
            help="exit 1 when a finding is at or above this severity (default: error)",
        )


def lang_of(args) -> str:
    return getattr(args, "lang", None) or default_lang()


def emit(result, args) -> None:
    text = render(result, args.format, lang_of(args), sys.stdout)
    if args.format != "json":  # JSON escapes control characters itself
        text = printable_block(text)
    sys.stdout.write(text)
    sys.stdout.flush()


def log(msg: str) -> None:
    print(one_line(msg), file=sys.stderr, flush=True)
