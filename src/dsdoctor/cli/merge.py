from __future__ import annotations

from dsdoctor.cli.common import add_command, add_dtype_flag, add_output_flags, add_quiet_flag, emit, log
from dsdoctor.findings import exit_code

EXAMPLES = """\
  dsdoctor merge out/checkpoint-500 merged/ --model meta-llama/Llama-3-8B-local
  dsdoctor merge ckpt/ merged/ --tag global_step2000 --dtype bf16 --max-shard-size 2GB
  dsdoctor merge ckpt/ merged/ --force --format json     # replace merged/, machine-readable summary
then: dsdoctor verify merged/ --model merged/"""


def register(sub):
    p = add_command(
        sub, "merge", "turn DeepSpeed ZeRO-1/2/3 checkpoint shards into safetensors that from_pretrained loads",
        EXAMPLES,
        description=("Rebuild every parameter (trainable and frozen), buffer and tied weight of a DeepSpeed ZeRO "
                     "checkpoint and write safetensors shards + model.safetensors.index.json. Streams with bounded "
                     "memory, never runs code from the checkpoint, and writes atomically."),
    )
    p.add_argument("ckpt_dir", help="checkpoint directory (holding `latest` and the tag directories), or a tag directory")
    p.add_argument("out_dir", help="output directory (created; refused if it exists unless --force)")
    p.add_argument("--tag", help="checkpoint tag to merge (default: the one named in `latest`)")
    add_dtype_flag(p, "dtype of floating tensors written", "fp32", "fp32, DeepSpeed's master weights")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default: 5GB)")
    p.add_argument("--model", help="directory with config.json and tokenizer files to copy (default: the checkpoint "
                                   "directory or its parent)")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    add_quiet_flag(p, "no progress bar")
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.checkpoint.merge import merge

    if not args.quiet:
        log(f"dsdoctor: merging {args.ckpt_dir} -> {args.out_dir}")
    result = merge(args.ckpt_dir, args.out_dir, tag=args.tag, dtype=args.dtype, max_shard_size=args.max_shard_size,
                   model=args.model, force=args.force, progress=not args.quiet)
    emit(result, args)
    return exit_code(result.findings, args.fail_on)
