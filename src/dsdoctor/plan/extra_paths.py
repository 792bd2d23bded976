"""The load paths planned as estimates (not yet measured on a GPU): accelerate's device_map="auto" and
quantized weights. Each becomes a ``PathPlan`` marked ``estimate``; the recommendation takes a quantized
path only when no full-precision path fits (quantization changes the model's outputs)."""
from __future__ import annotations

import dataclasses
import json

from dsdoctor.plan import device_map as dm
from dsdoctor.plan import quant
from dsdoctor.plan import recommend as rec
from dsdoctor.plan.emit import TORCH_DTYPE
from dsdoctor.plan.loading import PROCESS_BASE, apply_loading, methods_for
from dsdoctor.plan.result import PathPlan
from dsdoctor.plan.speed import estimate_speed


def _zero_code(name: str, model: str, gpus: int, dtype: str, knobs) -> tuple[dict, str]:
    base = "zero3-offload" if "offload" in name else "zero3"
    cfg = rec.ds_config_for(base, knobs, dtype=dtype)
    code = rec.code_for(base, model, gpus, dtype, knobs)
    with_q = dict(cfg, weight_quantization=quant.ds_weight_quantization())
    return with_q, code.replace(json.dumps(cfg, indent=2), json.dumps(with_q, indent=2))


def extra_paths(shape, wl, hw, knobs, ckpt, run_dtype: str, model: str, fits, figures=None) -> list[PathPlan]:
    """``figures``: the machine's speed figures (``speed.figures_for``: the calibrate profile's where measured)."""
    inv = shape.inventory
    if knobs is not None:  # the stage-3 tuning applies; the optimizer belongs to the config's own path
        knobs = dataclasses.replace(knobs, has_optimizer=False, offload_param=None)
    weights = inv.num_params * wl.dtype_bytes
    largest = max((p.numel for p in inv.params), default=0) * wl.dtype_bytes
    out = []
    # accelerate device_map="auto": one process
    if True:
        mem, info = dm.estimate_device_map(shape, wl, hw)
        methods = methods_for("plain", ckpt, wl.dtype, 1, 1, weights, largest)[:1]
        methods[0].method = "device-map"
        method, _ = apply_loading(mem, methods, hw.host_memory)
        plain_like = estimate_path_like(mem)
        speed = dm.device_map_speed(estimate_speed(plain_like, shape, wl, hw, None, figures), mem, hw, wl, figures)
        out.append(_plan(mem, speed, fits(mem, hw), method, methods, dm.code(model, TORCH_DTYPE[run_dtype]),
                         None, [f"placement: {len(info['placement'])} units over {hw.gpus} GPU(s)"]))
    for name in quant.QUANT_PATHS:
        if name.startswith("bnb"):
            mem = quant.bnb_estimate(name, shape, wl, hw)
            methods = methods_for("plain", ckpt, wl.dtype, 1, hw.gpus, weights, largest)
            speed = quant.bnb_speed(estimate_speed(estimate_path_like(mem), shape, wl, hw, None, figures), name)
            code, cfg = quant.bnb_code(name, model, TORCH_DTYPE[run_dtype], hw.gpus), None
        else:
            mem = quant.zero_int4_estimate(name, shape, wl, hw, knobs)
            if mem is None:
                continue
            methods = methods_for("zero3", ckpt, wl.dtype, mem.ranks, mem.replicas, weights, largest)
            speed = estimate_speed(mem, shape, wl, hw, knobs, figures)
            cfg, code = _zero_code(name, model, hw.gpus, run_dtype, knobs)
        method, _ = apply_loading(mem, methods, hw.host_memory)
        out.append(_plan(mem, speed, fits(mem, hw), method, methods, code, cfg, []))
    return out


def estimate_path_like(mem):
    """The memory record under the name the speed model reads as one whole copy per GPU."""
    return dataclasses.replace(mem, name="plain", ranks=1)


def _plan(mem, speed, fit, method, methods, code, cfg, notes) -> PathPlan:
    ok, limits = fit
    p = PathPlan(
        name=mem.name, ranks=mem.ranks, replicas=mem.replicas, gpu_peak_bytes=mem.gpu_peak_bytes,
        gpu_reserved_bytes=mem.gpu_reserved_bytes, gpu_outside_allocator_bytes=mem.gpu_outside_allocator_bytes,
        host_peak_bytes=mem.host_peak_bytes, fits=ok, limits=limits, peak_at=mem.peak_at,
        tokens_per_s=speed.tokens_per_s, decode_tokens_per_s=speed.decode_tokens_per_s, bound=speed.bound,
        breakdown=mem.gpu_breakdown, host_breakdown=mem.host_breakdown, notes=mem.notes + method.notes + notes,
        loading=method.method, loading_options=[m.to_dict() for m in methods], estimate=True,
        host_file_bytes=mem.host_file_bytes)
    p.code = code
    p.ds_config = cfg
    return p


__all__ = ["extra_paths", "PROCESS_BASE"]
