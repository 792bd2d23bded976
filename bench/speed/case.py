"""One bench/speed case in its own process (a fresh CUDA caching allocator per case).

    python3 case.py --case JSON --models DIR --out RAW.jsonl [--go FILE]

Imports first, then waits until ``--go FILE`` exists (the driver creates it when the GPU is free), so the
next case's imports overlap the current case's GPU work. Then: build the model with random weights on
its path (as bench/plan/measure.py does), reset peak stats, generate twice (a warm-up, then the timed
one: tokens/s = batch x new tokens / time, prefill included), record allocated and reserved peaks over
load and both generates, then time a prefill-only generate (max_new_tokens=1). Appends one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback


def write_history(torch, raw_path: str, cid: str) -> str:
    """The allocator's recorded events as gzipped JSON lines ``[action, addr, size, stream]``, in order."""
    import gzip

    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    name = f"hist-{cid}.jsonl.gz"
    with gzip.open(os.path.join(os.path.dirname(os.path.abspath(raw_path)), name), "wt") as fh:
        for e in snap["device_traces"][0]:
            fh.write(json.dumps([e["action"], e.get("addr"), e.get("size"), e.get("stream")]) + "\n")
    return name


def main() -> int:  # noqa: C901,PLR0912,PLR0915
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--go", default=None)
    a = ap.parse_args()
    case = json.loads(a.case)
    import torch
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    zero3 = case["path"].startswith("zero3")
    cuda = torch.cuda.is_available()
    if zero3:
        import deepspeed  # noqa: F401  (import before the GPU is ours)
    cfg = AutoConfig.from_pretrained(os.path.join(a.models, case["model"]))
    # resolve the class and import generate's modules now: a lazy import inside zero.Init breaks (its tensor
    # constructor patch meets torch._dynamo's polyfills)
    import transformers.generation.utils  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    if a.go:
        while not os.path.exists(a.go):
            time.sleep(0.05)
    rec = {"id": case["id"], "case": case, "ok": False, "started": time.time()}
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16
    torch.set_default_dtype(dtype)
    B, S, T = case["batch"], case["prompt_len"], case["new_tokens"]
    try:
        if cuda:
            torch.cuda.set_device(0)
            rec["device"] = torch.cuda.get_device_name()
            torch.cuda.reset_peak_memory_stats()
            if case.get("history"):  # no stacks: only the events (action, address, size, stream)
                torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                         max_entries=5_000_000)
        t0 = time.time()
        engine = None
        if not zero3:
            with torch.device(device):
                model = model_cls(cfg)
        else:
            import deepspeed

            for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
                os.environ.setdefault(k, v)
            if "MASTER_PORT" not in os.environ:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    os.environ["MASTER_PORT"] = str(s.getsockname()[1])
            deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
            zero = {"stage": 3}
            if case["path"] == "zero3-offload":
                zero["offload_param"] = {"device": "cpu", "pin_memory": bool(case.get("pin_memory", True))}
            config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
                      "steps_per_print": 10**9}
            with deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype):
                model = model_cls(cfg)
            engine = deepspeed.initialize(model=model, config=config)[0]
            model = engine.module
        model.eval()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        rec["load_s"] = time.time() - t0
        if cuda:
            rec["load_peak_allocated"] = torch.cuda.max_memory_allocated()
            rec["load_peak_reserved"] = torch.cuda.max_memory_reserved()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, cfg.vocab_size, (B, S), generator=g).to(device)
        mask = torch.ones_like(ids)

        def gen(n):
            sync()
            t = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0)
            sync()
            assert out.shape == (B, S + n), out.shape
            return time.perf_counter() - t

        rec["warmup_s"] = gen(T)
        timed = [gen(T)]
        if case.get("repeats", 1) > 1:  # the median of several timed generates (run 4 on)
            while len(timed) < case["repeats"] and sum(timed) < 8:
                timed.append(gen(T))
        rec["timed_all_s"] = timed
        rec["timed_s"] = statistics.median(timed)
        rec["tokens_per_s"] = B * T / rec["timed_s"]
        if cuda:
            rec["peak_allocated"] = torch.cuda.max_memory_allocated()
            rec["peak_reserved"] = torch.cuda.max_memory_reserved()
            st = torch.cuda.memory_stats()
            rec["alloc_stats"] = {k: st.get(k) for k in ("num_alloc_retries", "num_ooms", "segment.all.peak",
                                                          "inactive_split_bytes.all.peak", "active_bytes.all.peak",
                                                          "num_device_alloc", "num_device_free")}
            free, total = torch.cuda.mem_get_info()
            rec["outside_allocator"] = total - free - torch.cuda.memory_reserved()
            if case.get("history"):
                rec["history_file"] = write_history(torch, a.out, case["id"])
        rec["prefill_s"] = min(gen(1), gen(1))
        rec["ok"] = True
        if engine is not None:
            try:
                engine.destroy()
            except Exception:
                pass
    except Exception as exc:  # noqa: BLE001 -- record it; the driver goes on
        rec["error"] = f"{type(exc).__name__}: {exc}"[:1500]
        rec["traceback"] = traceback.format_exc()[-2500:]
    rec["wall_s"] = time.time() - rec["started"]
    with open(a.out, "a") as fh:
        fh.write(json.dumps(rec) + "\n")
    print(f"[case] {case['id']}: ok={rec['ok']} tok/s={rec.get('tokens_per_s')} "
          f"alloc={rec.get('peak_allocated')} reserved={rec.get('peak_reserved')} {rec.get('error', '')[:200]}",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
