"""The machine a plan is for: GPU count and memory, host memory, bandwidths.

Flags win; otherwise values are read from the machine (nvidia-smi, /proc/meminfo), never by importing
torch; bandwidths and FLOP/s come from the GPU's name (``dsdoctor.gpus``); anything still unknown is assumed
and said so in ``assumed``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dsdoctor.errors import InputError
from dsdoctor.gpus import gpu_facts
from dsdoctor.machine import meminfo, nvidia_smi_gpus
from dsdoctor.units import MAX_GPUS, number, parse_bytes

GiB = 1024**3

NVME_READ = 6e9  # one PCIe 4 NVMe drive, sequential read
MAX_MEMORY = 1 << 50  # 1 PiB


@dataclass
class Hardware:
    gpus: int
    gpu_memory: int  # bytes per GPU
    host_memory: int  # bytes on the host, all ranks together
    h2d_bandwidth: float  # bytes/s, pinned host memory to one GPU
    hbm_bandwidth: float
    gpu_gpu_bandwidth: float
    flops: float
    nvme_bandwidth: float = NVME_READ
    gpu_name: str | None = None
    detected: list = field(default_factory=list)  # what was read from the machine
    assumed: list = field(default_factory=list)  # what was neither given nor detected
    profile: dict | None = None  # the machine profile plan used: calibrated_at, source, figures still assumed
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF the plan assumed

    @property
    def h2d_assumed(self) -> bool:
        """The host-to-device bandwidth is the table's (not given with --h2d-bandwidth)."""
        return any(a.startswith("h2d_bandwidth") for a in self.assumed)

    def to_dict(self) -> dict:
        return asdict(self)


def detect_gpus() -> tuple[int, int, str] | None:
    """(count, bytes per GPU, name) of the visible GPUs, from nvidia-smi, or None."""
    gpus = nvidia_smi_gpus()
    return (len(gpus), gpus[0].total_bytes, gpus[0].name) if gpus else None


def detect_host_memory() -> int | None:
    return meminfo().get("MemTotal")


def make_hardware(gpus: int | None = None, gpu_memory=None, host_memory=None, h2d_bandwidth=None,  # noqa: PLR0912
                  gpu_name: str | None = None, detect: bool = True) -> Hardware:
    detected, assumed = [], []
    found = detect_gpus() if detect and (gpus is None or gpu_memory is None) else None
    if gpus is None:
        if found:
            gpus = found[0]
            detected.append("gpus")
        else:
            gpus = 1
            assumed.append("gpus=1")
    gpus = number(gpus, "--gpus", low=1, high=MAX_GPUS)
    if gpu_memory is None:
        if found:
            gpu_memory = found[1]
            detected.append("gpu_memory")
        else:
            gpu_memory = 80 * GiB
            assumed.append("gpu_memory=80GiB")
    gpu_memory = parse_bytes(gpu_memory, "--gpu-memory")
    if gpu_memory <= 0:
        raise InputError("--gpu-memory must be positive")
    if gpu_memory > MAX_MEMORY:
        raise InputError(f"--gpu-memory {gpu_memory} bytes is more than any GPU has (limit 1 PiB)")
    if host_memory is None:
        host_memory = detect_host_memory() if detect else None
        if host_memory:
            detected.append("host_memory")
        else:
            host_memory = 512 * GiB
            assumed.append("host_memory=512GiB")
    host_memory = parse_bytes(host_memory, "--host-memory")
    if host_memory <= 0 or host_memory > MAX_MEMORY:
        raise InputError(f"--host-memory must be between 1 byte and 1 PiB, not {host_memory}")
    name = gpu_name or (found[2] if found else None)
    facts = gpu_facts(name)
    if h2d_bandwidth is None:
        h2d = facts.h2d_bandwidth
        assumed.append(f"h2d_bandwidth={h2d / 1e9:.0f}GB/s")
    else:
        h2d = float(parse_bytes(h2d_bandwidth, "--h2d-bandwidth"))
        if h2d <= 0:
            raise InputError("--h2d-bandwidth must be positive")
    if facts.generic_speeds:
        assumed.append("bandwidths of a generic data-center GPU")
    return Hardware(gpus=gpus, gpu_memory=gpu_memory, host_memory=host_memory, h2d_bandwidth=h2d,
                    hbm_bandwidth=facts.hbm_bandwidth, gpu_gpu_bandwidth=facts.gpu_gpu_bandwidth,
                    flops=facts.flops, gpu_name=name, detected=detected, assumed=assumed)
