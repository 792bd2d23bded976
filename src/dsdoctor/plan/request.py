"""What plan is asked: one typed request per entry point (``PlanRequest`` for ``plan``, ``JobRequest`` for
``plan_job``), each concern declared once. A field's metadata is its documentation and its flag: the CLI derives
``dsdoctor plan``'s flags, types, defaults and help from them (``cli/plan.py``); the library functions build the
request from plain values (``plan.api.plan``, ``loop_job.plan_job``). Imports nothing heavy."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from dsdoctor.units import MAX_BATCH, MAX_GPUS, MAX_TOKENS


def arg(default, doc: str, *, flag: str | None = None, kind: str | None = None, metavar: str | None = None,
        choices: tuple | None = None, shown: str | None = None, high: int | None = None):
    """A request field: ``doc`` says what it is (the flag's help); ``flag``: its option ("" for the library
    only; default ``--name-with-dashes``); ``kind``: int (a count from 1 to ``high``), dtype, on (a switch),
    off (``--no-x`` passes False); ``shown``: the default as the help says it (else the default itself)."""
    return field(default=default, metadata={"doc": doc, "flag": flag, "kind": kind, "metavar": metavar,
                                            "choices": choices, "shown": shown, "high": high})


@dataclass(kw_only=True)
class MachineRequest:
    """The machine a plan is for, and how plan counts the model."""
    gpus: int | None = arg(None, "number of GPUs, one rank each", kind="int", metavar="N", shown="detected, else 1",
                             high=MAX_GPUS)
    gpu_memory: str | int | None = arg(None, "memory per GPU, e.g. 80GiB", shown="detected, else 80GiB")
    host_memory: str | int | None = arg(None, "host memory, e.g. 512GiB", shown="/proc/meminfo")
    h2d_bandwidth: str | float | None = arg(None, "host-to-GPU bandwidth per second, e.g. 25GB (pinned)",
                                            shown="the GPU table's")
    gpu_name: str | None = arg(None, "GPU model for bandwidths, e.g. H100", shown="detected")
    machine: object = arg(None, "machine profile from dsdoctor calibrate --out (a file or a MachineProfile)",
                          metavar="PROFILE", shown="this machine's cached one, if any")
    counts: str = arg("auto", "parameter counts: exact from the meta-device model (needs transformers) or formula",
                      choices=("auto", "meta", "formula"))
    detect: bool = arg(True, "read GPUs, host memory and the cached profile from this machine", flag="")


@dataclass(kw_only=True)
class PlanRequest(MachineRequest):
    """``plan``: one model's load paths for a workload on a machine."""
    model: str | os.PathLike = arg(None, "local Hugging Face model directory or its config.json (with --loop: the "
                                         "actor; a size such as 7B also works there)")
    batch: int = arg(1, "sequences each rank generates at once", kind="int", high=MAX_BATCH)
    prompt_len: int = arg(512, "prompt tokens", kind="int", high=MAX_TOKENS)
    new_tokens: int = arg(128, "generated tokens", kind="int", high=MAX_TOKENS)
    dtype: str | None = arg(None, "weight dtype", kind="dtype", shown="the model's, else bf16")
    config: object = arg(None, "DeepSpeed config whose stage-3 knobs, offload and optimizer apply (a path, a dict or "
                               "a LoadedConfig)", shown="none")
    recheck: object = arg(None, "re-time an eager layer on this host before a profile of its hardware is used, and "
                                "rescale the host-bound figures when it drifted (default: when a GPU is visible here; "
                                "--no-recheck: never, the profile as it is; library: a callable is the measurement)",
                          flag="--no-recheck", kind="off")
    hf_equality: bool = arg(False, "the outputs must equal transformers' greedy generate token for token: never "
                                   "recommend a serving engine (vllm, sglang)", kind="on")
    alloc_conf: str | None = arg(None, "PYTORCH_CUDA_ALLOC_CONF the run will use, e.g. expandable_segments:True",
                                 metavar="CONF", shown="this shell's")
    transformers_version: str | None = arg(None, "transformers release that will load the model; host memory by "
                                                 "loading method and the emitted code follow it",
                                           metavar="X.Y.Z", shown="the one installed here")
    loop: bool = arg(False, "the model trains and generates its own rollouts (RLHF/GRPO, eval with generate): count "
                            "the training state and add the paths zero2 and zero3-gather-once", kind="on")


MODEL_OPTS = (": a directory, config.json or size, with options frozen/trainable, zero0-zero3, offload, offload-param, "
              "offload-optimizer, ckpt")


@dataclass(kw_only=True)
class JobRequest(MachineRequest):
    """``plan_job``: an RL job's models on the same GPUs. Flags win over what the job says."""
    job: object = arg(None, "a job file (YAML/JSON: models, rollout, train, engine) or a DeepSpeed-Chat, OpenRLHF, "
                            "verl or trl launch line/script (also a dict of the job file's form, or an RlJob)",
                      metavar="FILE", shown="none")
    actor: str | None = arg(None, "the actor: a model directory, config.json or size (--model on the CLI)", flag="")
    ref: str | None = arg(None, f"the reference model{MODEL_OPTS}", metavar="MODEL[:OPTS]", shown="none")
    critic: str | None = arg(None, f"the critic model{MODEL_OPTS}", metavar="MODEL[:OPTS]", shown="none")
    reward: str | None = arg(None, f"the reward model{MODEL_OPTS}", metavar="MODEL[:OPTS]", shown="none")
    config: object = arg(None, "the actor's DeepSpeed config: its stage and offloads", flag="")
    batch: int | None = arg(None, "rollout sequences per training GPU", flag="", shown="the job's, else 1")
    prompt_len: int | None = arg(None, "prompt tokens", flag="", shown="the job's, else 512")
    new_tokens: int | None = arg(None, "generated tokens", flag="", shown="the job's, else 128")
    train_batch: int | None = arg(None, "training micro-batch per GPU", kind="int", metavar="N",
                                  shown="the rollout batch", high=MAX_BATCH)
    dtype: str | None = arg(None, "weight dtype", flag="", shown="the job's, else the actor's, else bf16")
    engine: str | None = arg(None, "how the actor generates now", flag="--rollout",
                             choices=("generate", "gather-once", "hybrid-engine", "vllm"),
                             shown="the job's, else HF generate")



def measure_command(req: PlanRequest, wl, hw) -> str:
    """The ``dsdoctor plan ... --measure`` line that settles an edge verdict (DSD234) on a machine with the GPU:
    the user's flags, with the workload and machine as this plan resolved them."""
    import shlex

    gib = hw.gpu_memory // 2**30
    flags = [("--model", req.model), ("--config", req.config if isinstance(req.config, (str, os.PathLike)) else None),
             ("--batch", wl.batch), ("--prompt-len", wl.prompt_len), ("--new-tokens", wl.new_tokens),
             ("--dtype", wl.dtype), ("--gpus", hw.gpus),
             ("--host-memory", req.host_memory), ("--gpu-memory", f"{gib}GiB" if gib * 2**30 == hw.gpu_memory else hw.gpu_memory),
             ("--gpu-name", req.gpu_name), ("--counts", None if req.counts == "auto" else req.counts),
             ("--alloc-conf", req.alloc_conf), ("--transformers-version", req.transformers_version)]
    return " ".join(["dsdoctor plan", *(f"{k} {shlex.quote(str(v))}" for k, v in flags if v is not None), "--measure"])
