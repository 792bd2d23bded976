"""``dsdoctor env``: versions and hardware, as a block to paste into a bug report."""
from __future__ import annotations

import contextlib
import io
import os
import platform
import sys
from dataclasses import asdict, dataclass, field

from dsdoctor._version import __version__
from dsdoctor.config.versions import installed
from dsdoctor.machine import Gpu, meminfo, nvidia_smi_gpus
from dsdoctor.proctree import SHM_DIR, leaked_deepspeed_shm
from dsdoctor.report.render import markdown_table
from dsdoctor.units import human_bytes

PACKAGES = ("torch", "deepspeed", "transformers", "accelerate", "safetensors", "pydantic", "hjson", "ninja")


@dataclass
class EnvResult:
    dsdoctor: str
    python: str
    platform: str
    packages: dict[str, str | None]
    torch_cuda: str | None = None
    cuda_available: bool = False
    gpus: list[Gpu] = field(default_factory=list)
    host_memory_bytes: int | None = None
    host_memory_available_bytes: int | None = None
    cpu_count: int | None = None
    ds_accelerator: str | None = None
    ds_ops: dict[str, bool] = field(default_factory=dict)  # op name -> compatible (can JIT-build)
    ds_ops_error: str | None = None
    leaked_shm_bytes: int = 0  # RAM held in /dev/shm by DeepSpeed CPU workspaces no process uses
    notes: list[str] = field(default_factory=list)

    def to_dict(self, lang: str = "en") -> dict:
        return asdict(self)

    def _rows(self):
        rows = [("dsdoctor", self.dsdoctor), ("Python", self.python), ("platform", self.platform)]
        rows += [(name, version or "not installed") for name, version in self.packages.items()]
        rows.append(("torch CUDA", self.torch_cuda or "none (CPU build)"))
        if self.gpus:
            for g in self.gpus:
                rows.append((f"GPU {g.index}", f"{g.name}, {human_bytes(g.total_bytes)}"))
        else:
            rows.append(("GPUs", "none visible"))
        rows.append(("host memory", f"{human_bytes(self.host_memory_bytes)} total, "
                                    f"{human_bytes(self.host_memory_available_bytes)} available"))
        rows.append(("CPU cores", str(self.cpu_count)))
        rows.append(("DeepSpeed accelerator", self.ds_accelerator or "-"))
        if self.ds_ops:
            ok = sorted(k for k, v in self.ds_ops.items() if v)
            no = sorted(k for k, v in self.ds_ops.items() if not v)
            rows.append(("DeepSpeed ops that can build", ", ".join(ok) or "none"))
            rows.append(("DeepSpeed ops that cannot", ", ".join(no) or "none"))
        elif self.ds_ops_error:
            rows.append(("DeepSpeed ops", self.ds_ops_error))
        return rows

    def to_text(self, lang: str = "en", style=None) -> str:
        width = max(len(k) for k, _ in self._rows())
        lines = [f"{k:<{width}}  {v}" for k, v in self._rows()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def to_markdown(self, lang: str = "en") -> str:
        return markdown_table(("", ""), self._rows()) + "".join(f"\n- {n}" for n in self.notes) + "\n"


def env(check_ops: bool = True) -> EnvResult:
    """Collect versions and hardware. ``check_ops`` imports DeepSpeed to ask which ops can JIT-build."""
    mem = meminfo()
    result = EnvResult(
        dsdoctor=__version__,
        python=sys.version.split()[0],
        platform=platform.platform(),
        packages={name: installed(name) for name in PACKAGES},
        host_memory_bytes=mem.get("MemTotal"),
        host_memory_available_bytes=mem.get("MemAvailable"),
        cpu_count=os.cpu_count(),
        ds_accelerator=os.environ.get("DS_ACCELERATOR"),
    )
    if result.packages["torch"]:
        try:
            import torch

            result.torch_cuda = torch.version.cuda
            result.cuda_available = torch.cuda.is_available()
            if result.cuda_available:
                for i in range(torch.cuda.device_count()):
                    p = torch.cuda.get_device_properties(i)
                    result.gpus.append(Gpu(i, p.name, int(p.total_memory)))
        except Exception as exc:  # a broken torch is exactly what env should report, not crash on
            result.notes.append(f"import torch failed: {type(exc).__name__}: {exc}")
    if not result.gpus:
        result.gpus = nvidia_smi_gpus(respect_visible=False)
    leaked = leaked_deepspeed_shm()
    if leaked:
        result.leaked_shm_bytes = sum(leaked.values())
        result.notes.append(
            f"{len(leaked)} DeepSpeed CPU all-reduce workspace(s) that no process uses hold "
            f"{human_bytes(result.leaked_shm_bytes)} of RAM in {SHM_DIR} (left by earlier CPU-accelerator runs); "
            f"free them with: rm {SHM_DIR}/deepspeed_allreduce_buffer_{os.getuid()}_*")
    if check_ops and result.packages["deepspeed"]:
        _deepspeed_ops(result)
    return result


def _deepspeed_ops(result: EnvResult) -> None:
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.accelerator import get_accelerator
            from deepspeed.ops.op_builder.all_ops import ALL_OPS
            from deepspeed.ops.op_builder.builder import probe_is_compatible

            result.ds_accelerator = get_accelerator()._name
            for name, builder in ALL_OPS.items():
                try:
                    result.ds_ops[name] = bool(probe_is_compatible(builder, False))
                except Exception:
                    result.ds_ops[name] = False
    except Exception as exc:
        result.ds_ops_error = f"could not ask DeepSpeed: {type(exc).__name__}: {exc}"
