"""What a GPU (by name) computes in: its CUDA compute capability, and whether it has bf16.

The one table of GPU names in dsdoctor: ``check`` reads bf16 from it (``--gpu-name`` or nvidia-smi) and
``plan`` reads the compute capability (``dsdoctor.plan.gpu_caps``). bf16 needs compute capability 8.0
(Ampere) or later; Volta/Turing/Pascal (V100 7.0, T4 7.5) run fp16. Torch-free.
"""
from __future__ import annotations

BF16_MIN = 8.0

# name fragment (upper case) -> compute capability, or None where the fragment names a family whose
# capability varies (then the third field says whether the family has bf16). First match wins: a fragment
# comes before any shorter one it contains ("L40" before "L4", "RTX 6000 ADA" before "RTX 6000").
_GPUS: tuple[tuple[str, float | None, bool | None], ...] = (
    ("RTX 6000 ADA", 8.9, None), ("RTX A", 8.6, None), ("ADA", 8.9, None), ("QUADRO RTX", 7.5, None),
    ("RTX 6000", 7.5, None), ("RTX 8000", 7.5, None), ("TITAN V", 7.0, None), ("TITAN RTX", 7.5, None),
    ("RTX 20", 7.5, None), ("GTX 16", 7.5, None), ("GTX 10", 6.1, None), ("GTX", None, False),
    ("V100", 7.0, None), ("T4", 7.5, None), ("P100", 6.0, None), ("P40", 6.1, None), ("P4", 6.1, None),
    ("K80", 3.7, None), ("M60", 5.2, None),
    ("A100", 8.0, None), ("A800", 8.0, None), ("A10", 8.6, None), ("A30", 8.0, None), ("A40", 8.6, None),
    ("A16", 8.6, None), ("A2", 8.6, None),
    ("H100", 9.0, None), ("H800", 9.0, None), ("GH200", 9.0, None), ("H200", 9.0, None), ("H20", 9.0, None),
    ("GB200", 10.0, None), ("B100", 10.0, None), ("B200", 10.0, None), ("B300", 10.3, None),
    ("L40", 8.9, None), ("L20", 8.9, None), ("L4", 8.9, None),
    ("RTX 30", 8.6, None), ("RTX 40", 8.9, None), ("RTX 50", 12.0, None),
    ("MI2", None, True), ("MI3", None, True),  # AMD Instinct: no CUDA capability, bf16 yes
    ("A6000", 8.6, None), ("A5000", 8.6, None), ("A4000", 8.6, None),
    ("4090", 8.9, None), ("4080", 8.9, None), ("3090", 8.6, None), ("3080", 8.6, None), ("2080", 7.5, None),
)


def _lookup(gpu_name: str | None) -> tuple[float | None, bool | None]:
    if not gpu_name:
        return None, None
    name = gpu_name.upper()
    for fragment, capability, bf16 in _GPUS:
        if fragment in name:
            return capability, bf16 if capability is None else capability >= BF16_MIN
    return None, None


def capability_of(gpu_name: str | None) -> float | None:
    """Compute capability from a GPU name (``Tesla V100-SXM2-32GB`` -> 7.0), or None if unknown."""
    return _lookup(gpu_name)[0]


def bf16_supported(gpu_name: str | None) -> bool | None:
    """True for sm >= 80, False below, None when the name is unknown."""
    return _lookup(gpu_name)[1]


def this_machine_gpu() -> str | None:
    from dsdoctor.machine import nvidia_smi_gpus

    gpus = nvidia_smi_gpus()
    return gpus[0].name if gpus else None
