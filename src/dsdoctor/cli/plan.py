"""``dsdoctor plan``: which load path to use for an inference run, and what fits."""
from __future__ import annotations

import os
from dataclasses import fields, is_dataclass

from dsdoctor.cli.common import add_command, add_output_flags, bounded, dtype_name, emit, lang_of, log
from dsdoctor.findings import exit_code
from dsdoctor.plan.request import JobRequest, PlanRequest

EXAMPLES = """\
  dsdoctor plan --model ./Llama-3.1-8B --batch 8 --prompt-len 2048 --new-tokens 256
  dsdoctor plan --model ./Llama-3.1-70B --gpus 4 --gpu-memory 80GiB --format json
  dsdoctor plan --model ./qwen2/config.json --config ds_train.json --plot plan-out
  dsdoctor plan --model ./Llama-3.1-8B --lang zh --format markdown > plan.md
  dsdoctor plan --model ./Llama-3.1-8B --machine h200.json   # speeds from a profile dsdoctor calibrate wrote
  dsdoctor plan --model ./Llama-2-7b --gpus 2 --batch 4 --new-tokens 32 --loop   # RLHF/GRPO rollouts
  dsdoctor plan --loop --model ./llama-7b --ref ./llama-7b:frozen --critic 7B --reward 7B:frozen --gpus 8
  dsdoctor plan --loop --job run_step3.sh --gpu-memory 40GiB   # a DeepSpeed-Chat/OpenRLHF/verl/trl launch line
  dsdoctor plan --model ./Qwen2-72B --gpus 8 --host-memory 1TiB --transformers-version 4.44.2
  dsdoctor plan --model ./Qwen2-7B --batch 4 --prompt-len 4096 --gpu-memory 24GiB --measure   # on a GPU machine"""


JOB_FLAGS = ("job", "ref", "critic", "reward")  # any of them: an RL job


def add_request_flags(p, cls, skip=()) -> list[str]:
    """One flag per field of the request type ``cls`` (``plan/request.py``): its option, type, default and
    help from the field's declaration. Returns the names added."""
    added, inherited = [], {f.name for f in fields(cls.__mro__[1])} if is_dataclass(cls.__mro__[1]) else set()
    for f in sorted(fields(cls), key=lambda f: f.name in inherited):  # the request's own flags first
        m = f.metadata
        if m.get("flag") == "" or f.name in skip:
            continue
        kind, shown = m.get("kind"), m.get("shown") or f.default
        tail = "" if kind in ("on", "off") or shown is None else f" (default: {shown})"
        opts = {"dest": f.name, "default": None, "help": m["doc"] + tail}
        if kind == "on":
            opts["action"] = "store_true"
        elif kind == "off":
            opts.update(action="store_const", const=False)
        else:
            opts.update(type=bounded(1, m["high"]) if kind == "int" else dtype_name if kind == "dtype" else str,
                        choices=m.get("choices"),
                        metavar=m.get("metavar") or ("{bf16,fp16,fp32}" if kind == "dtype" else None))
        p.add_argument(m.get("flag") or "--" + f.name.replace("_", "-"), **opts)
        added.append(f.name)
    return added


def request_values(args, cls, **extra) -> dict:
    """The plain values of the request ``cls`` that the command line gives (a flag not given: the request's
    default)."""
    values = {f.name: getattr(args, f.name, None) for f in fields(cls)} | extra
    return {k: v for k, v in values.items() if v is not None}


def register(sub):
    p = add_command(
        sub, "plan", "predict per-GPU and host memory and speed of each load path; recommend one", EXAMPLES,
        description="Predict the peak GPU memory (torch.cuda.max_memory_allocated over load and generate), host "
                    "memory and tokens/s of each load path (plain, tp, zero3, zero3-offload, zero3-offload-nvme; "
                    "estimates: device-map, vllm, sglang, quantized) for a model, workload and machine, and "
                    "recommend the fastest that fits.",
    )
    added = add_request_flags(p, PlanRequest)
    job = p.add_argument_group("an RL job (with --loop): the models on the same GPUs, the rollout engine")
    add_request_flags(job, JobRequest, skip=added)
    p.add_argument("--plot", metavar="DIR", default=None, help="write plan.png and plan.html into DIR (new)")
    p.add_argument("--force", action="store_true", help="replace an existing --plot directory")
    p.add_argument("--measure", action="store_true",
                   help="on a machine with a GPU: run the recommended path and any path at the edge for this exact "
                        "shape (random weights), capped at --gpu-memory, print measured beside predicted and record "
                        "the runs in this machine's profile (its band tightens)")
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsdoctor.errors import InputError
    from dsdoctor.plan.api import plan

    if any(getattr(args, k) for k in JOB_FLAGS) or (args.loop and args.model and not os.path.exists(args.model)):
        return run_job(args)  # an RL job, or --loop --model SIZE (a size is planned as the job planner's shape)
    if args.model is None:
        raise InputError("plan needs --model DIR (or, with --loop, --job FILE)")
    if args.measure:
        if args.loop or args.plot:
            raise InputError("--measure runs one model's inference paths: without --loop and --plot")
        from dsdoctor.plan.measure import measure

        result = measure(PlanRequest(**request_values(args, PlanRequest)))
        emit(result, args)
        return exit_code(result.findings, args.fail_on)
    if args.plot:
        from dsdoctor.plan.plot import require_matplotlib

        require_matplotlib()
    result = plan(**request_values(args, PlanRequest))
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
    result = plan_job(**request_values(args, JobRequest, actor=args.model))
    emit(result, args)
    return exit_code(result.findings, args.fail_on)
