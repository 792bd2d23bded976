"""Split config vs the training config it came from, on real GPUs: host memory, GPU memory, start-up time.

Usage (from the repo root, DeepSpeed and src on PYTHONPATH):
    python3 bench/config/run.py OUT_DIR [--gpus 2] [--preset 1.3b|tiny] [--timeout 480]

For each config it launches ``python3 -m torch.distributed.run --nproc_per_node GPUS split_rank.py``:
  train.json  the bundled example (src/dsdoctor/examples/train_zero3_offload.json) with every "auto" filled
              as the HF Trainer fills it (bf16, micro batch 1, hidden-size keys), and a torch AdamW
              (``torch_adam`` + ``zero_force_ds_cpu_optimizer: false``) so no compiled CPUAdam is needed
  infer.json  ``dsdoctor split`` of the same example with --model (what the tool tells users to run)
Writes OUT_DIR/<config>.rank<r>.json, OUT_DIR/results.json (summary) and prints one JSON line at the end.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

PRESETS = {  # Llama-shaped; 1.3b: hidden 2048, 24 layers (about 1.4B parameters)
    "1.3b": dict(hidden=2048, layers=24, inter=5504, heads=16, kv=16, vocab=32000, tokens=16, prompt=128),
    "tiny": dict(hidden=256, layers=2, inter=688, heads=4, kv=4, vocab=1000, tokens=4, prompt=8),
}


def model_dir(out: Path, p: dict) -> Path:
    d = out / "model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": p["hidden"],
        "intermediate_size": p["inter"], "num_hidden_layers": p["layers"], "num_attention_heads": p["heads"],
        "num_key_value_heads": p["kv"], "vocab_size": p["vocab"], "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "max_position_embeddings": 4096}))
    return d


def train_config(hidden: int) -> dict:
    from dsdoctor.config.load import load_config

    cfg = load_config(ROOT / "src" / "dsdoctor" / "examples" / "train_zero3_offload.json").raw
    cfg.pop("_comment", None)
    cfg.update(train_batch_size=None, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
               gradient_clipping=1.0)
    cfg.pop("train_batch_size")
    cfg["fp16"]["enabled"] = False
    cfg["bf16"]["enabled"] = True
    cfg["optimizer"]["params"] = {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                  "torch_adam": True}
    cfg["zero_force_ds_cpu_optimizer"] = False
    cfg["scheduler"]["params"] = {"warmup_min_lr": 0, "warmup_max_lr": 1e-5, "warmup_num_steps": 10}
    z = cfg["zero_optimization"]
    z["reduce_bucket_size"] = hidden * hidden
    z["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
    z["stage3_param_persistence_threshold"] = 10 * hidden
    return cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--gpus", type=int, default=None)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="1.3b")
    ap.add_argument("--timeout", type=int, default=480, help="seconds per launch")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p = PRESETS[args.preset]
    gpus = args.gpus
    if gpus is None:
        try:
            import torch
            gpus = max(1, min(2, torch.cuda.device_count()))
        except Exception:
            gpus = 1
    mdir = model_dir(out, p)
    train_path = out / "train.json"
    train_path.write_text(json.dumps(train_config(p["hidden"]), indent=2))
    from dsdoctor.config.check import check
    from dsdoctor.config.split import split

    infer_path = out / "infer.json"
    split(train_path, infer_path, model=mdir, force=True)
    findings = {f.code for f in check(train_path, model=mdir, gpus=gpus).findings}
    print(f"expect: train.json builds DeepSpeedZeroOptimizer_Stage3 and costs several bytes/param of host memory "
          f"per rank more than infer.json (DeepSpeedZeRoOffload); check on train.json: {sorted(findings)}", flush=True)
    summary = {"preset": args.preset, "gpus": gpus, "check_findings_train": sorted(findings), "runs": {}}
    flags = [f"--{k}={v}" for k, v in p.items()]
    for name, path in (("infer", infer_path), ("train", train_path)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
               str(ROOT / "bench" / "config" / "split_rank.py"), str(path), str(out / name), *flags]
        print("$", " ".join(cmd), flush=True)
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
            (out / f"{name}.log").write_text(proc.stdout[-20000:] + "\n--- stderr ---\n" + proc.stderr[-20000:])
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        ranks = []
        for r in range(gpus):
            f = out / f"{name}.rank{r}.json"
            if f.exists():
                ranks.append(json.loads(f.read_text()))
        summary["runs"][name] = {"rc": rc, "wall_s": time.perf_counter() - t, "ranks": ranks}
        print(f"{name}: rc={rc} {json.dumps(ranks)[:1500]}", flush=True)
    try:
        tr, inf = summary["runs"]["train"]["ranks"][0], summary["runs"]["infer"]["ranks"][0]
        n = tr["n_params"]
        summary["host_bytes_per_param_per_rank_saved"] = (tr["rss_delta_init"] - inf["rss_delta_init"]) / n
        summary["init_s"] = {"train": tr["init_s"], "infer": inf["init_s"]}
        summary["gpu_peak_init"] = {"train": tr["gpu_peak_init"], "infer": inf["gpu_peak_init"]}
        summary["gpu_peak_generate"] = {"train": tr.get("gpu_peak_generate"), "infer": inf.get("gpu_peak_generate")}
    except (KeyError, IndexError, TypeError):
        summary["incomplete"] = True
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}), flush=True)


if __name__ == "__main__":
    main()
