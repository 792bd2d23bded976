"""A 2-model RL job on one GPU, rollout under each arrangement, against ``dsdoctor plan --loop`` (issue 23).

    export PYTHONPATH=/tmp/site:$PWD/src
    python3 bench/rlloop/job_gpu.py --out OUT/rljob [--budget-s 330] [--tiny]

The job: a 1.5B actor (Qwen2-1.5B-shaped, random bf16 weights built on the GPU under ``zero.Init``) trained
with DeepSpeed and AdamW (torch's, fused on CUDA), and a frozen reference copy. Each iteration is PPO-shaped:

  rollout     the actor generates ``batch`` sequences of ``prompt`` + ``new`` tokens (greedy, fixed length)
  experience  the reference and the actor score the rollouts (no grad), ``exp_batch`` sequences at a time
  train       the actor trains on them, micro-batches of ``train_batch`` (a log-prob loss), one optimizer step

Arrangements (one process each, so that one's DeepSpeed patches and allocator state do not leak into the next):

  zero3-generate     actor ZeRO-3, reference ZeRO-3; HF generate on the training module (per-module hooks)
  zero3-gather-once  actor ZeRO-3 with DeepSpeed's unwrap_model_for_generation around generate; reference ZeRO-3
  zero2-generate     actor ZeRO-2 (whole weights), reference ZeRO-0 (whole); HF generate
  zero3-ref-offload  as zero3-gather-once with the reference's parameters offloaded (offload_param cpu)

Per arrangement, after one warm iteration (it creates the Adam moments), ``--timed`` iterations: each phase's
``max_memory_allocated``/``max_memory_reserved`` (reset before the phase) and seconds. Before measuring, the
parent process asks dsdoctor's planner (``plan.loop_job.evaluate_arrangement``) for the same job and
arrangement, so every JSON line (stdout and ``OUT/results.jsonl``) holds predicted beside measured.
The script stops starting arrangements once ``--budget-s`` is spent. ``--tiny``: a 2-layer model (CPU with
DS_ACCELERATOR=cpu, gloo). ``--case NAME`` runs one arrangement in this process (what the parent launches).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

CASES = {
    "zero3-generate": {"actor": (3, False), "reference": (3, False), "engine": "generate"},
    "zero3-gather-once": {"actor": (3, False), "reference": (3, False), "engine": "gather-once"},
    "zero2-generate": {"actor": (2, False), "reference": (0, False), "engine": "generate"},
    "zero3-ref-offload": {"actor": (3, False), "reference": (3, True), "engine": "gather-once"},
}
SHAPE = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960,
             num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
             max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6, torch_dtype="bfloat16",
             bos_token_id=1, eos_token_id=2)
TINY = dict(SHAPE, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the prediction (parent, no GPU needed)

def predict(args, shape: dict, case: str, gpu_memory: str, gpu_name: str | None) -> dict:
    from dsdoctor.config import rl
    from dsdoctor.plan.loop_job import evaluate_arrangement

    spec = CASES[case]
    path = os.path.join(args.out, "actor_config.json")
    with open(path, "w") as fh:
        json.dump(shape, fh)
    job = rl.RlJob([rl.RlModel("actor", path, True, spec["actor"][0]),
                    rl.RlModel("reference", path, False, spec["reference"][0], spec["reference"][1])],
                   batch=args.batch, prompt_len=args.prompt, new_tokens=args.new_tokens,
                   train_batch=args.train_batch, experience_batch=args.exp_batch, dtype="bf16" if not args.tiny
                   else "fp32", gpus=1, engine=rl.Engine(spec["engine"]))
    r = evaluate_arrangement(job, gpu_memory=gpu_memory, gpu_name=gpu_name, host_memory="128GiB", detect=False,
                             counts="formula")
    return {"phases": {p.name: p.total for p in r.phases}, "peak_phase": r.peak.name, "need": r.gpu_need_bytes,
            "seconds": r.seconds, "fits": r.fits}


# ------------------------------------------------------------------ one arrangement (child)

def run_case(args) -> dict:  # noqa: C901, PLR0915 (the GPU driver as it ran)
    import deepspeed
    import torch
    import transformers.generation.utils  # noqa: F401  (torch._dynamo before zero.Init patches Tensor.__new__)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = CASES[args.case]
    acc = get_accelerator()
    cuda = acc.device_name() == "cuda"
    device = torch.device("cuda:0") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    deepspeed.init_distributed()
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = dict(TINY if args.tiny else SHAPE)
    config = AutoConfig.for_model(**{k: v for k, v in shape.items() if k not in ("architectures", "torch_dtype")})
    prec = {"bf16": {"enabled": True}} if cuda else {}

    def ds_config(stage, offload_param, trainable):
        zero = {"stage": stage}
        if offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        cfg = {**prec, "zero_optimization": zero, "train_micro_batch_size_per_gpu": args.train_batch,
               "gradient_accumulation_steps": max(args.batch // args.train_batch, 1), "steps_per_print": 10**9}
        if trainable:
            cfg.update({"zero_allow_untested_optimizer": True, "gradient_clipping": 1.0,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "weight_decay": 0.0,
                                                                  "torch_adam": True, "fused": cuda}}})
        return cfg

    def build(stage, offload_param, trainable):
        cfg = ds_config(stage, offload_param, trainable)
        if stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=dtype):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if trainable:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        else:
            model.requires_grad_(False)
            engine, *_ = deepspeed.initialize(model=model, config=cfg)
        return engine

    actor = build(*spec["actor"], True)
    ref = build(*spec["reference"], False)
    ref.module.eval()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def phase(name, fn, into):
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        sync()
        into[name] = {"s": time.perf_counter() - t0,
                      "allocated": torch.cuda.max_memory_allocated() if cuda else None,
                      "reserved": torch.cuda.max_memory_reserved() if cuda else None}
        return out

    gen = torch.Generator(device="cpu").manual_seed(1234)
    prompts = torch.randint(3, shape["vocab_size"], (args.batch, args.prompt), generator=gen).to(device)
    gen_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      eos_token_id=None, pad_token_id=0, use_cache=True)

    def rollout():
        actor.module.eval()
        with torch.no_grad():
            if spec["engine"] == "gather-once":
                with unwrap_model_for_generation(actor):
                    return actor.module.generate(prompts, **gen_kwargs)
            return actor.module.generate(prompts, **gen_kwargs)

    def logprobs(engine, seq):
        logits = engine(seq).logits[:, :-1].float()
        return torch.gather(logits.log_softmax(-1), 2, seq[:, 1:, None]).squeeze(-1)

    def experience(seq):
        out = []
        with torch.no_grad():
            for i in range(0, seq.shape[0], args.exp_batch):
                part = seq[i:i + args.exp_batch]
                out.append((logprobs(ref, part), logprobs(actor, part)))
        return out

    def train(seq, exp):
        actor.module.train()
        for i in range(0, seq.shape[0], args.train_batch):
            part = seq[i:i + args.train_batch]
            ref_lp = exp[i // args.exp_batch][0][(i % args.exp_batch):(i % args.exp_batch) + args.train_batch]
            lp = logprobs(actor, part)
            loss = -(lp - 0.05 * (lp - ref_lp)).mean()  # a PPO-shaped objective: log-probs with a KL term
            actor.backward(loss)
            actor.step()

    iterations = []
    for it in range(1 + args.timed):
        rec: dict = {}
        seq = phase("rollout", rollout, rec)
        exp = phase("experience", lambda seq=seq: experience(seq), rec)
        phase("train", lambda seq=seq, exp=exp: train(seq, exp), rec)
        if it:
            iterations.append(rec)
        log(f"{args.case} iteration {it}: " + ", ".join(f"{k} {v['s']:.2f}s" for k, v in rec.items()))
    out = {"case": args.case, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "params": sum(int(getattr(p, "ds_numel", p.numel())) for p in actor.module.parameters())}
    for name in ("rollout", "experience", "train"):
        out[name] = {"s": statistics.median(r[name]["s"] for r in iterations),
                     "allocated": max((r[name]["allocated"] or 0) for r in iterations) or None,
                     "reserved": max((r[name]["reserved"] or 0) for r in iterations) or None}
    out["rollout_tokens_per_s"] = args.batch * args.new_tokens / out["rollout"]["s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--exp-batch", type=int, default=4)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--timed", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=330.0)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--gpu-memory", default="140GiB", help="for the prediction (H200: 139.8 GiB usable)")
    ap.add_argument("--gpu-name", default="H200")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.case:
        print(json.dumps(run_case(args)), flush=True)
        return 0
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        ap.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    shape = TINY if args.tiny else SHAPE
    log(f"rl job bench: 1.5B-shaped actor (trained) + frozen reference{' (tiny)' if args.tiny else ''}, batch "
        f"{args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens; cases: {', '.join(cases)}")
    log("expect: zero3-generate's rollout several times slower than the others (ZeRO-3's per-module hooks on "
        "every token); gather-once and zero2 near plain speed; the gather-once rollout peak higher by the whole "
        "weights; the reference offload lowering every phase by the reference's weights")
    start = time.perf_counter()
    for case in cases:
        if time.perf_counter() - start > args.budget_s:
            log(f"budget spent: {case} not run")
            continue
        row = {"case": case, "predicted": predict(args, shape, case, args.gpu_memory, args.gpu_name)}
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cmd = [sys.executable, __file__, "--out", args.out, "--case", case] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k in ("batch", "prompt", "new_tokens", "exp_batch", "train_batch", "timed")] + (
            ["--tiny"] if args.tiny else [])
        left = max(args.budget_s - (time.perf_counter() - start), 30)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left + 60)
            sys.stderr.write(proc.stderr[-3000:])
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode == 0 and lines:
                row["measured"] = json.loads(lines[-1])
            else:
                row["error"] = f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
        except subprocess.TimeoutExpired:
            row["error"] = "timed out"
        row["wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "results.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
