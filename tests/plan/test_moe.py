"""plan on a mixture of experts: plain decode reads the experts its tokens chose, ZeRO-3 gathers all of them
(speed), DSD226 with the figures, DSD118 under a transformers whose blocks skip unchosen experts, and the routing
and dispatch buffers of transformers 5's grouped_mm experts in the allocated peak (measured on CPU per family)."""
import json
import weakref

import pytest

from dsdoctor.model.formulas import from_formula
from dsdoctor.model.moe import experts_touched
from dsdoctor.model.spec import load_model_spec, spec_from_config
from dsdoctor.plan.api import plan
from dsdoctor.plan.hardware import make_hardware
from dsdoctor.plan.schedule import _layer_levels
from dsdoctor.plan.shape import model_shape
from dsdoctor.plan.speed import StepTerms, _decode_terms, expert_elems, figures_for
from dsdoctor.plan.workload import make_workload
from tests.helpers import ROOT

ARCH = ROOT / "tests" / "data" / "arch_configs"
Z3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def _small(tmp_path, name="qwen3-30b-a3b", layers=4):
    cfg = json.loads((ARCH / f"{name}.json").read_text())
    cfg["num_hidden_layers"] = layers
    d = tmp_path / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_experts_touched_is_k_for_one_token_and_all_for_many():
    spec = load_model_spec(ARCH / "qwen3-30b-a3b.json")
    moe = spec.moe
    assert experts_touched(moe, 1) == pytest.approx(8)
    assert experts_touched(moe, 8) == pytest.approx(128 * (1 - (120 / 128) ** 8))  # about 51
    assert experts_touched(moe, 10_000) == pytest.approx(128)


def test_plain_decode_reads_the_chosen_experts_zero3_gathers_all(tmp_path):
    spec = load_model_spec(_small(tmp_path))
    inv = from_formula(spec)
    shape = model_shape(spec, inv)
    f = figures_for(make_hardware(1, "80GiB", "256GiB", gpu_name="H200", detect=False))
    routed, touched, per_token = expert_elems(shape, 1)
    assert routed == sum(p.numel for p in inv.params if p.expert) and touched == pytest.approx(routed * 8 / 128)
    assert per_token == pytest.approx(touched)
    wl = make_workload(1, 512, 128, "bf16", "bf16")
    terms, _ = _decode_terms(shape, wl, StepTerms(), f)
    emb = inv.numel("embedding")
    read = (inv.num_params - emb - routed + touched) * 2  # bytes a batch-1 step reads: all but unchosen experts
    assert terms["weights"] == pytest.approx(read / f.hbm_read, rel=1e-6)
    # batch 64 chooses nearly every expert: the step reads close to the whole model
    terms64, _ = _decode_terms(shape, make_workload(64, 512, 128, "bf16", "bf16"), StepTerms(), f)
    assert terms64["weights"] > 5 * terms["weights"]


def test_zero3_on_a_moe_says_every_expert_is_gathered_each_step(tmp_path):
    r = plan(_small(tmp_path), gpus=2, gpu_memory="80GiB", host_memory="256GiB", gpu_name="H200", batch=8,
             config=Z3, counts="formula", detect=False, transformers_version="5.24.0")
    found = {f.code: f for f in r.findings}
    f = found["DSD226"]
    by = {p.name: p for p in r.paths}
    assert f.values["path"] == "zero3" and f.values["experts"] == 128 and f.values["touched"] == "52"
    assert f.values["tps"] == f"{by['zero3'].tokens_per_s:.1f}" and f.values["plain_tps"] == f"{by['plain'].tokens_per_s:.1f}"
    assert by["plain"].tokens_per_s > 3 * by["zero3"].tokens_per_s
    assert "DSD118" not in found
    r4 = plan(_small(tmp_path / "4", "deepseek-v2-lite"), gpus=2, gpu_memory="80GiB", host_memory="256GiB",
              gpu_name="H200", batch=8, config=Z3, counts="formula", detect=False, transformers_version="4.57.6")
    # DeepSpeed 0.19.8 (installed) makes Qwen3-MoE's block a leaf by itself, not DeepSeek-V2's
    assert "set_z3_leaf_modules(model, [DeepseekV2MoE])" in {f.code: f for f in r4.findings}["DSD118"].fix()


def test_a_dense_model_has_no_moe_levels_nor_finding(tmp_path):
    spec = load_model_spec(ARCH / "llama-2-7b.json")
    levels = _layer_levels(model_shape(spec, from_formula(spec)), 2, 1)
    assert "experts" not in levels and "gate" not in levels


# ------------------------------------------------------------------ routing and dispatch buffers, measured

TINY = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=64, num_local_experts=16, num_experts=16,
            num_experts_per_tok=4, shared_expert_intermediate_size=256, n_routed_experts=16, n_shared_experts=1,
            first_k_dense_replace=0, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32,
            v_head_dim=32, n_group=1, topk_group=1, tie_word_embeddings=False, eos_token_id=1, bos_token_id=1,
            pad_token_id=0)


def _measured_block_peak(model, tokens: int) -> int:
    """Bytes of every tensor storage a MoE block's forward creates, alive at once at their peak (a dispatch mode
    that sees each op's outputs; a storage lives while any tensor of it does)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Live(TorchDispatchMode):
        def __init__(self, known):
            super().__init__()
            self.known, self.refs, self.size, self.cur, self.peak = known, {}, {}, 0, 0

        def _drop(self, key):
            self.refs[key] -= 1
            if not self.refs[key]:
                self.cur -= self.size.pop(key)
                del self.refs[key]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                    key = t.untyped_storage().data_ptr()
                    if key not in self.refs:
                        self.refs[key], self.size[key] = 0, t.untyped_storage().nbytes()
                        self.cur += self.size[key]
                    self.refs[key] += 1
                    weakref.finalize(t, self._drop, key)
                    self.peak = max(self.peak, self.cur)
            return out

    block = model.model.layers[0].mlp
    x = torch.randn(1, tokens, model.config.hidden_size, dtype=torch.bfloat16)
    known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), x]}
    with torch.no_grad():
        mode = Live(known)
        with mode:
            block(x)
    return mode.peak


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                                        "gpt_oss"])
def test_the_moe_block_buffers_match_a_measured_forward(model_type):
    """grouped_mm (transformers 5's default on Hopper) on CPU: the block's peak over the tensors it creates, at two
    token counts, against the levels plan adds for the block (beside the layer's input and the block's own)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY, model_type=model_type)
    if model_type in ("mixtral", "olmoe", "gpt_oss"):  # their experts are intermediate_size wide
        cfg.pop("moe_intermediate_size")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.bfloat16,
                                             experts_implementation="grouped_mm").eval()
    spec = spec_from_config(cfg, "tiny")
    from dsdoctor.model.exact import inventory_of_module

    levels = _layer_levels(model_shape(spec, inventory_of_module(model)), 2, 1)
    predicted = levels["experts"] - levels["post_attention_layernorm"] + 8 * spec.hidden_size  # the block's own
    for tokens in (64, 256):
        measured = _measured_block_peak(model, tokens)
        assert predicted * tokens == pytest.approx(measured, rel=0.02), (model_type, tokens)
