"""Findings about the workload's length, the GPU's dtypes, loading methods and unmeasured paths."""
from __future__ import annotations

from dsdoctor.findings import Finding
from dsdoctor.plan.positions import encoding
from dsdoctor.units import human_bytes

_ENCODING_ZH = {"rotary": "RoPE", "alibi": "ALiBi"}


def path_findings(spec, wl, hw, plans, chosen, pos_limit, hard, run_dtype, capability, ckpt) -> list[Finding]:
    out: list[Finding] = []
    total = wl.prompt_len + wl.new_tokens
    if pos_limit and hard is None and total > pos_limit:
        out.append(Finding("DSD210", {"total": total, "limit": pos_limit,
                                      "encoding": _ENCODING_ZH.get(encoding(spec.raw), encoding(spec.raw))}))
    if run_dtype != wl.dtype:
        out.append(Finding("DSD211", {"gpu": hw.gpu_name or "the GPU", "capability": f"{capability:.1f}"}))
    if chosen is not None and chosen.loading_options and chosen.loading:
        first = chosen.loading_options[0]
        if first["method"] != chosen.loading:
            mine = next(m for m in chosen.loading_options if m["method"] == chosen.loading)
            out.append(Finding("DSD212", {"path": chosen.name, "method": chosen.loading,
                                          "method_peak": human_bytes(mine["peak_bytes"]),
                                          "host": human_bytes(hw.host_memory), "default": first["method"],
                                          "default_peak": human_bytes(first["peak_bytes"])}))
    if chosen is not None and chosen.estimate:  # the table marks the others with ~
        out.append(Finding("DSD213", {"paths": chosen.name}))
    if getattr(spec, "counted_by", "") == "formula-approx":
        out.append(Finding("DSD214", {"model_type": spec.model_type, "count": f"{spec.num_params / 1e9:.2f}B"}))
    return out
