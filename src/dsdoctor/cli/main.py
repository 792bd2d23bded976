"""``dsdoctor`` entry point. Maps every error to one line and an exit code:
0 clean, 1 findings at or above --fail-on, 2 bad input or internal error."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from dsdoctor._version import __version__
from dsdoctor.errors import InputError, one_line

# subcommand modules, in --help order; each has register(subparsers)
COMMANDS = ("diagnose", "check", "split", "explain", "plan", "trace", "ab", "merge", "verify", "compare", "calibrate", "env")

EPILOG = """\
examples:
  dsdoctor diagnose                                   # the whole troubleshooting on the bundled example
  dsdoctor check ds_config.json --model ./Llama-3-8B  # what a config really does at inference
  dsdoctor split ds_config.json -o ds_infer.json      # write the inference config
  dsdoctor explain DSD101                             # the long explanation of a finding
exit codes: 0 clean, 1 findings at or above --fail-on, 2 bad input or internal error
"""


def build_parser() -> argparse.ArgumentParser:
    from dsdoctor.cli.common import Parser

    parser = Parser(
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


class StdoutError(InputError):
    """The result could not be written: stdout is closed, or the disk behind it is full."""


def _silence_fd1() -> None:
    """Point fd 1 at /dev/null: Python flushes stdout again at exit, and that flush must not fail twice."""
    from dsdoctor import door

    door.devnull_onto(1)


class _GuardedStdout:
    """``sys.stdout`` during a command: a write that fails (closed stdout, ``> /dev/full``) becomes one
    ``StdoutError`` line and exit 2 instead of a traceback; a closed pipe (``| head``) stays a quiet exit."""

    def __init__(self, real):
        self._real = real

    def _fail(self, exc: OSError | None):
        if isinstance(exc, BrokenPipeError):
            _silence_fd1()
            raise exc
        if exc is not None:
            _silence_fd1()
        why = "stdout is closed" if exc is None else (exc.strerror or str(exc))
        raise StdoutError(f"cannot write the result: {why}", path="<stdout>",
                          hint="redirect the output to a file with room, or use -o where the command has it")

    def write(self, text):
        if self._real is None:
            self._fail(None)
        try:
            return self._real.write(text)
        except OSError as exc:
            self._fail(exc)
        except ValueError:  # "I/O operation on closed file"
            self._fail(None)

    def flush(self):
        if self._real is None:
            return
        try:
            self._real.flush()
        except OSError as exc:
            self._fail(exc)
        except ValueError:
            pass

    def __getattr__(self, name):
        if self._real is None:
            if name == "encoding":
                return "utf-8"
            if name == "isatty":
                return lambda: False
            raise AttributeError(name)
        return getattr(self._real, name)


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
    real_stdout = sys.stdout
    sys.stdout = _GuardedStdout(real_stdout)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except InputError as exc:
        print(f"dsdoctor: error: {exc.one_line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP/SIGQUIT while writing (dsdoctor.door)
        print(f"dsdoctor: {exc or 'interrupted'}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except Exception as exc:  # internal error: one line unless asked for the traceback
        if os.environ.get("DSDOCTOR_DEBUG"):
            raise
        print(
            one_line(f"dsdoctor: internal error: {type(exc).__name__}: {exc} "
                     "(rerun with DSDOCTOR_DEBUG=1 for the traceback and report it)"),
            file=sys.stderr,
        )
        return 2
    finally:
        sys.stdout = real_stdout
