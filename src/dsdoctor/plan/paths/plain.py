"""``plain``: the whole model on every GPU, one process and one batch per GPU (``from_pretrained`` with
``device_map`` to the rank's GPU, no DeepSpeed)."""
from __future__ import annotations

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
