"""One path of a plan turned into its result row: memory, the loading method that fits the host, speed,
whether it fits, and the largest batch and prompt that would (outright, and by the prediction only)."""
from __future__ import annotations

import dataclasses
import functools

from dsdoctor.plan.band import Band
from dsdoctor.plan.loading import apply_loading
from dsdoctor.plan.memory import PathMemory
from dsdoctor.plan.paths import LoadPath, PlanContext
from dsdoctor.plan.result import PathPlan

MAX_BATCH_SEARCH = 4096
MAX_CONTEXT = 131072  # the longest prompt searched when the model states no limit


def fits(mem: PathMemory, hw, bands: dict | None = None) -> tuple[bool, list, str]:
    """Whether the path fits, what it does not fit (gpu: reserved + outside the allocator; host), and the
    verdict: "fits" (with ``bands``: its upper figure fits too, ``upper_line``), "edge" (the prediction fits,
    the upper figure does not), "does not fit", or "unverified": it fits only without an assumption of the
    reserved figure that no measurement covers at this scale (``mem.reserved_assumption``: the host ahead of the
    GPU on several ranks, ``paths/base.host_ahead``), and is not marked as out of memory on that figure alone."""
    limits = []
    outside = mem.gpu_outside_allocator_bytes
    over = mem.gpu_reserved_bytes + outside > hw.gpu_memory
    alt = mem.reserved_assumption
    if over and not (alt and alt["reserved_without_bytes"] + outside <= hw.gpu_memory):
        limits.append("gpu")
    if mem.host_peak_bytes > hw.host_memory:
        limits.append("host")
    verdict = "does not fit" if limits else "unverified" if over else "fits"
    if verdict == "fits" and bands and upper_line(mem, bands) > hw.gpu_memory:
        verdict = "edge"
    return not limits, limits, verdict


def upper_line(mem: PathMemory, bands: dict) -> int:
    """The upper figure of the line (plan/band.py): reserved and allocated each times their band's worst case
    (reserved at least the allocated upper), plus the memory outside the allocator."""
    return upper_figure(mem.gpu_peak_bytes, mem.gpu_reserved_bytes, mem.gpu_outside_allocator_bytes, bands)


def upper_figure(allocated: int, reserved: int, outside: int, bands: dict) -> int:
    """``upper_line`` of bare figures (an RL job's arrangement, plan/loop_job.py, has no ``PathMemory``)."""
    return max(bands["reserved"].upper(reserved), bands["allocated"].upper(allocated)) + outside


def largest(fits_at, low: int, high: int) -> int | None:
    """Largest value in [low, high] for which fits_at(value) holds (monotone), or None."""
    if not fits_at(low):
        return None
    if fits_at(high):
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits_at(mid) else (low, mid)
    return low


def what_fits(path: LoadPath, ctx: PlanContext, mem: PathMemory, method, bands: dict | None = None) -> tuple:
    """The largest batch and the longest prompt that fit outright (with ``bands``: their upper figure fits too,
    ``fits``) with the loading method chosen, and the larger ones that fit by the prediction only (edge; None
    where none is larger): (batch, prompt, edge batch, edge prompt). The estimates reuse this workload's
    reserved/allocated ratio (where the path takes it) instead of replaying the allocator."""
    wl, hw = ctx.wl, ctx.hw
    verdict = fits(mem, hw)[2]
    reserved = mem.reserved_assumption["reserved_without_bytes"] if verdict == "unverified" else mem.gpu_reserved_bytes
    ratio = reserved / max(mem.gpu_peak_bytes, 1)  # an unverified fit is searched on the figure it fits by

    @functools.cache
    def verdict_at(field: str, value: int) -> str:
        m = path.memory(ctx, dataclasses.replace(wl, **{field: value}), ratio=ratio)
        if method is not None:
            apply_loading(m, [method], hw.host_memory)
        return fits(m, hw, bands)[2]

    def search(field: str, high: int) -> tuple:
        outright = largest(lambda v: verdict_at(field, v) == "fits", 1, high)
        edge = largest(lambda v: verdict_at(field, v) != "does not fit", outright or 1, high)
        return outright, edge if edge and edge > (outright or 0) else None

    max_ctx = (ctx.pos_limit or MAX_CONTEXT) - wl.new_tokens
    max_ctx = max(max_ctx, wl.prompt_len) if ctx.hard_limit is None else max_ctx
    (batch, edge_batch), (prompt, edge_prompt) = search("batch", MAX_BATCH_SEARCH), search("prompt_len", max(max_ctx, 1))
    return batch, prompt, edge_batch, edge_prompt


def evaluate(path: LoadPath, ctx: PlanContext) -> PathPlan | None:
    """The row of ``path`` for the planned workload; None when it does not apply."""
    mem = path.memory(ctx, ctx.wl)
    if mem is None:
        return None
    methods = path.loading_methods(ctx, mem)
    method = apply_loading(mem, methods, ctx.hw.host_memory)[0] if methods else None
    speed = path.speed(ctx, mem)
    bands = ctx.bands.for_path(path.name) if ctx.bands is not None else None
    if bands and path.serving:  # a serving engine's reserved is the pool it is told to take, not a prediction
        bands["reserved"] = Band(1.0, 1.0, 0, "pool")
    fit = fits(mem, ctx.hw, bands)
    searched = what_fits(path, ctx, mem, method, bands) if path.searched else (None,) * 4
    row = path.row(ctx, mem, speed, fit, method, methods, searched[:2])
    row.edge_batch, row.edge_prompt_len = searched[2:]
    if bands:
        row.band = {fig: b.to_dict() for fig, b in bands.items()}
        row.upper_bytes = upper_line(mem, bands)
    return row
