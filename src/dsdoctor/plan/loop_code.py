"""What the recommendation of an RL job emits: the DeepSpeed config of every model, and the change to make in
the job's own words (the framework's flags, or a training script for a job without one). The dtype is the
user's: fp16 keeps a dynamic loss-scaling section (DeepSpeed's defaults: ``loss_scale`` 0,
``initial_scale_power`` 16, ``loss_scale_window`` 1000, ``hysteresis`` 2, ``min_loss_scale`` 1), and every
``from_pretrained`` loads in that dtype."""
from __future__ import annotations

from dsdoctor.plan.loop import TORCH_DTYPE, training_dtype_section
from dsdoctor.plan.loop_memory import effective

TORCH = TORCH_DTYPE


def ds_config(hold, trainable: bool, dtype: str, train_batch: int) -> dict:
    h = effective(hold, trainable)
    zero: dict = {"stage": h.stage}
    if h.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if h.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    cfg = {**(training_dtype_section(dtype) if trainable else _frozen_dtype(dtype)), "zero_optimization": zero,
           "train_micro_batch_size_per_gpu": train_batch}
    if trainable:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-6}}
        cfg["gradient_clipping"] = 1.0
    return cfg


def _frozen_dtype(dtype: str) -> dict:
    return {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}.get(dtype, {})


def job_ds_configs(job, cand, dtype: str, train_batch: int) -> dict:
    return {m.role: ds_config(cand.holds[m.role], m.trainable, dtype, train_batch) for m in job.models}


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
    "from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation\n"
    "with torch.no_grad(), unwrap_model_for_generation(self.actor_model):\n"
    "    seq = self.actor_model.module.generate(prompts, attention_mask=mask, max_length=max_min_length,\n"
    "                                           pad_token_id=self.tokenizer.pad_token_id)\n")


def job_code(job, resolved, cand, changes: list, dtype: str, train_batch: int = 1) -> str:
    fw = job.framework
    if fw in ("deepspeed-chat", "openrlhf"):
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
    if fw == "verl":
        sets = [f"{k}={_value(v)}" for k, _a, v in changes]
        return "# verl: the overrides to change\npython3 -m verl.trainer.main_ppo ... " + " ".join(sets) + "\n"
    if fw == "trl":
        ds = [f"{k}: {_value(v)}" for k, _a, v in changes if k in ("zero_stage", "offload_param_device",
                                                                  "offload_optimizer_device")]
        args = [f"{k}: {_value(v)}" for k, _a, v in changes if k not in ("zero_stage", "offload_param_device",
                                                                        "offload_optimizer_device")]
        out = ["# trl: what to change"]
        if ds:
            out += ["# accelerate config, deepspeed_config:"] + [f"  {x}" for x in ds]
        if args:
            out += ["# GRPOConfig (YAML or flags):"] + args
        return "\n".join(out) + "\n"
    return script(job, resolved, cand, dtype, train_batch)


def _value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def script(job, resolved, cand, dtype: str, train_batch: int = 1) -> str:
    """A training script with every model of the job held as the arrangement says."""
    t = TORCH.get(dtype, "torch.bfloat16")
    eng = cand.engine
    lines = [f"# deepspeed --num_gpus {cand.train_gpus} train_rl.py",
             "import deepspeed, torch",
             "from transformers import AutoModelForCausalLM"]
    if eng.kind == "gather-once":
        lines.append("from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation")
    engines = {}
    for m in job.models:
        cfg = ds_config(cand.holds[m.role], m.trainable, dtype, train_batch)
        if m.role == "actor" and eng.kind == "hybrid-engine":
            cfg["hybrid_engine"] = {"enabled": True, "pin_parameters": eng.pin,
                                    "release_inference_cache": eng.release_cache,
                                    "max_out_tokens": (job.prompt_len or 512) + (job.new_tokens or 128)}
        name = {"reference": "ref"}.get(m.role, m.role)
        lines.append(f"{name}_config = {cfg!r}")
        r = resolved[m.role]
        path = repr(r.source) if r.how != "size" else repr("./" + m.role)
        note = f"  # a {r.source} model, given by its size" if r.how == "size" else ""
        lines.append(f"{name} = AutoModelForCausalLM.from_pretrained({path}, dtype={t}){note}")
        if m.trainable:
            lines.append(f"{name}_engine, *_ = deepspeed.initialize(model={name}, model_parameters={name}.parameters(), "
                         f"config={name}_config)")
        else:
            lines.append(f"{name}_engine, *_ = deepspeed.initialize(model={name}, config={name}_config)  # frozen")
        engines[m.role] = f"{name}_engine"
    actor = engines["actor"]
    gen = f"{actor}.module.generate(**prompts, max_new_tokens={job.new_tokens or 'N'}"
    synced = effective(cand.holds["actor"], True).stage == 3 and eng.kind == "generate"
    if eng.kind == "gather-once":
        lines += [f"with unwrap_model_for_generation({actor}):  # one all-gather, ZeRO-3's hooks lifted",
                  f"    rollouts = {gen})"]
    elif eng.kind == "hybrid-engine":
        lines.append(f"rollouts = {actor}.generate(**prompts, max_new_tokens={job.new_tokens or 'N'})"
                     "  # DeepSpeedHybridEngine")
    elif eng.kind == "vllm":
        lines.append("# rollouts from the vLLM engine; sync the actor's weights to it after every step")
    else:
        lines.append(f"rollouts = {gen}" + (", synced_gpus=True)" if synced else ")"))
    lines.append(f"loss = ppo_loss(rollouts, {', '.join(engines.values())})")
    for role in ("actor", "critic"):
        if role in engines:
            lines.append(f"{engines[role]}.backward(loss_of_{role}); {engines[role]}.step()")
    return "\n".join(lines) + "\n"
