"""Per-GPU memory of one arrangement of an RL job (``plan --loop`` with several models): what each model
holds on every GPU of its group, and what each phase of a PPO-style iteration adds on top.

A model is held (``Hold``) at a ZeRO stage with or without ``offload_param`` (stage 3 only: DeepSpeed ignores
it below) and, when it trains, with or without ``offload_optimizer``:

* weights: stage 3 a 1/N shard (none with offload_param: pinned on the host), else the whole model;
* a trainable model's state (DeepSpeed 0.19.8's ZeRO optimizers, fp32 Adam): fp32 master + two fp32 moments
  per element of the 1/N partition (stage 0: of the whole model), and at stage 3 also the flat gradient
  partition in the training dtype and the reduce bucket, built at initialize; with offload_optimizer the
  master, gradients and moments on the host (17 bytes per shard element measured at initialize,
  ``zero_costs.py``, + 8 for the moments). ZeRO-1/2 hold their gradients (the partition, or the whole model
  at stage 1 and 0, in the training dtype, its fp32 copy for the optimizer) and reduce buckets only from
  backward to the end of ``step`` (``stage_1_and_2.py`` frees them there): a training-step part, measured on
  one H200 (bench/rlloop/job_gpu.py: a ZeRO-2 rollout peak of weights + 12 bytes per parameter).

The phases, each on top of every model's share (plus what the rollout engine keeps):

* rollout: the actor generates ``batch`` sequences of prompt + new tokens: plan's own generate model
  (``memory.allocated`` on the plain or ZeRO-3 layout) for HF generate; gather-once and the hybrid engine
  under ZeRO-3 (pin_parameters) add the whole weights (nothing on one GPU without offload: its partition is
  the whole model, measured); the hybrid engine's workspace holds its KV cache for
  max_out_tokens positions at full attention width (its inference kernels), kept through training unless
  ``release_inference_cache``; a colocated vLLM engine holds ``gpu_memory_utilization`` of each GPU,
  through training unless put to sleep;
* experience: no-grad forwards over the rollouts (the framework's experience micro-batch x (prompt + new)),
  one model at a time:
  ZeRO-3's gathers, the forward's KV cache and activations (plan's prefill model) and, for the language
  models, logits over every position with their fp32 copy (value heads: none);
* train: one step of each trainable model on a micro-batch: the activations kept for backward (34 bytes per
  token, hidden element and layer at 16 bits, Korthikanti et al. 2022, ``loop.py``; with gradient
  checkpointing each layer's input and one layer recomputed), logits, ZeRO-3's gathers, ZeRO-1/2's gradients.

The per-GPU peak is the largest phase; its parts add up to it. Torch-free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dsdoctor.config.schema import ZERO_DEFAULTS
from dsdoctor.plan.loop import ACTIVATION_BYTES_PER_ELEMENT
from dsdoctor.plan.memory import CUBLAS_WORKSPACE, Layout, allocated, zero3_gather
from dsdoctor.plan.paths.plain import plain_layout
from dsdoctor.plan.workload import Workload
from dsdoctor.zero_costs import HOST_BYTES_PER_SHARD_ELEMENT

ADAM_MOMENTS = 8  # two fp32 moments per element
FP32_MASTER = 4
PHASES = ("rollout", "experience", "train")


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


def effective(hold: Hold, trainable: bool) -> Hold:
    """What DeepSpeed does with it: offload_param only at stage 3, no optimizer for a frozen model."""
    return Hold(hold.stage, hold.offload_param and hold.stage == 3, hold.offload_optimizer and trainable)


class ModelCosts:
    """One model of the job on a group of ``world`` GPUs: its share, its forward and training transients,
    computed once per hold and cached (arrangements reuse them)."""

    def __init__(self, role: str, shape, params: int, trainable: bool, value_head: bool, world: int, b: int,
                 ckpt: bool, reduce_bucket: int | None, overlap_comm: bool):
        self.role, self.shape, self.params, self.trainable = role, shape, params, trainable
        self.value_head, self.world, self.b, self.ckpt = value_head, world, b, ckpt
        self.reduce_bucket = int(reduce_bucket or ZERO_DEFAULTS["reduce_bucket_size"])
        self.overlap_comm = overlap_comm
        self._cache: dict = {}

    @property
    def weights(self) -> int:
        return self.params * self.b

    def shard(self) -> int:
        return math.ceil(self.params / self.world)

    def resident(self, hold: Hold) -> tuple[dict, dict]:
        """(GPU parts, host parts) this model keeps through the whole iteration."""
        h, n, b = effective(hold, self.trainable), self.params, self.b
        gpu, host = {}, {}
        if h.stage == 3:
            if h.offload_param:
                host["offloaded_params"] = n * b  # every rank's shard, pinned
            else:
                gpu["weights"] = self.shard() * b
        else:
            gpu["weights"] = n * b
        if not self.trainable:
            return gpu, host
        shard = self.shard()
        if h.offload_optimizer:
            host["optimizer_state"] = (HOST_BYTES_PER_SHARD_ELEMENT + ADAM_MOMENTS) * shard * self.world
        elif h.stage == 3:  # fp32 master and the flat gradient partition, built at initialize (zero_costs.py)
            gpu["optimizer_state"] = (b + FP32_MASTER + ADAM_MOMENTS) * shard
        elif h.stage in (1, 2):  # the gradients live only from backward to the end of step (train_step)
            gpu["optimizer_state"] = (FP32_MASTER + ADAM_MOMENTS) * shard
        else:
            gpu["optimizer_state"] = (FP32_MASTER + ADAM_MOMENTS) * n
        if h.stage == 3:
            gpu["gradient_buckets"] = self.reduce_bucket * b
        return gpu, host

    def step_gradients(self, hold: Hold) -> dict:
        """What ZeRO-1/2 (and stage 0) hold from the first backward to the end of ``step``
        (``stage_1_and_2.py``): the gradients in the training dtype (stage 1 and 0 whole, stage 2 its
        partition), the fp32 copy of the partition the optimizer steps on, and the reduce buckets
        (``reduce_bucket_size``, two with ``overlap_comm``). ZeRO-3 keeps its partition from initialize on."""
        h, n, b = effective(hold, True), self.params, self.b
        if h.stage == 3:
            return {}
        part = n if h.stage == 0 else self.shard()
        grads = (n if h.stage < 2 else part) * b + (0 if h.offload_optimizer else part * FP32_MASTER)
        out = {"gradients": grads}
        if h.stage in (1, 2):
            out["gradient_buckets"] = self.reduce_bucket * b * (2 if self.overlap_comm else 1)
        return out

    def _layout(self, hold: Hold) -> Layout:
        h = effective(hold, self.trainable)
        if h.stage == 3:
            return Layout("zero3-offload" if h.offload_param else "zero3", world=self.world, replicas=self.world,
                          procs=self.world, gather=zero3_gather(self.world, "cpu" if h.offload_param else None, None))
        return plain_layout(self.world)

    def _allocated(self, hold: Hold, wl: Workload, phases: tuple):
        key = ("alloc", effective(hold, self.trainable), wl, phases)
        if key not in self._cache:
            self._cache[key] = allocated(self._layout(hold), self.shape, wl, phases=phases)
        return self._cache[key]

    def gathered(self, hold: Hold, tokens_wl: Workload) -> int:
        """What ZeRO-3 gathers at the peak of one forward (0 when nothing is gathered)."""
        h = effective(hold, self.trainable)
        if h.stage != 3:
            return 0
        return self._allocated(hold, tokens_wl, ("prefill",)).gpu_breakdown.get("gathered_params", 0)

    def forward(self, hold: Hold, batch: int, seq: int, dtype: str) -> dict:
        """One no-grad forward over ``batch`` sequences of ``seq`` tokens (the experience phase)."""
        wl = Workload(batch, seq, 1, dtype)
        plain = self._allocated(Hold(0), wl, ("prefill",)).gpu_breakdown
        parts = {"gathered": self.gathered(hold, wl), "kv_cache": plain.get("kv_cache", 0),
                 "activations": plain.get("activations", 0)}
        if not self.value_head:
            parts["logits"] = batch * seq * self.shape.vocab * (self.b + 4)
        return parts

    def train_step(self, hold: Hold, batch: int, seq: int, dtype: str) -> dict:
        """One training micro-step over ``batch`` sequences of ``seq`` tokens."""
        s, tokens, b = self.shape, batch * seq, self.b
        layer = ACTIVATION_BYTES_PER_ELEMENT * tokens * s.hidden * b // 2
        if self.ckpt:  # each layer's input kept, one layer recomputed at a time
            act = s.layers * tokens * s.hidden * b + layer
        else:
            act = s.layers * layer
        parts = {"gathered": self.gathered(hold, Workload(batch, seq, 1, dtype)), "activations": int(act)}
        if not self.value_head:
            parts["logits"] = tokens * s.vocab * (b + 4)
        parts.update(self.step_gradients(hold))
        return parts

    def generate(self, hold: Hold, wl: Workload) -> dict:
        """HF generate on the training module: ZeRO-3 gathers per layer (plan's zero3 model), else plain."""
        mem = self._allocated(hold, wl, ("prefill", "decode"))
        g = mem.gpu_breakdown
        return {"gathered": g.get("gathered_params", 0), "kv_cache": g.get("kv_cache", 0),
                "activations": g.get("activations", 0), "logits": g.get("logits", 0)}

    def gathered_per_step(self, hold: Hold, wl: Workload) -> int:
        return self._allocated(hold, wl, ("prefill", "decode")).gathered_bytes_per_step

    def plain_generate(self, wl: Workload) -> dict:
        return self.generate(Hold(0), wl)

    def workspace_kv(self, wl: Workload, tp: int = 1) -> int:
        """The hybrid engine's KV cache: DeepSpeed's inference kernels size it for max_out_tokens positions
        at the full attention width (heads x head_dim, keys and values) per layer."""
        s = self.shape
        return 2 * s.layers * wl.batch * (wl.prompt_len + wl.new_tokens) * s.heads * s.head_dim * self.b // tp


def engine_parts(actor: ModelCosts, hold: Hold, engine, wl: Workload, gpu_memory: int) -> tuple[dict, dict, list]:
    """(rollout transient, what stays through the other phases, notes) of the actor's rollout engine."""
    h = effective(hold, True)
    kind, notes = engine.kind, []
    if kind == "vllm":
        if not engine.colocate:
            return {}, {}, ["the vLLM engine runs on GPUs of its own"]
        held = int((engine.gpu_memory_utilization or 0.9) * gpu_memory)
        return {"engine": held}, ({} if engine.sleep else {"engine": held}), []
    # gathering on one GPU without offload copies nothing: the rank's partition is the whole model already
    gathers = actor.world > 1 or h.offload_param
    if kind == "gather-once" and h.stage == 3:
        parts = dict(actor.plain_generate(wl))
        parts["gathered_whole_model"] = actor.weights if gathers else 0
        return parts, {}, []
    if kind == "hybrid-engine":
        plain = actor.plain_generate(wl)
        ws = actor.workspace_kv(wl, engine.tp)
        parts = {"workspace": ws, "activations": plain["activations"], "logits": plain["logits"]}
        if h.stage == 3 and engine.pin:
            parts["gathered_whole_model"] = actor.weights if gathers else 0
        elif h.stage == 3:
            parts["gathered"] = actor.generate(hold, wl)["gathered"]
        return parts, ({} if engine.release_cache else {"workspace": ws}), []
    if kind == "gather-once":
        notes.append("gather-once on a model that is not partitioned: plain generate")
    return actor.generate(hold, wl), {}, notes


@dataclass
class Phase:
    name: str
    parts: dict  # name -> bytes (resident parts included)

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()))


def prefixed(prefix: str, parts: dict) -> dict:
    return {f"{prefix}:{k}": int(v) for k, v in parts.items() if v}


def phases_of(costs: list, holds: dict, actor_role: str, engine, wl: Workload, train_batch: int,
              gpu_memory: int, experience_batch: int | None = None) -> tuple[list[Phase], dict, list]:
    """The three phases on one GPU of a group whose models are ``costs`` (their holds in ``holds``), the host
    parts, and notes. The actor's rollout is counted only in the actor's group."""
    resident, host = {}, {}
    for c in costs:
        gpu_part, host_part = c.resident(holds[c.role])
        resident.update(prefixed(c.role, gpu_part))
        host.update(prefixed(c.role, host_part))
    seq = wl.prompt_len + wl.new_tokens
    notes: list = []
    base = dict(resident, cublas_workspace=CUBLAS_WORKSPACE)
    actor = next((c for c in costs if c.role == actor_role), None)
    out = []
    keep: dict = {}
    if actor is not None:
        during, keep, notes = engine_parts(actor, holds[actor.role], engine, wl, gpu_memory)
        out.append(Phase("rollout", dict(base, **prefixed("rollout", during))))
        keep = prefixed("rollout", keep)
    forwards = [(c.role, c.forward(holds[c.role], experience_batch or wl.batch, seq, wl.dtype)) for c in costs]
    if forwards:
        role, parts = max(forwards, key=lambda rp: sum(rp[1].values()))
        out.append(Phase("experience", dict(base, **keep, **prefixed(f"experience:{role}", parts))))
    steps = [(c.role, c.train_step(holds[c.role], train_batch, seq, wl.dtype)) for c in costs if c.trainable]
    if steps:
        role, parts = max(steps, key=lambda rp: sum(rp[1].values()))
        out.append(Phase("train", dict(base, **keep, **prefixed(f"train:{role}", parts))))
    return out, host, notes
