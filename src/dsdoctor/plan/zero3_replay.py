"""ZeRO-3's side of the caching-allocator replay (``reserved.py``): the whole parameters and gather buffers a
forward allocates and frees, in the order ``schedule.GatherReplay`` models (the same sequence the allocated
peak is computed from), on the gather stream, with the clocks that decide when a released block can be reused.
"""
from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass

from dsdoctor.plan.schedule import GatherReplay, step_kind, trace_steps
from dsdoctor.plan.speed import Figures, hooked_modules

# ZeRO-3 gathers on its own stream (overlap_comm defaults to true at stage 3): the caching allocator keys
# free blocks by stream, so gathered parameters and the main stream's tensors never share a block
GATHER_STREAM = 1
_MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj",
            "<lm_head>")


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


def timing_for(offload: bool, shape, f: Figures) -> Timing:
    """From the machine's figures (``speed.figures_for``: a calibrate profile's where measured)."""
    v = f.values
    hook = v["zero3_offload_module_s" if offload else "zero3_module_s"]
    param_modules = max(len(shape.inventory.modules()), 1)
    per_layer = max(param_modules / max(shape.layers, 1), 1.0)
    host_module = hook + v["eager_layer_s"] / per_layer
    containers = max(hooked_modules(shape) - param_modules, 0)
    return Timing(f.h2d_pinned, f.allgather_bus_bw, f.matmul_flops, f.attention_flops, f.hbm_read,
                  host_module, hook if containers else 0.0)


def _step_key(step) -> object:
    """The replay's name for a module step: "<embed>", "<lm_head>", "<norm>", or (layer, kind)."""
    if step.layer is None:
        if step.module in ("<root>", "<model>", "<rotary_emb>"):
            return step.module
        return None  # embedding / lm_head / final norm: named by their parameters (``_step_keys``)
    kind = "gate_up_proj" if step.module.endswith("gate_up_proj") else step_kind(step.module)
    return (step.layer, kind if kind in _LAYER_KINDS else step.module)


_LAYER_KINDS = ("input_layernorm", "post_attention_layernorm", "q_proj", "k_proj", "v_proj", "o_proj",
                "gate_proj", "up_proj", "down_proj", "gate_up_proj")


def _step_keys(steps, inv) -> list:
    """Each step's name in the replay of a forward (``reserved._forward``)."""
    kinds = {k: p.kind for k, p in enumerate(inv.params)}
    aliases = {alias for alias, _owner in inv.tied}
    keys = []
    for st in steps:
        key = _step_key(st)
        if key is None and st.params:
            kind = kinds[st.params[0][0]]
            tied_alias = st.module in aliases
            key = "<lm_head>" if kind == "lm_head" or tied_alias else "<embed>" if kind == "embedding" else "<norm>"
        keys.append(key)
    return keys


class Zero3Fetcher:
    """fetch/release callbacks that allocate and free whole parameters and gather buffers as ZeRO-3 does:
    ``fetch(key)`` runs the pre-forward hooks of every module up to the one named ``key`` (containers prefetch
    too), ``release(key)`` its post-forward hook; ``start``/``finish`` bracket one forward. Nothing happens
    when nothing is gathered (one rank without offload keeps whole parameters). ``prefetch``: from the second
    forward on, ZeRO-3 prefetches along the recorded trace.

    With ``timing``, three clocks run beside the sequence: the host's, the gather stream's (copies from the
    host, all-gathers) and the compute stream's. DeepSpeed releases a gathered parameter with
    ``record_stream`` on the compute stream (``free_param``), so the caching allocator reuses its block only
    once the GPU has run the module that read it: a release is pending until the compute clock passes that
    module, and is processed before the next allocation the host makes after that time. The host waits for
    the gather stream where DeepSpeed waits (with offload on one rank, ``NoGatherHandle.wait`` synchronizes
    the stream; on several ranks, at most two fetch events are outstanding) and for the GPU at the end of
    every forward (generate reads the new token)."""

    def __init__(self, r, shape, g, b: int, numel_of: list, tp: int = 1, timing: Timing | None = None):
        self.r, self.shape, self.g, self.b, self.numel_of, self.tp, self.timing = r, shape, g, b, numel_of, tp, timing
        self.steps = trace_steps(shape, b, tp)
        self.keys = _step_keys(self.steps, shape.inventory)
        self.where: dict = {}
        for i, key in enumerate(self.keys):
            self.where.setdefault(key, []).append(i)
        self.active = g.zero3 and (g.world > 1 or bool(g.offload))
        self.persistent = {k for k, n in enumerate(numel_of) if n <= g.persistence_threshold} if g.zero3 else set()
        self.held: set = set()  # persistent parameters: fetched once, whole for good
        self.tensors: dict = {}  # the replay's buffer key -> tensor id
        self.prefetch = False
        self.rep: GatherReplay | None = None
        self.pos, self.entered = 0, {}
        self.n = self.batch = self.ctx = 1
        self.prefill = True
        self.clock = {"host": 0.0, "gather": 0.0, "compute": 0.0, "gathered": 0.0}
        self.waits: collections.deque = collections.deque()
        self.pending: list = []  # (compute time after which the block is free, tensor id, layer)
        # the most the held releases came to over the run: bytes, and the layers they belong to (how far the host
        # ran ahead of the GPU); read by ``reserved.reserved_detail``
        self.held_max = (0, 0)
        self._layer_of = {k: p.layer for k, p in enumerate(shape.inventory.params)}
        if timing is not None and self.active:
            r.before = self._process_events

    def _process_events(self) -> None:
        if self.pending:
            now = self.clock["host"]
            keep = []
            for t, tid, layer in self.pending:
                if t <= now:
                    self.r.free(tid)
                else:
                    keep.append((t, tid, layer))
            self.pending[:] = keep
        held = sum(self.r.a.deferred.get(tid, 0) for _t, tid, _layer in self.pending)
        if held > self.held_max[0]:
            self.held_max = (held, len({layer for _t, _tid, layer in self.pending if layer is not None}))

    def _transfer_s(self, key, nbytes, kind) -> float:
        g, timing = self.g, self.timing
        if timing is None or kind == "copy" or key[0] not in ("param", "flat", "stage"):
            return 0.0
        if key[0] == "stage" or g.world == 1:
            return nbytes / timing.h2d
        return nbytes * (g.world - 1) / g.world / timing.gather_bw

    def _wait(self) -> None:
        clock = self.clock
        if self.g.world == 1:  # NoGatherHandle.wait: the gather stream is synchronized
            clock["host"] = max(clock["host"], clock["gather"])
        else:  # the all-gather's wait is the stream's; the host keeps at most two fetch events open
            self.waits.append(clock["gather"])
            if len(self.waits) > 2:
                clock["host"] = max(clock["host"], self.waits.popleft())
        clock["gathered"] = clock["gather"]

    def sink(self, op, key, nbytes=0, kind=None) -> None:
        """What ``GatherReplay`` creates, waits for and frees, as allocations on the gather stream."""
        clock, r = self.clock, self.r
        if op == "alloc":
            self.tensors[key] = r.new(nbytes, GATHER_STREAM)
            dt = self._transfer_s(key, nbytes, kind)
            if dt:
                clock["gather"] = max(clock["gather"], clock["host"]) + dt
        elif op == "wait":
            if self.timing is not None:
                self._wait()
        else:
            tid = self.tensors.pop(key, None)
            if self.timing is not None and key[0] == "param" and tid is not None:
                self.pending.append((clock["compute"], tid, self._layer_of.get(key[1])))
                r.a.defer(tid)
            else:
                r.free(tid)

    def _compute_s(self, i) -> float:
        st, timing, shape, b, tp = self.steps[i], self.timing, self.shape, self.b, self.tp
        if timing is None or not st.params:
            return 0.0
        key = self.keys[i]
        numel = sum(self.numel_of[p] for p, _ in st.params)
        n, batch = self.n, self.batch
        kind = key[1] if isinstance(key, tuple) else key
        if kind not in _MATMULS:
            return n * shape.hidden * 12 / timing.hbm  # norms, embedding lookup: elementwise passes
        rows = batch if kind == "<lm_head>" and shape.logits_to_keep else n
        t = max(2 * rows * numel / timing.matmul, numel * b / timing.hbm)
        if kind == "o_proj":
            layer = key[0]
            window = shape.kv_window[layer]
            ctx = min(self.ctx, window) if window else self.ctx
            if self.prefill:
                t += 4 * n * ctx * shape.q_dim / tp / 2 / timing.attention
            else:
                t += batch * ctx * shape.kv_elems_per_token[layer] * b / tp / timing.hbm
        return t

    def _run_module(self, i) -> None:
        """The host issues module ``i``'s hooks and kernels; the compute stream runs it once its gathers
        are in."""
        if self.timing is None:
            return
        st, clock = self.steps[i], self.clock
        clock["host"] += self.timing.host_module if st.params else self.timing.host_container
        begin = max(clock["compute"], clock["host"], clock["gathered"] if st.params else 0.0)
        clock["compute"] = begin + self._compute_s(i)

    def start(self, n=1, batch=1, ctx=1, prefill=True) -> None:
        self.rep = GatherReplay(self.steps, self.b, self.g, self.prefetch, self.numel_of, self.sink)
        self.pos, self.entered, self.n, self.batch, self.ctx, self.prefill = 0, {}, n, batch, ctx, prefill
        self.waits.clear()

    def _enter(self, i) -> None:
        st = self.steps[i]
        for p, _n in st.params:
            if p in self.persistent and p not in self.held:
                self.held.add(p)
                self.r.new(self.numel_of[p] * self.b, GATHER_STREAM)
        self.rep.enter(st)
        self._run_module(i)

    def fetch(self, key) -> None:
        if not self.active:
            return
        at = self.where.get(key, ())
        k = bisect.bisect_left(at, self.pos)
        if k == len(at):
            return  # not a module of this model (or already past)
        while self.pos <= at[k]:
            i = self.pos
            self.pos += 1
            st = self.steps[i]
            if st.virtual:
                continue
            self._enter(i)
            if self.keys[i] == key:
                self.entered[key] = st
                return
            self.rep.leave(st)  # a module the replay does not run by name: its hooks fire back to back

    def release(self, key) -> None:
        if not self.active:
            return
        st = self.entered.pop(key, None)
        if st is not None:
            self.rep.leave(st)

    def finish(self) -> None:
        if not self.active or self.rep is None:
            return
        rep = self.rep
        while self.pos < len(self.steps):  # modules after the last one the replay names
            i = self.pos
            st = self.steps[i]
            self.pos += 1
            if not st.virtual:
                rep.enter(st)
                self._run_module(i)
                rep.leave(st)
        rep.finish()
        # generate reads the new token: the host waits for the GPU, and every pending block is free
        self.clock["host"] = max(self.clock["host"], self.clock["compute"])
