"""Pick the load path: the fastest among those that fit, by tokens/s over all GPUs.

Plain loading serves one batch per GPU (replicas), ZeRO-3 one batch per rank, tensor parallelism one
batch over all GPUs; so throughput per machine, not per rank, decides. On a tie the simpler path wins.
"""
from __future__ import annotations

import json

from dsdoctor.i18n import message_table, pick
from dsdoctor.units import human_bytes

PREFERENCE = ("plain", "tp", "zero3", "zero3-offload", "zero3-offload-nvme")


def machine_tokens_per_s(path) -> float:
    return path.tokens_per_s * path.replicas


def choose(paths: list) -> object | None:
    fitting = [p for p in paths if p.fits]
    if not fitting:
        return None
    best = max(machine_tokens_per_s(p) for p in fitting)
    close = [p for p in fitting if machine_tokens_per_s(p) >= 0.95 * best]
    return min(close, key=lambda p: preference(p.name))


def preference(name: str) -> tuple:
    """Simpler first: plain, tp over all GPUs, tp groups (larger first), ZeRO-3, then paths added later."""
    if name in PREFERENCE:
        return (PREFERENCE.index(name) if PREFERENCE.index(name) < 2 else PREFERENCE.index(name) + 1, 0)
    if name.startswith("tp") and "x" in name:
        return (2, -int(name[2:].split("x")[0]))
    return (len(PREFERENCE) + 1, name)


def dtype_section(dtype: str) -> dict:
    """The ds_config precision section for the run dtype (bf16 needs compute capability 8.0)."""
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    if dtype == "fp16":
        return {"fp16": {"enabled": True}}
    return {}


def ds_config_for(path: str, knobs=None, dtype: str = "bf16") -> dict | None:
    if not path.startswith("zero3"):
        return None
    zero = {"stage": 3}
    if knobs is not None:
        zero.update({
            "stage3_prefetch_bucket_size": knobs.prefetch_bucket_size,
            "stage3_param_persistence_threshold": knobs.param_persistence_threshold,
            "stage3_max_live_parameters": knobs.max_live_parameters,
        })
    if path == "zero3-offload":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if path == "zero3-offload-nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}
    return {**dtype_section(dtype), "zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}


def code_for(path: str, model: str, gpus: int, dtype: str, knobs=None) -> str:
    torch_dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}[dtype]
    if path == "plain":
        launch = (f"# one process per GPU, each with its own batch:\n#   torchrun --nproc_per_node {gpus} run.py\n"
                  if gpus > 1 else "")
        return (f"{launch}import os, torch\nfrom transformers import AutoModelForCausalLM\n"
                f"device = f\"cuda:{{int(os.environ.get('LOCAL_RANK', 0))}}\"\n"
                f"model = AutoModelForCausalLM.from_pretrained({model!r}, dtype={torch_dtype}, device_map=device)\n"
                f"out = model.generate(**inputs, max_new_tokens=N)\n")
    if path == "tp":
        return (f"# deepspeed --num_gpus {gpus} run.py\nimport torch, deepspeed\n"
                f"from transformers import AutoModelForCausalLM\n"
                f"model = AutoModelForCausalLM.from_pretrained({model!r}, dtype={torch_dtype})  # on the host\n"
                f"engine = deepspeed.init_inference(model, tensor_parallel={{\"tp_size\": {gpus}}}, "
                f"dtype={torch_dtype}, replace_with_kernel_inject=False)\n"
                f"out = engine.module.generate(**inputs, max_new_tokens=N)  # same inputs on every rank\n")
    cfg = json.dumps(ds_config_for(path, knobs, dtype=dtype), indent=2)
    return (f"# deepspeed --num_gpus {gpus} run.py\nimport torch, deepspeed\n"
            f"from transformers import AutoModelForCausalLM\n"
            f"from transformers.integrations import HfDeepSpeedConfig\n"
            f"ds_config = {cfg}\n"
            f"dschf = HfDeepSpeedConfig(ds_config)  # keep alive: from_pretrained loads under zero.Init\n"
            f"model = AutoModelForCausalLM.from_pretrained({model!r}, dtype={torch_dtype})\n"
            f"engine = deepspeed.initialize(model=model, config=ds_config)[0]  # no optimizer\n"
            f"engine.module.eval()\n"
            f"out = engine.module.generate(**inputs, max_new_tokens=N, synced_gpus=True)\n")


WHY = message_table("plan.recommend.WHY")  # why the recommended path, in dsdoctor/messages.json


def why(chosen, paths: list, lang: str) -> str:
    others = [p for p in paths if p is not chosen]
    fits_others = [p for p in others if p.fits]
    text = pick(WHY["fits"], lang).format(name=chosen.name, peak=human_bytes(chosen.gpu_peak_bytes),
                                           speed=machine_tokens_per_s(chosen))
    if fits_others:
        best_other = max(fits_others, key=machine_tokens_per_s)
        text += pick(WHY["next"], lang).format(name=best_other.name, speed=machine_tokens_per_s(best_other))
    unfit = [p.name for p in others if not p.fits]
    if unfit:
        text += pick(WHY["unfit"], lang).format(names=", ".join(unfit))
    return text
