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

from dsdoctor.plan.memory import CUBLAS_WORKSPACE, CUDA_CONTEXT, PathMemory, estimate_path, kv_bytes

BALANCE_BUFFER = 1.25
ONE_GPU_SHARE = 0.9
HOST_SHARE = 0.9
PAGEABLE_FACTOR = 0.35  # accelerate keeps offloaded weights in pageable memory (speed.UNPINNED_FACTOR's value)


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


def estimate_device_map(shape, wl, hw) -> tuple[PathMemory, dict]:
    inv = shape.inventory
    b = wl.dtype_bytes
    unit_list = units(inv, b)
    where, limits = place(unit_list, hw.gpus, hw.gpu_memory - CUDA_CONTEXT, hw.host_memory)
    plain = estimate_path("plain", shape, wl, dataclasses.replace(hw, gpus=1))
    act = plain.gpu_breakdown.get("activations", 0)
    logits = plain.gpu_breakdown.get("logits", 0)
    final = wl.final_len
    kv_layer = kv_bytes(shape, wl.batch, final, b, layers=1)
    per_gpu = {g: {"weights_resident": 0, "kv_cache": 0} for g in range(hw.gpus)}
    offloaded = 0
    streamed = 0
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
    mem = PathMemory("device-map", 1, 1, int(peak), int(peak * 1.02 + 64 * 2**20), CUDA_CONTEXT,
                     0, "prefill", breakdown, host, int(sum(p.get("weights_resident", 0) for p in peaks.values())),
                     int(offloaded), notes)
    info = {"placement": {str(k): v for k, v in where.items()}, "limits": limits, "offloaded_bytes": offloaded}
    return mem, info


def device_map_speed(speed, mem, hw, wl, figures=None):
    """Sequential over the GPUs (the plain step of the whole model) plus the offloaded layers' copies, from
    pageable host memory: at the measured pageable host-to-device rate when a profile has one."""
    pageable = figures.h2d_pageable if figures is not None else hw.h2d_bandwidth * PAGEABLE_FACTOR
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
