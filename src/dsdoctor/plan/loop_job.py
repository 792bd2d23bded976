"""``plan --loop`` for a whole RL job: the actor, reference, critic and reward on the same GPUs, the rollout
engine, and the fastest arrangement that fits (``plan_job``).

Data flow: the job (``config/rl.py``: a job file, a launch line, or the models given as flags) -> each model
resolved to a shape (a model directory, a config.json, or a size: the Llama-style shape of that size) ->
every arrangement the job's framework allows (``loop_arrange.py``) -> per GPU the three phases of an iteration
(``loop_memory.py``) and the seconds of each (below) -> the rows, the recommendation, the findings
(``loop_result.py``).

Time of one iteration per training GPU (each term a count times a machine figure, as ``speed.py``):

* rollout: ``batch`` sequences of ``new_tokens``: HF generate at plan's speed for the path (plain, or ZeRO-3
  with its hooks and per-step gathers); gather-once and the pinned hybrid engine: plain speed plus one
  all-gather of the weights (the hybrid engine's kernels are not modelled: plain speed is its floor); vLLM:
  the same decode model without the eager per-layer work (CUDA graphs), a colocated engine serving the
  batches of its tensor-parallel GPUs, plus the weight sync (gathered over the GPU link, loaded at HBM speed)
  and with sleep mode the weights copied out and back over the host link; an engine on GPUs of its own
  serves every training GPU's batch.
* experience: one forward per model over the rollouts: 2 FLOPs per parameter and token at the matmul rate,
  per micro-batch the eager per-layer work and ZeRO-3's module hooks (the machine's figures), ZeRO-3's
  all-gather, offloaded parameters copied from the host.
* train: 6 FLOPs per parameter and token (8 with gradient checkpointing) per trainable model, per micro-step
  three passes of eager per-layer work and ZeRO-3 hooks (four with recomputation), its
  collectives (stage 2: reduce-scatter + all-gather; stage 3: the gathers of forward and backward per
  micro-step + reduce-scatter), offloaded optimizer state (gradients down, parameters up over the host
  link, DeepSpeedCPUAdam at an assumed 1e9 elements/s per rank) and offloaded parameters per micro-step.

Not modelled: activation recomputation's time beyond the 8 FLOPs, LoRA, pipeline or sequence parallelism,
verl's FSDP as such (planned as ZeRO-3). Torch-free except the meta-device parameter count.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass

from dsdoctor.config import rl
from dsdoctor.config.runner import size_from_name
from dsdoctor.errors import InputError
from dsdoctor.model.spec import load_model_spec, spec_from_config
from dsdoctor.plan.api import load_inventory, resolve_profile
from dsdoctor.plan.ds_knobs import load_knobs
from dsdoctor.plan.hardware import make_hardware
from dsdoctor.plan.loading import PROCESS_BASE, ZERO3_RUNTIME
from dsdoctor.plan.loop_arrange import Candidate, candidates, changes, given
from dsdoctor.plan.loop_memory import Hold, ModelCosts, effective, phases_of
from dsdoctor.plan.loop_result import CPU_ADAM_ELEMENTS_PER_S, build_result
from dsdoctor.plan.memory import CUDA_CONTEXT, NCCL_BUFFERS, allocated, params_numel
from dsdoctor.plan.paths.plain import plain_layout
from dsdoctor.plan.reserved import reserved_for
from dsdoctor.plan.schedule import Gather
from dsdoctor.plan.shape import model_shape
from dsdoctor.plan.speed import StepTerms, estimate_speed, figures_for, hooked_modules
from dsdoctor.plan.workload import make_workload

CLOSE = 0.05  # arrangements within 5% of the fastest: the one with the fewest changes wins

# Llama-style shapes for a model given by its size (hidden, layers, heads, intermediate), from published
# OPT/Llama configs; a size picks the nearest in parameters
SIZE_SHAPES = ((0.125e9, 768, 12, 12, 3072), (0.35e9, 1024, 24, 16, 2816), (1.3e9, 2048, 24, 16, 5504),
               (2.7e9, 2560, 32, 20, 6912), (6.7e9, 4096, 32, 32, 11008), (13e9, 5120, 40, 40, 13824),
               (33e9, 6656, 60, 52, 17920), (65e9, 8192, 80, 64, 22016))
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([bBmM])\s*$")


@dataclass
class Resolved:
    role: str
    source: str
    spec: object
    shape: object
    params: int
    how: str  # "config" | "size" | "name"


def size_config(params: float) -> dict:
    """The config.json of a Llama-style model of about ``params`` parameters."""
    row = min(SIZE_SHAPES, key=lambda r: abs(math.log(r[0] / params)))
    _, hidden, layers, heads, inter = row
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "intermediate_size": inter, "vocab_size": 32000, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


def _size_of(text: str) -> float | None:
    m = _SIZE.match(text)
    if m:
        return float(m.group(1)) * (1e9 if m.group(2).lower() == "b" else 1e6)
    named = size_from_name(text)
    return float(named[:-1]) * 1e9 if named else None


def resolve(m: rl.RlModel, counts: str, cache: dict) -> Resolved:
    source = str(m.source) if m.source is not None else None
    if not source:
        raise InputError(f"the {m.role} names no model", hint=f"give --{m.role} DIR or a size such as 7B")
    if source in cache:
        r = cache[source]
        return dataclasses.replace(r, role=m.role)
    if os.path.exists(source):
        spec, how = load_model_spec(source), "config"
        inv = load_inventory(spec, counts)
    else:
        size = _size_of(source)
        if size is None:
            raise InputError(f"the {m.role} model {source!r} is neither a local directory or config.json nor a size",
                             hint="give a model directory, its config.json, or a size such as 7B")
        how = "size" if _SIZE.match(source) else "name"
        spec = spec_from_config(size_config(size), f"<{source}>")
        inv = load_inventory(spec, "formula")
    r = Resolved(m.role, source, spec, model_shape(spec, inv), inv.num_params, how)
    cache[source] = r
    return r


def _group_gpus(job, total: int) -> dict:
    """GPUs per placement group: OpenRLHF places models apart unless colocated; every other job shares."""
    groups = {m.group for m in job.models}
    if groups == {"all"}:
        return {"all": total}
    a = job.args
    out = {}
    for g in groups:
        key = {"actor": "actor", "reference": "ref", "critic": "critic", "reward": "reward"}.get(g, g)
        nodes = a.get(f"{key}_num_nodes", 1)
        per = a.get(f"{key}_num_gpus_per_node", 8)
        out[g] = (nodes if isinstance(nodes, int) else 1) * (per if isinstance(per, int) else 8)
    return out


def vllm_figures(figures):
    """The machine's figures for a CUDA-graph decode: no eager per-layer launches."""
    values = dict(figures.values)
    for k in list(values):
        if k.startswith("eager_layer_s"):
            values[k] = 0.0
    return dataclasses.replace(figures, values=values)


class JobModel:
    """What one plan of a job reads: the resolved models, the shapes of the phases, the machine."""

    def __init__(self, job, resolved: dict, hw, figures, wl, train_batch: int):
        self.job, self.resolved, self.hw, self.figures, self.wl = job, resolved, hw, figures, wl
        self.train_batch = train_batch
        self.experience_batch = min(job.experience_batch or train_batch, wl.batch)
        self._costs: dict = {}
        self.groups = _group_gpus(job, hw.gpus)

    def costs(self, role: str, world: int) -> ModelCosts:
        key = (role, world)
        if key not in self._costs:
            m, r = self.job.model(role), self.resolved[role]
            self._costs[key] = ModelCosts(role, r.shape, r.params, m.trainable, role in ("critic", "reward"), world,
                                          self.wl.dtype_bytes, m.gradient_checkpointing, self.job.reduce_bucket_size,
                                          self.job.overlap_comm)
        return self._costs[key]

    def world_of(self, cand: Candidate, group: str) -> int:
        n = self.groups[group]
        return cand.train_gpus if group == "all" else n

    # ------------------------------------------------------------ memory
    def memory(self, cand: Candidate) -> dict:
        """Per group: phases, host parts, notes; the worst group decides."""
        out = {}
        for group in self.groups:
            world = self.world_of(cand, group)
            costs = [self.costs(m.role, world) for m in self.job.models if m.group == group]
            phases, host, notes = phases_of(costs, cand.holds, "actor", cand.engine, self.wl, self.train_batch,
                                            self.hw.gpu_memory, self.experience_batch)
            out[group] = (phases, host, notes, world)
        return out

    # ------------------------------------------------------------ time
    def rollout_s(self, cand: Candidate, world: int) -> float:
        actor = self.costs("actor", world)
        r, wl, f = self.resolved["actor"], self.wl, self.figures
        h = effective(cand.holds["actor"], True)
        e = cand.engine
        tokens = wl.batch * wl.new_tokens
        weights = actor.weights
        link = weights * (world - 1) / world / f.allgather_bus_bw if world > 1 else 0.0
        host = weights / world / f.h2d_pinned if h.offload_param else 0.0
        plain = estimate_speed(r.shape, wl, f)
        if e.kind == "vllm":
            vf = vllm_figures(f)
            sync = weights / f.hbm_read + (link + host if h.stage == 3 else 0.0)
            if e.colocate:
                return self._vllm_s(wl.batch * e.tp, e, vf) + sync + (
                    2 * weights / e.tp / f.h2d_pinned if e.sleep else 0.0)
            engines = max((e.gpus or e.tp) // e.tp, 1)
            return self._vllm_s(max(wl.batch * world // engines, 1), e, vf) + weights / f.allgather_bus_bw
        once = e.kind == "gather-once" or (e.kind == "hybrid-engine" and e.pin)
        if h.stage == 3 and once:
            return tokens / plain.tokens_per_s + link + host
        if h.stage == 3:
            moved = actor.gathered_per_step(cand.holds["actor"], wl)
            terms = StepTerms(hooks="zero3_offload_module_s" if h.offload_param else "zero3_module_s", ranks=world,
                              moved=moved, h2d="pinned" if h.offload_param else None)
            return tokens / estimate_speed(r.shape, wl, f, terms).tokens_per_s
        return tokens / plain.tokens_per_s

    def vllm_capacity(self, e) -> int | None:
        """Sequences one engine holds in its KV pool at once (None: unbounded, an engine apart sized by
        itself): gpu_memory_utilization x the GPU, less its weight share, over the KV bytes of one sequence."""
        if not e.colocate:
            return None
        r = self.resolved["actor"]
        seq = self.wl.prompt_len + self.wl.new_tokens
        per_seq = seq * sum(r.shape.kv_elems_per_token) * self.wl.dtype_bytes / e.tp
        free = (e.util or 0) * self.hw.gpu_memory - r.params * self.wl.dtype_bytes / e.tp
        return max(int(free // per_seq), 0) if per_seq else None

    def _vllm_s(self, batch: int, e, vf) -> float:
        """One engine generating ``batch`` sequences, in waves of what its KV pool holds."""
        wl = self.wl
        cap = self.vllm_capacity(e)
        running = batch if cap is None else max(min(batch, cap), 1)
        waves = math.ceil(batch / running)
        spd = estimate_speed(self.resolved["actor"].shape, dataclasses.replace(wl, batch=running), vf,
                             StepTerms(tp=e.tp))
        return waves * running * wl.new_tokens / spd.tokens_per_s

    def _eager(self, c: ModelCosts, h: Hold, passes: int) -> float:
        """Host time of ``passes`` passes over the layers of one micro-batch (a forward is 1, forward + backward
        3, with recomputation 4): the machine's eager per-layer work and, under ZeRO-3, its module hooks."""
        v = self.figures.values
        t = passes * c.shape.layers * v["eager_layer_s_b16"]
        if h.stage == 3:
            hooks = "zero3_offload_module_s" if h.offload_param else "zero3_module_s"
            t += passes * hooked_modules(c.shape) * v[hooks]
        return t

    def _collective(self, c: ModelCosts, world: int) -> float:
        return c.weights * (world - 1) / world / self.figures.allgather_bus_bw if world > 1 else 0.0

    def experience_s(self, cand: Candidate, world: int) -> float:
        f, seq = self.figures, self.wl.prompt_len + self.wl.new_tokens
        steps = math.ceil(self.wl.batch / self.experience_batch)
        total = 0.0
        for m in self.job.models:
            c = self.costs(m.role, world)
            h = effective(cand.holds[m.role], m.trainable)
            total += 2 * c.params * self.wl.batch * seq / f.matmul_flops
            total += steps * self._eager(c, h, 1)
            if h.stage == 3:  # every micro-batch's forward gathers the model again
                total += steps * (self._collective(c, world) + (c.weights / world / f.h2d_pinned
                                                                if h.offload_param else 0))
        return total

    def train_s(self, cand: Candidate, world: int) -> float:
        f, seq = self.figures, self.wl.prompt_len + self.wl.new_tokens
        steps = math.ceil(self.wl.batch / self.train_batch)
        total = 0.0
        for m in self.job.models:
            if not m.trainable:
                continue
            c = self.costs(m.role, world)
            h = effective(cand.holds[m.role], True)
            total += (8 if m.gradient_checkpointing else 6) * c.params * self.wl.batch * seq / f.matmul_flops
            total += steps * self._eager(c, h, 4 if m.gradient_checkpointing else 3)
            coll = self._collective(c, world)
            total += (steps * 2 + 1) * coll if h.stage == 3 else 2 * coll
            if h.offload_optimizer:
                shard = c.shard()
                total += shard * (c.b + 4) / f.h2d_pinned + shard / CPU_ADAM_ELEMENTS_PER_S
            if h.offload_param:
                total += steps * 2 * c.weights / world / f.h2d_pinned
        return total

    # ------------------------------------------------------------ one arrangement
    def evaluate(self, cand: Candidate, slack: tuple) -> dict:
        groups = self.memory(cand)
        worst, need_worst, rows = None, -1, {}
        host_total = 0
        notes = list(cand.notes)
        any_z3 = any(effective(h, True).stage == 3 for h in cand.holds.values())
        for group, (phases, host, gnotes, world) in groups.items():
            top = max(phases, key=lambda p: p.total)
            outside = CUDA_CONTEXT + (NCCL_BUFFERS if world > 1 or any_z3 else 0)
            if cand.engine.kind == "vllm" and cand.engine.colocate and self.job.framework == "openrlhf":
                outside += CUDA_CONTEXT  # its engines are processes of their own on the same GPUs
            # the caching allocator's slack: plan's replay of the actor's HF generate at the batch of the phase
            # that sets the peak (the rollout batch, or the micro-batch of the forwards and training step)
            hf_rollout = top.name == "rollout" and cand.engine.kind != "vllm"
            need = top.total + slack[0 if hf_rollout else 1] + outside
            rows[group] = (phases, top, need, world)
            if need > need_worst:
                worst, need_worst = group, need
            host_total += sum(host.values()) + world * (PROCESS_BASE + (ZERO3_RUNTIME if any_z3 else 0))
            notes += [n for n in gnotes if n not in notes]
        e = cand.engine
        if e.kind == "vllm" and e.sleep:
            host_total += (self.groups.get("all", cand.train_gpus) // max(e.tp, 1)) * self.costs("actor", 1).weights
        if e.kind == "vllm" and not e.colocate:
            host_total += (e.gpus or e.tp) * PROCESS_BASE
        phases, top, need, world = rows[worst]
        limits = []
        if need > self.hw.gpu_memory:
            limits.append("gpu")
        if host_total > self.hw.host_memory:
            limits.append("host")
        actor_world = self.world_of(cand, self.job.model("actor").group)
        times = {"rollout": self.rollout_s(cand, actor_world), "experience": self.experience_s(cand, actor_world),
                 "train": self.train_s(cand, actor_world)}
        total = sum(times.values())
        samples = cand.train_gpus * self.wl.batch / total if total else 0.0
        if e.kind == "vllm" and e.colocate and self.vllm_capacity(e) == 0:
            limits.append("engine")  # its weights leave no room for one sequence's KV cache
        return {"candidate": cand, "group": worst, "phases": phases, "peak": top, "need": int(need),
                "world": world, "fits": not limits, "limits": limits, "host": int(host_total), "times": times,
                "total_s": total, "samples_per_s": samples,
                "rollout_tokens_per_s": cand.train_gpus * self.wl.batch * self.wl.new_tokens / times["rollout"]
                if times["rollout"] else 0.0, "notes": notes}


def _slack(actor: Resolved, wl) -> int:
    """What the caching allocator reserves beyond the allocated peak on the actor's generate (plan's replay of
    the plain generate, as the single-model loop paths take it)."""
    mem = allocated(plain_layout(1), actor.shape, wl)
    res = reserved_for("plain", actor.shape, wl, Gather(world=1), mem.gpu_peak_bytes,
                       params_numel(actor.shape.inventory))
    return max(res - mem.gpu_peak_bytes, 0)


def _merge(job: rl.RlJob, models: list, batch, prompt_len, new_tokens, train_batch, dtype, engine) -> rl.RlJob:
    """Flags win over what the job file or launch line says."""
    job = dataclasses.replace(job, models=list(job.models))
    for m in models or []:
        job.models = [x for x in job.models if x.role != m.role] + [m]
    order = {r: i for i, r in enumerate(rl.ROLES)}
    job.models.sort(key=lambda m: order.get(m.role, 99))
    for name, value in (("batch", batch), ("prompt_len", prompt_len), ("new_tokens", new_tokens),
                        ("train_batch", train_batch), ("dtype", dtype)):
        if value is not None:
            setattr(job, name, value)
    if engine is not None:
        job.engine = engine
    return job


def plan_job(job=None, *, actor=None, ref=None, critic=None, reward=None, config=None, batch: int | None = None,
             prompt_len: int | None = None, new_tokens: int | None = None, train_batch: int | None = None,
             dtype: str | None = None, gpus: int | None = None, gpu_memory=None, host_memory=None,
             h2d_bandwidth=None, gpu_name: str | None = None, counts: str = "auto", detect: bool = True,
             machine=None, engine: str | None = None):
    """Plan an RL job. ``job``: a job file or launch line (path), a dict in the job file's form, or an
    ``RlJob``; the models may also be given (or overridden) one by one: ``actor`` a model directory,
    config.json or size, ``ref``/``critic``/``reward`` ``MODEL[:opts]`` strings (``config/rl.py``
    ``parse_model_spec``); ``config``: the actor's DeepSpeed config (its stage and offloads). Returns a
    ``JobPlanResult`` (``loop_result.py``)."""
    if isinstance(job, rl.RlJob):
        base = job
    elif isinstance(job, dict):
        base = rl.job_from_dict(job)
    elif job is not None:
        base = rl.read_job(job)
    else:
        base = rl.RlJob([])
    models = []
    if actor is not None:
        models.append(_actor_model(actor, config))
    for role, spec in (("reference", ref), ("critic", critic), ("reward", reward)):
        if spec is not None:
            models.append(rl.parse_model_spec(role, spec))
    eng = rl.Engine(engine) if engine is not None else None
    if engine is not None and engine not in rl.ENGINES:
        raise InputError(f"--rollout {engine!r} is not one of {', '.join(rl.ENGINES)}")
    job = _merge(base, models, batch, prompt_len, new_tokens, train_batch, dtype, eng)
    model, slack, profile = _setup(job, gpus, gpu_memory, host_memory, h2d_bandwidth, gpu_name, counts, detect,
                                   machine)
    hw = model.hw
    rows = [model.evaluate(c, slack) for c in candidates(job, hw.gpus)]
    base_cand = given(job, hw.gpus)
    base_row = model.evaluate(base_cand, slack) if base_cand is not None else None
    return build_result(job, model.resolved, hw, model.wl, model.train_batch, rows, base_row,
                        choose(rows, base_row), model.figures, profile)


def _setup(job, gpus, gpu_memory, host_memory, h2d_bandwidth, gpu_name, counts, detect, machine):
    """The resolved models, workload and machine of a job: (JobModel, allocator slack, machine profile)."""
    if job.model("actor") is None:
        raise InputError("an RL job needs an actor", hint="give --model DIR (the actor) or a job file with models.actor")
    cache: dict = {}
    resolved = {m.role: resolve(m, counts, cache) for m in job.models}
    spec = resolved["actor"].spec
    wl = make_workload(job.batch or 1, job.prompt_len or 512, job.new_tokens or 128, job.dtype, spec.dtype)
    hw = make_hardware(gpus if gpus is not None else job.gpus, gpu_memory, host_memory, h2d_bandwidth,
                       gpu_name=gpu_name, detect=detect)
    profile = resolve_profile(machine, detect)
    figures = figures_for(hw, profile)
    tb = job.train_batch or wl.batch
    if tb < 1:
        raise InputError("the training micro-batch must be >= 1")
    model = JobModel(job, resolved, hw, figures, wl, tb)
    micro = max(model.experience_batch, min(tb, wl.batch))
    slack = (_slack(resolved["actor"], wl), _slack(resolved["actor"], dataclasses.replace(wl, batch=micro)))
    return model, slack, profile


def evaluate_arrangement(job: rl.RlJob, gpus: int | None = None, gpu_memory=None, host_memory=None,
                         h2d_bandwidth=None, gpu_name: str | None = None, counts: str = "auto", detect: bool = True,
                         machine=None) -> dict:
    """The job exactly as given (every model's stage, the engine): its phases (``phases``, each with its
    ``parts`` and ``total``), the peak phase (``peak``), what decides fits (``need``), seconds per phase
    (``times``). What the GPU bench compares its measurements with."""
    model, slack, _profile = _setup(job, gpus, gpu_memory, host_memory, h2d_bandwidth, gpu_name, counts, detect,
                                    machine)
    cand = given(job, model.hw.gpus)
    if cand is None:
        raise InputError("every model of the job needs its ZeRO stage to evaluate it as given")
    return model.evaluate(cand, slack)


def _actor_model(actor, config) -> rl.RlModel:
    m = rl.parse_model_spec("actor", str(actor))
    if config is not None:
        knobs = load_knobs(config)
        m.stage = knobs.zero_stage
        m.offload_param = knobs.offload_param is not None
        m.offload_optimizer = knobs.offload_optimizer is not None
    return m


def choose(rows: list, base: dict | None) -> dict | None:
    """The fastest fitting arrangement; within 5% of it, the one with the fewest changes (no code change
    first)."""
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return None
    best = max(r["samples_per_s"] for r in fitting)
    close = [r for r in fitting if r["samples_per_s"] >= (1 - CLOSE) * best]
    base_cand = base["candidate"] if base else None
    return min(close, key=lambda r: (r["candidate"].code_change, len(changes(r["candidate"], base_cand)),
                                     -r["samples_per_s"]))


__all__ = ["Hold", "choose", "evaluate_arrangement", "plan_job"]
