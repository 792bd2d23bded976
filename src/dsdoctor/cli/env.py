from __future__ import annotations

from dsdoctor.cli.common import add_command, emit


def register(sub):
    p = add_command(
        sub, "env", "print versions and hardware for a bug report",
        "  dsdoctor env\n  dsdoctor env --format markdown   # paste into a GitHub issue\n  dsdoctor env --format json --no-ops\n"
        "  dsdoctor env --calibrate   # also measure this machine for plan (about a minute)",
    )
    p.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    p.add_argument("--no-ops", action="store_true", help="skip asking DeepSpeed which ops can build (faster)")
    p.add_argument("--calibrate", action="store_true", help="also measure this machine (see dsdoctor calibrate)")
    from dsdoctor.cli.calibrate import add_flags

    add_flags(p)
    p.set_defaults(func=run, lang=None)


def run(args) -> int:
    from dsdoctor.envinfo import env

    emit(env(check_ops=not args.no_ops), args)
    if args.calibrate:
        from dsdoctor.calibrate.api import calibrate

        emit(calibrate(out=args.out, nvme_path=args.nvme_path, budget_s=args.budget_s, cache=not args.no_cache,
                       force=args.force), args)
    return 0
