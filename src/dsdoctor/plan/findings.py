"""What plan says about a plan: the findings DSD201-DSD214, DSD220-DSD226 and DSD234 (their texts: ``plan/rules.json``)."""
from __future__ import annotations

from dsdoctor.config.versions import resolve_versions, version_tuple
from dsdoctor.findings import Finding, Phrase
from dsdoctor.model.moe import experts_touched, hang_risk, hang_values
from dsdoctor.plan.memory import TRAINING_PARTS
from dsdoctor.plan.paths.base import TORCH_DTYPE
from dsdoctor.plan.positions import encoding
from dsdoctor.plan.speed import expert_elems
from dsdoctor.units import human_age, human_bytes, human_rate

_ENCODING_ZH = {"rotary": "RoPE", "alibi": "ALiBi"}
FRAGMENTATION_FINDING = 0.15
BAND_PHRASE = {"archived": "band archived", "here": "band here", "exact": "band exact", "unmeasured": "band unmeasured"}


def config_findings(plans, chosen, knobs, config_path, hw, figures, profile=None) -> list[Finding]:
    """DSD205 (what was assumed), DSD202 (nothing fits), and what the config costs: DSD201, DSD203, DSD204, DSD206."""
    out: list[Finding] = []
    by = {p.name: p for p in plans}
    assumed = list(hw.assumed)
    if profile is not None:  # what the profile measured is no longer assumed
        if "h2d_pinned" in profile.measured:
            assumed = [a for a in assumed if not a.startswith("h2d_bandwidth")]
        if "hbm_weight_read" in profile.measured and "matmul_flops" in profile.measured:
            assumed = [a for a in assumed if not a.startswith("bandwidths of")]
    if figures.assumed:
        assumed.append("speed figures " + ", ".join(figures.assumed)
                       + (" (run dsdoctor calibrate)" if profile is None else " (not in the machine profile)"))
    if assumed:
        out.append(Finding("DSD205", {"assumed": "; ".join(assumed)}))
    if chosen is None and plans:
        smallest = min(plans, key=lambda p: (p.gpu_reserved_bytes + p.gpu_outside_allocator_bytes))
        out.append(Finding("DSD202", {
            "path": smallest.name, "need": human_bytes(smallest.gpu_reserved_bytes + smallest.gpu_outside_allocator_bytes),
            "capacity": human_bytes(hw.gpu_memory), "host_need": human_bytes(smallest.host_peak_bytes),
            "host_capacity": human_bytes(hw.host_memory)}))
    if knobs is None:
        return out
    cp = by.get(config_path) if config_path else None
    if knobs.has_optimizer and cp is not None:
        gpu_cost = sum(v for k, v in cp.breakdown.items() if k in TRAINING_PARTS)
        host_cost = sum(v for k, v in cp.host_breakdown.items() if k in TRAINING_PARTS)
        out.append(Finding("DSD203", {"gpu_cost": human_bytes(gpu_cost), "host_cost": human_bytes(host_cost)}))
    if cp is not None and "gpu" in cp.limits:
        need = human_bytes(cp.gpu_reserved_bytes + cp.gpu_outside_allocator_bytes)
        out.append(Finding("DSD204", {"path": cp.name, "need": need,
                                      "capacity": human_bytes(hw.gpu_memory),
                                      "recommended": chosen.name if chosen else "none"}))
    plain = by.get("plain")
    if cp is not None and plain is not None and plain.verdict == "fits":
        speedup = plain.tokens_per_s / cp.tokens_per_s if cp.tokens_per_s else float("inf")
        out.append(Finding("DSD201", {"plain_peak": human_bytes(plain.gpu_peak_bytes),
                                      "capacity": human_bytes(hw.gpu_memory), "speedup": f"{speedup:.1f}",
                                      "config_path": cp.name}))
    if config_path == "zero3-offload" and not knobs.offload_param_pin_memory and cp is not None:
        pinned = cp.host_breakdown.get("offloaded_params", 0)
        factor = figures.h2d_pinned / figures.h2d_pageable
        out.append(Finding("DSD206", {"moved": human_bytes(cp.host_breakdown.get("offloaded_params", 0) / max(cp.ranks, 1)),
                                      "slowdown": f"{factor:.1f}", "pinned": human_bytes(pinned * 2)}))
    return out


def path_findings(spec, wl, hw, chosen, pos_limit, hard, run_dtype, capability) -> list[Finding]:
    """DSD210 (past the positions), DSD211 (no bf16 on this GPU), DSD212 (the loading method decides), DSD213
    (an estimate chosen), DSD214 (approximate counts)."""
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
    if spec.counted_by == "formula-approx":
        out.append(Finding("DSD214", {"model_type": spec.model_type, "count": f"{spec.num_params / 1e9:.2f}B"}))
    return out


def loop_findings(plans: list) -> list[Finding]:
    """DSD207 (gather-once against ZeRO-3 generate), DSD208 (gather-once does not fit), DSD209 (ZeRO-2 fits), and
    DSD231: one model planned, an RL job's others not counted (``plan --loop --ref/--critic/--reward/--job``)."""
    by = {p.name: p for p in plans}
    once, z3, z2 = by.get("zero3-gather-once"), by.get("zero3"), by.get("zero2")
    out = []
    if once is not None and z3 is not None:
        need = human_bytes(once.gpu_reserved_bytes + once.gpu_outside_allocator_bytes)
        if once.verdict == "fits":
            out.append(Finding("DSD207", {
                "once_tps": f"{once.tokens_per_s:.0f}", "z3_tps": f"{z3.tokens_per_s:.0f}",
                "speedup": f"{once.tokens_per_s / z3.tokens_per_s:.1f}" if z3.tokens_per_s else "?",
                "once_peak": human_bytes(once.gpu_peak_bytes), "z3_peak": human_bytes(z3.gpu_peak_bytes),
                "extra": human_bytes(max(once.gpu_peak_bytes - z3.gpu_peak_bytes, 0))}))
        elif not once.fits:
            out.append(Finding("DSD208", {"need": need, "limits": ", ".join(once.limits) or "gpu",
                                          "z3_peak": human_bytes(z3.gpu_peak_bytes)}))
    if z2 is not None and z2.verdict == "fits":
        out.append(Finding("DSD209", {"peak": human_bytes(z2.gpu_peak_bytes), "tps": f"{z2.tokens_per_s:.0f}",
                                      "gpus": z2.ranks}))
    return out + [Finding("DSD231", {})]


def fragmentation_findings(plans, chosen, config_path, with_expandable=None) -> list[Finding]:
    """DSD220 for the config's path and the recommended one, when reserved exceeds allocated by more than
    15%. ``with_expandable(name)``: the reserved bytes of that path under expandable segments."""
    out = []
    for p in plans:
        if p.name not in (config_path, chosen.name if chosen else None):
            continue
        frag = p.gpu_reserved_bytes - p.gpu_peak_bytes
        if p.gpu_peak_bytes and frag > FRAGMENTATION_FINDING * p.gpu_peak_bytes:
            exp = with_expandable(p.name) if with_expandable else None
            out.append(Finding("DSD220", {"path": p.name, "reserved": human_bytes(p.gpu_reserved_bytes),
                                          "allocated": human_bytes(p.gpu_peak_bytes),
                                          "pct": f"{100 * frag / p.gpu_peak_bytes:.0f}",
                                          "reserved_expandable": human_bytes(exp) if exp else "-"}))
    return out


def machine_findings(profile, machine) -> list[Finding]:
    """DSD221 when a profile given explicitly was measured on other hardware than this machine's."""
    if profile is None or machine is None:
        return []
    from dsdoctor.calibrate.profile import fingerprint, machine_description  # reads the machine: when asked

    here = machine_description()
    if not here.get("gpus") or fingerprint(here) == profile.fingerprint:
        return []  # no GPU here: planning for another machine is what --machine is for

    def describe(m):
        g = m.get("gpus") or []
        return f"{len(g)} x {g[0]['name']}" if g else "no GPU"

    return [Finding("DSD221", {"source": profile.source or "given", "profile_machine": describe(profile.machine),
                               "date": profile.date, "this_machine": describe(here)})]


def scale_findings(plans: list, hw) -> list[Finding]:
    """DSD222 when a path fits only without the reserved figure's assumption that no measurement covers at this
    scale (the host ahead of the GPU on several ranks): one finding, the figures of the first such path."""
    unverified = [p for p in plans if p.verdict == "unverified" and p.reserved_assumption]
    if not unverified:
        return []
    first = unverified[0].reserved_assumption
    outside = unverified[0].gpu_outside_allocator_bytes
    return [Finding("DSD222", {
        "paths": ", ".join(p.name for p in unverified), "gpus": first["world"],
        "with_figure": human_bytes(first["reserved_with_bytes"] + outside),
        "without_figure": human_bytes(first["reserved_without_bytes"] + outside),
        "layers": first["layers_ahead"], "layer": human_bytes(first["layer_bytes"]),
        "capacity": human_bytes(hw.gpu_memory), "measured": first["measured_up_to_world"]})]


ONE_GPU_PATHS = ("plain", "zero3", "zero3-offload")  # what plan --measure runs (plan/measure.py)


def measurable(p) -> bool:
    """Whether ``plan --measure`` can run this row: one process on one GPU."""
    return p.name in ONE_GPU_PATHS and p.ranks == 1


def edge_findings(plans: list, chosen, hw, command: str | None = None) -> list[Finding]:
    """DSD234 when the recommended path, or a faster one, fits by its prediction but not by the upper figure of
    its measured band (plan/band.py): by how much, and what to do (``command``: the ``plan --measure`` line with
    the user's flags, and the cap it runs under; or the path that fits outright)."""
    edge = [p for p in plans if p.verdict == "edge" and (p is chosen or chosen is None or
                                                         p.tokens_per_s * p.replicas > chosen.tokens_per_s * chosen.replicas)]
    if not edge:
        return []
    first = edge[0]
    outright = [p for p in plans if p.verdict == "fits" and not p.estimate]
    then = max(outright, key=lambda p: p.tokens_per_s * p.replicas).name if outright else None
    band = first.band["reserved"] if first.band["reserved"]["source"] != "pool" else first.band["allocated"]
    cap = human_bytes(hw.gpu_memory - first.gpu_outside_allocator_bytes)
    how = Phrase("measure command", {"command": command, "path": first.name, "cap": cap}) \
        if command and measurable(first) else Phrase("measure cap", {"what": first.name, "cap": cap})
    return [edge_finding(", ".join(p.name for p in edge), first.gpu_reserved_bytes + first.gpu_outside_allocator_bytes,
                         first.upper_bytes, hw.gpu_memory, band, how, then)]


def edge_finding(names: str, line: int, upper: int, capacity: int, band: dict, how: Phrase, then: str | None) -> Finding:
    """DSD234 for load paths (``edge_findings``) and an RL job's arrangements (plan/loop_result.py)."""
    return Finding("DSD234", {
        "paths": names, "line": human_bytes(line), "upper": human_bytes(upper), "capacity": human_bytes(capacity),
        "over": human_bytes(upper - capacity),
        "band": Phrase(BAND_PHRASE[band["source"]], {"low": f"{band['low'] - 1:+.0%}", "high": f"{band['high'] - 1:+.0%}",
                                                  "n": band["n"]}),
        "measure": how, "next": Phrase("next path", {"name": then}) if then else Phrase("no next path")})


def serving_findings(plans: list, chosen, serving: set, launch=None) -> list[Finding]:
    """DSD223 when a serving engine (an estimate) fits and would generate faster than the recommended path, which it
    does not displace: the user decides, knowing what it gives up. ``launch(name)``: the engine's command."""
    if chosen is None or chosen.name in serving:
        return []
    faster = [p for p in plans if p.name in serving and p.verdict == "fits"
              and p.tokens_per_s * p.replicas > 1.2 * chosen.tokens_per_s * chosen.replicas]
    if not faster:
        return []
    best = max(faster, key=lambda p: p.tokens_per_s * p.replicas)
    return [Finding("DSD223", {"engine": best.name, "split": f"{best.replicas} x TP {best.ranks}",
                               "tps": human_rate(best.tokens_per_s * best.replicas), "chosen": chosen.name,
                               "chosen_tps": human_rate(chosen.tokens_per_s * chosen.replicas),
                               "command": launch(best.name) if launch else best.name})]


LOSSY_FASTER = 3.0  # "several times faster": a lossy path named only past this
_HOW = {"bnb-int8": "how-bnb-int8", "bnb-nf4": "how-bnb-nf4", "zero3-int4": "how-int4", "zero3-offload-int4": "how-int4"}


def lossy_findings(plans: list, chosen, lossy: set) -> list[Finding]:
    """DSD215 when a path that changes the weights' precision (quantized, or an fp32 checkpoint in half
    precision) fits and plan rates it ``LOSSY_FASTER`` times the recommended full-precision path or more."""
    if chosen is None or chosen.name in lossy:
        return []
    base = chosen.tokens_per_s * chosen.replicas
    faster = [p for p in plans if p.name in lossy and p.verdict == "fits" and p.tokens_per_s * p.replicas >= LOSSY_FASTER * base]
    if not faster:
        return []
    best = max(faster, key=lambda p: p.tokens_per_s * p.replicas)
    half = best.name.removeprefix("plain-") if best.name not in _HOW else None
    what = Phrase("half", {"half": half}) if half else Phrase("quantized")
    how = Phrase("how-half", {"dtype": TORCH_DTYPE[half]}) if half else Phrase(_HOW[best.name])
    return [Finding("DSD215", {"path": best.name, "what": what, "tps": human_rate(best.tokens_per_s * best.replicas),
                               "chosen": chosen.name, "chosen_tps": human_rate(base), "how": how,
                               "speedup": f"{best.tokens_per_s * best.replicas / base:.0f}" if base else "?"})]


def freshness_findings(profile, freshness: dict | None) -> list[Finding]:
    """DSD224 when the profile's host-bound figures were scaled to what this host measures now; DSD225 when a
    profile could not be re-timed here and is older than a day or from another host."""
    if profile is None or not freshness:
        return []
    from dsdoctor.calibrate.recheck import STALE_AFTER_S

    values = {"source": profile.source or "cached", "age": human_age(freshness.get("age_s")),
              "host": Phrase(freshness.get("host") or "unknown host")}
    if freshness.get("rescaled"):
        return [Finding("DSD224", dict(values, then_us=f"{freshness['then_s'] * 1e6:.0f}",
                                       now_us=f"{freshness['now_s'] * 1e6:.0f}", ratio=f"{freshness['ratio']:.2f}"))]
    age = freshness.get("age_s")
    if freshness.get("now_s") is None and (freshness.get("host") == "another host"
                                           or (age is not None and age > STALE_AFTER_S)):
        return [Finding("DSD225", values)]
    return []


def moe_findings(plans, chosen, config_path, shape, wl, model_type: str, transformers: str | None) -> list[Finding]:
    """DSD226: the ZeRO-3 path of a mixture of experts (the config's, else the recommended) gathers every expert
    each decode step, where plain decode reads the experts its batch chose; DSD118: a block with one module per
    expert that skips unchosen experts, under the user's transformers (the hang and its leaf-module fix)."""
    moe = shape.inventory.moe
    if moe is None:
        return []
    out: list[Finding] = []
    by = {p.name: p for p in plans}
    z3 = by.get(config_path) if config_path and config_path.startswith("zero3") else None
    z3 = z3 or (chosen if chosen is not None and chosen.name.startswith("zero3") else None)
    plain = by.get("plain")
    if z3 is not None and plain is not None:
        routed, touched, _ = expert_elems(shape, wl.batch)
        read = (shape.inventory.num_params - routed + touched) * wl.dtype_bytes
        out.append(Finding("DSD226", {
            "path": z3.name, "gathered": human_bytes(shape.inventory.num_params * wl.dtype_bytes), "batch": wl.batch,
            "read": human_bytes(read), "touched": f"{experts_touched(moe, wl.batch):.0f}", "experts": moe.num_experts,
            "top_k": moe.top_k, "tps": f"{z3.tokens_per_s:.1f}", "plain_tps": f"{plain.tokens_per_s:.1f}",
            "plain_fits": "" if plain.verdict == "fits" else Phrase("does-not-fit" if not plain.fits else "edge")}))
    deepspeed = resolve_versions(None).tuple("deepspeed")  # its default leaf blocks (zero_optimization.leaf_module)
    if z3 is not None and hang_risk(moe, model_type, version_tuple(transformers), deepspeed):
        out.append(Finding("DSD118", hang_values(model_type, transformers or "(not installed)")))
    return out
