"""Recompute plan's measured band (src/dsdoctor/plan/band.json) from every archived GPU run in bench/.

    python scripts/band.py                  # re-estimate every archive (scripts/guard.py REESTIMATES), write band.json
    python scripts/band.py --check          # the same, compared with band.json: exit 1 when they differ
    python scripts/band.py --from SNAPSHOT  # from a guard snapshot's re-estimates (guard.py snapshot OUT) instead
    python scripts/band.py --verdicts [--from SNAPSHOT]  # what the band says on the archived capped runs

Each bench re-estimates its archive with the current model, no GPU (the same commands as the guard); this reads
their results: measured and predicted allocated and reserved peaks per run, grouped by path family, and writes
measured / predicted per family and figure with the runs, GPUs and dates it comes from
(``dsdoctor.plan.band.summarize``). Run it when runs are added to bench/*/runs/ or the memory model changes.

Which records count: a record that finished (a run that ran out of memory measured no peak); its reserved peak only
when no cap bound it (edge runs: uncapped, or capped with no allocator retry). Not counted: bench/plan gpu-run1
(its cases ran in one process and leaked memory into each other, BENCHMARKS.md), the loading runs (host memory),
and the rlloop, trace and compare runs (training loops and traced programs: no re-estimate of plan's figures).
"""
from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

import guard  # noqa: E402

from dsdoctor.plan.band import DATA, family, summarize  # noqa: E402

SCHEMA = "dsdoctor-band/1"


def _archives(argv: list) -> list[str]:
    return [a for a in argv if a.endswith(".tar.gz")]


def _gpu_of(archive: str) -> str:
    """The GPU that ran an archive: the first line of its nvidia-smi listing."""
    with tarfile.open(ROOT / archive) as tar:
        for m in tar.getmembers():
            if m.name.rsplit("/", 1)[-1] in ("gpu.txt", "nvidia-smi.txt"):
                lines = tar.extractfile(m).read().decode(errors="replace").splitlines()
                rows = [ln.split(",")[0].strip() for ln in lines[1:] if ln.strip() and "," in ln]
                if rows:
                    return f"{len(rows)} x {rows[0]}" if len(rows) > 1 else rows[0]
    return "2 x NVIDIA H200"  # bench/plan gpu-run2/3 hold no listing; BENCHMARKS.md names the machine


def _date_of(archive: str) -> str:
    with tarfile.open(ROOT / archive) as tar:
        return time.strftime("%Y-%m-%d", time.gmtime(max(m.mtime for m in tar.getmembers())))


def _row(fam: str, fig: str, predicted, measured, run: str) -> dict:
    return {"family": family(fam), "figure": fig, "predicted": predicted, "measured": measured, "run": run}


def rows_of(name: str, results: dict, run: str) -> list[dict]:
    """The (family, figure, predicted, measured) rows of one bench's re-estimate results."""
    out = []
    if name.startswith("plan-gpu"):
        for r in results["results.json"]["rows"]:
            est = r.get("estimate") or {}
            if r.get("ok") and "gpu_peak_bytes" in est:
                out += [_row(r["case"]["path"], "allocated", est["gpu_peak_bytes"], r["measured_peak_bytes"], run),
                        _row(r["case"]["path"], "reserved", est["gpu_reserved_bytes"], r["measured_reserved_bytes"], run)]
    elif name.startswith("edge"):
        for r in results["results-reestimate.json"]["rows"]:
            if r.get("observed") == "oom" and r.get("cap_applied") and r["cap"] != "none":
                # ran out of memory under its cap: it needed more reserved than the cap, at least the
                # allocated peak it reached; lower bounds that can only raise the worst case
                out += [dict(_row(r["case"]["path"], "reserved", r["plan"]["reserved"], r["cap_bytes"] + 1, run),
                             bound="at least"),
                        dict(_row(r["case"]["path"], "allocated", r["plan"]["allocated"], r.get("peak_allocated"), run),
                             bound="at least")]
            if r.get("observed") != "fits":
                continue
            out.append(_row(r["case"]["path"], "allocated", r["plan"]["allocated"], r.get("peak_allocated"), run))
            if r["cap"] == "none" or not r.get("alloc_retries"):
                out.append(_row(r["case"]["path"], "reserved", r["plan"]["reserved"], r.get("peak_reserved"), run))
    elif name.startswith("speed"):
        for r in results["results-all.json"]:
            out += [_row(r["case"]["path"], "allocated", r["alloc_est"], r["alloc_meas"], run),
                    _row(r["case"]["path"], "reserved", r["res_est"], r["res_meas"], run)]
    return out


def collect(snapshot: Path) -> list[dict]:
    rows = []
    for name, argv in guard.REESTIMATES:
        archives = _archives(argv)
        if name.startswith("loading") or not archives:
            continue
        rec = json.loads((snapshot / "reestimate" / f"{name}.json").read_text())
        if rec["rc"] != 0 or not rec["results"]:
            raise SystemExit(f"band: the re-estimate {name} failed (rc {rec['rc']}): {rec.get('stderr_tail', '')[-300:]}")
        gpu, date = _gpu_of(archives[0]), max(_date_of(a) for a in archives)
        for r in rows_of(name, rec["results"], name):
            rows.append(dict(r, gpu=gpu, date=date))
    return rows


def compute(snapshot: Path) -> dict:
    rows = collect(snapshot)
    families = summarize(rows)
    runs = sorted({r["run"] for r in rows})
    return {"schema": SCHEMA, "script": "scripts/band.py", "ratio": "measured / predicted",
            "records": len(rows), "runs": runs, "families": families}


def _upper_reserved(data: dict, path: str, reserved: int, allocated: int) -> int:
    """Plan's upper reserved figure on one GPU (``evaluate.upper_line`` less the outside bytes) from band data."""
    from dsdoctor.plan.band import Bands

    b = Bands(data).for_path(path)
    return max(b["reserved"].upper(reserved), b["allocated"].upper(allocated))


def verdicts(snapshot: Path, data: dict, room: float = 0.08) -> dict:
    """What the band changes on the archived one-GPU runs: of the capped edge runs that ran out of memory, how many
    plan calls "fits" (its upper figure fits the emulated GPU) and how many "edge"; of the runs with a measured
    reserved peak (edge runs uncapped, speed runs), how many it calls "fits" on a GPU ``room`` above it (plus
    plan's outside, which cancels)."""
    edge = json.loads((snapshot / "reestimate" / "edge-run1.json").read_text())["results"]["results-reestimate.json"]
    oom = {"fits": [], "edge": [], "does not fit": []}
    for r in edge["rows"]:
        if r["cap"] == "none" or r.get("observed") != "oom" or not r.get("cap_applied"):
            continue
        pl, gpu = r["plan"], r["emulated_gpu_bytes"]
        upper = _upper_reserved(data, r["case"]["path"], pl["reserved"], pl["allocated"]) + pl["outside"]
        oom["fits" if upper <= gpu else "edge" if pl["line"] <= gpu else "does not fit"].append(r["id"])
    measured = [(r["case"]["path"], r["plan"]["reserved"], r["plan"]["allocated"], r["peak_reserved"], r["id"])
                for r in edge["rows"] if r["cap"] == "none" and r.get("observed") == "fits"]
    for n in range(1, 7):
        rows = json.loads((snapshot / "reestimate" / f"speed-run{n}.json").read_text())["results"]["results-all.json"]
        measured += [(r["case"]["path"], r["res_est"], r["alloc_est"], r["res_meas"], f"speed-run{n}:{r['id']}")
                     for r in rows if r["case"]["gpus"] == 1 and r.get("res_meas")]
    roomy = {"fits": [], "edge": [], "does not fit": []}
    for path, reserved, allocated, meas, rid in measured:
        gpu = meas * (1 + room)
        upper = _upper_reserved(data, path, reserved, allocated)
        roomy["fits" if upper <= gpu else "edge" if reserved <= gpu else "does not fit"].append(rid)
    return {"capped_oom_runs": {k: len(v) for k, v in oom.items()}, "oom_called_fits": oom["fits"],
            f"runs_with_{room:.0%}_room": {k: len(v) for k, v in roomy.items()},
            "roomy_not_called_fits": roomy["edge"] + roomy["does not fit"]}


def _text(data: dict) -> str:
    """band.json as written: one line per entry and per family (a diff shows which band moved)."""
    head = [f' {json.dumps(k)}: {json.dumps(v, sort_keys=True)}' for k, v in sorted(data.items()) if k != "families"]
    fams = ",\n".join(f'  {json.dumps(f)}: {json.dumps(v, sort_keys=True)}' for f, v in data["families"].items())
    return "{\n" + ",\n".join([*head, ' "families": {\n' + fams + "\n }"]) + "\n}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with band.json; exit 1 when it differs")
    ap.add_argument("--from", dest="snapshot", type=Path, default=None,
                    help="a guard snapshot (guard.py snapshot OUT) whose re-estimates to read")
    ap.add_argument("--verdicts", action="store_true",
                    help="with band.json as it is: plan's verdicts on the archived capped runs that ran out of memory, "
                         "and on every one-GPU run with a measured reserved peak given 8%% of room above it")
    args = ap.parse_args(argv)
    if args.verdicts:
        with tempfile.TemporaryDirectory(prefix="dsdoctor-band-") as tmp:
            snap = args.snapshot or Path(tmp)
            if args.snapshot is None:
                guard.reestimates(snap)
            print(json.dumps(verdicts(snap, json.loads(DATA.read_text())), indent=1))
        return 0
    with tempfile.TemporaryDirectory(prefix="dsdoctor-band-") as tmp:
        snap = args.snapshot
        if snap is None:
            snap = Path(tmp)
            guard.reestimates(snap)
        data = compute(snap)
    text = _text(data)
    if args.check:
        same = DATA.is_file() and json.loads(DATA.read_text()) == data
        print("band.json is what the archives give" if same else "band.json differs from what the archives give: "
              "run python scripts/band.py")
        return 0 if same else 1
    DATA.write_text(text)
    for fam, figs in data["families"].items():
        print(fam, {fig: f"{b['low']:.3f}..{b['high']:.3f} n={b['n']}" for fig, b in figs.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
