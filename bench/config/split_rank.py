"""One rank of the split-vs-training measurement (launched by bench/config/run.py through torchrun).

Usage: split_rank.py DS_CONFIG OUT_JSON --hidden H --layers L --inter I --heads N --kv K --vocab V --tokens T
Builds a random-weight Llama (bf16, directly on the accelerator when there is one), runs
deepspeed.initialize with DS_CONFIG, and records host RSS and accelerator memory across initialize, the
initialize time, and a short greedy generation (synced_gpus) when the config has no optimizer.
"""
import argparse
import gc
import json
import os
import time

import psutil
import torch


def main():  # noqa: PLR0915
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    for name, default in (("hidden", 2048), ("layers", 24), ("inter", 5504), ("heads", 16), ("kv", 16),
                          ("vocab", 32000), ("tokens", 16), ("prompt", 128)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    args = ap.parse_args()

    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    with open(args.config) as fh:
        ds_config = json.load(fh)
    has_optimizer = "optimizer" in ds_config
    deepspeed.init_distributed()

    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.inter,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv, vocab_size=args.vocab,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with device:
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(prev)
    n_params = sum(p.numel() for p in model.parameters())
    proc = psutil.Process()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss0 = proc.memory_info().rss
    gpu0 = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    result = {"rank": rank, "config": os.path.basename(args.config), "n_params": n_params,
              "has_optimizer": has_optimizer, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    try:
        kwargs = {"model_parameters": model.parameters()} if has_optimizer else {}
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        result["init_s"] = time.perf_counter() - t0
        gc.collect()
        result["optimizer_class"] = type(engine.optimizer).__name__
        result["rss_delta_init"] = proc.memory_info().rss - rss0
        result["gpu_alloc_after_init"] = torch.cuda.memory_allocated() if cuda else 0
        result["gpu_alloc_before_init"] = gpu0
        result["gpu_peak_init"] = torch.cuda.max_memory_allocated() if cuda else 0
        if True:  # generate with both engines: it is what the user runs the config for
            engine.module.eval()
            ids = torch.randint(3, args.vocab, (1, args.prompt), device=device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t1 = time.perf_counter()
            with torch.no_grad():
                out = engine.module.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                             do_sample=False, synced_gpus=True, pad_token_id=0)
            if cuda:
                torch.cuda.synchronize()
            result["generate_s"] = time.perf_counter() - t1
            result["new_tokens"] = int(out.shape[1] - ids.shape[1])
            result["gpu_peak_generate"] = torch.cuda.max_memory_allocated() if cuda else 0
        result["rss_peak_kib"] = __import__("resource").getrusage(__import__("resource").RUSAGE_SELF).ru_maxrss
        result["ok"] = True
    except Exception as exc:  # record, do not hide: the lead's batch goes on
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    with open(args.out + f".rank{rank}.json", "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
