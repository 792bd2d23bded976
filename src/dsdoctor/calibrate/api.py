"""``dsdoctor calibrate``: measure this machine's figures (about a minute) and write its profile.

Each measurement is a function of ``measure.py``; this module runs them in order under a time budget,
reports progress, and records what it could not measure and why. Collectives between GPUs run in one
process per GPU (``nccl_worker.py`` under ``torch.distributed.run``).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from dsdoctor import door
from dsdoctor.calibrate.profile import (
    FIGURES,
    MachineProfile,
    cache_path,
    fingerprint,
    machine_description,
    save_profile,
    write_profile,
)
from dsdoctor.calibrate.recheck import host_id
from dsdoctor.config.versions import installed
from dsdoctor.errors import InputError
from dsdoctor.i18n import message_table, pick
from dsdoctor.proctree import free_port
from dsdoctor.units import human_bytes

BUDGET_S = 60.0

TEXT = message_table("calibrate.api.TEXT")  # the words of the rendered calibration


@dataclass
class CalibrateResult:
    profile: MachineProfile
    written: list  # paths

    def to_dict(self, lang: str = "en") -> dict:
        return dict(self.profile.to_dict(), written=[str(p) for p in self.written])

    def _rows(self):
        m = self.profile.measured
        for name, (unit, what) in FIGURES.items():
            if name in m:
                yield name, _fmt(m[name], unit), what
        for name, why in self.profile.not_measured.items():
            yield name, "not measured", why

    def to_text(self, lang: str = "en", style=None) -> str:
        from dsdoctor.report.render import text_table

        p = self.profile
        gpus = p.machine.get("gpus") or []
        head = pick(TEXT["head"], lang).format(
            fingerprint=p.fingerprint, gpus=len(gpus), gpu=gpus[0]["name"] if gpus else pick(TEXT["no gpu"], lang),
            cpu=p.machine.get("cpu_model") or "CPU", when=p.calibrated_at, seconds=f"{p.duration_s:.0f}")
        cols = pick(TEXT["cols"], lang)
        out = [head, text_table(cols, list(self._rows()))]
        for w in self.written:
            out.append(pick(TEXT["wrote"], lang) + str(w) + "\n")
        return "".join(out)

    def to_markdown(self, lang: str = "en") -> str:
        from dsdoctor.report.render import markdown_table

        p = self.profile
        return (f"# dsdoctor calibrate\n\nmachine `{p.fingerprint}`, calibrated on {p.calibrated_at}\n\n"
                + markdown_table(("figure", "value", "what"), list(self._rows())) + "\n")


def _fmt(v: float, unit: str) -> str:
    if unit == "B/s":
        return f"{v / 1e9:.1f} GB/s"
    if unit == "s":
        return f"{v * 1e6:.1f} us" if v < 1e-2 else f"{v * 1e3:.1f} ms"
    if unit == "FLOP/s":
        return f"{v / 1e12:.1f} TFLOP/s"
    if unit == "B":
        return human_bytes(v)
    return f"{v:g}"


def _default_progress(msg: str) -> None:
    print(f"[calibrate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def calibrate(out=None, nvme_path=None, budget_s: float = BUDGET_S, cache: bool = True, progress=None,  # noqa: C901,PLR0912,PLR0915
              gpus_for_collectives: int | None = None, force: bool = False) -> CalibrateResult:
    """Measure this machine and write its profile (the per-machine cache file and/or ``out``: a new file, or
    with ``force`` a regular file replaced)."""
    progress = progress or _default_progress
    if nvme_path is not None and not os.path.isdir(nvme_path):
        raise InputError(f"--nvme-path {nvme_path}: not a directory")
    if out is not None and os.path.isdir(out):
        raise InputError(f"--out {out}: is a directory; give a file name")
    if out is not None:
        door.check_output_path(out, force, kind="file")  # before a minute of measuring
    if cache:
        door.check_cache_file(cache_path(fingerprint(machine_description())))
    start = time.time()
    measured: dict = {}
    missing: dict = {}

    def step(name, fn, *figures, needs_s: float = 0.0):
        left = budget_s - (time.time() - start)
        if left < needs_s:
            for f in figures:
                missing[f] = f"skipped: the {budget_s:.0f} s budget ran out"
            progress(f"{name}: skipped (budget)")
            return None
        progress(f"{name} ...")
        t0 = time.time()
        try:
            res = fn()
        except Exception as exc:  # one failed measurement must not lose the others
            why = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            for f in figures:
                missing[f] = why
            progress(f"{name}: {why}")
            return None
        progress(f"{name}: done in {time.time() - t0:.1f} s")
        return res

    try:
        import torch
    except ImportError:
        torch = None
    from dsdoctor.calibrate import measure as m

    gpu_figs = [k for k in FIGURES if k not in ("host_memcpy", "cpu_matmul_flops", "nvme_read")]
    if torch is not None:
        r = step("host memcpy", m.host_memcpy_bandwidth, "host_memcpy")
        if r:
            measured["host_memcpy"] = r
        r = step("CPU matmul", m.cpu_matmul_flops, "cpu_matmul_flops")
        if r:
            measured["cpu_matmul_flops"] = r
    else:
        missing["host_memcpy"] = missing["cpu_matmul_flops"] = "torch is not installed"
    cuda = torch is not None and torch.cuda.is_available()
    ngpu = torch.cuda.device_count() if cuda else 0
    if not cuda:
        why = "no GPU visible to torch" if torch is not None else "torch is not installed"
        for k in gpu_figs:
            missing[k] = why
        progress(f"{why}: GPU figures not measured")
    else:
        torch.cuda.set_device(0)
        r = step("host<->device copies", m.transfer_bandwidths, "h2d_pinned", "h2d_pageable", "d2h_pinned",
                 "d2h_pageable", "h2d_latency_s")
        if r:
            measured.update(r)
        r = step("HBM bandwidth", m.hbm_bandwidth, "hbm_copy", "hbm_weight_read")
        if r:
            measured["hbm_copy"], measured["hbm_weight_read"] = r["hbm_copy"], r["hbm_weight_read"]
            measured["_weight_read_by_batch"] = r["weight_read_by_batch"]
        r = step("bf16 matmul", m.matmul_flops, "matmul_flops", "matmul_flops_square")
        if r:
            measured["matmul_flops_square"] = r["square_8192"]
            measured["matmul_flops"] = r["tokens_2048_k4096_n14336"]
            measured["_matmul_by_shape"] = r
        r = step("attention", m.attention_flops, "attention_flops")
        if r:
            measured["attention_flops"] = r
        r = step("CUDA context", m.context_bytes, "context_bytes")
        if r:
            measured["context_bytes"] = r["context_bytes"]
        r = step("eager decode overheads (real-size layers, batch 1/16/64)",
                 lambda: m.eager_overheads(hbm_read=measured.get("hbm_weight_read"),  # leave ~25 s for ZeRO-3's
                                           extend_s=min(25.0, max(budget_s - (time.time() - start) - 25.0, 0.0))),
                 "eager_layer_s",
                 "eager_token_s", "eager_layer_s_b16", "eager_layer_s_b64", needs_s=15)
        if r:
            measured["eager_layer_s"] = r[1]["layer_s"]
            measured["eager_token_s"] = r[1]["token_s"]
            for b in (16, 64):
                measured[f"eager_layer_s_b{b}"] = r[b]["layer_s"]
                measured[f"eager_token_s_b{b}"] = r[b]["token_s"]
            measured["_eager"] = {str(k): v for k, v in r.items()}
        if installed("deepspeed") is None:
            missing["zero3_module_s"] = missing["zero3_offload_module_s"] = "DeepSpeed is not installed"
        else:
            _single_rank_env()
            r = step("ZeRO-3 hooks (real-size layers, one GPU)", m.zero3_hook_cost, "zero3_module_s", needs_s=8)
            if r:
                measured["zero3_module_s"] = r["extra_s"] / r["modules"]
                measured["_zero3"] = r
            r = step("ZeRO-3 offload hooks", lambda: m.zero3_hook_cost(offload=True), "zero3_offload_module_s",
                     needs_s=6)
            if r and measured.get("h2d_pinned"):
                # beyond plain: the hooks plus this stack's bytes from pinned host memory; keep the hooks
                copy = r["param_bytes"] / measured["h2d_pinned"]
                measured["zero3_offload_module_s"] = max(r["extra_s"] - copy, 0.0) / r["modules"]
                measured["_zero3_offload"] = r
        world = min(gpus_for_collectives or ngpu, ngpu)
        coll = ("allgather_bus_bw", "allgather_latency_s", "allreduce_bus_bw", "allreduce_latency_s",
                "autotp_allreduce_s")
        if world < 2:
            for k in coll:
                missing[k] = "one GPU: no collective to measure"
        else:
            r = step(f"NCCL all-gather/all-reduce over {world} GPUs",
                     lambda: _collectives(world, budget_s - (time.time() - start)),
                     *coll, needs_s=10)
            if r:
                big = str(max(int(k) for k in r["all_gather"]))
                measured["allgather_bus_bw"] = r["all_gather"][big]["bus_bytes_per_s"]
                measured["allreduce_bus_bw"] = r["all_reduce"][big]["bus_bytes_per_s"]
                measured["allgather_latency_s"] = r["all_gather_latency_s"]
                measured["allreduce_latency_s"] = r["all_reduce_latency_s"]
                if "autotp_all_reduce_s" in r:
                    measured["autotp_allreduce_s"] = r["autotp_all_reduce_s"]
                else:
                    missing["autotp_allreduce_s"] = r.get("autotp_all_reduce_error", "not measured")
                measured["_collectives"] = r
    if nvme_path is None:
        missing["nvme_read"] = "no --nvme-path given"
    else:
        r = step(f"read bandwidth of {nvme_path}", lambda: m.nvme_read_bandwidth(nvme_path), "nvme_read")
        if r:
            measured["nvme_read"] = r
    details = {k[1:]: measured.pop(k) for k in list(measured) if k.startswith("_")}
    gpus = None
    if cuda:
        gpus = [{"name": torch.cuda.get_device_name(i), "memory_mib": torch.cuda.get_device_properties(i).total_memory // 2**20}
                for i in range(ngpu)]
        smi = machine_description()["gpus"]
        if len(smi) == len(gpus):  # nvidia-smi's names, so that plan (no torch) computes the same fingerprint
            gpus = smi
    machine = machine_description(gpus)
    machine["host"] = host_id()  # which host (hashed): the fingerprint says only what kind (calibrate/recheck.py)
    software = {"torch": installed("torch"), "transformers": installed("transformers"),
                "deepspeed": installed("deepspeed"), "cuda": getattr(getattr(torch, "version", None), "cuda", None),
                "details": json.loads(json.dumps(details, default=str))}
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    profile = MachineProfile(fingerprint(machine), machine, now, measured, missing, software,
                             round(time.time() - start, 1))
    written = []
    if cache:
        written.append(save_profile(profile, cache_path(profile.fingerprint)))
    if out is not None:
        written.append(write_profile(profile, out, force=force))
    return CalibrateResult(profile, written)


def _single_rank_env():
    """deepspeed.initialize wants a process group: a one-rank one, on a free local port."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def _collectives(world: int, left_s: float) -> dict:
    with door.scratch_dir("dsdoctor-calibrate-") as tmp:
        out = os.path.join(tmp, "nccl.json")
        env = dict(os.environ)
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_port", str(free_port()), "-m", "dsdoctor.calibrate.nccl_worker", out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(left_s, 20))
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"NCCL workers exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
        return door.read_json(out, door.NCCL_RESULT)
