"""What this machine has, read without importing torch: GPUs from nvidia-smi, memory from /proc/meminfo.
The one reader of this machine's GPUs: ``plan`` (hardware defaults, compute capability), ``check`` (the GPU
whose bf16 decides the dtype), ``env`` (the bug-report block) and ``calibrate`` (the profile's fingerprint).
What a GPU is by its name is ``dsdoctor.gpus``'s job."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass
class Gpu:
    index: int
    name: str
    total_bytes: int


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, ...); empty where there is none."""
    from dsdoctor import door

    out = {}
    for line in (door.read_proc("/proc/meminfo", 1 << 20) or b"").decode("ascii", "replace").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


def nvidia_smi_gpus(respect_visible: bool = True) -> list[Gpu]:
    """GPUs nvidia-smi lists (only those CUDA_VISIBLE_DEVICES names by index, when set); [] without it."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        proc = subprocess.run([exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    if proc.returncode != 0:
        return []
    gpus = []
    for line in proc.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            gpus.append(Gpu(int(parts[0]), parts[1], int(float(parts[2])) * 2**20))
        except (IndexError, ValueError):
            continue
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if respect_visible else None
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if all(v.isdigit() for v in ids):
            gpus = [g for g in gpus if str(g.index) in ids]
    return gpus


def this_machine_gpu() -> str | None:
    """The name of the first visible GPU, or None."""
    gpus = nvidia_smi_gpus()
    return gpus[0].name if gpus else None


def gpu_capability() -> float | None:
    """The first GPU's compute capability from ``nvidia-smi --query-gpu=compute_cap``, or None (a separate
    query: drivers older than the ``compute_cap`` field fail it, and must still list their GPUs)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        proc = subprocess.run([exe, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
        return float(proc.stdout.split()[0]) if proc.returncode == 0 and proc.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
