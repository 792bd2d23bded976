"""``plan``: does this inference need ZeRO-3, and which load path is fastest among those that fit?

Data flow: model spec (+ exact parameter inventory) + workload + hardware (+ DeepSpeed knobs)
-> memory per path (``memory.py``) -> speed per path (``speed.py``) -> recommendation -> ``PlanResult``.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os

from dsdoctor.calibrate import rules as _calibrate_rules  # noqa: F401  (registers DSD22x)
from dsdoctor.findings import Finding
from dsdoctor.gpus import gpu_facts
from dsdoctor.gpus import run_dtype as _dtype_for_gpu
from dsdoctor.machine import gpu_capability
from dsdoctor.model.formulas import from_formula
from dsdoctor.model.inventory import apply_to_spec
from dsdoctor.model.spec import load_model_spec
from dsdoctor.plan import loop as plan_loop
from dsdoctor.plan import recommend as rec
from dsdoctor.plan import rules  # noqa: F401  (registers DSD2xx)
from dsdoctor.plan.ds_knobs import DsKnobs, load_knobs
from dsdoctor.plan.emit import code_for_plan
from dsdoctor.plan.extra_paths import extra_paths
from dsdoctor.plan.hardware import make_hardware
from dsdoctor.plan.loading import apply_loading, find_checkpoint, methods_for
from dsdoctor.plan.memory import PATHS, estimate_path, model_shape
from dsdoctor.plan.path_findings import path_findings
from dsdoctor.plan.paths_tp import as_tp, estimate_split, parse_split, split_name, tp_splits
from dsdoctor.plan.positions import hard_limit, position_limit
from dsdoctor.plan.quant import QUANT_PATHS
from dsdoctor.plan.reserved import fragmentation_findings
from dsdoctor.plan.result import PathPlan, PlanResult, Recommendation
from dsdoctor.plan.speed import estimate_speed, figures_for
from dsdoctor.plan.workload import Workload, make_workload
from dsdoctor.units import human_bytes

MAX_BATCH_SEARCH = 4096
_EXACT_CACHE: dict[str, object] = {}  # config.json text -> inventory: building on the meta device takes seconds


def load_inventory(spec, counts: str = "auto"):
    """Exact counts from the meta-device model when transformers can build it, else the formula."""
    if counts not in ("auto", "meta", "formula"):
        raise ValueError(counts)
    inv = None
    if counts in ("auto", "meta"):
        try:
            from dsdoctor.model.exact import exact_inventory

            positions = min(int(spec.max_position_embeddings or 4096), 131072)
            key = json.dumps(spec.raw, sort_keys=True)
            if key not in _EXACT_CACHE:
                _EXACT_CACHE[key] = exact_inventory(spec.raw, probe_positions=positions)
            inv = copy.deepcopy(_EXACT_CACHE[key])
        except ImportError:
            inv = None
        if inv is None and counts == "meta":
            from dsdoctor.errors import InputError

            raise InputError(f"transformers cannot build model_type {spec.model_type!r} on the meta device",
                             path=spec.path, hint="use --counts formula")
    if inv is None:
        inv = from_formula(spec)
    apply_to_spec(spec, inv)
    return inv


def config_path_of(knobs: DsKnobs | None) -> str | None:
    if knobs is None or knobs.zero_stage != 3:
        return None
    return {"cpu": "zero3-offload", "nvme": "zero3-offload-nvme"}.get(knobs.offload_param or "", "zero3")


def _knobs_for(path: str, knobs: DsKnobs | None, config_path: str | None) -> DsKnobs | None:
    """The user's stage-3 tuning applies to every ZeRO-3 path; the optimizer only to the path the
    config itself selects (that is what it would build)."""
    if knobs is None:
        return None
    if path == config_path:
        return knobs
    return dataclasses.replace(knobs, has_optimizer=False, offload_param=None)


def _choose_tiered(plans: list) -> tuple:
    """Measured paths first; an estimate (device-map) only when none fits; quantized weights (they change
    the outputs) only when nothing in full precision fits. Returns (chosen or None, the tier compared)."""
    tiers = [[p for p in plans if not p.estimate], [p for p in plans if p.name not in QUANT_PATHS], plans]
    for tier in tiers:
        chosen = rec.choose(tier)
        if chosen is not None:
            return chosen, tier
    return None, plans


def _run_dtype(dtype: str, hw) -> tuple[str, float | None]:
    """The dtype the emitted config and code use on this GPU, and the GPU's compute capability."""
    capability = gpu_facts(hw.gpu_name).capability
    if capability is None and "gpus" in hw.detected:
        capability = gpu_capability()
    return _dtype_for_gpu(dtype, capability), capability


def _fits(mem, hw) -> tuple[bool, list]:
    limits = []
    if mem.gpu_reserved_bytes + mem.gpu_outside_allocator_bytes > hw.gpu_memory:
        limits.append("gpu")
    if mem.host_peak_bytes > hw.host_memory:
        limits.append("host")
    return not limits, limits


def _largest(fits_at, low: int, high: int) -> int | None:
    """Largest value in [low, high] for which fits_at(value) holds (monotone), or None."""
    if not fits_at(low):
        return None
    if fits_at(high):
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits_at(mid) else (low, mid)
    return low


def plan(model: str | os.PathLike, batch: int = 1, prompt_len: int = 512, new_tokens: int = 128,
         dtype: str | None = None, gpus: int | None = None, gpu_memory=None, host_memory=None,
         h2d_bandwidth=None, config=None, counts: str = "auto", detect: bool = True,
         gpu_name: str | None = None, loop: bool = False, machine=None, alloc_conf: str | None = None) -> PlanResult:
    """Plan ``model`` for the workload. ``config`` is a DeepSpeed config path, dict or an already loaded
    ``dsdoctor.config.load.LoadedConfig`` (``diagnose`` passes the one it has read). ``loop``: the model trains
    and generates its own rollouts (RLHF/GRPO): training state and the training step counted on the ZeRO-3
    paths, the paths zero2 and zero3-gather-once added, the recommendation among training paths
    (``plan/loop.py``). ``machine``: a MachineProfile or a profile file (``dsdoctor calibrate --out``); by
    default the cached profile of this machine when one matches (only when ``detect``). ``alloc_conf``: the
    PYTORCH_CUDA_ALLOC_CONF the run will use (default: this process's environment)."""
    spec = load_model_spec(model)
    # every input checked before the slow part (the meta-device build): bad input ends at once
    pos_limit, hard = position_limit(spec.raw), hard_limit(spec.raw)
    wl = make_workload(batch, prompt_len, new_tokens, dtype, spec.dtype, hard)
    hw = make_hardware(gpus, gpu_memory, host_memory, h2d_bandwidth, gpu_name=gpu_name, detect=detect)
    profile = resolve_profile(machine, detect)
    figures = figures_for(hw, profile)
    hw.figures = figures  # not a field: the reserved replay's clocks read it (plan/reserved.py timing_for)
    if alloc_conf is None:
        alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    expandable = "expandable_segments:true" in alloc_conf.replace(" ", "").lower()
    context = profile.get("context_bytes") if profile is not None else None
    knobs = load_knobs(config)
    inv = load_inventory(spec, counts)
    config_path = config_path_of(knobs)
    shape = model_shape(spec, inv)

    run_dtype, capability = _run_dtype(wl.dtype, hw)
    ckpt = find_checkpoint(spec.path, inv.num_params * wl.dtype_bytes, spec.dtype)
    largest_param = max((p.numel for p in inv.params), default=0) * wl.dtype_bytes
    splits = [(split_name(tp, r, hw.gpus), "tp") for tp, r in tp_splits(hw.gpus, spec.num_heads, spec.num_kv_heads)]
    candidates = [(name, name) for name in PATHS[:2]] + splits + [(name, name) for name in PATHS[2:]]
    plans: list[PathPlan] = []
    for name, family in candidates:
        k = _knobs_for(family, knobs, config_path)
        split = parse_split(name, hw.gpus) if family == "tp" else None

        def estimate(w, name=name, k=k, split=split, ratio=None):
            if split is not None and name != "tp":
                return estimate_split(split[0], split[1], shape, w, hw, k)
            mem = estimate_path(name, shape, w, hw, k, expandable=expandable, context_bytes=context,
                                reserved_ratio=ratio, built_from_config=not ckpt.seen)
            return plan_loop.in_loop(name, mem, shape, w, k) if loop else mem

        mem = estimate(wl)
        if mem is None:
            continue
        kind = "plain" if family == "plain" else "tp" if family == "tp" else "zero3"
        methods = methods_for(kind, ckpt, wl.dtype, mem.ranks, mem.replicas, inv.num_params * wl.dtype_bytes,
                              largest_param)
        method, _ = apply_loading(mem, methods, hw.host_memory)
        speed = estimate_speed(as_tp(mem) if family == "tp" else mem, shape, wl, hw, k, figures)
        fits, limits = _fits(mem, hw)

        ratio = mem.gpu_reserved_bytes / max(mem.gpu_peak_bytes, 1)  # what-fits searches reuse it

        def fits_with(estimate=estimate, method=method, ratio=ratio, **change):  # bound now: this iteration only
            m = estimate(dataclasses.replace(wl, **change), ratio=ratio)
            apply_loading(m, [method], hw.host_memory)
            return _fits(m, hw)[0]

        max_ctx = (pos_limit or 131072) - wl.new_tokens
        max_ctx = max(max_ctx, wl.prompt_len) if hard is None else max_ctx
        max_batch = _largest(lambda v: fits_with(batch=v), 1, MAX_BATCH_SEARCH)
        max_prompt = _largest(lambda v: fits_with(prompt_len=v), 1, max(max_ctx, 1))
        plans.append(PathPlan(
            name=name, ranks=mem.ranks, replicas=mem.replicas, gpu_peak_bytes=mem.gpu_peak_bytes,
            gpu_reserved_bytes=mem.gpu_reserved_bytes, gpu_outside_allocator_bytes=mem.gpu_outside_allocator_bytes,
            host_peak_bytes=mem.host_peak_bytes, fits=fits, limits=limits, peak_at=mem.peak_at,
            tokens_per_s=speed.tokens_per_s, decode_tokens_per_s=speed.decode_tokens_per_s, bound=speed.bound,
            breakdown=mem.gpu_breakdown, host_breakdown=mem.host_breakdown, max_batch=max_batch,
            max_prompt_len=max_prompt, notes=mem.notes + method.notes, loading=method.method,
            host_file_bytes=mem.host_file_bytes,
            loading_options=[m.to_dict() for m in methods],
            tp=split[0] if split else None,
            fragmentation_bytes=getattr(mem, "fragmentation_bytes", 0), speed_terms=speed.terms,
        ))

    plans += extra_paths(shape, wl, hw, knobs, ckpt, run_dtype, str(model), _fits, figures)
    if loop:
        plans += plan_loop.loop_plans(shape, wl, hw, knobs, _fits, _largest, pos_limit, hard, MAX_BATCH_SEARCH,
                                       figures)
        chosen, compared = plan_loop.choose(plans), [p for p in plans if p.name in plan_loop.TRAINING_PATHS]
    else:
        chosen, compared = _choose_tiered(plans)
    if chosen is not None:
        code = plan_loop.code_for(chosen.name, str(model), hw.gpus, run_dtype) if loop else \
            code_for_plan(chosen, str(model), hw.gpus, run_dtype, knobs)
        recommendation = Recommendation(
            chosen.name, {lang: rec.why(chosen, compared, lang) for lang in ("en", "zh")},
            chosen.ds_config if chosen.estimate else rec.ds_config_for(chosen.name, knobs, dtype=run_dtype),
            code)
    else:
        recommendation = Recommendation(None, {"en": "no path fits", "zh": "没有放得下的方式"}, None, None)

    findings = _findings(plans, chosen, knobs, config_path, hw, wl, figures, profile)
    findings += path_findings(spec, wl, hw, plans, chosen, pos_limit, hard, run_dtype, capability, ckpt)
    if loop:
        findings += plan_loop.findings(plans, chosen)
    if not expandable:
        def with_expandable(name):
            try:
                m = estimate_path(name, shape, wl, hw, _knobs_for(name, knobs, config_path), expandable=True,
                                  context_bytes=context)
            except Exception:  # noqa: BLE001 -- a path estimate_path does not know (tp groups, quantized)
                return None
            return m.gpu_reserved_bytes if m else None

        findings += fragmentation_findings(plans, chosen, config_path, with_expandable)
    findings += machine_findings(profile, machine)
    weights_only = inv.num_params * wl.dtype_bytes
    model_info = {"path": spec.path, "model_type": spec.model_type, "num_params": inv.num_params,
                  "counted_by": inv.counted_by, "layers": spec.num_layers, "hidden_size": spec.hidden_size,
                  "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                  "vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tie_word_embeddings,
                  "kv_bytes_per_token": sum(shape.kv_elems_per_token) * wl.dtype_bytes}
    hw.profile = profile_summary(profile, figures)
    hw.alloc_conf = alloc_conf or None
    return PlanResult(model_info, wl, hw, knobs, plans, recommendation, findings, weights_only)


def resolve_profile(machine, detect: bool):
    """The machine profile a plan uses: the one given, else this machine's cached one, else None."""
    from dsdoctor.calibrate.profile import MachineProfile, find_profile, load_profile

    if isinstance(machine, MachineProfile):
        return machine
    if machine is not None:
        return load_profile(machine)
    return find_profile() if detect else None


def machine_findings(profile, machine) -> list[Finding]:
    """DSD221 when a profile given explicitly was measured on other hardware than this machine's."""
    if profile is None or machine is None:
        return []
    from dsdoctor.calibrate import rules as _  # noqa: F401  (registers DSD22x)
    from dsdoctor.calibrate.profile import fingerprint, machine_description

    here = machine_description()
    if not here.get("gpus") or fingerprint(here) == profile.fingerprint:
        return []  # no GPU here: planning for another machine is what --machine is for

    def describe(m):
        g = m.get("gpus") or []
        return f"{len(g)} x {g[0]['name']}" if g else "no GPU"

    return [Finding("DSD221", {"source": profile.source or "given", "profile_machine": describe(profile.machine),
                               "date": profile.date, "this_machine": describe(here)})]


def profile_summary(profile, figures) -> dict:
    if profile is None:
        return {"calibrated_at": None, "source": None, "assumed": figures.assumed}
    return {"calibrated_at": profile.calibrated_at, "fingerprint": profile.fingerprint, "source": profile.source,
            "assumed": figures.assumed}


def _findings(plans, chosen, knobs, config_path, hw, wl: Workload, figures=None, profile=None) -> list[Finding]:
    out: list[Finding] = []
    by = {p.name: p for p in plans}
    assumed = list(hw.assumed)
    if profile is not None:  # what the profile measured is no longer assumed
        if "h2d_pinned" in profile.measured:
            assumed = [a for a in assumed if not a.startswith("h2d_bandwidth")]
        if "hbm_weight_read" in profile.measured and "matmul_flops" in profile.measured:
            assumed = [a for a in assumed if not a.startswith("bandwidths of")]
    if figures is not None and figures.assumed:
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
        train_keys = ("reduce_bucket", "optimizer_state")
        gpu_cost = sum(v for k, v in cp.breakdown.items() if k in train_keys)
        host_cost = sum(v for k, v in cp.host_breakdown.items() if k in train_keys)
        out.append(Finding("DSD203", {"gpu_cost": human_bytes(gpu_cost), "host_cost": human_bytes(host_cost)}))
    if cp is not None and "gpu" in cp.limits:
        need = human_bytes(cp.gpu_reserved_bytes + cp.gpu_outside_allocator_bytes)
        out.append(Finding("DSD204", {"path": cp.name, "need": need,
                                      "capacity": human_bytes(hw.gpu_memory),
                                      "recommended": chosen.name if chosen else "none"}))
    plain = by.get("plain")
    if cp is not None and plain is not None and plain.fits:
        speedup = plain.tokens_per_s / cp.tokens_per_s if cp.tokens_per_s else float("inf")
        out.append(Finding("DSD201", {"plain_peak": human_bytes(plain.gpu_peak_bytes),
                                      "capacity": human_bytes(hw.gpu_memory), "speedup": f"{speedup:.1f}",
                                      "config_path": cp.name}))
    if config_path == "zero3-offload" and not knobs.offload_param_pin_memory and cp is not None:
        pinned = cp.host_breakdown.get("offloaded_params", 0)
        factor = figures.h2d_pinned / figures.h2d_pageable if figures is not None else 1 / 0.35
        out.append(Finding("DSD206", {"moved": human_bytes(cp.host_breakdown.get("offloaded_params", 0) / max(cp.ranks, 1)),
                                      "slowdown": f"{factor:.1f}", "pinned": human_bytes(pinned * 2)}))
    return out
