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
  dsdoctor plan --loop --model ./llama-7b --ref ./llama-7b:frozen --critic 7B --reward 7B:frozen --gpus 8
  dsdoctor plan --loop --job run_step3.sh --gpu-memory 40GiB   # a DeepSpeed-Chat/OpenRLHF/verl/trl launch line
  dsdoctor plan --model ./Qwen2-72B --gpus 8 --host-memory 1TiB --transformers-version 4.44.2"""


def register(sub):
    p = add_command(
        sub, "plan", "predict per-GPU and host memory and speed of each load path; recommend one", EXAMPLES,
        description="Predict the peak GPU memory (torch.cuda.max_memory_allocated over load and generate), host "
                    "memory and tokens/s of each load path (plain, tp, zero3, zero3-offload, zero3-offload-nvme; "
                    "estimates: device-map, vllm, sglang, quantized) for a model, workload and machine, and "
                    "recommend the fastest that fits.",
    )
    p.add_argument("--model", default=None, help="local Hugging Face model directory or its config.json (with "
                                                 "--loop: the actor; a size such as 7B also works there)")
    p.add_argument("--batch", type=int, default=None, help="sequences each rank generates at once (default: 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: 512)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default: 128)")
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
    job = p.add_argument_group("an RL job (with --loop): the models on the same GPUs, the rollout engine")
    job.add_argument("--job", metavar="FILE", default=None,
                     help="a job file (YAML/JSON: models, rollout, train, engine) or a DeepSpeed-Chat, OpenRLHF, verl "
                          "or trl launch line/script")
    for role in ("ref", "critic", "reward"):
        job.add_argument(f"--{role}", metavar="MODEL[:OPTS]", default=None,
                         help=f"the {role} model: a directory, config.json or size, with options frozen/trainable, "
                              "zero0-zero3, offload, offload-param, offload-optimizer, ckpt")
    job.add_argument("--train-batch", type=int, default=None, metavar="N",
                     help="training micro-batch per GPU (default: the rollout batch)")
    job.add_argument("--rollout", choices=("generate", "gather-once", "hybrid-engine", "vllm"), default=None,
                     help="how the actor generates now (default: the job's, else HF generate)")
    p.add_argument("--plot", metavar="DIR", default=None, help="write plan.png and plan.html into DIR (new)")
    p.add_argument("--force", action="store_true", help="replace an existing --plot directory")
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.plan.api import plan

    if args.job or args.ref or args.critic or args.reward:
        return run_job(args)
    if args.model is None:
        from dsdoctor.errors import InputError

        raise InputError("plan needs --model DIR (or, with --loop, --job FILE)")
    if args.plot:
        from dsdoctor.plan.plot import require_matplotlib

        require_matplotlib()
    result = plan(args.model, batch=args.batch or 1, prompt_len=args.prompt_len or 512,
                  new_tokens=args.new_tokens or 128,
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


def run_job(args) -> int:
    """plan --loop for a whole RL job: several models on the same GPUs."""
    from dsdoctor.errors import InputError
    from dsdoctor.plan.loop_job import plan_job

    if not args.loop:
        raise InputError("--job, --ref, --critic and --reward plan an RL job: add --loop")
    if args.plot:
        raise InputError("--plot draws the load paths of one model; it does not apply to an RL job")
    result = plan_job(args.job, actor=args.model, ref=args.ref, critic=args.critic, reward=args.reward,
                      config=args.config, batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                      train_batch=args.train_batch, dtype=args.dtype, gpus=args.gpus, gpu_memory=args.gpu_memory,
                      host_memory=args.host_memory, h2d_bandwidth=args.h2d_bandwidth, gpu_name=args.gpu_name,
                      counts=args.counts, machine=args.machine, engine=args.rollout)
    emit(result, args)
    return exit_code(result.findings, args.fail_on)
