"""GPU facts by name: one table (``dsdoctor.gpus``) for check's bf16 and plan's capability and speeds.

The expected values are what the two tables it replaced (``config/gpu.py`` and ``plan/hardware.py``) answered
for each name; a real GPU name must keep its answers when a row is added or moved (first match wins).
"""
import pytest

from dsdoctor.gpus import BF16_MIN, GENERIC, gpu_facts, has_bf16, run_dtype

# (HBM bytes/s, all-gather bytes/s, host->device bytes/s, FLOP/s) by the speed row a name matched; "" none
SPEEDS = {
    "H200": (4.8e12, 450e9, 55e9, 989e12), "H100 PCIe": (2.0e12, 60e9, 55e9, 756e12),
    "H100": (3.35e12, 450e9, 55e9, 989e12), "H800": (3.35e12, 200e9, 55e9, 989e12),
    "H20": (4.0e12, 450e9, 55e9, 148e12), "B200": (8.0e12, 900e9, 55e9, 2250e12),
    "A100-SXM4-80GB": (2.0e12, 300e9, 25e9, 312e12), "A100": (1.6e12, 300e9, 25e9, 312e12),
    "A800": (2.0e12, 200e9, 25e9, 312e12), "L40S": (0.86e12, 25e9, 25e9, 362e12),
    "L40": (0.86e12, 25e9, 25e9, 181e12), "4090": (1.0e12, 25e9, 25e9, 165e12),
    "A10": (0.6e12, 25e9, 25e9, 125e12), "V100": (0.9e12, 150e9, 12e9, 125e12),
    "": (2.0e12, 200e9, 25e9, 300e12),
}

# name (as nvidia-smi prints it, or as typed after --gpu-name) -> compute capability, bf16, speed row
NAMES = [
    # NVIDIA data center, as nvidia-smi prints them
    ("NVIDIA H100 80GB HBM3", 9.0, True, "H100"),
    ("NVIDIA H100 PCIe", 9.0, True, "H100 PCIe"),
    ("NVIDIA H100 NVL", 9.0, True, "H100"),
    ("NVIDIA H100", 9.0, True, "H100"),
    ("NVIDIA H100 SXM5 80GB", 9.0, True, "H100"),
    ("NVIDIA H800", 9.0, True, "H800"),
    ("NVIDIA H800 PCIe", 9.0, True, "H800"),
    ("NVIDIA H200", 9.0, True, "H200"),
    ("NVIDIA H200 NVL", 9.0, True, "H200"),
    ("NVIDIA H20", 9.0, True, "H20"),
    ("NVIDIA GH200 480GB", 9.0, True, "H200"),
    ("NVIDIA GH200 144G HBM3e", 9.0, True, "H200"),
    ("NVIDIA B200", 10.0, True, "B200"),
    ("NVIDIA GB200", 10.0, True, "B200"),
    ("NVIDIA B100", 10.0, True, ""),
    ("NVIDIA B300 SXM6 AC", 10.3, True, ""),
    ("NVIDIA GB10", None, None, ""),
    ("NVIDIA A100-SXM4-80GB", 8.0, True, "A100-SXM4-80GB"),
    ("NVIDIA A100-SXM4-40GB", 8.0, True, "A100"),
    ("NVIDIA A100-PCIE-40GB", 8.0, True, "A100"),
    ("NVIDIA A100 80GB PCIe", 8.0, True, "A100"),
    ("NVIDIA A100-SXM-80GB", 8.0, True, "A100"),
    ("NVIDIA A800-SXM4-80GB", 8.0, True, "A800"),
    ("NVIDIA A800 80GB PCIe", 8.0, True, "A800"),
    ("NVIDIA A10", 8.6, True, "A10"),
    ("NVIDIA A10G", 8.6, True, "A10"),
    ("NVIDIA A30", 8.0, True, ""),
    ("NVIDIA A40", 8.6, True, ""),
    ("NVIDIA A16", 8.6, True, ""),
    ("NVIDIA A2", 8.6, True, ""),
    ("NVIDIA L40S", 8.9, True, "L40S"),
    ("NVIDIA L40", 8.9, True, "L40"),
    ("NVIDIA L4", 8.9, True, ""),
    ("NVIDIA L20", 8.9, True, ""),
    ("Tesla V100-SXM2-32GB", 7.0, False, "V100"),
    ("Tesla V100-SXM2-16GB", 7.0, False, "V100"),
    ("Tesla V100-PCIE-32GB", 7.0, False, "V100"),
    ("Tesla V100-PCIE-16GB", 7.0, False, "V100"),
    ("Tesla V100S-PCIE-32GB", 7.0, False, "V100"),
    ("Tesla V100-SXM3-32GB", 7.0, False, "V100"),
    ("Tesla T4", 7.5, False, ""),
    ("Tesla P100-PCIE-16GB", 6.0, False, ""),
    ("Tesla P100-SXM2-16GB", 6.0, False, ""),
    ("Tesla P40", 6.1, False, ""),
    ("Tesla P4", 6.1, False, ""),
    ("Tesla K80", 3.7, False, ""),
    ("Tesla K40m", None, None, ""),
    ("Tesla M60", 5.2, False, ""),
    ("Tesla M40 24GB", None, None, ""),
    # workstation
    ("Quadro RTX 8000", 7.5, False, ""),
    ("Quadro RTX 6000", 7.5, False, ""),
    ("Quadro RTX 5000", 7.5, False, ""),
    ("Quadro GV100", 7.0, False, "V100"),
    ("Quadro P6000", None, None, ""),
    ("NVIDIA RTX A6000", 8.6, True, ""),
    ("NVIDIA RTX A5500", 8.6, True, ""),
    ("NVIDIA RTX A5000", 8.6, True, ""),
    ("NVIDIA RTX A4500", 8.6, True, ""),
    ("NVIDIA RTX A4000", 8.6, True, ""),
    ("NVIDIA RTX A2000", 8.6, True, ""),
    ("NVIDIA RTX A2000 12GB", 8.6, True, ""),
    ("NVIDIA RTX A1000", 8.6, True, "A100"),
    ("NVIDIA RTX 6000 Ada Generation", 8.9, True, ""),
    ("NVIDIA RTX 5000 Ada Generation", 8.9, True, ""),
    ("NVIDIA RTX 4000 Ada Generation", 8.9, True, ""),
    ("NVIDIA RTX 4000 SFF Ada Generation", 8.9, True, ""),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", None, None, ""),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", None, None, ""),
    ("NVIDIA TITAN V", 7.0, False, ""),
    ("NVIDIA TITAN RTX", 7.5, False, ""),
    ("NVIDIA TITAN Xp", None, None, ""),
    ("NVIDIA GeForce GTX TITAN X", None, False, ""),
    # consumer
    ("NVIDIA GeForce RTX 5090", 12.0, True, ""),
    ("NVIDIA GeForce RTX 5080", 12.0, True, ""),
    ("NVIDIA GeForce RTX 4090", 8.9, True, "4090"),
    ("NVIDIA GeForce RTX 4090 D", 8.9, True, "4090"),
    ("NVIDIA GeForce RTX 4080 SUPER", 8.9, True, ""),
    ("NVIDIA GeForce RTX 4080", 8.9, True, ""),
    ("NVIDIA GeForce RTX 4070 Ti", 8.9, True, ""),
    ("NVIDIA GeForce RTX 4060", 8.9, True, ""),
    ("NVIDIA GeForce RTX 3090", 8.6, True, ""),
    ("NVIDIA GeForce RTX 3090 Ti", 8.6, True, ""),
    ("NVIDIA GeForce RTX 3080", 8.6, True, ""),
    ("NVIDIA GeForce RTX 3080 Ti", 8.6, True, ""),
    ("NVIDIA GeForce RTX 3070", 8.6, True, ""),
    ("NVIDIA GeForce RTX 3060", 8.6, True, ""),
    ("NVIDIA GeForce RTX 2080 Ti", 7.5, False, ""),
    ("NVIDIA GeForce RTX 2080 SUPER", 7.5, False, ""),
    ("NVIDIA GeForce RTX 2070", 7.5, False, ""),
    ("NVIDIA GeForce RTX 2060", 7.5, False, ""),
    ("NVIDIA GeForce GTX 1080 Ti", 6.1, False, ""),
    ("NVIDIA GeForce GTX 1070", 6.1, False, ""),
    ("NVIDIA GeForce GTX 1660 Ti", 7.5, False, ""),
    ("NVIDIA GeForce GTX 1650", 7.5, False, ""),
    ("NVIDIA GeForce GTX 980 Ti", None, False, ""),
    ("GeForce RTX 2080 Ti", 7.5, False, ""),
    ("GeForce GTX 1080 Ti", 6.1, False, ""),
    # AMD and others
    ("AMD Instinct MI300X", None, True, ""),
    ("AMD Instinct MI300A", None, True, ""),
    ("AMD Instinct MI325X", None, True, ""),
    ("AMD Instinct MI250X", None, True, ""),
    ("AMD Instinct MI250X / MI250", None, True, ""),
    ("AMD Instinct MI210", None, True, ""),
    ("AMD Instinct MI100", None, None, ""),
    ("AMD Radeon RX 7900 XTX", None, None, ""),
    ("AMD Radeon PRO W7900", None, None, ""),
    ("AMD Radeon Graphics", None, None, ""),
    ("Intel(R) Data Center GPU Max 1550", None, None, ""),
    # laptops, MIG and vGPU slices, embedded
    ("NVIDIA RTX 2000 Ada Generation", 8.9, True, ""),
    ("NVIDIA RTX 3500 Ada Generation Laptop GPU", 8.9, True, ""),
    ("NVIDIA RTX A400", 8.6, True, ""),
    ("NVIDIA RTX A500", 8.6, True, ""),
    ("NVIDIA RTX A5000 Laptop GPU", 8.6, True, ""),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", 8.9, True, "4090"),
    ("NVIDIA GeForce RTX 3080 Laptop GPU", 8.6, True, ""),
    ("NVIDIA GeForce RTX 3060 Laptop GPU", 8.6, True, ""),
    ("NVIDIA GeForce RTX 4080 Laptop GPU", 8.9, True, ""),
    ("NVIDIA GeForce RTX 5090 D", 12.0, True, ""),
    ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", 8.0, True, "A100-SXM4-80GB"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 9.0, True, "H100"),
    ("Tesla V100-DGXS-32GB", 7.0, False, "V100"),
    ("NVIDIA DGX Display", None, None, ""),
    ("GRID A100X-40C", 8.0, True, "A100"),
    ("NVIDIA A100D-80C", 8.0, True, "A100"),
    ("NVIDIA A40-8Q", 8.6, True, ""),
    ("NVIDIA A10-24Q", 8.6, True, "A10"),
    ("NVIDIA A16-16Q", 8.6, True, ""),
    ("NVIDIA GeForce MX450", None, None, ""),
    ("NVIDIA T1000", None, None, ""),
    ("NVIDIA T400", 7.5, False, ""),
    ("Quadro T2000", None, None, ""),
    ("NVIDIA GH200 120GB", 9.0, True, "H200"),
    ("NVIDIA H100 SXM5 94GB", 9.0, True, "H100"),
    ("NVIDIA Graphics Device", None, None, ""),
    ("Orin (nvgpu)", None, None, ""),
    ("AMD Instinct MI300X VF", None, True, ""),
    ("NVIDIA GeForce RTX 2080 Ti Rev. A", 7.5, False, ""),
    ("Tesla P100-PCIE-12GB", 6.0, False, ""),
    # what people type after --gpu-name
    ("H100", 9.0, True, "H100"),
    ("h100", 9.0, True, "H100"),
    ("H100 PCIe", 9.0, True, "H100 PCIe"),
    ("h100 pcie", 9.0, True, "H100 PCIe"),
    ("A100", 8.0, True, "A100"),
    ("a100-sxm4-80gb", 8.0, True, "A100-SXM4-80GB"),
    ("A100-SXM4-80GB", 8.0, True, "A100-SXM4-80GB"),
    ("H200", 9.0, True, "H200"),
    ("h200", 9.0, True, "H200"),
    ("GH200", 9.0, True, "H200"),
    ("B200", 10.0, True, "B200"),
    ("H20", 9.0, True, "H20"),
    ("H800", 9.0, True, "H800"),
    ("A800", 8.0, True, "A800"),
    ("4090", 8.9, True, "4090"),
    ("RTX 4090", 8.9, True, "4090"),
    ("V100", 7.0, False, "V100"),
    ("v100", 7.0, False, "V100"),
    ("T4", 7.5, False, ""),
    ("L40S", 8.9, True, "L40S"),
    ("l40s", 8.9, True, "L40S"),
    ("L40", 8.9, True, "L40"),
    ("L4", 8.9, True, ""),
    ("A10G", 8.6, True, "A10"),
    ("a10", 8.6, True, "A10"),
    ("MI300X", None, True, ""),
    ("mi250", None, True, ""),
    ("Some Future GPU", None, None, ""),
    ("", None, None, ""),
]


@pytest.mark.parametrize("name,capability,bf16,speeds", NAMES)
def test_gpu_facts_by_name(name, capability, bf16, speeds):
    facts = gpu_facts(name)
    assert (facts.capability, facts.bf16) == (capability, bf16)
    assert (facts.hbm_bandwidth, facts.gpu_gpu_bandwidth, facts.h2d_bandwidth, facts.flops) == SPEEDS[speeds]
    assert facts.generic_speeds is (speeds == "")


def test_no_name_is_unknown():
    facts = gpu_facts(None)
    assert (facts.row, facts.capability, facts.bf16, facts.generic_speeds) == ("", None, None, True)
    assert (facts.hbm_bandwidth, facts.gpu_gpu_bandwidth, facts.h2d_bandwidth, facts.flops) == GENERIC


def test_bf16_follows_capability():
    for name, capability, bf16, _ in NAMES:
        if capability is not None:
            assert bf16 is has_bf16(capability) is (capability >= BF16_MIN), name
    assert has_bf16(None) is None
    assert run_dtype("bf16", 7.0) == "fp16" and run_dtype("bf16", 8.0) == "bf16" and run_dtype("bf16", None) == "bf16"
    assert run_dtype("fp32", 7.0) == "fp32"

