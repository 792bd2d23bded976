"""``plain``: the whole model on every GPU, one process and one batch per GPU (``from_pretrained`` with
``device_map`` to the rank's GPU, no DeepSpeed)."""
from __future__ import annotations

import dataclasses

from dsdoctor.gpus import gpu_facts, run_dtype
from dsdoctor.plan.loading import plain_methods
from dsdoctor.plan.memory import Layout
from dsdoctor.plan.paths.base import TORCH_DTYPE, LayoutPath
from dsdoctor.plan.schedule import Gather
from dsdoctor.plan.speed import estimate_speed


def plain_layout(gpus: int) -> Layout:
    """Whole weights on each GPU; one replica (and one process) per GPU."""
    return Layout("plain", tp=1, world=1, replicas=gpus, procs=gpus, gather=Gather(world=1))


def plain_code(model: str, gpus: int, dtype: str, loading: str | None = None) -> str:
    launch = (f"# one process per GPU, each with its own batch:\n#   torchrun --nproc_per_node {gpus} run.py\n"
              if gpus > 1 else "")
    code = (f"{launch}import os, torch\nfrom transformers import AutoModelForCausalLM\n"
            f"device = f\"cuda:{{int(os.environ.get('LOCAL_RANK', 0))}}\"\n"
            f"model = AutoModelForCausalLM.from_pretrained({model!r}, dtype={TORCH_DTYPE[dtype]}, device_map=device)\n"
            f"out = model.generate(**inputs, max_new_tokens=N)\n")
    if loading == "cpu-then-to":
        code = code.replace(", device_map=device)", ").to(device)  # CPU first: a lower host peak")
    return code


class Plain(LayoutPath):
    """No config setting applies: DeepSpeed is not used."""
    name = "plain"

    def layout(self, gpus, knobs):
        return plain_layout(gpus)

    def loading_methods(self, ctx, mem):
        return plain_methods(ctx.ckpt, ctx.wl.dtype, mem.replicas, ctx.weights)

    def speed(self, ctx, mem):
        return estimate_speed(ctx.shape, ctx.wl, ctx.figures)

    def code(self, ctx, row):
        return plain_code(ctx.model, ctx.hw.gpus, ctx.run_dtype, row.loading)


class PlainHalf(Plain):
    """``plain-bf16`` (``plain-fp16`` on a GPU without bf16): an fp32 checkpoint loaded in half precision, the
    plain path otherwise. Offered whenever the planned dtype is fp32; it changes the weights' precision, so it
    is recommended only in the tier of the quantized paths (``quantized``: when nothing in fp32 fits)."""
    name = "plain-half"
    names = ("plain-bf16", "plain-fp16")  # the rows it makes
    quantized = True

    def __init__(self, half: str = "bf16"):
        self.half = half
        self.name = f"plain-{half}"

    @classmethod
    def instances(cls, ctx):
        if ctx.wl.dtype != "fp32":
            return []
        return [cls(run_dtype("bf16", gpu_facts(ctx.hw.gpu_name).capability))]

    def _ctx(self, ctx):
        return dataclasses.replace(ctx, wl=dataclasses.replace(ctx.wl, dtype=self.half), run_dtype=self.half)

    def memory(self, ctx, wl, ratio=None):
        return super().memory(self._ctx(ctx), dataclasses.replace(wl, dtype=self.half), ratio)

    def expandable_reserved(self, ctx):
        return super().expandable_reserved(self._ctx(ctx))

    def loading_methods(self, ctx, mem):
        return super().loading_methods(self._ctx(ctx), mem)

    def speed(self, ctx, mem):
        return super().speed(self._ctx(ctx), mem)

    def code(self, ctx, row):
        return super().code(self._ctx(ctx), row)

    def row(self, ctx, mem, speed, fit, method, methods, searched):
        return super().row(self._ctx(ctx), mem, speed, fit, method, methods, searched)
