"""ab reads the peak the way an expert does (DSD345, DSD346).

For each variant that reached ``generate``, its measured generate peak is split into plan's parts for
the same shape (model config, batch, prompt and new tokens, ranks, stage, offload, as the trace recorded
them): resident weights, gathered/prefetched parameters, KV cache, activations, logits; what plan does
not explain is said as a remainder. Then the verdict, from the variants side by side: lower without
offload_param -> gathering dominates; unchanged -> activations and output buffers; host memory or speed
collapsing with offload -> the host-to-device copy, with the machine's measured bandwidth (a calibrate
profile) and what pin_memory changed when that variant ran.
"""
from __future__ import annotations

import json

from dsdoctor import door
from dsdoctor.findings import Finding
from dsdoctor.i18n import pick
from dsdoctor.units import human_bytes

NOISE = 0.10
PARTS = (("weights_resident", "resident weights", "常驻权重"),
         ("persistent_params", "persistent params", "常驻小参数"),
         ("gathered_params", "gathered/prefetched params", "收集/预取的参数"),
         ("kv_cache", "KV cache", "KV cache"),
         ("activations", "activations", "激活"),
         ("logits", "logits", "logits"),
         ("cublas_workspace", "cuBLAS workspace", "cuBLAS 工作区"),
         ("reduce_bucket", "reduce bucket", "reduce bucket"),
         ("optimizer_state", "optimizer state", "优化器状态"))


def shape_of(trace) -> dict | None:
    """What plan needs from a variant's trace: model config, workload, ranks, path."""
    for r in trace.ranks:
        gen = next((p for p in r.phases if p.get("name") == "generate" and p.get("model_config")
                    and p.get("batch")), None)
        if gen is None:
            continue
        new = (gen.get("new_tokens") or 0) // max(gen["batch"], 1)
        return {"model_config": gen["model_config"], "batch": gen["batch"], "prompt_len": gen["prompt_len"],
                "new_tokens": max(new, 1), "world_size": r.world_size or 1, "zero_stage": r.zero_stage,
                "offload_param": r.offload_param, "tp_size": r.tp_size or 1, "dtype": r.dtype}
    return None


def _path(shape: dict) -> str:
    if shape.get("zero_stage") == 3:
        return {"cpu": "zero3-offload", "nvme": "zero3-offload-nvme"}.get(shape.get("offload_param") or "", "zero3")
    return "tp" if (shape.get("tp_size") or 1) > 1 else "plain"


def plan_breakdown(shape: dict) -> dict | None:
    """plan's generate-peak breakdown (bytes per part) for the variant's shape, or None if plan cannot."""
    try:
        from dsdoctor.model.spec import load_model_spec
        from dsdoctor.plan.api import load_inventory
        from dsdoctor.plan.hardware import make_hardware
        from dsdoctor.plan.memory import estimate_path, model_shape
        from dsdoctor.plan.workload import make_workload

        with door.scratch_dir("dsdoctor-ab-") as tmp:
            door.write_new(tmp / "config.json", json.dumps(shape["model_config"]))
            spec = load_model_spec(tmp)
            inv = load_inventory(spec, "auto")
        world = max(int(shape.get("world_size") or 1), 1)
        dtype = {"fp32": "fp32", "fp16": "fp16"}.get(shape.get("dtype") or "", None)
        wl = make_workload(int(shape["batch"]), int(shape["prompt_len"]), int(shape["new_tokens"]), dtype,
                           spec.dtype)
        hw = make_hardware(gpus=world, gpu_memory=2**50, host_memory=2**50, detect=False)
        mem = estimate_path(_path(shape) if world > 1 or _path(shape) != "tp" else "plain", model_shape(spec, inv),
                            wl, hw, phases=("prefill", "decode"))
    except Exception:  # noqa: BLE001 -- an unknown architecture: no attribution, the verdict still stands
        return None
    return None if mem is None else {"path": mem.name, "peak": mem.gpu_peak_bytes, "parts": mem.gpu_breakdown,
                                     "gathered_per_step": mem.gathered_bytes_per_step}


def _measured(v):
    """The peak ab compares (as ``diagnose_ab._metric``): the generate peak when the variant reached generate,
    else its whole-run peak; GPU when the run had one."""
    if v.generate_peak_gpu_bytes or v.peak_gpu_bytes:
        return v.generate_peak_gpu_bytes or v.peak_gpu_bytes, "GPU"
    return v.generate_peak_host_bytes or v.peak_host_bytes, "host"


def attribution(v) -> dict | None:
    """{measured, kind, parts: {name: bytes}, remainder, path} for one variant, or None."""
    if v.status != "ok" or not v.shape:
        return None
    measured, kind = _measured(v)
    b = plan_breakdown(v.shape)
    if not measured or b is None:
        return None
    parts = {k: int(b["parts"][k]) for k, _, _ in PARTS if b["parts"].get(k)}
    return {"variant": v.name, "measured": int(measured), "kind": kind, "path": b["path"], "parts": parts,
            "remainder": int(measured - sum(parts.values())), "gathered_per_step": b["gathered_per_step"]}


UNEXPLAINED = {"en": "unexplained ", "zh": "未解释的余量 "}


def _line(a: dict, lang: str) -> str:
    names = {k: pick({"en": en, "zh": zh}, lang) for k, en, zh in PARTS}
    parts = " + ".join(f"{names[k]} {human_bytes(x)}" for k, x in a["parts"].items())
    rest = pick(UNEXPLAINED, lang) + ("-" if a["remainder"] < 0 else "") + human_bytes(abs(a["remainder"]))
    return f"{a['variant']} ({a['path']}, {a['kind']}): {human_bytes(a['measured'])} = {parts} + {rest}"


def findings(variants, profile=None) -> list[Finding]:
    """DSD345 (the attribution of every variant) and DSD346 (the verdict in numbers)."""
    att = {v.name: a for v in variants if (a := attribution(v))}
    out: list[Finding] = []
    if att:
        out.append(Finding("DSD345", {"lines": "; ".join(_line(a, "en") for a in att.values()),
                                      "lines_zh": "；".join(_line(a, "zh") for a in att.values())}))
    verdict = _verdict(variants, att, profile)
    if verdict:
        out.append(Finding("DSD346", verdict))
    return out


def _verdict(variants, att: dict, profile) -> dict | None:
    by = {v.name: v for v in variants}
    base, nop, unpinned = by.get("as-is"), by.get("no-offload-param"), by.get("pin-memory-off")
    if base is None or base.status != "ok":
        return None
    if base.offload_param and nop is not None and nop.status != "ok":
        return None  # OOM without offload: DSD315/DSD311 already say what that means
    a = att.get("as-is")
    b_peak = _measured(base)[0]
    if base.offload_param and nop is not None and nop.status == "ok":
        n_peak = _measured(nop)[0]
        slow = base.tokens_per_s and nop.tokens_per_s and base.tokens_per_s < 0.5 * nop.tokens_per_s
        host_up = base.peak_host_bytes and nop.peak_host_bytes and base.peak_host_bytes > 1.5 * nop.peak_host_bytes
        if slow or host_up:
            return _h2d(base, nop, unpinned, a, profile)
        if n_peak and b_peak and n_peak < b_peak * (1 - NOISE):
            g = (a or {}).get("parts", {}).get("gathered_params")
            share = f"; plan puts gathered/prefetched params at {human_bytes(g)} of it" if g else ""
            share_zh = f"；其中收集/预取的参数约 {human_bytes(g)}" if g else ""
            return {"verdict": f"gathering dominates: without offload_param the generate peak falls from "
                               f"{human_bytes(b_peak)} to {human_bytes(n_peak)}{share}",
                    "verdict_zh": f"参数收集占主导：去掉 offload_param 后生成峰值从 {human_bytes(b_peak)} 降到 "
                                  f"{human_bytes(n_peak)}{share_zh}",
                    "advice": "lower stage3_prefetch_bucket_size and stage3_max_live_parameters",
                    "advice_zh": "调小 stage3_prefetch_bucket_size 和 stage3_max_live_parameters"}
    if a:
        act = sum(a["parts"].get(k, 0) for k in ("kv_cache", "activations", "logits"))
        if act >= 0.5 * a["measured"]:
            return {"verdict": f"activations and output buffers dominate: KV cache, activations and logits are "
                               f"{human_bytes(act)} of the {human_bytes(a['measured'])} generate peak",
                    "verdict_zh": f"激活和输出缓冲占主导：KV cache、激活和 logits 占生成峰值 "
                                  f"{human_bytes(a['measured'])} 中的 {human_bytes(act)}",
                    "advice": "generate fewer new tokens, lower the batch, or chunk long prompts",
                    "advice_zh": "减少生成的新 token、减小 batch，或把长 prompt 分块"}
    return None


def _h2d(base, nop, unpinned, a, profile) -> dict:
    moved = (a or {}).get("gathered_per_step")
    ranks = (base.shape or {}).get("world_size") or 1
    bits, bits_zh = [], []
    if base.tokens_per_s and nop.tokens_per_s:
        bits.append(f"tokens/s {nop.tokens_per_s:.1f} -> {base.tokens_per_s:.1f} with offload_param")
        bits_zh.append(f"开启 offload_param 后 tokens/s {nop.tokens_per_s:.1f} -> {base.tokens_per_s:.1f}")
    if moved:
        bits.append(f"each forward copies {human_bytes(moved / ranks)} per rank from the host")
        bits_zh.append(f"每次前向每个 rank 从主机拷贝 {human_bytes(moved / ranks)}")
    m = profile.measured if profile is not None else {}
    if m.get("h2d_pinned"):
        pinned, pageable = m["h2d_pinned"] / 1e9, m.get("h2d_pageable", 0) / 1e9
        bits.append(f"this machine copies {pinned:.0f} GB/s pinned, {pageable:.0f} GB/s pageable "
                    f"(calibrated {profile.date})")
        bits_zh.append(f"本机锁页拷贝 {pinned:.0f} GB/s，可分页 {pageable:.0f} GB/s（校准于 {profile.date}）")
    if unpinned is not None and unpinned.tokens_per_s and base.tokens_per_s:
        bits.append(f"pin_memory off: {unpinned.tokens_per_s:.1f} tokens/s vs {base.tokens_per_s:.1f} pinned")
        bits_zh.append(f"关闭 pin_memory：{unpinned.tokens_per_s:.1f} tokens/s，锁页为 {base.tokens_per_s:.1f}")
    return {"verdict": "host-to-device bottleneck: " + "; ".join(bits),
            "verdict_zh": "主机到设备拷贝是瓶颈：" + "；".join(bits_zh),
            "advice": "keep offload_param only if the model does not fit without it; pin the host memory",
            "advice_zh": "只有不卸载就放不下时才保留 offload_param；使用锁页内存"}
