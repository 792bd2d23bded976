"""Detectors for DSD120-DSD131: the runner and mode, init_inference configs, version-dependent behaviour,
hybrid_engine and weight_quantization. Each takes plain values and appends ``Finding``s. Torch-free."""
from __future__ import annotations

import json

from dsdoctor.config import rules_configs  # noqa: F401  (registers DSD120-DSD131)
from dsdoctor.config.effective import AUTO, Effective, _as_bool, _as_int
from dsdoctor.config.gpu import bf16_supported, this_machine_gpu
from dsdoctor.config.inference_config import InferenceSettings
from dsdoctor.config.load import LoadedConfig
from dsdoctor.config.runner import Runner, size_from_name
from dsdoctor.config.versions import (
    ACCELERATE_INT_PREFETCH, DEEPSPEED_AUTOTP_ZERO3, DEEPSPEED_PIN_FALSE_BEFORE, DEEPSPEED_PIN_TRUE_KNOWN,
    DEEPSPEED_PYDANTIC_V2, TRANSFORMERS_INT_PREFETCH, Versions,
)
from dsdoctor.errors import InputError
from dsdoctor.findings import Finding
from dsdoctor.model.spec import ModelSpec
from dsdoctor.units import human_bytes, human_count


def _true(v) -> bool:
    try:
        return _as_bool("", v)
    except InputError:
        return False


# ------------------------------------------------------------------ runner and mode

ONE_GPU_BYTES = 70 * 2**30  # bf16 weights that leave room for KV cache and activations on an 80 GiB GPU


def model_size_text(runner: Runner, spec: ModelSpec | None) -> tuple[str, str, int] | None:
    """("8.03B params, 15.0 GiB in bf16", zh, bytes) from --model, else what the model's name says."""
    if spec is not None:
        nbytes = spec.num_params * 2
        en = f"{human_count(spec.num_params)} params, {human_bytes(nbytes)} in bf16"
        return en, f"{human_count(spec.num_params)} 参数，bf16 下 {human_bytes(nbytes)}", nbytes
    size = size_from_name(runner.model)
    if size:
        nbytes = int(float(size[:-1]) * 1e9 * 2)
        gib = human_bytes(nbytes)
        return (f"{size} by its name ({runner.model}), about {gib} in bf16",
                f"按名字为 {size}（{runner.model}），bf16 下约 {gib}", nbytes)
    return None


def runner_findings(loaded: LoadedConfig, eff: Effective, runner: Runner, spec: ModelSpec | None) -> list[Finding]:
    out: list[Finding] = []
    src = loaded.source or {}
    stage = loaded.stage_from_name if loaded.ref_missing else eff.zero_stage
    if runner.hf_trainer and runner.predict_with_generate and stage == 3:
        size = model_size_text(runner, spec)
        lf = runner.name == "llamafactory"
        if lf:
            what = ("LLaMA-Factory refuses it while parsing its arguments (\"`predict_with_generate` is "
                    "incompatible with DeepSpeed ZeRO-3.\")")
            what_zh = "LLaMA-Factory 解析参数时就会拒绝（\"`predict_with_generate` is incompatible with DeepSpeed ZeRO-3.\"）"
        else:
            what = ("every rank gathers every layer for every generated token (synced_gpus), many times slower "
                    "than a plain load")
            what_zh = "每生成一个 token 每个 rank 都要 gather 每一层（synced_gpus），比直接加载慢很多倍"
        if size and size[2] > ONE_GPU_BYTES:
            gpus = -(-size[2] // ONE_GPU_BYTES)
            way_out = (f"The model ({size[0]}) needs about {gpus} GPUs for its weights: batch-generate from the saved "
                       f"model with a serving engine using tensor parallelism (vLLM/SGLang, tensor parallel size "
                       f"{gpus} or more), or predict without predict_with_generate; keep ZeRO-3 for training")
            way_out_zh = (f"模型（{size[1]}）仅权重就需要约 {gpus} 张 GPU：用支持张量并行的推理服务引擎（vLLM/SGLang，"
                          f"张量并行度 {gpus} 或以上）对保存的模型批量生成，或不用 predict_with_generate 做预测；ZeRO-3 留给训练")
        else:
            fits = (f"The model ({size[0]}) fits one GPU: " if size else "If the model fits one GPU (an 8B model is "
                    "about 15 GiB in bf16): ")
            fits_zh = (f"模型（{size[1]}）单卡放得下：" if size else "如果单卡放得下模型（8B 模型 bf16 约 15 GiB）：")
            way_out = fits + ("drop `deepspeed` from the predict run and start one replica per GPU on a shard of the "
                              "data, or batch-generate with a serving engine (vLLM, SGLang); keep ZeRO-3 for training")
            way_out_zh = fits_zh + ("预测时去掉 `deepspeed`，每张 GPU 跑一个副本处理一部分数据，或用推理服务引擎（vLLM、SGLang）"
                                    "批量生成；ZeRO-3 留给训练")
        f = Finding("DSD120", {"runner": runner.label, "mode": runner.mode, "what": what, "what_zh": what_zh,
                               "way_out": way_out, "way_out_zh": way_out_zh,
                               "model_size": size[0] if size else None})
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


def pick_dtype(gpu_name: str | None, model_dtype: str | None) -> tuple[str, str, str]:
    """(dtype for the config, note en, note zh) from the GPU: bf16 where sm >= 80, else fp16."""
    source = "--gpu-name" if gpu_name else None
    if gpu_name is None:
        gpu_name = this_machine_gpu()
        source = "this machine" if gpu_name else None
    ok = bf16_supported(gpu_name)
    if ok is True:
        return "bf16", f"bf16 because the {gpu_name} ({source}) supports it", f"用 bf16：{gpu_name}（{source}）支持"
    if ok is False:
        return ("fp16", f"fp16 because the {gpu_name} ({source}) has no bf16 (compute capability < 8.0)",
                f"用 fp16：{gpu_name}（{source}）不支持 bf16（compute capability < 8.0）")
    what = f"the GPU {gpu_name!r} is not known" if gpu_name else "no GPU was found or given"
    what_zh = f"未知的 GPU {gpu_name!r}" if gpu_name else "未找到也未指定 GPU"
    return ("bf16", f"bf16 assumed ({what}); use fp16 on GPUs older than Ampere (pass --gpu-name)",
            f"假定 bf16（{what_zh}）；Ampere 之前的 GPU 请用 fp16（传 --gpu-name）")


def init_inference_findings(settings: InferenceSettings, spec: ModelSpec | None, gpu_name: str | None) -> list[Finding]:
    out = [Finding("DSD124", {"key": k, "why": why}) for k, why in settings.invalid]
    if settings.zero:
        dtype, note, note_zh = pick_dtype(gpu_name, spec.dtype if spec else None)
        cfg = json.dumps(meant_config(settings.zero, dtype))
        out.append(Finding("DSD122", {"asked": _describe_zero(settings.zero), "config": cfg, "dtype_note": note,
                                      "dtype_note_zh": note_zh, "config_dict": meant_config(settings.zero, dtype)}))
    if not settings.dtype_set:
        md = spec.dtype if spec else None
        if md == "bf16":
            note, note_zh, sev = (f": the model ({spec.path}) is bf16, so it is cast to fp16",
                                  f"：模型（{spec.path}）是 bf16，会被转换成 fp16", None)
        elif md in ("fp16",):
            note, note_zh, sev = ": the model is fp16 already", "：模型本来就是 fp16", "info"
        else:
            note, note_zh, sev = (" (pass --model to know the model's dtype; bf16 models are cast)",
                                  "（传 --model 以获知模型精度；bf16 模型会被转换）", "info")
        want = md if md in ("bf16", "fp16", "fp32") else "bf16"
        f = Finding("DSD125", {"model_note": note, "model_note_zh": note_zh, "dtype": want,
                               "torch_dtype": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[want]})
        f.severity = sev
        out.append(f)
    return out


def top_level_zero_finding(raw: dict, eff: Effective, gpu_name: str | None, spec: ModelSpec | None) -> Finding | None:
    zero = raw.get("zero")
    if not isinstance(zero, dict) or "zero_optimization" in raw:
        return None
    dtype = eff.dtype if eff.dtype in ("bf16", "fp16") else pick_dtype(gpu_name, spec.dtype if spec else None)[0]
    fixed = {k: v for k, v in raw.items() if k != "zero"}
    fixed["zero_optimization"] = zero
    if dtype not in fixed and "bfloat16" not in fixed:
        fixed[dtype] = {"enabled": True}
    return Finding("DSD123", {"asked": _describe_zero(zero), "stage": eff.zero_stage, "config": json.dumps(fixed)})


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
            if ds < DEEPSPEED_PIN_FALSE_BEFORE:
                behaviour = "defaults it to false: offloaded tensors live in pageable memory (several times slower copies)"
                behaviour_zh = "默认为 false：卸载的张量放在可分页内存中（拷贝慢数倍）"
            else:
                behaviour = ("may default it to false (the default became true in 0.19.x, PR #8207; 0.19.8 is known "
                             "to default to true)")
                behaviour_zh = "可能默认为 false（默认值在 0.19.x 中改为 true，PR #8207；已知 0.19.8 默认为 true）"
            out.append(Finding("DSD127", {"section": section, "deepspeed": versions.label("deepspeed"),
                                          "behaviour": behaviour, "behaviour_zh": behaviour_zh}))

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


def autotp_zero3_note(versions: Versions) -> tuple[str, str]:
    """What the DeepSpeed in use does with AutoTP + ZeRO-3 (for DSD103's text)."""
    ds = versions.tuple("deepspeed")
    label = versions.label("deepspeed")
    if ds is None:
        return ("; DeepSpeed is not installed here: 0.19.4 and later accept AutoTP with ZeRO-3, older releases refuse it",
                "；此处未安装 DeepSpeed：0.19.4 及以后接受 AutoTP 与 ZeRO-3 同用，更早的版本会拒绝")
    if ds >= DEEPSPEED_AUTOTP_ZERO3:
        return (f"; DeepSpeed {label} accepts AutoTP with ZeRO-3 (since 0.19.4), so this runs, slowly",
                f"；DeepSpeed {label} 接受 AutoTP 与 ZeRO-3 同用（0.19.4 起），能运行但很慢")
    return (f"; DeepSpeed {label} refuses AutoTP with ZeRO-3 (accepted from 0.19.4, see DSD130)",
            f"；DeepSpeed {label} 拒绝 AutoTP 与 ZeRO-3 同用（0.19.4 起才接受，见 DSD130）")


# ------------------------------------------------------------------ hybrid_engine and weight_quantization

def hybrid_engine_findings(raw: dict, eff: Effective, gpus: int | None) -> list[Finding]:
    he = raw.get("hybrid_engine")
    if not isinstance(he, dict) or not _true(he.get("enabled", False)):
        return []
    problems, problems_zh, fixes, fixes_zh = [], [], [], []
    problems.append("deepspeed.initialize returns a DeepSpeedHybridEngine whose generate swaps in inference kernels "
                    "(only for model families with a DeepSpeed injection policy)")
    problems_zh.append("deepspeed.initialize 返回 DeepSpeedHybridEngine，其 generate 会换入推理 kernel（只支持 DeepSpeed "
                       "有注入策略的模型族）")
    pin = _true(he.get("pin_parameters", True)) if "pin_parameters" in he else True
    if eff.zero_stage == 3 and pin:
        problems.append("under ZeRO-3 with pin_parameters (default true) generate gathers every layer first, so the "
                        "whole model sits on each GPU during generation" +
                        (" and offload_param does not lower the generate peak" if eff.offload_param.enabled else ""))
        problems_zh.append("ZeRO-3 下 pin_parameters（默认 true）会在生成前 gather 所有层，生成期间整个模型都在每张 GPU 上" +
                           ("，offload_param 也不能降低生成峰值" if eff.offload_param.enabled else ""))
        fixes.append("inside DeepSpeed-Chat set \"pin_parameters\": false when the gathered model does not fit a GPU")
        fixes_zh.append("在 DeepSpeed-Chat 中，gather 后的模型放不下单卡时设 \"pin_parameters\": false")
    try:
        itp = _as_int("hybrid_engine.inference_tp_size", he.get("inference_tp_size", 1), minimum=1)
    except InputError:
        itp = 1
    if gpus and itp > 1 and gpus % itp:
        problems.append(f"inference_tp_size {itp} does not divide the {gpus} ranks")
        problems_zh.append(f"inference_tp_size {itp} 不能整除 {gpus} 个 rank")
        fixes.append(f"make inference_tp_size a divisor of {gpus}")
        fixes_zh.append(f"把 inference_tp_size 设为 {gpus} 的约数")
    if not fixes:
        fixes, fixes_zh = ["generate through engine.module.generate to bypass it"], ["或通过 engine.module.generate 绕过它"]
    return [Finding("DSD128", {"problems": "; ".join(problems), "problems_zh": "；".join(problems_zh),
                               "fix": "; ".join(fixes), "fix_zh": "；".join(fixes_zh)})]


WQ_FIELDS = {"enabled", "num_bits", "q_type", "q_groups", "quantized_initialization", "post_init_quant"}


def weight_quantization_findings(raw: dict, eff: Effective, runner: Runner) -> list[Finding]:
    wq = raw.get("weight_quantization")
    if wq is None:
        return []
    out = []
    if not isinstance(wq, dict):
        return [Finding("DSD114", {"key": "weight_quantization", "why": f"must be an object, not {wq!r}"})]
    for k in wq:
        if k not in WQ_FIELDS:
            out.append(Finding("DSD114", {"key": f"weight_quantization.{k}",
                                          "why": "unknown key: WeightQuantConfig forbids extra keys and raises a "
                                                 "ValidationError"}))
    qi, pq = wq.get("quantized_initialization"), wq.get("post_init_quant")
    if qi:
        bits = qi.get("num_bits", "?") if isinstance(qi, dict) else "?"
        if eff.zero_stage != 3:
            out.append(Finding("DSD129", {
                "part": "quantized_initialization",
                "problem": f"int{bits} weights are made only under zero.Init, which needs ZeRO stage 3; with stage "
                           f"{eff.zero_stage} nothing is quantized",
                "problem_zh": f"int{bits} 权重只在 zero.Init 下生成，而 zero.Init 需要 ZeRO stage 3；stage {eff.zero_stage} "
                              "下什么也不会被量化",
                "fix": "Use \"zero_optimization\": {\"stage\": 3} and build the model under HfDeepSpeedConfig(ds_config) "
                       "(created before from_pretrained) or deepspeed.zero.Init(config_dict_or_path=ds_config)",
                "fix_zh": "使用 \"zero_optimization\": {\"stage\": 3}，并在 HfDeepSpeedConfig(ds_config)（在 from_pretrained 之前创建）"
                          "或 deepspeed.zero.Init(config_dict_or_path=ds_config) 下构建模型"}))
        else:
            f = Finding("DSD129", {
                "part": "quantized_initialization",
                "problem": f"takes effect only if the model is built under zero.Init with this config (int{bits} "
                           "weights, CUDA only); deepspeed.initialize does not quantize a model that is already built",
                "problem_zh": f"只有模型在使用此配置的 zero.Init 下构建时才生效（int{bits} 权重，仅 CUDA）；"
                              "deepspeed.initialize 不会量化已经构建好的模型",
                "fix": "Create HfDeepSpeedConfig(ds_config) before from_pretrained and keep it alive (dsdoctor trace "
                       "shows whether the model reached initialize partitioned)",
                "fix_zh": "在 from_pretrained 之前创建 HfDeepSpeedConfig(ds_config) 并保持存活（dsdoctor trace 可显示模型到达 "
                          "initialize 时是否已分片）"})
            f.severity = "info"
            out.append(f)
    if pq:
        f = Finding("DSD129", {
            "part": "post_init_quant",
            "problem": "deepspeed.initialize ignores it; it acts only when the script calls "
                       "_init_group_wise_weight_quantization(model, ds_config) itself",
            "problem_zh": "deepspeed.initialize 会忽略它；只有脚本自己调用 _init_group_wise_weight_quantization(model, ds_config) "
                          "时才生效",
            "fix": "Call deepspeed.inference.quantization.quantization._init_group_wise_weight_quantization(model, "
                   "ds_config) after loading, or use quantized_initialization",
            "fix_zh": "加载后调用 deepspeed.inference.quantization.quantization._init_group_wise_weight_quantization(model, "
                      "ds_config)，或改用 quantized_initialization"})
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
