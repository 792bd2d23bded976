"""DeepSpeed ZeRO-3 for inference (``deepspeed.initialize`` without an optimizer, the model built under
``zero.Init``): ``zero3`` (shards on the GPUs), ``zero3-offload`` (shards in pinned host memory) and
``zero3-offload-nvme`` (shards on NVMe, staged through pinned buffers).

The user's config: its stage-3 tuning (prefetch bucket, persistence threshold, max live parameters, max
reuse distance) applies to every ZeRO-3 path; its optimizer and offload_param only to the path the config
itself selects (that is what it would build). With ``--loop`` the actor trains on these paths: the
training state and step are counted (``plan/loop_memory.py`` ``in_loop``), and the config and code are the
training ones (``plan/loop_code.py``)."""
from __future__ import annotations

from pprint import pformat

from dsdoctor.config.rl import Engine
from dsdoctor.plan.loading import zero3_methods
from dsdoctor.plan.loop_code import actor_config, actor_script, dtype_section
from dsdoctor.plan.loop_memory import actor_costs, in_loop, knobs_hold
from dsdoctor.plan.memory import Layout, zero3_gather
from dsdoctor.plan.paths.base import TORCH_DTYPE, LayoutPath, assumption_moved
from dsdoctor.plan.speed import StepTerms, estimate_speed


def zero3_config(offload: str | None, knobs=None, dtype: str = "bf16") -> dict:
    """The inference ds_config of a ZeRO-3 path: the config's stage-3 tuning, offload_param as the path has it."""
    zero = {"stage": 3}
    if knobs is not None:
        zero.update({
            "stage3_prefetch_bucket_size": knobs.prefetch_bucket_size,
            "stage3_param_persistence_threshold": knobs.param_persistence_threshold,
            "stage3_max_live_parameters": knobs.max_live_parameters,
        })
    if offload == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if offload == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}
    return {**dtype_section(dtype), "zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}


def zero3_code(model: str, gpus: int, dtype: str, cfg: dict) -> str:
    torch_dtype = TORCH_DTYPE[dtype]
    return (f"# deepspeed --num_gpus {gpus} run.py\nimport torch, deepspeed\n"
            f"from transformers import AutoModelForCausalLM\n"
            f"from transformers.integrations import HfDeepSpeedConfig\n"
            f"ds_config = {pformat(cfg, sort_dicts=False)}\n"
            f"dschf = HfDeepSpeedConfig(ds_config)  # keep alive: from_pretrained loads under zero.Init\n"
            f"model = AutoModelForCausalLM.from_pretrained({model!r}, dtype={torch_dtype})\n"
            f"engine = deepspeed.initialize(model=model, config=ds_config)[0]  # no optimizer\n"
            f"engine.module.eval()\n"
            f"out = engine.module.generate(**inputs, max_new_tokens=N, synced_gpus=True)\n")


LOOP_GENERATE = Engine("generate")  # the actor's rollouts in a loop: HF generate on the training module


class Zero3(LayoutPath):
    name = "zero3"
    offload: str | None = None  # where offload_param puts the shards
    hooks = "zero3_module_s"  # the machine figure of one module's ZeRO-3 hooks
    trains = True

    @classmethod
    def selected_by(cls, knobs) -> bool:
        """The config builds this path: stage 3 with this path's offload_param."""
        return knobs is not None and knobs.zero_stage == 3 and knobs.offload_param == cls.offload

    def knobs(self, ctx):
        return ctx.knobs if self.name == ctx.config_path else ctx.stage3_only()

    def layout(self, gpus, knobs):
        return Layout(self.name, tp=1, world=gpus, replicas=gpus, procs=gpus,
                      gather=zero3_gather(gpus, self.offload, knobs))

    def memory(self, ctx, wl, ratio=None):
        mem = super().memory(ctx, wl, ratio)
        if not ctx.loop:
            return mem
        knobs = self.knobs(ctx)
        layout = self.layout(ctx.hw.gpus, knobs)
        hold = knobs_hold(3, knobs, offload_param=self.offload is not None)
        return assumption_moved(in_loop(mem, actor_costs(ctx, lambda _hold: layout), hold, wl))

    def loading_methods(self, ctx, mem):
        return zero3_methods(ctx.ckpt, ctx.wl.dtype, mem.ranks, ctx.weights)

    def terms(self, ctx, mem) -> StepTerms:
        return StepTerms(hooks=self.hooks, ranks=mem.ranks, moved=mem.gathered_bytes_per_step)

    def speed(self, ctx, mem):
        return estimate_speed(ctx.shape, ctx.wl, ctx.figures, self.terms(ctx, mem))

    def ds_config(self, ctx):
        cfg = zero3_config(self.offload, ctx.knobs, ctx.run_dtype)
        return actor_config(cfg["zero_optimization"], ctx.knobs, ctx.run_dtype, ctx.wl.batch) if ctx.loop else cfg

    def code(self, ctx, row):
        if ctx.loop:
            return actor_script(self.ds_config(ctx), ctx.model, LOOP_GENERATE, ctx.hw.gpus, ctx.run_dtype)
        return zero3_code(ctx.model, ctx.hw.gpus, ctx.run_dtype, self.ds_config(ctx))


class Zero3Offload(Zero3):
    name = "zero3-offload"
    offload = "cpu"
    hooks = "zero3_offload_module_s"

    def terms(self, ctx, mem):
        knobs = self.knobs(ctx)
        pinned = knobs.offload_param_pin_memory if knobs is not None and knobs.offload_param else True
        return StepTerms(hooks=self.hooks, ranks=mem.ranks, moved=mem.gathered_bytes_per_step,
                         h2d="pinned" if pinned else "pageable")


class Zero3Nvme(Zero3):
    name = "zero3-offload-nvme"
    offload = "nvme"
    hooks = "zero3_offload_module_s"

    def terms(self, ctx, mem):
        return StepTerms(hooks=self.hooks, ranks=mem.ranks, moved=mem.gathered_bytes_per_step, nvme=True)


ZERO3_PATHS = (Zero3, Zero3Offload, Zero3Nvme)


def config_path(knobs) -> str | None:
    """The ZeRO-3 path a config builds (None: not stage 3). An offload_param device no path models is planned
    as ``zero3``."""
    if knobs is None or knobs.zero_stage != 3:
        return None
    return next((p.name for p in ZERO3_PATHS if p.selected_by(knobs)), Zero3.name)
