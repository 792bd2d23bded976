"""``plan --loop`` for a whole RL job: the actor, reference, critic and reward on the same GPUs, the rollout
engine, and the fastest arrangement that fits (``plan_job``).

Data flow: a ``JobRequest`` -> the job (``config/rl.py``: a job file, a launch line, or the models given as
flags; flags win) -> each model resolved to a shape (a model directory, a config.json, or a size: the
Llama-style shape of that size) -> every arrangement the job's framework allows (``loop_arrange.py``) -> per GPU
the phases of an iteration (``loop_memory.py``, on the layouts of the registry's paths) and the seconds of each
(``JobModel``: the rollout at the first planner's speed for the actor's path, or the serving path's for vLLM;
the experience forwards and training steps as FLOPs at the matmul rate plus the machine's eager per-layer work,
ZeRO-3 hooks, all-gathers and host copies, docs/plan.md) -> an ``Arrangement`` each -> the recommendation and the
findings (``loop_result.py``).

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
from dsdoctor.model.spec import MAX_PARAMS, load_model_spec, spec_from_config
from dsdoctor.plan.api import load_inventory, resolve_profile
from dsdoctor.plan.band import Bands, archived
from dsdoctor.plan.ds_knobs import load_knobs
from dsdoctor.plan.evaluate import upper_figure
from dsdoctor.plan.hardware import make_hardware
from dsdoctor.plan.loading import PROCESS_BASE, ZERO3_RUNTIME, Checkpoint
from dsdoctor.plan.loop_arrange import Candidate, candidates, changes, given
from dsdoctor.plan.loop_memory import Hold, ModelCosts, phases_of
from dsdoctor.plan.loop_result import CPU_ADAM_ELEMENTS_PER_S, Arrangement, JobPlanResult, build_result
from dsdoctor.plan.memory import CUDA_CONTEXT, NCCL_BUFFERS
from dsdoctor.plan.paths import PlanContext, by_name
from dsdoctor.plan.paths.loop import allocator_slack, gather_once_speed
from dsdoctor.plan.paths.serving import engine_memory, engine_speed
from dsdoctor.plan.recommend import outright_first
from dsdoctor.plan.request import JobRequest, MachineRequest
from dsdoctor.plan.shape import model_shape
from dsdoctor.plan.speed import figures_for, hooked_modules
from dsdoctor.plan.workload import make_workload
from dsdoctor.units import MAX_BATCH, MAX_GPUS, number
from dsdoctor.zero_costs import allgather_s

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


def _size_of(text: str, role: str) -> float | None:
    """The parameters a size (``7B``, ``350M``) or a hub name (``Qwen2-7B``) says, 1M to 100T; else None."""
    m = _SIZE.match(text)
    named = size_from_name(text) if m is None else None
    if m is None and named is None:
        return None
    params = float(m.group(1)) * (1e9 if m.group(2).lower() == "b" else 1e6) if m else float(named[:-1]) * 1e9
    return number(params, f"the {role} model's size {text!r}", low=1e6, high=MAX_PARAMS, whole=False)


def resolve(m: rl.RlModel, counts: str, cache: dict, named_by=None) -> Resolved:
    source = str(m.source) if m.source is not None else None
    if not source:
        raise InputError(f"the {m.role} names no model", hint=f"give --{m.role} DIR or a size such as 7B")
    if source in cache:
        r = cache[source]
        return dataclasses.replace(r, role=m.role)
    if os.path.exists(source):
        spec, how = load_model_spec(source, named_by), "config"  # named by the job file: the door's tree rule
        inv = load_inventory(spec, counts)
    else:
        size = _size_of(source, m.role)
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
        out[g] = (rl.count(a, f"{key}_num_nodes", 1, MAX_GPUS) or 1) * \
            (rl.count(a, f"{key}_num_gpus_per_node", 8, MAX_GPUS) or 8)
    return out


ASSUMED_CHECKPOINT = Checkpoint("unknown", 0, 0, 0, None, seen=True)  # a job's models: loaded, not built


class JobModel:
    """What one plan of a job reads: the resolved models, the shapes of the phases, the machine. Every model's
    memory and rollout speed come from the path of the registry its hold runs on (``Hold.path``)."""

    def __init__(self, job, resolved: dict, hw, figures, wl, train_batch: int):
        self.job, self.resolved, self.hw, self.figures, self.wl = job, resolved, hw, figures, wl
        self.train_batch = train_batch
        self.experience_batch = min(job.experience_batch or train_batch, wl.batch)
        self._costs: dict = {}
        self.groups = _group_gpus(job, hw.gpus)
        # no GPU run of an RL job is archived: every arrangement takes the widest measured band (plan/band.py)
        self.bands = Bands(archived()).widest

    def costs(self, role: str, world: int) -> ModelCosts:
        key = (role, world)
        if key not in self._costs:
            m, r = self.job.model(role), self.resolved[role]
            layouts = {}

            def layout_of(hold, world=world):
                if hold.path not in layouts:
                    layouts[hold.path] = by_name(hold.path)().layout(world, None)
                return layouts[hold.path]

            self._costs[key] = ModelCosts(role, r.shape, m.trainable, world, self.wl.dtype_bytes, layout_of,
                                          value_head=role in ("critic", "reward"), ckpt=m.gradient_checkpointing,
                                          reduce_bucket=self.job.reduce_bucket_size, overlap_comm=self.job.overlap_comm)
        return self._costs[key]

    def context(self, role: str, world: int) -> PlanContext:
        """The first planner's context of one model of the job on ``world`` GPUs (no DeepSpeed config: the
        job's holds say everything)."""
        r = self.resolved[role]
        return PlanContext(shape=r.shape, wl=self.wl, hw=dataclasses.replace(self.hw, gpus=world),
                           figures=self.figures, knobs=None, config_path=None, ckpt=ASSUMED_CHECKPOINT,
                           model=r.source, run_dtype=self.wl.dtype)

    def world_of(self, cand: Candidate, group: str) -> int:
        return cand.train_gpus if group == "all" else self.groups[group]

    # ------------------------------------------------------------ memory
    def memory(self, cand: Candidate) -> dict:
        """Per group: phases, host parts, notes; the worst group decides."""
        out = {}
        for group in self.groups:
            world = self.world_of(cand, group)
            costs = [self.costs(m.role, world) for m in self.job.models if m.group == group]
            phases, host, notes = phases_of(costs, cand.holds, cand.engine, self.wl, self.train_batch,
                                            self.hw.gpu_memory, self.experience_batch)
            out[group] = (phases, host, notes, world)
        return out

    # ------------------------------------------------------------ time
    def rollout_s(self, cand: Candidate, world: int) -> float:
        """HF generate at the first planner's speed for the actor's path; gather-once and the pinned hybrid
        engine at plain speed plus one all-gather; vLLM at the serving engine's."""
        h, e = cand.holds["actor"].effective(True), cand.engine
        if e.kind == "vllm":
            return self._vllm_s(e, h, world)
        ctx = self.context("actor", world)
        if h.stage == 3 and (e.kind == "gather-once" or (e.kind == "hybrid-engine" and e.pin)):
            speed = gather_once_speed(ctx, h.offload_param)
        else:
            speed = by_name(h.path)().speed(ctx, self.costs("actor", world).allocated(h, self.wl))
        return self.wl.batch * self.wl.new_tokens / speed.tokens_per_s

    def _vllm_s(self, e, h: Hold, world: int) -> float:
        """A vLLM engine's rollouts and the weight sync: colocated, it serves the batches of its tensor-parallel
        GPUs, gets the weights gathered over the GPU link and loaded at HBM speed (with sleep mode also copied out
        and back over the host link); on GPUs of its own it serves every training GPU's batch."""
        f, weights = self.figures, self.costs("actor", world).weights
        if not e.colocate:
            engines = max((e.gpus or e.tp) // e.tp, 1)
            return self._engine_s(max(self.wl.batch * world // engines, 1), e) + weights / f.allgather_bus_bw
        host = weights / world / f.h2d_pinned if h.offload_param else 0.0
        sync = weights / f.hbm_read + (allgather_s(weights, world, f.allgather_bus_bw) + host if h.stage == 3 else 0.0)
        return self._engine_s(self.wl.batch * e.tp, e) + sync + (2 * weights / e.tp / f.h2d_pinned if e.sleep else 0.0)

    def vllm_capacity(self, e) -> int | None:
        """Sequences one colocated engine holds in its KV pool at once (the serving model's accounting at the
        job's gpu_memory_utilization); None: an engine apart, sized by itself."""
        if not e.colocate:
            return None
        return engine_memory("vllm", self.resolved["actor"].shape, self.wl, self.hw.gpu_memory, e.tp, None,
                             share=e.gpu_memory_utilization or None)["seqs"]

    def _engine_s(self, batch: int, e) -> float:
        """One engine generating ``batch`` sequences, in waves of what its KV pool holds."""
        cap = self.vllm_capacity(e)
        running = batch if cap is None else max(min(batch, cap), 1)
        speed = engine_speed(self.resolved["actor"].shape, self.wl, self.figures, e.tp, running)
        return math.ceil(batch / running) * running * self.wl.new_tokens / speed.tokens_per_s

    def _eager(self, c: ModelCosts, h: Hold, passes: int) -> float:
        """Host time of ``passes`` passes over the layers of one micro-batch (a forward is 1, forward + backward
        3, with recomputation 4): the machine's eager per-layer work and, under ZeRO-3, its module hooks."""
        v = self.figures.values
        t = passes * c.shape.layers * v["eager_layer_s_b16"]
        if h.stage == 3:
            hooks = "zero3_offload_module_s" if h.offload_param else "zero3_module_s"
            t += passes * hooked_modules(c.shape) * v[hooks]
        return t

    def _gather(self, c: ModelCosts, h: Hold, world: int) -> float:
        """One ZeRO-3 gather of the model: over the GPU link, and from the host with offload_param."""
        f = self.figures
        return allgather_s(c.weights, world, f.allgather_bus_bw) + (c.weights / world / f.h2d_pinned
                                                                     if h.offload_param else 0.0)

    def experience_s(self, cand: Candidate, world: int) -> float:
        f, seq = self.figures, self.wl.prompt_len + self.wl.new_tokens
        steps = math.ceil(self.wl.batch / self.experience_batch)
        total = 0.0
        for m in self.job.models:
            c = self.costs(m.role, world)
            h = cand.holds[m.role].effective(m.trainable)
            total += 2 * c.params * self.wl.batch * seq / f.matmul_flops + steps * self._eager(c, h, 1)
            if h.stage == 3:  # every micro-batch's forward gathers the model again
                total += steps * self._gather(c, h, world)
        return total

    def train_s(self, cand: Candidate, world: int) -> float:
        f, seq = self.figures, self.wl.prompt_len + self.wl.new_tokens
        steps = math.ceil(self.wl.batch / self.train_batch)
        total = 0.0
        for m in (m for m in self.job.models if m.trainable):
            c = self.costs(m.role, world)
            h = cand.holds[m.role].effective(True)
            total += (8 if m.gradient_checkpointing else 6) * c.params * self.wl.batch * seq / f.matmul_flops
            total += steps * self._eager(c, h, 4 if m.gradient_checkpointing else 3)
            coll = allgather_s(c.weights, world, f.allgather_bus_bw)
            total += (steps * 2 + 1) * coll if h.stage == 3 else 2 * coll
            if h.offload_optimizer:
                shard = c.shard()
                total += shard * (c.b + 4) / f.h2d_pinned + shard / CPU_ADAM_ELEMENTS_PER_S
            if h.offload_param:
                total += steps * 2 * c.weights / world / f.h2d_pinned
        return total

    # ------------------------------------------------------------ one arrangement
    def _need(self, cand: Candidate, phases: list, world: int, slack: tuple, any_z3: bool) -> tuple[int, int]:
        """What decides fits on one GPU of a group: the peak phase with the caching allocator's slack (plan's
        replay of the actor's HF generate at the batch of the phase that sets the peak: the rollout batch, or the
        micro-batch of the forwards and training step), and beside it the CUDA context and NCCL."""
        top, e = max(phases, key=lambda p: p.total), cand.engine
        outside = CUDA_CONTEXT + (NCCL_BUFFERS if world > 1 or any_z3 else 0)
        if e.kind == "vllm" and e.colocate and self.job.framework == "openrlhf":
            outside += CUDA_CONTEXT  # its engines are processes of their own on the same GPUs
        return top.total + slack[0 if top.name == "rollout" and e.kind != "vllm" else 1], outside

    def _host(self, cand: Candidate, groups: dict, any_z3: bool) -> int:
        e = cand.engine
        total = sum(sum(host.values()) + world * (PROCESS_BASE + (ZERO3_RUNTIME if any_z3 else 0))
                    for _phases, host, _notes, world in groups.values())
        if e.kind == "vllm" and e.sleep:
            total += (self.groups.get("all", cand.train_gpus) // max(e.tp, 1)) * self.costs("actor", 1).weights
        if e.kind == "vllm" and not e.colocate:
            total += (e.gpus or e.tp) * PROCESS_BASE
        return int(total)

    def evaluate(self, cand: Candidate, slack: tuple) -> Arrangement:
        groups = self.memory(cand)
        any_z3 = any(h.effective(True).stage == 3 for h in cand.holds.values())
        needs = {g: self._need(cand, phases, world, slack, any_z3) for g, (phases, _h, _n, world) in groups.items()}
        worst = max(needs, key=lambda g: sum(needs[g]))  # the first of the largest
        need = sum(needs[worst])
        notes = list(cand.notes)
        for _phases, _host, gnotes, _world in groups.values():
            notes += [n for n in gnotes if n not in notes]
        phases, _host, _notes, world = groups[worst]
        host = self._host(cand, groups, any_z3)
        e = cand.engine
        limits = [name for name, over in (("gpu", need > self.hw.gpu_memory),
                                          ("host", host > self.hw.host_memory)) if over]
        actor_world = self.world_of(cand, self.job.model("actor").group)
        times = {"rollout": self.rollout_s(cand, actor_world), "experience": self.experience_s(cand, actor_world),
                 "train": self.train_s(cand, actor_world)}
        total = sum(times.values())
        if e.kind == "vllm" and e.colocate and self.vllm_capacity(e) == 0:
            limits.append("engine")  # its weights leave no room for one sequence's KV cache
        tokens = cand.train_gpus * self.wl.batch * self.wl.new_tokens
        upper = upper_figure(max(p.total for p in phases), *needs[worst], self.bands)
        return Arrangement(cand, worst, world, phases, int(need), limits, host, times,
                           cand.train_gpus * self.wl.batch / total if total else 0.0,
                           tokens / times["rollout"] if times["rollout"] else 0.0, notes, upper_bytes=upper,
                           band={fig: b.to_dict() for fig, b in self.bands.items()}, outside_bytes=needs[worst][1],
                           verdict="does not fit" if limits else "edge" if upper > self.hw.gpu_memory else "fits")


def _merge(job: rl.RlJob, req: JobRequest) -> rl.RlJob:
    """Flags win over what the job file or launch line says."""
    job = dataclasses.replace(job, models=list(job.models))
    models = [_actor_model(req.actor, req.config)] if req.actor is not None else []
    models += [rl.parse_model_spec(role, spec) for role, spec in (("reference", req.ref), ("critic", req.critic),
                                                                   ("reward", req.reward)) if spec is not None]
    for m in models:
        job.models = [x for x in job.models if x.role != m.role] + [m]
    order = {r: i for i, r in enumerate(rl.ROLES)}
    job.models.sort(key=lambda m: order.get(m.role, 99))
    for name in ("batch", "prompt_len", "new_tokens", "train_batch", "dtype"):
        if getattr(req, name) is not None:
            setattr(job, name, getattr(req, name))
    if req.engine is not None:
        if req.engine not in rl.ENGINES:
            raise InputError(f"--rollout {req.engine!r} is not one of {', '.join(rl.ENGINES)}")
        job.engine = rl.Engine(req.engine)
    return job


def _read(job) -> rl.RlJob:
    """The job as given: an ``RlJob``, a dict of the job file's form, a job file or launch line, or none."""
    if isinstance(job, rl.RlJob):
        return job
    if isinstance(job, dict):
        return rl.job_from_dict(job)
    return rl.read_job(job) if job is not None else rl.RlJob([])


def plan_job(job=None, **values) -> JobPlanResult:
    """Plan an RL job: ``job`` and every value a field of ``JobRequest`` (``plan/request.py`` says what each
    is), as plain values. Returns a ``JobPlanResult`` (``loop_result.py``)."""
    return plan_job_request(JobRequest(job=job, **values))


def plan_job_request(req: JobRequest) -> JobPlanResult:
    """The plan a ``JobRequest`` asks for: every arrangement the job's framework allows, the fastest that fits."""
    job = _merge(_read(req.job), req)
    model, slack, profile = _setup(job, req)
    rows = [model.evaluate(c, slack) for c in candidates(job, model.hw.gpus)]
    base_cand = given(job, model.hw.gpus)
    base = model.evaluate(base_cand, slack) if base_cand is not None else None
    return build_result(job, model.resolved, model.hw, model.wl, model.train_batch, rows, base, choose(rows, base),
                        model.figures, profile)


def _setup(job: rl.RlJob, req: MachineRequest):
    """The resolved models, workload and machine of a job: (JobModel, allocator slack, machine profile)."""
    if job.model("actor") is None:
        raise InputError("an RL job needs an actor", hint="give --model DIR (the actor) or a job file with models.actor")
    cache: dict = {}
    resolved = {m.role: resolve(m, req.counts, cache, job.source) for m in job.models}
    said = {k: v for k, v in (("batch", job.batch), ("prompt_len", job.prompt_len), ("new_tokens", job.new_tokens))
            if v is not None}
    said = {"batch": 1, "prompt_len": 512, "new_tokens": 128} | said  # 0 given is refused, not replaced
    wl = make_workload(said["batch"], said["prompt_len"], said["new_tokens"], job.dtype, resolved["actor"].spec.dtype)
    hw = make_hardware(req.gpus if req.gpus is not None else job.gpus, req.gpu_memory, req.host_memory,
                       req.h2d_bandwidth, gpu_name=req.gpu_name, detect=req.detect)
    profile = resolve_profile(req.machine, req.detect)
    tb = wl.batch if job.train_batch is None else number(job.train_batch, "the training micro-batch (--train-batch)",
                                                          low=1, high=MAX_BATCH)
    model = JobModel(job, resolved, hw, figures_for(hw, profile), wl, tb)
    micro = max(model.experience_batch, min(tb, wl.batch))
    ctx = model.context("actor", 1)
    slack = (allocator_slack(ctx, wl), allocator_slack(ctx, dataclasses.replace(wl, batch=micro)))
    return model, slack, profile


def evaluate_arrangement(job: rl.RlJob, **machine) -> Arrangement:
    """The job exactly as given (every model's stage, the engine) on the machine ``machine`` (the fields of
    ``MachineRequest``): its phases, the peak phase, what decides fits, seconds per phase. What the GPU bench
    compares its measurements with."""
    model, slack, _profile = _setup(job, MachineRequest(**machine))
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


def choose(rows: list, base: Arrangement | None) -> Arrangement | None:
    """The fastest arrangement that fits outright (else the fastest at the edge: only its prediction fits); within
    5% of it, the one with the fewest changes (no code change first)."""
    fitting = outright_first(rows)
    if not fitting:
        return None
    best = max(r.samples_per_s for r in fitting)
    close = [r for r in fitting if r.samples_per_s >= (1 - CLOSE) * best]
    base_cand = base.candidate if base else None
    return min(close, key=lambda r: (r.candidate.code_change, len(changes(r.candidate, base_cand)), -r.samples_per_s))


__all__ = ["Hold", "choose", "evaluate_arrangement", "plan_job"]
