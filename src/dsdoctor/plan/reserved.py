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
prefetches and releases from ``memory.GatherReplay``, the same replay the allocated peak comes from) through
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
rank with offload the host waits for every copy; the clocks are not used there. What they would add on one
rank was measured (up to -33% at batch 16 x prompt 2048, bench/speed run 6) but they did not reproduce it
case by case.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from dsdoctor.findings import Finding

KiB, MiB = 1024, 1024**2
SMALL_REQUEST = 1 * MiB  # kSmallSize
SMALL_SEGMENT = 2 * MiB  # kSmallBuffer
LARGE_SEGMENT = 20 * MiB  # kLargeBuffer
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge
PAGE = 2 * MiB  # expandable segments map 2 MiB pages
DECODE_STEPS_REPLAYED = 2  # first and last decode steps of each generate
FRAGMENTATION_FINDING = 0.15
# ZeRO-3 gathers on its own stream (overlap_comm defaults to true at stage 3): the caching allocator keys
# free blocks by stream, so gathered parameters and the main stream's tensors never share a block
GATHER_STREAM = 1


def round_size(n: int) -> int:
    return 512 if n < 512 else 512 * math.ceil(n / 512)


def segment_size(n: int) -> int:
    if n <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if n < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return ROUND_LARGE * math.ceil(n / ROUND_LARGE)


class Allocator:
    """The caching allocator's block bookkeeping (no release to CUDA: the GPU is never full here).

    Free blocks of a pool (small/large, per stream) sit in a list sorted by (size, segment, address), so a
    best-fit lookup is one bisection, as the allocator's own ordered set does."""

    def __init__(self, expandable: bool = False):
        self.expandable = expandable
        self.free: dict = {}  # (small pool, stream) -> sorted [(size, segment, addr)]
        self.free_at: dict = {}  # (segment, addr) -> size, free blocks
        self.free_end: dict = {}  # (segment, end address) -> addr, free blocks
        self.live: dict = {}  # id -> (pool key, segment, addr, size)
        self.seg_end: dict = {}
        self.reserved = 0
        self.peak_reserved = 0
        self.allocated = 0
        self._next_seg = 0
        self._grow: dict = {}  # expandable: the one segment per pool
        self.deferred: dict = {}  # id -> bytes: released by the program, not yet reusable (record_stream)
        self.deferred_bytes = 0
        self.peak_live = 0  # allocated minus deferred: what max_memory_allocated counts

    def _add_free(self, pool, seg, addr, size):
        bisect.insort(pool, (size, seg, addr))
        self.free_at[(seg, addr)] = size
        self.free_end[(seg, addr + size)] = addr

    def _del_free(self, pool, seg, addr):
        size = self.free_at.pop((seg, addr))
        del self.free_end[(seg, addr + size)]
        i = bisect.bisect_left(pool, (size, seg, addr))
        del pool[i]
        return size

    def _new_segment(self, size: int) -> int:
        seg = self._next_seg
        self._next_seg += 1
        self.seg_end[seg] = size
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return seg

    def malloc(self, tid: int, nbytes: int, stream: int = 0) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_REQUEST
        key = (small, stream)
        pool = self.free.setdefault(key, [])
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            bsize, seg, addr = pool[i]
        elif self.expandable:
            seg = self._grow.get(key)
            if seg is None:
                seg = self._grow[key] = self._new_segment(0)
            end = self.seg_end[seg]
            tail = self.free_end.get((seg, end))
            have = self._del_free(pool, seg, tail) if tail is not None else 0
            grow = PAGE * math.ceil((size - have) / PAGE)
            self.seg_end[seg] = end + grow
            self.reserved += grow
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            addr = tail if tail is not None else end
            self._add_free(pool, seg, addr, have + grow)
            bsize = have + grow
        else:
            seg = self._new_segment(segment_size(size))
            addr, bsize = 0, self.seg_end[seg]
            self._add_free(pool, seg, addr, bsize)
        self._del_free(pool, seg, addr)
        rest = bsize - size
        if rest >= (512 if small else SMALL_REQUEST + 1):
            self._add_free(pool, seg, addr + size, rest)
        else:
            size = bsize
        self.live[tid] = (key, seg, addr, size)
        self.allocated += size
        self.peak_live = max(self.peak_live, self.allocated - self.deferred_bytes)

    def defer(self, tid) -> None:
        """The program has released ``tid``; its block stays taken until ``release`` (its stream's event)."""
        got = self.live.get(tid)
        if got is not None and tid not in self.deferred:
            self.deferred[tid] = got[3]
            self.deferred_bytes += got[3]

    def release(self, tid: int) -> None:
        got = self.live.pop(tid, None)
        if got is None:
            return
        self.deferred_bytes -= self.deferred.pop(tid, 0)
        key, seg, addr, size = got
        self.allocated -= size
        pool = self.free[key]
        if (seg, addr + size) in self.free_at:  # merge with the next free block
            size += self._del_free(pool, seg, addr + size)
        prev = self.free_end.get((seg, addr))
        if prev is not None:  # and with the previous one
            size += self._del_free(pool, seg, prev)
            addr = prev
        self._add_free(pool, seg, addr, size)


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
        r.free(t1, t3, outs[name])
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
    r.free(cont)
    return o


def _forward(r: _Run, shape, batch: int, new: int, ctx: int, b: int, tp: int, kv: dict, fetch, release,
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
        if shape.gated_mlp:
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
        r.free(m)
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


@dataclass(frozen=True)
class Timing:
    """The machine figures the deferred frees depend on (bytes/s, FLOP/s, seconds)."""
    h2d: float  # host-to-device copy of an offloaded parameter
    gather_bw: float  # all-gather bus bandwidth (several ranks)
    matmul: float
    attention: float
    hbm: float
    host_module: float  # host time per module with parameters: its ZeRO-3 hooks and its kernel launches
    host_container: float  # host time per module without parameters: its hooks


def timing_for(name: str, shape, hw, figures=None) -> Timing:
    """From the machine's figures (``speed.figures_for``: a calibrate profile's where measured)."""
    from dsdoctor.plan.speed import _hooked_modules, figures_for

    f = figures or figures_for(hw)
    v = f.values
    offload = name.startswith("zero3-offload")
    hook = v["zero3_offload_module_s" if offload else "zero3_module_s"]
    param_modules = max(len(shape.inventory.modules()), 1)
    per_layer = max(param_modules / max(shape.layers, 1), 1.0)
    host_module = hook + v["eager_layer_s"] / per_layer
    containers = max(_hooked_modules(shape) - param_modules, 0)
    return Timing(f.h2d_pinned, f.allgather_bus_bw, f.matmul_flops, f.attention_flops, f.hbm_read,
                  host_module, hook if containers else 0.0)


def _step_key(step) -> object:
    """The replay's name for a module step: "<embed>", "<lm_head>", "<norm>", or (layer, kind)."""
    from dsdoctor.plan.memory import _step_kind

    if step.layer is None:
        if step.module in ("<root>", "<model>", "<rotary_emb>"):
            return step.module
        return None  # embedding / lm_head / final norm: named by their parameters (see _zero3_fetcher)
    kind = _step_kind(step.module)
    return (step.layer, kind if kind in _LAYER_KINDS else step.module)


_LAYER_KINDS = ("input_layernorm", "post_attention_layernorm", "q_proj", "k_proj", "v_proj", "o_proj",
                "gate_proj", "up_proj", "down_proj")


def _zero3_fetcher(r: _Run, shape, g, b: int, numel_of: list, prefetch_on: list, tp: int = 1,
                   timing: Timing | None = None):
    """fetch/release callbacks that allocate and free whole parameters and gather buffers as ZeRO-3 does,
    in the order ``memory.GatherReplay`` models (the same sequence the allocated peak is computed from):
    fetch(key) runs the pre-forward hooks of every module up to the one named ``key`` (containers prefetch
    too), release(key) its post-forward hook. Nothing happens when nothing is gathered (one rank without
    offload keeps whole parameters).

    With ``timing``, three clocks run beside the sequence: the host's, the gather stream's (copies from the
    host, all-gathers) and the compute stream's. DeepSpeed releases a gathered parameter with
    ``record_stream`` on the compute stream (``free_param``), so the caching allocator reuses its block only
    once the GPU has run the module that read it: a release is pending until the compute clock passes that
    module, and is processed before the next allocation the host makes after that time. The host waits for
    the gather stream where DeepSpeed waits (with offload on one rank, ``NoGatherHandle.wait`` synchronizes
    the stream; on several ranks, at most two fetch events are outstanding) and for the GPU at the end of
    every forward (generate reads the new token)."""
    import collections

    from dsdoctor.plan.memory import GatherReplay, trace_steps

    inv = shape.inventory
    steps = trace_steps(shape, b, tp)
    kinds = {k: p.kind for k, p in enumerate(inv.params)}
    keys = []
    for st in steps:
        key = _step_key(st)
        if key is None and st.params:
            kind = kinds[st.params[0][0]]
            tied_alias = st.module in {alias for alias, _owner in inv.tied}
            key = "<lm_head>" if kind == "lm_head" or tied_alias else "<embed>" if kind == "embedding" else "<norm>"
        keys.append(key)
    where: dict = {}
    for i, key in enumerate(keys):
        where.setdefault(key, []).append(i)
    active = g.zero3 and (g.world > 1 or bool(g.offload))
    persistent = {k for k, n in enumerate(numel_of) if n <= g.persistence_threshold} if g.zero3 else set()
    held: set = set()  # persistent parameters: fetched once, whole for good
    tensors: dict = {}  # the replay's buffer key -> tensor id
    state = {"rep": None, "pos": 0, "entered": {}, "n": 1, "batch": 1, "ctx": 1, "prefill": True}
    clock = {"host": 0.0, "gather": 0.0, "compute": 0.0, "gathered": 0.0}
    waits: collections.deque = collections.deque()
    pending: list = []  # (compute time after which the block is free, tensor id)

    def process_events():
        if pending:
            now = clock["host"]
            keep = []
            for t, tid in pending:
                if t <= now:
                    r.free(tid)
                else:
                    keep.append((t, tid))
            pending[:] = keep

    if timing is not None and active:
        r.before = process_events

    def transfer_s(key, nbytes, kind):
        if timing is None or kind == "copy" or key[0] not in ("param", "flat", "stage"):
            return 0.0
        if key[0] == "stage" or g.world == 1:
            return nbytes / timing.h2d
        return nbytes * (g.world - 1) / g.world / timing.gather_bw

    def sink(op, key, nbytes=0, kind=None):
        if op == "alloc":
            tensors[key] = r.new(nbytes, GATHER_STREAM)
            dt = transfer_s(key, nbytes, kind)
            if dt:
                clock["gather"] = max(clock["gather"], clock["host"]) + dt
        elif op == "wait":
            if timing is None:
                return
            if g.world == 1:  # NoGatherHandle.wait: the gather stream is synchronized
                clock["host"] = max(clock["host"], clock["gather"])
            else:  # the all-gather's wait is the stream's; the host keeps at most two fetch events open
                waits.append(clock["gather"])
                if len(waits) > 2:
                    clock["host"] = max(clock["host"], waits.popleft())
            clock["gathered"] = clock["gather"]
        else:
            tid = tensors.pop(key, None)
            if timing is not None and key[0] == "param" and tid is not None:
                pending.append((clock["compute"], tid))
                r.a.defer(tid)
            else:
                r.free(tid)

    def compute_s(i) -> float:
        st = steps[i]
        if timing is None or not st.params:
            return 0.0
        key = keys[i]
        numel = sum(numel_of[p] for p, _ in st.params)
        n, batch = state["n"], state["batch"]
        kind = key[1] if isinstance(key, tuple) else key
        if kind in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "<lm_head>"):
            rows = batch if kind == "<lm_head>" and shape.logits_to_keep else n
            t = max(2 * rows * numel / timing.matmul, numel * b / timing.hbm)
            if kind == "o_proj":
                layer = key[0]
                window = shape.kv_window[layer]
                ctx = min(state["ctx"], window) if window else state["ctx"]
                if state["prefill"]:
                    t += 4 * n * ctx * shape.q_dim / tp / 2 / timing.attention
                else:
                    t += batch * ctx * shape.kv_elems_per_token[layer] * b / tp / timing.hbm
            return t
        return n * shape.hidden * 12 / timing.hbm  # norms, embedding lookup: elementwise passes

    def run_module(i):
        """The host issues module ``i``'s hooks and kernels; the compute stream runs it once its gathers
        are in."""
        if timing is None:
            return
        st = steps[i]
        clock["host"] += timing.host_module if st.params else timing.host_container
        begin = max(clock["compute"], clock["host"], clock["gathered"] if st.params else 0.0)
        clock["compute"] = begin + compute_s(i)

    def start(n=1, batch=1, ctx=1, prefill=True):
        state.update(rep=GatherReplay(steps, b, g, prefetch_on[0], numel_of, sink), pos=0, entered={}, n=n,
                     batch=batch, ctx=ctx, prefill=prefill)
        waits.clear()

    def fetch(key):
        if not active:
            return
        at = where.get(key, ())
        k = bisect.bisect_left(at, state["pos"])
        if k == len(at):
            return  # not a module of this model (or already past)
        rep = state["rep"]
        while state["pos"] <= at[k]:
            i = state["pos"]
            state["pos"] += 1
            st = steps[i]
            if st.virtual:
                continue
            for p, _n in st.params:
                if p in persistent and p not in held:
                    held.add(p)
                    r.new(numel_of[p] * b, GATHER_STREAM)
            rep.enter(st)
            run_module(i)
            if keys[i] == key:
                state["entered"][key] = st
                return
            rep.leave(st)  # a module the replay does not run by name: its hooks fire back to back

    def release(key):
        if not active:
            return
        st = state["entered"].pop(key, None)
        if st is not None:
            state["rep"].leave(st)

    def finish():
        if active and state["rep"] is not None:
            rep = state["rep"]
            while state["pos"] < len(steps):  # modules after the last one the replay names
                i = state["pos"]
                st = steps[i]
                state["pos"] += 1
                if not st.virtual:
                    rep.enter(st)
                    run_module(i)
                    rep.leave(st)
            rep.finish()
            # generate reads the new token: the host waits for the GPU, and every pending block is free
            clock["host"] = max(clock["host"], clock["compute"])

    return fetch, release, start, finish


def simulate(name: str, shape, wl, g, numel_of: list, expandable: bool = False, tp: int = 1,
             training_bytes: int = 0, timing: Timing | None = None) -> Allocator:
    a = Allocator(expandable)
    r = _Run(a)
    b = wl.dtype_bytes
    inv = shape.inventory
    # load
    if name == "plain":
        for n in numel_of:
            r.new(n * b)
    elif name == "tp":

        for p in inv.params:  # AutoTP copies each sliced weight to the GPU: its share
            r.new(p.numel * b / (tp if (p.kind == "linear" and p.layer is not None) or p.kind == "lm_head" else 1))
    else:
        untied = [p.numel for alias, owner in inv.tied for p in inv.params if p.module == owner]
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
    prefetch_on = [False]
    fetch, release, start, finish = _zero3_fetcher(r, shape, g, b, numel_of, prefetch_on, tp, timing)
    B, S, T = wl.batch, wl.prompt_len, wl.new_tokens
    for _generate in range(2):  # the warm-up generate and the timed one
        kv: dict = {}
        steps = list(range(1, T))
        if len(steps) > 2 * DECODE_STEPS_REPLAYED:
            steps = steps[:DECODE_STEPS_REPLAYED] + steps[-DECODE_STEPS_REPLAYED:]
        start(B * S, B, S, True)
        _forward(r, shape, B, S, S, b, tp, kv, fetch, release, prefill=True)
        finish()
        prefetch_on[0] = True  # from the second forward on, ZeRO-3 prefetches along the recorded trace
        for t in steps:
            start(B, B, S + t, False)
            _forward(r, shape, B, 1, S + t, b, tp, kv, fetch, release, prefill=False)
            finish()
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
            shape.logits_to_keep, tuple(numel_of), tuple((p.module, p.kind, p.layer) for p in inv.params),
            tuple(inv.tied))


def reserved_for(name, shape, wl, g, peak, phase, moment, numel_of, expandable, training_bytes=0, tp=1,
                 timing: Timing | None = None) -> int:
    """Peak reserved bytes for a run whose allocated peak plan puts at ``peak``: the simulated allocator's
    reserved peak, shifted by how far its own allocated peak (deferred releases not counted, as
    ``max_memory_allocated`` does not count them) is from plan's exact one."""
    key = (_shape_key(shape, numel_of), name, wl, g, expandable, training_bytes, tp, timing)
    if key not in _CACHE:
        a = simulate(name, shape, wl, g, numel_of, expandable, tp, training_bytes, timing)
        _CACHE[key] = (a.peak_reserved, a.peak_live)
        if len(_CACHE) > 256:
            _CACHE.pop(next(iter(_CACHE)))
    res, alloc = _CACHE[key]
    slack = max(res - alloc, 0)  # what fragmentation and rounding add beyond the simulated live peak
    return int(max(peak + slack, peak))


def fragmentation_findings(plans, chosen, config_path, with_expandable=None) -> list:
    """DSD220 for the config's path and the recommended one, when reserved exceeds allocated by more than
    15%. ``with_expandable(name)``: the reserved bytes of that path under expandable segments."""
    from dsdoctor.units import human_bytes

    out = []
    for p in plans:
        if p.name not in (config_path, chosen.name if chosen else None):
            continue
        frag = p.gpu_reserved_bytes - p.gpu_peak_bytes
        if p.gpu_peak_bytes and frag > FRAGMENTATION_FINDING * p.gpu_peak_bytes:
            exp = with_expandable(p.name) if with_expandable else None
            out.append(Finding("DSD220", {"path": p.name, "reserved": human_bytes(p.gpu_reserved_bytes),
                                          "allocated": human_bytes(p.gpu_peak_bytes),
                                          "pct": f"{100 * frag / p.gpu_peak_bytes:.0f}",
                                          "reserved_expandable": human_bytes(exp) if exp else "-"}))
    return out
