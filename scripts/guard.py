"""The guard of a refactor: what dsdoctor says today, written to a folder, and two such folders compared.

    python scripts/guard.py snapshot OUT            # static outputs (check, split, plan, explain) + GPU re-estimates
    python scripts/guard.py snapshot OUT --quick    # static outputs only (about a minute)
    python scripts/guard.py diff OLD NEW            # what changed, file by file, number by number

Take a snapshot on the base commit and one on the change; every difference the diff lists is either intended
(say so in the commit) or a regression. The re-estimates replay every archived GPU run in bench/ with the
current model (no GPU needed): allocated and reserved peaks per case, the figures BENCHMARKS.md quotes.
Runs in the project's virtual environment (`.venv/bin/python scripts/guard.py ...`); no network, no GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "corpus" / "ds_configs"
CONFIGS = [ROOT / "tests" / "data" / "configs", ROOT / "src" / "dsdoctor" / "examples"]
MODELS = ROOT / "tests" / "data" / "arch_configs"
EXAMPLES = ROOT / "src" / "dsdoctor" / "examples"
WORKLOADS = [dict(batch=1, prompt_len=512, new_tokens=128), dict(batch=8, prompt_len=2048, new_tokens=64)]
HARDWARE = [dict(gpus=1, gpu_memory="80GiB"), dict(gpus=8, gpu_memory="24GiB")]
VOLATILE = {"calibrated_at", "elapsed_s", "wall_s", "created", "date", "timestamp"}

# (name, argv after the interpreter): every archived GPU run that a bench can re-estimate without a GPU
REESTIMATES = [
    ("plan-gpu-run2-3", ["bench/plan/run.py", "{out}", "--reestimate", "bench/plan/runs/gpu-run2.tar.gz",
                         "bench/plan/runs/gpu-run3.tar.gz", "--device", "2 x NVIDIA H200 (140 GiB)"]),
    ("edge-run1", ["bench/plan/edge_gpu.py", "{out}", "--reestimate", "bench/plan/runs/edge-run1.tar.gz"]),
    # hold-out set 2 on one H100 (2026-12-07): judged out of sample first (BENCHMARKS.md), then added to the band
    ("edge-holdout2", ["bench/plan/edge_gpu.py", "{out}", "--reestimate", "bench/plan/runs/edge-holdout2-h100.tar.gz"]),
    # each with its own calibration; run 6 did not calibrate and is planned without a profile (BENCHMARKS.md)
    *[(f"speed-run{n}", ["bench/speed/run.py", "{out}", "--reestimate",
                         f"bench/speed/runs/2026-12-01-run{n}.tar.gz", "--set", "all"]) for n in range(1, 7)],
    *[(f"loading-gpu-run{n}", ["bench/plan/loading_gpu.py", "--reestimate",
                               f"bench/plan/runs/loading-gpu-run{n}.tar.gz"]) for n in (1, 2)],
]


def _configs() -> list[Path]:
    found = []
    for folder in ([CORPUS] if CORPUS.is_dir() else []) + CONFIGS:
        found += sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".yml", ".yaml", ".sh")
                        and p.name != "INDEX.tsv")
    return found


def _models() -> list[Path]:
    models = sorted(MODELS.glob("*.json")) + sorted(p / "config.json" for p in EXAMPLES.iterdir()
                                                   if (p / "config.json").is_file())
    out = Path(tempfile.mkdtemp(prefix="dsdoctor-guard-models-"))
    dirs = []
    for m in models:  # plan takes a folder or a config.json; one folder per model keeps names stable
        d = out / (m.parent.name if m.name == "config.json" else m.stem)
        d.mkdir()
        (d / "config.json").write_bytes(m.read_bytes())
        dirs.append(d)
    return dirs


def _clean(value):
    """Drop what changes from run to run (dates, timings of dsdoctor itself, temporary paths)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, str) and "dsdoctor-guard-" in value:
        return "<tmp>"
    return value


def _run(call) -> dict:
    try:
        result = call()
    except Exception as exc:  # the guard records a refusal as an output: it must stay the same too
        return {"error": type(exc).__name__, "message": str(exc)[:400]}
    return result.to_dict("en") if hasattr(result, "to_dict") else {"value": str(result)}


def static_snapshot(out: Path) -> int:
    from dsdoctor import api
    from dsdoctor.findings import RULES

    n = 0
    llama = EXAMPLES / "llama-7b"
    for cfg in _configs():
        rec = {"check": _run(lambda cfg=cfg: api.check(str(cfg))),
               "check_model": _run(lambda cfg=cfg: api.check(str(cfg), model=str(llama), gpus=2))}
        with tempfile.TemporaryDirectory(prefix="dsdoctor-guard-") as tmp:
            target = Path(tmp) / "infer.json"
            rec["split"] = _run(lambda cfg=cfg, target=target: api.split(str(cfg), str(target)))
            rec["split_file"] = target.read_text() if target.is_file() else None
        _write(out / "static" / f"config-{cfg.name}.json", rec)
        n += 1
    for model in _models():
        rec = {}
        for wl in WORKLOADS:
            for hw in HARDWARE:
                key = f"b{wl['batch']}-p{wl['prompt_len']}-g{hw['gpus']}x{hw['gpu_memory']}"
                rec[key] = _run(lambda wl=wl, hw=hw, m=model: api.plan(str(m), detect=False, **wl, **hw))
        rec["with-config"] = _run(lambda m=model: api.plan(str(m), detect=False, gpus=2, gpu_memory="40GiB",
                                                   config=str(EXAMPLES / "train_zero3_offload.json")))
        _write(out / "static" / f"plan-{model.name}.json", rec)
        n += 1
    _write(out / "static" / "explain.json", {code: api.explain(code) for code in sorted(RULES)})
    return n + 1


def reestimates(out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for name, argv in REESTIMATES:
        with tempfile.TemporaryDirectory(prefix="dsdoctor-guard-") as tmp:
            args = [a.replace("{out}", tmp) for a in argv]
            proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=1800)
            results = {p.name: json.loads(p.read_text()) for p in sorted(Path(tmp).glob("results*.json"))}
            rec = {"rc": proc.returncode, "results": results or None,
                   "stdout": proc.stdout if not results else proc.stdout[-2000:],
                   "stderr_tail": proc.stderr[-2000:] if proc.returncode else ""}
        _write(out / "reestimate" / f"{name}.json", rec)
        print(f"re-estimated {name}: rc {proc.returncode}", file=sys.stderr)


def _write(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(value), indent=1, sort_keys=True, default=str) + "\n")


# --------------------------------------------------------------------------------------------- diff

def _walk(a, b, where: str, out: list, tol: float) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a:
                out.append(f"{where}.{k}: added")
            elif k not in b:
                out.append(f"{where}.{k}: removed")
            else:
                _walk(a[k], b[k], f"{where}.{k}", out, tol)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{where}: {len(a)} -> {len(b)} items")
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{where}[{i}]", out, tol)
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if a != b and not math.isclose(a, b, rel_tol=tol, abs_tol=0):
            rel = f" ({(b - a) / a:+.2%})" if a else ""
            out.append(f"{where}: {a} -> {b}{rel}")
    elif a != b:
        out.append(f"{where}: {str(a)[:100]!r} -> {str(b)[:100]!r}")


def diff(old: Path, new: Path, tol: float, most: int) -> int:
    changed = 0
    names = sorted({p.relative_to(old) for p in old.rglob("*.json")} | {p.relative_to(new) for p in new.rglob("*.json")})
    for name in names:
        a, b = old / name, new / name
        if not a.is_file() or not b.is_file():
            print(f"{name}: only in {'new' if b.is_file() else 'old'}")
            changed += 1
            continue
        lines: list[str] = []
        _walk(json.loads(a.read_text()), json.loads(b.read_text()), "", lines, tol)
        if lines:
            changed += 1
            print(f"{name}: {len(lines)} difference(s)")
            for line in lines[:most]:
                print(f"  {line}")
            if len(lines) > most:
                print(f"  ... {len(lines) - most} more")
    print(f"{changed} of {len(names)} file(s) differ" if changed else f"no differences in {len(names)} file(s)")
    return 1 if changed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot", help="write today's outputs to OUT")
    s.add_argument("out", type=Path)
    s.add_argument("--quick", action="store_true", help="static outputs only, no GPU re-estimates")
    s.add_argument("--reestimates-only", action="store_true", help="only the GPU re-estimates")
    d = sub.add_parser("diff", help="compare two snapshots")
    d.add_argument("old", type=Path)
    d.add_argument("new", type=Path)
    d.add_argument("--tol", type=float, default=0.0, help="relative tolerance on numbers (default: exact)")
    d.add_argument("--most", type=int, default=12, help="differences shown per file")
    args = ap.parse_args(argv)
    if args.cmd == "diff":
        return diff(args.old, args.new, args.tol, args.most)
    if args.out.exists() and any(args.out.iterdir()) and not args.reestimates_only:
        ap.error(f"{args.out} is not empty")
    if not args.reestimates_only:
        n = static_snapshot(args.out)
        print(f"{n} static output file(s) in {args.out / 'static'}", file=sys.stderr)
    if not args.quick:
        reestimates(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
