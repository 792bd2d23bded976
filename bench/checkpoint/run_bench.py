"""dsdoctor merge vs DeepSpeed 0.19.8 zero_to_fp32 on one ZeRO-3 checkpoint: wall time, peak RSS, disk bandwidth.

  python bench/checkpoint/run_bench.py --ckpt /tmp/dsdoctor-bench/ckpt --out bench/checkpoint/results.json

Before each run: outputs removed, `sync`, page cache dropped (needs root; the JSON says whether it was).
Each tool runs as its own process; peak RSS is that process's ru_maxrss (resident pages, including touched
memory-mapped file pages, as `top` shows them). Time is until the process exits, then the `sync` that
flushes what it left in the page cache is timed separately and added for the "durable" time (dsdoctor
fsyncs its shards itself; zero_to_fp32 does not). The disk's sequential write and read bandwidth are
measured in the same run with a file as large as the output, and so is `cp` + `sync` of the fp32 partition
files (the same bytes in, the same bytes out: what the disk itself can do for a merge). Outputs are compared tensor by tensor.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); rc = subprocess.run(sys.argv[1:], "
           "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode; "
           "print(rc, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")


def drop_caches() -> bool:
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def timed_sync() -> float:
    t = time.perf_counter()
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t


def disk_bandwidth(directory: Path, size: int) -> dict:
    path = directory / "bandwidth.bin"
    block = os.urandom(16 * 2**20)
    drop_caches()
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as fh:
        written = 0
        while written < size:
            written += fh.write(block)
        os.fsync(fh.fileno())
    write_s = time.perf_counter() - t
    cold = drop_caches()
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(16 * 2**20)
        while fh.readinto(buf):
            pass
    read_s = time.perf_counter() - t
    path.unlink()
    return {"bytes": written, "write_MBps": written / write_s / 1e6, "read_MBps": written / read_s / 1e6,
            "read_cold_cache": cold}


def copy_baseline(files: list[Path], directory: Path) -> dict:
    """The disk's own copy speed for the bytes a merge moves: `cp` the fp32 partition files, then `sync`, cold."""
    target = directory / "copy-baseline"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    cold = drop_caches()
    t = time.perf_counter()
    subprocess.run(["cp", *map(str, files), str(target)], check=True)
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - t
    size = sum(f.stat().st_size for f in files)
    shutil.rmtree(target)
    return {"bytes": size, "seconds": seconds, "MBps": size / seconds / 1e6, "cold_cache": cold}


def run_tool(name: str, cmd: list[str], out: Path, env: dict | None = None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cold = drop_caches()
    load_before = os.getloadavg()
    print(f"[bench] {name}: {' '.join(cmd)}", flush=True)
    res = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True, check=True, env=env)
    rc, wall, rss = res.stdout.split()
    sync_s = timed_sync()
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    row = {"tool": name, "rc": int(rc), "load_average_before": load_before, "load_average_after": os.getloadavg(),
           "wall_s": float(wall), "sync_after_s": sync_s,
           "durable_s": float(wall) + sync_s, "peak_rss_bytes": int(rss), "output_bytes": size,
           "cold_cache": cold, "command": cmd}
    print(f"[bench] {name}: {json.dumps(row)}", flush=True)
    return row


def compare_outputs(a: Path, b: Path) -> dict:
    import torch
    from safetensors import safe_open

    def index(d):
        m = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"] \
            if (d / "model.safetensors.index.json").exists() else None
        if m is None:
            f = d / "model.safetensors"
            with safe_open(str(f), "pt") as fh:
                return {k: f for k in fh.keys()}
        return {k: d / v for k, v in m.items()}

    ia, ib = index(a), index(b)
    different = []
    for k in sorted(set(ia) & set(ib)):
        with safe_open(str(ia[k]), "pt") as fa, safe_open(str(ib[k]), "pt") as fb:
            if not torch.equal(fa.get_tensor(k), fb.get_tensor(k)):
                different.append(k)
    return {"common": len(set(ia) & set(ib)), "only_dsdoctor": sorted(set(ia) - set(ib)),
            "only_zero_to_fp32": sorted(set(ib) - set(ia)), "different": different}


def _versions(runs: list[dict], tools: dict) -> dict:
    """Every dsdoctor version in the rounds: its durable time over zero_to_fp32's in the same round."""
    z2f = {r["round"]: r["durable_s"] for r in runs if r["tool"] == "zero_to_fp32"}
    out = {}
    for name in tools:
        if name.startswith("dsdoctor merge"):
            mine = sorted((r["round"], r["durable_s"]) for r in runs if r["tool"] == name)
            ratios = [d / z2f[i] for i, d in mine]
            out[name] = {"durable_s": [d for _, d in mine], "ratio_per_round": ratios,
                         "ratio_median": statistics.median(ratios)}
    return out


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/dsdoctor-bench/ckpt")
    ap.add_argument("--work", default=None, help="where outputs go (default: next to the checkpoint)")
    ap.add_argument("--out", default=str(ROOT / "bench/checkpoint/results.json"))
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds of the two tools (default 3)")
    ap.add_argument("--before", help="a src/ folder of an earlier dsdoctor: its merge joins the interleaved rounds "
                                     "as 'dsdoctor merge (before)', and the summary gives after/before per round")
    ap.add_argument("--no-zero-to-fp32", action="store_true", help="leave DeepSpeed's tool out (with --before: "
                                                                   "compare the two dsdoctor versions only)")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=SRC",
                    help="another dsdoctor version (a src/ folder) in the interleaved rounds as 'dsdoctor merge (NAME)'; "
                         "the summary gives each version's time over zero_to_fp32's per round (repeatable)")
    ap.add_argument("--no-bf16", action="store_true", help="skip the --dtype bf16 run")
    return ap.parse_args()


def main():
    args = _args()
    ckpt = Path(args.ckpt)
    work = Path(args.work or ckpt.parent)
    tag_dir = ckpt / (ckpt / "latest").read_text().strip()
    ckpt_bytes = sum(f.stat().st_size for f in tag_dir.iterdir())
    params = json.loads((ckpt / "model" / "params.json").read_text())["parameters"]
    print(f"[bench] checkpoint {ckpt}: {params / 1e9:.2f}B parameters, {ckpt_bytes / 1e9:.2f} GB; expecting "
          "dsdoctor at <= 1/2 the time and RSS of zero_to_fp32", flush=True)

    env_py = [sys.executable]
    ours_out, ref_out, bf16_out = work / "out-dsdoctor", work / "out-zero_to_fp32", work / "out-dsdoctor-bf16"
    optim_files = sorted(tag_dir.glob("*optim_states.pt"))
    read_bytes = sum(f.stat().st_size for f in optim_files)
    disk = disk_bandwidth(work, ckpt_bytes)
    disk["copy"] = copy_baseline(optim_files, work)
    print(f"[bench] disk: {json.dumps(disk)}", flush=True)
    tools = {
        "dsdoctor merge": (env_py + ["-m", "dsdoctor", "merge", str(ckpt), str(ours_out), "--quiet",
                                     "--model", str(ckpt / "model")], ours_out),
        "zero_to_fp32": (env_py + ["-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(ref_out),
                                   "--safe_serialization"], ref_out),
    }
    envs = {name: None for name in tools}
    if args.before:
        before_out = work / "out-dsdoctor-before"
        tools["dsdoctor merge (before)"] = (env_py + ["-m", "dsdoctor", "merge", str(ckpt), str(before_out), "--quiet",
                                                      "--model", str(ckpt / "model")], before_out)
        envs["dsdoctor merge (before)"] = dict(os.environ, PYTHONPATH=str(Path(args.before).resolve()))
        envs["dsdoctor merge"] = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for spec in args.also:
        name, src = spec.split("=", 1)
        tools[f"dsdoctor merge ({name})"] = (env_py + ["-m", "dsdoctor", "merge", str(ckpt), str(work / f"out-{name}"),
                                                      "--quiet", "--model", str(ckpt / "model")], work / f"out-{name}")
        envs[f"dsdoctor merge ({name})"] = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
        envs["dsdoctor merge"] = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    if args.no_zero_to_fp32:
        del tools["zero_to_fp32"]
    runs = []
    for i in range(args.repeat):  # interleaved, alternating order, so load changes hit both tools alike
        order = list(tools) if i % 2 == 0 else list(reversed(tools))
        for name in order:
            cmd, out = tools[name]
            runs.append(dict(run_tool(name, cmd, out, envs.get(name)), round=i))
    if args.before:
        same_before = compare_outputs(ours_out, before_out)
        shutil.rmtree(before_out, ignore_errors=True)
        pairs = [(a, b) for a in runs for b in runs if a["round"] == b["round"] and a["tool"] == "dsdoctor merge"
                 and b["tool"] == "dsdoctor merge (before)"]
        ratios = [a["durable_s"] / b["durable_s"] for a, b in pairs]
        summary = {"rounds": args.repeat, "after_over_before_per_round": ratios,
                   "after_over_before_median": statistics.median(ratios),
                   "after_durable_s": [a["durable_s"] for a, _ in pairs],
                   "before_durable_s": [b["durable_s"] for _, b in pairs],
                   "after_peak_rss_bytes": [a["peak_rss_bytes"] for a, _ in pairs],
                   "before_peak_rss_bytes": [b["peak_rss_bytes"] for _, b in pairs],
                   "identical_tensors": not same_before["different"] and same_before["common"] > 0
                   and not same_before["only_dsdoctor"] and not same_before["only_zero_to_fp32"]}
        if args.no_zero_to_fp32:
            shutil.rmtree(ours_out, ignore_errors=True)
            result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                  "python": platform.python_version(),
                                  "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
                      "checkpoint": {"path": str(ckpt), "parameters": params, "bytes": ckpt_bytes},
                      "disk": disk, "runs": runs, "comparison": same_before, "summary": summary}
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
            print(json.dumps(summary), flush=True)
            return
    same = compare_outputs(ours_out, ref_out)
    if not args.no_bf16:
        bf16 = run_tool("dsdoctor merge --dtype bf16", env_py + ["-m", "dsdoctor", "merge", str(ckpt), str(bf16_out),
                                                                 "--quiet", "--dtype", "bf16"], bf16_out)
        runs.append(dict(bf16, round=0))
    for out in (ours_out, ref_out, bf16_out, *(out for _, out in tools.values())):
        shutil.rmtree(out, ignore_errors=True)
    for row in runs:
        # read + write at the separately measured sequential bandwidths, one after the other
        ideal = read_bytes / (disk["read_MBps"] * 1e6) + row["output_bytes"] / (disk["write_MBps"] * 1e6)
        row["ideal_s_at_measured_read_write_bandwidth"] = ideal
        row["fraction_of_read_write_bandwidth"] = ideal / row["durable_s"]
        # the same bytes copied by `cp` + sync: the disk's own copy speed
        row["fraction_of_cp_speed"] = disk["copy"]["seconds"] * row["output_bytes"] / disk["copy"]["bytes"] / row["durable_s"]

    def med(name, key):
        return statistics.median(r[key] for r in runs if r["tool"] == name)

    pairs = [(a, b) for a in runs for b in runs if a["round"] == b["round"] and a["tool"] == "dsdoctor merge"
             and b["tool"] == "zero_to_fp32"]
    summary = {
        "rounds": args.repeat,
        "time_ratio_per_round": [a["durable_s"] / b["durable_s"] for a, b in pairs],
        "time_ratio_median": statistics.median(a["durable_s"] / b["durable_s"] for a, b in pairs),
        "dsdoctor_durable_s_median": med("dsdoctor merge", "durable_s"),
        "zero_to_fp32_durable_s_median": med("zero_to_fp32", "durable_s"),
        "rss_ratio": med("dsdoctor merge", "peak_rss_bytes") / med("zero_to_fp32", "peak_rss_bytes"),
        "dsdoctor_fraction_of_read_write_bandwidth_median": med("dsdoctor merge", "fraction_of_read_write_bandwidth"),
        "dsdoctor_fraction_of_cp_speed_median": med("dsdoctor merge", "fraction_of_cp_speed"),
        "identical_tensors": not same["different"] and not same["only_zero_to_fp32"] and same["common"] > 0,
    }
    summary["versions"] = _versions(runs, tools)
    summary["load_average_during"] = [r["load_average_before"][0] for r in runs]
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
        "checkpoint": {"path": str(ckpt), "parameters": params, "bytes": ckpt_bytes, "fp32_partition_bytes": read_bytes},
        "disk": disk, "runs": runs, "comparison": same, "summary": summary,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
