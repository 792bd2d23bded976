"""The paths only a loop has (``--loop``: the model trains and generates its own rollouts): ``zero2`` (whole
weights on every GPU, gradients and optimizer state partitioned) and ``zero3-gather-once`` (ZeRO-3 for
training; each generate all-gathers the whole model once and lifts ZeRO-3's module hooks, DeepSpeed's
``unwrap_model_for_generation``). Their memory is the actor's phases (``loop_memory.py``): the generate or the
training step on one micro-batch of the rollouts, whichever holds more, beside the training state; their
reserved bytes add plain's allocator slack to their peak. Speed: plain's; gather-once adds one all-gather of
every parameter per generate.

The user's config: its optimizer's offload and reduce bucket apply to the training state; the ZeRO-3 side
of gather-once takes its stage-3 tuning."""
from __future__ import annotations

from dsdoctor.config.rl import Engine
from dsdoctor.plan.loop_code import actor_config, actor_script
from dsdoctor.plan.loop_memory import actor_costs, flat, knobs_hold, phases_of
from dsdoctor.plan.memory import CUDA_CONTEXT, NCCL_BUFFERS, PathMemory, allocated
from dsdoctor.plan.paths.base import LoadPath
from dsdoctor.plan.paths.plain import Plain, plain_layout
from dsdoctor.plan.paths.zero3 import Zero3, zero3_config
from dsdoctor.plan.speed import Speed, estimate_speed
from dsdoctor.zero_costs import allgather_s


def allocator_slack(ctx, wl) -> int:
    """What the caching allocator reserves beyond the allocated peak of the plain generate (its replay): the
    slack a loop's paths and an RL job's arrangements take."""
    mem = Plain().memory(ctx, wl)
    return max(mem.gpu_reserved_bytes - mem.gpu_peak_bytes, 0)


def gather_once_speed(ctx, offload: bool = False) -> Speed:
    """Plain speed plus, per generate, one all-gather of every parameter (and, with offload_param, this rank's
    shard copied from the host)."""
    wl, f, gpus = ctx.wl, ctx.figures, ctx.hw.gpus
    plain = estimate_speed(ctx.shape, wl, f)
    extra = allgather_s(ctx.weights, gpus, f.allgather_bus_bw) + (ctx.weights / gpus / f.h2d_pinned if offload else 0.0)
    tokens = wl.batch * wl.new_tokens
    return Speed(plain.decode_step_s, plain.prefill_s + extra, tokens / (tokens / plain.tokens_per_s + extra),
                 plain.decode_tokens_per_s, plain.bound)


class LoopPath(LoadPath):
    """A path only a loop has. What-fits searches estimate every probe in full."""
    loop_only = True
    trains = True
    derived = True
    stage = 2
    engine = Engine("generate")
    notes: tuple = ()

    def knobs(self, ctx):
        return ctx.knobs

    def layout_of(self, ctx):
        gpus = ctx.hw.gpus
        zero3 = Zero3().layout(gpus, ctx.stage3_only())
        return lambda hold: zero3 if hold.stage == 3 else plain_layout(gpus)

    def allocated(self, ctx, wl):
        costs, hold = actor_costs(ctx, self.layout_of(ctx)), knobs_hold(self.stage, ctx.knobs)
        phases, host, _notes = phases_of([costs], {"actor": hold}, self.engine, wl, wl.batch, ctx.hw.gpu_memory)
        top = max(phases, key=lambda p: p.total)
        loading = allocated(costs.layout(hold), ctx.shape, wl).host_breakdown
        host = dict({k: v for k, v in loading.items() if k != "optimizer_state"}, **flat(host))
        gpus = ctx.hw.gpus
        return PathMemory(self.name, gpus, gpus, top.total, CUDA_CONTEXT + (NCCL_BUFFERS if gpus > 1 else 0),
                          int(sum(host.values())), "decode" if top.name == "rollout" else "train-step",
                          flat(top.parts), host, costs.weights, 0, list(self.notes))

    def reserved(self, ctx, wl, mem):
        return mem.gpu_peak_bytes + allocator_slack(ctx, wl)

    def memory(self, ctx, wl, ratio=None):
        return super().memory(ctx, wl)  # estimated in full at every probe

    def speed(self, ctx, mem):
        return estimate_speed(ctx.shape, ctx.wl, ctx.figures)

    def ds_config(self, ctx):
        return actor_config({"stage": self.stage}, ctx.knobs, ctx.run_dtype, ctx.wl.batch)

    def code(self, ctx, row):
        return actor_script(self.ds_config(ctx), ctx.model, self.engine, ctx.hw.gpus, ctx.run_dtype)


class Zero2(LoopPath):
    """ZeRO-2: whole weights on every GPU, gradients and optimizer state partitioned."""
    name = "zero2"
    notes = ("ZeRO-2: whole weights resident, gradients and optimizer state partitioned",)


class Zero3GatherOnce(LoopPath):
    """ZeRO-3 for training; each generate all-gathers the whole model once and lifts ZeRO-3's module hooks
    (``unwrap_model_for_generation``)."""
    name = "zero3-gather-once"
    stage = 3
    engine = Engine("gather-once")
    notes = ("whole weights on every GPU while generating, ZeRO-3 partitions as well",
             "speed: plain plus one all-gather of every parameter per generate")

    def speed(self, ctx, mem):
        return gather_once_speed(ctx)

    def ds_config(self, ctx):  # the ZeRO-3 side with the config's stage-3 tuning
        zero = zero3_config(None, ctx.knobs, ctx.run_dtype)["zero_optimization"]
        return actor_config(zero, ctx.knobs, ctx.run_dtype, ctx.wl.batch)
