"""init_inference configs read as DeepSpeedInferenceConfig reads them, the ignored zero section, and the
deepspeed.initialize config that does what the user meant (issue 13, item 2)."""
import json

import pytest

from dsdoctor.config.check import check
from dsdoctor.config.inference_config import read_inference_config
from tests.helpers import DATA as HELPERS_DATA
from tests.helpers import run_cli, write_model_config

DATA = HELPERS_DATA / "configs"


def codes(result):
    return {f.code: f.effective_severity for f in result.findings}


def test_zero_section_in_init_inference_is_flagged_not_stage_0():
    r = check(DATA / "init_inference_zero.json", gpu_name="NVIDIA A100-SXM4-80GB")
    assert r.runner.name == "init_inference" and r.inference_config.zero is not None
    assert codes(r)["DSD122"] == "error"
    f = next(f for f in r.findings if f.code == "DSD122")
    cfg = f.values["config_dict"]
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert cfg["bf16"] == {"enabled": True}
    text = r.to_text("en")
    assert "ZeRO stage" not in text and "zero section ignored" in text


def test_the_suggested_config_is_what_deepspeed_initialize_reads_as_zero3_offload():
    from deepspeed.runtime.config import DeepSpeedConfig

    r = check(DATA / "init_inference_zero.json", gpu_name="V100-SXM2-32GB")
    cfg = next(f for f in r.findings if f.code == "DSD122").values["config_dict"]
    assert "fp16" in cfg and "bf16" not in cfg  # V100: sm70, no bf16
    parsed = DeepSpeedConfig(cfg)
    assert int(parsed.zero_optimization_stage) == 3
    assert parsed.zero_config.offload_param.device == "cpu" and parsed.optimizer_name is None


def test_unknown_gpu_defaults_to_bf16_with_a_note(monkeypatch):
    import dsdoctor.config.checks_configs as cc

    monkeypatch.setattr(cc, "this_machine_gpu", lambda: None)
    r = check(DATA / "init_inference_zero.json")
    f = next(f for f in r.findings if f.code == "DSD122")
    assert "bf16" in f.values["config_dict"] and "bf16 assumed" in f.fix("en") and "假定 bf16" in f.fix("zh")


def test_fp16_default_warns_for_a_bf16_model(tmp_path):
    model = write_model_config(tmp_path / "m", torch_dtype="bfloat16")
    r = check(DATA / "init_inference_nodtype.json", model=model)
    assert codes(r)["DSD125"] == "warning"
    assert r.inference_config.dtype == "fp16" and r.inference_config.tp_size == 2
    assert codes(check(DATA / "init_inference_nodtype.json"))["DSD125"] == "info"  # model dtype unknown


BAD = [
    {"dtype": "bfloat8"},
    {"dtype": 16},
    {"tensor_parallel": {"tp_size": 2, "tp_degree": 2}},
    {"tensor_parallel": {"tp_size": "two"}},
    {"max_out_tokens": 0},
    {"replace_with_kernel_inject": "maybe"},
    {"zero": {"stage": 3, "offload_params": {"device": "cpu"}}},
    {"moe": {"enabled": True, "experts": 8}},
    {"checkpoint_config": {"checkpoint_dir": "x", "tag": "y"}},
]
GOOD = [
    {"dtype": "bf16", "tensor_parallel": {"tp_size": 2}},
    {"dtype": "torch.float16", "mp_size": 2, "replace_with_kernel_inject": True},
    {"dtype": "bfloat16", "max_tokens": 4096, "enable_cuda_graph": False},
    {"zero": {"stage": 3, "offload_param": {"device": "cpu"}}, "dtype": "fp16"},
    {"tp": {"tp_size": 1}, "moe": False, "checkpoint": "ckpt.json"},
]


@pytest.mark.parametrize("cfg", BAD + GOOD, ids=[json.dumps(c)[:60] for c in BAD + GOOD])
def test_rejects_exactly_what_deepspeed_inference_config_rejects(cfg):
    from deepspeed.inference.config import DeepSpeedInferenceConfig

    try:
        DeepSpeedInferenceConfig(**cfg)
        theirs = True
    except Exception:
        theirs = False
    ours = not read_inference_config(cfg).invalid
    assert ours == theirs, read_inference_config(cfg).invalid
    if not theirs:
        assert "DSD124" in codes(check(cfg))


def test_top_level_zero_key_in_an_initialize_config():
    from deepspeed.runtime.config import DeepSpeedConfig

    r = check(DATA / "zero_toplevel.json")
    assert r.runner.name == "deepspeed" and r.effective.zero_stage == 0
    f = next(f for f in r.findings if f.code == "DSD123")
    assert int(DeepSpeedConfig(json.loads(DATA.joinpath("zero_toplevel.json").read_text())).zero_optimization_stage) == 0
    fixed = DeepSpeedConfig(json.loads(f.values["config"]))
    assert int(fixed.zero_optimization_stage) == 3 and fixed.zero_config.offload_param.device == "cpu"


@pytest.mark.process
def test_cli_gpu_name_flag_and_json():
    proc = run_cli("check", DATA / "init_inference_zero.json", "--gpu-name", "Tesla T4", "--format", "json")
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["runner"]["name"] == "init_inference" and data["inference_config"]["zero_ignored"]
    f = next(f for f in data["findings"] if f["code"] == "DSD122")
    assert '"fp16"' in f["fix"] and "T4" in f["fix"]



def test_dtype_spellings_match_deepspeed():
    from deepspeed.inference.config import DtypeEnum

    from dsdoctor.config.inference_config import DTYPE_SPELLINGS

    theirs = {d.name: {v for v in d.value if isinstance(v, str)} for d in DtypeEnum}
    assert {k: set(v) for k, v in DTYPE_SPELLINGS.items()} == theirs


@pytest.mark.parametrize("name,ok", [("NVIDIA H200", True), ("NVIDIA A100-SXM4-80GB", True), ("Tesla V100-SXM2-32GB", False),
                                     ("Tesla T4", False), ("NVIDIA GeForce RTX 4090", True), ("Quadro RTX 6000", False),
                                     ("NVIDIA RTX A6000", True), ("NVIDIA L4", True), ("Some Future GPU", None)])
def test_bf16_by_gpu_name(name, ok):
    from dsdoctor.gpus import gpu_facts

    assert gpu_facts(name).bf16 is ok


@pytest.mark.parametrize("name,cap", [("Tesla V100-SXM2-32GB", 7.0), ("NVIDIA GeForce RTX 3060", 8.6),
                                      ("NVIDIA RTX 6000 Ada Generation", 8.9), ("Quadro RTX 6000", 7.5),
                                      ("NVIDIA L40S", 8.9), ("NVIDIA L4", 8.9), ("NVIDIA H20", 9.0),
                                      ("AMD Instinct MI300X", None), ("Some Future GPU", None)])
def test_one_gpu_table_for_check_and_plan(name, cap):
    """check's bf16 and plan's compute capability come from one table and never disagree."""
    from dsdoctor.gpus import gpu_facts, has_bf16

    assert gpu_facts(name).capability == cap
    if cap is not None:
        assert gpu_facts(name).bf16 is has_bf16(cap)
