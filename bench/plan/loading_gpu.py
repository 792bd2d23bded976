"""Host memory of each way to load a saved checkpoint, measured, against plan's loading model.

Writes random-weight Llama checkpoints with ``save_pretrained`` (safetensors and ``.bin``, 5 GB shards as
most published checkpoints have), then loads each one in a fresh process per loading method while this
process samples the child's ``/proc/PID/status`` every 2 ms: ``RssAnon`` (heap, CPU copies: what runs a
host out of memory), ``RssFile`` (memory-mapped checkpoint pages: shared through the page cache) and
``RssShmem``. The child also reports ``VmHWM`` and ``/proc/self/smaps_rollup`` at its end. One JSON line
per case on stdout with the prediction of ``dsdoctor.plan.loading`` beside the measurement; progress on
stderr; a summary line last.

Cases, per checkpoint:
  to-gpu           from_pretrained(dir, dtype=bf16, device_map="cuda")
  cpu-then-to      from_pretrained(dir, dtype=bf16) on the CPU, then .to("cuda")
  cpu-convert      from_pretrained(dir, dtype=fp16) on the CPU (a dtype conversion), then .to("cuda")
  zero-init        from_pretrained under HfDeepSpeedConfig (ZeRO-3, one rank): zero.Init builds and
                   partitions each module; rank 0 maps the checkpoint
  tp-cpu-model     from_pretrained on the CPU, then deepspeed.init_inference(tensor_parallel tp_size 1):
                   what each AutoTP rank does with a CPU-built model

Disk: one checkpoint at a time (7B bf16: 13.5 GB), deleted after its cases. Runtime on one H200 host:
about 4 minutes with the default sizes.

    PYTHONPATH=/tmp/site:$PWD/src python3 bench/plan/loading_gpu.py /tmp/dsd-loading > loading.jsonl

``--reestimate RUN.tar.gz|loading.jsonl`` measures nothing and needs no GPU: it recomputes the predictions of
the current ``dsdoctor.plan.loading`` for each recorded case (the checkpoint's shard sizes rebuilt from the
shape on the meta device, split as the writer split it) and prints a table of measured vs predicted:

    PYTHONPATH=$PWD/src python3 bench/plan/loading_gpu.py --reestimate bench/plan/runs/loading-gpu-run1.tar.gz
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 1024**3
SHAPES = {  # Llama shapes
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    # added after run 1's fix, for an out-of-sample check: Llama-3.2-3B's layers, its 128k vocabulary, untied
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, vocab_size=128256),
}
CASES = ("to-gpu", "cpu-then-to", "cpu-convert", "zero-init", "tp-cpu-model")


def log(msg: str):
    print(f"[loading_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def llama_config(size: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, **SHAPES[size]}


def write_checkpoint(size: str, fmt: str, directory: str) -> None:
    """Random weights built on the GPU (fast), saved with save_pretrained."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = llama_config(size)
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model = model.to("cpu")  # serializers read host memory (the writer is its own process)
    if fmt == "safetensors":
        model.save_pretrained(directory, max_shard_size="5GB")
    else:  # transformers 5 writes only safetensors: .bin shards as transformers 4 wrote them (torch.save, zip)
        model.config.save_pretrained(directory)
        _save_bin(model.state_dict(), directory, 5 * 10**9)
    del model
    torch.cuda.empty_cache()


def _save_bin(state: dict, directory: str, shard_bytes: int) -> None:
    import torch

    shards, current, size = [], {}, 0
    for name, tensor in state.items():
        n = tensor.numel() * tensor.element_size()
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor.contiguous()
        size += n
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, os.path.join(directory, fname))
        for name, tensor in shard.items():
            weight_map[name] = fname
            total += tensor.numel() * tensor.element_size()
    with open(os.path.join(directory, "pytorch_model.bin.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)


# ------------------------------------------------------------------------------------------ the child

def child(case: str, directory: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    if case == "to-gpu":
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map="cuda")
    elif case in ("cpu-then-to", "cpu-convert"):
        dtype = torch.bfloat16 if case == "cpu-then-to" else torch.float16
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        model = model.to("cuda")
    elif case == "zero-init":
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        deepspeed.init_distributed(dist_backend="nccl")
        cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
        keep = HfDeepSpeedConfig(cfg)  # noqa: F841  (kept alive: from_pretrained builds under zero.Init)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    elif case == "tp-cpu-model":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl")
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        model = deepspeed.init_inference(model, tensor_parallel={"tp_size": 1}, dtype=torch.bfloat16,
                                         replace_with_kernel_inject=False).module
    else:
        raise SystemExit(f"unknown case {case}")
    torch.cuda.synchronize()
    status = _status("self")
    rollup = {}
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "kB":
                    rollup[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        pass
    print(json.dumps({"vmhwm": status.get("VmHWM", 0), "end_anon": status.get("RssAnon", 0),
                      "end_file": status.get("RssFile", 0), "rollup_anonymous": rollup.get("Anonymous", 0),
                      "rollup_rss": rollup.get("Rss", 0),
                      "gpu_allocated": torch.cuda.memory_allocated()}), flush=True)


def _status(pid) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


# ----------------------------------------------------------------------------------------- the parent

def measure(case: str, directory: str, timeout_s: float) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + CASES.index(case)), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", case, directory],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = {"anon": 0, "file": 0, "shmem": 0, "total": 0}
    start = time.time()
    while proc.poll() is None:
        s = _status(proc.pid)
        a, f, sh = s.get("RssAnon", 0), s.get("RssFile", 0), s.get("RssShmem", 0)
        peak["anon"], peak["file"], peak["shmem"] = max(peak["anon"], a), max(peak["file"], f), max(peak["shmem"], sh)
        peak["total"] = max(peak["total"], a + f + sh)
        if time.time() - start > timeout_s:
            proc.kill()
            break
        time.sleep(0.002)
    out, err = proc.communicate()
    last = [ln for ln in out.splitlines() if ln.startswith("{")]
    result = {"peak_anon": peak["anon"], "peak_file": peak["file"], "peak_shmem": peak["shmem"],
              "peak_rss": peak["total"], "seconds": round(time.time() - start, 1), "rc": proc.returncode}
    if last:
        result.update(json.loads(last[-1]))
    else:
        result["error"] = err.strip().splitlines()[-1] if err.strip() else "no output"
    return result


def predicted(case: str, directory: str, size: str, ckpt=None) -> dict:
    """plan's prediction for a case; ``ckpt`` (a ``loading.Checkpoint``) when the directory holds only the
    config (re-estimation), else read from the directory."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from dsdoctor.model.formulas import from_formula
    from dsdoctor.model.spec import load_model_spec
    from dsdoctor.plan import loading

    spec = load_model_spec(directory)
    inv = from_formula(spec)
    weights = inv.num_params * 2
    largest = max(p.numel for p in inv.params) * 2
    ckpt = ckpt or loading.find_checkpoint(spec.path, weights, "bf16")
    if case in ("to-gpu", "cpu-then-to"):
        m = {x.method: x for x in loading.plain_methods(ckpt, "bf16", 1, weights)}[case]
    elif case == "cpu-convert":
        m = {x.method: x for x in loading.plain_methods(ckpt, "fp16", 1, weights)}["cpu-then-to"]
    elif case == "zero-init":
        m = loading.zero3_methods(ckpt, "bf16", 1, weights)[0]
    else:
        m = {x.method: x for x in loading.tp_methods(ckpt, "bf16", 1, 1, weights, largest)}["cpu-model"]
    return {"predicted_anon": m.anon_bytes, "predicted_file": m.file_rss_bytes, "predicted_rss": m.rss_bytes,
            "checkpoint_bytes": ckpt.total_bytes, "checkpoint_files": ckpt.files,
            "checkpoint_largest_bytes": ckpt.largest_file_bytes}


# ------------------------------------------------------------------------------------- re-estimation

def shard_sizes(size: str, fmt: str) -> list[int]:
    """Tensor bytes per file as ``write_checkpoint`` splits them (5 GB shards), from a meta-device model:
    huggingface_hub's split (what save_pretrained calls) for safetensors, ``_save_bin``'s own for .bin."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**llama_config(size)), dtype=torch.bfloat16)
    state = model.state_dict()
    nbytes = {k: t.numel() * t.element_size() for k, t in state.items()}
    if fmt == "safetensors":
        from huggingface_hub import split_torch_state_dict_into_shards

        split = split_torch_state_dict_into_shards(state, max_shard_size="5GB")
        return [sum(nbytes[k] for k in keys) for keys in split.filename_to_tensors.values()]
    shards, size_now = [], 0
    for n in nbytes.values():
        if size_now and size_now + n > 5 * 10**9:
            shards.append(size_now)
            size_now = 0
        size_now += n
    return shards + [size_now]


def _read_records(path: str) -> list[dict]:
    if path.endswith((".tar.gz", ".tgz")):
        import tarfile

        with tarfile.open(path) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("loading.jsonl"))
            text = tar.extractfile(member).read().decode()
    else:
        with open(path) as fh:
            text = fh.read()
    return [r for r in (json.loads(ln) for ln in text.splitlines() if ln.startswith("{")) if "case" in r]


def reestimate(path: str) -> int:
    """Today's predictions for a recorded run, beside the measurements and the run's own predictions."""
    import tempfile

    sys.path.insert(0, os.path.join(ROOT, "src"))
    from dsdoctor.plan import loading

    rows, errs, old = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in _read_records(path):
            if "error" in r:
                continue
            directory = os.path.join(tmp, r["size"])
            if not os.path.isdir(directory):
                os.makedirs(directory)
                with open(os.path.join(directory, "config.json"), "w") as fh:
                    json.dump(llama_config(r["size"]), fh)
            shards = shard_sizes(r["size"], r["format"])
            ckpt = loading.Checkpoint(r["format"], sum(shards), max(shards), len(shards), "bf16", True)
            p = predicted(r["case"], directory, r["size"], ckpt)
            err = 100 * (p["predicted_rss"] - r["peak_rss"]) / r["peak_rss"]
            rows.append({**{k: r[k] for k in ("size", "format", "case", "peak_anon", "peak_file", "peak_rss")},
                         **{k: p[k] for k in ("predicted_anon", "predicted_file", "predicted_rss")},
                         "recorded_error_rss_pct": r.get("error_rss_pct"), "error_rss_pct": round(err, 1),
                         "error_anon_pct": round(100 * (p["predicted_anon"] - r["peak_anon"]) / r["peak_anon"], 1),
                         "error_file_pct": round(100 * (p["predicted_file"] - r["peak_file"]) / r["peak_file"], 1)})
            errs.append(abs(err))
            if r.get("error_rss_pct") is not None:
                old.append(abs(r["error_rss_pct"]))
    print("| size | format | case | anon measured / predicted | file measured / predicted | RSS measured / "
          "predicted | RSS error before | RSS error now |")
    print("|---|---|---|---|---|---|---|---|")
    for w in rows:
        g = {k: f"{w[k] / GiB:.2f}" for k in w if k.startswith(("peak", "predicted"))}
        print(f"| {w['size']} | {w['format']} | {w['case']} | {g['peak_anon']} / {g['predicted_anon']} | "
              f"{g['peak_file']} / {g['predicted_file']} | {g['peak_rss']} / {g['predicted_rss']} | "
              f"{w['recorded_error_rss_pct']:+.1f}% | {w['error_rss_pct']:+.1f}% |")
    errs.sort()
    old.sort()
    summary = {"summary": True, "cases": len(errs),
               "median_abs_rss_error_pct": round(errs[len(errs) // 2], 1) if errs else None,
               "max_abs_rss_error_pct": round(errs[-1], 1) if errs else None,
               "recorded_median_abs_rss_error_pct": old[len(old) // 2] if old else None,
               "recorded_max_abs_rss_error_pct": old[-1] if old else None,
               "max_abs_anon_error_pct": max((abs(w["error_anon_pct"]) for w in rows), default=None),
               "max_abs_file_error_pct": max((abs(w["error_file_pct"]) for w in rows), default=None)}
    print(json.dumps(summary))
    return 0 if rows else 2


def main() -> int:
    if len(sys.argv) >= 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", nargs="?", help="where checkpoints are written (one at a time; 13.5 GB for 7b) and deleted")
    ap.add_argument("--sizes", default="1b,7b", help="Llama shapes: 1b,7b,3b (default 1b,7b)")
    ap.add_argument("--formats", default="safetensors,bin")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--timeout-s", type=float, default=180)
    ap.add_argument("--reestimate", metavar="RUN", help="recompute predictions for a recorded loading.jsonl "
                    "(or a run .tar.gz) with today's model; measures nothing, needs no GPU")
    args = ap.parse_args()
    if args.reestimate:
        return reestimate(args.reestimate)
    if not args.workdir:
        ap.error("give WORKDIR (or --reestimate RUN)")
    os.makedirs(args.workdir, exist_ok=True)
    errors = []
    for size in args.sizes.split(","):
        for fmt in args.formats.split(","):
            directory = os.path.join(args.workdir, f"llama-{size}-{fmt}")
            shutil.rmtree(directory, ignore_errors=True)
            t0 = time.time()
            log(f"writing {size} {fmt} checkpoint to {directory}")
            here = os.path.dirname(os.path.abspath(__file__))
            script = (f"import sys; sys.path.insert(0, {here!r}); import loading_gpu as m; "
                      f"m.write_checkpoint({size!r}, {fmt!r}, {directory!r})")
            proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
            if proc.returncode != 0:
                log(f"could not write the checkpoint: {proc.stderr.strip().splitlines()[-1:]}")
                continue
            log(f"written in {time.time() - t0:.0f} s")
            for case in args.cases.split(","):
                # drop this checkpoint's pages from the page cache so each case reads from disk alike
                subprocess.run(["sync"], check=False)
                log(f"{size} {fmt} {case}")
                row = {"size": size, "format": fmt, "case": case, **measure(case, directory, args.timeout_s),
                       **predicted(case, directory, size)}
                if "error" not in row:
                    row["error_anon_pct"] = round(100 * (row["predicted_anon"] - row["peak_anon"]) / max(row["peak_anon"], 1), 1)
                    row["error_rss_pct"] = round(100 * (row["predicted_rss"] - row["peak_rss"]) / max(row["peak_rss"], 1), 1)
                    errors.append(abs(row["error_rss_pct"]))
                print(json.dumps(row), flush=True)
            shutil.rmtree(directory, ignore_errors=True)
    errors.sort()
    print(json.dumps({"summary": True, "cases": len(errors),
                      "median_abs_rss_error_pct": errors[len(errors) // 2] if errors else None,
                      "max_abs_rss_error_pct": errors[-1] if errors else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
