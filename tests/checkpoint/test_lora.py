"""A PEFT LoRA model (q_proj, v_proj, r=4) trained a few steps under ZeRO-3 on 2 CPU ranks: dsdoctor merge writes the
PEFT adapter or (--merge-lora) the base weights with the update folded in; both load with transformers and peft and
generate the tokens of the model that was in memory when the checkpoint was saved."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dsdoctor.checkpoint.merge import merge
from dsdoctor.checkpoint.verify import verify
from dsdoctor.errors import InputError
from tests.checkpoint_fixtures import copy_checkpoint, lora_checkpoint, read_merged
from tests.helpers import run_cli

pytestmark = [pytest.mark.deepspeed, pytest.mark.process]
LOGITS_TOL = 1e-5  # fp32: the in-memory model (ZeRO-3, adapters unmerged) and a reload differ by float rounding


def _outputs(tmp_path: Path) -> tuple[Path, Path, Path]:
    run = lora_checkpoint()
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    merge(run / "ckpt", adapter, progress=False)
    merge(run / "ckpt", merged, merge_lora=True, model=run / "base", progress=False)
    return run, adapter, merged


def _generate(model, prompt: list[int]):
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]


def _same_as_in_memory(model, run: Path) -> None:
    import torch

    for rec in json.loads((run / "in_memory.json").read_text()):
        tokens, logits = _generate(model.eval(), rec["prompt"])
        assert tokens == rec["tokens"], rec["prompt"]  # token for token
        worst = max((got - torch.tensor(want)).abs().max().item() for got, want in zip(logits, rec["logits"]))
        assert worst < LOGITS_TOL, (rec["prompt"], worst)


def test_adapter_output_is_peft_s_own_and_generates_the_in_memory_tokens(tmp_path):
    import peft
    import torch
    import transformers
    from safetensors.torch import load_file

    run = lora_checkpoint()
    proc = run_cli("merge", run / "ckpt", tmp_path / "adapter", "--format", "json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["lora"]["output"] == "adapter" and summary["lora"]["layers"] == 4
    assert [f["code"] for f in summary["findings"]] == ["DSD421"]
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir() if not p.name.startswith(".")) == \
        ["adapter_config.json", "adapter_model.safetensors"]  # never a base config.json beside adapter keys
    ours, theirs = load_file(tmp_path / "adapter" / "adapter_model.safetensors"), \
        load_file(run / "expected_adapter.safetensors")  # get_peft_model_state_dict of the trained model
    assert sorted(ours) == sorted(theirs) and len(ours) == 8
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(ours[k].abs().max() > 0 for k in ours if "lora_B" in k)  # trained away from B = 0
    base = transformers.AutoModelForCausalLM.from_pretrained(run / "base")
    _same_as_in_memory(peft.PeftModel.from_pretrained(base, tmp_path / "adapter"), run)


def test_merge_lora_writes_the_base_model_and_equals_peft_merge_and_unload(tmp_path):
    import peft
    import torch
    import transformers

    run, adapter, merged = _outputs(tmp_path)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    _same_as_in_memory(model, run)
    ref = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(run / "base"),
                                         adapter).merge_and_unload()
    ours, theirs = read_merged(merged), ref.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name  # bit for bit, in the base model's key names
    base = transformers.AutoModelForCausalLM.from_pretrained(run / "base").state_dict()
    changed = sorted(k for k in ours if not torch.equal(ours[k], base[k]))
    assert changed == [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in ("q", "v")]


def test_verify_knows_both_forms(tmp_path):
    run, adapter, merged = _outputs(tmp_path)
    proc = run_cli("verify", adapter, "--model", run / "base", "--reference", merged, "--format", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] and data["adapter"]["layers"] == 4 and data["compared_with_reference"] == 28
    assert data["max_abs_diff"] == 0.0 and data["logits_max_abs_diff"] == 0.0
    assert verify(merged, merged).findings == []
    # an adapter checked against the base it was not folded into: the 4 changed weights are named
    other = verify(adapter, run / "base", reference=run / "base", logits=False)
    assert [f.code for f in other.findings] == ["DSD408"] and other.findings[0].values["count"] == 4
    with pytest.raises(InputError, match="the reference is a PEFT adapter folder"):
        verify(merged, merged, reference=adapter)


def test_peft_keys_beside_a_base_config_are_named_as_such(tmp_path):
    """What zero_to_fp32 (or an older merge) leaves: PEFT keys beside the base config.json. verify says so, and
    neither calls the merge incomplete (DSD401) nor the architecture wrong (DSD402)."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    run = lora_checkpoint()
    out = tmp_path / "checkpoint-3"
    ckpt = copy_checkpoint(run / "ckpt", out)
    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(out))  # pytorch_model.bin beside the checkpoint
    shutil.copy(run / "base" / "config.json", out / "config.json")
    proc = run_cli("verify", out, "--model", out, "--format", "json")
    assert proc.returncode == 1, proc.stderr
    found = json.loads(proc.stdout)["findings"]
    assert [f["code"] for f in found] == ["DSD420"]
    assert "base_model.model.model.embed_tokens.weight" in found[0]["message"]
    assert f"dsdoctor merge {out} OUT --merge-lora" in found[0]["fix"]


def test_compare_adapter_on_its_base_against_the_merged_weights(tmp_path):
    run, adapter, merged = _outputs(tmp_path)
    proc = run_cli("compare", adapter, merged, "--base", run / "base", "--format", "json", "--quiet",
                   env={"DS_ACCELERATOR": "cpu"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["status"] == "match" and all(r["ok"] for r in data["runs"])
    assert data["runs"][0]["tokens"] == data["runs"][1]["tokens"]
    proc = run_cli("compare", adapter, merged, "--quiet")
    assert proc.returncode == 2 and "--base" in proc.stderr


@pytest.mark.parametrize("edit", [{"use_rslora": True}, {"alpha_pattern": {"v_proj": 32}}],
                         ids=["rslora", "alpha_pattern"])
def test_scaling_follows_the_adapter_config_as_peft_does(tmp_path, edit):
    """alpha/sqrt(r) with rsLoRA, a per-layer alpha from alpha_pattern: the fold matches PEFT's merge_and_unload."""
    import peft
    import torch
    import transformers

    run = lora_checkpoint()
    ckpt = copy_checkpoint(run / "ckpt", tmp_path / "ckpt")
    cfg = json.loads((ckpt / "adapter_config.json").read_text())
    (ckpt / "adapter_config.json").write_text(json.dumps(dict(cfg, **edit)))
    merge(ckpt, tmp_path / "adapter", progress=False)
    merge(ckpt, tmp_path / "merged", merge_lora=True, model=run / "base", progress=False)
    ref = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(run / "base"),
                                         tmp_path / "adapter").merge_and_unload().state_dict()
    ours = read_merged(tmp_path / "merged")
    assert all(torch.equal(ours[k], ref[k]) for k in ours)
    plain = read_merged(_outputs(tmp_path / "plain")[2])
    assert not torch.equal(ours["model.layers.0.self_attn.v_proj.weight"], plain["model.layers.0.self_attn.v_proj.weight"])


def test_without_adapter_config_the_reason_and_the_flag_are_given(tmp_path):
    run = lora_checkpoint()
    ckpt = copy_checkpoint(run / "ckpt", tmp_path / "run" / "ckpt")
    (ckpt / "adapter_config.json").rename(tmp_path / "elsewhere.json")
    proc = run_cli("merge", ckpt, tmp_path / "out", "--quiet")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "PEFT LoRA checkpoint" in proc.stderr and "adapter_config.json" in proc.stderr
    assert str(ckpt) in proc.stderr and "--adapter-config" in proc.stderr
    assert not (tmp_path / "out").exists()
    ok = run_cli("merge", ckpt, tmp_path / "out", "--adapter-config", tmp_path / "elsewhere.json", "--quiet")
    assert ok.returncode == 0, ok.stderr
    # a config of another run (another rank) is refused, not folded with the wrong scaling
    cfg = json.loads((tmp_path / "elsewhere.json").read_text())
    (tmp_path / "r8.json").write_text(json.dumps(dict(cfg, r=8)))
    bad = run_cli("merge", ckpt, tmp_path / "out2", "--adapter-config", tmp_path / "r8.json", "--merge-lora",
                  "--quiet")
    assert bad.returncode == 2 and "rank 8" in bad.stderr and "4 rows" in bad.stderr


def test_merge_lora_on_a_plain_checkpoint_is_refused(tmp_path):
    from tests.checkpoint_fixtures import zero_checkpoints

    proc = run_cli("merge", zero_checkpoints() / "w2" / "zero3", tmp_path / "out", "--merge-lora", "--quiet")
    assert proc.returncode == 2 and "not a LoRA checkpoint" in proc.stderr


def test_a_missing_rank_file_is_named(tmp_path):
    """The issue's own case: an fp32 run, rank 1's optimizer file gone."""
    ckpt = copy_checkpoint(lora_checkpoint() / "ckpt", tmp_path / "ckpt")
    (ckpt / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    proc = run_cli("merge", ckpt, tmp_path / "out", "--quiet")
    assert proc.returncode == 2
    assert "missing optim-states file(s) zero_pp_rank_1_mp_rank_00_optim_states.pt" in proc.stderr
    assert "2 model-states files but 1 optim-states files" in proc.stderr


@pytest.mark.parametrize("variant", ["dora", "embedding"])
def test_dora_and_embedding_lora_fold_as_peft_does(tmp_path, variant):
    """DoRA (magnitude / ||W + scale*B*A|| per row, lm_head in modules_to_save) and LoRA on the embedding with a
    lora_only bias: the adapter holds PEFT's own tensors, --merge-lora equals merge_and_unload bit for bit and
    generates the in-memory tokens."""
    import peft
    import torch
    import transformers
    from safetensors.torch import load_file

    run = lora_checkpoint() / variant
    merge(run / "ckpt", tmp_path / "adapter", progress=False)
    merge(run / "ckpt", tmp_path / "merged", merge_lora=True, model=run / "base", progress=False)
    ours, theirs = load_file(tmp_path / "adapter" / "adapter_model.safetensors"), \
        load_file(run / "expected_adapter.safetensors")
    # PEFT's save_embedding_layers="auto" also saves the untrained base embedding when an embedding is a target
    extra = {k for k in theirs if k.endswith(".base_layer.weight")}
    assert set(ours) == set(theirs) - extra and extra == ({"base_model.model.model.embed_tokens.base_layer.weight"}
                                                          if variant == "embedding" else set())
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    ref = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(run / "base"),
                                         tmp_path / "adapter").merge_and_unload().state_dict()
    merged = read_merged(tmp_path / "merged")
    assert set(merged) == set(ref) and all(torch.equal(merged[k], ref[k]) for k in merged)
    _same_as_in_memory(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), run)
