"""One forward as DeepSpeed ZeRO-3 sees it, and the gather schedule over it.

* ``trace_steps``: the modules one forward runs, in order (containers too: DeepSpeed hooks them), with the
  live activation bytes per token at each step of a Llama-style decoder layer.
* ``GatherReplay``: DeepSpeed's fetch / prefetch / release over those steps (``partitioned_param_coordinator``):
  each rank keeps a 1/N shard of every parameter (padded to a multiple of N); parameters at or under
  ``stage3_param_persistence_threshold`` stay whole once fetched; each module gathers its parameters before
  its forward and releases them after, unless reused within ``stage3_max_reuse_distance``; from the second
  forward on, each module's fetch prefetches up to ``stage3_prefetch_bucket_size`` more elements, bounded by
  ``stage3_max_live_parameters`` available elements; a prefetched group lands in one flat buffer that lives
  until its parameters are copied out on first use.
* ``gather_points`` / ``peak_moment``: the allocated-peak model's reading of that schedule (``memory.py``); the
  caching-allocator replay (``reserved.py``) reads the same schedule through ``GatherReplay``'s sink.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dsdoctor.plan.shape import ModelShape

NORM_FP32_BYTES = 8  # RMSNorm: float32 copy and its square, per hidden element


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
    if shape.fused_gate_up:
        # Phi3MLP: gate_up = gate_up_proj(x); gate, up = gate_up.chunk(2); up = up * act(gate); down_proj(up).
        # The chunks are views: the 2I-wide output lives until the MLP returns, beside act(gate) and the product
        levels.update({"gate_up_proj": base + b * (2 * h + 2 * i), "act_fn": base + b * (2 * h + 3 * i),
                       "mul": base + b * (2 * h + 4 * i), "down_proj": base + b * (3 * h + 3 * i)})
    if shape.fused_qkv:
        # Phi3Attention: q, k, v are views of one qkv_proj output, alive (value_states) until the forward returns
        levels["o_proj"] = base + b * (2 * h + 2 * q + 2 * k)
    if shape.inventory.moe is not None:
        levels.update(_moe_levels(shape, b, base))
    return levels


MOE_PAIR_BYTES = 40  # per (token, chosen expert): sorted expert ids and permutation, token index (int64), weights


def _moe_levels(shape: ModelShape, b: int, base: float) -> dict[str, float]:
    """The routed block of transformers 5 (``integrations/moe.py`` grouped_mm, its default where the GPU has
    grouped GEMMs), per token with k chosen experts, beside the layer's input and the block's own (measured on CPU
    per family by recording every tensor a block's forward creates: within 0.5%). Up: the tokens sorted by expert,
    the gate_up output, act(gate) and the product (gpt-oss: its gathered biases and clamps too); down: the sorted
    input, the down output, the weighted and the un-permuted outputs (float32 where the routing weights are:
    DeepSeek). Qwen2-MoE keeps its shared expert's output. The router: logits and their float32 softmax.
    ``shape.experts`` names another implementation (``model.moe.implementation``): batched_mm, eager, per-expert."""
    moe = shape.inventory.moe
    h, i, k = shape.hidden, moe.expert_intermediate, moe.top_k
    w = 4 if "deepseek" in moe.block_class else b
    up = b * (h + (9 if "gpt_oss" in moe.block_class else 4) * i)
    down = h * (2 * b + 2 * w)
    shared = b * h if moe.shared_experts and "qwen2_moe" in moe.block_class else 0
    into = base + 2 * b * h  # the residual and the normed input
    router = into + moe.num_experts * (b + 4)
    experts = k * (max(up, down) + MOE_PAIR_BYTES)
    if shape.experts == "batched_mm":  # each (token, expert) pair gathers its expert's weights: a decode kernel
        experts = k * (3 * i * h * b + (i + h) * b + 18)
    elif shape.experts in ("eager", "per-expert"):
        experts = _looped_experts(moe, h, i, b, w, shape.experts == "eager", "gpt_oss" in moe.block_class)
    return {"experts": into + shared + experts, "gate": router, "router": router}


def _looped_experts(moe, h: int, i: int, b: int, w: int, eager: bool, gpt_oss: bool) -> float:
    """A loop over the experts some token chose (5.x eager; 4.x one module per expert): the output, the router's
    top-k ids and weights, the int64 one-hot mask of every (token, slot) over the experts (5.x adds a sentinel
    class; 4.x keeps the router logits beside it), and one expert's tokens at a time (k/N pairs per token under
    even routing): its input and output, and I-wide tensors, 5.x's eager with the previous expert's gate/up still
    alive (gpt-oss: its biases and clamps too). Measured on CPU within 6% from 1024 tokens."""
    n, k = moe.num_experts, moe.top_k
    mask = k * (n + 1) * 8 + k * 12 if eager else k * n * 8 + n * b + k * (b + 8)
    tall, wide = (2, 10 if gpt_oss else 5) if eager else (3, 3)
    return b * h + mask + k / n * ((tall * h + wide * i) * b + h * (w - b) + 16)


_ALIASES = {  # module name endings of other families -> the Llama step they play
    "c_attn": "v_proj", "query_key_value": "v_proj", "qkv_proj": "v_proj", "wqkv": "v_proj",
    "c_proj": "o_proj", "dense": "o_proj", "out_proj": "o_proj", "wo": "o_proj",
    "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "c_fc": "up_proj", "fc1": "up_proj", "fc2": "down_proj",
    "dense_h_to_4h": "up_proj", "dense_4h_to_h": "down_proj", "gate_up_proj": "act_fn",
    "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "input_layernorm": "input_layernorm",
}


def step_kind(module: str) -> str:
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


def _forward_order(item) -> tuple:
    """Sort key of (registration position, (module, params)): embeddings, then each layer's modules in the
    order a Llama-style layer runs them, then the final norm and the lm_head."""
    pos, (name, params) = item
    layer = params[0].layer
    if layer is None:
        return (0 if params[0].kind == "embedding" else 2, 0, 0, pos)
    part = name.split(f".{layer}.", 1)[-1]
    group = 1 if "attn" in part or "attention" in part.split(".")[0] else 3 if "mlp" in part or "feed" in part else None
    order = _LAYER_ORDER.get(step_kind(name), group if group is not None else 1)
    return (1, layer, order, pos)


def _outside_layers(shape: ModelShape, b: int, name: str, params, plist) -> list[Step]:
    """The embedding (and the rotary embedding after it), the lm_head, or the final norm."""
    emb_level = b * shape.hidden
    if params[0].kind == "embedding":
        return [Step(name, plist, emb_level, None),
                Step("<rotary_emb>", [], emb_level + 2 * b * shape.head_dim, None)]
    if params[0].kind == "lm_head":
        return [Step(name, plist, b * shape.hidden, None)]
    # final norm: embeddings, last hidden state, float32 work
    return [Step(name, plist, 2 * b * shape.hidden + NORM_FP32_BYTES * shape.hidden, None)]


def _in_layer(shape: ModelShape, levels: dict, name: str, layer: int, plist) -> list[Step]:
    """A module inside a decoder layer, with the points inside its forward where the layer can peak."""
    kind = step_kind(name)
    owner = name.rsplit(".", 1)[0]
    if shape.fused_gate_up and name.endswith("gate_up_proj"):
        return [Step(name, plist, levels["gate_up_proj"], layer),
                Step(owner + ".activation_fn", [], levels["act_fn"], layer),  # a module: DeepSpeed hooks it
                Step(owner + ".<mul>", [], levels["mul"], layer, virtual=True)]
    out = []
    if kind == "up_proj" and shape.gated_mlp:
        out.append(Step(owner + ".act_fn", [], levels["act_fn"], layer))
    out.append(Step(name, plist, levels.get(kind, levels["attention"]), layer, attention=(kind == "v_proj")))
    if kind == "v_proj":
        out.append(Step(owner + ".<sdpa>", [], levels["attention"], layer, virtual=True, attention=True))
    if kind == "up_proj" and shape.gated_mlp:
        out.append(Step(owner + ".<mul>", [], levels["mul"], layer, virtual=True))
    return out


def trace_steps(shape: ModelShape, b: int, tp: int = 1) -> list[Step]:
    """The modules one forward runs, in order, with containers (DeepSpeed hooks them too) and the
    point between ``up_proj`` and ``down_proj`` where the MLP peaks."""
    inv = shape.inventory
    levels = _layer_levels(shape, b, tp)
    index = {id(p): n for n, p in enumerate(inv.params)}
    ordered = [m for _, m in sorted(enumerate(inv.modules()), key=_forward_order)]
    steps: list[Step] = [Step("<root>", [], b * shape.hidden, None), Step("<model>", [], b * shape.hidden, None)]
    entered: set[str] = set()
    container_level = levels["input_layernorm"] - NORM_FP32_BYTES * shape.hidden - b * shape.hidden
    for name, params in ordered:
        parts = name.split(".")
        layer = params[0].layer
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            if parent not in entered and (layer is not None and f".{layer}" in "." + parent):
                entered.add(parent)
                steps.append(Step(parent, [], container_level, layer))
        plist = [(index[id(p)], p.numel) for p in params]
        if layer is None:
            steps += _outside_layers(shape, b, name, params, plist)
        else:
            steps += _in_layer(shape, levels, name, layer, plist)
    for alias in sorted({alias for alias, _owner in inv.tied}):  # a tied lm_head uses the embedding weight again
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
        self._need: list = []  # the parameters of the module entered last (released by leave)

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
        b, numel_of = self.b, self.numel_of
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
            self._prefetch(need, mark)
        self._need = need

    def _prefetch(self, need: list, mark) -> None:
        """Walk the recorded trace past this module's own parameters, then launch up to the prefetch bucket
        (bounded by max_live_parameters available elements) of the parameters that come next."""
        g, numel_of = self.g, self.numel_of
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


def prepared(points: list[Point]) -> tuple:
    """``points`` as ``peak_moment`` reads them: (point, layers done after it (+1), whether its cache grows with
    the layer, whether it is the lm_head, whether it is attention's own call) per point, computed once per
    forward instead of per workload."""
    out, done = [], -1
    for pt in points:
        if pt.layer is not None:
            done = max(done, pt.layer - (0 if pt.attention else 1))
        out.append((pt, done + 1, pt.layer is not None, pt.label.endswith("lm_head"), pt.label.endswith(".<sdpa>")))
    return tuple(out)


def peak_moment(points: tuple, tokens: int, layers: int, kv_before: float, kv_after: float,
                kv_transient: float, logits_bytes: float, lm_head_bytes: float, fixed: float = 0,
                scores: float = 0) -> tuple:
    """Place one forward's ``prepared`` points on a workload (activations scale with tokens, the cache grows per
    layer) and return (the first moment with the largest ``fixed + total``, that figure). Only that moment is
    built: a plan reads ~10^5 points per path and workload while it searches the largest batch and prompt.
    ``scores``: what eager attention holds inside its function (``eager_scores``), at attention's own call."""
    best, best_at = None, None
    grow = kv_after - kv_before
    for pt, progress, layered, lm_head, attention_call in points:
        if layered:
            kv = kv_before + grow * progress / layers
        else:
            kv = kv_after if progress >= layers else kv_before
        if pt.attention:
            kv += kv_transient
        logits = logits_bytes if pt.end else (lm_head_bytes if lm_head else 0)
        act = pt.level * tokens + (scores if attention_call else 0) if not pt.end else 0
        key = fixed + (pt.gathered + act + kv + logits)  # Moment.total's sum, in its order
        if best is None or key > best:
            best, best_at = key, (pt, act, kv, logits)
    pt, act, kv, logits = best_at
    return Moment(pt.label, pt.gathered, act, kv, logits), best


def eager_scores(shape: ModelShape, batch: int, queries: int, keys: int, b: int, tp: int = 1) -> float:
    """Bytes eager attention holds at once for ``batch`` x heads x ``queries`` x ``keys`` scores (SDPA: none).
    transformers' eager function: q.k^T x scaling, + mask, softmax(dtype=float32), cast back: at the softmax the
    masked scores, their float32 copy and the float32 result live together (dtype + 8 bytes an element; a float32
    model: 8), beside the 4-D mask; gpt-oss's (eager-sinks): the masked scores, the logits with the sink column
    less their maximum, and the softmax in the dtype (3 x dtype bytes). Measured on the CPU against transformers'
    own functions (tests/plan/test_attention.py). Every layer at prefill scores the whole prompt (a sliding window
    only masks)."""
    kind = shape.inventory.attention
    if kind == "sdpa":
        return 0
    heads = math.ceil(shape.q_dim / shape.head_dim / tp)
    n = batch * heads * queries * (keys + (kind == "eager-sinks"))
    per = 3 * b if kind == "eager-sinks" else 8 if b == 4 else b + 8
    return n * per + batch * queries * keys * b
