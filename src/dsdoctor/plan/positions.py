"""How far a model's positions go, and whether going past ``max_position_embeddings`` can run.

Rotary (RoPE) and ALiBi models compute positions; transformers runs them past the configured limit (quality
may drop: the model was trained to that length). Models with a learned absolute position table (GPT-2,
OPT, GPT-Neo, BioGPT, GPT-BigCode) index a table of that many rows: past it the forward fails.
"""
from __future__ import annotations

LEARNED_ABSOLUTE = {"gpt2", "gpt_bigcode", "opt", "gpt_neo", "biogpt", "imagegpt", "decision_transformer",
                    "ctrl", "openai-gpt", "xlm", "megatron-bert", "bert", "roberta", "git"}
ALIBI = {"bloom", "mpt"}


def position_limit(raw: dict) -> int | None:
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"):
        value = text.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def encoding(raw: dict) -> str:
    """learned | alibi | rotary: how the model encodes positions."""
    model_type = str(raw.get("model_type", ""))
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    if model_type in LEARNED_ABSOLUTE:
        return "learned"
    if model_type in ALIBI or text.get("alibi") or (text.get("attn_config") or {}).get("alibi"):
        return "alibi"
    return "rotary"


def hard_limit(raw: dict) -> int | None:
    """The longest sequence the model can run at all (None: no hard limit)."""
    return position_limit(raw) if encoding(raw) == "learned" else None
