"""What a GPU can compute in: its CUDA compute capability, and whether it has bf16.

Read from ``nvidia-smi --query-gpu=compute_cap`` when the machine has one (no torch), else from the GPU's
name. bf16 needs compute capability 8.0 (Ampere) or later; older GPUs (V100 7.0, T4 7.5) run fp16.
"""
from __future__ import annotations

import shutil
import subprocess

# name fragment -> compute capability; longest fragments first where one contains another
_CAPS = (
    ("RTX 6000 Ada", 8.9), ("RTX A6000", 8.6), ("A6000", 8.6), ("A5000", 8.6), ("A4000", 8.6),
    ("H200", 9.0), ("H100", 9.0), ("H800", 9.0), ("H20", 9.0), ("GH200", 9.0),
    ("B200", 10.0), ("B100", 10.0), ("GB200", 10.0),
    ("A100", 8.0), ("A800", 8.0), ("A30", 8.0), ("A40", 8.6), ("A10", 8.6), ("A16", 8.6), ("A2", 8.6),
    ("L40S", 8.9), ("L40", 8.9), ("L20", 8.9), ("L4", 8.9), ("4090", 8.9), ("4080", 8.9), ("3090", 8.6),
    ("3080", 8.6), ("V100", 7.0), ("TITAN V", 7.0), ("T4", 7.5), ("2080", 7.5), ("RTX 8000", 7.5),
    ("RTX 6000", 7.5), ("P100", 6.0), ("P40", 6.1), ("P4", 6.1), ("K80", 3.7),
)
BF16_MIN = 8.0


def capability_of(name: str | None) -> float | None:
    """Compute capability from a GPU name (``Tesla V100-SXM2-32GB`` -> 7.0), or None if unknown."""
    if not name:
        return None
    upper = name.upper()
    for fragment, cap in _CAPS:
        if fragment.upper() in upper:
            return cap
    return None


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
