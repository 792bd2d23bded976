"""``dsdoctor trace -- COMMAND``: run the user's own command and report what DeepSpeed really did."""
from __future__ import annotations

import argparse
import sys

from dsdoctor.cli.common import SECONDS, add_command, add_out_flag, add_output_flags, add_quiet_flag, emit, lang_of
from dsdoctor.findings import exit_code

EXAMPLES = """\
  dsdoctor trace -- python infer.py --model ./Llama-3-8B
  dsdoctor trace --out trace-out --timeout 900 -- deepspeed --num_gpus 2 infer.py
  dsdoctor trace --format json -q -- torchrun --nproc_per_node 2 infer.py > trace.json
  dsdoctor trace --timeout 600 -- deepspeed --hostfile hosts infer.py   # --out on a shared filesystem
  dsdoctor trace -o /shared/t -- torchrun --nnodes 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint head:29400 train.py
  dsdoctor trace --report-only /shared/t   # the whole report again from every node's part"""


def add_run_flags(p, default_out: str) -> None:
    add_out_flag(p, default_out, "output directory")
    p.add_argument("--force", action="store_true", help="replace the output directory if it exists")
    p.add_argument("--timeout", type=SECONDS, default=None, metavar="SECONDS",
                   help="watchdog: end every process of the run after SECONDS and report where each rank was")
    add_quiet_flag(p, "the command's output is not echoed (it is kept in output.log)")
    add_output_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")


def register(sub):
    p = add_command(
        sub, "trace", "run your inference command and record what DeepSpeed really did, rank by rank", EXAMPLES,
        description="Run COMMAND unchanged with an observer in every rank: the ZeRO stage, offloads, optimizer, "
                    "dtype and tensor parallelism that took effect, memory and time per phase (load, init, each "
                    "generate), and findings. Writes DIR/report.json, report.md and a memory timeline per rank.",
    )
    add_run_flags(p, "dsdoctor-trace")
    p.add_argument("--report-only", metavar="DIR", default=None,
                   help="run nothing: rebuild the report of a multi-node trace from DIR/node-*/ (each node's agent "
                        "ran dsdoctor trace -o DIR -- torchrun --nnodes N --node-rank K ...); --force replaces "
                        "the report files an earlier run wrote there")
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.trace.api import report_only, trace

    if args.report_only:
        if [c for c in args.command if c != "--"]:
            from dsdoctor.errors import InputError

            raise InputError("--report-only runs nothing: give DIR and no command")
        result = report_only(args.report_only, lang=lang_of(args), force=args.force)
        emit(result, args)
        return exit_code(result.findings, args.fail_on)
    result = trace(args.command, out=args.out, timeout=args.timeout, force=args.force,
                   echo=False if args.quiet else sys.stderr, lang=lang_of(args))
    emit(result, args)
    return exit_code(result.findings, args.fail_on)
