"""Per-GPU memory of models that train and generate their own rollouts (``plan --loop``): what each model holds
all along, and what each phase of a PPO-style iteration adds on top. One model for both planners: the actor
alone (``paths/loop.py``, and the ZeRO-3 paths of ``paths/zero3.py`` in a loop, ``in_loop``) and every model of
an RL job (``loop_job.py``). The inference side of every part is the first planner's: the layout a model is
held on (a path of the registry, given as ``layout_of``) and ``memory.allocated`` on it.

A model is held (``Hold``) at a ZeRO stage with or without ``offload_param`` (stage 3 only: DeepSpeed ignores
it below) and, when it trains, with or without ``offload_optimizer``:

* weights: what the path's layout keeps resident (stage 3: the 1/N shards and the persistent parameters whole,
  the shards pinned on the host with offload_param; below: the whole model);
* a trainable model's state (DeepSpeed 0.19.8's ZeRO optimizers, fp32 Adam): fp32 master + two fp32 moments
  per element of the 1/N partition (stage 0: of the whole model), and at stage 3 also the flat gradient
  partition in the training dtype and the reduce bucket, built at initialize (``zero_costs.optimizer_cost``);
  with offload_optimizer the master, gradients and moments on the host (17 bytes per shard element measured at
  initialize + 8 for the moments). ZeRO-1/2 hold their gradients (the partition, or the whole model at stage 1
  and 0, in the training dtype, its fp32 copy for the optimizer) and reduce buckets only from backward to the
  end of ``step`` (``stage_1_and_2.py`` frees them there): a training-step part, measured on one H200
  (bench/rlloop/job_gpu.py: a ZeRO-2 rollout peak of weights + 12 bytes per parameter).

The phases, each on top of every model's share (plus what the rollout engine keeps):

* rollout: the actor generates ``batch`` sequences of prompt + new tokens: plan's generate model on its layout
  for HF generate; gather-once and the hybrid engine under ZeRO-3 (pin_parameters) add the whole weights
  (nothing on one GPU without offload: its partition is the whole model, measured); the hybrid engine's
  workspace holds its KV cache for max_out_tokens positions at full attention width (its inference kernels),
  kept through training unless ``release_inference_cache``; a colocated vLLM engine holds
  ``gpu_memory_utilization`` of each GPU, through training unless put to sleep;
* experience (jobs): no-grad forwards over the rollouts (the framework's experience micro-batch x (prompt +
  new)), one model at a time: ZeRO-3's gathers, the forward's KV cache and activations (plan's prefill model)
  and, for the language models, logits over every position with their fp32 copy (value heads: none);
* train: one step of each trainable model on a micro-batch: the activations kept for backward, 34 bytes per
  token, hidden element and layer at 16 bits (Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", without the attention-score term that SDPA/flash attention does not keep; with
  gradient checkpointing each layer's input and one layer recomputed), logits with their fp32 copy for the
  loss, ZeRO-3's gathers, ZeRO-1/2's gradients.

The per-GPU peak is the largest phase; its parts add up to it. Torch-free.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsdoctor.config.schema import ZERO_DEFAULTS
from dsdoctor.plan.memory import (
    CUBLAS_WORKSPACE,
    TRAINING_PARTS,
    PathMemory,
    allocated,
    params_numel,
    persistent_params,
)
from dsdoctor.plan.workload import Workload
from dsdoctor.zero_costs import HOST_BYTES_PER_SHARD_ELEMENT, optimizer_cost, shard_numel

ADAM_MOMENTS = 8  # two fp32 moments per element, from the first step on
FP32_MASTER = 4
ACTIVATION_BYTES_PER_ELEMENT = 34  # per token, hidden element and layer at 16 bits, no recomputation
GENERATE = ("prefill", "decode")


@dataclass(frozen=True)
class Hold:
    """How one model is held on its GPUs."""
    stage: int
    offload_param: bool = False  # stage 3 only
    offload_optimizer: bool = False  # trainable only

    @property
    def label(self) -> str:
        bits = [f"zero{self.stage}"]
        if self.offload_param and self.stage == 3:
            bits.append("offload-param")
        if self.offload_optimizer:
            bits.append("offload-optimizer")
        return "+".join(bits)

    @property
    def path(self) -> str:
        """The registry's path whose layout the model generates and runs its forwards on."""
        if self.stage != 3:
            return "plain"
        return "zero3-offload" if self.offload_param else "zero3"

    def effective(self, trainable: bool) -> Hold:
        """What DeepSpeed does with it: offload_param only at stage 3, no optimizer for a frozen model."""
        return Hold(self.stage, self.offload_param and self.stage == 3, self.offload_optimizer and trainable)


def training_state(numel: int, world: int, b: int, hold: Hold, bucket: int) -> tuple[dict, dict]:
    """GPU and host bytes per rank (host: all ranks) of a trained model's ZeRO state from initialize on, Adam
    moments included (a loop steps): ZeRO-3's through ``zero_costs.optimizer_cost``; ZeRO-0/1/2 keep the fp32
    master and moments of their partition, their gradients only in the step (``step_gradients``)."""
    shard = shard_numel(numel, world)
    if hold.stage == 3:
        cost = optimizer_cost(numel, world, "cpu" if hold.offload_optimizer else None, b, bucket)
        gpu = {"reduce_bucket": cost["bucket"]}
        if cost["host"]:
            return gpu, {"optimizer_state": (cost["host"] + ADAM_MOMENTS * shard) * world}
        return {"optimizer_state": cost["gpu"] + ADAM_MOMENTS * shard, **gpu}, {}
    if hold.offload_optimizer:
        return {}, {"optimizer_state": (HOST_BYTES_PER_SHARD_ELEMENT + ADAM_MOMENTS) * shard * world}
    return {"optimizer_state": (FP32_MASTER + ADAM_MOMENTS) * (shard if hold.stage else numel)}, {}


def step_gradients(numel: int, world: int, b: int, hold: Hold, bucket: int, overlap_comm: bool) -> dict:
    """What ZeRO-1/2 (and stage 0) hold from the first backward to the end of ``step`` (``stage_1_and_2.py``):
    the gradients in the training dtype (stage 1 and 0 whole, stage 2 its partition), the fp32 copy of the
    partition the optimizer steps on, and the reduce buckets (``reduce_bucket_size``, two with
    ``overlap_comm``). ZeRO-3 keeps its partition from initialize on."""
    if hold.stage == 3:
        return {}
    part = numel if hold.stage == 0 else shard_numel(numel, world)
    grads = (numel if hold.stage < 2 else part) * b + (0 if hold.offload_optimizer else part * FP32_MASTER)
    out = {"gradients": grads}
    if hold.stage in (1, 2):
        out["reduce_bucket"] = bucket * b * (2 if overlap_comm else 1)
    return out


class ModelCosts:
    """One model on a group of ``world`` GPUs: its share, its forward, generate and training transients, each
    computed once per hold and workload (arrangements reuse them). ``layout_of(hold)``: the registry path's
    layout the model runs its forwards on (``Hold.path``)."""

    def __init__(self, role: str, shape, trainable: bool, world: int, b: int, layout_of, *, value_head: bool = False,
                 ckpt: bool = False, reduce_bucket: int | None = None, overlap_comm: bool = False):
        self.role, self.shape, self.params, self.trainable = role, shape, shape.inventory.num_params, trainable
        self.value_head, self.world, self.b, self.ckpt = value_head, world, b, ckpt
        self.reduce_bucket = int(reduce_bucket or ZERO_DEFAULTS["reduce_bucket_size"])
        self.overlap_comm, self.layout_of = overlap_comm, layout_of
        self._cache: dict = {}

    @property
    def weights(self) -> int:
        return self.params * self.b

    def shard(self) -> int:
        return shard_numel(self.params, self.world)

    def layout(self, hold: Hold):
        return self.layout_of(hold.effective(self.trainable))

    def allocated(self, hold: Hold, wl: Workload, phases: tuple = GENERATE) -> PathMemory:
        key = (hold.effective(self.trainable), wl, phases)
        if key not in self._cache:
            self._cache[key] = allocated(self.layout(hold), self.shape, wl, phases=phases)
        return self._cache[key]

    def persistent_bytes(self, hold: Hold) -> int:
        """The parameters ZeRO-3 keeps whole on every GPU (under the persistence threshold)."""
        numel = params_numel(self.shape.inventory)
        return sum(numel[i] for i in persistent_params(numel, self.layout(hold).gather)) * self.b

    def resident(self, hold: Hold, wl: Workload) -> tuple[dict, dict]:
        """(GPU parts, host parts) this model keeps through the whole iteration: its layout's weights (any
        workload's generate shows them) and, trained, its ZeRO state."""
        mem = self.allocated(hold, wl)
        gpu = {k: mem.gpu_breakdown.get(k, 0) for k in ("weights_resident", "persistent_params")}
        host = {k: v for k, v in mem.host_breakdown.items() if k.startswith("offloaded_params")}
        if self.trainable:
            g, h = training_state(self.params, self.world, self.b, hold.effective(True), self.reduce_bucket)
            gpu.update(g)
            host.update(h)
        return gpu, host

    def gathered(self, hold: Hold, wl: Workload) -> int:
        """What ZeRO-3 gathers at the peak of one forward over ``wl`` (0 when nothing is gathered)."""
        if hold.effective(self.trainable).stage != 3:
            return 0
        return self.allocated(hold, wl, ("prefill",)).gpu_breakdown.get("gathered_params", 0)

    def forward(self, hold: Hold, batch: int, seq: int, dtype: str) -> dict:
        """One no-grad forward over ``batch`` sequences of ``seq`` tokens (the experience phase)."""
        wl = Workload(batch, seq, 1, dtype)
        plain = self.allocated(Hold(0), wl, ("prefill",)).gpu_breakdown
        parts = {"gathered_params": self.gathered(hold, wl), "kv_cache": plain.get("kv_cache", 0),
                 "activations": plain.get("activations", 0)}
        if not self.value_head:
            parts["logits"] = batch * seq * self.shape.vocab * (self.b + 4)
        return parts

    def train_step(self, hold: Hold, batch: int, seq: int, rollout: Workload) -> dict:
        """One training micro-step over ``batch`` sequences of ``seq`` tokens of the ``rollout``; ZeRO-3 gathers
        at least what a forward over them or the rollout's generate gathers at its peak."""
        s, tokens, b = self.shape, batch * seq, self.b
        layer = ACTIVATION_BYTES_PER_ELEMENT * tokens * s.hidden * b // 2
        act = s.layers * tokens * s.hidden * b + layer if self.ckpt else s.layers * layer
        gathered = max(self.gathered(hold, Workload(batch, seq, 1, rollout.dtype)),
                       self.generate(hold, rollout)["gathered_params"])
        parts = {"gathered_params": gathered, "activations": int(act)}
        if not self.value_head:
            parts["logits"] = tokens * s.vocab * (b + 4)
        parts.update(step_gradients(self.params, self.world, b, hold.effective(True), self.reduce_bucket,
                                    self.overlap_comm))
        return parts

    def generate(self, hold: Hold, wl: Workload) -> dict:
        """HF generate on the training module: ZeRO-3 gathers per layer (plan's zero3 model), else plain."""
        g = self.allocated(hold, wl).gpu_breakdown
        return {k: g.get(k, 0) for k in ("gathered_params", "kv_cache", "activations", "logits")}

    def gathered_whole(self, hold: Hold) -> int:
        """What gathering the whole model once adds beside the partitions: the weights not kept whole, or nothing
        on one GPU without offload (the rank's partition is the whole model already, measured)."""
        return self.weights - self.persistent_bytes(hold) if self.layout(hold).gathers else 0

    def workspace_kv(self, wl: Workload, tp: int = 1) -> int:
        """The hybrid engine's KV cache: DeepSpeed's inference kernels size it for max_out_tokens positions
        at the full attention width (heads x head_dim, keys and values) per layer."""
        s = self.shape
        return 2 * s.layers * wl.batch * (wl.prompt_len + wl.new_tokens) * s.heads * s.head_dim * self.b // tp


def engine_parts(actor: ModelCosts, hold: Hold, engine, wl: Workload, gpu_memory: int) -> tuple[dict, dict, list]:
    """(rollout transient, what stays through the other phases, notes) of the actor's rollout engine."""
    h = hold.effective(True)
    if engine.kind == "vllm":
        if not engine.colocate:
            return {}, {}, ["the vLLM engine runs on GPUs of its own"]
        held = int((engine.gpu_memory_utilization or 0.9) * gpu_memory)
        return {"engine": held}, ({} if engine.sleep else {"engine": held}), []
    if engine.kind == "gather-once" and h.stage == 3:
        return dict(actor.generate(Hold(0), wl), gathered_whole_model=actor.gathered_whole(h)), {}, []
    if engine.kind == "hybrid-engine":
        plain = actor.generate(Hold(0), wl)
        ws = actor.workspace_kv(wl, engine.tp)
        parts = {"workspace": ws, "activations": plain["activations"], "logits": plain["logits"]}
        if h.stage == 3 and engine.pin:
            parts["gathered_whole_model"] = actor.gathered_whole(h)
        elif h.stage == 3:
            parts["gathered_params"] = actor.generate(h, wl)["gathered_params"]
        return parts, ({} if engine.release_cache else {"workspace": ws}), []
    notes = ["gather-once on a model that is not partitioned: plain generate"] if engine.kind == "gather-once" else []
    return actor.generate(h, wl), {}, notes


@dataclass
class Phase:
    name: str
    parts: dict  # name -> bytes (resident parts included)

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()))


def prefixed(prefix: str, parts: dict) -> dict:
    return {f"{prefix}:{k}": int(v) for k, v in parts.items() if v}


def phases_of(costs: list, holds: dict, engine, wl: Workload, train_batch: int, gpu_memory: int,
              experience_batch: int | None = None) -> tuple[list[Phase], dict, list]:
    """The phases on one GPU of a group whose models are ``costs`` (their holds in ``holds``), the host parts,
    and notes. The actor's rollout is counted only in the actor's group; no ``experience_batch``: no experience
    phase (the actor alone: its training step holds more than its forward)."""
    resident, host = {}, {}
    for c in costs:
        gpu_part, host_part = c.resident(holds[c.role], wl)
        resident.update(prefixed(c.role, gpu_part))
        host.update(prefixed(c.role, host_part))
    seq = wl.prompt_len + wl.new_tokens
    base = dict(resident, cublas_workspace=CUBLAS_WORKSPACE)
    actor = next((c for c in costs if c.role == "actor"), None)
    out, keep, notes = [], {}, []
    if actor is not None:
        during, keep, notes = engine_parts(actor, holds["actor"], engine, wl, gpu_memory)
        out.append(Phase("rollout", dict(base, **prefixed("rollout", during))))
        keep = prefixed("rollout", keep)
    for name, batch, models in (("experience", experience_batch, costs), ("train", train_batch,
                                                                          [c for c in costs if c.trainable])):
        parts = [(c.role, c.forward(holds[c.role], batch, seq, wl.dtype) if name == "experience" else
                  c.train_step(holds[c.role], batch, seq, wl)) for c in models] if batch else []
        if parts:
            role, most = max(parts, key=lambda rp: sum(rp[1].values()))
            out.append(Phase(name, dict(base, **keep, **prefixed(f"{name}:{role}", most))))
    return out, host, notes


# ------------------------------------------------------------------ the actor alone (plan --loop)

TRAIN_NAMES = {"activations": "training_activations", "logits": "training_logits"}


def flat(parts: dict) -> dict:
    """The actor alone's parts under plan's names: role and phase dropped, the step's activations and logits
    named apart from the generate's."""
    out = {}
    for key, value in parts.items():
        leaf = key.rsplit(":", 1)[-1]
        out[TRAIN_NAMES.get(leaf, leaf) if key.startswith("train:") else leaf] = value
    return out


def knobs_hold(stage: int, knobs, offload_param: bool = False) -> Hold:
    """The actor's hold on a path, with the user's config's offload_optimizer where it has one."""
    return Hold(stage, offload_param, bool(knobs is not None and knobs.offload_optimizer))


def actor_costs(ctx, layout_of) -> ModelCosts:
    """The actor of ``plan --loop`` on the plan's GPUs, with the config's reduce bucket where it has one."""
    bucket = ctx.knobs.reduce_bucket_size if ctx.knobs is not None else None
    return ModelCosts("actor", ctx.shape, True, ctx.hw.gpus, ctx.wl.dtype_bytes, layout_of, reduce_bucket=bucket)


def in_loop(mem: PathMemory | None, costs: ModelCosts, hold: Hold, wl: Workload) -> PathMemory | None:
    """A ZeRO-3 inference path's memory (``mem``: its load and generate, reserved replay included) in a loop:
    the loop's training state in place of a config's, and the training step on one micro-batch of the rollouts
    as a second phase that may set the peak. The reserved bytes keep the replay's slack."""
    if mem is None:
        return None
    state, host_state = training_state(costs.params, costs.world, costs.b, hold, costs.reduce_bucket)
    kept = {k: v for k, v in mem.gpu_breakdown.items() if k not in TRAINING_PARTS}
    base = sum(kept.values())
    if mem.peak_at == "load":
        base = mem.gpu_peak_bytes - sum(mem.gpu_breakdown.get(k, 0) for k in TRAINING_PARTS)
    train = costs.train_step(hold, wl.batch, wl.prompt_len + wl.new_tokens, wl)
    step = dict(costs.resident(hold, wl)[0], cublas_workspace=CUBLAS_WORKSPACE,
                **{TRAIN_NAMES.get(k, k): v for k, v in train.items()})
    peak, breakdown, peak_at = base + sum(state.values()), dict(kept, **state), mem.peak_at
    if sum(step.values()) > peak:
        peak, breakdown, peak_at = sum(step.values()), step, "train-step"
    elif peak_at == "load":  # the load still sets it: its own parts
        breakdown = dict(mem.gpu_breakdown)
    host = dict({k: v for k, v in mem.host_breakdown.items() if k not in TRAINING_PARTS}, **host_state)
    return dataclasses.replace(mem, gpu_peak_bytes=int(peak), gpu_reserved_bytes=int(peak) + (mem.gpu_reserved_bytes -
                               mem.gpu_peak_bytes), gpu_breakdown={k: int(v) for k, v in breakdown.items() if v},
                               host_breakdown=host, host_peak_bytes=int(sum(host.values())), peak_at=peak_at,
                               notes=list(mem.notes) + ["loop: training state counted (Adam moments included)"])
