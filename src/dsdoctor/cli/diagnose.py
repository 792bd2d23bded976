"""``dsdoctor diagnose``: the whole troubleshooting as one command (the README's main job)."""
from __future__ import annotations

from dsdoctor.cli.common import (
    BATCH,
    SECONDS,
    TOKENS,
    add_command,
    add_dtype_flag,
    add_gpus_flag,
    add_out_flag,
    add_output_flags,
    emit,
    lang_of,
)

EXAMPLES = """\
  dsdoctor diagnose -- deepspeed --num_gpus 2 infer.py   # on what the run passes: its config, model and workload
  dsdoctor diagnose                                   # the bundled example: a ZeRO-3 offload training config, 7B model
  dsdoctor diagnose --config ds_z3_offload.json --model ./Llama-3.1-8B --gpus 1 --gpu-memory 80GiB
  dsdoctor diagnose --config ds.json --model ./m --checkpoint ./ckpt --out diag   # also merge + verify the shards
  dsdoctor diagnose --config ds.json --model ./m -- deepspeed --num_gpus 2 infer.py   # also trace (and A/B on a GPU)"""


def register(sub):
    p = add_command(
        sub, "diagnose", "run the whole troubleshooting and write one report", EXAMPLES,
        description="Walk the troubleshooting in order: what takes effect (check, trace), whether inference needs "
                    "ZeRO-3 (plan), the inference config (split), the A/B peak (ab), and the way out (merge + plain "
                    "load, tensor parallel xor ZeRO-3, or ZeRO-3 with offload_param) with the exact commands. With a "
                    "command after --, it runs on what that run passes to DeepSpeed (config, model, batch and "
                    "lengths) unless --config/--model/--batch... say otherwise. "
                    "Writes OUT/report.md, OUT/report.html, OUT/report.json and OUT/ds_inference.json.",
    )
    p.add_argument("--config", help="the DeepSpeed config your inference uses (default: the one your command "
                                    "passes to DeepSpeed; with no command, the bundled example)")
    p.add_argument("--model", help="local model directory or config.json (default: the model your command builds; "
                                   "with no command, the bundled 7B example)")
    add_gpus_flag(p, "the traced run's world size, else detected, else 1", " for inference")
    p.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GiB (default: detected, else 80GiB)")
    p.add_argument("--host-memory", default=None, help="host memory, e.g. 512GiB (default: this machine's)")
    p.add_argument("--batch", type=BATCH, default=None,
                   help="sequences each rank generates at once (default: the traced run's, else 1)")
    p.add_argument("--prompt-len", type=TOKENS, default=None, help="prompt tokens (default: the traced run's, else 512)")
    p.add_argument("--new-tokens", type=TOKENS, default=None,
                   help="generated tokens (default: the traced run's, else 128)")
    add_dtype_flag(p, "weight dtype", default_text="the traced run's, else the model's, else bf16")
    p.add_argument("--machine", default=None, metavar="PROFILE",
                   help="machine profile from dsdoctor calibrate --out (default: this machine's cached one)")
    p.add_argument("--checkpoint", default=None, help="a DeepSpeed ZeRO checkpoint directory to merge and verify")
    add_out_flag(p, "dsdoctor-out", "report directory")
    p.add_argument("--force", action="store_true", help="replace an existing report directory")
    p.add_argument("--timeout", type=SECONDS, default=None, help="watchdog for a traced command, seconds")
    p.add_argument("command", nargs="*", help="after --: your inference command, to trace (and A/B on a GPU)")
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.diagnose import diagnose, diagnose_exit_code

    result = diagnose(config=args.config, model=args.model, gpus=args.gpus, gpu_memory=args.gpu_memory,
                      host_memory=args.host_memory, batch=args.batch, prompt_len=args.prompt_len,
                      new_tokens=args.new_tokens, dtype=args.dtype, checkpoint=args.checkpoint,
                      command=args.command or None, out=args.out, force=args.force, timeout=args.timeout,
                      lang=lang_of(args), machine=args.machine)
    emit(result, args)
    return diagnose_exit_code(result, args.fail_on)
