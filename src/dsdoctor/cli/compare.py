"""``dsdoctor compare``: do two load paths (or two weight directories) give the same tokens?"""
from __future__ import annotations

from dsdoctor.cli.common import (
    SECONDS,
    TOKENS,
    add_command,
    add_dtype_flag,
    add_gpus_flag,
    add_out_flag,
    add_output_flags,
    add_quiet_flag,
    emit,
    log,
)
from dsdoctor.findings import exit_code

EXAMPLES = """\
  dsdoctor compare ./Llama-3-8B                                  # plain vs ZeRO-3 (2 ranks)
  dsdoctor compare ./Llama-3-8B --paths plain,zero3,tp --gpus 2 --out cmp-report
  dsdoctor compare ./merged ./reference --paths plain            # merged weights vs a reference
  dsdoctor compare ./adapter ./merged --base ./base-model         # PEFT adapter on its base vs its --merge-lora merge
  dsdoctor compare ./model --prompts prompts.jsonl --max-new-tokens 32 --dtype fp32 --format json
  DS_ACCELERATOR=cpu dsdoctor compare ./tiny-model               # on a machine without GPUs
prompt file: one prompt per line, a JSON list of token ids ([1, 450, 4996]), {"ids": [...]}, {"text": "..."}
  or plain text (text needs a tokenizer in MODEL_DIR); default: 4 seeded token-id prompts
exit codes: 0 every prompt matches (near-ties explained), 1 a real mismatch, logits beyond tolerance (even with
  the same tokens) or a failed load path, 2 bad input"""


def register(sub):
    p = add_command(
        sub, "compare", "check that load paths (plain, ZeRO-3, offload, tensor parallel) give the same tokens",
        EXAMPLES,
        description="Greedy-generate the same prompts through each load path and compare each with the first: "
                    "first divergent position, top-2 logit margin there (near-tie or broken load) and the "
                    "largest logit difference over the shared prefix. With two model directories, the same "
                    "load path runs on both.",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="local model directory (config.json + *.safetensors)")
    p.add_argument("model_dir_b", metavar="MODEL_DIR_B", nargs="?", default=None,
                   help="second model directory, compared with MODEL_DIR through the same load path")
    p.add_argument("--base", metavar="DIR", default=None,
                   help="base model folder for a MODEL_DIR that is a PEFT adapter (adapter_config.json, no config.json)")
    p.add_argument("--paths", default=None,
                   help="comma-separated load paths, the first is the reference: plain, zero3, zero3-offload, tp "
                        "(default: plain,zero3; with MODEL_DIR_B: plain)")
    add_gpus_flag(p, "visible GPUs, else 2", " for zero3/zero3-offload/tp")
    p.add_argument("--prompts", default=None, metavar="FILE", help="prompt file (see below)")
    p.add_argument("--max-new-tokens", type=TOKENS, default=16, help="tokens to generate per prompt (default: 16)")
    add_dtype_flag(p, "compute dtype for every path", default_text="the checkpoint's, else fp32")
    add_out_flag(p, None, "write report.json, report.md and raw runs into DIR")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--timeout", type=SECONDS, default=None, metavar="S", help="give up on a load path after S seconds")
    add_quiet_flag(p, "no progress")
    p.add_argument("--oversubscribe", action="store_true",
                   help="on the CPU accelerator, allow more ranks than usable CPU cores (refused by default)")
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.compare.api import compare

    result = compare(
        args.model_dir, args.model_dir_b, paths=args.paths, gpus=args.gpus, prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, dtype=args.dtype, out=args.out, force=args.force,
        timeout=args.timeout, progress=None if args.quiet else log, oversubscribe=args.oversubscribe,
        base=args.base,
    )
    emit(result, args)
    return exit_code(result.findings, args.fail_on)
