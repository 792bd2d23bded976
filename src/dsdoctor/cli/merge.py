from __future__ import annotations

from dsdoctor.cli.common import add_command, add_dtype_flag, add_output_flags, add_quiet_flag, emit, log
from dsdoctor.findings import exit_code

EXAMPLES = """\
  dsdoctor merge out/checkpoint-500 merged/ --model meta-llama/Llama-3-8B-local
  dsdoctor merge ckpt/ merged/ --tag global_step2000 --dtype bf16 --max-shard-size 2GB
  dsdoctor merge ckpt/ merged/ --force --format json     # replace merged/, machine-readable summary
  dsdoctor merge lora-run/checkpoint-500 adapter/        # PEFT LoRA: adapter_model.safetensors + adapter_config.json
  dsdoctor merge lora-run/checkpoint-500 full/ --merge-lora --model ./base-model   # base weights, LoRA folded in
  dsdoctor merge ckpt/ merged/ --tag global_step500_universal   # a universal checkpoint (ds_to_universal output)
then: dsdoctor verify merged/ --model merged/"""


def register(sub):
    p = add_command(
        sub, "merge", "turn DeepSpeed ZeRO-1/2/3 checkpoint shards into safetensors that from_pretrained loads",
        EXAMPLES,
        description=("Rebuild every parameter (trainable and frozen), buffer and tied weight of a DeepSpeed ZeRO "
                     "checkpoint (also tensor-parallel AutoTP + ZeRO, and universal checkpoints) and write safetensors "
                     "shards + model.safetensors.index.json. A PEFT LoRA checkpoint becomes a PEFT adapter, or with "
                     "--merge-lora the base model's weights with the LoRA update folded in. Streams with bounded "
                     "memory, never runs code from the checkpoint, and writes atomically."),
    )
    p.add_argument("ckpt_dir", help="checkpoint directory (holding `latest` and the tag directories), or a tag directory")
    p.add_argument("out_dir", help="output directory (created; refused if it exists unless --force)")
    p.add_argument("--tag", help="checkpoint tag to merge (default: the one named in `latest`)")
    add_dtype_flag(p, "dtype of floating tensors written", "fp32", "fp32, DeepSpeed's master weights")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default: 5GB)")
    p.add_argument("--model", help="directory with config.json and tokenizer files to copy (default: the checkpoint "
                                   "directory or its parent)")
    p.add_argument("--merge-lora", action="store_true",
                   help="LoRA checkpoint: write the base model's weights with W + scaling*B@A folded in (default: a "
                        "PEFT adapter, adapter_model.safetensors + adapter_config.json)")
    p.add_argument("--adapter-config", metavar="FILE",
                   help="the run's adapter_config.json (default: found in the tag, checkpoint or parent directory)")
    p.add_argument("--expert-layout", choices=("auto", "per-expert", "fused"), default="auto",
                   help="mixture-of-experts weights: per-expert (experts.N.gate_proj..., transformers 4 and 5 load it; "
                        "5 fuses on load) or fused (experts.gate_up_proj, 5 only); auto: per-expert where transformers "
                        "converts the model type, else as saved")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    add_quiet_flag(p, "no progress bar")
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.checkpoint.merge import merge

    if not args.quiet:
        log(f"dsdoctor: merging {args.ckpt_dir} -> {args.out_dir}")
    result = merge(args.ckpt_dir, args.out_dir, tag=args.tag, dtype=args.dtype, max_shard_size=args.max_shard_size,
                   model=args.model, force=args.force, progress=not args.quiet,
                   merge_lora=args.merge_lora, adapter_config=args.adapter_config, expert_layout=args.expert_layout)
    emit(result, args)
    return exit_code(result.findings, args.fail_on)
