"""``dsdoctor ab -- COMMAND``: run the command once per config variant and read the difference."""
from __future__ import annotations

import sys

from dsdoctor.cli.common import add_command, emit, lang_of
from dsdoctor.cli.trace import add_run_flags
from dsdoctor.findings import exit_code

EXAMPLES = """\
  dsdoctor ab -- deepspeed --num_gpus 2 infer.py
  dsdoctor ab --variants as-is,no-offload-param,pin-memory-off --timeout 900 -- python infer.py
  dsdoctor ab --variants as-is,prefetch=1e7,prefetch=1e8 --format json -- torchrun --nproc_per_node 2 infer.py
  dsdoctor ab --variants as-is,gather-once -- deepspeed --num_gpus 2 ppo_train.py   # rollouts inside training"""


def register(sub):
    from dsdoctor.trace.variants import DEFAULT_VARIANTS, KNOWN

    p = add_command(
        sub, "ab", "run your command once per DeepSpeed config variant and diagnose the difference", EXAMPLES,
        description="Run COMMAND once per variant, with the DeepSpeed config rewritten in-process where it reaches "
                    "deepspeed.initialize / HfDeepSpeedConfig (your files are untouched). An OOM or a hang in a "
                    "variant is a result, not a crash. When the config never reaches those calls (init_inference, "
                    "no DeepSpeed), ab says the variants cannot be applied (DSD320, exit 1) and stops after as-is.",
    )
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, from: {', '.join(KNOWN)} (default: {','.join(DEFAULT_VARIANTS)}; when "
                        "the as-is run trains between generates, the rest becomes gather-once)")
    add_run_flags(p, "dsdoctor-ab")
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.trace.api import ab

    result = ab(args.command, variants=args.variants, out=args.out, timeout=args.timeout, force=args.force,
                echo=False if args.quiet else sys.stderr, lang=lang_of(args))
    emit(result, args)
    return exit_code(result.findings, args.fail_on)
