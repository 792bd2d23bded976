"""Does a GPU (by name) support bf16? Compute capability 8.0 (Ampere) and later do; Volta/Turing/Pascal do not.
Read from ``--gpu-name`` or nvidia-smi; torch-free."""
from __future__ import annotations

# name fragments, most specific first: (fragment, sm >= 80)
_FRAGMENTS = (
    ("RTX 6000 ADA", True), ("RTX A", True), ("ADA", True), ("QUADRO RTX", False), ("RTX 6000", False),
    ("RTX 8000", False), ("TITAN V", False), ("TITAN RTX", False), ("RTX 20", False), ("GTX", False),
    ("V100", False), ("T4", False), ("P100", False), ("P40", False), ("P4", False), ("K80", False), ("M60", False),
    ("A100", True), ("A800", True), ("A10", True), ("A30", True), ("A40", True), ("A16", True), ("A2", True),
    ("H100", True), ("H800", True), ("H200", True), ("H20", True), ("GH200", True), ("B100", True), ("B200", True),
    ("GB200", True), ("B300", True), ("L40", True), ("L20", True), ("L4", True), ("RTX 30", True), ("RTX 40", True),
    ("RTX 50", True), ("MI2", True), ("MI3", True),
)


def bf16_supported(gpu_name: str | None) -> bool | None:
    """True for sm >= 80, False below, None when the name is unknown."""
    if not gpu_name:
        return None
    name = gpu_name.upper()
    for fragment, ok in _FRAGMENTS:
        if fragment in name:
            return ok
    return None


def this_machine_gpu() -> str | None:
    from dsdoctor.machine import nvidia_smi_gpus

    gpus = nvidia_smi_gpus()
    return gpus[0].name if gpus else None
