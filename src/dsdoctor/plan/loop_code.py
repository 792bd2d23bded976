"""What a loop's recommendation emits: the DeepSpeed config every model trains or runs with, and the change to
make in the job's own words (the framework's flags, or a training script for a job without one and for the
actor alone of ``plan --loop``). The dtype is the user's: a trained model's fp16 keeps a dynamic loss-scaling
section (DeepSpeed's defaults: ``loss_scale`` 0, ``initial_scale_power`` 16, ``loss_scale_window`` 1000,
``hysteresis`` 2, ``min_loss_scale`` 1; without it an fp16 user would train in fp32), and every
``from_pretrained`` loads in that dtype."""
from __future__ import annotations

from dsdoctor.dtypes import TORCH_NAMES

FP16_SCALING = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                "hysteresis": 2, "min_loss_scale": 1}
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-6}}
UNWRAP = "from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation"


def torch_dtype(dtype: str) -> str:
    return "torch." + TORCH_NAMES.get(dtype, "bfloat16")


def dtype_section(dtype: str, trainable: bool = False) -> dict:
    """The precision section of a DeepSpeed config: bf16, fp16 (with dynamic loss scaling for a trained model),
    fp32 none (bf16 needs compute capability 8.0: the dtype is the run's)."""
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    if dtype == "fp16":
        return {"fp16": dict(FP16_SCALING) if trainable else {"enabled": True}}
    return {}


def zero_section(hold) -> dict:
    """The ``zero_optimization`` of a hold (``loop_memory.Hold``, as DeepSpeed takes it)."""
    zero: dict = {"stage": hold.stage}
    if hold.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if hold.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return zero


def ds_config(zero: dict, trainable: bool, dtype: str, train_batch: int) -> dict:
    """The DeepSpeed config a model of a loop runs with: a trained one's with its optimizer."""
    cfg = {**dtype_section(dtype, trainable), "zero_optimization": zero, "train_micro_batch_size_per_gpu": train_batch}
    if trainable:
        cfg["optimizer"] = OPTIMIZER
        cfg["gradient_clipping"] = 1.0
    return cfg


def job_ds_configs(job, cand, dtype: str, train_batch: int) -> dict:
    return {m.role: ds_config(zero_section(cand.holds[m.role].effective(m.trainable)), m.trainable, dtype, train_batch)
            for m in job.models}


def _flag_lines(changes: list) -> tuple[list, list]:
    add, drop = [], []
    for key, _before, after in changes:
        if not key.startswith("--"):
            continue
        if after is True:
            add.append(key)
        elif after is False:
            drop.append(key)
        elif after is not None:
            add.append(f"{key} {after}")
    return add, drop


GATHER_ONCE_DSCHAT = (
    "# dschat/rlhf/ppo_trainer.py, DeepSpeedPPOTrainer._generate_sequence: gather the actor once per generate\n"
    f"{UNWRAP}\n"
    "with torch.no_grad(), unwrap_model_for_generation(self.actor_model):\n"
    "    seq = self.actor_model.module.generate(prompts, attention_mask=mask, max_length=max_min_length,\n"
    "                                           pad_token_id=self.tokenizer.pad_token_id)\n")
TRL_DEEPSPEED = ("zero_stage", "offload_param_device", "offload_optimizer_device")


def _flags_code(fw: str, changes: list) -> str:
    add, drop = _flag_lines(changes)
    cmd = "deepspeed main.py" if fw == "deepspeed-chat" else "python3 -m openrlhf.cli.train_ppo_ray"
    lines = [f"# {fw}: the flags to change (the rest of the launch line as it is)"]
    if add:
        lines.append(f"{cmd} ... " + " ".join(add))
    if drop:
        lines.append("# and remove: " + " ".join(drop))
    if not add and not drop:
        lines.append("# no flag changes")
    code = "\n".join(lines) + "\n"
    if any(k == "rollout" and v and "gather-once" in str(v) for k, _a, v in changes):
        code += GATHER_ONCE_DSCHAT
    return code


def _trl_code(changes: list) -> str:
    ds = [f"{k}: {_value(v)}" for k, _a, v in changes if k in TRL_DEEPSPEED]
    args = [f"{k}: {_value(v)}" for k, _a, v in changes if k not in TRL_DEEPSPEED]
    out = ["# trl: what to change"]
    if ds:
        out += ["# accelerate config, deepspeed_config:"] + [f"  {x}" for x in ds]
    if args:
        out += ["# GRPOConfig (YAML or flags):"] + args
    return "\n".join(out) + "\n"


def job_code(job, resolved, cand, changes: list, dtype: str, train_batch: int = 1) -> str:
    fw = job.framework
    if fw in ("deepspeed-chat", "openrlhf"):
        return _flags_code(fw, changes)
    if fw == "verl":
        sets = [f"{k}={_value(v)}" for k, _a, v in changes]
        return "# verl: the overrides to change\npython3 -m verl.trainer.main_ppo ... " + " ".join(sets) + "\n"
    if fw == "trl":
        return _trl_code(changes)
    configs = job_ds_configs(job, cand, dtype, train_batch)
    models = []
    for m in job.models:
        r = resolved[m.role]
        sized = r.how == "size"
        models.append((m.role, configs[m.role], repr("./" + m.role if sized else r.source),
                       f"  # a {r.source} model, given by its size" if sized else "", m.trainable))
    return script(models, cand.engine, cand.train_gpus, dtype, job.new_tokens,
                  (job.prompt_len or 512) + (job.new_tokens or 128))


def actor_config(zero: dict, knobs, dtype: str, train_batch: int) -> dict:
    """The training config of the actor alone (``plan --loop``) on a path whose ZeRO section is ``zero``, with
    the user's config's offload_optimizer where it has one (the memory counts it on the host)."""
    if knobs is not None and knobs.offload_optimizer:
        zero = dict(zero, offload_optimizer={"device": "cpu", "pin_memory": True})
    return ds_config(zero, True, dtype, train_batch)


def actor_script(cfg: dict, model: str, engine, gpus: int, dtype: str) -> str:
    """The training script of the actor alone: trained with ``cfg``, generating its rollouts with ``engine``."""
    return script([("actor", cfg, repr(model), "", True)], engine, gpus, dtype)


def _value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def script(models: list, engine, gpus: int, dtype: str, new_tokens: int | None = None, max_out: int = 0) -> str:
    """A training script with every model held as its config says: ``models`` is (role, DeepSpeed config, the
    source expression, a note, trainable) per model; the actor generates with ``engine``; the hybrid engine
    holds ``max_out`` positions."""
    lines = [f"# deepspeed --num_gpus {gpus} train_rl.py", "import deepspeed, torch",
             "from transformers import AutoModelForCausalLM"] + ([UNWRAP] if engine.kind == "gather-once" else [])
    engines = {}
    for role, cfg, source, note, trainable in models:
        if role == "actor" and engine.kind == "hybrid-engine":
            cfg = dict(cfg, hybrid_engine={"enabled": True, "pin_parameters": engine.pin,
                                           "release_inference_cache": engine.release_cache, "max_out_tokens": max_out})
        name = {"reference": "ref"}.get(role, role)
        lines += [f"{name}_config = {cfg!r}",
                  f"{name} = AutoModelForCausalLM.from_pretrained({source}, dtype={torch_dtype(dtype)}){note}"]
        if trainable:
            lines.append(f"{name}_engine, *_ = deepspeed.initialize(model={name}, model_parameters={name}.parameters(), "
                         f"config={name}_config)")
        else:
            lines.append(f"{name}_engine, *_ = deepspeed.initialize(model={name}, config={name}_config)  # frozen")
        engines[role] = f"{name}_engine"
    actor = engines["actor"]
    stage = next(cfg for role, cfg, *_ in models if role == "actor")["zero_optimization"]["stage"]
    gen = f"{actor}.module.generate(**prompts, max_new_tokens={new_tokens or 'N'}"
    if engine.kind == "gather-once":
        lines += [f"with unwrap_model_for_generation({actor}):  # one all-gather, ZeRO-3's hooks lifted",
                  f"    rollouts = {gen})"]
    elif engine.kind == "hybrid-engine":
        lines.append(f"rollouts = {actor}.generate(**prompts, max_new_tokens={new_tokens or 'N'})"
                     "  # DeepSpeedHybridEngine")
    elif engine.kind == "vllm":
        lines.append("# rollouts from the vLLM engine; sync the actor's weights to it after every step")
    else:
        lines.append(f"rollouts = {gen}" + (", synced_gpus=True)" if stage == 3 else ")"))
    lines.append(f"loss = ppo_loss(rollouts, {', '.join(engines.values())})")
    for role in ("actor", "critic"):
        if role in engines:
            lines.append(f"{engines[role]}.backward(loss_of_{role}); {engines[role]}.step()")
    return "\n".join(lines) + "\n"
