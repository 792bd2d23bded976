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

from dsdoctor.findings import Finding, Phrase
from dsdoctor.units import human_bytes

NOISE = 0.10
# plan's parts of a generate peak, in the order the attribution says them; each is a phrase of DSD345
PARTS = ("weights_resident", "persistent_params", "gathered_params", "kv_cache", "activations", "logits",
         "cublas_workspace", "reduce_bucket", "optimizer_state")


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
        from dsdoctor.plan.api import generate_peak

        world = max(int(shape.get("world_size") or 1), 1)
        path = _path(shape) if world > 1 or _path(shape) != "tp" else "plain"
        dtype = {"fp32": "fp32", "fp16": "fp16"}.get(shape.get("dtype") or "", None)
        mem = generate_peak(shape["model_config"], path, int(shape["batch"]), int(shape["prompt_len"]),
                            int(shape["new_tokens"]), gpus=world, dtype=dtype)
    except Exception:  # an unknown architecture: no attribution, the verdict still stands
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
    parts = {k: int(b["parts"][k]) for k in PARTS if b["parts"].get(k)}
    return {"variant": v.name, "measured": int(measured), "kind": kind, "path": b["path"], "parts": parts,
            "remainder": int(measured - sum(parts.values())), "gathered_per_step": b["gathered_per_step"]}


def _line(a: dict) -> Phrase:
    parts = [Phrase(k, {"size": human_bytes(x)}) for k, x in a["parts"].items()]
    return Phrase("line", {"variant": a["variant"], "path": a["path"], "kind": a["kind"],
                           "measured": human_bytes(a["measured"]), "parts": Phrase.join("plus", parts),
                           "remainder": ("-" if a["remainder"] < 0 else "") + human_bytes(abs(a["remainder"]))})


def findings(variants, profile=None) -> list[Finding]:
    """DSD345 (the attribution of every variant) and DSD346 (the verdict in numbers)."""
    att = {v.name: a for v in variants if (a := attribution(v))}
    out: list[Finding] = []
    if att:
        out.append(Finding("DSD345", {"lines": Phrase.join("and", [_line(a) for a in att.values()])}))
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
            share = Phrase("gathered-share", {"size": human_bytes(g)}) if g else ""
            return {"verdict": Phrase("gathering", {"before": human_bytes(b_peak), "after": human_bytes(n_peak),
                                                    "share": share}),
                    "advice": _drop_offload(nop) if not _slower(nop, base) else Phrase("advice-gathering")}
    if a:
        act = sum(a["parts"].get(k, 0) for k in ("kv_cache", "activations", "logits"))
        if act >= 0.5 * a["measured"]:
            return {"verdict": Phrase("activations", {"act": human_bytes(act), "peak": human_bytes(a["measured"])}),
                    "advice": Phrase("advice-activations")}
    return None


def _h2d(base, nop, unpinned, a, profile) -> dict:
    moved = (a or {}).get("gathered_per_step")
    ranks = (base.shape or {}).get("world_size") or 1
    bits = []
    if base.tokens_per_s and nop.tokens_per_s:
        bits.append(Phrase("h2d-speed", {"before": f"{nop.tokens_per_s:.1f}", "after": f"{base.tokens_per_s:.1f}"}))
    if moved:
        bits.append(Phrase("h2d-copied", {"size": human_bytes(moved / ranks)}))
    m = profile.measured if profile is not None else {}
    if m.get("h2d_pinned"):
        pinned, pageable = m["h2d_pinned"] / 1e9, m.get("h2d_pageable", 0) / 1e9
        bits.append(Phrase("h2d-bandwidth", {"pinned": f"{pinned:.0f}", "pageable": f"{pageable:.0f}",
                                             "date": profile.date}))
    if unpinned is not None and unpinned.tokens_per_s and base.tokens_per_s:
        bits.append(Phrase("h2d-unpinned", {"unpinned": f"{unpinned.tokens_per_s:.1f}",
                                            "pinned": f"{base.tokens_per_s:.1f}"}))
    # the seed's weighing: offload only when the model does not fit without it (here it ran without);
    # pin_memory is what measured better when both were run
    advice = _drop_offload(nop) if nop.status == "ok" else _pin_advice(base, unpinned) or Phrase("advice-h2d")
    return {"verdict": Phrase("h2d", {"bits": Phrase.join("and", bits)}), "advice": advice}


def _slower(a, b) -> bool:
    """``a`` ran clearly slower than ``b`` (both measured)."""
    return bool(a.tokens_per_s and b.tokens_per_s and a.tokens_per_s < b.tokens_per_s * (1 - NOISE))


def _drop_offload(nop) -> Phrase:
    peak, kind = _measured(nop)
    rate = f"{nop.tokens_per_s:.1f}" if nop.tokens_per_s else "-"
    return Phrase("advice-drop-offload", {"peak": human_bytes(peak), "kind": kind, "tps": rate})


def _pin_advice(base, unpinned) -> Phrase | None:
    """pin_memory as measured: keep it when unpinned ran clearly slower, else turn it off (page-locked host
    memory cannot be swapped or shared) when unpinned ran about as fast."""
    if unpinned is None or unpinned.status != "ok" or not (unpinned.tokens_per_s and base.tokens_per_s):
        return None
    values = {"pinned": f"{base.tokens_per_s:.1f}", "unpinned": f"{unpinned.tokens_per_s:.1f}"}
    return Phrase("advice-pin-on" if _slower(unpinned, base) else "advice-pin-off", values)
