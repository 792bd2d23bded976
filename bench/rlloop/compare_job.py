"""Measured against predicted for bench/rlloop/job_gpu.py's runs: re-estimates every case with the planner as it
is now (the prediction stored in the run is the one of the day it ran) and prints a Markdown table.

    python3 bench/rlloop/compare_job.py bench/rlloop/runs/2026-12-01-job-run1.tar.gz
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GB = 1e9


def rows_of(path: str) -> list[dict]:
    if path.endswith(".tar.gz"):
        with tarfile.open(path) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("results.jsonl"))
            text = io.TextIOWrapper(tar.extractfile(member)).read()
    else:
        text = Path(path, "results.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def main() -> int:
    import job_gpu

    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--exp-batch", type=int, default=4)
    ap.add_argument("--train-batch", type=int, default=4)
    args = ap.parse_args()
    args.tiny, args.out = False, "/tmp/dsdoctor-compare-job"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print("| arrangement | phase | predicted GB | measured GB (allocated) | error | reserved GB | predicted s |"
          " measured s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows_of(args.run):
        m = row.get("measured")
        if not m:
            print(f"| {row['case']} | - | - | {row.get('error', '-')} | | | | |")
            continue
        p = job_gpu.predict(args, job_gpu.SHAPE, row["case"], "140GiB", "H200")
        for phase in ("rollout", "experience", "train"):
            pred, meas = p["phases"][phase], m[phase]["allocated"]
            print(f"| {row['case']} | {phase} | {pred / GB:.2f} | {meas / GB:.2f} | {100 * (pred - meas) / meas:+.1f}% |"
                  f" {m[phase]['reserved'] / GB:.2f} | {p['seconds'][phase]:.2f} | {m[phase]['s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
