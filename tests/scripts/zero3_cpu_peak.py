"""Rank script: real ZeRO-3 (2 ranks, CPU accelerator) load + two generates under the CPU memory profiler.

Writes rank 0's live-byte peaks (load, generate) and the plan's prediction to the JSON file in argv[1].
On the CPU accelerator every "GPU" tensor is a CPU tensor, so the profiler's allocation events give the
same quantity torch.cuda.max_memory_allocated gives on a GPU.
"""
import gc
import json
import sys

import torch

argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
out_path, model_dir = argv[0], argv[1]
B, S, T = 4, 128, 6

import deepspeed  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import AutoConfig, LlamaForCausalLM  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
torch.set_default_dtype(torch.bfloat16)
cfg = AutoConfig.from_pretrained(model_dir)
ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
MARK = 12345
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    with deepspeed.zero.Init(config_dict_or_path=ds, dtype=torch.bfloat16):
        model = LlamaForCausalLM(cfg)
    engine = deepspeed.initialize(model=model, config=ds)[0]
    m = engine.module.eval()
    gc.collect()  # the whole copies zero.Init partitioned may sit in reference cycles until collected
    marker = torch.empty(MARK, dtype=torch.uint8)
    ids = torch.randint(3, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        with torch.no_grad():
            m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=T, min_new_tokens=T,
                       do_sample=False, pad_token_id=0, synced_gpus=True)
events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
cur = load_peak = gen_peak = after_load = 0
loading = True
for _, n in events:
    cur += n
    if loading and n == MARK:
        loading, after_load = False, cur - n
        continue
    if loading:
        load_peak = max(load_peak, cur)
    else:
        gen_peak = max(gen_peak, cur - MARK)
if rank == 0:
    from dsdoctor.plan.api import plan

    r = plan(model_dir, batch=B, prompt_len=S, new_tokens=T, dtype="bf16", gpus=2, gpu_memory="80GiB",
             detect=False)
    p = r.path("zero3")
    from dsdoctor.plan.memory import CUBLAS_WORKSPACE  # no cuBLAS on the CPU

    json.dump({"load_peak": load_peak, "after_load": after_load, "gen_peak": gen_peak,
               "predicted_peak": p.gpu_peak_bytes - CUBLAS_WORKSPACE, "breakdown": p.breakdown,
               "predicted_shards": p.breakdown.get("weights_resident", 0) + p.breakdown.get("persistent_params", 0)},
              open(out_path, "w"))
