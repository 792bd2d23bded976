"""An RL job (actor, reference, critic, reward; the rollout engine; the rollout and training shapes) read from
what users run: a DeepSpeed-Chat step-3, OpenRLHF, verl or trl launch line, a trl YAML, a DeepSpeed config
with a ``hybrid_engine`` block (DeepSpeed-Chat's actor), a job file of dsdoctor's own, or ``--ref MODEL:opts``.

Every framework default used here was read in the framework's own code or docs (cited in the rules'
explanations, ``config/rules.json`` DSD140-DSD144):

* DeepSpeed-Chat (DeepSpeedExamples ``applications/DeepSpeed-Chat``: ``training/step3_rlhf_finetuning/main.py``,
  ``dschat/rlhf/rlhf_engine.py``, ``dschat/utils/ds_utils.py``): the reference and EMA copy run at ZeRO-3 only
  when the actor does, else stage 0; the reward model likewise after the critic; ``--offload_reference_model``
  and ``--offload_reward_model`` set ``offload_param``, which stage 0 ignores; ``--offload`` offloads the
  actor's and critic's parameters and optimizer; ``--dtype`` defaults to fp16 (loss scaling window 100).
* OpenRLHF (``openrlhf/cli/train_ppo_ray.py``, ``openrlhf/utils/deepspeed``): ``--zero_stage`` (default 2) for the
  actor and critic, the frozen models at stage 3 only when that is 3, else 0; ``--ref_reward_offload``
  sets their ``offload_param``; ``--adam_offload`` the optimizer's; vLLM engines on their own GPUs unless
  ``--colocate_all_models``; ``--vllm_gpu_memory_utilization`` default 0.95.
* verl (``docs/examples/config.rst``): FSDP (planned as ZeRO-3: parameters, gradients and optimizer state
  sharded), a colocated rollout engine whose ``gpu_memory_utilization`` is a fraction of the whole GPU for
  vLLM >= 0.7, ``free_cache_engine`` (default true) freeing its KV cache after the rollout.
* trl (``trl/trainer/grpo_config.py``): ``ds3_gather_for_generation`` (default true) gathers the ZeRO-3 policy
  once per generate; ``use_vllm`` with ``vllm_mode`` server (other GPUs) or colocate
  (``vllm_gpu_memory_utilization``, default 0.3); ``beta`` 0 loads no reference model.

Torch-free; reading only (``plan/loop_job.py`` plans the job).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.errors import InputError
from dsdoctor.units import MAX_GPUS, MAX_TOKENS, number

ROLES = ("actor", "reference", "critic", "reward", "ema")
TRAINABLE_ROLES = ("actor", "critic")
ENGINES = ("generate", "gather-once", "hybrid-engine", "vllm")


@dataclass
class RlModel:
    """One model of the job, as given: ``source`` is a model directory, a config.json, a size ("7B") or a hub
    name whose size its name says. ``stage`` None: not given (the planner chooses)."""
    role: str
    source: str | None
    trainable: bool
    stage: int | None = None
    offload_param: bool = False
    offload_optimizer: bool = False
    gradient_checkpointing: bool = False
    group: str = "all"  # models of one group share GPUs (OpenRLHF places groups apart)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Engine:
    """How the actor generates its rollouts: ``generate`` (HF generate on the training module: ZeRO-3 gathers
    every layer for every token), ``gather-once`` (the whole model gathered once per generate, hooks lifted),
    ``hybrid-engine`` (DeepSpeed's, inference kernels), ``vllm`` (colocated on the training GPUs or on
    ``gpus`` GPUs of its own)."""
    kind: str = "generate"
    colocate: bool = True
    gpu_memory_utilization: float | None = None
    tp: int = 1
    gpus: int = 0  # a separate engine's GPUs (0: unknown or colocated)
    sleep: bool = False  # vLLM sleep mode / verl free_cache_engine: its memory released during training
    release_cache: bool = False  # hybrid engine: release_inference_cache
    pin: bool = True  # hybrid engine: pin_parameters (gather all layers once under ZeRO-3)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RlJob:
    models: list[RlModel]
    batch: int | None = None  # rollout sequences each training GPU generates per iteration
    prompt_len: int | None = None
    new_tokens: int | None = None
    train_batch: int | None = None  # training micro-batch per GPU
    experience_batch: int | None = None  # sequences per experience forward (None: the training micro-batch)
    dtype: str | None = None
    gpus: int | None = None  # the training GPUs
    engine: Engine | None = None  # None: not said (HF generate)
    framework: str | None = None  # deepspeed-chat, openrlhf, verl, trl; None for a job file or flags
    source: str | None = None  # the file it was read from
    args: dict = field(default_factory=dict)  # the flags as read (launch lines)
    notes: list = field(default_factory=list)  # what was assumed or not resolved
    overlap_comm: bool = False
    reduce_bucket_size: int | None = None
    engines_allowed: tuple = ENGINES  # what the framework can switch to without new code

    def model(self, role: str) -> RlModel | None:
        return next((m for m in self.models if m.role == role), None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["engines_allowed"] = list(self.engines_allowed)
        return d


# ------------------------------------------------------------------ --ref MODEL[:opts]

_OPTS = {"frozen", "trainable", "offload", "offload-param", "offload-optimizer", "ckpt", "gradient-checkpointing",
         "zero0", "zero1", "zero2", "zero3"}


def _options(text: str) -> list[str] | None:
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    ok = all(w in _OPTS or re.fullmatch(r"stage=?[0-3]", w) for w in words)
    return words if words and ok else None


def parse_model_spec(role: str, text: str) -> RlModel:
    """``MODEL[:opt,opt]`` (``--ref ./llama-7b:frozen,zero3,offload``): options frozen/trainable, zero0-3
    (or stage=N), offload (parameters, and the optimizer of a trainable model), offload-param,
    offload-optimizer, ckpt (gradient checkpointing)."""
    if role not in ROLES:
        raise InputError(f"unknown model role {role!r}", hint=f"one of {', '.join(ROLES)}")
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"--{role} needs a model: a directory, a config.json or a size such as 7B")
    source, opts = text, []
    if ":" in text:
        head, tail = text.rsplit(":", 1)
        found = _options(tail)
        if found is not None:
            source, opts = head, found
        elif tail and not tail.startswith(("/", "\\")) and head:
            raise InputError(f"--{role} {text}: unknown option(s) {tail!r}",
                             hint="options: frozen, trainable, zero0-zero3, offload, offload-param, "
                                  "offload-optimizer, ckpt")
    trainable = role in TRAINABLE_ROLES
    m = RlModel(role, source, trainable)
    for o in opts:
        if o in ("frozen", "trainable"):
            m.trainable = o == "trainable"
        elif o.startswith("zero"):
            m.stage = int(o[4])
        elif o.startswith("stage"):
            m.stage = int(o[-1])
        elif o == "offload":
            m.offload_param, m.offload_optimizer = True, m.trainable
        elif o == "offload-param":
            m.offload_param = True
        elif o == "offload-optimizer":
            m.offload_optimizer = True
        elif o in ("ckpt", "gradient-checkpointing"):
            m.gradient_checkpointing = True
    if m.offload_optimizer and not m.trainable:
        m.offload_optimizer = False
    return m


# ------------------------------------------------------------------ launch lines

def _tokens(text: str) -> list[str]:
    """Every word of the script's commands (``config.load.launch_words``, the one bounded reader); ``$VAR`` and
    ``${VAR}`` replaced by the last literal ``VAR=value`` the script assigns (a default set in an ``if``
    block counts); others stay as written."""
    from dsdoctor.config.load import launch_words

    assigned: dict[str, str] = {}
    words: list[str] = []
    for toks in launch_words(text, every=True):
        if len(toks) == 1 and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=[^$`]*", toks[0]):
            name, value = toks[0].split("=", 1)
            assigned[name] = value
            continue
        words += toks

    def sub(word: str) -> str:
        return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: assigned.get(m.group(1), m.group(0)), word)

    return [sub(w) for w in words]


def parse_flags(tokens: list[str]) -> dict:
    """The flags of ``config.load.launch_flags`` (``--key value``, bare ``--flag``, hydra's ``a.b.c=value``), values
    read as scalars (true/false, null, numbers, else the text); a number's bounds are its reader's (``count``)."""
    from dsdoctor.config.load import launch_flags

    def scalar(v: str):
        low = v.strip().lower()
        if low in ("true", "yes", "on"):
            return True
        if low in ("false", "no", "off"):
            return False
        if low in ("null", "none", "~"):
            return None
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
        return v

    return {key: scalar(value) for key, value in launch_flags(tokens)[0].items()}


def count(args: dict, key: str, default=None, high: int = MAX_TOKENS):
    """A count the launch line gives (``units.number``: finite, 0..high); an unresolved ``$VAR``: the default."""
    v = args.get(key, default)
    if isinstance(v, str) and v.startswith("$"):
        return default
    return None if v is None else number(v, f"--{key}", high=high)


def _fraction(args: dict, key: str, default: float) -> float:
    """A share of GPU memory the launch line gives, in (0, 1]."""
    v = args.get(key)
    return number(default if v is None else v, f"--{key}", low=0.01, high=1, whole=False)


def _true(v) -> bool:
    return v is True or (isinstance(v, str) and v.strip().lower() in ("true", "1", "yes")) or \
        (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1)


def _unresolved(job: RlJob, args: dict, keys: tuple) -> None:
    for k in keys:
        if isinstance(args.get(k), str) and args[k].startswith("$"):
            job.notes.append(f"--{k} {args[k]} is not resolved in the script: its default assumed")


def detect_framework(tokens: list[str], args: dict) -> str | None:
    joined = " ".join(tokens)
    if "openrlhf.cli.train_ppo" in joined or "openrlhf.cli.train_grpo" in joined:
        return "openrlhf"
    if "verl.trainer.main_ppo" in joined or any(k.startswith("actor_rollout_ref.") for k in args):
        return "verl"
    if "actor_model_name_or_path" in args or "actor_zero_stage" in args:
        return "deepspeed-chat"
    if any(k in args for k in ("use_vllm", "vllm_mode", "ds3_gather_for_generation")) or \
            re.search(r"(^|\s)trl\s+(grpo|rloo|ppo|online_dpo)\b", joined):
        return "trl"
    return None


def deepspeed_chat(args: dict) -> RlJob:
    """DeepSpeed-Chat step 3 (main.py): its models and the configs ds_utils.py builds for them."""
    actor_stage = count(args, "actor_zero_stage", 0, high=3)
    critic_stage = count(args, "critic_zero_stage", 0, high=3)
    offload = _true(args.get("offload"))
    frozen_actor_stage = 3 if actor_stage == 3 else 0
    frozen_critic_stage = 3 if critic_stage == 3 else 0
    actor_path = args.get("actor_model_name_or_path")
    critic_path = args.get("critic_model_name_or_path")
    models = [
        RlModel("actor", actor_path, True, actor_stage, offload, offload,
                _true(args.get("actor_gradient_checkpointing"))),
        RlModel("reference", actor_path, False, frozen_actor_stage, _true(args.get("offload_reference_model"))),
        RlModel("critic", critic_path, True, critic_stage, offload, offload,
                _true(args.get("critic_gradient_checkpointing"))),
        RlModel("reward", critic_path, False, frozen_critic_stage, _true(args.get("offload_reward_model"))),
    ]
    if _true(args.get("enable_ema")):
        models.append(RlModel("ema", actor_path, False, frozen_actor_stage, _true(args.get("offload_reference_model"))))
    if _true(args.get("enable_hybrid_engine")):
        engine = Engine("hybrid-engine", pin=not _true(args.get("unpin_actor_parameters")),
                        release_cache=_true(args.get("release_inference_cache")),
                        tp=count(args, "inference_tp_size", 1) or 1)
    else:
        engine = Engine("generate")
    batch = count(args, "per_device_generation_batch_size", None) or count(args, "per_device_train_batch_size", 16)
    train = count(args, "per_device_training_batch_size", None) or count(args, "per_device_mini_train_batch_size", 16)
    job = RlJob(models, batch=batch, prompt_len=count(args, "max_prompt_seq_len", 256),
                new_tokens=count(args, "max_answer_seq_len", 256), train_batch=train,
                dtype=str(args.get("dtype", "fp16")), engine=engine, framework="deepspeed-chat", args=args,
                overlap_comm=True, experience_batch=batch, engines_allowed=("generate", "gather-once", "hybrid-engine"))
    _unresolved(job, args, ("actor_zero_stage", "critic_zero_stage", "per_device_generation_batch_size",
                            "per_device_training_batch_size"))
    if (count(args, "actor_lora_dim", 0) or 0) > 0:
        job.notes.append("--actor_lora_dim: LoRA is not modelled; the actor is planned as fully trained")
    return job


def deepspeed_chat_actor_config(job: RlJob) -> dict:
    """The actor's DeepSpeed config as DeepSpeed-Chat's get_train_ds_config builds it (the values it sets)."""
    actor, args = job.model("actor"), job.args
    device = "cpu" if actor.offload_optimizer else "none"
    dtype = {"fp16": ("fp16", {"enabled": True, "loss_scale_window": 100})}.get(
        job.dtype or "fp16", ("bfloat16", {"enabled": True}))
    engine = job.engine or Engine()
    return {
        "train_batch_size": (job.train_batch or 16) * (job.gpus or 1),
        "train_micro_batch_size_per_gpu": job.train_batch or 16,
        "zero_optimization": {"stage": actor.stage or 0, "overlap_comm": True, "offload_param": {"device": device},
                              "offload_optimizer": {"device": device},
                              "stage3_param_persistence_threshold": 10000, "stage3_max_live_parameters": 30000000,
                              "stage3_prefetch_bucket_size": 30000000, "memory_efficient_linear": False},
        dtype[0]: dtype[1], "gradient_clipping": 1.0, "prescale_gradients": False,
        "hybrid_engine": {"enabled": engine.kind == "hybrid-engine",
                          "max_out_tokens": (job.prompt_len or 256) + (job.new_tokens or 256),
                          "inference_tp_size": engine.tp, "release_inference_cache": engine.release_cache,
                          "pin_parameters": engine.pin,
                          "tp_gather_partition_size": count(args, "tp_gather_partition_size", 8) or 8},
    }


def openrlhf(args: dict) -> RlJob:
    """OpenRLHF train_ppo_ray: models, their GPU groups, vLLM engines."""
    stage = count(args, "zero_stage", 2, high=3)
    frozen_stage = 3 if stage == 3 else 0
    offload_frozen = _true(args.get("ref_reward_offload"))
    ckpt = _true(args.get("gradient_checkpointing"))
    all_models = _true(args.get("colocate_all_models"))
    actor_ref = all_models or _true(args.get("colocate_actor_ref"))
    critic_reward = all_models or _true(args.get("colocate_critic_reward"))
    pretrain = args.get("pretrain")
    reward = args.get("reward_pretrain")
    models = [RlModel("actor", pretrain, True, stage, False, _true(args.get("adam_offload")), ckpt,
                      group="all" if all_models else "actor")]
    kl = args.get("init_kl_coef", 0.01)
    if (isinstance(kl, (int, float)) and kl > 0) or _true(args.get("use_kl_loss")):
        models.append(RlModel("reference", pretrain, False, frozen_stage, offload_frozen,
                              group="all" if all_models else ("actor" if actor_ref else "reference")))
    estimator = str(args.get("advantage_estimator", "gae"))
    if estimator == "gae":
        critic = args.get("critic_pretrain") or (str(reward).split(",")[0] if reward else pretrain)
        models.append(RlModel("critic", critic, True, stage, False, _true(args.get("adam_offload")), ckpt,
                              group="all" if all_models else "critic"))
    if reward and not args.get("remote_rm_url"):
        models.append(RlModel("reward", str(reward).split(",")[0], False, frozen_stage, offload_frozen,
                              group="all" if all_models else ("critic" if critic_reward else "reward")))
    engines = count(args, "vllm_num_engines", None) or 0
    tp = count(args, "vllm_tensor_parallel_size", 1) or 1
    if engines > 0:
        engine = Engine("vllm", colocate=all_models, gpu_memory_utilization=_fraction(
            args, "vllm_gpu_memory_utilization", 0.95), tp=tp, gpus=0 if all_models else engines * tp,
            sleep=all_models and _true(args.get("vllm_enable_sleep")))
    else:
        engine = Engine("generate")
    gpus = (count(args, "actor_num_nodes", 1) or 1) * (count(args, "actor_num_gpus_per_node", 8) or 8)
    job = RlJob(models, batch=count(args, "micro_rollout_batch_size", 8), prompt_len=count(args, "prompt_max_len", 1024),
                new_tokens=count(args, "generate_max_len", 1024), train_batch=count(args, "micro_train_batch_size", 4),
                dtype="bf16" if _true(args.get("bf16")) else "fp32", gpus=gpus, engine=engine, framework="openrlhf",
                experience_batch=count(args, "micro_rollout_batch_size", 8),
                args=args, overlap_comm=_true(args.get("overlap_comm")),
                engines_allowed=("generate", "vllm"))
    if not all_models:
        job.notes.append("models not colocated run on GPU groups of their own; each group is planned apart")
    return job


def openrlhf_actor_config(job: RlJob) -> dict:
    """The actor's DeepSpeed config as OpenRLHF's get_train_ds_config builds it (the values that matter here)."""
    actor = job.model("actor")
    return {"zero_optimization": {"stage": actor.stage if actor.stage is not None else 2,
                                  "offload_param": {"device": "none"},
                                  "offload_optimizer": {"device": "cpu" if actor.offload_optimizer else "none",
                                                        "pin_memory": True}},
            "bf16": {"enabled": job.dtype == "bf16"}, "gradient_clipping": 1.0, "prescale_gradients": False,
            "train_micro_batch_size_per_gpu": job.train_batch or 4}


def verl(args: dict) -> RlJob:
    """verl main_ppo hydra overrides. FSDP is planned as ZeRO-3 (parameters, gradients, optimizer sharded)."""
    a = "actor_rollout_ref."
    path = args.get(a + "model.path")
    ckpt = _true(args.get(a + "model.enable_gradient_checkpointing"))
    models = [RlModel("actor", path, True, 3, _true(args.get(a + "actor.fsdp_config.param_offload")),
                      _true(args.get(a + "actor.fsdp_config.optimizer_offload")), ckpt)]
    if _true(args.get(a + "actor.use_kl_loss")) or _true(args.get("algorithm.use_kl_in_reward")):
        models.append(RlModel("reference", path, False, 3, _true(args.get(a + "ref.fsdp_config.param_offload"))))
    if str(args.get("algorithm.adv_estimator", "gae")) == "gae":
        models.append(RlModel("critic", args.get("critic.model.path", path), True, 3,
                              _true(args.get("critic.model.fsdp_config.param_offload")),
                              _true(args.get("critic.model.fsdp_config.optimizer_offload")),
                              _true(args.get("critic.model.enable_gradient_checkpointing"))))
    if _true(args.get("reward_model.enable")):
        models.append(RlModel("reward", args.get("reward_model.model.path"), False, 3,
                              _true(args.get("reward_model.model.fsdp_config.param_offload"))))
    name = str(args.get(a + "rollout.name", "vllm"))
    job_notes = []
    if args.get(a + "rollout.gpu_memory_utilization") is None:
        job_notes.append(f"{a}rollout.gpu_memory_utilization not given: 0.5 assumed")
    engine = Engine("vllm" if name in ("vllm", "sglang") else "generate", colocate=True,
                    gpu_memory_utilization=_fraction(args, a + "rollout.gpu_memory_utilization", 0.5),
                    tp=count(args, a + "rollout.tensor_model_parallel_size", 1) or 1,
                    sleep=_true(args.get(a + "rollout.free_cache_engine", True)))
    gpus = (count(args, "trainer.n_gpus_per_node", 8) or 8) * (count(args, "trainer.nnodes", 1) or 1)
    prompts = count(args, "data.train_batch_size", None)
    n = count(args, a + "rollout.n", 1) or 1
    batch = max(prompts * n // gpus, 1) if prompts else None
    job = RlJob(models, batch=batch, prompt_len=count(args, "data.max_prompt_length", 512),
                new_tokens=count(args, "data.max_response_length", 512),
                train_batch=count(args, a + "actor.ppo_micro_batch_size_per_gpu", None) or 1, dtype="bf16", gpus=gpus,
                experience_batch=count(args, a + "rollout.log_prob_micro_batch_size_per_gpu", None)
                or count(args, a + "actor.ppo_micro_batch_size_per_gpu", None) or 1,
                engine=engine, framework="verl", args=args, notes=job_notes + [
                    "verl trains with FSDP: planned as ZeRO-3 (parameters, gradients and optimizer state sharded)",
                    "free_cache_engine planned as the rollout engine's sleep: its memory released during training"],
                engines_allowed=("generate", "vllm"))
    return job


def trl(args: dict, stage: int | None = None) -> RlJob:
    """trl GRPO/RLOO/online-DPO arguments (a YAML or flags): the policy, a reference when beta > 0, the rollout."""
    model = args.get("model_name_or_path") or args.get("model")
    ckpt = _true(args.get("gradient_checkpointing"))
    models = [RlModel("actor", str(model) if model else None, True, stage, False, False, ckpt)]
    notes = []
    beta = args.get("beta")
    if beta is None:
        notes.append("beta not given: trl's default (0.0 in recent releases: no reference model; 0.04 before)")
    elif isinstance(beta, (int, float)) and beta > 0:
        models.append(RlModel("reference", str(model) if model else None, False, stage))
    if _true(args.get("use_vllm")):
        mode = str(args.get("vllm_mode", "server"))
        if "vllm_mode" not in args:
            notes.append("vllm_mode not given: 'server' assumed (trl's GRPOConfig default; newer releases may "
                         "default to colocate)")
        engine = Engine("vllm", colocate=mode == "colocate",
                        gpu_memory_utilization=_fraction(args, "vllm_gpu_memory_utilization", 0.3),
                        tp=count(args, "vllm_tensor_parallel_size", 1) or 1,
                        sleep=_true(args.get("vllm_enable_sleep_mode")))
    elif args.get("ds3_gather_for_generation") is not None and not _true(args.get("ds3_gather_for_generation")):
        engine = Engine("generate")
    else:
        engine = Engine("gather-once")  # ds3_gather_for_generation: true (the default)
    per_device = count(args, "per_device_train_batch_size", 8) or 8
    dtype = "fp16" if _true(args.get("fp16")) else ("bf16" if args.get("bf16") is None or _true(args.get("bf16"))
                                                    else "fp32")
    return RlJob(models, batch=per_device, prompt_len=count(args, "max_prompt_length", 512),
                 new_tokens=count(args, "max_completion_length", 256), train_batch=per_device, dtype=dtype,
                 engine=engine, framework="trl", args=args, notes=notes,
                 engines_allowed=("generate", "gather-once", "vllm"))


READERS = {"deepspeed-chat": deepspeed_chat, "openrlhf": openrlhf, "verl": verl, "trl": trl}


def read_launch(text: str, source: str | None = None) -> RlJob | None:
    """The RL job of a launch line or script, or None when it is not one of the frameworks read here."""
    tokens = _tokens(text)
    args = parse_flags(tokens)
    framework = detect_framework(tokens, args)
    if framework is None:
        return None
    try:
        job = READERS[framework](args)
    except InputError as exc:  # a value of the line: the file named
        raise InputError(exc.problem, path=exc.path or source, hint=exc.hint) from None
    job.source = source
    if job.gpus is None:
        job.gpus = _launcher_gpus(tokens, args)
    return job


def _launcher_gpus(tokens: list[str], args: dict) -> int | None:
    """``deepspeed --num_gpus N``, ``torchrun --nproc_per_node N``, ``accelerate launch --num_processes N``."""
    for key in ("num_gpus", "nproc_per_node", "num_processes"):
        v = args.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    for i, tok in enumerate(tokens):
        if tok == "--include" and i + 1 < len(tokens) and ":" in tokens[i + 1]:
            return len(tokens[i + 1].split(":", 1)[1].split(","))
    return None


# ------------------------------------------------------------------ configs: a DeepSpeed actor config, trl YAML

def job_of_config(raw: dict, source: dict | None = None, path: str | None = None) -> RlJob | None:
    """An RL job a config shows: trl's arguments in a trainer YAML, or a DeepSpeed config with a
    ``hybrid_engine`` block (DeepSpeed-Chat writes one into every actor config, enabled or not)."""
    src = source or {}
    if any(k in src for k in ("use_vllm", "vllm_mode", "ds3_gather_for_generation")):
        zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
        stage = zero.get("stage") if isinstance(zero.get("stage"), int) else None
        job = trl(src, stage)
        job.source = path
        return job
    he = raw.get("hybrid_engine")
    if not isinstance(he, dict):
        return None
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
    stage = zero.get("stage") if isinstance(zero.get("stage"), int) else 0
    enabled = _true(he.get("enabled", False))
    engine = Engine("hybrid-engine", pin=_true(he.get("pin_parameters", True)),
                    release_cache=_true(he.get("release_inference_cache", False)),
                    tp=he.get("inference_tp_size", 1) if isinstance(he.get("inference_tp_size", 1), int) else 1) \
        if enabled else Engine("generate")
    dtype = "fp16" if _true((raw.get("fp16") or {}).get("enabled")) else (
        "bf16" if _true((raw.get("bf16") or raw.get("bfloat16") or {}).get("enabled")) else None)
    return RlJob([RlModel("actor", None, True, stage)], engine=engine, dtype=dtype, framework="deepspeed-chat",
                 source=path, notes=["only the actor's config: the reference, critic and reward are not in it"])


# ------------------------------------------------------------------ dsdoctor's job file

def _read_tree(path: Path, text: str) -> dict:
    from dsdoctor.config.load import _bound_slow_parse, _parse_json, _parse_yaml

    if text.lstrip().startswith("{"):
        data, _ = _parse_json(text, path)
    else:
        _bound_slow_parse(text, path, "YAML")  # pure Python: refused at once past the bound
        data = _parse_yaml(text, path)
    if not isinstance(data, dict):
        raise InputError("is not an RL job (a mapping of models, rollout and train settings, or a launch line)",
                         path=path)
    door.check_tree(data, path, door.RL_JOB)
    return data


def read_job(path) -> RlJob:
    """A job file (YAML/JSON: ``models``, ``rollout``, ``train``, ``engine``, ``gpus``, ``dtype``) or a launch
    line of a framework read here."""
    p = Path(path)
    text = door.read_text(p, door.RL_JOB)
    if not text.strip():
        raise InputError("is empty", path=p)
    job = read_launch(text, str(p))
    if job is not None:
        if job.framework == "trl":
            _trl_stage(job, p)
        return job
    data = _read_tree(p, text)
    if "models" not in data and any(k in data for k in ("use_vllm", "vllm_mode", "ds3_gather_for_generation")):
        job = trl(data)
        job.source = str(p)
        _trl_stage(job, p)
        return job
    if "models" not in data:
        raise InputError("is neither an RL job file (no 'models') nor a DeepSpeed-Chat, OpenRLHF, verl or trl "
                         "launch line", path=p)
    return job_from_dict(data, str(p))


def _trl_stage(job: RlJob, path: Path) -> None:
    """The policy's ZeRO stage from the DeepSpeed config the trl arguments or launch line name."""
    from dsdoctor.config.load import load_config

    try:
        loaded = load_config(path)
    except InputError:
        job.notes.append("no DeepSpeed config found for the trl job: its ZeRO stage is planned, not read")
        return
    zero = loaded.raw.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if isinstance(stage, int) and not isinstance(stage, bool):
        for m in job.models:
            m.stage = stage


def _number(where: str, v, source, low: float = 1, high: float = MAX_TOKENS, whole: bool = True):
    """A number of the job file, through ``units.number`` (finite, in range, the file and key named)."""
    return None if v is None else number(v, where, low=low, high=high, whole=whole, path=source)


def job_from_dict(data: dict, source: str | None = None) -> RlJob:
    models = []
    given = data.get("models")
    if not isinstance(given, dict) or not given:
        raise InputError("'models' must map roles (actor, reference, critic, reward) to models", path=source)
    for role, m in given.items():
        if role not in ROLES:
            raise InputError(f"unknown model role {role!r} in 'models'", path=source, hint=f"one of {', '.join(ROLES)}")
        if isinstance(m, str):
            models.append(parse_model_spec(role, m))
            continue
        if not isinstance(m, dict) or not isinstance(m.get("model"), (str, int, float)):
            raise InputError(f"models.{role} needs 'model' (a directory, config.json or size)", path=source)
        trainable = bool(m.get("trainable", role in TRAINABLE_ROLES))
        stage = _number(f"models.{role}.stage", m.get("stage"), source, 0, 3)
        models.append(RlModel(role, str(m["model"]), trainable, stage, bool(m.get("offload_param", False)),
                              bool(m.get("offload_optimizer", False)) and trainable,
                              bool(m.get("gradient_checkpointing", False))))
    rollout, train = data.get("rollout") or {}, data.get("train") or {}
    if not isinstance(rollout, dict) or not isinstance(train, dict):
        raise InputError("'rollout' and 'train' must be mappings", path=source)
    eng = data.get("engine")
    engine = None
    if isinstance(eng, str):
        eng = {"kind": eng}
    if isinstance(eng, dict):
        kind = eng.get("kind", "generate")
        if kind not in ENGINES:
            raise InputError(f"engine.kind {kind!r} is not one of {', '.join(ENGINES)}", path=source)
        engine = Engine(kind, colocate=bool(eng.get("colocate", True)),
                        gpu_memory_utilization=_number("engine.gpu_memory_utilization",
                                                       eng.get("gpu_memory_utilization"), source, 0.01, 1, False),
                        tp=_number("engine.tp", eng.get("tp", 1), source, high=MAX_GPUS),
                        gpus=_number("engine.gpus", eng.get("gpus", 0), source, 0, MAX_GPUS),
                        sleep=bool(eng.get("sleep", False)), release_cache=bool(eng.get("release_cache", False)),
                        pin=bool(eng.get("pin", True)))
    return RlJob(models, batch=_number("rollout.batch", rollout.get("batch"), source),
                 prompt_len=_number("rollout.prompt_len", rollout.get("prompt_len"), source),
                 new_tokens=_number("rollout.new_tokens", rollout.get("new_tokens"), source),
                 train_batch=_number("train.micro_batch", train.get("micro_batch"), source),
                 dtype=data.get("dtype"), gpus=_number("gpus", data.get("gpus"), source, high=MAX_GPUS), engine=engine,
                 source=source,
                 overlap_comm=bool(train.get("overlap_comm", False)))


def describe(job: RlJob) -> str:
    return json.dumps(job.to_dict(), sort_keys=True)
