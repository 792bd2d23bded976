from __future__ import annotations

from dsdoctor.cli.common import add_command, add_output_flags, emit
from dsdoctor.findings import exit_code

EXAMPLES = """\
  dsdoctor verify merged/ --model merged/                       # keys, shapes, ties, empty and NaN tensors
  dsdoctor verify merged/ --model ./Llama-3-8B --reference ./zero_to_fp32_out
  dsdoctor verify saved_by_trainer/ --model saved_by_trainer/ --format json"""


def register(sub):
    p = add_command(
        sub, "verify", "check merged weights strictly against the model their config describes",
        EXAMPLES,
        description=("Build the model from config.json on the meta device and compare: missing and unexpected keys, "
                     "shapes, dtypes, tied weights, empty tensors (ZeRO-3 saved without gathering), NaN/Inf. With "
                     "--reference, compare every tensor and the logits of one CPU forward pass."),
    )
    p.add_argument("out_dir", help="weights directory (safetensors shards + index, or pytorch_model.bin)")
    p.add_argument("--model", required=True, help="model directory holding config.json")
    p.add_argument("--reference", help="other weights of the same model to compare with (tensors and logits)")
    p.add_argument("--no-logits", action="store_true", help="with --reference, compare tensors only")
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.checkpoint.verify import verify

    result = verify(args.out_dir, args.model, reference=args.reference, logits=not args.no_logits)
    emit(result, args)
    return exit_code(result.findings, args.fail_on)
