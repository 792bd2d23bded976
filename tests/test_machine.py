import os
import stat

import pytest

from dsdoctor.machine import meminfo, nvidia_smi_gpus
from dsdoctor.plan.hardware import detect_gpus, detect_host_memory


def _fake_smi(tmp_path, monkeypatch, text, rc=0):
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\ncat <<'X'\n{text}\nX\nexit {rc}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.process
def test_gpus_from_nvidia_smi_respect_cuda_visible_devices(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, "0, NVIDIA H200, 143771\n1, NVIDIA H200, 143771\n2, NVIDIA H100, 81559")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    assert [(g.index, g.name) for g in nvidia_smi_gpus()] == [(1, "NVIDIA H200"), (2, "NVIDIA H100")]
    assert len(nvidia_smi_gpus(respect_visible=False)) == 3
    assert detect_gpus() == (2, 143771 * 2**20, "NVIDIA H200")  # plan reads the same thing


@pytest.mark.process
def test_broken_nvidia_smi_means_no_gpus(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, "NVIDIA-SMI has failed", rc=9)
    assert nvidia_smi_gpus() == [] and detect_gpus() is None


def test_host_memory_from_proc_meminfo():
    assert meminfo()["MemTotal"] == detect_host_memory() > 2**30


@pytest.mark.process
def test_first_gpu_name_and_compute_capability(tmp_path, monkeypatch):
    from dsdoctor.machine import gpu_capability, this_machine_gpu

    _fake_smi(tmp_path, monkeypatch, "0, Tesla V100-SXM2-32GB, 32768\n1, NVIDIA H200, 143771")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert this_machine_gpu() == "NVIDIA H200"
    _fake_smi(tmp_path, monkeypatch, "9.0\n7.0")
    assert gpu_capability() == 9.0
    _fake_smi(tmp_path, monkeypatch, "Field \"compute_cap\" is not a valid field to query.", rc=2)
    assert gpu_capability() is None and this_machine_gpu() is None
