"""accelerate's ``device_map="auto"``: the layers of one process spread over the GPUs, the rest offloaded.

What ``from_pretrained(..., device_map="auto")`` does (transformers 5 ``integrations/accelerate.py`` and
accelerate 1.x ``utils/modeling.py``), modelled here without torch:

* the units placed are the model's leaf modules and its no-split blocks (the decoder layers), in
  registration order; a tied lm_head goes with the embedding it shares;
* ``get_balanced_memory``: every GPU but the last gets at most ``total / n + 1.25 x max(largest layer,
  largest leaf)``; the last keeps its free memory; on one GPU, 90% of it;
* ``infer_auto_device_map`` fills GPU 0, 1, ... in order; the first GPU keeps room for the largest layer
  still to place (to bring back an offloaded one); what does not fit goes to the CPU (90% of the host's
  available memory), then to disk.

At run time one GPU works at a time (a pipeline without micro-batches): a decode step reads every weight once
at one GPU's bandwidth, and CPU-offloaded layers are copied to GPU 0 from pageable memory on every forward.
The KV cache of a layer lives where the layer runs; offloaded layers run on GPU 0.
"""
from __future__ import annotations

import dataclasses

from dsdoctor.plan.loading import plain_methods
from dsdoctor.plan.memory import CUBLAS_WORKSPACE, CUDA_CONTEXT, PathMemory, allocated
from dsdoctor.plan.paths.base import TORCH_DTYPE, EstimatePath
from dsdoctor.plan.paths.plain import plain_layout
from dsdoctor.plan.shape import kv_bytes
from dsdoctor.plan.speed import estimate_speed

BALANCE_BUFFER = 1.25
ONE_GPU_SHARE = 0.9
HOST_SHARE = 0.9


def units(inv, b: int) -> list[tuple[str, int, int | None]]:
    """(name, bytes, layer) of what accelerate places, in order; a tied lm_head costs nothing extra."""
    out: dict[str, list] = {}
    for p in inv.params:
        key = f"layer{p.layer}" if p.layer is not None else p.module
        entry = out.setdefault(key, [key, 0, p.layer])
        entry[1] += p.numel * b
    return [tuple(e) for e in out.values()]


def place(unit_list, gpus: int, gpu_free: int, host_free: int) -> tuple[dict, list]:
    """Device per unit (0..gpus-1, "cpu" or "disk") and the per-GPU limits used."""
    total = sum(u[1] for u in unit_list)
    biggest = max((u[1] for u in unit_list), default=0)
    if gpus == 1:
        limits = [int(gpu_free * ONE_GPU_SHARE)]
    else:
        per_gpu = total // gpus + int(BALANCE_BUFFER * biggest)
        limits = [min(per_gpu, gpu_free)] * (gpus - 1) + [gpu_free]
    devices = list(range(gpus)) + ["cpu", "disk"]
    caps = limits + [int(host_free * HOST_SHARE), None]
    used = {d: 0 for d in devices}
    where: dict = {}
    current = 0
    for k, (name, size, _layer) in enumerate(unit_list):
        reserve = max((u[1] for u in unit_list[k:]), default=0)
        while True:
            dev = devices[current]
            cap = caps[current]
            if cap is not None and dev in (0, "cpu"):
                cap -= reserve
            if cap is None or used[dev] + size <= cap:
                used[dev] += size
                where[name] = dev
                break
            current += 1
    return where, limits


def _per_gpu(unit_list, where: dict, gpus: int, act: int, logits: int, kv_layer: int) -> tuple[dict, int]:
    """Parts per GPU (weights placed there, the KV cache of the layers it runs, activations and logits where the
    work runs, one offloaded layer on GPU 0 while it runs) and the offloaded bytes."""
    per_gpu = {g: {"weights_resident": 0, "kv_cache": 0} for g in range(gpus)}
    offloaded = streamed = 0
    for name, size, layer in unit_list:
        dev = where[name]
        run_on = dev if isinstance(dev, int) else 0
        if isinstance(dev, int):
            per_gpu[dev]["weights_resident"] += size
        else:
            offloaded += size
            streamed = max(streamed, size)
        if layer is not None:
            per_gpu[run_on]["kv_cache"] += kv_layer
    head = next((n for n, _, layer in unit_list if layer is None and n.endswith(("lm_head", "embed_out"))), None)
    head_dev = where.get(head, where.get(unit_list[0][0])) if unit_list else 0
    head_gpu = head_dev if isinstance(head_dev, int) else 0
    peaks = {}
    for g, parts in per_gpu.items():
        parts = dict(parts)
        if parts["weights_resident"] or parts["kv_cache"] or g == 0:
            parts["activations"] = act
            parts["cublas_workspace"] = CUBLAS_WORKSPACE
        if g == head_gpu:
            parts["logits"] = logits
        if g == 0 and streamed:
            parts["offloaded_layers"] = streamed  # one offloaded layer on GPU 0 while it runs
        peaks[g] = {k: int(v) for k, v in parts.items() if v}
    return peaks, offloaded


def estimate_device_map(shape, wl, hw) -> tuple[PathMemory, dict]:
    """The fullest GPU's allocated peak (reserved left to the path) and the placement."""
    inv = shape.inventory
    b = wl.dtype_bytes
    unit_list = units(inv, b)
    where, limits = place(unit_list, hw.gpus, hw.gpu_memory - CUDA_CONTEXT, hw.host_memory)
    plain = allocated(plain_layout(1), shape, wl)
    act = plain.gpu_breakdown.get("activations", 0)
    logits = plain.gpu_breakdown.get("logits", 0)
    kv_layer = kv_bytes(shape, wl.batch, wl.final_len, b, layers=1)
    peaks, offloaded = _per_gpu(unit_list, where, hw.gpus, act, logits, kv_layer)
    worst = max(peaks, key=lambda g: sum(peaks[g].values()))
    breakdown = peaks[worst]
    peak = sum(breakdown.values())
    host = {"offloaded_params": offloaded} if offloaded else {}
    notes = [f"GPU {worst} holds the most; weights per GPU: "
             + ", ".join(f"{g}: {peaks[g].get('weights_resident', 0) / 2**30:.1f} GiB" for g in peaks)]
    if offloaded:
        notes.append(f"{offloaded / 2**30:.1f} GiB of layers offloaded to the CPU, copied to GPU 0 every forward")
    if any(v == "disk" for v in where.values()):
        notes.append("some layers go to disk (offload_folder): every forward reads them")
    mem = PathMemory("device-map", 1, 1, int(peak), CUDA_CONTEXT, 0, "prefill", breakdown, host,
                     int(sum(p.get("weights_resident", 0) for p in peaks.values())), int(offloaded), notes)
    info = {"placement": {str(k): v for k, v in where.items()}, "limits": limits, "offloaded_bytes": offloaded}
    return mem, info


def device_map_speed(speed, mem, wl, figures):
    """Sequential over the GPUs (the plain step of the whole model) plus the offloaded layers' copies, from
    pageable host memory: at the machine's pageable host-to-device rate."""
    pageable = figures.h2d_pageable
    extra = mem.gathered_bytes_per_step / pageable if mem.gathered_bytes_per_step else 0.0
    step = speed.decode_step_s + extra
    prefill = speed.prefill_s + extra
    total = prefill + max(wl.new_tokens - 1, 0) * step
    return dataclasses.replace(speed, decode_step_s=step, prefill_s=prefill,
                               tokens_per_s=wl.batch * wl.new_tokens / total, decode_tokens_per_s=wl.batch / step,
                               bound="host-to-device" if extra > speed.decode_step_s else speed.bound)


def code(model: str, dtype_name: str) -> str:
    return ("import torch\nfrom transformers import AutoModelForCausalLM\n"
            f"model = AutoModelForCausalLM.from_pretrained({model!r}, dtype={dtype_name}, device_map=\"auto\")"
            "  # one process, layers over the GPUs\n"
            "out = model.generate(**inputs.to(\"cuda:0\"), max_new_tokens=N)\n")


class DeviceMap(EstimatePath):
    """One process, the layers spread over the GPUs; no config setting applies."""
    name = "device-map"

    def allocated(self, ctx, wl):
        return estimate_device_map(ctx.shape, wl, ctx.hw)[0]

    def reserved(self, ctx, wl, mem):
        return int(mem.gpu_peak_bytes * 1.02 + 64 * 2**20)  # the allocator's slack, assumed

    def loading_methods(self, ctx, mem):
        methods = plain_methods(ctx.ckpt, ctx.wl.dtype, 1, ctx.weights)[:1]
        methods[0].method = "device-map"
        return methods

    def speed(self, ctx, mem):
        return device_map_speed(estimate_speed(ctx.shape, ctx.wl, ctx.figures), mem, ctx.wl, ctx.figures)

    def code(self, ctx, row):
        return code(ctx.model, TORCH_DTYPE[ctx.run_dtype])

    def row_notes(self, ctx):
        return [f"placement: {len(units(ctx.shape.inventory, ctx.wl.dtype_bytes))} units over {ctx.hw.gpus} GPU(s)"]
