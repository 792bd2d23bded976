"""Per-GPU and host memory of one inference run (load + generate) on each load path.

Derived from how the real code allocates, not fitted:

* transformers' ``generate`` with ``DynamicCache``: the cache grows by ``torch.cat`` (one layer's old and new
  keys live together for a moment); prefill runs the whole prompt through each layer; ``logits_to_keep=1``
  keeps the lm_head output to the last position, which ``generate`` copies to float32.
* the Llama-style layer: the embedding output and each layer's input stay referenced by the caller while
  the layer runs; RMSNorm computes in float32; the gated MLP holds act(gate), up and their product at once.
* DeepSpeed ZeRO-3 (``partitioned_param_coordinator.py``, ``partition_parameters.py``): each rank keeps a
  1/N shard of every parameter (padded to a multiple of N); parameters at or under
  ``stage3_param_persistence_threshold`` stay whole once fetched; each module gathers its parameters
  before its forward and releases them after, unless reused within ``stage3_max_reuse_distance``; from the
  second forward on, each module's fetch prefetches up to ``stage3_prefetch_bucket_size`` more elements,
  bounded by ``stage3_max_live_parameters`` available elements; a prefetched group lands in one flat
  buffer that lives until its parameters are copied out on first use.
* AutoTP (``deepspeed.init_inference``): linear layers, the embedding and lm_head are split N ways;
  norms stay whole; every rank runs the same batch.

What ``torch.cuda.max_memory_allocated`` does not count (CUDA context, NCCL buffers, allocator slack) is
kept apart: it decides ``fits``, not ``gpu_peak_bytes``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dsdoctor.model.inventory import Inventory
from dsdoctor.zero_costs import optimizer_cost

MiB = 1024**2
GiB = 1024**3
CUBLAS_WORKSPACE = 32 * MiB  # torch's cuBLAS workspace on Hopper (":4096:8"), allocated through the caching allocator
CUDA_CONTEXT = 600 * MiB  # per process, outside the caching allocator
NCCL_BUFFERS = 512 * MiB  # per process with a multi-rank communicator, outside the caching allocator
NORM_FP32_BYTES = 8  # RMSNorm: float32 copy and its square, per hidden element
CHECKPOINT_SHARD = 5 * GiB  # transformers' default safetensors shard: held on the host while loading

PATHS = ("plain", "tp", "zero3", "zero3-offload", "zero3-offload-nvme")


# ---------------------------------------------------------------------------------------------- shapes

@dataclass
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    gated_mlp: bool
    kv_elems_per_token: list  # per layer: elements of keys + values for one position
    kv_window: list  # per layer: positions kept (None: all)
    logits_to_keep: bool
    inventory: Inventory

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim


def model_shape(spec, inv: Inventory) -> ModelShape:
    raw = spec.raw.get("text_config") if isinstance(spec.raw.get("text_config"), dict) else spec.raw
    layers = spec.num_layers
    if inv.cache_layout and len(inv.cache_layout) == layers:  # what transformers' DynamicCache really holds
        per_layer = [e for e, _ in inv.cache_layout]
        windows = [w for _, w in inv.cache_layout]
    else:
        if raw.get("kv_lora_rank"):  # MLA: transformers caches the compressed latent and the rope key
            per_token = int(raw["kv_lora_rank"]) + int(raw.get("qk_rope_head_dim", 0))
        else:
            per_token = 2 * spec.num_kv_heads * spec.head_dim
        per_layer = [per_token] * layers
        window = spec.sliding_window
        types = raw.get("layer_types")
        if inv.window_layout and len(inv.window_layout) == layers:
            windows = [w for _, w in inv.window_layout]
        elif isinstance(types, list) and len(types) == layers:
            windows = [window if (t == "sliding_attention" and window) else None for t in types]
        elif window and raw.get("use_sliding_window", True) and spec.model_type in ("mistral", "mixtral", "qwen2",
                                                                                      "starcoder2"):
            windows = [window] * layers
        else:
            windows = [None] * layers
    names = {p.module.rsplit(".", 1)[-1] for p in inv.params}
    gated = bool(names & {"gate_proj", "w1", "gate_up_proj"})
    return ModelShape(spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                      spec.vocab_size, layers, gated, per_layer, windows, inv.supports_logits_to_keep, inv)


def kv_bytes(shape: ModelShape, batch: int, positions: int, dtype_bytes: int, tp: int = 1,
             layers: int | None = None) -> int:
    """KV cache of ``layers`` layers (default all) holding ``positions`` positions for ``batch`` sequences."""
    total = 0
    for elems, window in list(zip(shape.kv_elems_per_token, shape.kv_window))[: layers if layers is not None else None]:
        kept = min(positions, window - 1) if window else positions  # DynamicSlidingWindowLayer keeps window-1
        total += batch * kept * math.ceil(elems / tp) * dtype_bytes
    return total


# ------------------------------------------------------------------------------ activations per step

def _layer_levels(shape: ModelShape, b: int, tp: int) -> dict[str, float]:
    """Live activation bytes per token at each step of one decoder layer (beyond the KV cache).

    ``base``: the embedding output (LlamaModel keeps ``inputs_embeds`` referenced), the layer's input (the
    caller's variable) and the rotary cos/sin of the whole forward.
    """
    h = shape.hidden
    q = math.ceil(shape.q_dim / tp)
    k = math.ceil(shape.kv_elems_per_token[0] / 2 / tp)
    i = math.ceil(shape.intermediate / tp)
    base = b * 2 * h + 2 * b * shape.head_dim
    levels = {
        "input_layernorm": base + NORM_FP32_BYTES * h + b * h,
        "q_proj": base + b * (h + q),
        "k_proj": base + b * (h + q + k),
        "v_proj": base + b * (h + q + 2 * k),
        # rotary: q, q*cos, rotate_half(q), rotate_half(q)*sin live at once; then SDPA output
        "attention": base + b * (h + 4 * q + 2 * k),
        "o_proj": base + b * (h + q + h),
        "post_attention_layernorm": base + b * h + NORM_FP32_BYTES * h + b * h,
    }
    if shape.gated_mlp:
        levels.update({
            "gate_proj": base + b * (2 * h + i),
            "act_fn": base + b * (2 * h + 2 * i),
            "up_proj": base + b * (2 * h + 2 * i),
            "mul": base + b * (2 * h + 3 * i),  # act(gate) * up: three I-wide tensors at once
            "down_proj": base + b * (3 * h + i),
        })
    else:
        levels.update({"up_proj": base + b * (2 * h + i), "act_fn": base + b * (2 * h + 2 * i),
                       "down_proj": base + b * (3 * h + i)})
    return levels


_ALIASES = {  # module name endings of other families -> the Llama step they play
    "c_attn": "v_proj", "query_key_value": "v_proj", "qkv_proj": "v_proj", "wqkv": "v_proj",
    "c_proj": "o_proj", "dense": "o_proj", "out_proj": "o_proj", "wo": "o_proj",
    "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "c_fc": "up_proj", "fc1": "up_proj", "fc2": "down_proj",
    "dense_h_to_4h": "up_proj", "dense_4h_to_h": "down_proj", "gate_up_proj": "act_fn",
    "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "input_layernorm": "input_layernorm",
}


def _step_kind(module: str) -> str:
    last = module.rsplit(".", 1)[-1]
    return _ALIASES.get(last, last)


# ------------------------------------------------------------------------------------------ the trace

@dataclass
class Step:
    module: str
    params: list  # [(param index, numel)]
    level: float  # activation bytes per token during this step's forward
    layer: int | None
    virtual: bool = False  # not a module (no fetch/prefetch hook): a point inside a forward
    attention: bool = False  # the KV cache grows here


_LAYER_ORDER = {"input_layernorm": 0, "q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 1,
                "post_attention_layernorm": 2, "gate_proj": 3, "up_proj": 3, "down_proj": 3}


def trace_steps(shape: ModelShape, b: int, tp: int = 1) -> list[Step]:
    """The modules one forward runs, in order, with containers (DeepSpeed hooks them too) and the
    point between ``up_proj`` and ``down_proj`` where the MLP peaks."""
    inv = shape.inventory
    levels = _layer_levels(shape, b, tp)
    mods = inv.modules()
    index = {id(p): n for n, p in enumerate(inv.params)}

    def sort_key(item):
        pos, (name, params) = item
        layer = params[0].layer
        if layer is None:
            return (0 if params[0].kind == "embedding" else 2, 0, 0, pos)
        part = name.split(f".{layer}.", 1)[-1]
        group = 1 if "attn" in part or "attention" in part.split(".")[0] else 3 if "mlp" in part or "feed" in part else None
        order = _LAYER_ORDER.get(_step_kind(name), group if group is not None else 1)
        return (1, layer, order, pos)

    ordered = [m for _, m in sorted(enumerate(mods), key=sort_key)]
    steps: list[Step] = [Step("<root>", [], b * shape.hidden, None), Step("<model>", [], b * shape.hidden, None)]
    entered: set[str] = set()
    aliases = {alias for alias, _owner in inv.tied}
    emb_level = b * shape.hidden
    for name, params in ordered:
        parts = name.split(".")
        layer = params[0].layer
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            if parent not in entered and (layer is not None and f".{layer}" in "." + parent):
                entered.add(parent)
                level = levels["input_layernorm"] - NORM_FP32_BYTES * shape.hidden - b * shape.hidden
                steps.append(Step(parent, [], level, layer))
        kind = _step_kind(name)
        plist = [(index[id(p)], p.numel) for p in params]
        if layer is None:
            if params[0].kind == "embedding":
                steps.append(Step(name, plist, emb_level, None))
                steps.append(Step("<rotary_emb>", [], emb_level + 2 * b * shape.head_dim, None))
            elif params[0].kind == "lm_head":
                steps.append(Step(name, plist, b * shape.hidden, None))
            else:  # final norm: embeddings, last hidden state, float32 work
                steps.append(Step(name, plist, 2 * b * shape.hidden + NORM_FP32_BYTES * shape.hidden, None))
            continue
        if kind == "up_proj" and shape.gated_mlp:
            steps.append(Step(name.rsplit(".", 1)[0] + ".act_fn", [], levels["act_fn"], layer))
        level = levels.get(kind, levels["attention"])
        steps.append(Step(name, plist, level, layer, attention=(kind == "v_proj")))
        if kind == "v_proj":
            steps.append(Step(name.rsplit(".", 1)[0] + ".<sdpa>", [], levels["attention"], layer, virtual=True,
                              attention=True))
        if kind == "up_proj" and shape.gated_mlp:
            steps.append(Step(name.rsplit(".", 1)[0] + ".<mul>", [], levels["mul"], layer, virtual=True))
    for alias in sorted(aliases):  # a tied lm_head uses the embedding weight again at the end
        owner = dict(inv.tied)[alias]
        emb = [(index[id(p)], p.numel) for p in inv.params if p.module == owner]
        steps.append(Step(alias, emb, b * shape.hidden, None))
    return steps


# --------------------------------------------------------------------------------- the gather model

@dataclass(frozen=True)
class Gather:
    """How a rank obtains whole parameters: resident (nothing to do) or ZeRO-3 gathers."""
    world: int = 1
    zero3: bool = False
    offload: str | None = None
    persistence_threshold: int = 100_000
    prefetch_bucket: int = 50_000_000
    max_live: int = 1_000_000_000
    max_reuse: int = 1_000_000_000


def _aligned(n: int, world: int) -> int:
    return math.ceil(n / world) * world


@dataclass
class Moment:
    label: str
    gathered: float  # bytes of whole parameters and gather buffers on the GPU
    act: float  # activation bytes
    kv: float
    logits: float = 0.0

    @property
    def total(self) -> float:
        return self.gathered + self.act + self.kv + self.logits


@dataclass(frozen=True)
class Point:
    """A point of one forward, independent of the workload: gathered bytes, activation bytes per token."""
    label: str
    gathered: float
    level: float
    layer: int | None
    attention: bool
    end: bool = False  # after the forward: generate's float32 copy of the logits


class GatherReplay:
    """DeepSpeed's fetch / prefetch / release over one forward (``partitioned_param_coordinator``), step by
    step. ``held()`` is the bytes of whole parameters and gather buffers on the GPU. Every buffer it creates
    or frees is also told to ``sink(op, key, nbytes[, kind])`` (op "alloc" or "free"; "wait" where the module
    waits for its gathers; kind "copy" for a copy out of a coalesced buffer), in DeepSpeed's order: the
    allocated-peak model (``gather_points``) and the caching-allocator replay (``plan/reserved.py``) read
    the same sequence."""

    def __init__(self, steps: list[Step], b: int, g: Gather, prefetch: bool, numel_of: list[int], sink=None):
        self.b, self.g, self.prefetch, self.numel_of = b, g, prefetch, numel_of
        self.sink = sink or (lambda op, key, nbytes=0, kind=None: None)
        self.active = g.zero3 and (g.world > 1 or bool(g.offload))
        self.persistent = {i for i, n in enumerate(numel_of) if n <= g.persistence_threshold} if g.zero3 else set()
        self.avail: dict[int, int] = {}  # param -> bytes of its whole copy
        self.inflight: dict[int, int] = {}  # group id -> flat buffer bytes
        self.group_of: dict[int, int] = {}
        self.members: dict[int, list[int]] = {}
        self.pending: dict[int, set] = {}
        self.n_available = 0
        self.most_recent: dict[int, int] = {}
        self.real = [s for s in steps if not s.virtual]
        self.queue = [(p, k) for k, s in enumerate(self.real) for p, _ in s.params if p not in self.persistent]
        self.qpos = 0
        self.gid = 0
        self.real_idx = -1
        # With offload_param on several ranks, a partition lives on the host and is copied to the GPU to be
        # the all-gather's input (partition_parameters.py: ``ds_tensor.to(device)``). A single parameter's
        # copy is the input of an asynchronous all-gather: its work object keeps it until the parameter is
        # waited for. A coalesced group's copies are concatenated into the flat buffer and freed at once.
        self.staging = bool(g.offload) and g.world > 1
        self.staged: dict[int, int] = {}  # param -> bytes of its partition's GPU copy, until waited for

    def held(self) -> float:
        return sum(self.avail.values()) + sum(self.inflight.values()) + sum(self.staged.values())

    def _launch(self, params) -> float:
        """Start the gathers; return the bytes that exist only while they are being started."""
        if not params:
            return 0.0
        g, b, numel_of, sink = self.g, self.b, self.numel_of, self.sink
        self.gid += 1
        transient = 0.0
        if len(params) == 1 or g.world == 1:
            for p in params:  # sequential all-gather / host copy: straight into the parameter's buffer
                if self.staging:
                    self.staged[p] = math.ceil(numel_of[p] / g.world) * b
                    sink("alloc", ("stage", p), self.staged[p])
                self.avail[p] = (_aligned(numel_of[p], g.world) if g.world > 1 else numel_of[p]) * b
                sink("alloc", ("param", p), self.avail[p])
        else:  # coalesced: one flat buffer, copied out parameter by parameter on first use
            if self.staging:
                parts = [math.ceil(numel_of[p] / g.world) * b for p in params]
                transient = sum(parts)
                for p, n in zip(params, parts):
                    sink("alloc", ("stage", self.gid, p), n)
            self.inflight[self.gid] = sum(_aligned(numel_of[p], g.world) for p in params) * b
            sink("alloc", ("flat", self.gid), self.inflight[self.gid])
            if self.staging:
                for p in params:
                    sink("free", ("stage", self.gid, p))
            self.members[self.gid] = list(params)
            for p in params:
                self.group_of[p] = self.gid
        self.n_available += sum(numel_of[p] for p in params)
        return transient

    def enter(self, step: Step, mark=None) -> None:
        """The module's pre-forward hook: gather what it needs, wait, prefetch. ``mark(label, extra)`` is
        called where a moment inside the hook can peak (extra: bytes beyond ``held()``)."""
        mark = mark or (lambda label, extra: None)
        b, numel_of, g = self.b, self.numel_of, self.g
        self.real_idx += 1
        need = [p for p, _ in step.params if p not in self.persistent]
        transient = self._launch([p for p in need if p not in self.avail and p not in self.group_of])
        if self.staging and (transient or any(p in self.staged for p in need)):
            mark(" (gather)", transient)
        for p in need:
            if self.staged.pop(p, None) is not None:  # waited for: the all-gather's input is released
                self.sink("free", ("stage", p))
            grp = self.group_of.pop(p, None)
            if grp is None:
                continue
            if grp in self.members:  # first use: every parameter of the group is copied out of the flat buffer
                copies = sum(numel_of[q] for q in self.members[grp]) * b
                mark(" (wait)", copies)
                for q in self.members.pop(grp):
                    self.avail[q] = numel_of[q] * b
                    self.sink("alloc", ("param", q), self.avail[q], "copy")
                self.pending[grp] = set(q for q in self.group_of if self.group_of[q] == grp)
            # the handle (and its flat buffer) stays referenced by the in-flight registry until the last
            # parameter of the group has been waited for by its own module
            self.pending.setdefault(grp, set()).discard(p)
            if not self.pending[grp]:
                self.pending.pop(grp)
                if self.inflight.pop(grp, None) is not None:
                    self.sink("free", ("flat", grp))
        self.sink("wait", None, 0)  # the module waits here for its gathers, before it prefetches
        if self.prefetch:
            wanted = {p for p in need if self.most_recent.get(p, -1) < self.real_idx}
            queue = self.queue
            while self.qpos < len(queue) and wanted:
                p, k = queue[self.qpos]
                self.qpos += 1
                self.most_recent[p] = max(self.most_recent.get(p, -1), k)
                wanted.discard(p)
            budget = min(g.max_live - self.n_available, g.prefetch_bucket)
            chosen, numel = [], 0
            while self.qpos < len(queue) and numel < budget:
                p, k = queue[self.qpos]
                self.qpos += 1
                self.most_recent[p] = max(self.most_recent.get(p, -1), k)
                if p not in self.avail and p not in self.group_of and p not in chosen:
                    chosen.append(p)
                    numel += numel_of[p]
            transient = self._launch(chosen)
            if transient:
                mark(" (prefetch)", transient)
        self._need = need

    def leave(self, step: Step) -> None:
        """The module's post-forward hook: release, unless used again within max_reuse_distance or
        prefetched for a later use."""
        need = self._need
        if not need:
            return
        keep = set()
        traversed = 0
        for later in self.real[self.real_idx + 1:]:
            if traversed >= self.g.max_reuse:
                break
            for p, n in later.params:
                keep.add(p)
                traversed += n
        for p in need:
            if p in keep or self.most_recent.get(p, -1) > self.real_idx or p not in self.avail:
                continue
            self.avail.pop(p)
            self.sink("free", ("param", p))
            self.n_available -= self.numel_of[p]

    def finish(self) -> None:
        """The end of the forward: whatever is still gathered is released (``release_and_reset_all``)."""
        for p in list(self.staged):
            self.sink("free", ("stage", p))
        for grp in list(self.inflight):
            self.sink("free", ("flat", grp))
        for p in list(self.avail):
            self.sink("free", ("param", p))
        self.staged.clear()
        self.inflight.clear()
        self.avail.clear()


def gather_points(steps: list[Step], layers: int, b: int, g: Gather, prefetch: bool,
                  numel_of: list[int]) -> list[Point]:
    """The moments of one forward under DeepSpeed's fetch / prefetch / release (``GatherReplay``)."""
    points: list[Point] = []
    rep = GatherReplay(steps, b, g, prefetch, numel_of)
    prev = steps[0]
    for step in steps:
        if step.virtual or not rep.active:
            points.append(Point(step.module, rep.held(), step.level, step.layer, step.attention))
            prev = step
            continue
        rep.enter(step, lambda label, extra, s=step, q=prev: points.append(
            Point(s.module + label, rep.held() + extra, q.level, q.layer, False)))
        points.append(Point(step.module, rep.held(), step.level, step.layer, step.attention))
        prev = step
        rep.leave(step)
    points.append(Point("<logits>", rep.held(), 0.0, None, False, end=True))
    return points


def moments_of(points: list[Point], tokens: int, layers: int, kv_before: float, kv_after: float,
               kv_transient: float, logits_bytes: float, lm_head_bytes: float) -> list[Moment]:
    """Place one forward's points on a workload: activations scale with tokens, the cache grows per layer."""
    out = []
    done = -1
    for pt in points:
        if pt.layer is not None:
            done = max(done, pt.layer - (0 if pt.attention else 1))
            kv = kv_before + (kv_after - kv_before) * (done + 1) / layers
        else:
            kv = kv_after if done >= layers - 1 else kv_before
        kv += kv_transient if pt.attention else 0
        logits = logits_bytes if pt.end else (lm_head_bytes if pt.label.endswith("lm_head") else 0)
        out.append(Moment(pt.label, pt.gathered, pt.level * tokens if not pt.end else 0, kv, logits))
    return out


# ---------------------------------------------------------------------------------------- estimates

@dataclass
class PathMemory:
    name: str
    ranks: int
    replicas: int  # independent batches served at once (data parallel)
    gpu_peak_bytes: int
    gpu_reserved_bytes: int
    gpu_outside_allocator_bytes: int  # CUDA context, NCCL: counted for fits only
    host_peak_bytes: int  # the whole host: every rank on it
    peak_at: str
    gpu_breakdown: dict
    host_breakdown: dict
    resident_weight_bytes: int
    gathered_bytes_per_step: int  # weights a decode step must bring in (gather or host copy), per rank
    notes: list = field(default_factory=list)
    fragmentation_bytes: int = 0


def _pow2(n: int) -> int:
    """torch's pinned host allocator rounds every block up to a power of two."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def _params_numel(inv: Inventory) -> list[int]:
    return [p.numel for p in inv.params]


TP_GRAIN = 64  # deepspeed.inference.config: tensor_parallel.tp_grain_size
_ROW_PARALLEL = {"o_proj", "down_proj"}  # AutoTP's all-reduce linears split their input dimension


def _tp_shard(total: int, tp: int, rank: int, kv_heads: int | None, name: str) -> int:
    """The rows (or columns) ``rank`` gets of a dimension of ``total`` (module_inject/tp_shard.py:
    get_shard_size): attention splits whole key/value heads; MLPs and the lm_head split in grains of 64,
    the last rank taking the tail."""
    mlp = "mlp" in name or _step_kind(name) in ("gate_proj", "up_proj", "down_proj")
    if kv_heads and total % kv_heads == 0 and not mlp and not name.endswith(("lm_head", "embed_out")):
        return total * (kv_heads // tp + (1 if rank < kv_heads % tp else 0)) // kv_heads
    if total >= TP_GRAIN:
        grains, tail = divmod(total, TP_GRAIN)
        return (grains // tp + (1 if rank < grains % tp else 0)) * TP_GRAIN + (tail if rank == tp - 1 else 0)
    return total // tp + (1 if rank < total % tp else 0)


def _tp_share(inv: Inventory, tp: int, kv_heads: int | None = None) -> int:
    """Elements the fullest AutoTP rank holds: decoder linears split (column-parallel on their outputs,
    o_proj/down_proj on their inputs) and the lm_head on its input; norms whole; a tied lm_head gets its
    own slice. The input embedding stays whole: AutoTP's default policies slice only modules inside the
    decoder layers, plus the lm_head (``module_inject/auto_tp.py``: ``nn.Embedding`` is sliced only through
    a ``partition_config``), and the embedding lies outside them."""
    def rank_share(rank: int) -> int:
        total = 0
        for p in inv.params:
            split = p.kind == "lm_head" or (p.kind == "linear" and p.layer is not None)
            if not split or not p.shape:
                total += p.numel
                continue
            rows = p.kind == "linear" and _step_kind(p.module) not in _ROW_PARALLEL
            if len(p.shape) == 2:
                dim = 0 if rows else 1
                other = p.shape[1 - dim]
                total += _tp_shard(p.shape[dim], tp, rank, kv_heads, p.module) * other
            else:  # a bias: split with its column-parallel weight, whole after a row-parallel one
                total += _tp_shard(p.numel, tp, rank, kv_heads, p.module) if rows else p.numel
        for alias, owner in inv.tied:
            for p in inv.params:
                if p.module == owner and len(p.shape) == 2:
                    total += _tp_shard(p.shape[1], tp, rank, kv_heads, alias) * p.shape[0]
        return total

    return max(rank_share(r) for r in range(tp))


def _training_extras(knobs, numel: int, world: int, b: int) -> tuple[dict, dict, list]:
    """What ``deepspeed.initialize`` with an optimizer section builds (DeepSpeedZeroOptimizer_Stage3)."""
    gpu, host, notes = {}, {}, []
    if knobs is None or not knobs.has_optimizer or knobs.zero_stage != 3:
        return gpu, host, notes
    cost = optimizer_cost(numel, world, knobs.offload_optimizer, b, knobs.reduce_bucket_size)
    gpu["reduce_bucket"] = cost["bucket"]
    if cost["host"]:  # pinned, per rank: the node holds every local rank's
        host["optimizer_state"] = cost["host"] * world
    else:
        gpu["optimizer_state"] = cost["gpu"]
    notes.append("training-config optimizer state counted (Adam moments appear only at step())")
    return gpu, host, notes


def estimate_path(name: str, shape: ModelShape, wl, hw, knobs=None, expandable: bool = False,
                  context_bytes: int | None = None, reserved_ratio: float | None = None,
                  phases: tuple | None = None, built_from_config: bool = False) -> PathMemory | None:
    """``reserved_ratio``: reserved = peak x ratio instead of replaying the allocator (what-fits searches
    reuse the ratio of the planned workload)."""
    """Memory of one load path; None when the path does not apply (tp on one GPU)."""
    inv = shape.inventory
    b = wl.dtype_bytes
    n = hw.gpus
    numel_of = _params_numel(inv)
    total_numel = sum(numel_of)
    weights = total_numel * b
    B, S, final = wl.batch, wl.prompt_len, wl.final_len
    notes: list[str] = []
    if name == "tp":
        if n < 2:
            return None
        tp, world, replicas = n, n, 1
    elif name == "plain":
        tp, world, replicas = 1, 1, n
    else:
        tp, world, replicas = 1, n, n
    offload = {"zero3-offload": "cpu", "zero3-offload-nvme": "nvme"}.get(name)
    zero3 = name.startswith("zero3")
    defaults = dict(persistence_threshold=100_000, prefetch_bucket=50_000_000, max_live=1_000_000_000,
                    max_reuse=1_000_000_000)
    if knobs is not None:
        defaults.update(persistence_threshold=knobs.param_persistence_threshold,
                        prefetch_bucket=knobs.prefetch_bucket_size, max_live=knobs.max_live_parameters,
                        max_reuse=knobs.max_reuse_distance)
    g = Gather(world=world, zero3=zero3, offload=offload, **defaults)
    persistent = [i for i, k in enumerate(numel_of) if zero3 and k <= g.persistence_threshold]
    persistent_bytes = sum(numel_of[i] for i in persistent) * b

    # resident weights on each GPU
    if name == "plain":
        resident = weights
    elif name == "tp":
        resident = _tp_share(inv, tp, shape.kv_heads) * b
    else:
        shards = sum(math.ceil(k / world) for i, k in enumerate(numel_of)) * b
        resident = (0 if offload else shards) + persistent_bytes
    # load: building on the GPU (plain), slicing a host copy (tp), or zero.Init: every module is built
    # whole on the GPU, then partitioned (to the host with offload). A tied output layer is built too, with
    # its own weight, and partitioned like the rest; only post_init's tying drops it, after everything else.
    load_peak = resident
    if zero3:
        done = 0
        untied = [p.numel for alias, owner in inv.tied for p in inv.params if p.module == owner]
        for k in numel_of + untied:
            shard = math.ceil(k / world) * b
            load_peak = max(load_peak, done + k * b + (0 if offload else shard))
            done += 0 if offload else shard
        load_peak = max(load_peak, resident)
    elif name == "plain" and built_from_config and inv.tied:
        # no weights to load: the model is built from its config on the GPU (``model_cls(config)``), which
        # creates the output layer with its own weight last; post_init's tying frees it only after that
        # (measured on one H200: Llama-3.2-1B and Qwen2.5-1.5B shapes, load peak = weights + lm_head exactly).
        # from_pretrained builds on the meta device and ties before loading: no such transient.
        untied = sum(p.numel for alias, owner in inv.tied for p in inv.params if p.module == owner)
        load_peak = max(load_peak, resident + untied * b)

    kv_prompt = kv_bytes(shape, B, S, b, tp)
    kv_final = kv_bytes(shape, B, final, b, tp)
    kv_layer_final = max(kv_bytes(shape, B, final, b, tp, layers=1) // 2, 0)
    vocab = shape.vocab  # tp: LmHeadLinearAllreduce returns whole logits
    logits_prefill_tokens = 1 if shape.logits_to_keep else S
    logits_prefill = B * logits_prefill_tokens * vocab * b + B * vocab * 4
    logits_decode = B * vocab * b + B * vocab * 4
    fixed = resident + CUBLAS_WORKSPACE
    key = (tp, b, g)
    cache = shape.__dict__.setdefault("_points", {})
    if key not in cache:
        steps = trace_steps(shape, b, tp)
        cache[key] = tuple(gather_points(steps, shape.layers, b, g, pf, numel_of) for pf in (False, True))
    first_pts, warm_pts = cache[key]
    lm_prefill = B * logits_prefill_tokens * vocab * b
    first = moments_of(first_pts, B * S, shape.layers, 0, kv_prompt, 0, logits_prefill, lm_prefill)
    warm = moments_of(warm_pts, B * S, shape.layers, 0, kv_prompt, 0, logits_prefill, lm_prefill)
    decode = moments_of(warm_pts, B, shape.layers, kv_bytes(shape, B, final - 1, b, tp), kv_final, kv_layer_final,
                        logits_decode, B * vocab * b)
    candidates = [("load", Moment("load", 0, 0, 0), load_peak)]
    for phase, moments in (("prefill", first + warm), ("decode", decode)):
        for m in moments:
            candidates.append((phase, m, fixed + m.total))
    if phases:  # e.g. ab reads a generate-only peak: ("prefill", "decode")
        candidates = [c for c in candidates if c[0] in phases]
    phase, moment, peak = max(candidates, key=lambda c: c[2])
    if phase == "load":
        breakdown = {"weights_resident": resident, "load_transient": load_peak - resident}
        peak = load_peak
    else:
        breakdown = {"weights_resident": resident - persistent_bytes, "persistent_params": persistent_bytes,
                     "gathered_params": moment.gathered, "kv_cache": moment.kv, "activations": moment.act,
                     "logits": moment.logits, "cublas_workspace": CUBLAS_WORKSPACE}
    t_gpu, t_host, t_notes = _training_extras(knobs if zero3 else None, total_numel, world, b)
    notes += t_notes
    for key, value in t_gpu.items():
        breakdown[key] = value
        peak += value
    breakdown = {k: int(v) for k, v in breakdown.items() if v}
    peak = int(peak)
    # what the caching allocator reserves for that allocated peak (plan/reserved.py)
    from dsdoctor.plan.reserved import reserved_for

    if reserved_ratio is not None:
        reserved = int(peak * reserved_ratio)
    else:
        from dsdoctor.plan.reserved import timing_for

        # the clocks of the deferred releases, on several ranks only: there the host runs ahead of the compute
        # stream whenever a layer computes longer than it gathers (measured on 2 x H200: 21.67 GiB reserved for
        # 13.8 allocated). On one rank with offload the host waits for every copy; the replay without clocks
        # matches its recorded allocator history exactly, and clocks there moved some cases away from the
        # measurement (BENCHMARKS.md, runs 3-6)
        timing = timing_for(name, shape, hw, getattr(hw, "figures", None)) if g.zero3 and world > 1 else None
        reserved = reserved_for(name, shape, wl, g, peak, phase, moment, numel_of, expandable,
                                training_bytes=sum(t_gpu.values()), tp=tp, timing=timing)
    # deepspeed.initialize needs a process group: ZeRO-3 holds NCCL's buffers on one rank too (measured on one
    # H200: 1.25 GiB outside the allocator under ZeRO-3 vs 0.68 GiB plain, bench/speed run 1)
    outside = (context_bytes if context_bytes is not None else CUDA_CONTEXT) + (NCCL_BUFFERS if world > 1 or zero3 else 0)

    # host, all ranks of the machine together
    host: dict[str, int] = {}
    procs = n if name != "plain" or n > 1 else 1
    if name == "plain":
        host["checkpoint_while_loading"] = min(weights, CHECKPOINT_SHARD) * procs
    elif name == "tp":
        host["model_copy_while_sharding"] = weights * n
    else:
        host["checkpoint_while_loading"] = min(weights, CHECKPOINT_SHARD) * n
    if offload == "cpu":
        pinned = knobs.offload_param_pin_memory if knobs is not None and knobs.offload_param else True
        per_rank = sum((_pow2(math.ceil(k / world) * b) if pinned else math.ceil(k / world) * b)
                       for i, k in enumerate(numel_of) if i not in set(persistent))
        host["offloaded_params_pinned" if pinned else "offloaded_params"] = per_rank * n
    if offload == "nvme":
        count = knobs.nvme_buffer_count if knobs is not None else 5
        size = knobs.nvme_buffer_size if knobs is not None else 100_000_000
        host["nvme_swap_buffers_pinned"] = _pow2(size * b) * count * n
    for key, value in t_host.items():
        host[key] = value
    host_peak = sum(host.values())

    if zero3 and (world > 1 or offload):
        per_step = sum(numel_of[i] for i in range(len(numel_of)) if i not in set(persistent))
        gathered_per_step = per_step * b
    else:
        gathered_per_step = 0
    if zero3 and world == 1 and not offload:
        notes.append("ZeRO-3 on one rank shards nothing: every parameter stays whole on the GPU")
    return PathMemory(name, world, replicas, peak, reserved, outside, int(host_peak), phase, breakdown, host,
                      int(resident), int(gathered_per_step), notes, max(reserved - peak, 0))
