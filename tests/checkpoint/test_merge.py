"""dsdoctor merge on real DeepSpeed ZeRO-2/3 checkpoints (2 and 3 ranks), against DeepSpeed's own consolidation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsdoctor.checkpoint import merge as merge_mod
from dsdoctor.checkpoint.merge import merge
from dsdoctor.errors import InputError
from tests.checkpoint_fixtures import copy_checkpoint, read_merged, zero_checkpoints
from tests.helpers import ROOT, run_cli

pytestmark = pytest.mark.deepspeed

CASES = [("w2", "zero3", 3, 2), ("w3", "zero3", 3, 3), ("w2", "zero2", 2, 2)]


def deepspeed_reference(ckpt: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


@pytest.mark.parametrize("world,stage_dir,stage,ranks", CASES, ids=[f"{s}-{w}" for w, s, _, _ in CASES])
def test_merge_is_bit_identical_to_deepspeed(tmp_path, world, stage_dir, stage, ranks):
    import torch

    base = zero_checkpoints()
    result = merge(base / world / stage_dir, tmp_path / "out", model=base / world / "model", progress=False)
    assert (result.zero_stage, result.world_size, result.frozen) == (stage, ranks, 3)
    assert result.buffers == (2 if stage == 2 else 0)
    ours = read_merged(tmp_path / "out")
    ref = deepspeed_reference(base / world / stage_dir)
    # the tied lm_head is stored once (config ties it); everything else is there, bit for bit
    assert result.tied == {"lm_head.weight": "model.embed_tokens.weight"} and result.tied_stored_once
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name, tensor in ref.items():
        if name in ours:
            assert ours[name].dtype == (torch.float32 if tensor.is_floating_point() else tensor.dtype), name
            assert torch.equal(ours[name], tensor.to(ours[name].dtype)), name
    if stage == 2:
        assert ours["model.probe_steps"].dtype == torch.int64 and ours["model.probe_steps"].tolist() == list(range(0, 21, 3))
        assert ours["model.probe_scale"].dtype == torch.float32
    # odd sizes really crossed rank boundaries: hidden 45, vocab 251, a 16-element bias over 3 ranks
    assert ours["model.embed_tokens.weight"].shape == (251, 45)
    assert not torch.equal(ours["model.layers.0.mlp.up_proj.weight"], torch.zeros(99, 45))


def test_zero1_frozen_params_that_deepspeed_drops_are_kept(tmp_path):
    """bf16 ZeRO-1 writes no frozen_param_shapes: zero_to_fp32 loses the frozen MLP, dsdoctor keeps it."""
    import torch
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    from dsdoctor.checkpoint.verify import verify

    base = zero_checkpoints()
    ckpt = base / "w2" / "zero1"
    result = merge(ckpt, tmp_path / "out", model=base / "w2" / "model", progress=False)
    frozen = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
              "model.layers.0.mlp.down_proj.weight"]
    assert result.zero_stage == 1 and [f.code for f in result.findings] == ["DSD412"]
    ours, ref = read_merged(tmp_path / "out"), deepspeed_reference(ckpt)
    assert set(ours) == (set(ref) - {"lm_head.weight"}) | set(frozen) and not set(frozen) & set(ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ref if k in ours)
    module = torch.load(_tag(ckpt) / "mp_rank_00_model_states.pt", weights_only=False)["module"]  # our own file
    assert all(torch.equal(ours[k], module[k].float()) for k in frozen)
    assert verify(tmp_path / "out", tmp_path / "out").findings == []
    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(tmp_path / "ds"))
    missing = verify(tmp_path / "ds", tmp_path / "out").findings
    assert [f.code for f in missing] == ["DSD401"] and frozen[0] in missing[0].values["names"]


def test_cli_bf16_sharded_output_loads_with_from_pretrained(tmp_path):
    import torch
    import transformers

    base = zero_checkpoints()
    out = tmp_path / "merged"
    proc = run_cli("merge", base / "w3" / "zero3", out, "--model", base / "w3" / "model", "--dtype", "bf16",
                   "--max-shard-size", "30KB", "--format", "json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["dtype"] == "bfloat16" and len(summary["shards"]) > 1 and summary["findings"] == []
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == summary["shards"]
    assert index["metadata"]["total_size"] == summary["bytes_written"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ref = deepspeed_reference(base / "w3" / "zero3")
    got = read_merged(out)
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, ref[name].to(torch.bfloat16)), name


def test_merge_without_config_copies_tied_weights_and_warns(tmp_path):
    import torch

    base = zero_checkpoints()
    ckpt = copy_checkpoint(base / "w2" / "zero2", tmp_path / "ckpt")  # no config.json anywhere near it
    proc = run_cli("merge", ckpt, tmp_path / "out", "--quiet")
    assert proc.returncode == 0, proc.stderr  # warnings only
    assert "DSD410" in proc.stdout and "DSD411" in proc.stdout
    got = read_merged(tmp_path / "out")
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    again = run_cli("merge", ckpt, tmp_path / "out", "--quiet", "--fail-on", "warning")
    assert again.returncode == 2 and "already exists" in again.stderr and "--force" in again.stderr
    forced = run_cli("merge", ckpt, tmp_path / "out", "--quiet", "--fail-on", "warning", "--force")
    assert forced.returncode == 1, forced.stderr


def test_merge_runs_without_deepspeed(tmp_path):
    """The pickles are read by dsdoctor's own restricted unpickler; torch is used only to convert dtypes."""
    base = zero_checkpoints()
    code = ("import sys; sys.modules['deepspeed'] = None\n"
            "from dsdoctor.checkpoint.merge import merge\n"
            f"r = merge({str(base / 'w2' / 'zero3')!r}, {str(tmp_path / 'out')!r}, progress=False)\n"
            "print(r.tensors)")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) == 29  # 28 + the untied copy of lm_head (no config found)


# ---- failure paths: each names the file and exits 2 -------------------------------------------------------

def _tag(ckpt: Path) -> Path:
    return ckpt / "global_step1"


def _fails(*args) -> str:
    proc = run_cli("merge", *args, "--quiet")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("dsdoctor: error: ") and "Traceback" not in proc.stderr
    return proc.stderr


def test_no_latest_lists_tags(tmp_path):
    ckpt = copy_checkpoint(zero_checkpoints() / "w2" / "zero3", tmp_path / "ckpt")
    (ckpt / "latest").unlink()
    err = _fails(ckpt, tmp_path / "out")
    assert "no `latest`" in err and "global_step1" in err and str(ckpt) in err
    assert not (tmp_path / "out").exists()
    assert _fails(ckpt, tmp_path / "out", "--tag", "global_step9").count("global_step1") == 1
    # the tag directory itself, or --tag, still works
    assert merge(_tag(ckpt), tmp_path / "a", progress=False).tag == "global_step1"
    assert merge(ckpt, tmp_path / "b", tag="global_step1", progress=False).tensors == 29


def test_missing_and_extra_rank_files(tmp_path):
    ckpt = copy_checkpoint(zero_checkpoints() / "w3" / "zero3", tmp_path / "ckpt")
    tag = _tag(ckpt)
    (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    err = _fails(ckpt, tmp_path / "out")
    assert "missing optim-states file(s) bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt for rank(s) 1" in err

    ckpt2 = copy_checkpoint(zero_checkpoints() / "w2" / "zero3", tmp_path / "ckpt2")
    tag2 = _tag(ckpt2)
    for kind, prefix in (("optim", "bf16_"), ("model", "")):
        src = tag2 / f"{prefix}zero_pp_rank_1_mp_rank_00_{kind}_states.pt"
        (tag2 / f"{prefix}zero_pp_rank_2_mp_rank_00_{kind}_states.pt").write_bytes(src.read_bytes())
    err = _fails(ckpt2, tmp_path / "out")
    assert "extra rank files" in err and "2 ranks" in err and "3 optim-states files" in err


def test_shards_from_different_world_sizes(tmp_path):
    ckpt = copy_checkpoint(zero_checkpoints() / "w2" / "zero3", tmp_path / "ckpt")
    other = _tag(zero_checkpoints() / "w3" / "zero3") / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (_tag(ckpt) / other.name).write_bytes(other.read_bytes())
    err = _fails(ckpt, tmp_path / "out")
    assert "different world sizes" in err and "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt: 3" in err


def test_truncated_shard_is_named(tmp_path):
    ckpt = copy_checkpoint(zero_checkpoints() / "w2" / "zero3", tmp_path / "ckpt")
    victim = _tag(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    err = _fails(ckpt, tmp_path / "out")
    assert str(victim) in err and "truncated or corrupt" in err
    assert not (tmp_path / "out").exists()


def test_tensor_parallel_checkpoint_is_refused_with_the_reason(tmp_path):
    ckpt = copy_checkpoint(zero_checkpoints() / "w2" / "zero3", tmp_path / "ckpt")
    for f in list(_tag(ckpt).iterdir()):
        (f.parent / f.name.replace("mp_rank_00", "mp_rank_01")).write_bytes(f.read_bytes())
    err = _fails(ckpt, tmp_path / "out")
    assert "2 model-parallel ranks" in err and "tensor-parallel" in err and "does not record" in err


def test_mixture_of_experts_checkpoint_is_refused(tmp_path):
    ckpt = copy_checkpoint(zero_checkpoints() / "w2" / "zero3", tmp_path / "ckpt")
    (_tag(ckpt) / "layer_0_expert_0_mp_rank_00_model_states.pt").write_bytes(b"")
    assert "DeepSpeed-MoE checkpoint (deepspeed.moe expert files such as layer_0_expert_0_mp_rank_00_model_states.pt" \
        in _fails(ckpt, tmp_path / "o")


def test_checkpoint_without_optimizer_states(tmp_path):
    ckpt = copy_checkpoint(zero_checkpoints() / "w2" / "zero3", tmp_path / "ckpt")
    for f in _tag(ckpt).glob("*optim_states.pt"):
        f.unlink()
    assert "no *_optim_states.pt" in _fails(ckpt, tmp_path / "out")


def test_pickle_with_code_is_refused_and_never_runs(tmp_path):
    import torch

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ckpt = copy_checkpoint(zero_checkpoints() / "w2" / "zero3", tmp_path / "ckpt")
    victim = _tag(ckpt) / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"buffer_names": [], "evil": Evil()}, victim)
    err = _fails(ckpt, tmp_path / "out")
    assert "refused to load" in err and "system" in err and str(victim) in err
    assert not marker.exists()


def test_interrupted_merge_leaves_nothing(tmp_path, monkeypatch):
    base = zero_checkpoints()
    real = merge_mod.write_all

    def write_then_die(out_dir, *args, **kwargs):
        real(out_dir, *args, **kwargs)
        assert any(out_dir.iterdir())
        raise KeyboardInterrupt

    monkeypatch.setattr(merge_mod, "write_all", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        merge(base / "w2" / "zero3", tmp_path / "out", model=base / "w2" / "model", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_disk_space_is_checked_first(tmp_path, monkeypatch):
    base = zero_checkpoints()

    monkeypatch.setattr(merge_mod.door, "free_bytes", lambda p: 1000)  # the door asks the filesystem
    with pytest.raises(InputError, match="not enough free disk space"):
        merge(base / "w2" / "zero3", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_zip_records_are_stored_uncompressed():
    """The streaming copy relies on torch.save's uncompressed zip records."""
    tag = _tag(zero_checkpoints() / "w2" / "zero3")
    with zipfile.ZipFile(tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt") as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
