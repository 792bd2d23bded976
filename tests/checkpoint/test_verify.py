"""dsdoctor verify: each finding from a real merged checkpoint with one thing broken, through the real CLI."""
from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from dsdoctor.checkpoint.merge import merge
from dsdoctor.checkpoint.verify import verify
from dsdoctor.errors import InputError
from tests.checkpoint_fixtures import read_merged, zero_checkpoints
from tests.helpers import run_cli

pytestmark = [pytest.mark.deepspeed, pytest.mark.process]


@functools.cache
def merged() -> Path:
    base = zero_checkpoints()  # shared by the session's processes: each merges into a folder of its own
    out = Path(tempfile.mkdtemp(prefix="dsdoctor-merged-")) / "merged-w2-zero3"
    atexit.register(shutil.rmtree, out.parent, True)
    merge(base / "w2" / "zero3", out, model=base / "w2" / "model", progress=False)
    return out


def variant(tmp_path: Path, edit) -> Path:
    """A copy of the merged weights (one file) after ``edit(tensors)``, with the config."""
    from safetensors.torch import save_file

    tensors = read_merged(merged())
    edit(tensors)
    out = tmp_path / "variant"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(merged() / "config.json", out / "config.json")
    return out


def codes(proc) -> list[str]:
    return [f["code"] for f in json.loads(proc.stdout)["findings"]]


def check(path: Path, *extra) -> tuple[int, list[str]]:
    proc = run_cli("verify", path, "--model", path, "--format", "json", *extra)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, codes(proc)


def test_clean_merge_verifies_and_matches_deepspeed_bin_reference(tmp_path):
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    base = zero_checkpoints()
    ref = tmp_path / "zero_to_fp32"
    convert_zero_checkpoint_to_fp32_state_dict(str(base / "w2" / "zero3"), str(ref))  # pytorch_model.bin
    proc = run_cli("verify", merged(), "--model", merged(), "--reference", ref, "--format", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] and data["findings"] == []
    assert data["compared_with_reference"] == 29 and data["max_abs_diff"] == 0.0  # lm_head via its tie
    assert data["logits_max_abs_diff"] == 0.0 and data["logits_top1_agreement"] == 1.0
    assert data["tied_groups"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    text = run_cli("verify", merged(), "--model", merged(), "--lang", "zh")
    assert text.returncode == 0 and "验证通过" in text.stdout


def test_empty_tensors_saved_without_gathering(tmp_path):
    import torch

    def empty(t):
        for k in list(t)[:4]:
            t[k] = torch.empty(0, dtype=t[k].dtype)

    rc, found = check(variant(tmp_path, empty))
    assert rc == 1 and found == ["DSD404"]


def test_missing_unexpected_and_misshaped(tmp_path):
    import torch

    def edit(t):
        del t["model.norm.weight"]
        t["module.extra.weight"] = torch.ones(3)
        t["model.layers.1.self_attn.k_proj.bias"] = torch.ones(17)

    rc, found = check(variant(tmp_path, edit))
    assert rc == 1 and sorted(found) == ["DSD401", "DSD402", "DSD403"]
    text = verify(tmp_path / "variant", tmp_path / "variant").to_text("en")
    assert "model.norm.weight" in text and "[17] != [16]" in text and "module.extra.weight" in text


def test_nan_and_tied_weights_that_differ(tmp_path):

    def edit(t):
        t["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1

    rc, found = check(variant(tmp_path, edit))
    assert rc == 1 and sorted(found) == ["DSD405", "DSD407"]


def test_reference_mismatch_reports_tensor_and_logits(tmp_path):
    def edit(t):
        t["model.layers.1.mlp.down_proj.weight"] *= 3

    rc, found = check(variant(tmp_path, edit), "--reference", str(merged()))
    assert rc == 1 and sorted(found) == ["DSD408", "DSD409"]
    result = verify(tmp_path / "variant", merged(), reference=merged(), logits=False)
    assert [f.code for f in result.findings] == ["DSD408"] and result.logits_max_abs_diff is None
    assert result.findings[0].values["worst"] == "model.layers.1.mlp.down_proj.weight"


def test_bf16_weights_for_fp32_config_is_info_and_within_rounding(tmp_path):
    import torch

    def to_bf16(t):
        for k in t:
            t[k] = t[k].to(torch.bfloat16)

    rc, found = check(variant(tmp_path, to_bf16), "--reference", str(merged()))
    assert rc == 0 and found == ["DSD406"]


def test_bad_inputs_exit_2(tmp_path):
    proc = run_cli("verify", tmp_path / "nope", "--model", merged())
    assert proc.returncode == 2 and "weights directory not found" in proc.stderr
    (tmp_path / "m").mkdir()
    proc = run_cli("verify", merged(), "--model", tmp_path / "m")
    assert proc.returncode == 2 and "no config.json" in proc.stderr
    broken = tmp_path / "broken"
    shutil.copytree(merged(), broken)
    shard = next(broken.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(InputError, match="truncated"):
        verify(broken, broken)


# ---- dtype-aware tolerances, the failing tensor named, pointers ----------------------------------------------

def test_fp16_merge_verifies_against_zero_to_fp32_fp32_output(tmp_path):
    """merge --dtype fp16 is zero_to_fp32's fp32 output cast to fp16, bit for bit; fp16 subnormals (|x| < 6.1e-5)
    fail any relative tolerance, a ULP tolerance passes them."""
    import torch
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    base = zero_checkpoints()
    ref = tmp_path / "zero_to_fp32"
    convert_zero_checkpoint_to_fp32_state_dict(str(base / "w2" / "zero3"), str(ref))
    out = tmp_path / "fp16"
    merge(base / "w2" / "zero3", out, model=base / "w2" / "model", dtype="fp16", progress=False)
    ours, theirs = read_merged(out), torch.load(ref / "pytorch_model.bin", weights_only=True)
    assert any(((t.abs() < 6.1e-5) & (t != 0)).any() for t in ours.values())  # subnormals really are there
    assert all(torch.equal(t, theirs[k].to(torch.float16)) for k, t in ours.items())
    proc = run_cli("verify", out, "--model", out, "--reference", ref, "--format", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert [f["code"] for f in data["findings"]] == ["DSD406"]  # fp16 weights for an fp32 config: info
    assert data["tolerance"] == {"narrow": "float16", "ulp": 1}
    assert data["identical_after_cast"] == data["compared_with_reference"] == 29
    text = run_cli("verify", out, "--model", out, "--reference", ref).stdout
    assert "1 ULP of float16" in text and "2^-24" in text and "29 of 29 tensors bit-identical" in text


def test_the_tensor_named_as_largest_difference_is_one_that_failed(tmp_path):
    """In fp16 a weight near 1 is rounded by up to 2.4e-4, within its ULP; a small embedding value moved by 1e-4 is
    many of its ULPs off. The failing embedding is named, not the larger but correct norm weight."""
    import torch

    def to_fp16_and_nudge(t):
        for k in t:
            t[k] = t[k].to(torch.float16)
        t["model.embed_tokens.weight"][0, 0] += 1e-4

    rc, found = check(variant(tmp_path, to_fp16_and_nudge), "--reference", str(merged()), "--no-logits")
    result = verify(tmp_path / "variant", merged(), reference=merged(), logits=False)
    bad = [f for f in result.findings if f.code == "DSD408"]
    assert rc == 1 and len(bad) == 1 and bad[0].values["count"] == 1
    assert bad[0].values["worst"] == "model.embed_tokens.weight"
    assert result.max_abs_diff > float(bad[0].values["max_diff"])  # a passing tensor differs more
    assert "beyond 1 ULP of float16" in bad[0].message("en")


def test_empty_weights_name_the_checkpoint_beside_them_and_accelerates_key(tmp_path):
    """The HF Trainer's checkpoint-N/ holds both the empty save_pretrained weights and the ZeRO checkpoint."""
    import torch
    from safetensors.torch import save_file

    run = tmp_path / "checkpoint-1"
    shutil.copytree(zero_checkpoints() / "w2" / "zero3", run)
    tensors = {k: torch.empty(0) for k in read_merged(merged())}
    save_file(tensors, str(run / "model.safetensors"))
    shutil.copy(merged() / "config.json", run / "config.json")
    proc = run_cli("verify", run, "--model", run, "--format", "json")
    found = json.loads(proc.stdout)["findings"]
    assert proc.returncode == 1 and [f["code"] for f in found] == ["DSD404"]
    assert f"dsdoctor merge {run} {run}-merged" in found[0]["fix"]
    assert "zero3_save_16bit_model: true" in found[0]["fix"] and "deepspeed_config" in found[0]["fix"]
    zh = run_cli("verify", run, "--model", run, "--lang", "zh")
    assert f"dsdoctor merge {run} {run}-merged" in zh.stdout and "zero3_save_16bit_model" in zh.stdout
