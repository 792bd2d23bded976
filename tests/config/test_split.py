"""split: what it drops, keeps and resolves, and how it writes (without launching DeepSpeed)."""
import copy
import json

import pytest

from dsdoctor.config.check import check
from dsdoctor.config.effective import effective_settings
from dsdoctor.config.split import split
from dsdoctor.errors import InputError
from tests.helpers import EXAMPLES, run_cli

EXAMPLE = EXAMPLES / "train_zero3_offload.json"


def test_bundled_example_split_with_model(tmp_path):
    before = EXAMPLE.read_bytes()
    out = tmp_path / "infer.json"
    result = split(EXAMPLE, out, model=EXAMPLES / "llama-7b")
    assert EXAMPLE.read_bytes() == before  # input never touched
    written = json.loads(out.read_text())
    assert written == result.config
    assert "optimizer" not in written and "scheduler" not in written
    zero = written["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert "offload_optimizer" not in zero and "reduce_bucket_size" not in zero
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 4096**2)
    assert zero["stage3_param_persistence_threshold"] == 40960
    assert written["bf16"] == {"enabled": True} and written["fp16"] == {"enabled": False}  # llama-7b is bf16
    assert written["train_micro_batch_size_per_gpu"] == 1 and "train_batch_size" not in written
    assert "auto" not in out.read_text()
    eff = effective_settings(written)
    assert (eff.zero_stage, eff.offload_param.device, eff.has_optimizer) == (3, "cpu", False)
    # only advice remains on the written config
    assert {f.code for f in result.findings} == {"DSD107"}
    reasons = {c.key: c for c in result.changes}
    assert reasons["optimizer"].action == "drop" and "DSD101" in reasons["optimizer"].reason["en"]
    assert reasons["train_micro_batch_size_per_gpu"].new == 1
    assert "-  \"optimizer\": {" in result.diff


def test_without_model_auto_becomes_what_deepspeed_uses(tmp_path):
    result = split(EXAMPLE, tmp_path / "o.json")
    zero = result.config["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == 50_000_000 and zero["stage3_param_persistence_threshold"] == 100_000
    assert result.config["bf16"] == {"enabled": False} and result.config["fp16"] == {"enabled": False}


def test_keep_auto_for_hf_trainer_users(tmp_path):
    result = split(EXAMPLE, tmp_path / "o.json", keep_auto=True)
    cfg = result.config
    assert cfg["bf16"]["enabled"] == "auto" and cfg["train_micro_batch_size_per_gpu"] == "auto"
    assert cfg["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"
    assert "optimizer" not in cfg and "DSD105" in {f.code for f in result.findings}


def test_stage_2_becomes_0_and_offload_param_goes(tmp_path):
    cfg = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}, "allgather_bucket_size": 5e8,
                                 "overlap_comm": True}, "train_batch_size": 16, "optimizer": {"type": "Adam"}}
    result = split(cfg, tmp_path / "o.json")
    assert result.config == {"zero_optimization": {"stage": 0, "overlap_comm": True},
                             "train_micro_batch_size_per_gpu": 1}


def test_rejected_and_removed_keys_are_dropped(tmp_path):
    cfg = {"amp": {"enabled": True}, "zero_optimization": {"stage": 3, "_offload_param": {"device": "cpu"},
                                                           "stage3_max_reuse_distance": -1}}
    result = split(cfg, tmp_path / "o.json")
    assert "amp" not in result.config and result.config["zero_optimization"] == {"stage": 3}
    assert not any(f.code == "DSD114" for f in check(result.config).findings)


def test_dict_input_not_mutated(tmp_path):
    cfg = json.loads(EXAMPLE.read_text())
    snapshot = copy.deepcopy(cfg)
    split(cfg, tmp_path / "o.json")
    assert cfg == snapshot


def test_refuses_overwrite_and_same_file(tmp_path):
    out = tmp_path / "o.json"
    out.write_text("keep me")
    with pytest.raises(InputError, match="--force"):
        split(EXAMPLE, out)
    assert out.read_text() == "keep me"
    split(EXAMPLE, out, force=True)
    assert json.loads(out.read_text())["zero_optimization"]["stage"] == 3
    src = tmp_path / "train.json"
    src.write_text(EXAMPLE.read_text())
    with pytest.raises(InputError, match="is the input config"):
        split(src, src, force=True)
    assert src.read_text() == EXAMPLE.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.json", "train.json"]  # no temp files left


def test_accelerate_yaml_writes_plain_deepspeed_json(tmp_path):
    y = tmp_path / "acc.yaml"
    y.write_text("distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n  zero_stage: 3\n"
                 "  offload_param_device: cpu\n  offload_optimizer_device: cpu\n  gradient_clipping: 1.0\n")
    result = split(y, tmp_path / "o.json")
    cfg = json.loads((tmp_path / "o.json").read_text())
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "offload_optimizer" not in cfg["zero_optimization"] and cfg["bf16"] == {"enabled": True}
    assert "gradient_clipping" not in cfg and result.kind == "accelerate-yaml"


def test_yaml_with_missing_reference_is_refused(tmp_path):
    y = tmp_path / "sft.yaml"
    y.write_text("deepspeed: nowhere.json\n")
    with pytest.raises(InputError, match="does not exist"):
        split(y, tmp_path / "o.json")
    assert not (tmp_path / "o.json").exists()


@pytest.mark.process
def test_split_cli(tmp_path):
    out = tmp_path / "infer.json"
    proc = run_cli("split", EXAMPLE, "-o", out, "--model", EXAMPLES / "llama-7b")
    assert proc.returncode == 0, proc.stderr
    assert "optimizer" in proc.stdout and "DSD101" in proc.stdout and out.exists()
    again = run_cli("split", EXAMPLE, "-o", out)
    assert again.returncode == 2 and "already exists" in again.stderr and "--force" in again.stderr
    js = run_cli("split", EXAMPLE, "-o", out, "--force", "--format", "json", "--lang", "zh")
    data = json.loads(js.stdout)
    assert data["config"]["zero_optimization"]["stage"] == 3 and data["changes"][0]["reason"]
    missing_dir = run_cli("split", EXAMPLE, "-o", tmp_path / "no" / "such" / "dir.json")
    assert missing_dir.returncode == 2 and "parent directory does not exist" in missing_dir.stderr
