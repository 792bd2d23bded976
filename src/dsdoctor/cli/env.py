from __future__ import annotations

from dsdoctor.cli.common import add_command, emit


def register(sub):
    p = add_command(
        sub, "env", "print versions and hardware for a bug report",
        "  dsdoctor env\n  dsdoctor env --format markdown   # paste into a GitHub issue\n  dsdoctor env --format json --no-ops",
    )
    p.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    p.add_argument("--no-ops", action="store_true", help="skip asking DeepSpeed which ops can build (faster)")
    p.set_defaults(func=run, lang=None)


def run(args) -> int:
    from dsdoctor.envinfo import env

    emit(env(check_ops=not args.no_ops), args)
    return 0
