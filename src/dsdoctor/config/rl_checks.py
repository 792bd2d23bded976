"""What ``check`` says about an RL job (DSD140-DSD144): the job it read, a rollout that gathers every layer for
every token, an offload flag the framework ignores, what the rollout engine costs, and a DeepSpeed config that
is an RLHF actor's. The readings are ``config/rl.py``'s; each finding takes plain values. Torch-free."""
from __future__ import annotations

from pathlib import Path

from dsdoctor.config import rl
from dsdoctor.config.load import LoadedConfig, load_config
from dsdoctor.errors import InputError
from dsdoctor.findings import Finding, Phrase
from dsdoctor.units import human_bytes

FRAMEWORK_LABELS = {"deepspeed-chat": "DeepSpeed-Chat", "openrlhf": "OpenRLHF", "verl": "verl", "trl": "trl"}


def launch_config(path) -> tuple[LoadedConfig, rl.RlJob] | None:
    """For an RL launch line or script: the config the actor trains with (built as the framework builds it,
    or the one the line names) and the job; None when the file is not an RL launch line."""
    from dsdoctor.config.load import looks_like_command, read_text

    p = Path(path)
    if not p.is_file():
        return None
    text = read_text(p)
    if text.lstrip().startswith(("{", "[")):
        return None
    job = rl.read_launch(text, str(p))
    if job is None:
        return None
    label = FRAMEWORK_LABELS[job.framework]
    src = {"_raw_deepspeed": "rl", "_command": f"{label} launch line"}
    if job.framework == "deepspeed-chat":
        return LoadedConfig(str(p), rl.deepspeed_chat_actor_config(job), "command", source=src), job
    if job.framework == "openrlhf":
        return LoadedConfig(str(p), rl.openrlhf_actor_config(job), "command", source=src), job
    if job.framework == "verl":
        loaded = LoadedConfig(str(p), {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, "command",
                              source=src)
        loaded.notes.append("verl trains with FSDP (parameters, gradients and optimizer state sharded): shown as "
                            "the ZeRO-3 it is planned as")
        return loaded, job
    loaded = None
    if looks_like_command(text):
        try:
            loaded = load_config(p)  # trl through accelerate launch --config_file / --deepspeed
        except InputError:
            loaded = None
    if loaded is None:
        loaded = LoadedConfig(str(p), {}, "command", source=src)
        loaded.notes.append("the launch line names no DeepSpeed config: the policy's ZeRO stage is not known")
    stage = loaded.raw.get("zero_optimization", {}).get("stage") if isinstance(
        loaded.raw.get("zero_optimization"), dict) else None
    for m in job.models:
        m.stage = stage if isinstance(stage, int) else None
    return loaded, job


def _size(source) -> str:
    from dsdoctor.config.runner import size_from_name

    named = size_from_name(str(source)) if source else None
    return f" ({named}: about {human_bytes(float(named[:-1]) * 2e9)} in 16 bits)" if named else ""


def _models_phrase(job: rl.RlJob) -> Phrase:
    parts = []
    for m in job.models:
        stage = "?" if m.stage is None else m.stage
        parts.append(Phrase("model", {"role": m.role, "kind": Phrase("trained" if m.trainable else "frozen"),
                                      "stage": stage}))
    return Phrase.join("list", parts) if parts else Phrase("none")


def _engine_phrase(e: rl.Engine | None) -> Phrase:
    e = e or rl.Engine()
    if e.kind == "vllm":
        return Phrase("engine-vllm-colocated" if e.colocate else "engine-vllm-apart",
                      {"util": e.gpu_memory_utilization, "tp": e.tp})
    return Phrase({"gather-once": "engine-gather-once", "hybrid-engine": "engine-hybrid-engine"}.get(
        e.kind, "engine-generate"))


def findings(job: rl.RlJob, stage_of_actor: int | None, gpus: int | None) -> list[Finding]:
    out: list[Finding] = []
    fw = job.framework or "job"
    actor = job.model("actor")
    stage = actor.stage if actor and actor.stage is not None else stage_of_actor
    if job.framework and job.args:
        shape = Phrase("shape", {"batch": job.batch, "prompt": job.prompt_len, "new": job.new_tokens,
                                 "train": job.train_batch}) if job.batch else Phrase("none")
        out.append(Finding("DSD140", {"framework": FRAMEWORK_LABELS.get(fw, fw), "models": _models_phrase(job),
                                      "engine": _engine_phrase(job.engine), "shape": shape,
                                      "source": job.source or "-"}))
    engine = job.engine or rl.Engine()
    per_layer = stage == 3 and (engine.kind == "generate" or (engine.kind == "hybrid-engine" and not engine.pin))
    if per_layer:
        how = {"deepspeed-chat": "dschat-no-hybrid", "trl": "trl-no-gather", "openrlhf": "openrlhf-hf",
               "verl": "verl-hf"}.get(fw, "config-disabled")
        if engine.kind == "hybrid-engine":
            how = "unpinned"
        elif fw == "deepspeed-chat" and not job.args:  # the actor's config alone
            how = "config-disabled"
        fix = {"dschat-no-hybrid": "fix-dschat", "unpinned": "fix-pin", "trl-no-gather": "fix-trl",
               "openrlhf-hf": "fix-openrlhf", "verl-hf": "fix-verl"}.get(how, "fix-config")
        out.append(Finding("DSD141", {"how": Phrase(how), "fix": Phrase(fix)}))
    flags_seen = set()
    for m in job.models:
        if m.trainable or not m.offload_param or m.stage == 3 or job.framework not in ("deepspeed-chat", "openrlhf"):
            continue
        flag = {"deepspeed-chat": {"reward": "--offload_reward_model"}.get(m.role, "--offload_reference_model"),
                "openrlhf": "--ref_reward_offload"}[job.framework]
        follows = {"deepspeed-chat": ("critic", "--critic_zero_stage") if m.role == "reward" else
                   ("actor", "--actor_zero_stage"), "openrlhf": ("actor", "--zero_stage")}[job.framework]
        if flag in flags_seen:
            continue
        flags_seen.add(flag)
        out.append(Finding("DSD142", {"flag": flag, "framework": FRAMEWORK_LABELS[job.framework], "role": m.role,
                                      "follows": follows[0], "stage_flag": follows[1], "size": _size(m.source)}))
    if engine.kind != "generate" and not per_layer:
        out.append(Finding("DSD143", {"engine": _engine_phrase(engine), "cost": _engine_cost(engine, stage)}))
    return out


def _engine_cost(e: rl.Engine, stage: int | None) -> Phrase:
    if e.kind == "vllm":
        if not e.colocate:
            return Phrase("cost-vllm-apart")
        return Phrase("cost-vllm-colocated", {"util": e.gpu_memory_utilization,
                                              "sleep": Phrase("sleep" if e.sleep else "no-sleep")})
    if e.kind == "hybrid-engine":
        return Phrase("cost-hybrid-z3" if stage == 3 else "cost-hybrid",
                      {"release": Phrase("released" if e.release_cache else "kept")})
    return Phrase("cost-gather-once" if stage == 3 else "cost-whole")


def actor_config_finding(loaded: LoadedConfig) -> Finding | None:
    """DSD144: a DeepSpeed config with a hybrid_engine block is an RLHF actor's."""
    he = loaded.raw.get("hybrid_engine")
    if not isinstance(he, dict):
        return None
    return Finding("DSD144", {"config": loaded.name, "enabled": str(rl._true(he.get("enabled", False))).lower()})
