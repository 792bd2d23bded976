"""Tensor-parallel (AutoTP) + ZeRO and universal checkpoints made by DeepSpeed on CPU ranks, merged by dsdoctor and
compared bit for bit with DeepSpeed's own reconstruction (ds_to_universal) where one exists."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsdoctor.checkpoint.merge import merge
from dsdoctor.checkpoint.verify import verify
from tests.checkpoint_fixtures import autotp_checkpoints, copy_checkpoint, read_merged, universal, zero_checkpoints
from tests.helpers import run_cli

pytestmark = [pytest.mark.deepspeed, pytest.mark.process]


def _universal_params(root: Path) -> dict:
    """Every fp32.pt ds_to_universal wrote, as DeepSpeed itself loads it."""
    import torch

    tag = root / (root / "latest_universal").read_text().strip() / "zero"
    out = {}
    for d in tag.iterdir():
        if (d / "fp32.pt").is_file():
            obj = torch.load(d / "fp32.pt", weights_only=False)  # DeepSpeed's output, made by this test
            out[d.name] = obj["param"] if isinstance(obj, dict) else obj
    return out


@pytest.mark.parametrize("variant,stage", [("zero3", 3), ("zero1", 1)])
def test_autotp_merge_is_bit_identical_to_ds_to_universal(tmp_path, variant, stage):
    import torch

    base = autotp_checkpoints()
    result = merge(base / variant, tmp_path / "out", model=base / "model", progress=False)
    assert (result.zero_stage, result.tensor_parallel, result.world_size) == (stage, 2, 2)
    assert result.findings == []
    ours = read_merged(tmp_path / "out")
    theirs = _universal_params(universal(base / variant))
    assert set(ours) == set(theirs) and len(ours) == 21
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape and torch.equal(ours[name], tensor), name
    # uneven splits over 2 ranks really happened: vocab 251 (lm_head rows), intermediate 99
    assert ours["lm_head.weight"].shape == (251, 48) and ours["model.layers.1.mlp.down_proj.weight"].shape == (48, 99)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["dsdoctor"]["tensor_parallel"] == 2
    assert verify(tmp_path / "out", tmp_path / "out").findings == []


def test_autotp_frozen_shards_rebuild_the_initial_weights(tmp_path):
    """Frozen layers are saved as 16-bit... here fp32 fragments per (tp, dp) rank; ds_to_universal does not convert
    this checkpoint (its strict pattern check fails on the frozen MLP), so the reference is the model the run
    started from: frozen weights never moved."""
    import torch
    import transformers

    base = autotp_checkpoints()
    merge(base / "zero3-frozen", tmp_path / "out", model=base / "model", progress=False)
    ours = read_merged(tmp_path / "out")
    cfg = json.loads((base / "model" / "config.json").read_text())
    torch.manual_seed(0)
    start = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})).state_dict()
    frozen = [k for k in ours if k.startswith("model.layers.0.mlp.")]
    assert len(frozen) == 3 and all(torch.equal(ours[k], start[k]) for k in frozen)
    assert sum(not torch.equal(ours[k], start[k]) for k in ours) == len(ours) - 3  # the rest was trained


def test_autotp_merge_loads_and_prints_the_split(tmp_path):
    import transformers

    base = autotp_checkpoints()
    proc = run_cli("merge", base / "zero3", tmp_path / "out", "--model", base / "model", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "3 / 4 (2 tensor-parallel x 2 data-parallel)" in proc.stdout
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_a_missing_tensor_parallel_rank_is_named(tmp_path):
    ckpt = copy_checkpoint(autotp_checkpoints() / "zero3", tmp_path / "ckpt")
    for f in (ckpt / "global_step1").glob("*mp_rank_01*"):
        f.unlink()
    (ckpt / "global_step1" / "zero_pp_rank_0_mp_rank_02_optim_states.pt").write_bytes(b"")
    (ckpt / "global_step1" / "zero_pp_rank_0_mp_rank_02_model_states.pt").write_bytes(b"")
    proc = run_cli("merge", ckpt, tmp_path / "out", "--quiet")
    assert proc.returncode == 2 and "missing the files of tensor-parallel rank(s) mp_rank_01" in proc.stderr


def test_a_missing_data_parallel_file_of_one_tp_rank_is_named(tmp_path):
    ckpt = copy_checkpoint(autotp_checkpoints() / "zero3", tmp_path / "ckpt")
    (ckpt / "global_step1" / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    proc = run_cli("merge", ckpt, tmp_path / "out", "--quiet")
    assert proc.returncode == 2, proc.stdout
    assert "missing optim-states file(s) zero_pp_rank_1_mp_rank_01_optim_states.pt" in proc.stderr


@pytest.mark.parametrize("world,stage_dir", [("w2", "zero3"), ("w2", "zero2"), ("w2", "zero1")])
def test_universal_checkpoint_merges_like_the_original(tmp_path, world, stage_dir):
    """ds_to_universal's output of a plain ZeRO checkpoint (ZeRO-3: flat fp32.pt and frozen fragments in the
    copied model states; ZeRO-1/2: dicts, frozen weights from the module state) merges to the same tensors as
    the checkpoint it came from."""
    import torch

    base = zero_checkpoints()
    root = universal(base / world / stage_dir)
    assert (root / "latest_universal").is_file()
    original = merge(base / world / stage_dir, tmp_path / "a", model=base / world / "model", progress=False)
    result = merge(root, tmp_path / "b", tag="global_step1_universal", model=base / world / "model", progress=False)
    assert result.source == "universal" and result.zero_stage == original.zero_stage
    assert [f.code for f in result.findings] == [f.code for f in original.findings]
    a, b = read_merged(tmp_path / "a"), read_merged(tmp_path / "b")
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    proc = run_cli("merge", root / "global_step1_universal", tmp_path / "c", "--model", base / world / "model",
                   "--quiet")
    assert proc.returncode == 0 and "DeepSpeed universal checkpoint" in proc.stdout, proc.stderr


def test_autotp_universal_checkpoint_merges_to_the_same_tensors(tmp_path):
    import torch

    base = autotp_checkpoints()
    root = universal(base / "zero3")
    merge(base / "zero3", tmp_path / "a", progress=False)
    result = merge(root, tmp_path / "b", tag="global_step1_universal", progress=False)
    assert result.source == "universal" and result.tensor_parallel == 2
    a, b = read_merged(tmp_path / "a"), read_merged(tmp_path / "b")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_only_latest_universal_is_followed_when_latest_is_gone(tmp_path):
    base = autotp_checkpoints()
    root = copy_checkpoint(universal(base / "zero1"), tmp_path / "ckpt")
    (root / "latest").unlink()
    result = merge(root, tmp_path / "out", progress=False)
    assert result.source == "universal" and result.tag == "global_step1_universal"
