"""The observer's own cost, measured with enough repeats to say something: interleaved untraced/traced pairs.

    python3 bench/trace/overhead_cpu.py OUT_DIR [--pairs 10] [--new-tokens 200]

Runs ``bench/trace/infer_7b.py --tiny`` (a 2-layer Llama under ZeRO-3, one rank, DS_ACCELERATOR=cpu) untraced
and under ``dsdoctor trace``, alternating, and compares the tokens/s each run measures itself (the median of
three generate calls). A tiny model makes each generate short, so a fixed per-call cost of the observer
(its wrappers, phase records and the 10 Hz sampler thread) weighs more than it would on a 7B model: this is
an upper bound of the observer's CPU-side cost. It is not the GPU figure the issue asks for (that one needs
``run_gpu.py``): on a GPU the observer adds one ``cuda.synchronize`` per phase and allocator reads, no
per-token work.

Writes OUT_DIR/overhead.json (every run, the paired differences, mean and a 95% interval) and prints the
summary.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "infer_7b.py"
CONFIG = HERE / "infer_zero3.json"
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20,
       12: 2.18, 14: 2.14, 19: 2.09, 29: 2.05}


def t95(df: int) -> float:
    return T95.get(df) or T95[max(k for k in T95 if k <= df)] if df >= 1 else float("nan")


def one_run(out: Path, name: str, traced: bool, new_tokens: int) -> float:
    result = out / f"{name}.json"
    user = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(SCRIPT),
            "--config", str(CONFIG), "--tiny", "--new-tokens", str(new_tokens), "--repeats", "3",
            "--result", str(result)]
    cmd = user if not traced else [sys.executable, "-m", "dsdoctor", "trace", "-q", "--format", "json",
                                    "--timeout", "300", "-o", str(out / name), "--force", "--", *user]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if not result.exists():
        raise SystemExit(f"{name} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return statistics.median(json.loads(result.read_text())["tokens_per_s_all"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=200)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    runs, diffs = [], []
    t0 = time.time()
    for i in range(a.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)  # alternate who goes first
        rate = {}
        for traced in order:
            name = f"{'traced' if traced else 'untraced'}-{i}"
            rate[traced] = one_run(a.out, name, traced, a.new_tokens)
            runs.append({"name": name, "traced": traced, "tokens_per_s": rate[traced]})
        diffs.append(100 * (rate[False] - rate[True]) / rate[False])
        print(f"pair {i}: untraced {rate[False]:.1f}, traced {rate[True]:.1f} tokens/s, overhead {diffs[-1]:+.2f}%",
              file=sys.stderr, flush=True)
    mean = statistics.mean(diffs)
    half = t95(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    summary = {"pairs": a.pairs, "new_tokens": a.new_tokens, "overhead_percent_mean": round(mean, 2),
               "overhead_percent_95ci": [round(mean - half, 2), round(mean + half, 2)],
               "untraced_mean": statistics.mean(r["tokens_per_s"] for r in runs if not r["traced"]),
               "traced_mean": statistics.mean(r["tokens_per_s"] for r in runs if r["traced"]),
               "wall_s": round(time.time() - t0, 1), "machine": f"{os.cpu_count()} CPUs, CPU accelerator"}
    (a.out / "overhead.json").write_text(json.dumps({"summary": summary, "runs": runs, "diffs": diffs}, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
