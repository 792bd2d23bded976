"""Measure the real peak GPU memory of each load path and compare it with ``dsdoctor plan``.

    python3 bench/plan/run.py OUT_DIR [--tiny] [--gpus N] [--budget-s 470]
    python3 bench/plan/run.py OUT_DIR --reestimate RUN.tar.gz|RUN/raw.jsonl [...] --device "2 x NVIDIA H200"

Writes OUT_DIR/results.json and OUT_DIR/results.md (estimated vs measured vs weights-only, error %),
plus the raw per-case records in OUT_DIR/raw.jsonl and each launch's log. One torchrun launch per GPU
count (1-GPU cases run as two concurrent launches when two GPUs exist); a launch that crashes or times
out loses one case, and the rest are relaunched. ``--tiny`` runs tiny models (on CPU with gloo when
there is no GPU) to prove the script works. ``--reestimate`` measures nothing: it compares the current model with the peaks
recorded by earlier runs (a case recorded twice: the later file wins).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))

from cases import CASES, MODELS, TINY_CASES, TINY_MODELS  # noqa: E402

SHARDED = ("tp", "zero3", "zero3-offload", "zero3-offload-nvme")


def log(msg: str) -> None:
    print(f"[bench/plan {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_info():
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return torch.cuda.device_count(), props.total_memory, props.name
    except Exception:
        pass
    return 0, None, None


def launch(cases, nproc, out: Path, models: Path, env_extra: dict, deadline: float, tag: str):
    """Start one torchrun launch; returns the Popen and what it needs to be resumed."""
    case_file = out / f"cases-{tag}.json"
    case_file.write_text(json.dumps(cases))
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "4")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), str(HERE / "measure.py"),
           "--cases", str(case_file), "--models", str(models), "--out", str(out / "raw.jsonl")]
    logf = open(out / f"launch-{tag}.log", "a")
    logf.write(f"\n$ {' '.join(cmd)}\n")
    logf.flush()
    proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, logf


def done_ids(out: Path) -> set:
    raw = out / "raw.jsonl"
    if not raw.exists():
        return set()
    return {json.loads(line)["id"] for line in raw.read_text().splitlines() if line.strip()}


def run_group(cases, nproc, out, models, env_extra, deadline, tag):
    """Run each case in a fresh launch: a ZeRO-3 engine's hooks keep GPU memory alive after the case ends,
    which would leak into the next case's peak. A crash or time-out loses only its own case."""
    for n, case in enumerate(cases):
        _run_launch([case], nproc, out, models, env_extra, deadline, f"{tag}-c{n}")


def _run_launch(cases, nproc, out, models, env_extra, deadline, tag):
    """Run cases in one launch; on a crash or time-out, record the case in progress and relaunch the rest."""
    pending = list(cases)
    attempt = 0
    while pending:
        if time.time() >= deadline:
            for c in pending:
                record_failure(out, c, "skipped: out of time budget")
            return
        attempt += 1
        proc, logf = launch(pending, nproc, out, models, env_extra, deadline, f"{tag}-{attempt}")
        try:
            proc.wait(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        logf.close()
        finished = done_ids(out)
        pending = [c for c in pending if c["id"] not in finished]
        if pending and proc.returncode != 0:
            bad = pending.pop(0)
            why = "time budget ran out" if time.time() >= deadline else f"launch exited {proc.returncode}"
            record_failure(out, bad, f"{why} during this case (see launch-{tag}-{attempt}.log)")
            log(f"{bad['id']}: {why}")
        elif pending:  # clean exit but cases missing: should not happen; avoid looping
            for c in pending:
                record_failure(out, c, "launch ended without recording this case")
            return


def record_failure(out: Path, case: dict, why: str) -> None:
    with open(out / "raw.jsonl", "a") as f:
        f.write(json.dumps({"id": case["id"], "case": case, "ok": False, "error": why}) + "\n")


def predict(case, models: Path, gpu_memory, gpu_name):
    from dsdoctor.plan.api import plan

    res = plan(models / case["model"], batch=case["batch"], prompt_len=case["prompt_len"],
               new_tokens=case["new_tokens"], dtype="bf16", gpus=case["gpus"], gpu_memory=gpu_memory or 141 * 10**9,
               host_memory=2**40, detect=False, gpu_name=gpu_name or "H200")
    p = res.path(case["path"])
    weights_only = res.model["num_params"] * 2 // (case["gpus"] if case["path"] in SHARDED else 1)
    return {"gpu_peak_bytes": p.gpu_peak_bytes, "gpu_reserved_bytes": p.gpu_reserved_bytes,
            "tokens_per_s": p.tokens_per_s, "peak_at": p.peak_at, "breakdown": p.breakdown,
            "weights_only_bytes": weights_only, "num_params": res.model["num_params"],
            "counted_by": res.model["counted_by"], "host_peak_bytes": p.host_peak_bytes}


def pct(est, meas):
    return None if not meas or est is None else 100.0 * (est - meas) / meas


def gib(n):
    return "-" if n is None else f"{n / 2**30:.2f}"


def fmt_pct(x):
    return "-" if x is None else f"{x:+.1f}%"


def summarize(out: Path, models: Path, gpu_memory, gpu_name, device_desc: str, elapsed: float) -> dict:
    records = {}
    for line in (out / "raw.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            records[r["id"]] = r  # the last word on a case wins
    rows = []
    for rid, r in records.items():
        case = r["case"]
        ranks = r.get("ranks") or []
        # a rank's own peak: what an earlier case left allocated (should be 0) is not this case's
        peaks = [x["peak_allocated"] - (x.get("allocated_at_start") or 0) for x in ranks if x.get("peak_allocated")]
        reserved = [x.get("peak_reserved") for x in ranks if x.get("peak_reserved")]
        measured = max(peaks) if peaks else None
        try:
            pred = predict(case, models, gpu_memory, gpu_name)
        except Exception as exc:  # keep the measurement even if the prediction breaks
            pred = {"error": f"{type(exc).__name__}: {exc}"}
        rows.append({
            "id": rid, "case": case, "ok": r.get("ok"), "error": r.get("error"),
            "measured_peak_bytes": measured, "measured_peak_per_rank": peaks,
            "measured_reserved_bytes": max(reserved) if reserved else None,
            "measured_load_peak_bytes": max((x.get("load_peak_allocated") or 0) for x in ranks) if ranks else None,
            "measured_tokens_per_s": r.get("tokens_per_s"), "rss_after_load": r.get("rss_after_load"),
            "allocated_at_start": [x.get("allocated_at_start") for x in ranks],
            "estimate": pred,
            "error_pct": pct(pred.get("gpu_peak_bytes"), measured),
            "weights_only_error_pct": pct(pred.get("weights_only_bytes"), measured),
        })
    errs = [abs(x["error_pct"]) for x in rows if x["error_pct"] is not None]
    wo = [abs(x["weights_only_error_pct"]) for x in rows if x["weights_only_error_pct"] is not None]
    summary = {
        "device": device_desc, "elapsed_s": round(elapsed, 1), "cases": len(rows),
        "measured": len(errs), "failed": sum(1 for x in rows if not x["ok"]),
        "median_abs_error_pct": statistics.median(errs) if errs else None,
        "max_abs_error_pct": max(errs) if errs else None,
        "weights_only_median_abs_error_pct": statistics.median(wo) if wo else None,
        "weights_only_max_abs_error_pct": max(wo) if wo else None,
    }
    (out / "results.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    lines = ["# dsdoctor plan: estimated vs measured peak GPU memory\n",
             f"Device: {device_desc}.{f' Wall time {elapsed:.0f} s.' if elapsed else ''} "
             f"Peak = `torch.cuda.max_memory_allocated` over load "
             f"and two `generate` calls, max over ranks (GiB).\n",
             "| case | path | GPUs | batch | prompt | new | measured | estimated | error | weights-only | error | "
             "reserved (meas/est) | tok/s/rank (meas/est) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        c, e = x["case"], x["estimate"]
        if not x["ok"]:
            note = (x["error"] or "failed").replace("|", "/")[:120]
            lines.append(f"| {c['model']} | {c['path']} | {c['gpus']} | {c['batch']} | {c['prompt_len']} | "
                         f"{c['new_tokens']} | failed: {note} | {gib(e.get('gpu_peak_bytes'))} | - | - | - | - | - |")
            continue
        mt = x["measured_tokens_per_s"]
        lines.append(
            f"| {c['model']} | {c['path']} | {c['gpus']} | {c['batch']} | {c['prompt_len']} | {c['new_tokens']} | "
            f"{gib(x['measured_peak_bytes'])} | {gib(e.get('gpu_peak_bytes'))} | {fmt_pct(x['error_pct'])} | "
            f"{gib(e.get('weights_only_bytes'))} | {fmt_pct(x['weights_only_error_pct'])} | "
            f"{gib(x['measured_reserved_bytes'])}/{gib(e.get('gpu_reserved_bytes'))} | "
            f"{'-' if mt is None else f'{mt:.1f}'}/{e.get('tokens_per_s', 0):.1f} |")
    s = summary
    lines.append("")
    lines.append(f"Median |error| {fmt_pct(s['median_abs_error_pct'])}, worst {fmt_pct(s['max_abs_error_pct'])} "
                 f"over {s['measured']} measured cases; weights-only estimate: median "
                 f"{fmt_pct(s['weights_only_median_abs_error_pct'])}, worst {fmt_pct(s['weights_only_max_abs_error_pct'])}. "
                 f"{s['failed']} case(s) failed.")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(summary))
    return summary


def _raw_text(path: Path) -> str:
    """A raw.jsonl, or the raw.jsonl inside a run's archive (bench/plan/runs/<run>.tar.gz)."""
    if path.name.endswith(".tar.gz"):
        import tarfile

        with tarfile.open(path) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("raw.jsonl"))
            return tar.extractfile(member).read().decode()
    return path.read_text()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output directory (created)")
    ap.add_argument("--tiny", action="store_true", help="tiny models (works on CPU with gloo)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible, at most 2)")
    ap.add_argument("--budget-s", type=float, default=470, help="wall-time budget for the launches (default 470)")
    ap.add_argument("--only", default=None, help="comma-separated case ids or substrings")
    ap.add_argument("--reestimate", nargs="+", type=Path, metavar="RAW_JSONL",
                    help="measure nothing: estimate the cases recorded in these raw.jsonl files again")
    ap.add_argument("--device", default="recorded GPU", help="with --reestimate: the machine that measured them")
    args = ap.parse_args()
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "raw.jsonl").unlink(missing_ok=True)
    if args.reestimate:
        models = out / "models"
        for m, cfg in MODELS.items():
            (models / m).mkdir(parents=True, exist_ok=True)
            (models / m / "config.json").write_text(json.dumps(cfg, indent=2))
        lines = [ln for f in args.reestimate for ln in _raw_text(f).splitlines() if ln.strip()]
        (out / "raw.jsonl").write_text("\n".join(lines) + "\n")
        summarize(out, models, None, None, f"{args.device}, re-estimated from {len(args.reestimate)} recorded run(s)", 0)
        return 0
    ngpu, total, name = gpu_info()
    gpus = min(args.gpus or max(ngpu, 2 if args.tiny else 1), 2)
    models_src, cases = (TINY_MODELS, TINY_CASES) if args.tiny else (MODELS, CASES)
    if args.only:
        keys = args.only.split(",")
        cases = [c for c in cases if any(k in c["id"] for k in keys)]
    cases = [c for c in cases if c["gpus"] <= gpus]
    models = out / "models"
    for m, cfg in models_src.items():
        (models / m).mkdir(parents=True, exist_ok=True)
        (models / m / "config.json").write_text(json.dumps(cfg, indent=2))
    env = {} if ngpu else {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    device_desc = f"{ngpu} x {name} ({total / 2**30:.0f} GiB)" if ngpu else "CPU (gloo), no GPU: peaks not measured"
    deadline = start + args.budget_s
    log(f"{len(cases)} cases on {device_desc}; budget {args.budget_s:.0f} s")

    one = [c for c in cases if c["gpus"] == 1]
    two = [c for c in cases if c["gpus"] == 2]
    if one and ngpu >= 2:  # two concurrent single-GPU launches, one per GPU
        halves = [one[0::2], one[1::2]]
        import threading

        threads = [threading.Thread(target=run_group, args=(h, 1, out, models, dict(env, CUDA_VISIBLE_DEVICES=str(i)),
                                                             deadline, f"g1-dev{i}")) for i, h in enumerate(halves) if h]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elif one:
        run_group(one, 1, out, models, env, deadline, "g1")
    if two:
        run_group(two, 2, out, models, env, deadline, "g2")
    summary = summarize(out, models, total, name, device_desc, time.time() - start)
    log(f"wrote {out / 'results.md'}")
    return 0 if summary["cases"] else 1


if __name__ == "__main__":
    sys.exit(main())
