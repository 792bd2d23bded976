"""What a load path declares, and what every path of one plan reads (``PlanContext``).

A path type says, for one way of running the model:

* ``instances(ctx)``: whether it applies to this machine, and in how many shapes (tp groups: one per split);
* ``knobs(ctx)``: which of the user's DeepSpeed settings apply to it (the one place that decides it);
* ``allocated(ctx, wl)``: its allocated peak and the parts of it (``memory.allocated`` on its ``Layout``, or
  its own model);
* ``reserved(ctx, wl, mem)``: its reserved model (the caching-allocator replay, ``reserved.py``, or its own);
  ``memory()`` combines the two, and what-fits searches reuse the planned workload's reserved/allocated ratio;
* ``loading_methods(ctx, mem)``: how the checkpoint can be loaded on the host (``loading.py``);
* ``speed(ctx, mem)``: its speed (``speed.estimate_speed`` with the ``StepTerms`` it pays, or its own);
* ``ds_config(ctx)`` and ``code(ctx, row)``: what the recommendation emits when it is chosen;
* ``expandable_reserved(ctx)``: its reserved bytes under expandable segments (DSD220), where its reserved
  model has them; ``row_notes(ctx)``: notes of its own for the result row.

Flags: ``estimate`` (modelled, not yet measured on a GPU), ``quantized`` (changes the outputs: chosen only
when nothing in full precision fits), ``serving`` (a serving engine: never chosen when the user needs greedy
outputs equal to transformers' ``generate``), ``trains`` (the actor of ``--loop`` can train on it), ``loop_only``
(planned with ``--loop`` only), ``searched`` (the largest batch and prompt that fit are searched),
``derived`` (its reserved bytes and speed derive from another path's: no allocator slack or speed terms
reported). A path with one model for both peaks may override ``memory()`` instead of the two hooks.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from dsdoctor.plan.ds_knobs import DsKnobs
from dsdoctor.plan.hardware import Hardware
from dsdoctor.plan.loading import Checkpoint, HostLoad
from dsdoctor.plan.memory import Layout, PathMemory, allocated, params_numel
from dsdoctor.plan.reserved import reserved_detail, reserved_for
from dsdoctor.plan.result import PathPlan
from dsdoctor.plan.shape import ModelShape
from dsdoctor.plan.speed import Figures, Speed, first_generate_extra_s, first_generate_tokens_per_s
from dsdoctor.plan.workload import Workload
from dsdoctor.plan.zero3_replay import timing_for

TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


@dataclass
class PlanContext:
    """What every path of one plan reads: the model, the workload, the machine and the user's config."""
    shape: ModelShape
    wl: Workload
    hw: Hardware
    figures: Figures  # the machine's speed figures (``speed.figures_for``)
    knobs: DsKnobs | None  # the user's DeepSpeed config as read; a path takes what applies (``knobs()``)
    config_path: str | None  # the path the config selects (None: no ZeRO-3 config)
    ckpt: Checkpoint
    model: str  # as given: the emitted code loads it
    run_dtype: str  # the dtype the emitted config and code use on this GPU
    loop: bool = False  # the model trains and generates its own rollouts (``--loop``)
    expandable: bool = False  # PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True
    context_bytes: int | None = None  # the CUDA context, from a machine profile
    pos_limit: int | None = None  # max_position_embeddings
    hard_limit: int | None = None  # the longest sequence the model can run at all
    transformers: dict | None = None  # the release the host figures and the code assume (loading.transformers_loading)
    hf_equality: bool = False  # the outputs must equal transformers' greedy generate: no serving engine chosen
    bands: object = None  # the measured bands of the memory figures (plan/band.py ``Bands``); None: no band

    @property
    def weights(self) -> int:
        return self.shape.inventory.num_params * self.wl.dtype_bytes

    @property
    def largest_param(self) -> int:
        return max((p.numel for p in self.shape.inventory.params), default=0) * self.wl.dtype_bytes

    def stage3_only(self) -> DsKnobs | None:
        """The config's stage-3 tuning without its optimizer and offload_param: what a ZeRO-3 path the
        config does not select takes of it."""
        if self.knobs is None:
            return None
        return dataclasses.replace(self.knobs, has_optimizer=False, offload_param=None)


def for_transformers(code: str | None, version: str | None) -> str | None:
    """The emitted code for the user's transformers: ``from_pretrained`` and ``from_config`` take ``torch_dtype``
    before 4.56 (``dtype`` there would be passed on to the config and the model loaded in float32)."""
    from dsdoctor.config.versions import TRANSFORMERS_DTYPE_KWARG, version_tuple

    release = version_tuple(version)
    if code is None or release is None or release >= TRANSFORMERS_DTYPE_KWARG:
        return code
    return re.sub(r"(from_pretrained|from_config)\(([^\n]*?)\bdtype=", r"\1(\2torch_dtype=", code)


def replay(layout: Layout, ctx: PlanContext, wl: Workload, mem: PathMemory, expandable: bool = False) -> int:
    """The caching-allocator replay's reserved bytes for a path on ``layout`` whose allocated peak is ``mem``."""
    g = layout.gather
    # the clocks of the deferred releases: on several ranks the host does not wait for the GPU, so it runs ahead of
    # the compute stream whenever a layer computes longer than it gathers (measured on 2 x H200: 21.67 GiB reserved
    # for 13.8 allocated). On one rank with offload it waits for every copy and runs ahead only where a module
    # computes longer than its copy (long prefills: 18.84 GiB reserved for 9.89 allocated, edge run 1); there the
    # clocks move some cases away from the measurement (BENCHMARKS.md, runs 3-6), so the larger replay counts
    timing = timing_for(bool(g.offload), ctx.shape, ctx.figures) if g.zero3 and (layout.world > 1 or g.offload) else None
    numel = params_numel(ctx.shape.inventory)
    args = (layout.name, ctx.shape, wl, g, mem.gpu_peak_bytes, numel, expandable)
    kw = dict(training_bytes=mem.training_gpu_bytes, tp=layout.tp, built=not ctx.ckpt.seen)
    reserved, held, layers = reserved_detail(*args, timing=timing, **kw)
    if timing is not None:
        without = reserved_for(*args, timing=None, **kw)
        if layout.world > 1:
            mem.reserved_assumption = host_ahead(ctx, layout, reserved, without, held, layers)
        else:
            reserved = max(reserved, without)
    return reserved


# The largest world the host-ahead replay was checked against (bench/plan run 3, 2 x H200, uncapped peaks)
HOST_AHEAD_MEASURED_WORLD = 2


def host_ahead(ctx: PlanContext, layout: Layout, reserved: int, without: int, held: int, layers: int) -> dict:
    """What the multi-rank reserved figure assumes, and the figure without it. With several ranks the host does
    not wait for the GPU, so it runs ahead of a long prefill and every gathered layer it releases stays reserved
    (``record_stream``) until the GPU has used it. Measured uncapped on 2 GPUs; under a memory cap PyTorch's
    allocator first waits for those blocks (``release_cached_blocks`` synchronizes outstanding events) and
    only then fails, so the line a run really needs lies between the two figures."""
    inv = ctx.shape.inventory
    numel = params_numel(inv)
    persistent = layout.gather.persistence_threshold
    per_layer: dict = {}
    for k, prm in enumerate(inv.params):
        if prm.layer is not None and numel[k] > persistent:
            per_layer[prm.layer] = per_layer.get(prm.layer, 0) + numel[k] * ctx.wl.dtype_bytes
    return {"assumption": "host-ahead", "reserved_with_bytes": int(reserved), "reserved_without_bytes": int(without),
            "held_bytes": int(held), "layers_ahead": int(layers),  # the most held at once, and its layers
            "layer_bytes": int(max(per_layer.values(), default=0)), "world": layout.world,
            "measured_up_to_world": HOST_AHEAD_MEASURED_WORLD}


def assumption_moved(mem: PathMemory | None) -> PathMemory | None:
    """``mem`` with its host-ahead figures (``host_ahead``) moved with its reserved bytes, after these changed
    past the replay (the loop's training state and step, ``loop_memory.in_loop``; int4 shards): the assumption still
    adds what it added to the generate's replay, so the figure without it is the path's reserved less that."""
    alt = mem.reserved_assumption if mem is not None else None
    if alt and alt["reserved_with_bytes"] != mem.gpu_reserved_bytes:
        added = alt["reserved_with_bytes"] - alt["reserved_without_bytes"]
        mem.reserved_assumption = {**alt, "reserved_with_bytes": int(mem.gpu_reserved_bytes),
                                   "reserved_without_bytes": int(mem.gpu_reserved_bytes - added)}
    return mem


def replayed(layout: Layout, ctx: PlanContext, wl: Workload, knobs: DsKnobs | None = None,
             context_bytes: int | None = None, built_from_config: bool = False, expandable: bool = False,
             ratio: float | None = None) -> PathMemory:
    """The allocated peak on ``layout`` with its reserved bytes: replayed, or ``ratio`` x the peak."""
    mem = allocated(layout, ctx.shape, wl, knobs, context_bytes, None, built_from_config)
    if ratio is not None:
        return mem.with_reserved(int(mem.gpu_peak_bytes * ratio))
    return mem.with_reserved(replay(layout, ctx, wl, mem, expandable))


class LoadPath:
    """One load path (see the module's docstring). Subclasses set ``name`` and override what differs."""
    name = ""
    estimate = False
    quantized = False
    serving = False
    trains = False
    loop_only = False
    searched = True
    derived = False  # reserved bytes and speed derive from another path's: no allocator slack, no speed terms
    tp: int | None = None  # GPUs per tensor-parallel group

    @classmethod
    def instances(cls, ctx: PlanContext) -> list[LoadPath]:
        """The paths of this type for this plan (none when it does not apply)."""
        return [cls()]

    def knobs(self, ctx: PlanContext) -> DsKnobs | None:
        return None

    def allocated(self, ctx: PlanContext, wl: Workload) -> PathMemory | None:
        raise NotImplementedError

    def reserved(self, ctx: PlanContext, wl: Workload, mem: PathMemory) -> int:
        raise NotImplementedError

    def memory(self, ctx: PlanContext, wl: Workload, ratio: float | None = None) -> PathMemory | None:
        """Allocated peak and reserved bytes for ``wl``; ``ratio``: reserved = peak x ratio (what-fits searches)."""
        mem = self.allocated(ctx, wl)
        if mem is None:
            return None
        return mem.with_reserved(int(mem.gpu_peak_bytes * ratio) if ratio is not None else self.reserved(ctx, wl, mem))

    def expandable_reserved(self, ctx: PlanContext) -> int | None:
        """Reserved bytes under expandable segments (DSD220), where the path's reserved model has them."""
        return None

    def loading_methods(self, ctx: PlanContext, mem: PathMemory) -> list[HostLoad]:
        return []

    def speed(self, ctx: PlanContext, mem: PathMemory) -> Speed:
        raise NotImplementedError

    def ds_config(self, ctx: PlanContext) -> dict | None:
        return None

    def code(self, ctx: PlanContext, row: PathPlan) -> str:
        raise NotImplementedError

    def row_notes(self, ctx: PlanContext) -> list:
        return []

    def row(self, ctx: PlanContext, mem: PathMemory, speed: Speed, fit: tuple, method: HostLoad | None,
            methods: list, searched: tuple) -> PathPlan:
        """The result row: the estimate, the loading method chosen, the speed, what fits (``fit``: fits, the
        limits it does not fit, the verdict: ``evaluate.fits``)."""
        ok, limits, verdict = fit
        return PathPlan(
            name=self.name, ranks=mem.ranks, replicas=mem.replicas, gpu_peak_bytes=mem.gpu_peak_bytes,
            gpu_reserved_bytes=mem.gpu_reserved_bytes, gpu_outside_allocator_bytes=mem.gpu_outside_allocator_bytes,
            host_peak_bytes=mem.host_peak_bytes, fits=ok, limits=limits, peak_at=mem.peak_at,
            tokens_per_s=speed.tokens_per_s, decode_tokens_per_s=speed.decode_tokens_per_s, bound=speed.bound,
            breakdown=mem.gpu_breakdown, host_breakdown=mem.host_breakdown, max_batch=searched[0],
            max_prompt_len=searched[1], notes=mem.notes + (method.notes if method else []) + self.row_notes(ctx),
            loading=method.method if method else None, host_file_bytes=mem.host_file_bytes,
            loading_options=[m.to_dict() for m in methods], tp=self.tp, estimate=self.estimate,
            fragmentation_bytes=0 if self.derived else mem.fragmentation_bytes,
            speed_terms={} if self.derived else speed.terms, verdict=verdict,
            reserved_assumption=mem.reserved_assumption,
            first_generate_extra_s=round(first_generate_extra_s(ctx.wl, ctx.figures), 3),
            first_generate_tokens_per_s=round(first_generate_tokens_per_s(speed.tokens_per_s, ctx.wl, ctx.figures), 3))


class LayoutPath(LoadPath):
    """A path the shared memory model covers: it says how it holds the weights (``layout``); its allocated
    peak is ``memory.allocated``'s and its reserved bytes the caching-allocator replay's."""

    def layout(self, gpus: int, knobs: DsKnobs | None) -> Layout:
        raise NotImplementedError

    def allocated(self, ctx, wl):
        knobs = self.knobs(ctx)
        return allocated(self.layout(ctx.hw.gpus, knobs), ctx.shape, wl, knobs, ctx.context_bytes,
                         built_from_config=not ctx.ckpt.seen)

    def reserved(self, ctx, wl, mem):
        return replay(self.layout(ctx.hw.gpus, self.knobs(ctx)), ctx, wl, mem, ctx.expandable)

    def expandable_reserved(self, ctx):
        knobs = self.knobs(ctx)
        return replayed(self.layout(ctx.hw.gpus, knobs), ctx, ctx.wl, knobs, ctx.context_bytes,
                        expandable=True).gpu_reserved_bytes


class EstimatePath(LoadPath):
    """A path modelled from the libraries' sources, not yet measured on a GPU: no what-fits search; its
    reserved bytes and speed derive from another path's."""
    estimate = True
    searched = False
    derived = True
