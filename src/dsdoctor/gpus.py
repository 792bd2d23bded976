"""What a GPU is, by its name: compute capability, bf16, memory and link bandwidths, FLOP/s.

The one table of GPU names in dsdoctor: ``check`` reads bf16 from it (``--gpu-name`` or nvidia-smi),
``plan`` reads the compute capability (bf16 or fp16 for the emitted config) and the bandwidths and FLOP/s
of its speed model. bf16 needs compute capability 8.0 (Ampere) or later; Volta/Turing/Pascal (V100 7.0,
T4 7.5) run fp16. Torch-free. Reading the GPUs of this machine is ``dsdoctor.machine``'s job.
"""
from __future__ import annotations

from dataclasses import dataclass

BF16_MIN = 8.0

# (HBM bytes/s, GPU<->GPU all-gather bytes/s, host->device bytes/s pinned, dense bf16 FLOP/s).
# Datasheet numbers; the speed model applies its own efficiency factors.
_H200 = (4.8e12, 450e9, 55e9, 989e12)
_H100_PCIE = (2.0e12, 60e9, 55e9, 756e12)
_H100 = (3.35e12, 450e9, 55e9, 989e12)
_H800 = (3.35e12, 200e9, 55e9, 989e12)
_H20 = (4.0e12, 450e9, 55e9, 148e12)
_B200 = (8.0e12, 900e9, 55e9, 2250e12)
_A100_SXM4_80GB = (2.0e12, 300e9, 25e9, 312e12)
_A100 = (1.6e12, 300e9, 25e9, 312e12)
_A800 = (2.0e12, 200e9, 25e9, 312e12)
_L40S = (0.86e12, 25e9, 25e9, 362e12)
_L40 = (0.86e12, 25e9, 25e9, 181e12)
_RTX_4090 = (1.0e12, 25e9, 25e9, 165e12)
_A10 = (0.6e12, 25e9, 25e9, 125e12)
_V100 = (0.9e12, 150e9, 12e9, 125e12)
GENERIC = (2.0e12, 200e9, 25e9, 300e12)  # a generic data-center GPU, for names without figures

# name fragment (upper case) -> compute capability (None where the fragment names a family whose
# capability varies; then the third field says whether the family has bf16), and the speed figures above
# (None: the generic ones). First match wins: a fragment comes before any shorter one it contains ("L40S"
# before "L40" before "L4", "H100 PCIE" before "H100", "RTX 6000 ADA" before "RTX 6000").
_GPUS: tuple[tuple[str, float | None, bool | None, tuple | None], ...] = (
    ("RTX 6000 ADA", 8.9, None, None),
    ("RTX A100", 8.6, None, _A100), ("RTX A10", 8.6, None, _A10),  # RTX A1000: A100 figures (it contains "A100")
    ("RTX A", 8.6, None, None),
    ("ADA", 8.9, None, None), ("QUADRO RTX", 7.5, None, None), ("RTX 6000", 7.5, None, None),
    ("RTX 8000", 7.5, None, None), ("TITAN V", 7.0, None, None), ("TITAN RTX", 7.5, None, None),
    ("RTX 20", 7.5, None, None), ("GTX 16", 7.5, None, None), ("GTX 10", 6.1, None, None),
    ("GTX", None, False, None),
    ("V100", 7.0, None, _V100), ("T4", 7.5, None, None), ("P100", 6.0, None, None), ("P40", 6.1, None, None),
    ("P4", 6.1, None, None), ("K80", 3.7, None, None), ("M60", 5.2, None, None),
    ("A100-SXM4-80GB", 8.0, None, _A100_SXM4_80GB), ("A100", 8.0, None, _A100), ("A800", 8.0, None, _A800),
    ("A10", 8.6, None, _A10), ("A30", 8.0, None, None), ("A40", 8.6, None, None), ("A16", 8.6, None, None),
    ("A2", 8.6, None, None),
    ("H100 PCIE", 9.0, None, _H100_PCIE), ("H100", 9.0, None, _H100), ("H800", 9.0, None, _H800),
    ("GH200", 9.0, None, _H200), ("H200", 9.0, None, _H200), ("H20", 9.0, None, _H20),
    ("GB200", 10.0, None, _B200), ("B100", 10.0, None, None), ("B200", 10.0, None, _B200),
    ("B300", 10.3, None, None),
    ("L40S", 8.9, None, _L40S), ("L40", 8.9, None, _L40), ("L20", 8.9, None, None), ("L4", 8.9, None, None),
    ("RTX 30", 8.6, None, None), ("4090", 8.9, None, _RTX_4090), ("RTX 40", 8.9, None, None),
    ("RTX 50", 12.0, None, None),
    ("MI2", None, True, None), ("MI3", None, True, None),  # AMD Instinct: no CUDA capability, bf16 yes
    ("A6000", 8.6, None, None), ("A5000", 8.6, None, None), ("A4000", 8.6, None, None),
    ("4080", 8.9, None, None), ("3090", 8.6, None, None), ("3080", 8.6, None, None), ("2080", 7.5, None, None),
)


@dataclass(frozen=True)
class GpuFacts:
    """What the table knows of one GPU name; ``row`` is the fragment that matched ("" when none did)."""

    row: str
    capability: float | None
    bf16: bool | None
    hbm_bandwidth: float
    gpu_gpu_bandwidth: float
    h2d_bandwidth: float
    flops: float
    generic_speeds: bool  # the bandwidths and FLOP/s are GENERIC's, not this GPU's


def gpu_facts(gpu_name: str | None) -> GpuFacts:
    """Everything the table says of ``gpu_name`` (``Tesla V100-SXM2-32GB``, ``H100``; any case)."""
    row = ("", None, None, None)
    if gpu_name:
        name = gpu_name.upper()
        row = next((r for r in _GPUS if r[0] in name), row)
    fragment, capability, bf16, speeds = row
    if capability is not None:
        bf16 = capability >= BF16_MIN
    hbm, gpu_gpu, h2d, flops = speeds or GENERIC
    return GpuFacts(fragment, capability, bf16, hbm, gpu_gpu, h2d, flops, speeds is None)


def has_bf16(capability: float | None) -> bool | None:
    """True for compute capability 8.0 and later, False below, None when unknown."""
    return None if capability is None else capability >= BF16_MIN


def run_dtype(dtype: str, capability: float | None) -> str:
    """The dtype the emitted config and code use: bf16 becomes fp16 on a GPU without bf16."""
    if dtype == "bf16" and capability is not None and capability < BF16_MIN:
        return "fp16"
    return dtype
