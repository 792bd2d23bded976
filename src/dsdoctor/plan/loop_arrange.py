"""The arrangements ``plan --loop`` compares for an RL job, in the words of the job's framework.

An arrangement is how each model is held (``loop_memory.Hold``) and how the actor generates (``config.rl.Engine``).
What may change depends on what the framework can set without new code, and what it ties together:

* DeepSpeed-Chat: ``--actor_zero_stage``, ``--critic_zero_stage``; ``--offload`` (parameters and optimizer of the
  actor and the critic at once); ``--offload_reference_model``, ``--offload_reward_model``; the reference and
  EMA run at stage 3 only when the actor does, the reward model only when the critic does;
  ``--enable_hybrid_engine`` with ``--unpin_actor_parameters`` and ``--release_inference_cache``; gather-once
  is a code change (wrap the actor's generate in ``unwrap_model_for_generation``).
* OpenRLHF: one ``--zero_stage`` for the actor and critic (the frozen models at 3 only with it), ``--adam_offload``,
  ``--ref_reward_offload``; a colocated vLLM engine's ``--vllm_gpu_memory_utilization`` and ``--vllm_enable_sleep``.
* verl: FSDP (stage 3) always; each model's ``param_offload``/``optimizer_offload``; the rollout engine's
  ``gpu_memory_utilization`` and ``tensor_model_parallel_size``.
* trl: the DeepSpeed stage of the policy (the reference follows it), its offloads; ``ds3_gather_for_generation``;
  ``use_vllm`` with ``vllm_mode`` colocate (``vllm_gpu_memory_utilization``, ``vllm_enable_sleep_mode``) or server.
* a job file or flags: every model independently, and the engines the job allows.

Torch-free.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from dsdoctor.config.rl import Engine
from dsdoctor.errors import InputError
from dsdoctor.plan.loop_memory import Hold

UTILIZATIONS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def engine_label(e: Engine) -> str:
    if e.kind == "vllm":
        where = f"colocated {e.gpu_memory_utilization:g}" if e.colocate else f"{e.gpus} GPU(s) of its own"
        return f"vllm ({where}, tp {e.tp}{', sleep' if e.sleep else ''})"
    if e.kind == "hybrid-engine":
        bits = ([] if e.pin else ["unpinned"]) + (["release cache"] if e.release_cache else [])
        return "hybrid-engine" + (f" ({', '.join(bits)})" if bits else "")
    return e.kind


def engine_of(job) -> Engine:
    """The actor's rollout engine as the job gives it (HF generate when it says none)."""
    e = job.engine or Engine()
    return dataclasses.replace(e, tp=e.tp or 1, gpus=e.gpus or 0)


@dataclass
class Candidate:
    holds: dict  # role -> Hold
    engine: Engine
    settings: dict  # the framework's setting -> value (what a user changes)
    train_gpus: int
    code_change: bool = False  # needs a code edit (gather-once in DeepSpeed-Chat)
    notes: list = field(default_factory=list)


def _stages(given) -> list:
    return sorted({2, 3} | ({given} if given is not None else set()))


def _utils(given) -> list:
    return sorted(set(UTILIZATIONS) | ({given} if given else set()))


def _frozen_follow(stage: int) -> int:
    return 3 if stage == 3 else 0


def _colocated(eng: Engine, sleeps) -> list:
    """A colocated vLLM engine at every memory fraction, with the sleep modes ``sleeps``."""
    return [Engine("vllm", True, u, eng.tp, 0, s) for u in _utils(eng.gpu_memory_utilization) for s in sleeps]


# ------------------------------------------------------------------ each framework: its space and its settings

def deepspeed_chat(job, gpus: int):
    actor, critic = job.model("actor"), job.model("critic")
    engines = [Engine("generate"), Engine("hybrid-engine", pin=True), Engine("hybrid-engine", pin=False),
               Engine("hybrid-engine", pin=True, release_cache=True), Engine("gather-once")]
    eng = engine_of(job)
    engines += [] if eng in engines else [eng]
    frozen = [m for m in job.models if not m.trainable]
    for a_stage, c_stage, offload, ref_off, rew_off, engine in itertools.product(
            _stages(actor.stage), _stages(critic.stage if critic else None),
            sorted({bool(actor.offload_optimizer), False, True}), (False, True), (False, True), engines):
        if engine.kind == "gather-once" and a_stage != 3:
            continue
        holds = {"actor": Hold(a_stage, offload, offload)}
        if critic:
            holds["critic"] = Hold(c_stage, offload, offload)
        for m in frozen:
            follow = a_stage if m.role in ("reference", "ema") else c_stage
            holds[m.role] = Hold(_frozen_follow(follow), ref_off if m.role != "reward" else rew_off)
        yield holds, engine


def deepspeed_chat_settings(job, holds: dict, engine: Engine) -> dict:
    hybrid = engine.kind == "hybrid-engine"
    out = {"--actor_zero_stage": holds["actor"].stage, "--offload": holds["actor"].offload_optimizer,
           "--offload_reference_model": "reference" in holds and holds["reference"].offload_param,
           "--enable_hybrid_engine": hybrid, "--unpin_actor_parameters": hybrid and not engine.pin,
           "--release_inference_cache": hybrid and engine.release_cache,
           "rollout": "gather-once (unwrap_model_for_generation)" if engine.kind == "gather-once" else None}
    if "critic" in holds:
        out["--critic_zero_stage"] = holds["critic"].stage
    if "reward" in holds:
        out["--offload_reward_model"] = holds["reward"].offload_param
    return out


def openrlhf(job, gpus: int):
    eng = engine_of(job)
    engines = _colocated(eng, sorted({eng.sleep, True})) if eng.kind == "vllm" and eng.colocate else [eng]
    for stage, adam, off, engine in itertools.product(_stages(job.model("actor").stage), (False, True),
                                                      (False, True), engines):
        yield {m.role: Hold(stage, False, adam) if m.trainable else Hold(_frozen_follow(stage), off)
               for m in job.models}, engine


def openrlhf_settings(job, holds: dict, engine: Engine) -> dict:
    actor = holds["actor"]
    frozen = [holds[m.role] for m in job.models if not m.trainable]
    out = {"--zero_stage": actor.stage, "--adam_offload": actor.offload_optimizer,
           "--ref_reward_offload": any(h.offload_param for h in frozen)}
    if engine.kind == "vllm" and engine.colocate:
        out.update({"--vllm_gpu_memory_utilization": engine.gpu_memory_utilization, "--vllm_enable_sleep": engine.sleep})
    return out


def verl(job, gpus: int):
    eng = engine_of(job)
    tps = sorted({t for t in (1, 2, 4, 8, eng.tp) if gpus % t == 0})
    engines = [eng]
    if eng.kind == "vllm":
        engines = [Engine("vllm", True, u, t, 0, eng.sleep) for u in _utils(eng.gpu_memory_utilization) for t in tps]
    offload_opts = [(p, o) for p in (False, True) for o in (False, True)]
    per_model = [[(p, o if m.trainable else False) for p, o in offload_opts if m.trainable or not o] for m in job.models]
    for combo in itertools.product(*per_model):
        holds = {m.role: Hold(3, p, o) for m, (p, o) in zip(job.models, combo)}
        for engine in engines:
            yield holds, engine


_VERL_PREFIX = {"actor": "actor_rollout_ref.actor", "reference": "actor_rollout_ref.ref", "critic": "critic.model",
                "reward": "reward_model.model"}


def verl_settings(job, holds: dict, engine: Engine) -> dict:
    out = {}
    for role, h in holds.items():
        prefix = _VERL_PREFIX.get(role, role)
        out[f"{prefix}.fsdp_config.param_offload"] = h.offload_param
        if role in ("actor", "critic"):
            out[f"{prefix}.fsdp_config.optimizer_offload"] = h.offload_optimizer
    if engine.kind == "vllm":
        out["actor_rollout_ref.rollout.gpu_memory_utilization"] = engine.gpu_memory_utilization
        out["actor_rollout_ref.rollout.tensor_model_parallel_size"] = engine.tp
    return out


def trl(job, gpus: int):
    eng = engine_of(job)
    engines = [Engine("generate"), Engine("gather-once")]
    if eng.kind == "vllm":
        engines += _colocated(eng, (False, True)) if eng.colocate else [eng]
    for stage, op, oo, engine in itertools.product(_stages(job.model("actor").stage), (False, True), (False, True),
                                                   engines):
        if stage != 3 and (op or engine.kind == "gather-once"):
            continue
        holds = {"actor": Hold(stage, op, oo)}
        if job.model("reference"):
            holds["reference"] = Hold(_frozen_follow(stage))
        yield holds, engine


def trl_settings(job, holds: dict, engine: Engine) -> dict:
    a = holds["actor"]
    out = {"zero_stage": a.stage, "offload_param_device": "cpu" if a.offload_param else "none",
           "offload_optimizer_device": "cpu" if a.offload_optimizer else "none"}
    if engine.kind == "vllm":
        out.update({"use_vllm": True, "vllm_mode": "colocate" if engine.colocate else "server"})
        if engine.colocate:
            out.update({"vllm_gpu_memory_utilization": engine.gpu_memory_utilization, "vllm_enable_sleep_mode": engine.sleep})
    else:
        out.update({"use_vllm": False, "ds3_gather_for_generation": engine.kind == "gather-once"})
    return out


def generic(job, gpus: int):
    eng = engine_of(job)
    engines = [Engine(k) for k in job.engines_allowed if k in ("generate", "gather-once", "hybrid-engine")]
    if eng.kind == "vllm":
        engines += _colocated(eng, sorted({eng.sleep, True})) if eng.colocate else [eng]
    elif eng not in engines:
        engines.append(eng)
    per_model = []
    for m in job.models:
        opts = {Hold(0), Hold(3), Hold(3, True)}
        if m.trainable:
            opts = {h for s in _stages(m.stage) for h in (Hold(s), Hold(s, False, True))} | {Hold(3, True, True)}
        if m.stage is not None:
            opts.add(Hold(m.stage, m.offload_param, m.offload_optimizer))
        per_model.append(sorted({h.effective(m.trainable) for h in opts},
                                key=lambda h: (h.stage, h.offload_param, h.offload_optimizer)))
    for combo in itertools.product(*per_model):
        holds = {m.role: h for m, h in zip(job.models, combo)}
        for engine in engines:
            if engine.kind != "gather-once" or holds["actor"].stage == 3:
                yield holds, engine


def generic_settings(job, holds: dict, engine: Engine) -> dict:
    out = {}
    for role, h in holds.items():
        out[f"{role} stage"] = h.stage
        out[f"{role} offload_param"] = h.offload_param
        out[f"{role} offload_optimizer"] = h.offload_optimizer
    out["rollout"] = engine_label(engine)
    return out


# framework -> (its arrangements, their settings, the rollout kinds that are a code change, a vLLM server's
# GPUs taken from training, flags set as given even where DeepSpeed ignores them)
SPACES = {"deepspeed-chat": (deepspeed_chat, deepspeed_chat_settings, ("gather-once",), False, True),
          "openrlhf": (openrlhf, openrlhf_settings, (), False, True),
          "verl": (verl, verl_settings, (), False, False),
          "trl": (trl, trl_settings, (), True, False),
          None: (generic, generic_settings, ("gather-once", "hybrid-engine"), True, False)}


def _space(job) -> tuple:
    """The job's framework's space; a framework whose trained models do not all name a stage is searched as a
    job file (every model independently), except trl (its policy's stage comes from its DeepSpeed config)."""
    fw = job.framework if job.framework in SPACES else None
    if fw not in (None, "trl") and not all(m.stage is not None for m in job.models if m.trainable):
        fw = None
    return SPACES[fw]


def _candidate(job, space: tuple, holds: dict, engine: Engine, gpus: int, code_change: bool) -> Candidate | None:
    """The arrangement, or None when a vLLM server on GPUs of its own leaves none for training."""
    _arrangements, settings, _code, apart, _raw = space
    train = gpus - (engine.gpus if apart and engine.kind == "vllm" and not engine.colocate else 0)
    return Candidate(holds, engine, settings(job, holds, engine), train, code_change=code_change) if train > 0 else None


def candidates(job, gpus: int):
    """Every arrangement the job's framework can be switched to (the actor's job must name a stage where the
    framework has one)."""
    space = _space(job)
    for holds, engine in space[0](job, gpus):
        cand = _candidate(job, space, holds, engine, gpus, engine.kind in space[2])
        if cand is not None:
            yield cand


def given(job, gpus: int) -> Candidate | None:
    """The job as the user runs it, or None when it does not say every model's stage."""
    if any(m.stage is None for m in job.models):
        return None
    space = _space(job)
    holds = {m.role: Hold(m.stage, m.offload_param, m.offload_optimizer) for m in job.models}
    if not space[4]:  # the framework's settings say what DeepSpeed does with them
        holds = {m.role: holds[m.role].effective(m.trainable) for m in job.models}
    cand = _candidate(job, space, holds, engine_of(job), gpus, False)
    if cand is None:
        raise InputError(f"the vLLM engine's {job.engine.gpus} GPU(s) of its own leave none of the {gpus} for training",
                         path=job.source, hint="give --gpus the training GPUs and the engine's together")
    return cand


def changes(chosen: Candidate, base: Candidate | None) -> list[tuple]:
    """(setting, from, to) for every setting the chosen arrangement changes; all of them without a base."""
    out = []
    for key, value in chosen.settings.items():
        if base is None:  # nothing to compare with: what the arrangement sets
            if value not in (None, False):
                out.append((key, None, value))
            continue
        before = base.settings.get(key)
        if before != value and not (value is None and before is None):
            out.append((key, before, value))
    return out
