"""``dsdoctor`` entry point. Maps every error to one line and an exit code:
0 clean, 1 findings at or above --fail-on, 2 bad input or internal error."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from dsdoctor._version import __version__
from dsdoctor.errors import InputError

# subcommand modules, in --help order; each has register(subparsers)
COMMANDS = ("diagnose", "check", "split", "explain", "plan", "trace", "ab", "merge", "verify", "compare", "env")

EPILOG = """\
examples:
  dsdoctor diagnose                                   # the whole troubleshooting on the bundled example
  dsdoctor check ds_config.json --model ./Llama-3-8B  # what a config really does at inference
  dsdoctor split ds_config.json -o ds_infer.json      # write the inference config
  dsdoctor explain DSD101                             # the long explanation of a finding
exit codes: 0 clean, 1 findings at or above --fail-on, 2 bad input or internal error
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsdoctor",
        description="Find, explain and fix why LLM inference with DeepSpeed runs out of GPU memory or crawls.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dsdoctor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"dsdoctor.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors exit 2, --help exits 0
        return int(exc.code or 0)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except InputError as exc:
        print(f"dsdoctor: error: {exc.one_line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP/SIGQUIT while writing (dsdoctor.fsutil)
        print(f"dsdoctor: {exc or 'interrupted'}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except Exception as exc:  # internal error: one line unless asked for the traceback
        if os.environ.get("DSDOCTOR_DEBUG"):
            raise
        print(
            f"dsdoctor: internal error: {type(exc).__name__}: {exc} "
            "(rerun with DSDOCTOR_DEBUG=1 for the traceback and report it)",
            file=sys.stderr,
        )
        return 2
