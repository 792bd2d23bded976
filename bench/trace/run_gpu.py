"""GPU benchmark of dsdoctor trace/ab on a 7B-shaped Llama, 1 and 2 GPUs, plus the tracing overhead.

    python3 bench/trace/run_gpu.py OUT_DIR [--budget 400] [--smoke]

Runs unattended from the repository root (dsdoctor's src and DeepSpeed on PYTHONPATH), in two stages:
  stage 1, both GPUs:    ab on 2 GPUs (reused training config; each variant's report is a full 2-GPU trace).
  stage 2, side by side: GPU0: the overhead pairs (untraced, traced, untraced, traced; inference config, no
                         offload) with `dsdoctor trace`;  GPU1: ab on 1 GPU (its as-is variant is the 1-GPU trace).
Each ab variant's watchdog is an equal share of what is left of --budget seconds; a step that no longer fits
is skipped and said so. Writes OUT_DIR/summary.json (and each step's report directory); progress on stderr.
--smoke: the same steps with a 2-layer model on the CPU (DS_ACCELERATOR=cpu), one after the other.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_CFG = HERE / "train_zero3_offload.json"
INFER_CFG = HERE / "infer_zero3.json"
SCRIPT = HERE / "infer_7b.py"


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, out: Path, budget: float, smoke: bool):
        self.out, self.smoke = out, smoke
        self.deadline = time.time() + budget
        self.steps: list[dict] = []
        self.lock = threading.Lock()

    def left(self) -> float:
        return self.deadline - time.time()

    def env(self, gpus: str | None) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        if self.smoke:
            env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        elif gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        return env

    def user_command(self, nproc: int, config: Path, result: Path | None, new_tokens: int) -> list[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(SCRIPT), "--config", str(config), "--new-tokens", str(new_tokens)]
        if result:
            cmd += ["--result", str(result)]
        if self.smoke:
            cmd += ["--tiny"]
        return cmd

    def run(self, name: str, cmd: list[str], gpus: str | None, need_s: float) -> dict:
        step = {"name": name, "command": cmd, "gpus": gpus}
        left = self.left()
        if left < need_s:
            step.update(status="skipped", reason=f"{left:.0f}s left of the budget, needs about {need_s:.0f}s")
            log(f"{name}: skipped ({step['reason']})")
        else:
            log(f"{name}: start (gpus {gpus}, watchdog {left:.0f}s)")
            t0 = time.time()
            with open(self.out / f"{name}.log", "w") as fh:
                proc = subprocess.Popen(cmd, env=self.env(gpus), stdout=fh, stderr=subprocess.STDOUT)
                try:
                    step["returncode"] = proc.wait(timeout=left + 30)
                except subprocess.TimeoutExpired:  # SIGTERM: dsdoctor ends its ranks before it exits
                    proc.terminate()
                    step["returncode"] = proc.wait(timeout=60)
                    step["killed_by_budget"] = True
            step["wall_s"] = round(time.time() - t0, 1)
            step["status"] = "done"
            log(f"{name}: exit {step['returncode']} after {step['wall_s']}s")
        with self.lock:
            self.steps.append(step)
        return step

    def ab(self, name: str, nproc: int, gpus: str | None, need_s: float) -> dict:
        variants = ("as-is", "no-offload-param", "split")
        timeout = max(30, int((self.left() - 20) / len(variants)))  # per variant
        cmd = [sys.executable, "-m", "dsdoctor", "ab", "-q", "--format", "json", "--timeout", str(timeout),
               "--variants", ",".join(variants), "-o", str(self.out / name), "--force", "--",
               *self.user_command(nproc, TRAIN_CFG, None, 16), "--repeats", "1"]
        return self.run(name, cmd, gpus, need_s)

    def overhead(self, gpus: str | None, pairs: int = 2, only_traced: bool = False) -> None:
        for i in range(pairs):
            for traced in ((True,) if only_traced else (False, True)):
                name = f"overhead-{'traced' if traced else 'untraced'}-{i + (2 if only_traced else 0)}"
                result = self.out / f"{name}.json"
                user = self.user_command(1, INFER_CFG, result, 64)
                cmd = user if not traced else [sys.executable, "-m", "dsdoctor", "trace", "-q", "--format", "json",
                                                "--timeout", str(max(30, int(self.left() - 20))), "-o",
                                                str(self.out / name), "--force", "--", *user]
                self.run(name, cmd, gpus, need_s=40)

    def overhead_summary(self) -> dict:
        rates = {"untraced": [], "traced": []}
        for path in sorted(self.out.glob("overhead-*.json")):
            kind = "traced" if "-traced-" in path.name else "untraced"
            rates[kind].append(json.loads(path.read_text())["tokens_per_s"])
        if not rates["untraced"] or not rates["traced"]:
            return {"rates": rates, "overhead_percent": None}
        u, t = statistics.mean(rates["untraced"]), statistics.mean(rates["traced"])
        return {"rates": rates, "untraced_tokens_per_s": u, "traced_tokens_per_s": t,
                "overhead_percent": round(100 * (u - t) / u, 2), "within_3_percent": (u - t) / u <= 0.03}


def machine(smoke: bool) -> dict:
    info = {"python": sys.version.split()[0]}
    for mod in ("torch", "transformers", "deepspeed"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:
            info[mod] = f"unavailable: {type(exc).__name__}"
    if not smoke:
        try:
            import torch

            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
        except Exception:
            pass
    info["cpus"] = os.cpu_count()
    return info


def _gib(n):
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _rate(x):
    return "-" if x is None else f"{x:.1f}"


def results_markdown(out: Path, summary: dict) -> str:
    """The filled-in RESULTS.md, from the reports this run wrote."""
    m = summary["machine"]
    lines = ["# dsdoctor trace / ab on GPUs: results", "",
             "`PYTHONPATH=/tmp/site:$PWD/src python3 bench/trace/run_gpu.py $OUT/trace --budget 400`", "",
             f"Machine: {', '.join(m.get('gpus') or ['CPU smoke run'])}; CUDA {m.get('cuda')}; {m.get('cpus')} CPUs; "
             f"python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
             f"deepspeed {m['deepspeed']}. Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "## Tracing overhead (1 GPU, ZeRO-3 inference config, batch 4, prompt 128, 64 new tokens)", ""]
    o = summary["overhead"]
    lines += ["| run | tokens/s (each run) | mean |", "|---|---|---|",
              f"| untraced | {', '.join(_rate(x) for x in o['rates']['untraced'])} | "
              f"{_rate(o.get('untraced_tokens_per_s'))} |",
              f"| traced | {', '.join(_rate(x) for x in o['rates']['traced'])} | {_rate(o.get('traced_tokens_per_s'))} |",
              "", f"Overhead: {o.get('overhead_percent')} % (target: within 3%).", ""]
    lines += ["## The reused ZeRO-3 offload training config, as traced (the as-is variants)", "",
              "| GPUs | rank | stage | optimizer | optimizer bytes | offload param/opt | peak GPU | peak host | pinned "
              "| peak in | tokens/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for name, gpus in (("ab-1gpu", 1), ("ab-2gpu", 2)):
        report = out / name / "as-is" / "report.json"
        if not report.is_file():
            lines.append(f"| {gpus} | _not run_ | | | | | | | | | |")
            continue
        data = json.loads(report.read_text())
        for r in data["ranks"]:
            lines.append(f"| {gpus} | {r['rank']} | {r['zero_stage']} | {r['optimizer']} | "
                         f"{_gib(r['optimizer_state_bytes'])} | {r['offload_param']}/{r['offload_optimizer']} | "
                         f"{_gib(r['peak_gpu_bytes'])} | {_gib(r['peak_host_bytes'])} | {_gib(r['pinned_host_bytes'])} "
                         f"| {r['peak_phase']} | {_rate(r['tokens_per_s'])} |")
        notes.append(f"- {gpus} GPU(s), findings: " + "; ".join(f"{f['code']} {f['message']}" for f in data["findings"]))
    lines += [""] + notes + ["", "## ab", "", "| GPUs | variant | status | peak GPU | peak host | tokens/s (rank 0) | wall |",
              "|---|---|---|---|---|---|---|"]
    diag = []
    for name, gpus in (("ab-1gpu", 1), ("ab-2gpu", 2)):
        report = out / name / "report.json"
        if not report.is_file():
            lines.append(f"| {gpus} | _not run_ | | | | | |")
            continue
        data = json.loads(report.read_text())
        for v in data["variants"]:
            lines.append(f"| {gpus} | {v['name']} | {v['status']} | {_gib(v['peak_gpu_bytes'])} | "
                         f"{_gib(v['peak_host_bytes'])} | {_rate(v['tokens_per_s'])} | {v['wall_s']:.0f} s |")
        d = data.get("diagnosis")
        if d:
            diag.append(f"- {gpus} GPU(s): **{d['code']}** {d['message']} → {d['fix']}")
    lines += ["", "Diagnosis:", ""] + diag + [""]
    skipped = [st for st in summary["steps"] if st.get("status") == "skipped" or st.get("killed_by_budget")]
    if skipped:
        lines += ["Steps cut by the time budget: " + ", ".join(st["name"] for st in skipped), ""]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--budget", type=float, default=400, help="seconds for everything (default 400)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, to check the script")
    p.add_argument("--steps", default="ab-2gpu,ab-1gpu,overhead",
                   help="which steps to run (default: all): ab-2gpu, ab-1gpu, overhead, traced (one traced run only)")
    a = p.parse_args()
    steps = set(a.steps.split(","))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(out, a.budget, a.smoke)
    ngpu = 0
    if not a.smoke:
        import torch

        ngpu = torch.cuda.device_count()
    log(f"out {out}, budget {a.budget:.0f}s, GPUs {ngpu}, smoke {a.smoke}")
    log("expect: as-is builds DeepSpeedZeroOptimizer_Stage3 (DSD101) and is slowest (offload_param); split drops "
        "the optimizer (lower host peak); no-offload-param raises the GPU peak and tokens/s; tracing overhead within 3%")

    if (ngpu >= 2 or a.smoke) and "ab-2gpu" in steps:
        b.ab("ab-2gpu", 2, None if a.smoke else "0,1", 100)
    lane1 = threading.Thread(target=b.ab, args=("ab-1gpu", 1, None if a.smoke else "1", 100))
    run_lane1 = "ab-1gpu" in steps
    if ngpu >= 2 and run_lane1:
        lane1.start()
    if "overhead" in steps:
        b.overhead("0" if ngpu else None)
    elif "traced" in steps:  # one more traced sample for the overhead, next to earlier runs' samples
        b.overhead("0" if ngpu else None, pairs=1, only_traced=True)
    if run_lane1:
        if ngpu >= 2:
            lane1.join()
        else:
            b.ab("ab-1gpu", 1, None if a.smoke else "0", 100)

    summary = {"gpus": ngpu, "smoke": a.smoke, "steps": b.steps, "overhead": b.overhead_summary()}
    for name in ("ab-1gpu", "ab-2gpu", "overhead-traced-0"):
        report = out / name / "report.json"
        if report.is_file():
            data = json.loads(report.read_text())
            if "variants" in data:
                summary[name] = {"variants": [{k: v.get(k) for k in ("name", "status", "peak_gpu_bytes",
                                                                    "peak_host_bytes", "tokens_per_s")}
                                              for v in data["variants"]],
                                 "diagnosis": data.get("diagnosis")}
            else:
                summary[name] = {"status": data["status"], "peak_gpu_bytes": data["peak_gpu_bytes"],
                                 "peak_host_bytes": data["peak_host_bytes"], "tokens_per_s": data["tokens_per_s"],
                                 "findings": [f["code"] for f in data["findings"]]}
    summary["machine"] = machine(a.smoke)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "RESULTS.md").write_text(results_markdown(out, summary))
    log(f"overhead: {summary['overhead']}")
    print(json.dumps({"summary": str(out / "summary.json"), "overhead": summary["overhead"]}))


if __name__ == "__main__":
    main()
