"""The arrangements ``plan --loop`` compares for an RL job, in the words of the job's framework.

An arrangement is how each model is held (``loop_memory.Hold``) and how the actor generates (``Choice``).
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

import itertools
from dataclasses import dataclass, field

from dsdoctor.plan.loop_memory import Hold, effective

UTILIZATIONS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class Choice:
    """The actor's rollout engine in one arrangement."""
    kind: str  # generate, gather-once, hybrid-engine, vllm
    colocate: bool = True
    util: float | None = None
    tp: int = 1
    gpus: int = 0  # a separate vLLM engine's GPUs
    sleep: bool = False
    release_cache: bool = False
    pin: bool = True

    @property
    def gpu_memory_utilization(self):  # the name loop_memory.engine_parts reads
        return self.util

    @property
    def label(self) -> str:
        if self.kind == "vllm":
            where = f"colocated {self.util:g}" if self.colocate else f"{self.gpus} GPU(s) of its own"
            return f"vllm ({where}, tp {self.tp}{', sleep' if self.sleep else ''})"
        if self.kind == "hybrid-engine":
            bits = [] if self.pin else ["unpinned"]
            bits += ["release cache"] if self.release_cache else []
            return "hybrid-engine" + (f" ({', '.join(bits)})" if bits else "")
        return self.kind


def choice_of(engine) -> Choice:
    if engine is None:
        return Choice("generate")
    return Choice(engine.kind, engine.colocate, engine.gpu_memory_utilization, engine.tp or 1, engine.gpus or 0,
                  engine.sleep, engine.release_cache, engine.pin)


@dataclass
class Candidate:
    holds: dict  # role -> Hold
    engine: Choice
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


def deepspeed_chat(job, gpus: int):
    actor, critic = job.model("actor"), job.model("critic")
    eng = choice_of(job.engine)
    given_offload = bool(actor.offload_optimizer)
    engines = [Choice("generate"), Choice("hybrid-engine", pin=True), Choice("hybrid-engine", pin=False),
               Choice("hybrid-engine", pin=True, release_cache=True), Choice("gather-once")]
    if eng not in engines:
        engines.append(eng)
    frozen = [m for m in job.models if not m.trainable]
    for a_stage, c_stage, offload, ref_off, rew_off, engine in itertools.product(
            _stages(actor.stage), _stages(critic.stage if critic else None), sorted({given_offload, False, True}),
            (False, True), (False, True), engines):
        if engine.kind == "gather-once" and a_stage != 3:
            continue
        holds = {"actor": Hold(a_stage, offload, offload)}
        if critic:
            holds["critic"] = Hold(c_stage, offload, offload)
        for m in frozen:
            follow = a_stage if m.role in ("reference", "ema") else c_stage
            holds[m.role] = Hold(_frozen_follow(follow), ref_off if m.role != "reward" else rew_off)
        settings = {"--actor_zero_stage": a_stage, "--offload": offload,
                    "--offload_reference_model": ref_off, "--enable_hybrid_engine": engine.kind == "hybrid-engine",
                    "--unpin_actor_parameters": engine.kind == "hybrid-engine" and not engine.pin,
                    "--release_inference_cache": engine.kind == "hybrid-engine" and engine.release_cache,
                    "rollout": "gather-once (unwrap_model_for_generation)" if engine.kind == "gather-once" else None}
        if critic:
            settings["--critic_zero_stage"] = c_stage
        if job.model("reward"):
            settings["--offload_reward_model"] = rew_off
        yield Candidate(holds, engine, settings, gpus, code_change=engine.kind == "gather-once")


def deepspeed_chat_given(job, gpus: int) -> Candidate:
    actor, critic = job.model("actor"), job.model("critic")
    ref, reward = job.model("reference"), job.model("reward")
    holds = {m.role: Hold(m.stage or 0, m.offload_param, m.offload_optimizer) for m in job.models}
    eng = choice_of(job.engine)
    settings = {"--actor_zero_stage": actor.stage or 0, "--offload": bool(actor.offload_optimizer),
                "--offload_reference_model": bool(ref and ref.offload_param),
                "--enable_hybrid_engine": eng.kind == "hybrid-engine",
                "--unpin_actor_parameters": eng.kind == "hybrid-engine" and not eng.pin,
                "--release_inference_cache": eng.kind == "hybrid-engine" and eng.release_cache,
                "rollout": "gather-once (unwrap_model_for_generation)" if eng.kind == "gather-once" else None}
    if critic:
        settings["--critic_zero_stage"] = critic.stage or 0
    if reward:
        settings["--offload_reward_model"] = bool(reward.offload_param)
    return Candidate(holds, eng, settings, gpus)


def openrlhf(job, gpus: int):
    actor = job.model("actor")
    eng = choice_of(job.engine)
    frozen = [m for m in job.models if not m.trainable]
    trainable = [m for m in job.models if m.trainable]
    engines = [eng]
    if eng.kind == "vllm" and eng.colocate:
        engines = [Choice("vllm", True, u, eng.tp, 0, s) for u in _utils(eng.util) for s in sorted({eng.sleep, True})]
    for stage, adam, off, engine in itertools.product(_stages(actor.stage), (False, True), (False, True), engines):
        holds = {m.role: Hold(stage, False, adam) for m in trainable}
        holds.update({m.role: Hold(_frozen_follow(stage), off) for m in frozen})
        settings = {"--zero_stage": stage, "--adam_offload": adam, "--ref_reward_offload": off}
        if engine.kind == "vllm" and engine.colocate:
            settings.update({"--vllm_gpu_memory_utilization": engine.util, "--vllm_enable_sleep": engine.sleep})
        yield Candidate(holds, engine, settings, gpus)


def verl(job, gpus: int):
    eng = choice_of(job.engine)
    roles = [m for m in job.models]
    tps = sorted({t for t in (1, 2, 4, 8, eng.tp) if gpus % t == 0})
    engines = [eng]
    if eng.kind == "vllm":
        engines = [Choice("vllm", True, u, t, 0, eng.sleep) for u in _utils(eng.util) for t in tps]
    offload_opts = [(p, o) for p in (False, True) for o in (False, True)]
    per_model = [[(p, o if m.trainable else False) for p, o in offload_opts if m.trainable or not o] for m in roles]
    for combo in itertools.product(*per_model):
        holds = {m.role: Hold(3, p, o) for m, (p, o) in zip(roles, combo)}
        for engine in engines:
            settings = _verl_settings(holds, engine)
            yield Candidate(holds, engine, settings, gpus)


_VERL_PREFIX = {"actor": "actor_rollout_ref.actor", "reference": "actor_rollout_ref.ref", "critic": "critic.model",
                "reward": "reward_model.model"}


def _verl_settings(holds: dict, engine: Choice) -> dict:
    out = {}
    for role, h in holds.items():
        prefix = _VERL_PREFIX.get(role, role)
        out[f"{prefix}.fsdp_config.param_offload"] = h.offload_param
        if role in ("actor", "critic"):
            out[f"{prefix}.fsdp_config.optimizer_offload"] = h.offload_optimizer
    if engine.kind == "vllm":
        out["actor_rollout_ref.rollout.gpu_memory_utilization"] = engine.util
        out["actor_rollout_ref.rollout.tensor_model_parallel_size"] = engine.tp
    return out


def trl(job, gpus: int):
    actor = job.model("actor")
    eng = choice_of(job.engine)
    ref = job.model("reference")
    engines = [Choice("generate"), Choice("gather-once")]
    if eng.kind == "vllm" and eng.colocate:
        engines += [Choice("vllm", True, u, eng.tp, 0, s) for u in _utils(eng.util) for s in (False, True)]
    elif eng.kind == "vllm":
        engines.append(eng)
    for stage, op, oo, engine in itertools.product(_stages(actor.stage), (False, True), (False, True), engines):
        if engine.kind == "gather-once" and stage != 3:
            continue
        if op and stage != 3:
            continue
        holds = {"actor": Hold(stage, op, oo)}
        if ref:
            holds["reference"] = Hold(_frozen_follow(stage))
        yield Candidate(holds, engine, _trl_settings(stage, op, oo, engine), gpus - (engine.gpus if
                                                                                     engine.kind == "vllm" and not
                                                                                     engine.colocate else 0))


def _trl_settings(stage, op, oo, engine: Choice) -> dict:
    out = {"zero_stage": stage, "offload_param_device": "cpu" if op else "none",
           "offload_optimizer_device": "cpu" if oo else "none"}
    if engine.kind == "vllm":
        out.update({"use_vllm": True, "vllm_mode": "colocate" if engine.colocate else "server"})
        if engine.colocate:
            out.update({"vllm_gpu_memory_utilization": engine.util, "vllm_enable_sleep_mode": engine.sleep})
    else:
        out.update({"use_vllm": False, "ds3_gather_for_generation": engine.kind == "gather-once"})
    return out


def generic(job, gpus: int):
    eng = choice_of(job.engine)
    kinds = [k for k in job.engines_allowed if k in ("generate", "gather-once", "hybrid-engine")]
    engines = [Choice(k) for k in kinds]
    if eng.kind == "vllm":
        engines += ([Choice("vllm", True, u, eng.tp, 0, s) for u in _utils(eng.util) for s in sorted({eng.sleep, True})]
                    if eng.colocate else [eng])
    elif eng not in engines:
        engines.append(eng)
    per_model = []
    for m in job.models:
        opts = set()
        if m.trainable:
            for s in _stages(m.stage):
                opts |= {Hold(s), Hold(s, False, True)} | ({Hold(3, True, True)} if s == 3 else set())
        else:
            opts = {Hold(0), Hold(3), Hold(3, True)}
        if m.stage is not None:
            opts.add(Hold(m.stage, m.offload_param, m.offload_optimizer))
        per_model.append(sorted({effective(h, m.trainable) for h in opts}, key=lambda h: (h.stage, h.offload_param,
                                                                                         h.offload_optimizer)))
    for combo in itertools.product(*per_model):
        holds = {m.role: h for m, h in zip(job.models, combo)}
        for engine in engines:
            if engine.kind == "gather-once" and holds["actor"].stage != 3:
                continue
            train = gpus - (engine.gpus if engine.kind == "vllm" and not engine.colocate else 0)
            yield Candidate(holds, engine, _generic_settings(holds, engine), train,
                            code_change=engine.kind in ("gather-once", "hybrid-engine"))


def _generic_settings(holds: dict, engine: Choice) -> dict:
    out = {}
    for role, h in holds.items():
        out[f"{role} stage"] = h.stage
        out[f"{role} offload_param"] = h.offload_param
        out[f"{role} offload_optimizer"] = h.offload_optimizer
    out["rollout"] = engine.label
    return out


SPACES = {"deepspeed-chat": deepspeed_chat, "openrlhf": openrlhf, "verl": verl, "trl": trl}


def candidates(job, gpus: int):
    """Every arrangement the job's framework can be switched to (the actor's job must name a stage where the
    framework has one)."""
    fn = SPACES.get(job.framework or "", generic)
    if job.framework in SPACES and not all(m.stage is not None for m in job.models if m.trainable) and \
            job.framework != "trl":
        fn = generic
    yield from fn(job, gpus)


def given(job, gpus: int) -> Candidate | None:
    """The job as the user runs it, or None when it does not say every model's stage."""
    if any(m.stage is None for m in job.models):
        return None
    holds = {m.role: effective(Hold(m.stage, m.offload_param, m.offload_optimizer), m.trainable)
             for m in job.models}
    eng = choice_of(job.engine)
    if job.framework == "deepspeed-chat" and job.model("critic"):
        return deepspeed_chat_given(job, gpus)
    if job.framework == "openrlhf":
        actor, frozen = job.model("actor"), [m for m in job.models if not m.trainable]
        settings = {"--zero_stage": actor.stage, "--adam_offload": actor.offload_optimizer,
                    "--ref_reward_offload": any(m.offload_param for m in frozen)}
        if eng.kind == "vllm" and eng.colocate:
            settings.update({"--vllm_gpu_memory_utilization": eng.util, "--vllm_enable_sleep": eng.sleep})
        return Candidate(holds, eng, settings, gpus)
    if job.framework == "verl":
        return Candidate(holds, eng, _verl_settings(holds, eng), gpus)
    if job.framework == "trl":
        a = holds["actor"]
        return Candidate(holds, eng, _trl_settings(a.stage, a.offload_param, a.offload_optimizer, eng),
                         gpus - (eng.gpus if eng.kind == "vllm" and not eng.colocate else 0))
    return Candidate(holds, eng, _generic_settings(holds, eng),
                     gpus - (eng.gpus if eng.kind == "vllm" and not eng.colocate else 0))


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
