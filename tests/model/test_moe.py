"""Mixtures of experts counted once, total and active, the same by config.json and by the meta-device model.

The published figures are the model cards' (total / activated parameters). Vendors differ on whether the input
embedding counts as active: Mistral and Qwen count it, DeepSeek and OpenAI do not; ``active_params`` counts it
(the whole forward of one token), so for those two the card's figure plus the embedding is compared."""
import dataclasses
import json

import pytest

from dsdoctor.model.exact import inventory_of_module
from dsdoctor.model.formulas import from_formula
from dsdoctor.model.spec import load_model_spec, spec_from_config
from tests.helpers import ROOT

ARCH = ROOT / "tests" / "data" / "arch_configs"

HELD_OUT = ROOT / "tests" / "data" / "moe_held_out"
# config.json files no other test uses, written by hand from each model's published config (no hub access), with
# the model card's total and active parameters where the card states them for the text model (None: it does not)
CARDS = {
    "qwen3-235b-a22b": (235e9, 22e9), "mixtral-8x22b": (141e9, 39e9), "qwen2-57b-a14b": (57.4e9, 14e9),
    "gpt-oss-120b": (116.83e9, 5.13e9 + 201088 * 2880), "deepseek-r1": (671e9, 37e9), "kimi-k2": (1.04e12, 32e9),
    "moonlight-16b-a3b": (16e9, 3e9), "glm-4.5-air": (106e9, None), "phi-3.5-moe": (41.9e9, 6.6e9),
    "granite-3.0-3b-a800m": (3.3e9, 0.8e9 + 49155 * 1536), "jetmoe-8b": (8.5e9, None),
    "llama-4-scout-17b-16e": (None, 17e9), "llama-4-maverick-17b-128e": (400e9, 17e9),
}

SHIPPED = {  # tests/data/arch_configs: total, active (model cards)
    "qwen3-30b-a3b": (30.5e9, 3.3e9), "deepseek-v2-lite": (15.7e9, 2.4e9 + 102400 * 2048),
    "mixtral-8x7b": (46.7e9, 12.9e9), "olmoe-1b-7b": (6.9e9, 1.3e9), "qwen1.5-moe-a2.7b": (14.3e9, 2.7e9),
    "deepseek-v3": (671e9, 37e9), "gpt-oss-20b": (20.9e9, 3.6e9 + 201088 * 2880),
}


def _close(a, b, tol):
    return abs(a - b) <= tol * b


def test_the_held_out_set_is_the_folder():
    assert sorted(p.stem for p in HELD_OUT.glob("*.json")) == sorted(CARDS)


@pytest.mark.parametrize("stem", sorted(CARDS))
def test_held_out_configs_counted_within_2_percent_of_transformers(stem):
    """config.json's count (check, split, plan --counts formula) against transformers' own meta-device model (plan),
    total and active, and the expert layout both give; then the card's figures."""
    pytest.importorskip("transformers")
    from dsdoctor.model.exact import exact_inventory

    spec = load_model_spec(HELD_OUT / f"{stem}.json")
    meta = exact_inventory(json.loads((HELD_OUT / f"{stem}.json").read_text()))
    assert meta is not None and spec.moe is not None and meta.moe is not None
    assert _close(spec.num_params, meta.num_params, 0.02), (spec.num_params, meta.num_params)
    assert _close(spec.active_params, meta.active_params, 0.02), (spec.active_params, meta.active_params)
    assert spec.moe.moe_layers == meta.moe.moe_layers
    same = ("num_experts", "top_k", "expert_intermediate", "shared_experts", "shared_intermediate")
    assert [getattr(spec.moe, k) for k in same] == [getattr(meta.moe, k) for k in same]
    total, active = CARDS[stem]
    assert total is None or _close(spec.num_params, total, 0.02), spec.num_params
    assert active is None or _close(spec.active_params, active, 0.05), spec.active_params


@pytest.mark.parametrize("stem", sorted(SHIPPED))
def test_shipped_configs_match_the_model_cards(stem):
    total, active = SHIPPED[stem]
    spec = load_model_spec(ARCH / f"{stem}.json")
    assert _close(spec.num_params, total, 0.02), spec.num_params
    assert _close(spec.active_params, active, 0.05), spec.active_params


@pytest.mark.parametrize("stem", sorted(SHIPPED))
def test_formula_and_meta_device_agree_on_experts(stem):
    pytest.importorskip("transformers")
    from dsdoctor.model.exact import exact_inventory

    spec = load_model_spec(ARCH / f"{stem}.json")
    formula, meta = from_formula(spec), exact_inventory(json.loads((ARCH / f"{stem}.json").read_text()))
    assert (formula.num_params, formula.active_params) == (meta.num_params, meta.active_params)
    assert {p.name for p in formula.params if p.expert} == {p.name for p in meta.params if p.expert}
    # the block class is the running transformers' own (DeepseekV2Moe in 5.x, DeepseekV2MoE in 4.x)
    assert dataclasses.replace(formula.moe, block_class="") == dataclasses.replace(meta.moe, block_class="")
    assert meta.moe.block_class.rsplit(".", 1)[1].lower() == formula.moe.block_class.rsplit(".", 1)[1].lower()


def test_dense_layers_and_shared_experts_follow_the_config():
    raw = json.loads((ARCH / "deepseek-v3.json").read_text())
    spec = spec_from_config(raw, "v3/config.json")
    assert spec.moe.moe_layers == tuple(range(3, 61)) and spec.moe.shared_experts == 1
    assert spec.moe.shared_intermediate == 2048 and (spec.moe.num_experts, spec.moe.top_k) == (256, 8)
    raw = dict(json.loads((ARCH / "qwen3-30b-a3b.json").read_text()), mlp_only_layers=[0, 5], decoder_sparse_step=2)
    spec = spec_from_config(raw, "q/config.json")
    assert spec.moe.moe_layers == tuple(i for i in range(48) if (i + 1) % 2 == 0 and i != 5)


def test_a_dense_model_has_no_layout_and_is_all_active():
    spec = load_model_spec(ARCH / "llama-2-7b.json")
    assert spec.moe is None and spec.active_params == spec.num_params


class _Experts4x:
    """transformers 4.x's layout: one module per expert under ``experts``, built from torch modules only."""

    @staticmethod
    def model():
        torch = pytest.importorskip("torch")
        nn = torch.nn

        class Expert(nn.Module):
            def __init__(self):
                super().__init__()
                self.w1, self.w2, self.w3 = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False), \
                    nn.Linear(8, 16, bias=False)

        class SparseBlock(nn.Module):
            def __init__(self):
                super().__init__()
                self.gate = nn.Linear(8, 4, bias=False)
                self.experts = nn.ModuleList(Expert() for _ in range(4))

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.block_sparse_moe = SparseBlock()

        class Body(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed_tokens = nn.Embedding(32, 8)
                self.layers = nn.ModuleList(Layer() for _ in range(2))

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = Body()
                self.config = type("C", (), {"to_dict": staticmethod(lambda: {
                    "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                    "intermediate_size": 16})})()

        return Model()


def test_per_expert_modules_are_counted_as_experts():
    inv = inventory_of_module(_Experts4x.model())
    experts = [p for p in inv.params if p.expert]
    assert len(experts) == 2 * 4 * 3 and all(".experts." in p.name for p in experts)
    assert inv.moe.fused is False and inv.moe.moe_layers == (0, 1)
    assert inv.moe.block_class.endswith(".SparseBlock")
    routed = 2 * 4 * 3 * 8 * 16
    assert inv.active_params == inv.num_params - routed + routed * 2 // 4


def test_a_partitioned_parameter_counts_by_its_full_shape():
    torch = pytest.importorskip("torch")
    model = _Experts4x.model()
    w = model.model.embed_tokens.weight
    w.data = torch.empty(0)
    w.ds_shape = torch.Size([32, 8])  # what ZeRO-3 leaves on a parameter it partitioned
    assert next(p for p in inventory_of_module(model).params if p.name.endswith("embed_tokens.weight")).numel == 256
