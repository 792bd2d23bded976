"""Does ``dsdoctor trace`` change the numbers a program reads about itself? And what does it cost?

A Llama-shaped model (random weights, built from a config on the GPU, bf16) generates a fixed batch; the
script reads its own ``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()`` (after its own
``reset_peak_memory_stats()``, as guides do) and its VmHWM, and times generate. The driver runs it bare and
under ``dsdoctor trace``, in interleaved pairs, and ends with one JSON line.

    python bench/trace/counters_gpu.py                     # 5 pairs, ~1.3B model, one GPU
    python bench/trace/counters_gpu.py --pairs 3 --layers 8 --hidden 1024   # quicker
    python bench/trace/counters_gpu.py --worker            # one bare run: prints RESULT {...}

Expected: the peaks are byte-identical bare and traced (the observer resets the allocator's peaks at every
phase, but shows the program the counters it would see without it); tokens/s within noise of each other.
Before the fix the traced peak was the last phase's only (13.77 GiB bare vs 12.58 GiB traced on a 7B run).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def vm_hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def worker(a) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cuda = a.device == "cuda"
    assert not cuda or torch.cuda.is_available(), "needs a CUDA GPU (--device cpu only checks the plumbing)"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4, num_hidden_layers=a.layers,
                      num_attention_heads=a.hidden // 128, num_key_value_heads=a.hidden // 128, vocab_size=32000,
                      max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.set_default_dtype(dtype)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()  # observed: "load"
    torch.set_default_dtype(torch.float32)
    ids = torch.randint(3, 32000, (a.batch, a.prompt), device=a.device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)  # warm-up
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()  # the program's own reset: what it reads below starts here
        scratch = torch.empty(a.scratch_mib * 2**20, dtype=torch.uint8, device=a.device)  # a peak between phases
        scratch.fill_(1)
        del scratch
        times = []
        for _ in range(a.repeats):  # each generate is an observed phase: the observer resets around each
            sync()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False)
            sync()
            times.append(time.perf_counter() - t0)
    out = {
        "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else 0,
        "max_memory_reserved": torch.cuda.max_memory_reserved() if cuda else 0,
        "peak_stat": torch.cuda.memory_stats()["allocated_bytes.all.peak"] if cuda else 0,
        "vm_hwm": vm_hwm(),
        "tokens_per_s": a.batch * a.new_tokens / statistics.median(times),
        "traced": bool(os.environ.get("PYTHON_DSDOCTOR_TRACE_DIR")),
    }
    print("RESULT " + json.dumps(out), flush=True)


def run_once(args: list[str], traced: bool, workdir: Path, i: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env.pop("PYTHON_DSDOCTOR_TRACE_DIR", None)
    cmd = [sys.executable, __file__, "--worker", *args]
    if traced:
        cmd = [sys.executable, "-m", "dsdoctor", "trace", "-o", str(workdir / f"trace-{i}"), "--", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    text = proc.stdout + proc.stderr
    line = next((ln for ln in text.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"no RESULT from {' '.join(cmd)} (exit {proc.returncode}):\n{text[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help="one run of the model (what the driver launches)")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scratch-mib", type=int, default=2048)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: only check the plumbing")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    passthrough = ["--hidden", str(a.hidden), "--layers", str(a.layers), "--batch", str(a.batch), "--prompt",
                   str(a.prompt), "--new-tokens", str(a.new_tokens), "--repeats", str(a.repeats),
                   "--scratch-mib", str(a.scratch_mib), "--device", a.device]
    print(f"expect: identical peaks bare vs traced; tokens/s within noise ({a.pairs} interleaved pairs)",
          file=sys.stderr)
    bare, traced = [], []
    with tempfile.TemporaryDirectory(prefix="dsd-counters-") as tmp:
        for i in range(a.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)  # alternate who goes first
            for is_traced in order:
                r = run_once(passthrough, is_traced, Path(tmp), i)
                (traced if is_traced else bare).append(r)
                print(f"pair {i} {'traced' if is_traced else 'bare  '}: {json.dumps(r)}", file=sys.stderr)
    keys = ("max_memory_allocated", "max_memory_reserved", "peak_stat", "vm_hwm", "tokens_per_s")
    overheads = [100.0 * (b["tokens_per_s"] - t["tokens_per_s"]) / b["tokens_per_s"]
                 for b, t in zip(bare, traced, strict=True)]
    summary = {
        "pairs": a.pairs,
        "model": {"hidden": a.hidden, "layers": a.layers, "batch": a.batch, "prompt": a.prompt,
                  "new_tokens": a.new_tokens},
        "bare": {k: [r[k] for r in bare] for k in keys},
        "traced": {k: [r[k] for r in traced] for k in keys},
        "peaks_identical": all(b[k] == t[k] for b, t in zip(bare, traced, strict=True)
                               for k in ("max_memory_allocated", "max_memory_reserved", "peak_stat")),
        "max_allocated_diff_bytes": max(abs(b["max_memory_allocated"] - t["max_memory_allocated"])
                                        for b, t in zip(bare, traced, strict=True)),
        "tokens_per_s_overhead_pct_median": round(statistics.median(overheads), 2),
        "tokens_per_s_overhead_pct_each": [round(x, 2) for x in overheads],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
