"""One rank of the bench: load each case's model on its path, generate twice, record the real peak.

Launched by bench/plan/run.py as ``python3 -m torch.distributed.run --nproc_per_node N measure.py ...``.
For each case: free everything, reset peak stats, load (see LOAD below), run ``generate`` twice with the
workload (the first records ZeRO-3's trace; the second prefetches, as every later call does), and record
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over all of it, host RSS, and the time per
token of the second generate. One JSON line per case (rank 0 writes, holding every rank's numbers).

LOAD, per path (random weights, bf16 default dtype, built directly on the device):
  plain          the model is built on this rank's GPU.
  tp             built on the host without initialisation (meta, then to_empty), then
                 deepspeed.init_inference(tensor_parallel={"tp_size": N}, dtype=bf16,
                 replace_with_kernel_inject=False) slices it onto the GPUs.
  zero3          built under deepspeed.zero.Init (each module whole on the GPU, then partitioned), then
                 deepspeed.initialize(model, config) without optimizer: ZeRO-Inference.
  zero3-offload  the same with offload_param {"device": "cpu", "pin_memory": true}.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
import traceback


def ds_config(path: str) -> dict:
    zero = {"stage": 3}
    if path == "zero3-offload":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def main() -> int:  # noqa: C901,PLR0912,PLR0915
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True, help="JSON list of cases (bench/plan/cases.py shape)")
    ap.add_argument("--models", required=True, help="directory with <model>/config.json")
    ap.add_argument("--out", required=True, help="JSON-lines file rank 0 appends to")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if cuda:
        torch.cuda.set_device(local_rank)
    import deepspeed
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16
    torch.set_default_dtype(dtype)
    cases = json.load(open(args.cases))

    def log(msg):
        if rank == 0:
            print(f"[measure w{world}] {msg}", file=sys.stderr, flush=True)

    def clean():
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
            if hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()
            torch.cuda.reset_peak_memory_stats()

    for case in cases:
        cfg = AutoConfig.from_pretrained(os.path.join(args.models, case["model"]))
        path, B, S, T = case["path"], case["batch"], case["prompt_len"], case["new_tokens"]
        rec = {"id": case["id"], "case": case, "world": world, "device": torch.cuda.get_device_name() if cuda else "cpu"}
        model = engine = None
        clean()
        rec["allocated_at_start"] = torch.cuda.memory_allocated() if cuda else None
        log(f"{case['id']}: load")
        t0 = time.time()
        try:
            if path == "plain":
                with torch.device(device):
                    model = LlamaForCausalLM(cfg)
            elif path == "tp":
                # bf16 AutoTP segfaults on the CPU accelerator (shared/FACTS.md); CPU runs check the flow in fp32
                tp_dtype = dtype if cuda else torch.float32
                with torch.device("meta"):
                    model = LlamaForCausalLM(cfg)
                model = model.to_empty(device="cpu").to(tp_dtype)
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()
                engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=tp_dtype,
                                                  replace_with_kernel_inject=False)
                model = engine.module
            else:
                config = ds_config(path)
                with deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype):
                    model = LlamaForCausalLM(cfg)
                engine = deepspeed.initialize(model=model, config=config)[0]
                model = engine.module
            model.eval()
            if cuda:
                torch.cuda.synchronize()
                rec["load_peak_allocated"] = torch.cuda.max_memory_allocated()
            rec["load_s"] = time.time() - t0
            rec["rss_after_load"] = rss()
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(3, cfg.vocab_size, (B, S), generator=g).to(device)
            mask = torch.ones_like(ids)
            kw = dict(max_new_tokens=T, min_new_tokens=T, do_sample=False, pad_token_id=0,
                      synced_gpus=path.startswith("zero3") and world > 1)
            times = []
            for _ in range(2):  # the first generate records ZeRO-3's trace; the second prefetches
                if cuda:
                    torch.cuda.synchronize()
                t1 = time.time()
                with torch.no_grad():
                    out = model.generate(input_ids=ids, attention_mask=mask, **kw)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.time() - t1)
                assert out.shape == (B, S + T), out.shape
                del out
            rec["generate_s"] = times
            rec["tokens_per_s"] = B * T / times[-1]
            if cuda:
                rec["peak_allocated"] = torch.cuda.max_memory_allocated()
                rec["peak_reserved"] = torch.cuda.max_memory_reserved()
            rec["rss_after_generate"] = rss()
            rec["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            rec["ok"] = True
        except Exception as exc:  # record and go on: one failing case must not lose the others
            rec["ok"] = False
            rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            rec["traceback"] = traceback.format_exc()[-3000:]
            log(f"{case['id']}: FAILED {rec['error'][:300]}")
        finally:
            if engine is not None and hasattr(engine, "destroy"):
                try:
                    engine.destroy()
                except Exception:
                    pass
            del model, engine
            clean()
        gathered = [None] * world
        dist.all_gather_object(gathered, rec)
        if rank == 0:
            keys = ("allocated_at_start", "peak_allocated", "peak_reserved", "load_peak_allocated", "rss_after_load",
                    "rss_after_generate",                     "tokens_per_s", "ok", "error")
            merged = dict(rec, ranks=[{k: r.get(k) for k in keys} for r in gathered])
            merged["ok"] = all(r.get("ok") for r in gathered)
            with open(args.out, "a") as f:
                f.write(json.dumps(merged) + "\n")
            log(f"{case['id']}: peak {rec.get('peak_allocated')} tokens/s {rec.get('tokens_per_s')}")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
