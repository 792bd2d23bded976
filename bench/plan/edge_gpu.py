"""Edge of capacity on one GPU: does a run fit exactly where ``dsdoctor plan`` says it does?

    python3 bench/plan/edge_gpu.py OUT_DIR [--budget-s 330] [--lanes 3] [--only SUBSTR,...] [--delta 0.02]
    python3 bench/plan/edge_gpu.py OUT_DIR --tiny                        # tiny models; on the CPU without a GPU
    python3 bench/plan/edge_gpu.py OUT_DIR --reestimate RUN.tar.gz|RAW.jsonl [...]   # no GPU: plan again

For each case (a model shape, a load path, batch x prompt x new tokens) plan gives its line: reserved +
outside the allocator (``fits`` is decided on it). The case then runs twice, each in a fresh process under
``torch.cuda.set_per_process_memory_fraction``: the caching allocator capped so that the GPU it emulates is
``delta`` of the line above it, then ``delta`` below it (cap = line x (1 +- delta) - plan's outside bytes).
Plan predicts "fits" above and "out of memory" below; each run says what happened: load and two
``generate`` calls (the warm-up and the timed one, as plan models) finished, or ``torch.OutOfMemoryError``
(where: load, warm-up or timed), with its peaks, the allocator's retries (``num_alloc_retries``: times it
freed its cache and tried again at the cap) and the memory used outside the allocator (``mem_get_info`` is the
whole GPU's: meaningful only for the uncapped runs, which run alone). Cases marked
``measure`` also run uncapped once, alone on the GPU, with the allocator's history recorded: their real
reserved peak (the zero3-offload reserved cases re-measured) and the events to replay offline.

Runs go in ``--lanes`` concurrent lanes (each cap bounds its process; the GPU has room for all), the
uncapped runs afterwards one at a time. Each run imports while the one before it in its lane works (a
``go`` file starts it). The driver stops launching at ``--budget-s`` and kills what still runs 25 s later.
Writes OUT_DIR/raw.jsonl (one line per run, plan's figures beside), results.md and results.json (the
table), and edge-run.tar.gz (allocator histories and every run's log), rewritten after each run; prints one
JSON line per run on stdout and a summary line last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench" / "speed"))

from cases import MODELS as SPEED_MODELS  # noqa: E402
from cases import TINY_MODELS  # noqa: E402

PHI3 = json.loads((ROOT / "tests" / "data" / "arch_configs" / "phi-3-mini-4k.json").read_text())
MODELS = dict(SPEED_MODELS, **{"phi3-mini": dict(PHI3, hidden_act="silu", rms_norm_eps=1e-5)})
DELTA = 0.02
JOB_TIMEOUT_S = 150


def case(model, path, batch, prompt, new, measure=False):
    return {"model": model, "path": path, "batch": batch, "prompt_len": prompt, "new_tokens": new,
            "measure": measure, "id": f"{model}-{path}-b{batch}-p{prompt}-n{new}"}


# Llama-, Qwen2-, Mistral- and Phi-3-shaped, every one-GPU path; batch x prompt where the KV cache and the
# activations are a large part of the line. Chosen before any was run. Ordered by what the budget must not lose.
CASES = [
    case("llama-8b", "zero3-offload", 16, 2048, 4, measure=True),  # recorded: 18.8 GiB reserved, plan 12.6
    case("llama-8b", "plain", 8, 2048, 16),
    case("phi3-mini", "plain", 8, 2048, 16),  # fused qkv_proj / gate_up_proj
    case("llama-3b", "zero3-offload", 8, 512, 8, measure=True),  # recorded: -15.9% reserved
    case("qwen2-7b", "plain", 4, 4096, 16),
    case("llama-8b", "zero3", 4, 2048, 8),
    case("qwen2-1.5b", "zero3-offload", 4, 1024, 8, measure=True),  # recorded: -13.3%
    case("mistral-7b", "plain", 16, 1024, 16),
    case("llama2-7b", "plain", 16, 256, 16, measure=True),  # recorded: -5.7%
    case("llama-8b", "zero3-offload", 8, 2048, 4, measure=True),  # recorded: -21.3%
    case("qwen2-1.5b", "zero3", 16, 1024, 8),
    case("llama-1b", "plain", 64, 128, 16, measure=True),  # recorded: -6.1%
    case("qwen2-7b", "zero3-offload", 1, 2048, 8, measure=True),  # recorded: -20.0%
]
# Hold-out set (run 2): shapes and batch x prompt never run before on any bench, chosen before running, to test
# plan's allocated peak and its line on runs it never saw. Qwen2.5-3B (tied 152k vocabulary, 2 KV heads) and a
# Mistral-Nemo-12B shape (head_dim 128 explicit while hidden / heads is 160; no sliding window).
HOLDOUT_MODELS = {
    "qwen2.5-3b": dict(SPEED_MODELS["qwen2-1.5b"], hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2),
    "nemo-12b": dict(SPEED_MODELS["mistral-7b"], hidden_size=5120, intermediate_size=14336, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                     max_position_embeddings=131072, rope_theta=1000000.0, sliding_window=None),
}
HOLDOUT_CASES = [
    case("qwen2.5-3b", "plain", 12, 1536, 16, measure=True),
    case("nemo-12b", "plain", 2, 4096, 16, measure=True),
    case("llama-8b", "plain", 3, 5000, 12, measure=True),
    case("qwen2.5-3b", "zero3", 6, 3072, 8, measure=True),
    case("phi3-mini", "zero3", 4, 3000, 8, measure=True),
    case("qwen2-7b", "zero3", 8, 1000, 8, measure=True),
    case("nemo-12b", "zero3-offload", 4, 2048, 4, measure=True),
]

# Hold-out set 2 (issue 29), chosen before running, none run yet: mixtures of experts, offload with long prompts,
# large vocabularies, sliding-window and hybrid (sliding + global) caches. Real configs from tests/data/arch_configs
# (random bf16 weights: a quantization_config is dropped), and three shapes scaled from them so that three capped
# lanes fit one H200 at once (every line below about 45 GiB; the largest host side, gpt-oss offloaded, 42 GB pinned).
def _arch(name: str, **change) -> dict:
    cfg = json.loads((ROOT / "tests" / "data" / "arch_configs" / f"{name}.json").read_text())
    cfg.pop("quantization_config", None)
    return dict(cfg, **change)


HOLDOUT2_MODELS = {
    "olmoe-1b-7b": _arch("olmoe-1b-7b"),  # 64 experts, top-8, no shared expert
    "qwen1.5-moe": _arch("qwen1.5-moe-a2.7b"),  # 60 experts top-4 + a gated shared expert, 152k vocabulary
    "deepseek-v2-lite": _arch("deepseek-v2-lite"),  # MLA attention, 64 routed + 2 shared experts
    "mixtral-8l": _arch("mixtral-8x7b", num_hidden_layers=8),  # Mixtral's experts (8, top-2), 8 of its 32 layers
    "gpt-oss-20b": _arch("gpt-oss-20b"),  # 32 experts top-4, sliding 128 / full alternating, 201k vocabulary
    "gemma2-9b": _arch("gemma-2-9b"),  # sliding 4096 / global alternating, 256k vocabulary, softcapping
    "gemma2-2b": _arch("gemma-2-9b", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, tie_word_embeddings=True),
    "gemma3-4b": dict(_arch("gemma-2-9b"), model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                      hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
                      layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(34)],
                      rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=131072,
                      query_pre_attn_scalar=256, final_logit_softcapping=None, attn_logit_softcapping=None,
                      tie_word_embeddings=True),
    "qwen3-8b": _arch("qwen3-8b"),  # q/k norms, 152k vocabulary
}
HOLDOUT2_CASES = [
    # mixtures of experts: router logits, top-k, dispatched tokens, expert workspaces
    case("olmoe-1b-7b", "plain", 8, 2048, 16, measure=True),
    case("olmoe-1b-7b", "zero3", 4, 4096, 8, measure=True),
    case("qwen1.5-moe", "plain", 4, 2048, 16, measure=True),
    case("qwen1.5-moe", "zero3-offload", 2, 4096, 4, measure=True),
    case("deepseek-v2-lite", "plain", 4, 2048, 16, measure=True),
    case("mixtral-8l", "plain", 4, 4096, 8, measure=True),
    case("gpt-oss-20b", "zero3-offload", 2, 8192, 4, measure=True),
    # offload with long prompts
    case("llama-8b", "zero3-offload", 1, 16384, 4, measure=True),
    case("qwen2-7b", "zero3-offload", 2, 8192, 4, measure=True),
    case("nemo-12b", "zero3-offload", 1, 16000, 4, measure=True),
    case("gemma2-9b", "zero3-offload", 1, 8192, 4, measure=True),
    # large vocabularies
    case("gemma2-2b", "plain", 16, 1024, 16, measure=True),
    case("gemma2-2b", "zero3", 8, 2048, 8, measure=True),
    case("qwen2.5-3b", "zero3-offload", 8, 2048, 4, measure=True),
    case("llama-3b", "plain", 32, 1024, 16, measure=True),
    # sliding-window and hybrid caches, prompts past the window
    case("mistral-7b", "plain", 2, 8192, 16, measure=True),
    case("mistral-7b", "zero3", 4, 6144, 8, measure=True),
    case("gemma2-9b", "plain", 2, 8192, 16, measure=True),
    case("gemma2-9b", "zero3", 4, 4096, 8, measure=True),
    case("gemma3-4b", "plain", 4, 8192, 16, measure=True),
    case("gemma3-4b", "zero3", 2, 16384, 8, measure=True),
    case("qwen3-8b", "plain", 4, 4096, 16, measure=True),
]
# MoE bench (issue 30 item 6): two MoE shapes cut to a few layers, every one-GPU path, uncapped (allocated,
# reserved, first and steady tokens/s): fused experts with top-k routing, 128 experts (Qwen3-MoE) and 64 (OLMoE).
MOE_MODELS = {"qwen3-moe-6l": _arch("qwen3-30b-a3b", num_hidden_layers=6),
              "olmoe-4l": _arch("olmoe-1b-7b", num_hidden_layers=4)}
MOE_CASES = [dict(case(m, p, 8, 512, 32, measure=True), capped=False)
             for m in MOE_MODELS for p in ("plain", "zero3", "zero3-offload")]
# Eager attention (a class without SDPA: gpt-oss's sinks): the B x H x S x S scores, uncapped, cut to 2 layers
EAGER_MODELS = {"gpt-oss-2l": _arch("gpt-oss-20b", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]),
                "gemma2-2b": HOLDOUT2_MODELS["gemma2-2b"]}  # Gemma-2: no SDPA (softcapping)
EAGER_CASES = [dict(case(m, "plain", b, p, 4, measure=True), capped=False)
               for m, b, p in (("gpt-oss-2l", 1, 2048), ("gpt-oss-2l", 2, 4096), ("gemma2-2b", 2, 4096))]
# Phi-3's pad_token_id (32000) inside a 32064 vocabulary: the zero3 case that crashed the hold-out run
TINY_PHI3 = dict(PHI3, hidden_act="silu", hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=256, original_max_position_embeddings=256)
TINY_CASES = [case("tiny", "plain", 2, 16, 4), case("tiny", "zero3", 2, 16, 4), case("tiny-phi3", "zero3", 2, 16, 4),
              case("tiny", "zero3-offload", 1, 8, 3, measure=True)]


def log(msg: str) -> None:
    print(f"[bench/edge {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_models(out: Path, models: dict) -> Path:
    d = out / "models"
    for m, cfg in models.items():
        (d / m).mkdir(parents=True, exist_ok=True)
        (d / m / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


# ------------------------------------------------------------------------------------------ plan's side

def predict(models_dir: Path, c: dict, gpu_name: str | None) -> dict:
    """Plan's figures for the case's path on one GPU (bf16, no DeepSpeed config, no machine profile)."""
    from dsdoctor.plan.api import plan

    res = plan(models_dir / c["model"], batch=c["batch"], prompt_len=c["prompt_len"], new_tokens=c["new_tokens"],
               dtype="bf16", gpus=1, gpu_memory=141 * 10**9, host_memory=2**40, detect=False,
               gpu_name=gpu_name or "H200", alloc_conf="")
    p = res.path(c["path"])
    return {"allocated": p.gpu_peak_bytes, "reserved": p.gpu_reserved_bytes,
            "outside": p.gpu_outside_allocator_bytes, "line": p.gpu_reserved_bytes + p.gpu_outside_allocator_bytes,
            "upper": p.upper_bytes}


def verdict_at(pred: dict, gpu_bytes: int | None) -> str | None:
    """Plan's three-valued verdict (DSD234) for a GPU of ``gpu_bytes``: fits (the band's upper figure fits), edge (the
    prediction fits, the upper figure does not), does not fit."""
    if not gpu_bytes or pred.get("upper") is None:
        return None
    return "fits" if pred["upper"] <= gpu_bytes else "edge" if pred["line"] <= gpu_bytes else "does not fit"


def caps_for(pred: dict, delta: float) -> dict:
    """The emulated GPU just above and just below plan's line, and the allocator cap that makes it."""
    out = {}
    for side, sign in (("above", 1), ("below", -1)):
        gpu = int(pred["line"] * (1 + sign * delta))
        out[side] = {"emulated_gpu_bytes": gpu, "cap_bytes": gpu - pred["outside"]}
    return out


# ------------------------------------------------------------------------------------------ one run

def worker(job: dict, models: Path, rec_path: Path, go: Path | None) -> int:
    """One run in this process: build, generate twice, under the job's cap (``dsdoctor.calibrate.run_case``, the
    runner ``plan --measure`` uses). Waits for its go file before the load. Writes ``rec_path``."""
    from dsdoctor.calibrate.run_case import run

    c = job["case"]
    config = json.loads((models / c["model"] / "config.json").read_text())
    concurrent = 0

    def start(torch):
        nonlocal concurrent
        if go is not None:
            while not go.exists():
                time.sleep(0.05)
            concurrent = int(go.read_text() or 0)
        if job.get("history") and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                     max_entries=5_000_000)

    def end(torch, rec):
        if job.get("history") and torch.cuda.is_available():
            rec["history_file"] = _write_history(torch, rec_path.parent, job["id"])

    rec = run({"config": config, "path": c["path"], "batch": c["batch"], "prompt_len": c["prompt_len"],
               "new_tokens": c["new_tokens"], "dtype": "bf16", "cap_bytes": job.get("cap_bytes")}, start, end)
    rec.update(id=job["id"], concurrent=concurrent)
    rec_path.write_text(json.dumps(rec))
    return 0


def _write_history(torch, where: Path, jid: str) -> str:
    """The allocator's events as gzipped JSON lines ``[action, addr, size, stream]`` (as bench/speed/case.py)."""
    import gzip

    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    name = f"hist-{jid}.jsonl.gz"
    with gzip.open(where / name, "wt") as fh:
        for e in snap["device_traces"][0]:
            fh.write(json.dumps([e["action"], e.get("addr"), e.get("size"), e.get("stream")]) + "\n")
    return name


# ------------------------------------------------------------------------------------------ the driver

class Lane:
    """Runs one job at a time; the next one imports meanwhile and waits for its go file."""

    def __init__(self, name: str):
        self.name, self.current, self.next = name, None, None

    def busy(self) -> bool:
        return self.current is not None


def spawn(job: dict, out: Path, models: Path) -> dict:
    jobs = out / "jobs"
    jobs.mkdir(exist_ok=True)
    go = jobs / f"{job['id']}.go"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "4")
    if not _cuda_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job), "--models", str(models),
           "--record", str(jobs / f"{job['id']}.json"), "--go", str(go)]
    logf = open(jobs / f"{job['id']}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    return {"job": job, "proc": proc, "go": go, "log": logf, "t0": None}


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_phase(jobs: list, lanes: int, out: Path, models: Path, deadline: float, finish) -> list:
    """Run ``jobs`` over ``lanes`` lanes; ``finish(job, record)`` after each. Returns the jobs not started."""
    queue = list(jobs)
    pool = [Lane(f"lane{i}") for i in range(lanes)]
    while True:
        now = time.time()
        for lane in pool:
            cur = lane.current
            if cur is not None:
                over = now - cur["t0"] > JOB_TIMEOUT_S or now > deadline + 25
                if cur["proc"].poll() is None and over:
                    _kill(cur["proc"])
                if cur["proc"].poll() is not None:
                    cur["log"].close()
                    finish(cur["job"], _record_of(cur, out))
                    lane.current = None
            if lane.current is None and lane.next is not None and now < deadline and _room(pool, lane.next["job"]):
                lane.current, lane.next = lane.next, None
                lane.current["go"].write_text(str(sum(lane2.busy() for lane2 in pool)))
                lane.current["t0"] = time.time()
            if lane.next is None and queue and now < deadline:
                lane.next = spawn(queue.pop(0), out, models)
        if not any(lane.current or lane.next for lane in pool) or (now > deadline and not any(lane.current for lane in pool)):
            break
        time.sleep(0.1)
    for lane in pool:  # waiting workers that never got their go
        if lane.next is not None:
            _kill(lane.next["proc"])
            lane.next["log"].close()
            queue.insert(0, lane.next["job"])
    return queue


def _gpu_total() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


def _room(pool: list, job: dict) -> bool:
    """Start a capped run only where the GPU has room for its cap beside the runs in flight (an H100 holds fewer
    lanes than an H200); an uncapped run, or one that fits no lanes beside it, starts alone."""
    running = [lane.current["job"] for lane in pool if lane.current is not None]
    if not running:
        return True
    need = job.get("emulated_gpu_bytes")
    busy = [r.get("emulated_gpu_bytes") for r in running]
    if need is None or None in busy:
        return False
    return sum(busy) + need <= _gpu_total() - 2 * 2**30


def _kill(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _record_of(cur: dict, out: Path) -> dict:
    path = out / "jobs" / f"{cur['job']['id']}.json"
    if path.exists():
        return json.loads(path.read_text())
    return {"id": cur["job"]["id"], "ok": False, "observed": "error", "phase": "killed",
            "error": f"worker exited {cur['proc'].returncode} without a record (timed out or crashed)"}


def jobs_for(cases: list, preds: dict, delta: float, cuda: bool) -> tuple[list, list]:
    """(capped jobs, uncapped jobs): below and above per case, interleaved so a budget cut loses whole cases."""
    capped, uncapped = [], []
    for c in cases:
        caps = caps_for(preds[c["id"]], delta)
        for side in ("above", "below") if c.get("capped", True) else ():
            capped.append({"id": f"{c['id']}-{side}", "case": c, "cap": side, **caps[side]} if cuda else
                          {"id": f"{c['id']}-{side}", "case": c, "cap": side, "emulated_gpu_bytes": None,
                           "cap_bytes": None})
        if c.get("measure"):
            uncapped.append({"id": f"{c['id']}-uncapped", "case": c, "cap": "none", "cap_bytes": None,
                             "emulated_gpu_bytes": None, "history": cuda and c.get("capped", True)})
    return capped, uncapped


def row_of(job: dict, rec: dict, pred: dict) -> dict:
    predicted = None if job["cap"] == "none" else job["cap"] == "above"
    return {**rec, "id": job["id"], "case": job["case"], "cap": job["cap"], "cap_bytes": job.get("cap_bytes"),
            "emulated_gpu_bytes": job.get("emulated_gpu_bytes"), "plan": pred, "predicted_fits": predicted,
            "observed_fits": {"fits": True, "oom": False}.get(rec.get("observed")),
            "right": None if predicted is None or rec.get("observed") not in ("fits", "oom") or not rec.get("cap_applied")
            else predicted == (rec["observed"] == "fits")}


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def results(rows: list, device: str, command: str) -> tuple[str, dict]:
    """The table: one line per case, its capped runs and its uncapped measurement."""
    by: dict = {}
    for r in rows:
        by.setdefault(r["case"]["id"], {})[r["cap"]] = r
    lines = [f"Device: {device}. Command: `{command}`.\n",
             "| case | path | batch x prompt + new | plan allocated / reserved / line GiB | GPU just above (cap) | "
             "observed | GPU just below (cap) | observed | uncapped, alone: allocated / reserved GiB, outside |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(r):
        if r is None:
            return "-", "not run"
        what = {"fits": "fits", "oom": f"OOM ({r.get('phase')})", "error": "error"}.get(r.get("observed"), "?")
        if r.get("alloc_retries"):
            what += f", {r['alloc_retries']} retries"
        if r.get("right") is False:
            what = f"**{what}** (plan: {'fits' if r['predicted_fits'] else 'OOM'})"
        return f"{_gib(r.get('emulated_gpu_bytes'))} ({_gib(r.get('cap_bytes'))})", what

    for runs in by.values():
        c = next(iter(runs.values()))["case"]
        pred = next(iter(runs.values()))["plan"]
        a_cap, a_obs = cell(runs.get("above"))
        b_cap, b_obs = cell(runs.get("below"))
        u = runs.get("none")
        meas = "-" if u is None or not u.get("ok") else (
            f"{_gib(u.get('peak_allocated'))} / {_gib(u.get('peak_reserved'))}, {_gib(u.get('outside_measured'))}")
        lines.append(f"| {c['model']} | {c['path']} | {c['batch']} x {c['prompt_len']} + {c['new_tokens']} | "
                     f"{_gib(pred['allocated'])} / {_gib(pred['reserved'])} / {_gib(pred['line'])} | {a_cap} | "
                     f"{a_obs} | {b_cap} | {b_obs} | {meas} |")
    judged = [r for r in rows if r.get("right") is not None]
    right = sum(r["right"] for r in judged)
    verdicts = {r["id"]: verdict_at(r["plan"], r.get("emulated_gpu_bytes")) for r in judged}
    summary = {"capped_runs": len(judged), "right": right, "wrong": [r["id"] for r in judged if not r["right"]],
               "errors": [r["id"] for r in rows if r.get("observed") == "error"],
               "verdicts": {v: sum(x == v for x in verdicts.values()) for v in ("fits", "edge", "does not fit")},
               "optimistic": [r["id"] for r in judged if verdicts[r["id"]] == "fits" and r["observed"] == "oom"],
               "fits_that_fit": sum(verdicts[r["id"]] == "fits" and r["observed"] == "fits" for r in judged),
               "edge_that_fit": sum(verdicts[r["id"]] == "edge" and r["observed"] == "fits" for r in judged)}
    lines.append(f"\nplan's fit / out-of-memory verdict right on {right} of {len(judged)} capped runs"
                 + (f"; wrong: {', '.join(summary['wrong'])}" if summary["wrong"] else "")
                 + (f"; errors: {', '.join(summary['errors'])}" if summary["errors"] else "") + ".")
    lines.append(f"\nWith the band (three verdicts at each capped run's GPU): {summary['verdicts']}; \"fits\" that ran out of "
                 f"memory: {len(summary['optimistic'])}" + (f" ({', '.join(summary['optimistic'])})" if summary["optimistic"]
                                                          else "") + f"; \"fits\" that fit: {summary['fits_that_fit']}; "
                 f"\"edge\" that fit: {summary['edge_that_fit']}.")
    return "\n".join(lines) + "\n", summary


def save(out: Path, rows: list, device: str, command: str) -> dict:
    with open(out / "raw.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    md, summary = results(rows, device, command)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps({"device": device, "command": command, "summary": summary,
                                                  "rows": rows}, indent=1))
    with tarfile.open(out / "edge-run.tar.gz", "w:gz") as tar:
        for f in sorted((out / "jobs").glob("*")) if (out / "jobs").is_dir() else []:
            if f.suffix in (".log", ".gz", ".json"):
                tar.add(f, arcname=f"jobs/{f.name}")
        tar.add(out / "raw.jsonl", arcname="raw.jsonl")
    return summary


def measure(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    cuda = _cuda_available()
    models, cases = (dict(TINY_MODELS, **{"tiny-phi3": TINY_PHI3}), TINY_CASES) if a.tiny else (MODELS, CASES)
    if a.set == "holdout":
        models, cases = dict(MODELS, **HOLDOUT_MODELS), HOLDOUT_CASES
    if a.set == "holdout2":
        models, cases = dict(MODELS, **HOLDOUT_MODELS, **HOLDOUT2_MODELS), HOLDOUT2_CASES
    if a.set == "moe":
        models, cases = dict(MODELS, **MOE_MODELS), MOE_CASES
    if a.set == "eager":
        models, cases = dict(MODELS, **EAGER_MODELS), EAGER_CASES
    if a.only:
        keys = a.only.split(",")
        cases = [c for c in cases if any(k in c["id"] for k in keys)]
    models_dir = write_models(out, models)
    device = "CPU (no caps)"
    gpu_name = None
    if cuda:
        import torch

        gpu_name = torch.cuda.get_device_name(0)
        device = f"1 x {gpu_name} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
    if a.write_preds:  # plan's figures computed here, carried to the GPU machine (plan takes seconds a case)
        table = {}
        for name in a.gpu_names.split(","):
            table[name] = {c["id"]: predict(models_dir, c, name) for c in cases}
        Path(a.write_preds).write_text(json.dumps(table, indent=1))
        return 0
    preds = json.loads(Path(a.preds).read_text()).get(gpu_name or "H200", {}) if a.preds else {}
    for c in cases:
        if c["id"] not in preds:
            preds[c["id"]] = predict(models_dir, c, gpu_name)
        log(f"plan {c['id']}: reserved {_gib(preds[c['id']]['reserved'])} GiB, line {_gib(preds[c['id']]['line'])} GiB")
    capped, uncapped = jobs_for(cases, preds, a.delta, cuda)
    rows: list = []
    command = " ".join(["python3", "bench/plan/edge_gpu.py", *sys.argv[1:]])

    def finish(job, rec):
        row = row_of(job, rec, preds[job["case"]["id"]])
        rows.append(row)
        save(out, rows, device, command)
        print(json.dumps({k: row.get(k) for k in ("id", "cap", "cap_bytes", "predicted_fits", "observed", "phase",
                                                  "right", "peak_allocated", "peak_reserved", "alloc_retries",
                                                  "outside_measured", "wall_s", "concurrent", "error")}), flush=True)
        log(f"{job['id']}: {rec.get('observed')} ({rec.get('phase')}) in {rec.get('wall_s', 0):.1f} s")

    deadline = start + a.budget_s
    left = run_phase(capped, a.lanes, out, models_dir, deadline - 0.3 * a.budget_s * bool(uncapped), finish)
    left += run_phase(uncapped, 1, out, models_dir, deadline, finish)
    left += run_phase(left, a.lanes, out, models_dir, deadline, finish) if time.time() < deadline else []
    for job in left:
        log(f"{job['id']}: not started (budget)")
    summary = save(out, rows, device, command)
    print(json.dumps({"device": device, "elapsed_s": round(time.time() - start), "runs": len(rows),
                      "not_started": len(left), **summary}), flush=True)
    return 0


def reestimate(a) -> int:
    """Plan again, with the current code, for recorded runs: is its verdict right at the recorded caps?"""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    models_dir = write_models(out, {**MODELS, **HOLDOUT_MODELS, **HOLDOUT2_MODELS, **TINY_MODELS, "tiny-phi3": TINY_PHI3})
    recs = []
    for f in a.reestimate:
        f = Path(f)
        if f.name.endswith(".tar.gz"):
            with tarfile.open(f) as tar:
                text = tar.extractfile("raw.jsonl").read().decode()
        else:
            text = f.read_text()
        recs += [json.loads(line) for line in text.splitlines() if line.strip()]
    preds: dict = {}
    rows = []
    for r in recs:
        c = r["case"]
        if c["id"] not in preds:
            preds[c["id"]] = predict(models_dir, c, "H200")
        pred = preds[c["id"]]
        job = {"id": r["id"], "case": c, "cap": r["cap"], "cap_bytes": r.get("cap_bytes"),
               "emulated_gpu_bytes": r.get("emulated_gpu_bytes")}
        row = row_of(job, r, pred)
        if r["cap"] != "none" and r.get("emulated_gpu_bytes"):  # the same emulated GPU, plan's new line
            row["predicted_fits"] = pred["line"] <= r["emulated_gpu_bytes"]
            row["right"] = (None if r.get("observed") not in ("fits", "oom") or not r.get("cap_applied")
                            else row["predicted_fits"] == (r["observed"] == "fits"))
        rows.append(row)
    md, summary = results(rows, "recorded GPU, re-estimated", " ".join(["python3", "bench/plan/edge_gpu.py",
                                                                         *sys.argv[1:]]))
    (out / "results-reestimate.md").write_text(md)
    (out / "results-reestimate.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(md)
    print(json.dumps(summary))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budget-s", type=float, default=330)
    ap.add_argument("--lanes", type=int, default=3)
    ap.add_argument("--delta", type=float, default=DELTA)
    ap.add_argument("--only", default=None)
    ap.add_argument("--set", choices=("run1", "holdout", "holdout2", "moe", "eager"), default="run1",
                    help="run1: the cases of edge run 1; holdout, holdout2: shapes and sizes no bench ran before; "
                         "moe: two MoE shapes, every one-GPU path, uncapped; eager: gpt-oss's eager attention")
    ap.add_argument("--preds", default=None, help="plan's figures per GPU name, written by --write-preds")
    ap.add_argument("--write-preds", default=None, help="write plan's figures for --gpu-names and stop")
    ap.add_argument("--gpu-names", default="NVIDIA H200,NVIDIA H100 80GB HBM3")
    ap.add_argument("--reestimate", nargs="+", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--models", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--go", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(json.loads(a.worker), Path(a.models), Path(a.record), Path(a.go) if a.go else None)
    if not a.out:
        ap.error("OUT_DIR is required")
    return reestimate(a) if a.reestimate else measure(a)


if __name__ == "__main__":
    sys.exit(main())
