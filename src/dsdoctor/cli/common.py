"""Flags shared by several commands, and the one way results are written.

Shared flags have one meaning in every command; only the default (and, for --out, whether it names a file or
a directory) differs, and each command's help says it:
  --gpus N     the number of GPUs the run uses, one rank each
  -q/--quiet   nothing on stderr but errors (progress, the command's echoed output); stdout is unchanged
  -o/--out     where the command writes what it produces
  --dtype      a weight/compute dtype: bf16, fp16 or fp32 (bfloat16, float16, half, float32 accepted)
"""
from __future__ import annotations

import argparse
import sys

from dsdoctor.errors import InputError, one_line, printable_block
from dsdoctor.i18n import LANGS, default_lang
from dsdoctor.report.render import FORMATS, render
from dsdoctor.units import MAX_BATCH, MAX_GPUS, MAX_SECONDS, MAX_TOKENS, number


def bounded(low: float, high: float, whole: bool = True):
    """An argparse type for a numeric flag: its text through the one bounded reader (``units.number``), so
    NaN, ``1e400`` and values past any machine end as one usage line naming the flag."""
    def parse(text: str):
        try:
            return number(text, "value", low=low, high=high, whole=whole)
        except InputError as exc:
            raise argparse.ArgumentTypeError(exc.problem) from None

    parse.bounds = (low, high)
    return parse


SECONDS, TOKENS, BATCH = bounded(0.001, MAX_SECONDS, whole=False), bounded(1, MAX_TOKENS), bounded(1, MAX_BATCH)


class Parser(argparse.ArgumentParser):
    """argparse with usage errors as one line (the command, the problem, where to look), exit 2."""

    def error(self, message):
        self.exit(2, one_line(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n")


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


def add_gpus_flag(p, default: str, use: str = "") -> None:
    p.add_argument("--gpus", type=bounded(1, MAX_GPUS), default=None, metavar="N",
                   help=f"number of GPUs, one rank each{use} (default: {default})")


def add_quiet_flag(p, silenced: str) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help=f"nothing on stderr but errors: {silenced}")


def add_out_flag(p, default: str | None, what: str, *, required: bool = False, metavar: str = "DIR") -> None:
    tail = "" if required else f" (default: {default or 'none'})"
    p.add_argument("-o", "--out", default=default, required=required, metavar=metavar, help=what + tail)


def dtype_name(text: str) -> str:
    from dsdoctor.dtypes import normalize_dtype

    name = normalize_dtype(text)
    if name is None:
        raise argparse.ArgumentTypeError(f"unsupported dtype {text!r} (use bf16, fp16 or fp32)")
    return name


def add_dtype_flag(p, what: str, default: str | None = None, default_text: str | None = None) -> None:
    p.add_argument("--dtype", type=dtype_name, default=default, metavar="{bf16,fp16,fp32}",
                   help=f"{what} (default: {default_text or default})")


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
