"""Mixture-of-experts checkpoints: merge and verify in both layouts of the expert weights (transformers 5's fused
3-D tensors, 4.x's per-expert modules), against DeepSpeed's zero_to_fp32 and transformers' own conversion; a
DeepSpeed-MoE checkpoint (expert files per rank) and an AutoEP ZeRO-3 one are refused naming the format."""
from __future__ import annotations

import json
import sys

import pytest

from dsdoctor.checkpoint import moe
from dsdoctor.checkpoint.merge import merge
from dsdoctor.checkpoint.verify import verify
from dsdoctor.errors import InputError
from tests.checkpoint_fixtures import copy_checkpoint, moe_checkpoints, read_merged
from tests.helpers import ROOT, run_cli

sys.path.insert(0, str(ROOT / "tests" / "scripts"))
import moe_models  # noqa: E402

HF = ["qwen3_moe-fused", "mixtral-fused", "olmoe-fused", "qwen3_moe-per-expert", "mixtral-per-expert"]


def _names(family: str) -> tuple:
    """(block, gate, up, down) of transformers 4.x's per-expert modules, written out here, not taken from moe.py."""
    return ("block_sparse_moe", "w1", "w3", "w2") if family == "mixtral" else ("mlp", "gate_proj", "up_proj", "down_proj")


def to_per_expert(sd: dict, family: str) -> dict:
    """The test's own fused -> per-expert conversion (tensor indexing), to check dsdoctor's range arithmetic."""
    block, gate, up, down = _names(family)
    out = {}
    for name, t in sd.items():
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            prefix = name.rsplit(".experts.", 1)[0].replace(".mlp", f".{block}")
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    half = t.shape[1] // 2
                    out[f"{prefix}.experts.{e}.{gate}.weight"] = t[e, :half]
                    out[f"{prefix}.experts.{e}.{up}.weight"] = t[e, half:]
                else:
                    out[f"{prefix}.experts.{e}.{down}.weight"] = t[e]
        else:
            out[name.replace(".mlp.", f".{block}.")] = t
    return out


def to_fused(sd: dict, family: str) -> dict:
    import torch

    block, gate, up, down = _names(family)
    out, experts = {}, {}
    for name, t in sd.items():
        if ".experts." in name and name.endswith(".weight") and name.split(".experts.")[1].split(".")[0].isdigit():
            prefix, rest = name.split(".experts.")
            e, proj = rest.split(".")[:2]
            experts.setdefault(prefix.replace(f".{block}", ".mlp"), {}).setdefault(proj, {})[int(e)] = t
        else:
            out[name.replace(f".{block}.", ".mlp.")] = t
    for prefix, projs in experts.items():
        n = len(projs[gate])
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat([projs[gate][e], projs[up][e]]) for e in range(n)])
        out[f"{prefix}.experts.down_proj"] = torch.stack([projs[down][e] for e in range(n)])
    return out


# ---- the conversion against transformers' own (no DeepSpeed) --------------------------------------------------

def test_families_are_the_ones_the_installed_transformers_converts():
    from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN

    for model_type, (block, *_) in moe.FAMILIES.items():
        pattern = _MODEL_TO_CONVERSION_PATTERN.get(model_type, model_type)
        assert pattern == ("mixtral" if block == "block_sparse_moe" else "qwen2_moe"), model_type


@pytest.mark.parametrize("family", sorted(moe_models.CONFIGS))
def test_conversion_both_ways_equals_transformers_save_and_load(family):
    """fused -> per-expert is what transformers 5's save_pretrained writes (revert_weight_conversion), key for key
    and value for value; per-expert -> fused gives back the model's own tensors; the per-expert names and shapes are
    those of transformers 4.x's modules (moe_models' per-expert build)."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    model = moe_models.build(family, "fused")
    fused = {n: t.detach() for n, t in model.state_dict().items()}
    saved = revert_weight_conversion(model, dict(fused))
    model_type = model.config.model_type
    per_expert = moe.convert(fused, model_type, "per-expert", moe.cat)
    assert moe.layout_of(fused) == "fused" and moe.layout_of(per_expert) == "per-expert"
    assert set(per_expert) == set(saved) and len(per_expert) > len(fused)
    assert all(torch.equal(per_expert[n], saved[n]) for n in saved)
    back = moe.convert(saved, model_type, "fused", moe.cat)
    assert set(back) == set(fused) and all(torch.equal(back[n], fused[n]) for n in fused)
    v4 = moe_models.build(family, "per-expert").state_dict()
    assert {n: tuple(t.shape) for n, t in v4.items()} == {n: tuple(t.shape) for n, t in saved.items()}
    # shapes only, as merge plans it, and no change for what is already in the layout asked for
    plan = moe.conversion({n: tuple(t.shape) for n, t in fused.items()}, model_type, "per-expert")
    assert {n: s for n, (s, _) in plan.items()} == {n: tuple(t.shape) for n, t in saved.items()}
    assert moe.conversion({n: tuple(t.shape) for n, t in fused.items()}, model_type, "fused") is None
    assert moe.conversion({n: tuple(t.shape) for n, t in fused.items()}, "gpt_oss", "per-expert") is None


def test_incomplete_experts_are_not_fused():
    shapes = {f"m.layers.0.mlp.experts.{e}.{p}.weight": (4, 6) for e in (0, 1, 3) for p in ("gate_proj", "up_proj")}
    shapes.update({f"m.layers.0.mlp.experts.{e}.down_proj.weight": (6, 4) for e in (0, 1, 3)})
    with pytest.raises(InputError, match=r"experts of m.layers.0.mlp are not all there.*\[0, 1, 3\]"):
        moe.conversion(shapes, "qwen3_moe", "fused")
    shapes = {n: s for n, s in shapes.items() if "gate_proj" not in n}
    with pytest.raises(InputError, match="up projections but no gate projections"):
        moe.conversion(shapes, "qwen3_moe", "fused")
    with pytest.raises(InputError, match=r"gate_up_proj has shape \[2, 5, 4\]"):
        moe.conversion({"m.mlp.experts.gate_up_proj": (2, 5, 4)}, "olmoe", "per-expert")
    with pytest.raises(InputError, match=r"down_proj has shape \[1000000, 1, 1\], not \[experts \(at most 4096\)"):
        moe.conversion({"m.mlp.experts.down_proj": (10**6, 1, 1)}, "olmoe", "per-expert")


# ---- real ZeRO-3 checkpoints ---------------------------------------------------------------------------------

def _reference(ckpt):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


def _trained_logits(family: str, layout: str, ref: dict, ids):
    """The model trained (the maker's own module layout) with DeepSpeed's consolidated fp32 weights: what it
    generates greedily from ``ids`` and its logits over that whole sequence."""
    import torch

    model = moe_models.build(family, layout).float().eval()
    model.load_state_dict(ref, strict=True)
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        return tokens, model(input_ids=tokens).logits


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", HF)
def test_merge_equals_zero_to_fp32_loads_and_verifies_in_both_layouts(tmp_path, name):
    import torch
    import transformers
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    family, saved = name.split("-", 1)
    base = moe_checkpoints() / name
    ref = _reference(base / "ckpt")
    assert moe.layout_of(ref) == saved
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    tokens, want_logits = _trained_logits(family, saved, ref, ids)
    convert_zero_checkpoint_to_fp32_state_dict(str(base / "ckpt"), str(tmp_path / "ds"))  # DeepSpeed's own output
    (tmp_path / "ds" / "config.json").write_text((base / "model" / "config.json").read_text())
    expected = {"per-expert": ref if saved == "per-expert" else to_per_expert(ref, family),
                "fused": ref if saved == "fused" else to_fused(ref, family)}
    for layout in ("per-expert", "fused"):
        out = tmp_path / layout
        result = merge(base / "ckpt", out, model=base / "model", progress=False,
                       expert_layout="auto" if layout == "per-expert" else "fused")
        assert result.experts["layout"] == layout and result.experts["saved"] == saved and not result.findings
        ours = read_merged(out)
        assert moe.layout_of(ours) == layout and set(ours) == set(expected[layout])
        assert all(torch.equal(ours[n], expected[layout][n]) for n in ours), layout  # bit for bit
        model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        with torch.no_grad():  # over the trained model's own continuation (greedy near-ties may differ by 1e-6)
            logits = model.eval()(input_ids=tokens).logits
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert (logits.argmax(-1) == want_logits.argmax(-1)).float().mean() > 0.9
        checked = verify(out, out, reference=tmp_path / "ds")
        assert checked.findings == [] and checked.compared_with_reference == len(ours), checked.to_text()
        assert checked.logits_max_abs_diff == 0.0 and checked.max_abs_diff == 0.0


@pytest.mark.deepspeed
def test_cli_says_which_layout_and_verify_catches_swapped_experts(tmp_path):
    import torch
    from safetensors.torch import save_file

    base = moe_checkpoints() / "qwen3_moe-fused"
    proc = run_cli("merge", base / "ckpt", tmp_path / "out", "--model", base / "model", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "one tensor per expert (model.layers.0.mlp.experts.0.gate_proj.weight)" in proc.stdout
    assert "converted from the checkpoint's fused layout" in proc.stdout
    proc = run_cli("merge", base / "ckpt", tmp_path / "fused", "--model", base / "model", "--quiet",
                   "--expert-layout", "fused", "--format", "json")
    summary = json.loads(proc.stdout)
    assert summary["experts"]["layout"] == summary["experts"]["saved"] == "fused" and summary["findings"] == []
    # the same weights with two experts' gate projections swapped: verify against the good merge says so
    bad = read_merged(tmp_path / "out")
    a, b = (f"model.layers.1.mlp.experts.{e}.gate_proj.weight" for e in (1, 3))
    bad[a], bad[b] = bad[b].clone(), bad[a].clone()
    (tmp_path / "bad").mkdir()
    save_file(bad, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "bad" / "config.json").write_text((base / "model" / "config.json").read_text())
    result = verify(tmp_path / "bad", tmp_path / "bad", reference=tmp_path / "fused")
    assert [f.code for f in result.findings] == ["DSD408", "DSD409"], result.to_text()
    assert result.findings[0].values["count"] == 2
    assert torch.equal(read_merged(tmp_path / "fused")["model.layers.1.mlp.experts.gate_up_proj"][3, :24], bad[a])


@pytest.mark.deepspeed
def test_expert_layout_refusals(tmp_path, monkeypatch):
    from dsdoctor.config import versions

    base = moe_checkpoints() / "olmoe-fused"
    cfg = json.loads((base / "model" / "config.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(dict(cfg, model_type="my_moe")))
    # a model type transformers does not convert: kept as saved by default, refused when asked to convert
    kept = merge(base / "ckpt", tmp_path / "kept", model=tmp_path / "other", progress=False)
    assert kept.experts["layout"] == "fused" and moe.layout_of(read_merged(tmp_path / "kept")) == "fused"
    assert "fused as saved (model.layers.0.mlp.experts.gate_up_proj): model_type my_moe is not one" in kept.to_text()
    proc = run_cli("merge", base / "ckpt", tmp_path / "o", "--model", tmp_path / "other", "--expert-layout",
                   "per-expert", "--quiet")
    assert proc.returncode == 2 and "no known conversion of fused expert weights for model_type 'my_moe'" in \
        proc.stderr and proc.stderr.count("\n") == 1 and not (tmp_path / "o").exists()
    monkeypatch.setattr(versions, "installed", lambda name: "4.57.1")
    with pytest.raises(InputError, match="transformers 4.57.1 loads only per-expert"):
        merge(base / "ckpt", tmp_path / "f", model=base / "model", progress=False, expert_layout="fused")
    assert not (tmp_path / "f").exists()


@pytest.mark.deepspeed
def test_deepspeed_moe_checkpoint_is_refused_naming_the_format(tmp_path):
    """A real deepspeed.moe.layer.MoE checkpoint (2 ranks, ep_size 2, ZeRO-2): DeepSpeed's own zero_to_fp32 fails on
    it, dsdoctor says which format it is in one line and writes nothing."""
    ckpt = moe_checkpoints() / "dsmoe" / "ckpt"
    tag = ckpt / "global_step2"
    assert sorted(p.name for p in tag.glob("layer_*")) == [f"layer_0_expert_{e}_mp_rank_00_model_states.pt"
                                                           for e in range(4)]
    with pytest.raises(ValueError, match="is not a model state checkpoint"):
        _reference(ckpt)
    proc = run_cli("merge", ckpt, tmp_path / "out", "--quiet")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("dsdoctor: error: ") and "a DeepSpeed-MoE checkpoint (deepspeed.moe expert " \
        "files such as layer_0_expert_0_mp_rank_00_model_states.pt" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.deepspeed
def test_autoep_zero3_checkpoint_is_refused(tmp_path):
    """AutoEP under ZeRO-3 writes no expert files: its experts are in the ZeRO-3 partitions of expert replica groups,
    marked by ds_autoep_layers in the model states (engine.py _save_moe_checkpoint); merging them as data-parallel
    partitions would be wrong."""
    import torch

    ckpt = copy_checkpoint(moe_checkpoints() / "qwen3_moe-fused" / "ckpt", tmp_path / "ckpt")
    for f in (ckpt / "global_step2").glob("zero_pp_rank_*_model_states.pt"):
        sd = torch.load(f, weights_only=False)
        sd["ds_autoep_layers"] = [{"moe_layer_id": 0, "ep_size": 2, "ds_autoep_zero3_expert_state_format": "x"}]
        torch.save(sd, f)
    proc = run_cli("merge", ckpt, tmp_path / "out", "--quiet")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "a DeepSpeed AutoEP ZeRO-3 checkpoint (ds_autoep_layers)" in proc.stderr and "ds_to_universal" in proc.stderr
    assert not (tmp_path / "out").exists()
