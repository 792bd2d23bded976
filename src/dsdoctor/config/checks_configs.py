"""Detectors for DSD120-DSD131: the runner and mode, init_inference configs, version-dependent behaviour,
hybrid_engine and weight_quantization. Each takes plain values and appends ``Finding``s. Torch-free."""
from __future__ import annotations

import json

from dsdoctor.config.effective import AUTO, Effective, _as_bool, _as_int
from dsdoctor.config.inference_config import InferenceSettings
from dsdoctor.config.load import LoadedConfig
from dsdoctor.config.runner import Runner, size_from_name
from dsdoctor.config.schema import check_section, unknown
from dsdoctor.config.versions import (
    ACCELERATE_INT_PREFETCH,
    DEEPSPEED_AUTOTP_ZERO3,
    DEEPSPEED_PIN_FALSE_BEFORE,
    DEEPSPEED_PIN_TRUE_KNOWN,
    DEEPSPEED_PYDANTIC_V2,
    TRANSFORMERS_INT_PREFETCH,
    Versions,
)
from dsdoctor.dtypes import TORCH_NAMES
from dsdoctor.errors import InputError
from dsdoctor.findings import Finding, Phrase
from dsdoctor.gpus import gpu_facts
from dsdoctor.machine import this_machine_gpu
from dsdoctor.model.moe import gather_values, hang_risk, hang_values
from dsdoctor.model.spec import ModelSpec
from dsdoctor.units import human_bytes, human_count


def _true(v) -> bool:
    try:
        return _as_bool("", v)
    except InputError:
        return False


# ------------------------------------------------------------------ runner and mode

ONE_GPU_BYTES = 70 * 2**30  # bf16 weights that leave room for KV cache and activations on an 80 GiB GPU


def way_out_phrase(runner: Runner, spec: ModelSpec | None) -> Phrase:
    """DSD120's way out, sized by --model or by the model's name: replicas when one GPU holds the weights,
    tensor-parallel serving when it does not."""
    if spec is not None:
        nbytes = spec.num_params * 2
        size = Phrase("size-model", {"params": human_count(spec.num_params), "bytes": human_bytes(nbytes)})
    elif size_from_name(runner.model):
        name_size = size_from_name(runner.model)
        nbytes = int(float(name_size[:-1]) * 1e9 * 2)
        size = Phrase("size-name", {"size": name_size, "name": runner.model, "bytes": human_bytes(nbytes)})
    else:
        return Phrase("way-out", {"fits": Phrase("fits-unknown")})
    if nbytes > ONE_GPU_BYTES:
        return Phrase("way-out-tp", {"size": size, "gpus": -(-nbytes // ONE_GPU_BYTES)})
    return Phrase("way-out", {"fits": Phrase("fits", {"size": size})})


def runner_findings(loaded: LoadedConfig, eff: Effective, runner: Runner, spec: ModelSpec | None) -> list[Finding]:
    out: list[Finding] = []
    src = loaded.source or {}
    stage = loaded.stage_from_name if loaded.ref_missing else eff.zero_stage
    if runner.hf_trainer and runner.predict_with_generate and stage == 3:
        lf = runner.name == "llamafactory"
        f = Finding("DSD120", {"runner": runner.label, "mode": runner.mode,
                               "what": Phrase("refused" if lf else "slow"),
                               "way_out": way_out_phrase(runner, spec)})
        if not lf:
            f.severity = "warning"
        out.append(f)
    if runner.hf_trainer and runner.mode in ("eval", "predict", "predict-with-generate") and stage is not None \
            and stage != 3 and runner.mode_source != "--mode":
        out.append(Finding("DSD121", {"runner": runner.label, "mode": runner.mode, "stage": stage}))
    if runner.name == "llamafactory" and _true(src.get("pure_bf16")) and stage == 3:
        out.append(Finding("DSD131", {}))
    return out


# ------------------------------------------------------------------ init_inference and the ignored zero

def _describe_zero(zero: dict) -> str:
    parts = [f"stage {zero.get('stage', 0)}"]
    for sec in ("offload_param", "offload_optimizer"):
        s = zero.get(sec)
        if isinstance(s, dict) and s.get("device") not in (None, "none", AUTO):
            parts.append(f"{sec} {s['device']}")
    return ", ".join(parts)


def meant_config(zero: dict, dtype: str) -> dict:
    """The deepspeed.initialize config that does what a misplaced zero section asked for (stage 3 and its
    offload_param; nothing of the optimizer side)."""
    z = {"stage": 3}
    op = zero.get("offload_param")
    if isinstance(op, dict) and op.get("device") in ("cpu", "nvme"):
        z["offload_param"] = {k: v for k, v in op.items() if k in ("device", "nvme_path", "pin_memory")}
        z["offload_param"].setdefault("pin_memory", True)
    return {dtype: {"enabled": True}, "zero_optimization": z, "train_micro_batch_size_per_gpu": 1}


def pick_dtype(gpu_name: str | None) -> tuple[str, Phrase]:
    """(dtype for the config, why) from the GPU: bf16 where sm >= 80, else fp16."""
    source = "--gpu-name" if gpu_name else None
    if gpu_name is None:
        gpu_name = this_machine_gpu()
        source = "nvidia-smi" if gpu_name else None
    ok = gpu_facts(gpu_name).bf16
    if ok is True:
        return "bf16", Phrase("bf16-gpu", {"gpu": gpu_name, "source": source})
    if ok is False:
        return "fp16", Phrase("fp16-gpu", {"gpu": gpu_name, "source": source})
    if gpu_name:
        return "bf16", Phrase("bf16-unknown-gpu", {"gpu": gpu_name})
    return "bf16", Phrase("bf16-no-gpu")


def init_inference_findings(settings: InferenceSettings, spec: ModelSpec | None, gpu_name: str | None) -> list[Finding]:
    out = [Finding("DSD124", {"key": k, "why": why}) for k, why in settings.invalid]
    if settings.zero:
        dtype, note = pick_dtype(gpu_name)
        cfg = json.dumps(meant_config(settings.zero, dtype))
        section = Phrase("in-args", {"key": settings.zero_source}) if settings.zero_source in ("args", "config") \
            else Phrase("in-zero")
        out.append(Finding("DSD122", {"section": section, "asked": _describe_zero(settings.zero), "config": cfg,
                                      "dtype_note": note, "config_dict": meant_config(settings.zero, dtype)}))
    if not settings.dtype_set:
        md = spec.dtype if spec else None
        if md == "bf16":
            note, sev = Phrase("model-bf16", {"model": spec.path}), None
        elif md == "fp16":
            note, sev = Phrase("model-fp16"), "info"
        else:
            note, sev = Phrase("model-unknown"), "info"
        want = md if md in ("bf16", "fp16", "fp32") else "bf16"
        f = Finding("DSD125", {"model_note": note, "dtype": want,
                               "torch_dtype": TORCH_NAMES[want]})
        f.severity = sev
        out.append(f)
    return out


def top_level_zero_finding(raw: dict, eff: Effective, gpu_name: str | None, spec: ModelSpec | None) -> Finding | None:
    zero = raw.get("zero")
    if not isinstance(zero, dict) or "zero_optimization" in raw:
        return None
    dtype = eff.dtype if eff.dtype in ("bf16", "fp16") else pick_dtype(gpu_name)[0]
    fixed = {k: v for k, v in raw.items() if k != "zero"}
    fixed["zero_optimization"] = zero
    if dtype not in fixed and "bfloat16" not in fixed:
        fixed[dtype] = {"enabled": True}
    return Finding("DSD123", {"asked": _describe_zero(zero), "stage": eff.zero_stage, "config": json.dumps(fixed)})


# ------------------------------------------------------------------ mixtures of experts

def moe_findings(raw: dict, eff: Effective, spec: ModelSpec | None, versions: Versions, inference: bool,
                 elem_bytes: int) -> list[Finding]:
    """DSD117 (a ZeRO-3 inference forward gathers every expert) and DSD118 (ranks gather different experts: the
    hang of one-module-per-expert blocks that DeepSpeed does not make leaves by itself, and the leaf-module fix)."""
    if spec is None or spec.moe is None or eff.zero_stage != 3:
        return []
    out = []
    if inference:
        out.append(Finding("DSD117", gather_values(spec.model_type, spec.moe, spec.num_params, spec.active_params,
                                                   elem_bytes)))
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
    leaf = zero.get("leaf_module") if isinstance(zero.get("leaf_module"), dict) else {}
    classes = leaf.get("classes")
    classes = [classes] if isinstance(classes, str) else classes if isinstance(classes, list) else None
    if hang_risk(spec.moe, spec.model_type, versions.tuple("transformers"), versions.tuple("deepspeed"), classes):
        out.append(Finding("DSD118", hang_values(spec.model_type, versions.label("transformers"))))
    return out


# ------------------------------------------------------------------ versions

def version_findings(raw: dict, eff: Effective, runner: Runner, versions: Versions, spec: ModelSpec | None,
                     tp: int | None) -> list[Finding]:
    out: list[Finding] = []
    ds = versions.tuple("deepspeed")
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}

    # DSD126: the float 0.9*h*h
    prefetch = zero.get("stage3_prefetch_bucket_size", zero.get("prefetch_bucket_size"))
    if runner.fills_auto and prefetch == AUTO and eff.zero_stage == 3 and ds and ds >= DEEPSPEED_PYDANTIC_V2:
        tf, acc = versions.tuple("transformers"), versions.tuple("accelerate")
        old_tf = tf is not None and tf < TRANSFORMERS_INT_PREFETCH
        old_acc = acc is not None and acc < ACCELERATE_INT_PREFETCH
        if runner.hf_trainer:
            bad, filler = old_tf, f"transformers {versions.get('transformers')}"
        else:  # accelerate: the Trainer fills it when the script uses one, else accelerate's own fill
            bad = old_tf or old_acc
            filler = " or ".join(f"{n} {versions.get(n)}" for n, old in (("transformers", old_tf),
                                                                          ("accelerate", old_acc)) if old)
        value, suggested = "", "<int(0.9*hidden_size**2)>"
        if spec is not None:
            h = spec.hidden_size
            v = 0.9 * h * h
            if float(v).is_integer():
                bad = False  # a whole float passes pydantic's lax int
            value, suggested = f" ({v!r} for hidden_size {h})", str(int(v))
        if bad:
            out.append(Finding("DSD126", {"transformers": versions.label("transformers"),
                                          "deepspeed": versions.label("deepspeed"), "filler": filler,
                                          "value": value, "suggested": suggested}))

    # DSD127: pin_memory default by version
    if ds is not None and ds < DEEPSPEED_PIN_TRUE_KNOWN:
        for section, off in (("offload_param", eff.offload_param), ("offload_optimizer", eff.offload_optimizer)):
            if not off.enabled or off.values.get("pin_memory") is None or off.values["pin_memory"].state != "unset":
                continue
            if section == "offload_param" and eff.zero_stage < 3:
                continue
            if section == "offload_optimizer" and (runner.inference and not runner.hf_trainer) and not eff.has_optimizer:
                continue
            behaviour = Phrase("false" if ds < DEEPSPEED_PIN_FALSE_BEFORE else "maybe-false")
            out.append(Finding("DSD127", {"section": section, "deepspeed": versions.label("deepspeed"),
                                          "behaviour": behaviour}))

    # DSD130: AutoTP + ZeRO-3 before 0.19.4
    tpc = raw.get("tensor_parallel") if isinstance(raw.get("tensor_parallel"), dict) else {}
    autotp = tpc.get("autotp_size")
    if eff.zero_stage == 3 and ds is not None and ds < DEEPSPEED_AUTOTP_ZERO3 and autotp not in (None, AUTO):
        try:
            size = _as_int("tensor_parallel.autotp_size", autotp)
        except InputError:
            size = 0
        if size > 1:
            out.append(Finding("DSD130", {"source": "tensor_parallel.autotp_size", "tp_size": size,
                                          "deepspeed": versions.label("deepspeed")}))
    return out


def autotp_zero3_note(versions: Versions) -> Phrase:
    """What the DeepSpeed in use does with AutoTP + ZeRO-3 (DSD103's version_note)."""
    ds = versions.tuple("deepspeed")
    if ds is None:
        return Phrase("not-installed")
    return Phrase("accepts" if ds >= DEEPSPEED_AUTOTP_ZERO3 else "refuses", {"version": versions.label("deepspeed")})


# ------------------------------------------------------------------ hybrid_engine and weight_quantization

def hybrid_engine_findings(raw: dict, eff: Effective, gpus: int | None) -> list[Finding]:
    he = raw.get("hybrid_engine")
    if not isinstance(he, dict) or not _true(he.get("enabled", False)):
        return []
    problems, fixes = [Phrase("engine")], []
    pin = _true(he.get("pin_parameters", True)) if "pin_parameters" in he else True
    if eff.zero_stage == 3 and pin:
        problems.append(Phrase("gathers-all-offload" if eff.offload_param.enabled else "gathers-all"))
        fixes.append(Phrase("unpin"))
    try:
        itp = _as_int("hybrid_engine.inference_tp_size", he.get("inference_tp_size", 1), minimum=1)
    except InputError:
        itp = 1
    if gpus and itp > 1 and gpus % itp:
        problems.append(Phrase("tp-divides", {"tp": itp, "gpus": gpus}))
        fixes.append(Phrase("tp-divisor", {"gpus": gpus}))
    if not fixes:
        fixes = [Phrase("bypass")]
    return [Finding("DSD128", {"problems": Phrase.join("and", problems), "fix": Phrase.join("and", fixes)})]


def weight_quantization_findings(raw: dict, eff: Effective, runner: Runner) -> list[Finding]:
    wq = raw.get("weight_quantization")
    if wq is None:
        return []
    out = []
    if not isinstance(wq, dict):
        return [Finding("DSD114", {"key": "weight_quantization", "why": f"must be an object, not {wq!r}"})]
    for key, why in unknown(check_section(wq, "weight_quantization", "weight_quantization.")[0]):
        out.append(Finding("DSD114", {"key": key, "why": why}))
    qi, pq = wq.get("quantized_initialization"), wq.get("post_init_quant")
    if qi:
        bits = qi.get("num_bits", "?") if isinstance(qi, dict) else "?"
        if eff.zero_stage != 3:
            out.append(Finding("DSD129", {"part": "quantized_initialization",
                                          "problem": Phrase("needs-stage3", {"bits": bits, "stage": eff.zero_stage}),
                                          "fix": Phrase("use-stage3")}))
        else:
            f = Finding("DSD129", {"part": "quantized_initialization", "problem": Phrase("zero-init-only", {"bits": bits}),
                                   "fix": Phrase("hf-config-first")})
            f.severity = "info"
            out.append(f)
    if pq:
        f = Finding("DSD129", {"part": "post_init_quant", "problem": Phrase("post-init-ignored"),
                               "fix": Phrase("call-post-init")})
        f.severity = "info"
        out.append(f)
    return out


def inference_sections(raw: dict) -> dict:
    """hybrid_engine and weight_quantization as DeepSpeed reads them (defaults from runtime/config.py)."""
    out = {}
    he = raw.get("hybrid_engine")
    if isinstance(he, dict):
        try:
            tp = _as_int("hybrid_engine.inference_tp_size", he.get("inference_tp_size", 1), minimum=1)
        except InputError:
            tp = None
        out["hybrid_engine"] = {"enabled": _true(he.get("enabled", False)),
                                "pin_parameters": _true(he["pin_parameters"]) if "pin_parameters" in he else True,
                                "inference_tp_size": tp}
    wq = raw.get("weight_quantization")
    if isinstance(wq, dict):
        qi = wq.get("quantized_initialization")
        out["weight_quantization"] = {
            "quantized_initialization": bool(qi), "post_init_quant": bool(wq.get("post_init_quant")),
            "num_bits": qi.get("num_bits", 8) if isinstance(qi, dict) else None}
    return out
