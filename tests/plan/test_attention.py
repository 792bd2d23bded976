"""Eager attention in the allocated peak: a class transformers runs without SDPA (gpt-oss: SDPA cannot apply its
sinks; Gemma-2 in transformers 5.24: softcapping) holds batch x heads x queries x keys scores inside its attention
function. On one H100, gpt-oss-20b at 2 x 8192 under zero3-offload asked for 16.00 GiB at once (one bf16 score
tensor: 2 x 64 x 8192 x 8192 x 2 bytes) where plan had predicted a 6.9 GiB peak (hold-out set 2, edge_gpu.py)."""
from __future__ import annotations

import json

import pytest

from dsdoctor.model.exact import exact_inventory
from dsdoctor.model.inventory import inventory_from_dict, inventory_to_dict
from dsdoctor.model.spec import spec_from_config
from dsdoctor.plan.schedule import eager_scores
from dsdoctor.plan.shape import model_shape
from tests.helpers import ROOT, created_peak

ARCH = ROOT / "tests" / "data" / "arch_configs"
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
            head_dim=32, vocab_size=64, max_position_embeddings=4096, eos_token_id=1, bos_token_id=1, pad_token_id=0)


@pytest.mark.parametrize(("name", "expected"), [("gpt-oss-20b", "eager-sinks"), ("qwen2-7b", "sdpa"),
                                                ("mixtral-8x7b", "sdpa"), ("llama-2-7b", "sdpa")])
def test_the_inventory_reads_which_attention_transformers_runs(name, expected):
    pytest.importorskip("torch")
    raw = json.loads((ARCH / f"{name}.json").read_text())
    raw.pop("quantization_config", None)
    inv = exact_inventory(raw)
    assert inv.attention == expected
    assert inventory_from_dict(json.loads(json.dumps(inventory_to_dict(inv)))).attention == expected  # cached
    shape = model_shape(spec_from_config(raw, name), inv)
    scores = eager_scores(shape, 2, 8192, 8192, 2)
    if expected == "sdpa":
        assert scores == 0
    else:  # three bf16 tensors of 2 x 64 x 8192 x 8193 and the 4-D mask: the 16.00 GiB request was one of them
        assert scores == pytest.approx(3 * 16 * 2**30, rel=0.01)


def test_a_forged_attention_value_is_refused():
    raw = json.loads((ARCH / "qwen2-0.5b.json").read_text())
    pytest.importorskip("torch")
    d = inventory_to_dict(exact_inventory(raw))
    d["attention"] = "flash; rm -rf /"
    with pytest.raises(ValueError, match="attention"):
        inventory_from_dict(d)


@pytest.mark.parametrize(("model_type", "kind"), [("gpt_oss", "eager-sinks"), ("llama", "eager")])
def test_eager_scores_match_what_the_eager_function_creates(model_type, kind):
    """transformers' own eager function on the CPU, its created tensors' peak against ``eager_scores`` (less the
    mask, an input here), at two prompt lengths: the quadratic term, not a constant. The output is made after
    the scores' peak: it is not part of it."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY, model_type=model_type)
    if model_type == "gpt_oss":
        cfg.update(num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.bfloat16,
                                             attn_implementation="eager").eval()
    attn = model.model.layers[0].self_attn
    module = __import__(type(attn).__module__, fromlist=["eager_attention_forward"])
    from dsdoctor.model.exact import inventory_of_module

    shape = model_shape(spec_from_config(cfg, "tiny"), inventory_of_module(model))
    assert shape.inventory.attention == kind or model_type == "llama"  # llama has SDPA: eager forced here
    object.__setattr__(shape.inventory, "attention", kind)
    for seq in (256, 512):
        q = torch.randn(2, 4, seq, 32, dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        mask = torch.zeros(2, 1, seq, seq, dtype=torch.bfloat16)
        measured = created_peak(module.eager_attention_forward, attn, q, k, v, mask, scaling=0.1, known=[q, k, v, mask])
        predicted = eager_scores(shape, 2, seq, seq, 2) - 2 * seq * seq * 2  # the mask is the caller's here
        assert predicted == pytest.approx(measured, rel=0.01), (model_type, seq)
