"""The worker: load one model through one load path, generate greedily, record what came out.

Runs in-process (``plain``) or inside each rank started by the launcher (``launch.py``); a job file
(JSON) says what to do, and rank 0 writes the run record (JSON) that ``diff.py`` reads. Per prompt and
generated position it keeps the chosen token, the top-k logits and the logits of a fixed set of probe
token ids: small, and enough to compare logits between paths over their shared prefix.

    python -m dsdoctor.compare.runner JOB.json      # under deepspeed / torchrun, one per rank
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# load path -> what it does; the order here is the order in --help
PATHS = {
    "plain": "from_pretrained, one process, no DeepSpeed",
    "zero3": "deepspeed.initialize with ZeRO stage 3, generate(synced_gpus=True)",
    "zero3-offload": "ZeRO stage 3 with offload_param to CPU",
    "tp": "deepspeed.init_inference tensor parallel, no kernel injection",
}
MULTI_RANK = {"zero3", "zero3-offload", "tp"}
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _log(msg: str) -> None:
    print(f"[dsdoctor compare] {msg}", file=sys.stderr, flush=True)


def _device(torch, path: str):
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if path in MULTI_RANK:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if accelerator.device_name() != "cpu":
            accelerator.set_device(local_rank)  # before loading: each rank on its own GPU
            return torch.device(accelerator.device_name(local_rank))
        return torch.device("cpu")
    if os.environ.get("DS_ACCELERATOR", "") == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def _zero3_config(dtype: str, offload: bool, pin: bool) -> dict:
    zero = {"stage": 3}
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16"},
    }


def load(job: dict):
    """-> (model to call generate on, device, generate kwargs, world size)."""
    import torch
    from transformers import AutoModelForCausalLM

    path, dtype = job["path"], job["dtype"]
    torch_dtype = getattr(torch, TORCH_DTYPES[dtype])
    if torch.cuda.is_available():  # compare like with like: no TF32 shortcuts in fp32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = _device(torch, path)
    # straight onto this rank's device: ZeRO-3 and AutoTP partition from there, and a 7B model does not
    # go through host memory once per rank
    model = AutoModelForCausalLM.from_pretrained(
        job["model_dir"], dtype=torch_dtype, trust_remote_code=False, use_safetensors=True,
        device_map={"": torch.device("cpu") if path == "zero3-offload" else device},
    )
    if job.get("adapter_dir"):  # a PEFT adapter on its base model, not merged: what the adapter computes
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, job["adapter_dir"], is_trainable=False)
    model.eval()
    if path == "plain":
        return model, device, {}, 1

    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed()
    world = dist.get_world_size()
    if path in ("zero3", "zero3-offload"):
        pin = device.type == "cuda"
        engine, *_ = deepspeed.initialize(model=model, config=_zero3_config(dtype, path == "zero3-offload", pin))
        engine.module.eval()
        return engine.module, device, {"synced_gpus": True}, world
    if path == "tp":
        engine = deepspeed.init_inference(
            model, tensor_parallel={"tp_size": world}, dtype=torch_dtype, replace_with_kernel_inject=False,
        )
        return engine.module, device, {}, world
    raise ValueError(f"unknown load path {path!r}")


def generate_records(model, device, gen_kwargs: dict, job: dict) -> list[dict]:
    """Greedy generation of exactly max_new_tokens per prompt (EOS does not stop it), one prompt at a time
    so no padding enters the comparison."""
    import torch
    from transformers import GenerationConfig

    top_k = int(job.get("top_k", 8))
    probe = torch.tensor(job["probe_ids"], dtype=torch.long)
    n = int(job["max_new_tokens"])
    config = GenerationConfig(
        max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1,
        return_dict_in_generate=True, output_logits=True, pad_token_id=0,
    )
    records = []
    for ids in job["prompts"]:
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                **gen_kwargs,
            )
        tokens = out.sequences[0, len(ids):].tolist()
        steps = []
        for logits in out.logits:  # one [1, vocab] tensor per generated position
            row = logits[0].float().cpu()
            values, index = torch.topk(row, min(top_k, row.numel()))
            steps.append({
                "top_ids": index.tolist(),
                "top_logits": [round(v, 6) for v in values.tolist()],
                "probe_logits": [round(v, 6) for v in row[probe].tolist()],
            })
        records.append({"input_ids": list(ids), "tokens": tokens, "steps": steps})
    return records


def run_job(job: dict) -> dict | None:
    """Load, generate, return the run record (None on ranks other than 0)."""
    import torch

    if job.get("quiet"):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, device, gen_kwargs, world = load(job)
    t1 = time.perf_counter()
    if not job.get("quiet"):
        _log(f"{job['path']}: loaded on {device} x{world} in {t1 - t0:.1f}s, generating")
    records = generate_records(model, device, gen_kwargs, job)
    t2 = time.perf_counter()
    rank = int(os.environ.get("RANK", 0))
    if rank != 0:
        return None
    return {
        "path": job["path"],
        "model_dir": str(job["model_dir"]),
        "dtype": job["dtype"],
        "world_size": world,
        "device": device.type,
        "load_seconds": round(t1 - t0, 3),
        "generate_seconds": round(t2 - t1, 3),
        "probe_ids": list(job["probe_ids"]),
        "versions": _versions(),
        "prompts": records,
    }


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "deepspeed"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="dsdoctor compare worker (one rank)")
    parser.add_argument("job", help="job file (JSON) written by dsdoctor compare")
    args, _unknown = parser.parse_known_args(argv)  # the deepspeed launcher adds --local_rank
    from dsdoctor import door

    job = door.read_json(args.job, door.COMPARE_JOB)
    record = run_job(job)
    if record is not None:
        out = door.write_record(job["out"], json.dumps(record))
        if not job.get("quiet"):
            _log(f"{job['path']}: wrote {out}")
    try:  # leave the process group cleanly so the launcher sees exit 0 on every rank
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
