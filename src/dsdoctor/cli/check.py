"""``dsdoctor check CONFIG``: one library call, rendered."""
from __future__ import annotations

from dsdoctor.cli.common import add_command, add_gpus_flag, add_output_flags, emit
from dsdoctor.findings import exit_code


def register(sub):
    p = add_command(
        sub, "check", "show what a DeepSpeed config really does at inference, and what is wrong with it",
        "  dsdoctor check ds_config.json\n"
        "  dsdoctor check ds_config.json --model ./Llama-3-8B --gpus 2\n"
        "  dsdoctor check accelerate_zero3.yaml --format json\n"
        "  dsdoctor check ds_config.json --mode training --fail-on warning",
    )
    p.add_argument("config", help="DeepSpeed config (JSON/HJSON), accelerate YAML or trainer YAML")
    p.add_argument("--mode", choices=("inference", "training"), default="inference",
                   help="what the config is used for (default: inference)")
    p.add_argument("--model", metavar="DIR", help="local model directory or config.json (sizes findings in bytes)")
    add_gpus_flag(p, "the accelerate YAML's num_processes, else unknown", " that the config runs on")
    p.add_argument("--tp", type=int, metavar="N", help="tensor-parallel degree used with it")
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.config.check import check

    result = check(args.config, mode=args.mode, model=args.model, gpus=args.gpus, tp=args.tp)
    emit(result, args)
    return exit_code(result.findings, args.fail_on)
