"""``dsdoctor split CONFIG -o OUT``: one library call, rendered."""
from __future__ import annotations

from dsdoctor.cli.common import add_command, add_out_flag, add_output_flags, emit


def register(sub):
    p = add_command(
        sub, "split", "write the inference config of a training DeepSpeed config (with the reason for each change)",
        "  dsdoctor split ds_config.json -o ds_infer.json\n"
        "  dsdoctor split ds_config.json -o ds_infer.json --model ./Llama-3-8B   # resolve \"auto\" from the model\n"
        "  dsdoctor split ds_config.json -o ds_infer.json --keep-auto           # for HF Trainer users\n"
        "  dsdoctor split accelerate_zero3.yaml -o ds_infer.json --force",
    )
    p.add_argument("config", help="DeepSpeed config (JSON/HJSON), accelerate YAML or trainer YAML")
    add_out_flag(p, None, "where to write the inference config (a JSON file)", required=True, metavar="OUT")
    p.add_argument("--model", metavar="DIR", help="local model directory or config.json (resolves \"auto\" from it)")
    p.add_argument("--keep-auto", action="store_true", help="keep \"auto\" values (the HF Trainer fills them)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    add_output_flags(p, fail_on=False)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.config.split import split

    result = split(args.config, args.out, model=args.model, keep_auto=args.keep_auto, force=args.force)
    emit(result, args)
    return 0
