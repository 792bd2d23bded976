"""``dsdoctor check CONFIG``: one library call, rendered."""
from __future__ import annotations

from dsdoctor.cli.common import add_command, add_gpus_flag, add_output_flags, bounded, emit
from dsdoctor.findings import exit_code
from dsdoctor.units import MAX_GPUS


def register(sub):
    p = add_command(
        sub, "check", "show what a DeepSpeed config really does at inference, and what is wrong with it",
        "  dsdoctor check ds_config.json\n"
        "  dsdoctor check ds_config.json --model ./Llama-3-8B --gpus 2\n"
        "  dsdoctor check accelerate_zero3.yaml --format json\n"
        "  dsdoctor check ds_config.json --mode train --fail-on warning\n"
        "  dsdoctor check llamafactory_predict.yaml --model ./Meta-Llama-3-8B   (runner and mode read from the YAML)\n"
        "  dsdoctor check swift_cmd.sh            (a launch command: swift sft --deepspeed zero3 ...)\n"
        "  dsdoctor check init_inference.json --gpu-name V100\n"
        "  dsdoctor check ds_z3_config.json --runner llamafactory --mode predict-with-generate\n"
        "  dsdoctor check ds_config.json --deepspeed-version 0.15.0 --transformers-version 4.44.2",
    )
    p.add_argument("config", help="DeepSpeed config (JSON/HJSON), init_inference config, accelerate YAML, trainer "
                                  "YAML/TrainingArguments JSON (LLaMA-Factory, axolotl, ms-swift) or a launch command")
    p.add_argument("--mode", choices=("train", "eval", "predict", "predict-with-generate", "inference", "training"),
                   default=None, help="what the config is used for (default: read from the trainer's arguments "
                                      "(do_train, do_predict, predict_with_generate, swift sft/infer); inference for a "
                                      "bare DeepSpeed config)")
    p.add_argument("--model", metavar="DIR", help="local model directory or config.json (sizes findings in bytes)")
    add_gpus_flag(p, "the accelerate YAML's num_processes, else unknown", " that the config runs on")
    p.add_argument("--tp", type=bounded(1, MAX_GPUS), metavar="N", help="tensor-parallel degree used with it")
    p.add_argument("--runner", choices=("deepspeed", "init_inference", "hf-trainer", "llamafactory", "axolotl",
                                        "ms-swift", "accelerate"), default=None,
                   help="what runs a bare DeepSpeed JSON (default: read from the file; a DeepSpeed JSON alone is "
                        "raw deepspeed.initialize)")
    p.add_argument("--gpu-name", metavar="NAME", help="GPU the config runs on (e.g. A100, V100): bf16 or fp16 in "
                                                       "suggested configs (default: this machine's, else bf16)")
    for pkg in ("deepspeed", "transformers", "accelerate"):
        p.add_argument(f"--{pkg}-version", metavar="X.Y.Z",
                       help=f"check against this {pkg} version instead of the installed one (for another machine)")
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.config.check import check

    versions = {pkg: getattr(args, f"{pkg}_version") for pkg in ("deepspeed", "transformers", "accelerate")
                if getattr(args, f"{pkg}_version")}
    result = check(args.config, mode=args.mode, model=args.model, gpus=args.gpus, tp=args.tp,
                   versions=versions or None, gpu_name=args.gpu_name, runner=args.runner)
    emit(result, args)
    return exit_code(result.findings, args.fail_on)
