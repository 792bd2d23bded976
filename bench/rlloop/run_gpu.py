"""Rollouts inside ZeRO-3 training: generate speed and peak with and without gathering once (issue 14).

    export PYTHONPATH=/tmp/site:$PWD/src
    python3 -m torch.distributed.run --nproc_per_node N bench/rlloop/run_gpu.py --out OUT/rlloop

A 7B-shaped Llama policy (random bf16 weights, built on the GPU) trains under ZeRO-3 (DeepSpeed
initialize, AdamW with torch's implementation) and generates its own rollouts. Per case, after one warm
iteration, each timed iteration is: generate (batch 4, prompt 512, 32 new tokens, greedy) -> a short
training step on the rollouts (backward + step), so the hooks come back and the Adam moments exist as in a
real loop. Cases:

  plain              reference: the same model without DeepSpeed, built first (before DeepSpeed replaces
                     torch.nn.functional.linear), then freed
  zero3              engine.module.generate as most loops call it: ZeRO-3 gathers every layer per token
  gathered           inside GatheredParameters(all parameters): whole weights, hooks still on every module
  gather-once        gathered + ZeRO-3's module hooks removed for the generate (DeepSpeed's own
                     unwrap_model_for_generation, trl's ds3 gather)
  gather-once+linear gather-once + plain torch.nn.functional.linear restored while generating (what
                     dsdoctor ab's gather-once variant does)
  gather-once+linear+root  also the root module's start-of-forward hook (reset_step) off: what is left
                     against plain after this is the gathered weights themselves (views into one flat
                     buffer) and generate's own work

Prints what it expects, then one JSON line per case (rank 0; also appended to OUT/results.jsonl): tokens/s
of the rollout (median of the timed generates), the generate's peak allocated/reserved GPU bytes, the time
to gather, the training step time, and whether the greedy tokens equal the zero3 case's.
``--tiny`` runs a 2-layer model (CPU with DS_ACCELERATOR=cpu, or a quick GPU check).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

CASES = ("plain", "zero3", "gathered", "gather-once", "gather-once+linear", "gather-once+linear+root")
SHAPE_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000)
SHAPE_TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256)


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


def main() -> int:  # noqa: C901,PLR0915
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--timed", type=int, default=2, help="timed iterations per case, after one warm one")
    ap.add_argument("--train-tokens", type=int, default=64, help="tokens of one rollout the training step uses")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        ap.error(f"unknown case(s): {', '.join(sorted(unknown))}")

    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers.generation.utils  # noqa: F401  (pulls in torch._dynamo before zero.Init patches Tensor.__new__)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsdoctor.trace.observer.gather_once import gathered_for_generation

    acc = get_accelerator()
    local = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = acc.device_name() == "cuda"
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(local)
    deepspeed.init_distributed()
    rank = dist.get_rank()
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SHAPE_TINY if args.tiny else SHAPE_7B
    config = AutoConfig.for_model("llama", max_position_embeddings=4096, tie_word_embeddings=False,
                                  bos_token_id=1, eos_token_id=2, **shape)  # no pad id: no padding row under zero.Init
    os.makedirs(args.out, exist_ok=True)
    n_params = None
    if rank == 0:
        log(f"rlloop bench: {world} rank(s), {'7B-shaped' if not args.tiny else 'tiny'} Llama, batch {args.batch}, "
            f"prompt {args.prompt}, {args.new_tokens} new tokens, {args.timed} timed iteration(s) per case")
        log("expect: zero3 and gathered well below plain; gather-once near plain (one all-gather per generate "
            "more); gather-once+linear closer still; the gather-once peaks higher by about the whole weights "
            "minus one shard")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def reset_peak():
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    def peaks():
        if not cuda:
            return None, None
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    prompts = torch.randint(3, shape["vocab_size"], (args.batch, args.prompt), generator=gen).to(device)
    gen_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    results = []

    def emit(row):
        row.update(rank=rank, world=world, batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens,
                   params=n_params, device=torch.cuda.get_device_name() if cuda else "cpu")
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        if rank == 0:
            merged = dict(gathered[0])
            merged["per_rank_tokens_per_s"] = [g.get("tokens_per_s") for g in gathered]
            merged["per_rank_generate_peak_allocated"] = [g.get("generate_peak_allocated") for g in gathered]
            merged["same_tokens_as_zero3_all_ranks"] = (all(g.get("same_tokens_as_zero3") for g in gathered)
                                                        if row.get("same_tokens_as_zero3") is not None else None)
            print(json.dumps(merged), flush=True)
            with open(os.path.join(args.out, "results.jsonl"), "a") as fh:
                fh.write(json.dumps(merged) + "\n")
        results.append(row)

    # ---------------------------------------------------------------- plain reference, before DeepSpeed
    if "plain" in cases:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.eval()
        n_params = sum(p.numel() for p in model.parameters())
        times, peak = [], (None, None)
        for i in range(1 + args.timed):
            sync()
            reset_peak()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompts, **gen_kwargs)
            sync()
            dt = time.perf_counter() - t0
            if i:
                times.append(dt)
                peak = max(peak, peaks(), key=lambda p: p[0] or 0)
        t = statistics.median(times)
        emit({"case": "plain", "tokens_per_s": args.batch * args.new_tokens / t, "generate_s": t,
              "generate_peak_allocated": peak[0], "generate_peak_reserved": peak[1]})
        del model, out
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    zero_cases = [c for c in cases if c != "plain"]
    if not zero_cases:
        return 0

    # ---------------------------------------------------------------- the ZeRO-3 policy in training
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "bf16": {"enabled": cuda}, "zero_allow_untested_optimizer": True,
                 # torch's AdamW, fused on CUDA: the single-tensor path would allocate a temporary as big as the
                 # flat fp32 partition (27 GB for 7B on one GPU) at every step
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "weight_decay": 0.0, "torch_adam": True,
                                                           "fused": cuda}},
                 "zero_optimization": {"stage": 3}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    with deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device=None,
                             dtype=dtype):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    policy = engine.module
    n_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in policy.parameters())
    synced = world > 1

    def contexts(case):
        if case == "gathered":
            return GatheredParameters(list(policy.parameters()))
        if case == "gather-once":
            return gathered_for_generation(engine, restore_linear=False)
        if case == "gather-once+linear":
            return gathered_for_generation(engine, restore_linear=True)
        if case == "gather-once+linear+root":
            return gathered_for_generation(engine, restore_linear=True, lift_root_hook=True)
        return contextlib.nullcontext()

    def train_step(seq):
        policy.train()
        piece = seq[:1, -args.train_tokens:]
        loss = engine(piece, labels=piece).loss
        engine.backward(loss)
        engine.step()
        policy.eval()

    # the tokens check: every case generates from the same (untrained) weights, before any step
    same, check = {}, {}
    for case in zero_cases:
        with contexts(case):
            with torch.no_grad():
                check[case] = policy.generate(prompts, synced_gpus=synced, **dict(gen_kwargs, max_new_tokens=8,
                                                                                  min_new_tokens=8)).tolist()
    for case in zero_cases:
        same[case] = check[case] == check["zero3"] if "zero3" in check else None

    for case in zero_cases:
        times, gather_times, step_times, peak = [], [], [], (None, None)
        for i in range(1 + args.timed):
            policy.eval()
            sync()
            reset_peak()
            t0 = time.perf_counter()
            ctx = contexts(case)
            with ctx:
                sync()
                t_in = time.perf_counter()
                with torch.no_grad():
                    out = policy.generate(prompts, synced_gpus=synced, **gen_kwargs)
            sync()
            t1 = time.perf_counter()
            p = peaks()
            t2 = time.perf_counter()
            train_step(out)
            sync()
            if i:
                times.append(t1 - t0)
                gather_times.append(t_in - t0)
                step_times.append(time.perf_counter() - t2)
                peak = max(peak, p, key=lambda x: x[0] or 0)
        t = statistics.median(times)
        row = {"case": case, "tokens_per_s": args.batch * args.new_tokens / t, "generate_s": t,
               "gather_s": statistics.median(gather_times), "train_step_s": statistics.median(step_times),
               "generate_peak_allocated": peak[0], "generate_peak_reserved": peak[1],
               "same_tokens_as_zero3": same.get(case)}
        emit(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
