"""Tensor parallelism (AutoTP, ``deepspeed.init_inference``): ``tp`` over all GPUs, and ``tpKxR``: R
independent AutoTP groups of K GPUs (K divides the GPU count and the attention and key/value head counts),
each with its own batch. Per GPU a group is exactly AutoTP over K GPUs; the machine serves R batches at once.
No config setting applies: ``init_inference`` does not read the ZeRO section."""
from __future__ import annotations

import dataclasses
import re

from dsdoctor.plan.loading import tp_methods
from dsdoctor.plan.memory import Layout, allocated
from dsdoctor.plan.paths.base import TORCH_DTYPE, LayoutPath, replay
from dsdoctor.plan.schedule import Gather
from dsdoctor.plan.speed import StepTerms, estimate_speed

_SPLIT = re.compile(r"^tp(\d+)x(\d+)$")


def split_name(tp: int, replicas: int, gpus: int) -> str:
    return "tp" if tp == gpus else f"tp{tp}x{replicas}"


def parse_split(name: str, gpus: int) -> tuple[int, int] | None:
    """(tp, replicas) of a tensor-parallel path name, None for other paths."""
    if name == "tp":
        return gpus, 1
    m = _SPLIT.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def tp_splits(gpus: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """(tp, replicas) with 1 < tp < gpus, tp dividing the GPUs and both head counts; largest tp first."""
    out = []
    for tp in range(gpus - 1, 1, -1):
        if gpus % tp == 0 and heads % tp == 0 and kv_heads % tp == 0:
            out.append((tp, gpus // tp))
    return out


def tp_layout(tp: int) -> Layout:
    """AutoTP over ``tp`` GPUs: one model instance, one batch, ``tp`` processes."""
    return Layout("tp", tp=tp, world=tp, replicas=1, procs=tp, gather=Gather(world=tp))


def tp_code(model: str, tp: int, replicas: int, dtype: str, loading: str) -> str:
    td = TORCH_DTYPE[dtype]
    if replicas > 1:
        groups = [",".join(str(g) for g in range(r * tp, (r + 1) * tp)) for r in range(replicas)]
        launch = (f"# {replicas} replicas of tensor parallelism over {tp} GPUs: one launch per group, each with "
                  f"its own batch\n"
                  + "".join(f"#   deepspeed --include localhost:{g} --master_port {29500 + i} run.py"
                            f"{' &' if i < replicas - 1 else ''}\n" for i, g in enumerate(groups)))
    else:
        launch = f"# deepspeed --num_gpus {tp} run.py\n"
    head = launch + "import torch, deepspeed\nfrom transformers import AutoConfig, AutoModelForCausalLM\n"
    tail = "out = engine.module.generate(**inputs, max_new_tokens=N)  # same inputs on every rank of a group\n"
    if loading == "meta-checkpoint":
        return (head + f"config = AutoConfig.from_pretrained({model!r})\n"
                f"with deepspeed.OnDevice(dtype={td}, device=\"meta\"):\n"
                f"    model = AutoModelForCausalLM.from_config(config, dtype={td})\n"
                "# checkpoints.json: {\"type\": \"ds_model\", \"checkpoints\": [the checkpoint files], \"version\": 1.0}\n"
                f"engine = deepspeed.init_inference(model, tensor_parallel={{\"tp_size\": {tp}}}, dtype={td}, "
                f"checkpoint=\"checkpoints.json\", replace_with_kernel_inject=True)\n" + tail)
    if loading == "pre-sharded":
        return (head + "# once, on a machine that holds the model: init_inference(..., "
                f"save_mp_checkpoint_path=\"sharded\") with tp_size {tp}\n"
                f"config = AutoConfig.from_pretrained({model!r})\n"
                f"with deepspeed.OnDevice(dtype={td}, device=\"meta\"):\n"
                f"    model = AutoModelForCausalLM.from_config(config, dtype={td})\n"
                f"engine = deepspeed.init_inference(model, tensor_parallel={{\"tp_size\": {tp}}}, dtype={td}, "
                f"checkpoint=\"sharded/ds_inference_config.json\", replace_with_kernel_inject=True)\n" + tail)
    return (head + f"model = AutoModelForCausalLM.from_pretrained({model!r}, dtype={td})  # on the host, every rank\n"
            f"engine = deepspeed.init_inference(model, tensor_parallel={{\"tp_size\": {tp}}}, dtype={td}, "
            f"replace_with_kernel_inject=False)\n" + tail)


class Tp(LayoutPath):
    """AutoTP over every GPU (two or more)."""
    name = "tp"
    groups = 1

    def __init__(self, tp: int | None = None):
        self.tp = tp

    @classmethod
    def instances(cls, ctx):
        return [cls(ctx.hw.gpus)] if ctx.hw.gpus >= 2 else []

    def layout(self, gpus, knobs):
        return tp_layout(gpus)

    def loading_methods(self, ctx, mem):
        return tp_methods(ctx.ckpt, ctx.wl.dtype, mem.ranks, mem.replicas, ctx.weights, ctx.largest_param,
                          ctx.shape.kernel_inject)

    def speed(self, ctx, mem):
        return estimate_speed(ctx.shape, ctx.wl, ctx.figures, StepTerms(tp=mem.ranks))

    def code(self, ctx, row):
        return tp_code(ctx.model, self.tp, self.groups, ctx.run_dtype, row.loading or "cpu-model")


class TpGroups(Tp):
    """``tpKxR``: R AutoTP groups of K GPUs, one per divisor K of the GPUs (and of both head counts), the
    largest first. Its memory is AutoTP over K GPUs as a plain run builds it: the CUDA context of the
    generic machine, the allocator without expandable segments, and the replay at every what-fits probe
    (it does not reuse the planned workload's reserved/allocated ratio)."""
    name = "tpKxR"  # each instance is named for its split

    def __init__(self, tp: int, groups: int, gpus: int):
        super().__init__(tp)
        self.groups = groups
        self.name = split_name(tp, groups, gpus)

    @classmethod
    def instances(cls, ctx):
        shape = ctx.shape
        return [cls(tp, r, ctx.hw.gpus) for tp, r in tp_splits(ctx.hw.gpus, shape.heads, shape.kv_heads)]

    def layout(self, gpus, knobs):
        return tp_layout(self.tp)

    def allocated(self, ctx, wl):
        mem = allocated(tp_layout(self.tp), ctx.shape, wl, self.knobs(ctx))
        return dataclasses.replace(mem, name=self.name, replicas=self.groups)

    def reserved(self, ctx, wl, mem):
        return replay(tp_layout(self.tp), ctx, wl, mem)

    def memory(self, ctx, wl, ratio=None):
        """Replayed at every probe (see the class), save a probe whose allocated peak alone does not fit: the
        replay only adds to it (reserved >= allocated), so the probe fails either way."""
        mem = self.allocated(ctx, wl)
        over = ratio is not None and mem.gpu_peak_bytes + mem.gpu_outside_allocator_bytes > ctx.hw.gpu_memory
        return mem.with_reserved(mem.gpu_peak_bytes if over else self.reserved(ctx, wl, mem))
