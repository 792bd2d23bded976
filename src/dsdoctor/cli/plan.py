"""``dsdoctor plan``: which load path to use for an inference run, and what fits."""
from __future__ import annotations

from dsdoctor.cli.common import add_command, add_dtype_flag, add_gpus_flag, add_output_flags, emit, lang_of, log
from dsdoctor.findings import exit_code

EXAMPLES = """\
  dsdoctor plan --model ./Llama-3.1-8B --batch 8 --prompt-len 2048 --new-tokens 256
  dsdoctor plan --model ./Llama-3.1-70B --gpus 4 --gpu-memory 80GiB --format json
  dsdoctor plan --model ./qwen2/config.json --config ds_train.json --plot plan-out
  dsdoctor plan --model ./Llama-3.1-8B --lang zh --format markdown > plan.md
  dsdoctor plan --model ./Llama-3.1-8B --machine h200.json   # speeds from a profile dsdoctor calibrate wrote
  dsdoctor plan --model ./Llama-2-7b --gpus 2 --batch 4 --new-tokens 32 --loop   # RLHF/GRPO rollouts
  dsdoctor plan --model ./Qwen2-72B --gpus 8 --host-memory 1TiB --transformers-version 4.44.2"""


def register(sub):
    p = add_command(
        sub, "plan", "predict per-GPU and host memory and speed of each load path; recommend one", EXAMPLES,
        description="Predict the peak GPU memory (torch.cuda.max_memory_allocated over load and generate), host "
                    "memory and tokens/s of each load path (plain, tp, zero3, zero3-offload, zero3-offload-nvme; "
                    "estimates: device-map, vllm, sglang, quantized) for a model, workload and machine, and "
                    "recommend the fastest that fits.",
    )
    p.add_argument("--model", required=True, help="local Hugging Face model directory or its config.json")
    p.add_argument("--batch", type=int, default=1, help="sequences each rank generates at once (default: 1)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default: 512)")
    p.add_argument("--new-tokens", type=int, default=128, help="generated tokens (default: 128)")
    add_dtype_flag(p, "weight dtype", default_text="the model's, else bf16")
    add_gpus_flag(p, "detected, else 1")
    p.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GiB (default: detected, else 80GiB)")
    p.add_argument("--host-memory", default=None, help="host memory, e.g. 512GiB (default: /proc/meminfo)")
    p.add_argument("--h2d-bandwidth", default=None, help="host-to-GPU bandwidth per second, e.g. 25GB (pinned)")
    p.add_argument("--gpu-name", default=None, help="GPU model for bandwidths, e.g. H100 (default: detected)")
    p.add_argument("--config", default=None, help="DeepSpeed config whose stage-3 knobs, offload and optimizer apply")
    p.add_argument("--machine", default=None, metavar="PROFILE",
                   help="machine profile from dsdoctor calibrate --out (default: this machine's cached one, if any)")
    p.add_argument("--no-recheck", action="store_true",
                   help="use the machine profile as it is: do not re-time an eager layer on this host first "
                        "(default: re-timed in a few seconds when a GPU is visible, host-bound figures rescaled)")
    p.add_argument("--hf-equality", action="store_true",
                   help="the outputs must equal transformers' greedy generate token for token: never recommend a "
                        "serving engine (vllm, sglang)")
    p.add_argument("--alloc-conf", default=None, metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF the run will use (default: this shell's), e.g. expandable_segments:True")
    p.add_argument("--transformers-version", metavar="X.Y.Z", default=None,
                   help="transformers release that will load the model (default: the one installed here); "
                        "host memory by loading method and the emitted code follow it")
    p.add_argument("--counts", choices=("auto", "meta", "formula"), default="auto",
                   help="parameter counts: exact from the meta-device model (needs transformers) or formula")
    p.add_argument("--loop", action="store_true",
                   help="the model trains and generates its own rollouts (RLHF/GRPO, eval with generate): count the "
                        "training state and add the paths zero2 and zero3-gather-once")
    p.add_argument("--plot", metavar="DIR", default=None, help="write plan.png and plan.html into DIR (new)")
    p.add_argument("--force", action="store_true", help="replace an existing --plot directory")
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.plan.api import plan

    if args.plot:
        from dsdoctor.plan.plot import require_matplotlib

        require_matplotlib()
    result = plan(args.model, batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                  dtype=args.dtype, gpus=args.gpus, gpu_memory=args.gpu_memory, host_memory=args.host_memory,
                  h2d_bandwidth=args.h2d_bandwidth, config=args.config, counts=args.counts, gpu_name=args.gpu_name,
                  machine=args.machine, alloc_conf=args.alloc_conf, loop=args.loop,
                  transformers_version=args.transformers_version, hf_equality=args.hf_equality,
                  recheck=False if args.no_recheck else None)
    if args.plot:
        from dsdoctor.plan.plot import write_plots

        for path in write_plots(result, args.plot, lang=lang_of(args), force=args.force):
            log(f"wrote {path}")
    emit(result, args)
    return exit_code(result.findings, args.fail_on)
