"""Reserved GPU memory: what PyTorch's CUDA caching allocator holds for one run, the real OOM line.

``torch.cuda.max_memory_allocated`` (plan's peak) counts live tensors; the allocator reserves more. It
rounds requests (to 512 bytes; segments of 2 MiB for requests up to 1 MiB, 20 MiB for requests under
10 MiB, larger ones rounded to 2 MiB), serves a request from the smallest cached free block that fits,
splits it (large pool: when more than 1 MiB would remain), merges neighbours when freed, and asks CUDA for
a new segment when no free block fits (``c10/cuda/CUDACachingAllocator.cpp``). Under ZeRO-3 a forward
allocates and frees every gathered parameter while the KV cache and activations, which live longer, land
in the holes; the next large gather then finds no hole big enough and a new segment is reserved. With
``expandable_segments:True`` a pool is one segment that grows by mapping 2 MiB pages, so a new request
can extend the free block at its end instead of taking a new segment.

This module replays the allocation sequence of the run plan models (load, then two generates: the
warm-up and the timed one; per forward: embeddings, each decoder layer's ops as transformers' Llama-style
layer runs them, the KV cache's ``torch.cat``, the logits and their float32 copies; ZeRO-3's gathers,
prefetches and releases from ``schedule.GatherReplay``, the same replay the allocated peak comes from) through
a model of that allocator, and returns the peak reserved bytes. Decode steps are replayed for the first and
last few tokens of each generate (the rest repeat them with a slightly longer cache).

Checked against ``torch.cuda.memory._record_memory_history`` of real runs (one H200, ZeRO-3 with
offload_param, bench/speed run 3): the gather stream's allocations and frees equal the recorded ones, and
the allocator model fed the recorded events reproduces the recorded reserved peak exactly.

DeepSpeed frees a gathered parameter with ``record_stream`` on the compute stream, so its block returns to
the pool only once the GPU has run the kernels that read it. On several ranks the host runs ahead of the
compute stream whenever a layer computes longer than it gathers (a long prefill), and the allocator takes
new segments for what it gathers meanwhile: 2 x H200, Llama-3.1-8B shape, batch 8, prompt 2048: 13.8 GiB
allocated, 21.7 GiB reserved. The replay runs clocks for the host, the gather stream and the compute stream
from the machine's figures (``Timing``) on several ranks, which reproduces that record within 1.1%. On one
rank with offload the host waits for every copy and runs ahead only of a long prefill (-33% without the clocks
at batch 16 x prompt 2048, bench/speed run 6); there plan keeps the larger of the replays with and without
them (``paths.base.replay``), and adds ``held_split_bytes``.
"""
from __future__ import annotations

import math

from dsdoctor.plan.allocator import Allocator, MiB, round_size, segment_size
from dsdoctor.plan.zero3_replay import Timing, Zero3Fetcher

DECODE_STEPS_REPLAYED = 2  # first and last decode steps of each generate


class _Run:
    """Issues the run's allocations: ids, and names for what must be freed later."""

    def __init__(self, alloc: Allocator):
        self.a = alloc
        self.n = 0
        self.before = None  # called before each allocation (the allocator processes its events first)

    def new(self, nbytes, stream: int = 0) -> int:
        self.n += 1
        if nbytes > 0:
            if self.before is not None:
                self.before()
            self.a.malloc(self.n, int(nbytes), stream)
        return self.n

    def free(self, *tids) -> None:
        for t in tids:
            if t is not None:
                self.a.release(t)


def _decoder_layer(r: _Run, shape, n: int, b: int, tp: int, kv: dict, layer: int, batch: int, ctx: int,
                   fetch, release, prefill: bool):
    """One Llama-style decoder layer over ``n`` tokens (batch x new positions), as transformers runs it."""
    h = shape.hidden
    q = math.ceil(shape.q_dim / tp)
    k = math.ceil(shape.kv_elems_per_token[layer] / 2 / tp)
    window = shape.kv_window[layer]

    def norm(x_bytes_per_tok, mod):
        fetch(mod)
        a1 = r.new(n * h * 4)  # hidden_states.to(float32)
        a2 = r.new(n * h * 4)  # * rsqrt(variance)
        r.free(a1)
        a3 = r.new(n * h * 2)  # .to(bf16)
        r.free(a2)
        out = r.new(n * h * 2)  # weight * x
        r.free(a3)
        release(mod)
        return out

    x = norm(h, "input_layernorm")
    outs = {}
    qkv = None
    if shape.fused_qkv:  # one output; q, k and v are views of it, alive until the attention forward returns
        fetch("v_proj")
        qkv = r.new(n * (q + 2 * k) * b)
        release("v_proj")
        outs["v_proj"] = r.new(n * k * b)  # the cache's copy of the value view (its update concatenates)
    else:
        for name, width in (("q_proj", q), ("k_proj", k), ("v_proj", k)):
            fetch(name)
            outs[name] = r.new(n * width * b)
            release(name)
    r.free(x)
    # rotary on q and k: x*cos, rotate_half(x), *sin, sum
    for name, width in (("q_proj", q), ("k_proj", k)):
        t1 = r.new(n * width * b)
        t2 = r.new(n * width * b)
        t3 = r.new(n * width * b)
        r.free(t2)
        t4 = r.new(n * width * b)
        r.free(t1, t3, outs.get(name))
        outs[name] = t4
    # the cache: the first update keeps the tensors; later ones concatenate
    for name in ("k_proj", "v_proj"):
        old = kv.get((layer, name))
        if old is None or prefill:
            r.free(old)
            kv[(layer, name)] = outs[name]
        else:
            kept = min(ctx, window - 1) if window else ctx
            new = r.new(batch * kept * k * b)
            r.free(old, outs[name])
            kv[(layer, name)] = new
    attn = r.new(n * q * b)  # SDPA output
    r.free(outs["q_proj"])
    cont = r.new(n * q * b)  # transpose(1, 2).contiguous()
    r.free(attn)
    fetch("o_proj")
    o = r.new(n * h * b)
    release("o_proj")
    r.free(cont, qkv)
    return o


def _forward(r: _Run, shape, batch: int, new: int, ctx: int, b: int, tp: int, kv: dict, fetch, release,  # noqa: PLR0915
             prefill: bool, logits_f32: bool = True):
    n = batch * new
    h = shape.hidden
    fetch("<embed>")
    emb = r.new(n * h * b)
    release("<embed>")
    cos, sin = r.new(n * shape.head_dim * b), r.new(n * shape.head_dim * b)
    hidden = emb
    for layer in range(shape.layers):
        fetch(("<layer>", layer))
        o = _decoder_layer(r, shape, n, b, tp, kv, layer, batch, ctx, lambda m, L=layer: fetch((L, m)),
                           lambda m, L=layer: release((L, m)), prefill)
        h1 = r.new(n * h * b)  # residual + attention
        r.free(o)
        fetch((layer, "post_attention_layernorm"))
        a1 = r.new(n * h * 4)
        a2 = r.new(n * h * 4)
        r.free(a1)
        a3 = r.new(n * h * 2)
        r.free(a2)
        x = r.new(n * h * 2)
        r.free(a3)
        release((layer, "post_attention_layernorm"))
        i = math.ceil(shape.intermediate / tp)
        gate_up = None
        if shape.fused_gate_up:  # Phi3MLP: the 2I-wide output stays (its chunks are views) until the MLP returns
            fetch((layer, "gate_up_proj"))
            gate_up = r.new(n * 2 * i * b)
            release((layer, "gate_up_proj"))
            act = r.new(n * i * b)
            m = r.new(n * i * b)
            r.free(act)
        elif shape.gated_mlp:
            fetch((layer, "gate_proj"))
            g = r.new(n * i * b)
            release((layer, "gate_proj"))
            act = r.new(n * i * b)
            r.free(g)
            fetch((layer, "up_proj"))
            u = r.new(n * i * b)
            release((layer, "up_proj"))
            m = r.new(n * i * b)
            r.free(act, u)
        else:
            fetch((layer, "up_proj"))
            u = r.new(n * i * b)
            release((layer, "up_proj"))
            m = r.new(n * i * b)
            r.free(u)
        r.free(x)
        fetch((layer, "down_proj"))
        d = r.new(n * h * b)
        release((layer, "down_proj"))
        r.free(m, gate_up)
        h2 = r.new(n * h * b)
        r.free(d, h1)
        release(("<layer>", layer))
        if hidden is not emb:
            r.free(hidden)
        hidden = h2
    fetch("<norm>")
    a1 = r.new(n * h * 4)
    a2 = r.new(n * h * 4)
    r.free(a1)
    a3 = r.new(n * h * 2)
    r.free(a2)
    x = r.new(n * h * 2)
    r.free(a3, hidden)
    release("<norm>")
    keep = batch if shape.logits_to_keep else n
    fetch("<lm_head>")
    logits = r.new(keep * shape.vocab * b)
    release("<lm_head>")
    r.free(x, emb, cos, sin)
    f32 = r.new(batch * shape.vocab * 4)  # generate: next-token logits to float32
    r.free(logits)
    proc = r.new(batch * shape.vocab * 4)  # a logits processor's result
    r.free(f32, proc)


def simulate(name: str, shape, wl, g, numel_of: list, expandable: bool = False, tp: int = 1,
             training_bytes: int = 0, timing: Timing | None = None, built: bool = False) -> Allocator:
    a = Allocator(expandable)
    r = _Run(a)
    b = wl.dtype_bytes
    inv = shape.inventory
    untied = [p.numel for alias, owner in inv.tied for p in inv.params if p.module == owner]
    # load
    if name == "plain":
        for n in numel_of:
            r.new(n * b)
        if built:  # built from its config on the GPU: a tied output layer's own weight, until post_init ties it
            r.free(*[r.new(n * b) for n in untied])
    elif name == "tp":
        for p in inv.params:  # AutoTP copies each sliced weight to the GPU: its share
            r.new(p.numel * b / (tp if (p.kind == "linear" and p.layer is not None) or p.kind == "lm_head" else 1))
    else:
        extra = []
        for k, n in enumerate(numel_of + untied):
            full = r.new(n * b)
            if not g.offload:
                shard = r.new(math.ceil(n / g.world) * b)
                if k >= len(numel_of):
                    extra.append(shard)
            r.free(full)
        r.free(*extra)  # post_init ties the output layer: its own shard goes
    if training_bytes:
        r.new(training_bytes)
    r.new(32 * MiB)  # cuBLAS workspace, at the first matmul
    z3 = Zero3Fetcher(r, shape, g, b, numel_of, tp, timing)
    a.fetcher = z3
    B, S, T = wl.batch, wl.prompt_len, wl.new_tokens
    for _generate in range(2):  # the warm-up generate and the timed one
        kv: dict = {}
        steps = list(range(1, T))
        if len(steps) > 2 * DECODE_STEPS_REPLAYED:
            steps = steps[:DECODE_STEPS_REPLAYED] + steps[-DECODE_STEPS_REPLAYED:]
        z3.start(B * S, B, S, True)
        _forward(r, shape, B, S, S, b, tp, kv, z3.fetch, z3.release, prefill=True)
        z3.finish()
        z3.prefetch = True  # from the second forward on, ZeRO-3 prefetches along the recorded trace
        for t in steps:
            z3.start(B, B, S + t, False)
            _forward(r, shape, B, 1, S + t, b, tp, kv, z3.fetch, z3.release, prefill=False)
            z3.finish()
        for tid in list(kv.values()):
            r.free(tid)
    return a


_CACHE: dict = {}


def _shape_key(shape, numel_of) -> tuple:
    """What the replay reads of a model, by value: an ``id()`` is reused once a shape is garbage collected,
    and would hand one model's replay to the next (seen when plan ran over many models in one process)."""
    inv = shape.inventory
    return (shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab,
            shape.layers, shape.gated_mlp, tuple(shape.kv_elems_per_token), tuple(shape.kv_window),
            shape.logits_to_keep, shape.fused_qkv, shape.fused_gate_up, tuple(numel_of),
            tuple((p.module, p.kind, p.layer) for p in inv.params),
            tuple(inv.tied))


def held_split_bytes(g, b: int, numel_of: list) -> int:
    """With offload_param, one segment of the largest gathered parameter (the embedding or output layer). DeepSpeed
    frees a gathered parameter with ``record_stream`` on the compute stream (``free_param``); on one rank the host
    waits only for the copy (``NoGatherHandle.wait``), so where the GPU is still computing, a release is not yet
    reusable at the next gather. That gather then splits the one free block big enough, the one the largest
    parameter left; lowest address first (``allocator``), the carved segment keeps serving the smaller gathers and
    the largest parameter's next gather takes a new segment. Seven of the eleven recorded offload histories (edge
    run 1, speed runs 3 and 6) show it: fed with every release at once they lose one such segment (one, two).
    The replay cannot time those holds, so the segment is added."""
    if not (g.zero3 and g.offload):
        return 0
    largest = max((n for n in numel_of if n > g.persistence_threshold), default=0)
    return segment_size(round_size(largest * b)) if largest else 0


def reserved_detail(name, shape, wl, g, peak, numel_of, expandable=False, training_bytes=0, tp=1,
                    timing: Timing | None = None, built: bool = False) -> tuple[int, int, int]:
    """(peak reserved bytes, the most bytes of released gathers held at once, the layers they belonged to) for a
    run whose allocated peak plan puts at ``peak``: the simulated allocator's reserved peak, shifted by how far
    its own allocated peak (deferred releases not counted, as ``max_memory_allocated`` does not count them) is
    from plan's exact one, plus ``held_split_bytes``. Held bytes are only simulated with ``timing`` (the host
    ahead of the GPU). ``built``: the model is built from its config on the GPU (no checkpoint)."""
    key = (_shape_key(shape, numel_of), name, wl, g, expandable, training_bytes, tp, timing, built)
    if key not in _CACHE:
        a = simulate(name, shape, wl, g, numel_of, expandable, tp, training_bytes, timing, built)
        _CACHE[key] = (a.peak_reserved, a.peak_live, *a.fetcher.held_max)
        if len(_CACHE) > 256:
            _CACHE.pop(next(iter(_CACHE)))
    res, alloc, held, layers = _CACHE[key]
    slack = max(res - alloc, 0)  # what fragmentation and rounding add beyond the simulated live peak
    split = 0 if expandable else held_split_bytes(g, wl.dtype_bytes, numel_of)
    return int(max(peak + slack, peak) + split), int(held), int(layers)


def reserved_for(name, shape, wl, g, peak, numel_of, expandable=False, training_bytes=0, tp=1,
                 timing: Timing | None = None, built: bool = False) -> int:
    """The peak reserved bytes of ``reserved_detail``."""
    return reserved_detail(name, shape, wl, g, peak, numel_of, expandable, training_bytes, tp, timing, built)[0]
