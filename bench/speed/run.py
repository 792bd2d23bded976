"""bench/speed: calibrate this machine, then measure warm tokens/s, allocated and reserved peaks per case.

    python3 bench/speed/run.py OUT_DIR [--tiny] [--budget-s 420] [--only SUBSTR,...] [--no-calibrate]
    python3 bench/speed/run.py OUT_DIR --reestimate RUN.tar.gz|RAW.jsonl --profile PROFILE.json [--set dev|holdout|validation|all]

A run writes OUT_DIR/profile.json (``dsdoctor calibrate --out``), OUT_DIR/raw.jsonl (one line per case,
from case.py) and OUT_DIR/calibrate.log. Cases run one at a time, each in a fresh process (a fresh
caching allocator); the next case imports while the current one holds the GPU. ``--reestimate`` measures
nothing: it compares plan (with that profile) with recorded cases: tokens/s and reserved peaks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))

from cases import CASES, MODELS, RUN3, RUN4, RUN6, TINY_CASES, TINY_MODELS, VALIDATION  # noqa: E402


def log(msg):
    print(f"[bench/speed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_models(out: Path, models: dict) -> Path:
    d = out / "models"
    for m, cfg in models.items():
        (d / m).mkdir(parents=True, exist_ok=True)
        (d / m / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def measure(out: Path, cases, models_dir: Path, budget_s: float):
    start = time.time()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "4")
    raw = out / "raw.jsonl"
    def spawn(c, n):
        go = out / f".go-{n}"
        e = dict(env)
        if c.get("expandable"):
            e["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        cmd = [sys.executable, str(HERE / "case.py"), "--case", json.dumps(c), "--models", str(models_dir),
               "--out", str(raw), "--go", str(go)]
        logf = open(out / "cases.log", "a")
        return c, subprocess.Popen(cmd, env=e, stdout=logf, stderr=subprocess.STDOUT), go

    queue = list(enumerate(cases))
    current = None
    nxt = spawn(queue[0][1], queue[0][0]) if queue else None
    qi = 1
    while nxt is not None:
        if time.time() - start > budget_s:
            nxt[1].kill()
            nxt[1].wait()
            for _, c in [(None, nxt[0])] + queue[qi:]:
                with open(raw, "a") as fh:
                    fh.write(json.dumps({"id": c["id"], "case": c, "ok": False, "error": "skipped: budget"}) + "\n")
            break
        current = nxt
        current[2].touch()
        log(f"{current[0]['id']} ({current[0]['set']})")
        nxt = None
        if qi < len(queue):
            nxt = spawn(queue[qi][1], queue[qi][0])
            qi += 1
        try:
            current[1].wait(timeout=max(min(150, budget_s + 30 - (time.time() - start)), 5))
        except subprocess.TimeoutExpired:
            current[1].kill()
            current[1].wait()
            with open(raw, "a") as fh:
                fh.write(json.dumps({"id": current[0]["id"], "case": current[0], "ok": False, "error": "timed out"}) + "\n")
            log(f"{current[0]['id']}: timed out")


def reestimate(raw_files, profile_path, which: str, out: Path):
    from dsdoctor.calibrate.profile import load_profile
    from dsdoctor.plan.api import plan

    if not profile_path and len(raw_files) == 1 and str(raw_files[0]).endswith(".tar.gz"):
        import tarfile  # the run's own calibration, measured on the machine that ran the cases

        with tarfile.open(raw_files[0]) as tar:  # run 6 did not calibrate: planned without a profile (no clocks)
            if "profile.json" in tar.getnames():
                (out / "profile.json").write_bytes(tar.extractfile("profile.json").read())
                profile_path = out / "profile.json"
    prof = load_profile(profile_path) if profile_path else None
    models_dir = write_models(out, MODELS)
    recs = {}
    for f in raw_files:
        f = Path(f)
        if f.name.endswith(".tar.gz"):  # a run's archive (bench/speed/runs/<run>.tar.gz)
            import tarfile

            with tarfile.open(f) as tar:
                text = tar.extractfile("raw.jsonl").read().decode()
        else:
            text = f.read_text()
        for line in text.splitlines():
            if line.strip():
                r = json.loads(line)
                recs[r["id"]] = r
    rows = []
    for r in recs.values():
        c = r["case"]
        if not r.get("ok") or (which != "all" and c.get("set") != which):
            continue
        knobs = None
        if c["path"] == "zero3-offload" and not c.get("pin_memory", True):
            cfgp = out / "unpinned.json"
            cfgp.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
                "stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}}}))
            knobs = str(cfgp)
        res = plan(models_dir / c["model"], batch=c["batch"], prompt_len=c["prompt_len"], new_tokens=c["new_tokens"],
                   dtype="bf16", gpus=c["gpus"], gpu_memory=141 * 10**9, host_memory=2**40, detect=False,
                   gpu_name="H200", machine=prof, config=knobs,
                   alloc_conf="expandable_segments:True" if c.get("expandable") else None)
        p = res.path(c["path"])
        rows.append({"id": r["id"], "set": c.get("set"), "case": c,
                     "tok_meas": r["tokens_per_s"], "tok_est": p.tokens_per_s,
                     "tok_err": 100 * (p.tokens_per_s - r["tokens_per_s"]) / r["tokens_per_s"],
                     "alloc_meas": r.get("peak_allocated"), "alloc_est": p.gpu_peak_bytes,
                     "res_meas": r.get("peak_reserved"), "res_est": p.gpu_reserved_bytes,
                     "res_err": (100 * (p.gpu_reserved_bytes - r["peak_reserved"]) / r["peak_reserved"])
                     if r.get("peak_reserved") else None,
                     "prefill_meas": r.get("prefill_s"), "timed_s": r.get("timed_s"), "bound": p.bound})
    return rows


def _gib(n):
    return "-" if n is None else f"{n / 2**30:.2f}"


def _pct(x):
    return "-" if x is None else f"{x:+.1f}%"


def table(rows, title) -> str:
    lines = [f"### {title}\n",
             "| case | set | path | batch | prompt | new | tok/s meas | tok/s plan | error | "
             "allocated meas/plan GiB | reserved meas | reserved plan | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        c = x["case"]
        name = c["model"] + (" expandable" if c.get("expandable") else "") \
            + ("" if c.get("pin_memory", True) else " unpinned")
        lines.append(f"| {name} | {x['set']} | {c['path']} | {c['batch']} | {c['prompt_len']} | {c['new_tokens']} | "
                     f"{x['tok_meas']:.1f} | {x['tok_est']:.1f} | {_pct(x['tok_err'])} | "
                     f"{_gib(x['alloc_meas'])}/{_gib(x['alloc_est'])} | {_gib(x['res_meas'])} | {_gib(x['res_est'])} | "
                     f"{_pct(x['res_err'])} |")
    te = [abs(x["tok_err"]) for x in rows if not x["case"].get("history")]  # recording slows a run
    re_ = [abs(x["res_err"]) for x in rows if x["res_err"] is not None]
    if te:
        res = (f"median |error| {statistics.median(re_):.1f}%, worst {max(re_):.1f}%, "
               f"within 10%: {sum(e <= 10 for e in re_)}/{len(re_)}") if re_ else "not measured"
        lines.append(f"\ntokens/s: median |error| {statistics.median(te):.1f}%, worst {max(te):.1f}%, "
                     f"within 25%: {sum(e <= 25 for e in te)}/{len(te)}; reserved: {res}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--only", default=None)
    ap.add_argument("--no-calibrate", action="store_true")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--reestimate", nargs="+", default=None)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--set", default="all",
                    choices=("dev", "holdout", "validation", "run3", "run4", "rerun3", "hist4", "run6", "all"))
    ap.add_argument("--validation", action="store_true", help="measure the validation cases (run 2)")
    ap.add_argument("--run3", action="store_true", help="measure run 3's cases")
    ap.add_argument("--run4", action="store_true", help="measure run 4's cases")
    ap.add_argument("--run6", action="store_true", help="measure run 6's cases")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.reestimate:
        rows = reestimate(a.reestimate, a.profile, a.set, out)
        which = a.profile or "the run's own calibration (profile.json in the archive)"
        md = table(rows, f"bench/speed, {a.set} cases, profile: {which}")
        (out / f"results-{a.set}.md").write_text(md)
        (out / f"results-{a.set}.json").write_text(json.dumps(rows, indent=1))
        print(md)
        return 0
    start = time.time()
    sets = RUN6 if a.run6 else RUN4 if a.run4 else RUN3 if a.run3 else VALIDATION if a.validation else CASES
    models, cases = (TINY_MODELS, TINY_CASES) if a.tiny else (MODELS, sets)
    if a.only:
        keys = a.only.split(",")
        cases = [c for c in cases if any(k in c["id"] for k in keys)]
    models_dir = write_models(out, models)
    if not a.no_calibrate:
        log("calibrate")
        cmd = [sys.executable, "-m", "dsdoctor", "calibrate", "--out", str(out / "profile.json"), "--no-cache"]
        if a.nvme_path:
            cmd += ["--nvme-path", a.nvme_path]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
        t0 = time.time()
        with open(out / "calibrate.log", "w") as fh:
            rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=150).returncode
        log(f"calibrate exited {rc} after {time.time() - t0:.1f} s")
    measure(out, cases, models_dir, a.budget_s - (time.time() - start))
    log(f"done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
