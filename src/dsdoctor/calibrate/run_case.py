"""One run of a model shape on one load path, on this machine's first GPU: random weights from the model's
config.json, loaded as the path loads it, then two ``generate`` calls (the first run of a process, then the
steady state, as plan models them), under an allocator cap. What ``plan --measure`` runs (``plan/measure.py``)
and what bench/plan/edge_gpu.py measures, one owner for both.

    python -m dsdoctor.calibrate.run_case < JOB.json     # one JSON record on stdout's last line

A job: ``config`` (the parsed config.json), ``path`` (plain, zero3, zero3-offload), ``batch``, ``prompt_len``,
``new_tokens``, ``dtype``, ``cap_bytes`` (``torch.cuda.set_per_process_memory_fraction`` of it; none: uncapped).
The record: ``observed`` fits | oom | error, ``phase`` (build, load, warmup, timed, done), the peaks
(``max_memory_allocated`` / ``max_memory_reserved``), the allocator's retries, the memory outside the allocator,
and tokens/s of the first and the second generate. Runs on the CPU too (no peaks, no cap): the tests' way in.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

from dsdoctor.dtypes import TORCH_NAMES
from dsdoctor.proctree import free_port

PATHS = ("plain", "zero3", "zero3-offload")


def build_config(config: dict):
    """The transformers config of a parsed config.json."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[config["model_type"]].from_dict(dict(config))


def _ds_config(path: str) -> dict:
    zero: dict = {"stage": 3}
    if path == "zero3-offload":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
            "steps_per_print": 10**9}


def _one_rank(cuda: bool) -> None:
    import deepspeed

    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")


def load(model_cls, cfg, path: str, device, dtype):
    """The model on ``path``, as plan models the load: plain builds it on the GPU; zero3 under ``zero.Init`` (each
    module whole on the GPU, then partitioned; to pinned host memory with offload), then ``deepspeed.initialize``
    without an optimizer. Returns (model, engine or None)."""
    import torch

    if path == "plain":
        with torch.device(device):
            return model_cls(cfg), None
    import deepspeed

    # zero.Init partitions each module as it is built, so transformers' own initialisation (post_init) then writes
    # into empty shards: an embedding's padding row (Phi-3's pad_token_id 32000) is an IndexError there. The
    # padding index only zeroes that row at init; random weights need no init, so none is run.
    cfg = build_config(dict(cfg.to_dict(), pad_token_id=None))
    config = _ds_config(path)
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype):
        model = model_cls(cfg)
    engine = deepspeed.initialize(model=model, config=config)[0]
    return engine.module, engine


def _model_class(config: dict):
    """The transformers config and causal-LM class of a parsed config.json."""
    cfg = build_config(config)
    import transformers.generation.utils  # noqa: F401  (a lazy import inside zero.Init breaks)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return cfg, MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]


def _cap(torch, job: dict, rec: dict) -> None:
    torch.cuda.set_device(0)
    total = torch.cuda.get_device_properties(0).total_memory
    rec["device"], rec["total_bytes"] = torch.cuda.get_device_name(), total
    if job.get("cap_bytes"):
        torch.cuda.set_per_process_memory_fraction(min(job["cap_bytes"] / total, 1.0), 0)
        rec["cap_applied"] = True
    torch.cuda.reset_peak_memory_stats()


def _generate_twice(torch, model, cfg, job: dict, device, rec: dict) -> None:
    """The first generate of a process, then the steady state: their seconds and tokens/s in ``rec``."""
    B, S, T = job["batch"], job["prompt_len"], job["new_tokens"]
    ids = torch.randint(3, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    for phase in ("warmup", "timed"):
        rec["phase"] = phase
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=T, min_new_tokens=T,
                                 do_sample=False, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape == (B, S + T), out.shape
        rec[f"{phase}_s"] = time.perf_counter() - t0
    rec["first_tokens_per_s"] = B * T / rec["warmup_s"]
    rec["steady_tokens_per_s"] = B * T / rec["timed_s"]


def _peaks(torch, rec: dict) -> None:
    rec["peak_allocated"] = torch.cuda.max_memory_allocated()
    rec["peak_reserved"] = torch.cuda.max_memory_reserved()
    st = torch.cuda.memory_stats()
    rec["alloc_retries"], rec["num_ooms"] = st.get("num_alloc_retries"), st.get("num_ooms")
    free, total = torch.cuda.mem_get_info()
    rec["outside_measured"] = total - free - torch.cuda.memory_reserved()


def run(job: dict, start=None, end=None) -> dict:
    """One run of ``job`` in this process (see the module's docstring). ``start(torch)``: called after the imports
    and the cap, before the load (the bench waits for its lane there and starts the allocator's history);
    ``end(torch, record)``: after the run, before the record is returned."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path, cuda = job["path"], torch.cuda.is_available()
    rec = {"path": path, "ok": False, "observed": "error", "phase": "build", "cap_applied": False}
    if path not in PATHS:
        rec["error"] = f"--measure runs {', '.join(PATHS)} on one GPU, not {path}"
        return rec
    if path.startswith("zero3"):
        import deepspeed  # noqa: F401  (before the GPU is ours)
    dtype = getattr(torch, TORCH_NAMES.get(job.get("dtype") or "bf16", "bfloat16"))
    try:
        cfg, model_cls = _model_class(job["config"])
    except Exception as exc:  # a model transformers cannot build is an answer, said in one line
        rec["error"] = f"{type(exc).__name__}: {exc}"[:600]
        return rec
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.set_default_dtype(dtype)
    engine = None
    try:
        if cuda:
            _cap(torch, job, rec)
        if start is not None:
            start(torch)
        rec["started"] = time.time()
        rec["phase"] = "load"
        if path.startswith("zero3"):
            _one_rank(cuda)
        model, engine = load(model_cls, cfg, path, device, dtype)
        model.eval()
        _generate_twice(torch, model, cfg, job, device, rec)
        rec.update(ok=True, observed="fits", phase="done")
    except Exception as exc:  # out of memory is an answer; anything else is recorded
        oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
        rec["observed"] = "oom" if oom else "error"
        rec["error"] = f"{type(exc).__name__}: {exc}"[:600]
        if not oom:
            rec["traceback"] = traceback.format_exc()[-2000:]
    if cuda:
        _peaks(torch, rec)
    if end is not None:
        end(torch, rec)
    rec["wall_s"] = time.time() - rec.pop("started", time.time())
    if engine is not None:
        try:
            engine.destroy()
        except Exception:
            pass
    return rec


def main() -> int:
    job = json.loads(sys.stdin.read())
    print(json.dumps(run(job)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
