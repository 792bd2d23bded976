"""Parameter inventories from config.json alone (no torch), one builder per architecture family.

Each builder lists the tensors transformers 5 registers for that ``model_type`` (names, shapes, order of
registration, tied lm_head, biases and norms), so ``--counts formula`` matches the meta-device count
exactly (``tests/model/test_formulas.py`` builds both for public configs). An architecture without a
builder gets the Llama-style formula, marked ``formula-approx``.

The one owner of parameter counts from config.json: ``from_formula`` (every tensor, for ``plan``) and
``estimate_params`` (the totals every ``ModelSpec`` carries, for ``check`` and ``split``). A live torch
model is counted by ``dsdoctor.model.exact``.
"""
from __future__ import annotations

from dsdoctor.model.inventory import Inventory, Param, apply_to_spec, kind_of, layer_of
from dsdoctor.model.moe import is_moe_layer, layout, routed_experts, shared_intermediate

# transformers' config defaults for tie_word_embeddings where they are True
TIE_DEFAULT_TRUE = {"gemma", "gemma2", "gpt2", "bloom", "falcon", "mpt", "opt", "starcoder2", "gpt_bigcode"}
LLAMA_EXACT = {"llama", "mistral", "qwen2"}  # the Llama-style builder (_llama) is exact


def text_config(raw: dict) -> dict:
    return raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw


def tied(raw: dict) -> bool:
    default = str(raw.get("model_type", "")) in TIE_DEFAULT_TRUE
    text = text_config(raw)
    value = raw.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    return default if value is None else bool(value)


class _Builder:
    def __init__(self):
        self.params: list[Param] = []

    def add(self, module: str, shape: tuple, cls: str = "Linear", bias: bool = False, bias_shape=None,
            name: str = "weight", expert: bool = False):
        n = 1
        for s in shape:
            n *= s
        full = f"{module}.{name}"
        self.params.append(Param(full, module, n, tuple(shape), kind_of(module, cls, len(shape)), layer_of(full),
                                 expert))
        if bias:
            b = bias_shape or (shape[0],)
            self.params.append(Param(f"{module}.bias", module, b[0], tuple(b), kind_of(module, cls, 1),
                                     layer_of(f"{module}.bias")))

    def norm(self, module: str, h: int, bias: bool = False, cls: str = "LayerNorm"):
        self.add(module, (h,), cls, bias)

    def inventory(self, raw: dict, owner: str, head: str = "lm_head", head_bias: int = 0) -> Inventory:
        pairs = []
        if tied(raw):
            pairs.append((head, owner))
        else:
            vocab = next(p for p in self.params if p.module == owner).shape
            self.add(head, (vocab[0], vocab[1]), "Linear", bool(head_bias), (head_bias,) if head_bias else None)
        return Inventory(self.params, tied=pairs, counted_by="formula")


def _i(cfg: dict, *keys, default=None):
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return default


def _attention(b: _Builder, p: str, spec, c: dict, t: str):
    """q/k/v/o (or phi3's fused qkv) with each family's biases and q/k norms."""
    h, nh, kv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    if t == "phi3":
        b.add(f"{p}.self_attn.o_proj", (h, nh * hd))
        b.add(f"{p}.self_attn.qkv_proj", ((nh + 2 * kv) * hd, h))
        return
    if t == "gpt_oss":
        b.add(f"{p}.self_attn", (nh,), "GptOssAttention", name="sinks")
    bias = bool(c.get("attention_bias", t == "gpt_oss"))
    if t == "starcoder2":
        bias = bool(c.get("use_bias", True))
    qkv_bias = bool(c.get("qkv_bias", True)) if t == "qwen2_moe" else bias
    b.add(f"{p}.self_attn.q_proj", (nh * hd, h), bias=qkv_bias)
    b.add(f"{p}.self_attn.k_proj", (kv * hd, h), bias=qkv_bias)
    b.add(f"{p}.self_attn.v_proj", (kv * hd, h), bias=qkv_bias)
    b.add(f"{p}.self_attn.o_proj", (h, nh * hd), bias=bias and t != "qwen2_moe")
    if t in ("qwen3", "qwen3_moe"):
        b.norm(f"{p}.self_attn.q_norm", hd, cls="RMSNorm")
        b.norm(f"{p}.self_attn.k_norm", hd, cls="RMSNorm")
    elif t == "olmoe":
        b.norm(f"{p}.self_attn.q_norm", h, cls="RMSNorm")
        b.norm(f"{p}.self_attn.k_norm", h // nh * kv, cls="RMSNorm")


def _gated_mlp(b: _Builder, module: str, h: int, inter: int, bias: bool = False):
    b.add(f"{module}.gate_proj", (inter, h), bias=bias)
    b.add(f"{module}.up_proj", (inter, h), bias=bias)
    b.add(f"{module}.down_proj", (h, inter), bias=bias)


def _mlp_bias(c: dict, t: str) -> bool:
    return t == "deepseek_v2" and bool(c.get("mlp_bias", False))


def _routed(b: _Builder, p: str, h: int, c: dict, t: str) -> int:
    """A routed layer's router, fused experts and shared experts, in transformers 5's registration order;
    returns one expert's intermediate size."""
    n = routed_experts(c, t)
    inter = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 4 * h)
    gate = (f"{p}.mlp.router" if t == "gpt_oss" else f"{p}.mlp.gate", (n, h), "TopKRouter", t == "gpt_oss")
    experts = f"{p}.mlp.experts"
    if t not in ("qwen3_moe", "deepseek_v2", "deepseek_v3"):  # these register the experts before the router
        b.add(*gate)
    if t == "gpt_oss":
        b.add(experts, (n, h, 2 * inter), "Experts", name="gate_up_proj", expert=True)
        b.add(experts, (n, 2 * inter), "Experts", name="gate_up_proj_bias", expert=True)
        b.add(experts, (n, inter, h), "Experts", name="down_proj", expert=True)
        b.add(experts, (n, h), "Experts", name="down_proj_bias", expert=True)
    else:
        b.add(experts, (n, 2 * inter, h), "Experts", name="gate_up_proj", expert=True)
        b.add(experts, (n, h, inter), "Experts", name="down_proj", expert=True)
    if t in ("qwen3_moe", "deepseek_v2", "deepseek_v3"):
        b.add(*gate)
    shared, shared_inter = shared_intermediate(c)
    if t == "qwen2_moe":
        _gated_mlp(b, f"{p}.mlp.shared_expert", h, shared_inter)
        b.add(f"{p}.mlp.shared_expert_gate", (1, h))
    elif shared:
        _gated_mlp(b, f"{p}.mlp.shared_experts", h, shared_inter, _mlp_bias(c, t))
    return inter


def _mla(b: _Builder, p: str, spec, c: dict):
    """DeepSeek's multi-head latent attention: low-rank q (or a plain q_proj) and a compressed kv."""
    h, nh = spec.hidden_size, spec.num_heads
    rope, nope = int(c.get("qk_rope_head_dim", 64)), int(c.get("qk_nope_head_dim", 128))
    v_dim, kv_rank, q_rank = int(c.get("v_head_dim", 128)), int(c.get("kv_lora_rank", 512)), c.get("q_lora_rank")
    bias = bool(c.get("attention_bias", False))
    a = f"{p}.self_attn"
    if q_rank is None:
        b.add(f"{a}.q_proj", (nh * (nope + rope), h))
    else:
        b.add(f"{a}.q_a_proj", (int(q_rank), h), bias=bias)
        b.norm(f"{a}.q_a_layernorm", int(q_rank), cls="RMSNorm")
        b.add(f"{a}.q_b_proj", (nh * (nope + rope), int(q_rank)))
    b.add(f"{a}.kv_a_proj_with_mqa", (kv_rank + rope, h), bias=bias)
    b.norm(f"{a}.kv_a_layernorm", kv_rank, cls="RMSNorm")
    b.add(f"{a}.kv_b_proj", (nh * (nope + v_dim), kv_rank))
    b.add(f"{a}.o_proj", (h, nh * v_dim), bias=bias)


def _llama_family(spec, raw: dict) -> Inventory:
    """gemma, gemma2, qwen3, phi3, starcoder2 and the MoE decoders (mixtral, qwen2_moe, qwen3_moe, olmoe,
    deepseek_v2/v3, gpt_oss): the Llama layout with each family's changes."""
    c = text_config(raw)
    t = spec.model_type
    h, inter = spec.hidden_size, spec.intermediate_size
    b = _Builder()
    b.add("model.embed_tokens", (spec.vocab_size, h), "Embedding")
    moe_layers, expert_inter = [], 0
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        if t.startswith("deepseek"):
            _mla(b, p, spec, c)
        else:
            _attention(b, p, spec, c, t)
        if is_moe_layer(c, t, i):
            expert_inter = _routed(b, p, h, c, t)
            moe_layers.append(i)
        elif t == "phi3":
            b.add(f"{p}.mlp.gate_up_proj", (2 * inter, h))
            b.add(f"{p}.mlp.down_proj", (h, inter))
        elif t == "starcoder2":
            bias = bool(c.get("use_bias", True))
            b.add(f"{p}.mlp.c_fc", (inter, h), bias=bias)
            b.add(f"{p}.mlp.c_proj", (h, inter), bias=bias)
        else:
            _gated_mlp(b, f"{p}.mlp", h, inter, _mlp_bias(c, t))
        norm_bias = t == "starcoder2"
        b.norm(f"{p}.input_layernorm", h, norm_bias, "RMSNorm")
        b.norm(f"{p}.post_attention_layernorm", h, norm_bias, "RMSNorm")
        if t == "gemma2":
            b.norm(f"{p}.pre_feedforward_layernorm", h, cls="RMSNorm")
            b.norm(f"{p}.post_feedforward_layernorm", h, cls="RMSNorm")
    b.norm("model.norm", h, t == "starcoder2", "RMSNorm")
    inv = b.inventory(raw, "model.embed_tokens")
    inv.moe = layout(c, t, moe_layers, expert_inter)
    return inv


def _gpt2(spec, raw: dict) -> Inventory:
    c = text_config(raw)
    h = spec.hidden_size
    inner = c.get("n_inner") or 4 * h
    b = _Builder()
    b.add("transformer.wte", (spec.vocab_size, h), "Embedding")
    b.add("transformer.wpe", (int(_i(c, "n_positions", "max_position_embeddings", default=1024)), h), "Embedding")
    for i in range(spec.num_layers):
        p = f"transformer.h.{i}"
        b.norm(f"{p}.ln_1", h, True)
        for mod, shape in ((f"{p}.attn.c_attn", (h, 3 * h)), (f"{p}.attn.c_proj", (h, h))):
            b.add(mod, shape, "Conv1D", True, (shape[1],))
        b.norm(f"{p}.ln_2", h, True)
        for mod, shape in ((f"{p}.mlp.c_fc", (h, inner)), (f"{p}.mlp.c_proj", (inner, h))):
            b.add(mod, shape, "Conv1D", True, (shape[1],))
    b.norm("transformer.ln_f", h, True)
    return b.inventory(raw, "transformer.wte")


def _gpt_neox(spec, raw: dict) -> Inventory:
    c = text_config(raw)
    h, inter = spec.hidden_size, spec.intermediate_size
    attn_bias = bool(c.get("attention_bias", True))
    b = _Builder()
    b.add("gpt_neox.embed_in", (spec.vocab_size, h), "Embedding")
    for i in range(spec.num_layers):
        p = f"gpt_neox.layers.{i}"
        b.norm(f"{p}.input_layernorm", h, True)
        b.norm(f"{p}.post_attention_layernorm", h, True)
        b.add(f"{p}.attention.query_key_value", (3 * h, h), bias=attn_bias)
        b.add(f"{p}.attention.dense", (h, h), bias=attn_bias)
        b.add(f"{p}.mlp.dense_h_to_4h", (inter, h), bias=True)
        b.add(f"{p}.mlp.dense_4h_to_h", (h, inter), bias=True)
    b.norm("gpt_neox.final_layer_norm", h, True)
    return b.inventory(raw, "gpt_neox.embed_in")


def _bloom(spec, raw: dict) -> Inventory:
    h = spec.hidden_size
    b = _Builder()
    b.add("transformer.word_embeddings", (spec.vocab_size, h), "Embedding")
    b.norm("transformer.word_embeddings_layernorm", h, True)
    for i in range(spec.num_layers):
        p = f"transformer.h.{i}"
        b.norm(f"{p}.input_layernorm", h, True)
        b.add(f"{p}.self_attention.query_key_value", (3 * h, h), bias=True)
        b.add(f"{p}.self_attention.dense", (h, h), bias=True)
        b.norm(f"{p}.post_attention_layernorm", h, True)
        b.add(f"{p}.mlp.dense_h_to_4h", (4 * h, h), bias=True)
        b.add(f"{p}.mlp.dense_4h_to_h", (h, 4 * h), bias=True)
    b.norm("transformer.ln_f", h, True)
    return b.inventory(raw, "transformer.word_embeddings")


def falcon_kv_heads(c: dict, heads: int) -> int:
    if c.get("new_decoder_architecture"):
        return int(c.get("num_kv_heads") or heads)
    return 1 if c.get("multi_query", True) else heads


def _falcon(spec, raw: dict) -> Inventory:
    c = text_config(raw)
    h, nh = spec.hidden_size, spec.num_heads
    hd = h // nh
    bias = bool(c.get("bias", False))
    new = bool(c.get("new_decoder_architecture", False))
    if new:
        qkv = (int(c.get("num_kv_heads") or nh) * 2 + nh) * hd
    elif c.get("multi_query", True):
        qkv = h + 2 * hd
    else:
        qkv = 3 * h
    ffn = int(c.get("ffn_hidden_size") or 4 * h)
    parallel = bool(c.get("parallel_attn", True))
    n_ln = c.get("num_ln_in_parallel_attn") or (2 if new else None)
    b = _Builder()
    b.add("transformer.word_embeddings", (spec.vocab_size, h), "Embedding")
    for i in range(spec.num_layers):
        p = f"transformer.h.{i}"
        b.add(f"{p}.self_attention.query_key_value", (qkv, h), "FalconLinear", bias)
        b.add(f"{p}.self_attention.dense", (h, h), "FalconLinear", bias)
        b.add(f"{p}.mlp.dense_h_to_4h", (ffn, h), "FalconLinear", bias)
        b.add(f"{p}.mlp.dense_4h_to_h", (h, ffn), "FalconLinear", bias)
        if not parallel:
            b.norm(f"{p}.post_attention_layernorm", h, True)
            b.norm(f"{p}.input_layernorm", h, True)
        elif n_ln == 2:
            b.norm(f"{p}.ln_attn", h, True)
            b.norm(f"{p}.ln_mlp", h, True)
        else:
            b.norm(f"{p}.input_layernorm", h, True)
    b.norm("transformer.ln_f", h, True)
    return b.inventory(raw, "transformer.word_embeddings")


def _opt(spec, raw: dict) -> Inventory:
    c = text_config(raw)
    h, ffn = spec.hidden_size, int(_i(c, "ffn_dim", default=4 * spec.hidden_size))
    proj = int(c.get("word_embed_proj_dim") or h)
    bias = bool(c.get("enable_bias", True))
    affine = bool(c.get("layer_norm_elementwise_affine", True))
    b = _Builder()
    b.add("model.decoder.embed_tokens", (spec.vocab_size, proj), "Embedding")
    b.add("model.decoder.embed_positions", (int(c.get("max_position_embeddings", 2048)) + 2, h),
          "OPTLearnedPositionalEmbedding")
    if proj != h:
        b.add("model.decoder.project_out", (proj, h))
        b.add("model.decoder.project_in", (h, proj))
    if c.get("do_layer_norm_before", True) and not c.get("_remove_final_layer_norm", False) and affine:
        b.norm("model.decoder.final_layer_norm", h, True)
    for i in range(spec.num_layers):
        p = f"model.decoder.layers.{i}"
        for name in ("k_proj", "v_proj", "q_proj", "out_proj"):
            b.add(f"{p}.self_attn.{name}", (h, h), bias=bias)
        if affine:
            b.norm(f"{p}.self_attn_layer_norm", h, True)
        b.add(f"{p}.fc1", (ffn, h), bias=bias)
        b.add(f"{p}.fc2", (h, ffn), bias=bias)
        if affine:
            b.norm(f"{p}.final_layer_norm", h, True)
    return b.inventory(raw, "model.decoder.embed_tokens")


def _gptj(spec, raw: dict) -> Inventory:
    c = text_config(raw)
    h = spec.hidden_size
    inner = c.get("n_inner") or 4 * h
    b = _Builder()
    b.add("transformer.wte", (spec.vocab_size, h), "Embedding")
    for i in range(spec.num_layers):
        p = f"transformer.h.{i}"
        b.norm(f"{p}.ln_1", h, True)
        for name in ("k_proj", "v_proj", "q_proj", "out_proj"):
            b.add(f"{p}.attn.{name}", (h, h))
        b.add(f"{p}.mlp.fc_in", (inner, h), bias=True)
        b.add(f"{p}.mlp.fc_out", (h, inner), bias=True)
    b.norm("transformer.ln_f", h, True)
    return b.inventory(raw, "transformer.wte", head_bias=spec.vocab_size)


def _mpt(spec, raw: dict) -> Inventory:
    h = spec.hidden_size
    b = _Builder()
    b.add("transformer.wte", (spec.vocab_size, h), "Embedding")
    for i in range(spec.num_layers):
        p = f"transformer.blocks.{i}"
        b.norm(f"{p}.norm_1", h)
        b.add(f"{p}.attn.Wqkv", (3 * h, h))
        b.add(f"{p}.attn.out_proj", (h, h))
        b.norm(f"{p}.norm_2", h)
        b.add(f"{p}.ffn.up_proj", (4 * h, h))
        b.add(f"{p}.ffn.down_proj", (h, 4 * h))
    b.norm("transformer.norm_f", h)
    return b.inventory(raw, "transformer.wte")


def _phi(spec, raw: dict) -> Inventory:
    c = text_config(raw)
    h, nh, kv, hd, inter = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    b = _Builder()
    b.add("model.embed_tokens", (spec.vocab_size, h), "Embedding")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        b.add(f"{p}.self_attn.q_proj", (nh * hd, h), bias=True)
        b.add(f"{p}.self_attn.k_proj", (kv * hd, h), bias=True)
        b.add(f"{p}.self_attn.v_proj", (kv * hd, h), bias=True)
        b.add(f"{p}.self_attn.dense", (h, nh * hd), bias=True)
        if c.get("qk_layernorm"):
            b.norm(f"{p}.self_attn.q_layernorm", hd, True)
            b.norm(f"{p}.self_attn.k_layernorm", hd, True)
        b.add(f"{p}.mlp.fc1", (inter, h), bias=True)
        b.add(f"{p}.mlp.fc2", (h, inter), bias=True)
        b.norm(f"{p}.input_layernorm", h, True)
    b.norm("model.final_layernorm", h, True)
    return b.inventory(raw, "model.embed_tokens", head_bias=spec.vocab_size)


def _jetmoe(spec, raw: dict) -> Inventory:
    """JetMoE: routed experts in the attention (a shared kv_proj) and in the MLP, each with a router and a bias."""
    c = text_config(raw)
    h, n, inter = spec.hidden_size, routed_experts(c, "jetmoe"), spec.intermediate_size
    kv = int(c.get("kv_channels") or spec.head_dim) * spec.num_kv_heads
    b = _Builder()
    b.add("model.embed_tokens", (spec.vocab_size, h), "Embedding")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        for mod, up, down in ((f"{p}.mlp", 2 * inter, inter), (f"{p}.self_attention.experts", kv, kv)):
            b.add(mod, (h,), "Bias", name="bias")
            b.add(f"{mod}.input_linear", (n, up, h), "ParallelExperts", expert=True)
            b.add(f"{mod}.output_linear", (n, h, down), "ParallelExperts", expert=True)
            b.add(f"{mod}.router.layer", (n, h))
        b.add(f"{p}.self_attention.kv_proj", (2 * kv, h))
        b.norm(f"{p}.input_layernorm", h, cls="RMSNorm")
        b.norm(f"{p}.post_attention_layernorm", h, cls="RMSNorm")
    b.norm("model.norm", h, cls="RMSNorm")
    inv = b.inventory(raw, "model.embed_tokens")
    inv.moe = layout(c, "jetmoe", range(spec.num_layers), inter)
    return inv


BUILDERS = {
    "gemma": _llama_family, "gemma2": _llama_family, "qwen3": _llama_family, "phi3": _llama_family,
    "starcoder2": _llama_family, "mixtral": _llama_family, "qwen2_moe": _llama_family, "qwen3_moe": _llama_family,
    "olmoe": _llama_family, "deepseek_v2": _llama_family, "deepseek_v3": _llama_family, "gpt_oss": _llama_family,
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, "bloom": _bloom, "falcon": _falcon, "opt": _opt, "gptj": _gptj,
    "mpt": _mpt, "phi": _phi, "jetmoe": _jetmoe,
}
EXACT_TYPES = LLAMA_EXACT | set(BUILDERS)


def _llama(spec) -> Inventory:
    """A Llama-style decoder (gated MLP, RMSNorm, optional q/k/v bias, optional routed experts as fused 3-D
    tensors): exact for the Llama family, marked ``formula-approx`` for an architecture without a builder. It
    lists a constant number of tensors per layer whatever the expert count (an untrusted config.json with
    thousands of experts costs nothing)."""
    h, hd, nh, kv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    inter = spec.intermediate_size
    raw = text_config(spec.raw)
    qkv_bias = bool(raw.get("attention_bias")) or spec.model_type == "qwen2"
    experts = spec.num_experts
    moe_inter = int(raw.get("moe_intermediate_size") or inter) if experts else 0
    shared, shared_inter = shared_intermediate(raw) if experts else (0, 0)
    b = _Builder()
    b.add("model.embed_tokens", (spec.vocab_size, h), "Embedding")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        b.norm(f"{p}.input_layernorm", h, cls="RMSNorm")
        for name, out in (("q_proj", nh * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            b.add(f"{p}.self_attn.{name}", (out, h), bias=qkv_bias)
        b.add(f"{p}.self_attn.o_proj", (h, nh * hd))
        b.norm(f"{p}.post_attention_layernorm", h, cls="RMSNorm")
        if is_moe_layer(raw, spec.model_type, i):
            b.add(f"{p}.mlp.gate", (experts, h))
            b.add(f"{p}.mlp.experts", (experts, 2 * moe_inter, h), "Experts", name="gate_up_proj", expert=True)
            b.add(f"{p}.mlp.experts", (experts, h, moe_inter), "Experts", name="down_proj", expert=True)
            if shared:
                _gated_mlp(b, f"{p}.mlp.shared_experts", h, shared_inter)
        else:
            _gated_mlp(b, f"{p}.mlp", h, int(raw.get("intermediate_size_mlp") or inter))
    b.norm("model.norm", h, cls="RMSNorm")
    if spec.tie_word_embeddings:
        inv = Inventory(b.params, tied=[("lm_head", "model.embed_tokens")])
    else:
        b.add("lm_head", (spec.vocab_size, h))
        inv = Inventory(b.params)
    inv.counted_by = "formula" if spec.model_type in EXACT_TYPES else "formula-approx"
    moe_layers = [i for i in range(spec.num_layers) if is_moe_layer(raw, spec.model_type, i)]
    inv.moe = layout(raw, spec.model_type, moe_layers, moe_inter)
    return inv


def from_formula(spec) -> Inventory:
    """Every parameter tensor from config.json alone: the architecture's own builder, else the Llama-style
    decoder (exact for the Llama family, ``formula-approx`` for anything else)."""
    builder = BUILDERS.get(spec.model_type)
    return builder(spec, spec.raw) if builder else _llama(spec)


def estimate_params(spec):
    """Fill the spec's counts (``load_model_spec`` does, for every model) from the one inventory; its cost is
    linear in the layers only (bounded by ``spec.LIMITS``)."""
    return apply_to_spec(spec, from_formula(spec))
