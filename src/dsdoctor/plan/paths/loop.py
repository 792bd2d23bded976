"""The paths only a loop has (``--loop``: the model trains and generates its own rollouts): ``zero2`` and
``zero3-gather-once`` (the model plan/loop.py describes). Their memory derives from the plain and ZeRO-3
estimates of the same workload; their reserved bytes add plain's allocator slack to their peak.

The user's config: its optimizer's offload and reduce bucket apply to the training state; the ZeRO-3 side
of gather-once takes its stage-3 tuning."""
from __future__ import annotations

from dsdoctor.plan.loop import loop_path, loop_speed, train_step_bytes, training_code
from dsdoctor.plan.memory import allocated
from dsdoctor.plan.paths.base import LoadPath, replayed
from dsdoctor.plan.paths.plain import plain_layout
from dsdoctor.plan.paths.zero3 import Zero3, zero3_config
from dsdoctor.plan.speed import estimate_speed


class LoopPath(LoadPath):
    """A path only a loop has. What-fits searches estimate every probe in full."""
    loop_only = True
    trains = True
    derived = True

    def knobs(self, ctx):
        return ctx.knobs

    def allocated(self, ctx, wl):
        gpus, inv = ctx.hw.gpus, ctx.shape.inventory
        plain = allocated(plain_layout(gpus), ctx.shape, wl)
        zero3 = allocated(Zero3().layout(gpus, ctx.stage3_only()), ctx.shape, wl, ctx.stage3_only())
        numel, b = inv.num_params, wl.dtype_bytes
        return loop_path(self.name, zero3, plain, numel, numel * b, b, gpus, self.knobs(ctx),
                         train_step_bytes(ctx.shape, wl))

    def reserved(self, ctx, wl, mem):
        plain = replayed(plain_layout(ctx.hw.gpus), ctx, wl)
        return mem.gpu_peak_bytes + max(plain.gpu_reserved_bytes - plain.gpu_peak_bytes, 0)

    def memory(self, ctx, wl, ratio=None):
        return super().memory(ctx, wl)  # estimated in full at every probe

    def speed(self, ctx, mem):
        plain = estimate_speed(ctx.shape, ctx.wl, ctx.figures)
        return loop_speed(self.name, plain, ctx.weights, ctx.hw.gpus, ctx.wl, ctx.figures)

    def code(self, ctx, row):
        return training_code(self.name, ctx.model, ctx.hw.gpus, ctx.run_dtype)


class Zero2(LoopPath):
    """ZeRO-2: whole weights on every GPU, gradients and optimizer state partitioned."""
    name = "zero2"


class Zero3GatherOnce(LoopPath):
    """ZeRO-3 for training; each generate all-gathers the whole model once and lifts ZeRO-3's module hooks
    (``unwrap_model_for_generation``)."""
    name = "zero3-gather-once"

    def ds_config(self, ctx):
        return zero3_config(None, ctx.knobs, ctx.run_dtype)
