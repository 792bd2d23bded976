"""Every emitted code sample runs (issue 31.4): plan's code for each path it can run here, pasted as a user would,
on real CPU ranks of DeepSpeed with a tiny model of each architecture family, under the installed transformers;
and the tensor-parallel code is emitted only where DeepSpeed 0.19.8 can run it (CPU ranks cannot run
init_inference TP: FACTS.md, so that part tests the gate against DeepSpeed's own policy list)."""
from __future__ import annotations

import json

import pytest

from dsdoctor.plan.api import plan
from dsdoctor.plan.shape import kernel_injectable
from tests.helpers import EXAMPLES, ROOT, deepspeed_launch

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
FAMILIES = {  # tiny 2-layer configs; grouped-query attention in each
    "llama": dict(BASE, model_type="llama"),
    "qwen2": dict(BASE, model_type="qwen2"),
    "mistral": dict(BASE, model_type="mistral", sliding_window=64),
    "phi3": dict(BASE, model_type="phi3"),
    "gemma2": dict(BASE, model_type="gemma2", head_dim=16, sliding_window=32, query_pre_attn_scalar=16),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", head_dim=16, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
}
# the paths whose code runs on CPU ranks (tp: init_inference TP segfaults there; bnb, vLLM, SGLang and NVMe
# need a GPU or a device)
RUNNABLE = ("plain", "zero3", "zero3-offload", "device-map")


def _emitted(model_dir, name: str, monkeypatch) -> str:
    """The code plan emits when ``name`` is the path it recommends (only that path registered)."""
    from dsdoctor.plan import paths

    cls = next(c for c in paths.REGISTRY if c.name == name)
    with monkeypatch.context() as m:
        m.setattr(paths, "REGISTRY", (cls,))
        result = plan(model_dir, gpus=2, gpu_memory="80GiB", host_memory="64GiB", gpu_name="H100", batch=2,
                      prompt_len=8, new_tokens=4)
    assert result.recommended.path == name, result.recommended.why
    return result.recommended.code


@pytest.mark.deepspeed
@pytest.mark.process
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_emitted_code_runs_on_cpu_ranks(family, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = tmp_path / family
    config = AutoConfig.for_model(**FAMILIES[family])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
    codes = {name: _emitted(model_dir, name, monkeypatch) for name in RUNNABLE}
    assert "torch.bfloat16" in codes["zero3"] and "'bf16': {'enabled': True}" in codes["zero3"]
    (tmp_path / "codes.json").write_text(json.dumps(codes))
    proc = deepspeed_launch(ROOT / "tests" / "scripts" / "run_emitted.py", tmp_path / "codes.json", tmp_path,
                            timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(results) == set(RUNNABLE)
        failed = {k: v for k, v in results.items() if not v.startswith("ok [2, ")}
        assert not failed, failed


@pytest.mark.deepspeed
def test_the_kernel_injection_gate_is_deepspeeds_policy_list():
    """DeepSpeed 0.19.8's injection policies (module_inject/replace_policy.py), read from the installed package:
    of the families plan sees, only Llama's decoder layer has one; the gate says the same."""
    pytest.importorskip("transformers")
    from deepspeed.module_inject.replace_policy import replace_policies
    from transformers import AutoConfig, AutoModelForCausalLM

    layers = set()
    for policy in replace_policies:
        policy(None)  # as DeepSpeed's replace_module does: sets the policy's _orig_layer_class
        orig = policy._orig_layer_class
        layers |= set(orig) if isinstance(orig, list) else {orig}
    for family, cfg in FAMILIES.items():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).to("meta")
        layer = type(model.model.layers[0])
        served = layer in layers
        assert served == (family == "llama"), (family, layer)
        # the gate: a policy, and equal head counts (GQA does not fit the fused qkv)
        assert kernel_injectable(family, 4, 4, cfg) == served
        assert not kernel_injectable(family, 4, 2, cfg)
    assert not kernel_injectable("llama", 8, 8, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
             "tie_word_embeddings": False}


@pytest.mark.parametrize("model, heads, injectable", [
    ("qwen2-72b", None, False),  # Qwen2: no injection policy
    ("llama-70b", 8, False),  # grouped-query attention: the v1 kernels size a fused qkv for equal head counts
    ("llama-70b", 64, True),  # the same shape with multi-head attention: the kernels serve it
])
def test_tp_code_needing_kernel_injection_only_where_deepspeed_has_it(model, heads, injectable, tmp_path):
    """transformers < 4.51 puts a whole CPU copy in every rank, so a 72B on 8 GPUs with 1 TiB of host can load
    tensor-parallel only through kernel injection (a meta model and checkpoints.json). That code is emitted only
    for a model DeepSpeed can inject; otherwise no tp row fits and no init_inference code is emitted."""
    if model == "qwen2-72b":
        path = EXAMPLES / "qwen2-72b"
    else:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(dict(LLAMA_70B, num_key_value_heads=heads)))
    r = plan(path, gpus=8, gpu_memory="80GiB", host_memory="1TiB", gpu_name="H100", counts="formula",
             transformers_version="4.50.0")
    tp_rows = [p for p in r.paths if p.name.startswith("tp")]
    assert tp_rows
    injected = [p.name for p in tp_rows if p.loading in ("meta-checkpoint", "pre-sharded")]
    code = r.recommended.code or ""
    if injectable:
        assert injected and any(p.fits for p in tp_rows)
    else:
        assert not injected and not any(p.fits for p in tp_rows)
        assert "init_inference" not in code and "replace_with_kernel_inject=True" not in code
