"""Parameter counts and KV-cache bytes against real transformers models (tiny, built on the CPU)."""
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dsdoctor.model.exact import count_parameters, exact_inventory  # noqa: E402
from dsdoctor.model.formulas import from_formula  # noqa: E402
from dsdoctor.model.spec import load_model_spec  # noqa: E402
from dsdoctor.plan.api import load_inventory  # noqa: E402
from dsdoctor.plan.shape import kv_bytes, model_shape  # noqa: E402
from tests.helpers import TINY_LLAMA  # noqa: E402

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "vocab_size": 128, "max_position_embeddings": 256, "torch_dtype": "float32", "rms_norm_eps": 1e-6}

ARCHS = {
    "llama-gqa": dict(TINY_LLAMA),
    "llama-mqa-tied": dict(TINY_LLAMA, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen2-bias": dict(BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_key_value_heads=2,
                       tie_word_embeddings=False),
    "mistral-window": dict(BASE, model_type="mistral", architectures=["MistralForCausalLM"], num_key_value_heads=2,
                           sliding_window=16, head_dim=32),
    "gemma2-alt-window": dict(BASE, model_type="gemma2", architectures=["Gemma2ForCausalLM"], num_key_value_heads=2,
                              head_dim=16, sliding_window=8, num_hidden_layers=4, tie_word_embeddings=True),
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4,
             "vocab_size": 128, "n_positions": 128},
    "deepseek-v3-mla": dict(BASE, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                            topk_group=1, num_hidden_layers=2),
}


def _write(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _real_model(cfg):
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_exact_count_equals_real_model(arch):
    cfg = ARCHS[arch]
    model = _real_model(cfg)
    real = sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once
    inv = exact_inventory(cfg)
    assert inv is not None and inv.counted_by == "meta"
    assert inv.num_params == real
    assert count_parameters(model) == real  # the count a traced run records


@pytest.mark.parametrize("arch", ["llama-gqa", "llama-mqa-tied", "qwen2-bias", "mistral-window"])
def test_formula_matches_real_model_for_llama_family(arch, tmp_path):
    cfg = ARCHS[arch]
    spec = load_model_spec(_write(tmp_path, cfg))
    assert from_formula(spec).num_params == sum(p.numel() for p in _real_model(cfg).parameters())


def test_unknown_architecture_falls_back_to_formula(tmp_path):
    spec = load_model_spec(_write(tmp_path, dict(TINY_LLAMA, model_type="my_private_arch")))
    inv = load_inventory(spec, "auto")
    assert inv.counted_by == "formula-approx" and spec.counted_by == "formula-approx"  # DSD214
    assert inv.num_params == spec.num_params > 0


def _real_kv_bytes(model, batch, seq):
    ids = torch.randint(3, 100, (batch, seq))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("arch", ["llama-gqa", "llama-mqa-tied", "mistral-window", "gemma2-alt-window",
                                  "deepseek-v3-mla"])
def test_kv_bytes_equal_dynamic_cache(arch, tmp_path):
    cfg = ARCHS[arch]
    spec = load_model_spec(_write(tmp_path, cfg))
    inv = load_inventory(spec, "auto")
    shape = model_shape(spec, inv)
    model = _real_model(cfg)
    batch, seq = 3, 40  # longer than every sliding window above
    assert kv_bytes(shape, batch, seq, dtype_bytes=4) == _real_kv_bytes(model, batch, seq)


def test_gqa_and_mqa_shrink_kv_by_head_ratio(tmp_path):
    sizes = {}
    for kv in (4, 2, 1):
        d = tmp_path / f"kv{kv}"
        d.mkdir()
        spec = load_model_spec(_write(d, dict(TINY_LLAMA, num_key_value_heads=kv)))
        sizes[kv] = kv_bytes(model_shape(spec, from_formula(spec)), 2, 100, 2)
    assert sizes[4] == 2 * sizes[2] == 4 * sizes[1]
    assert sizes[1] == 2 * 2 * 100 * 2 * 1 * 16 * 2  # layers * batch * positions * (k,v) * heads * head_dim * bytes
