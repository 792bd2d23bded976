"""What a GPU can compute in: its CUDA compute capability, and whether it has bf16.

Read from the GPU's name (the table in ``dsdoctor.config.gpu``), else from
``nvidia-smi --query-gpu=compute_cap`` when the machine has one (no torch). bf16 needs compute capability
8.0 (Ampere) or later; older GPUs (V100 7.0, T4 7.5) run fp16.
"""
from __future__ import annotations

import shutil
import subprocess

from dsdoctor.config.gpu import BF16_MIN, capability_of  # the one table of GPU names

__all__ = ["BF16_MIN", "capability_of", "detect_capability", "has_bf16", "run_dtype"]


def detect_capability() -> float | None:
    """The first visible GPU's compute capability from nvidia-smi, or None."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        proc = subprocess.run([exe, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
        return float(proc.stdout.split()[0]) if proc.returncode == 0 and proc.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def has_bf16(capability: float | None) -> bool | None:
    return None if capability is None else capability >= BF16_MIN


def run_dtype(dtype: str, capability: float | None) -> str:
    """The dtype the emitted config and code use: bf16 becomes fp16 on a GPU without bf16."""
    if dtype == "bf16" and capability is not None and capability < BF16_MIN:
        return "fp16"
    return dtype
