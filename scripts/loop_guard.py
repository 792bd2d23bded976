"""The guard of the RL planner (``plan --loop`` and ``plan --loop --job``): what it says today, written to a folder
in ``scripts/guard.py``'s form, so that ``guard.py diff OLD NEW`` compares two such folders.

    python scripts/loop_guard.py OUT

Every RL job file of the tests (tests/data/rl) on two machines, jobs given as flags with each rollout engine, the
jobs the GPU bench evaluates as given (``evaluate_arrangement``), and ``plan(loop=True)`` on the guard's model
configs. JSON and text of each. No network, no GPU; about a minute.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RL = ROOT / "tests" / "data" / "rl"
LLAMA = ROOT / "src" / "dsdoctor" / "examples" / "llama-7b"
MACHINES = {"8xA100-40G": dict(gpu_memory="40GiB", gpu_name="A100", host_memory="1TiB"),
            "8xH100-80G": dict(gpu_memory="80GiB", gpu_name="H100", host_memory="512GiB")}
LOOP_MODELS = ("llama-7b", "qwen2-7b", "mixtral-8x7b", "gemma-2-9b", "qwen2-72b", "phi-2")


def _guard():
    spec = importlib.util.spec_from_file_location("guard", ROOT / "scripts" / "guard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _both(result) -> dict:
    return {"json": result.to_dict("en"), "text": result.to_text("en"), "text_zh": result.to_text("zh")}


def _run(call) -> dict:
    """The answer, or the refusal (a refusal must stay the same too)."""
    try:
        return call()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:400]}


def _arrangement(r) -> dict:
    """``evaluate_arrangement``'s answer in plain values (the bench reads these)."""
    return {"group": r.group, "need": r.gpu_need_bytes, "world": r.world, "fits": r.fits, "limits": r.limits,
            "host": r.host_peak_bytes, "times": r.seconds, "total_s": r.iteration_s, "samples_per_s": r.samples_per_s,
            "rollout_tokens_per_s": r.rollout_tokens_per_s, "notes": r.notes,
            "phases": {p.name: dict(p.parts) for p in r.phases}, "peak": r.peak.name}


def _two_models(gpus: int, engine: dict | str) -> dict:
    return {"gpus": gpus, "dtype": "bf16", "engine": engine,
            "models": {"actor": {"model": str(LLAMA), "stage": 3},
                       "reference": {"model": str(LLAMA), "stage": 3, "trainable": False}},
            "rollout": {"batch": 4, "prompt_len": 512, "new_tokens": 64}, "train": {"micro_batch": 2}}


def snapshot(out: Path) -> int:
    from dsdoctor import api
    from dsdoctor.config import rl
    from dsdoctor.plan.loop_job import evaluate_arrangement

    guard = _guard()
    n = 0
    for job in sorted(RL.iterdir()):
        if job.name in ("zero3.json",):
            continue
        for mname, machine in MACHINES.items():
            rec = _run(lambda job=job, machine=machine: _both(api.plan_job(str(job), detect=False, **machine)))
            guard._write(out / "loop" / f"job-{job.name}-{mname}.json", rec)
            n += 1
    flags = dict(actor=str(LLAMA), ref=f"{LLAMA}:frozen,zero3", critic="1.3B", reward="1.3B:frozen", batch=4,
                 prompt_len=256, new_tokens=128, gpus=8, counts="formula", detect=False)
    for engine in (None, "generate", "gather-once", "hybrid-engine", "vllm"):
        for dtype in ("fp16", "bf16"):
            rec = _run(lambda e=engine, d=dtype: _both(api.plan_job(engine=e, dtype=d, **flags,
                                                                           **MACHINES["8xA100-40G"])))
            guard._write(out / "loop" / f"flags-{engine}-{dtype}.json", rec)
            n += 1
    given = dict(actor=f"{LLAMA}:zero3", ref=f"{LLAMA}:frozen,zero3,offload", batch=2, prompt_len=512,
                 new_tokens=64, gpus=2, counts="formula", detect=False, **MACHINES["8xH100-80G"])
    rec = _run(lambda: _both(api.plan_job(**given)))
    guard._write(out / "loop" / "flags-given-zero3.json", rec)
    rec = _run(lambda: _both(api.plan_job(str(RL / "dschat_actor_ds_config.json"), actor="7B", gpus=8,
                                                detect=False, **MACHINES["8xA100-40G"])))
    guard._write(out / "loop" / "config-dschat-actor.json", rec)
    n += 2
    engines = ("generate", "gather-once", {"kind": "hybrid-engine", "pin": False}, "hybrid-engine",
               {"kind": "vllm", "gpu_memory_utilization": 0.5, "sleep": True}, {"kind": "vllm", "colocate": False,
                                                                               "gpus": 1})
    for gpus in (1, 2):
        for i, engine in enumerate(engines):
            rec = _run(lambda g=gpus, e=engine: _arrangement(evaluate_arrangement(
                rl.job_from_dict(_two_models(g, e)), gpu_memory="141GiB", gpu_name="H200", host_memory="1TiB",
                detect=False, counts="formula")))
            guard._write(out / "loop" / f"arrangement-g{gpus}-{i}.json", rec)
            n += 1
    models = {m.name: m for m in guard._models()}
    for name in LOOP_MODELS:
        rec = {}
        for gpus, mem in ((1, "80GiB"), (2, "141GiB"), (8, "40GiB")):
            rec[f"g{gpus}x{mem}"] = _run(lambda g=gpus, m=mem, name=name: _both(api.plan(
                str(models[name]), batch=4, prompt_len=512, new_tokens=64, gpus=g, gpu_memory=m, detect=False,
                host_memory="1TiB", gpu_name="H200", loop=True)))
        rec["with-config"] = _run(lambda name=name: _both(api.plan(
            str(models[name]), gpus=2, gpu_memory="80GiB", detect=False, loop=True,
            config=str(ROOT / "src" / "dsdoctor" / "examples" / "train_zero3_offload.json"))))
        guard._write(out / "loop" / f"plan-loop-{name}.json", rec)
        n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        ap.error(f"{args.out} is not empty")
    n = snapshot(args.out)
    print(f"{n} loop output file(s) in {args.out / 'loop'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
