"""``plan``: does this inference need ZeRO-3, and which load path is fastest among those that fit?

Data flow: model spec (+ exact parameter inventory) + workload + hardware (+ DeepSpeed knobs) -> one
``PlanContext`` -> each registered load path (``paths/``) estimates its memory (``memory.py`` + the reserved
replay, ``reserved.py``), loading (``loading.py``) and speed (``speed.py``) -> a result row each
(``evaluate.py``) -> the recommendation (``recommend.py``) and the findings (``findings.py``) -> ``PlanResult``.
"""
from __future__ import annotations

import dataclasses
import os

from dsdoctor.config.versions import version_tuple
from dsdoctor.gpus import gpu_facts
from dsdoctor.gpus import run_dtype as _dtype_for_gpu
from dsdoctor.machine import gpu_capability
from dsdoctor.model.formulas import from_formula
from dsdoctor.model.inventory import apply_to_spec
from dsdoctor.model.moe import implementation
from dsdoctor.model.spec import load_model_spec, spec_from_config
from dsdoctor.plan import findings as plan_findings
from dsdoctor.plan import recommend as rec
from dsdoctor.plan.band import Bands, archived, load_bands
from dsdoctor.plan.ds_knobs import load_knobs
from dsdoctor.plan.evaluate import evaluate
from dsdoctor.plan.hardware import make_hardware
from dsdoctor.plan.inventory_cache import exact_inventory_cached
from dsdoctor.plan.loading import find_checkpoint, transformers_loading
from dsdoctor.plan.memory import PathMemory, allocated
from dsdoctor.plan.paths import (
    PlanContext,
    by_name,
    config_path,
    paths_for,
    quantized_names,
    serving_names,
    training_names,
)
from dsdoctor.plan.paths.base import LayoutPath, for_transformers
from dsdoctor.plan.positions import hard_limit, position_limit
from dsdoctor.plan.request import PlanRequest, measure_command
from dsdoctor.plan.result import PlanResult, Recommendation
from dsdoctor.plan.shape import model_shape
from dsdoctor.plan.speed import figures_for
from dsdoctor.plan.workload import make_workload


def load_inventory(spec, counts: str = "auto"):
    """Exact counts from the meta-device model when transformers can build it (kept per config:
    ``inventory_cache.py``), else the formula."""
    if counts not in ("auto", "meta", "formula"):
        raise ValueError(counts)
    inv = None
    if counts in ("auto", "meta"):
        try:
            inv = exact_inventory_cached(spec.raw, min(int(spec.max_position_embeddings or 4096), 131072),
                                         path=spec.path)
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


def _run_dtype(dtype: str, hw) -> tuple[str, float | None]:
    """The dtype the emitted config and code use on this GPU, and the GPU's compute capability."""
    capability = gpu_facts(hw.gpu_name).capability
    if capability is None and "gpus" in hw.detected:
        capability = gpu_capability()
    return _dtype_for_gpu(dtype, capability), capability


def _recommend(plans: list, rows: dict, ctx: PlanContext) -> tuple:
    """The chosen row (or None), the rows it was compared with, and the recommendation."""
    if ctx.loop:
        chosen, compared = rec.choose_training(plans, training_names())
    else:  # a serving engine only for pure batch generation, and not when the outputs must equal HF generate's
        candidates = [p for p in plans if not (ctx.hf_equality and p.name in serving_names())]
        chosen, compared = rec.choose_tiered(candidates, quantized_names())
    if chosen is None:
        return None, compared, Recommendation(None, dict(rec.WHY["none fits"]), None, None)
    path = rows[chosen.name]
    why = {lang: rec.why(chosen, compared, lang) for lang in ("en", "zh")}
    code = for_transformers(path.code(ctx, chosen), (ctx.transformers or {}).get("version"))
    return chosen, compared, Recommendation(chosen.name, why, path.ds_config(ctx), code)


def plan(model: str | os.PathLike | None = None, **values) -> PlanResult:
    """Plan ``model`` for the workload: every value a field of ``PlanRequest`` (``plan/request.py`` says what
    each is), as plain values."""
    return plan_request(PlanRequest(model=model, **values))


def plan_request(req: PlanRequest) -> PlanResult:
    """The plan a ``PlanRequest`` asks for. ``config`` may be an already loaded ``LoadedConfig`` (``diagnose``
    passes the one it has read); with ``loop`` the training state and step are counted on the ZeRO-3 paths and
    the paths zero2 and zero3-gather-once added, the recommendation among training paths (``loop_memory.py``)."""
    if req.model is None:
        from dsdoctor.errors import InputError

        raise InputError("plan needs a model: a model directory or its config.json")
    model, gpus, alloc_conf = req.model, req.gpus, req.alloc_conf
    spec = load_model_spec(model)
    # every input checked before the slow part (the meta-device build): bad input ends at once
    pos_limit, hard = position_limit(spec.raw), hard_limit(spec.raw)
    wl = make_workload(req.batch, req.prompt_len, req.new_tokens, req.dtype, spec.dtype, hard)
    hw = make_hardware(gpus, req.gpu_memory, req.host_memory, req.h2d_bandwidth, gpu_name=req.gpu_name,
                       detect=req.detect)
    profile = resolve_profile(req.machine, req.detect)
    profile, freshness = fresh_profile(profile, req.detect, hw, req.recheck)
    figures = figures_for(hw, profile)
    if alloc_conf is None:
        alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    knobs = load_knobs(req.config)
    loading = transformers_loading(req.transformers_version)
    inv = load_inventory(spec, req.counts)
    run_dtype, capability = _run_dtype(wl.dtype, hw)
    ctx = PlanContext(
        shape=model_shape(spec, inv, implementation(spec.raw, spec.model_type, version_tuple(loading["version"]))),
        wl=wl, hw=hw, figures=figures, knobs=knobs, config_path=config_path(knobs),
        ckpt=dataclasses.replace(find_checkpoint(spec.path, inv.num_params * wl.dtype_bytes, spec.dtype),
                                 loader=loading["loader"]), model=str(model),
        run_dtype=run_dtype, loop=req.loop, expandable="expandable_segments:true" in alloc_conf.replace(" ", "").lower(),
        context_bytes=profile.get("context_bytes") if profile is not None else None, pos_limit=pos_limit,
        hard_limit=hard, transformers=loading, hf_equality=req.hf_equality,
        bands=load_bands(profile, {"model": spec.raw, "batch": wl.batch, "prompt_len": wl.prompt_len,
                                   "new_tokens": wl.new_tokens, "gpus": hw.gpus, "dtype": wl.dtype}))
    rows, plans = {}, []
    for path in paths_for(ctx):
        row = evaluate(path, ctx)
        if row is not None:
            rows[row.name] = path
            plans.append(row)
    chosen, compared, recommendation = _recommend(plans, rows, ctx)
    found = _findings(plans, rows, chosen, ctx, spec, capability, profile, req)
    found += plan_findings.freshness_findings(profile, freshness)
    hw.profile = profile_summary(profile, figures, freshness)
    hw.alloc_conf = alloc_conf or None
    return PlanResult(_model_info(spec, inv, ctx), wl, hw, knobs, plans, recommendation, found,
                      inv.num_params * wl.dtype_bytes, loading=loading, run_dtype=run_dtype)


def _findings(plans: list, rows: dict, chosen, ctx: PlanContext, spec, capability, profile, req) -> list:
    found = plan_findings.config_findings(plans, chosen, ctx.knobs, ctx.config_path, ctx.hw, ctx.figures, profile)
    found += plan_findings.path_findings(spec, ctx.wl, ctx.hw, chosen, ctx.pos_limit, ctx.hard_limit,
                                         ctx.run_dtype, capability)
    if ctx.loop:
        found += plan_findings.loop_findings(plans)
    found += plan_findings.scale_findings(plans, ctx.hw)
    found += plan_findings.edge_findings(plans, chosen, ctx.hw, None if ctx.loop else measure_command(req, ctx.wl, ctx.hw))
    if not ctx.loop and not ctx.hf_equality:
        found += plan_findings.serving_findings(plans, chosen, serving_names(), lambda name: rows[name].launch(ctx))
        found += plan_findings.lossy_findings(plans, chosen, quantized_names())
    if not ctx.expandable:
        found += plan_findings.fragmentation_findings(plans, chosen, ctx.config_path,
                                                      lambda name: rows[name].expandable_reserved(ctx))
    found += plan_findings.moe_findings(plans, chosen, ctx.config_path, ctx.shape, ctx.wl, spec.model_type,
                                        (ctx.transformers or {}).get("version"))
    return found + plan_findings.machine_findings(profile, req.machine)


def _model_info(spec, inv, ctx: PlanContext) -> dict:
    return {"path": spec.path, "model_type": spec.model_type, "num_params": inv.num_params,
            "counted_by": inv.counted_by, "layers": spec.num_layers, "hidden_size": spec.hidden_size,
            "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tie_word_embeddings,
            "kv_bytes_per_token": sum(ctx.shape.kv_elems_per_token) * ctx.wl.dtype_bytes}


def allocated_upper(path: str, peak_bytes: int) -> int:
    """The upper figure of an allocated peak of ``path``: the peak times the archived band's worst case."""
    return Bands(archived()).for_path(path)["allocated"].upper(peak_bytes)


def generate_peak(model_config: dict, path: str, batch: int, prompt_len: int, new_tokens: int, gpus: int = 1,
                  dtype: str | None = None) -> PathMemory | None:
    """The allocated peak of ``generate`` (prefill and decode; the load left out) on ``path`` and its parts, for a
    model given by its parsed ``config.json``, without a DeepSpeed config: what ``ab`` splits a measured peak
    into. None for a path the shared memory model does not cover (or tp on one GPU)."""
    cls = by_name(path)
    if cls is None or not issubclass(cls, LayoutPath) or (path == "tp" and gpus < 2):
        return None
    spec = spec_from_config(model_config, "model_config")
    inv = load_inventory(spec, "auto")
    wl = make_workload(batch, prompt_len, new_tokens, dtype, spec.dtype)
    return allocated(cls().layout(gpus, None), model_shape(spec, inv), wl, phases=("prefill", "decode"))


def resolve_profile(machine, detect: bool):
    """The machine profile a plan uses: the one given, else this machine's cached one, else None."""
    from dsdoctor.calibrate.profile import MachineProfile, find_profile, load_profile

    if isinstance(machine, MachineProfile):
        return machine
    if machine is not None:
        return load_profile(machine)
    return find_profile() if detect else None


def fresh_profile(profile, detect: bool, hw, recheck=None) -> tuple:
    """(the profile to plan with, what its re-check found, or None without a profile). The host-bound figures
    are re-timed only on the hardware the profile describes, with a GPU visible here (or with ``recheck`` a
    measurement function); otherwise the profile is only dated."""
    if profile is None:
        return None, None
    from dsdoctor.calibrate.recheck import rechecked

    measure = recheck if callable(recheck) else None
    if recheck is None:
        measure = False
        if detect and "gpus" in hw.detected:
            from dsdoctor.calibrate.profile import fingerprint, machine_description

            measure = None if fingerprint(machine_description()) == profile.fingerprint else False
    elif recheck is False:
        measure = False
    return rechecked(profile, measure)


def profile_summary(profile, figures, freshness: dict | None = None) -> dict:
    if profile is None:
        return {"calibrated_at": None, "source": None, "assumed": figures.assumed}
    return {"calibrated_at": profile.calibrated_at, "fingerprint": profile.fingerprint, "source": profile.source,
            "assumed": figures.assumed, "freshness": freshness}
