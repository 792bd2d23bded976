"""A model's shape from a local Hugging Face ``config.json`` (a directory or the file), without torch.

Parameter counts (total and active) come from ``dsdoctor.model.formulas`` (config.json alone); ``plan`` replaces
them with exact counts from the model built on the meta device (``dsdoctor.model.exact``) when torch and
transformers are installed.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.dtypes import normalize_dtype
from dsdoctor.errors import InputError
from dsdoctor.model.formulas import estimate_params, falcon_kv_heads, tied
from dsdoctor.model.inventory import MoeLayout
from dsdoctor.model.moe import routed_experts


@dataclass
class ModelSpec:
    path: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str | None  # the checkpoint's dtype per config.json, normalized (bf16, fp16, fp32) or None
    max_position_embeddings: int | None = None
    sliding_window: int | None = None
    num_experts: int = 0
    raw: dict = field(default_factory=dict, repr=False)
    # filled by formulas.estimate_params(), replaced by exact counts when available
    num_params: int = 0
    embedding_params: int = 0
    per_layer_params: int = 0
    largest_param_numel: int = 0
    counted_by: str = "formula"
    active_params: int = 0  # what one token uses (num_params for a dense model)
    moe: MoeLayout | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("raw")
        return d


def _find_config(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise InputError("no config.json found", path=p, hint="pass a local model directory or its config.json")
    return p


def read_config_json(path: str | os.PathLike, named_by=None) -> tuple[Path, dict]:
    """The parsed config.json (the one reader of it: plan, check, split, merge, verify, compare, RL jobs): a
    regular file of bounded size, depth and node count (untrusted input); outside the user's tree (a system
    folder, or away from the file ``named_by`` that names it) only when it reads as a model config."""
    p = _find_config(path)
    text = door.read_text(p, door.MODEL_CONFIG, named_by=named_by)
    door.json_bound(text, p, door.MODEL_CONFIG)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", path=p) from None
    except RecursionError:
        raise InputError("is nested too deeply", path=p) from None
    if not isinstance(data, dict):
        raise InputError("config.json must hold a JSON object", path=p)
    door.check_tree(data, p, door.MODEL_CONFIG)
    return p, data


# Upper bounds on a decoder's shape: 16x or more beyond any released model (Llama 3.1 405B: hidden 16384,
# 126 layers, 128 heads; the largest vocabularies are ~256k). Past them a plan is not for a real model, and
# the arithmetic (and the meta-device build) would run for minutes on numbers like 1e12.
LIMITS = {
    "hidden_size": 1 << 18, "num_layers": 2048, "num_heads": 1 << 14, "num_kv_heads": 1 << 14,
    "head_dim": 1 << 14, "intermediate_size": 1 << 21, "vocab_size": 1 << 24, "num_experts": 1 << 14,
}
MAX_PARAMS = 10**14  # 100 T parameters


def _int(cfg: dict, path: Path, *keys, default=None, low: int = 1, limit: int | None = None):
    """The first of ``keys`` that is set, as an integer in [low, limit]; the file and the key named if not."""
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            if isinstance(v, float) and v.is_integer():
                v = int(v)  # 4096.0: the integer it spells
            if isinstance(v, bool) or not isinstance(v, int):
                raise InputError(f"{k} must be an integer, not {v!r}", path=path)
            if v < low:
                raise InputError(f"{k} is {v}; it must be at least {low}", path=path)
            if limit is not None and v > limit:
                raise InputError(f"{k} is {v}; larger than any real model (limit {limit})", path=path)
            return v
    if default is None:
        raise InputError(f"missing {keys[0]}: not a decoder language-model config", path=path)
    return default


def load_model_spec(path: str | os.PathLike, named_by=None) -> ModelSpec:
    p, cfg = read_config_json(path, named_by)
    return spec_from_config(cfg, p)


def spec_from_config(cfg: dict, path: str | os.PathLike) -> ModelSpec:
    """The spec of a parsed ``config.json`` (untrusted: bounded here too); ``path`` names where it came from."""
    p = Path(path)
    door.check_tree(cfg, p, door.MODEL_CONFIG)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    hidden = _int(text, p, "hidden_size", "n_embd", "n_embed", "d_model", limit=LIMITS["hidden_size"])
    heads = _int(text, p, "num_attention_heads", "n_head", "num_heads", "n_heads", limit=LIMITS["num_heads"])
    if hidden // heads < 1 and text.get("head_dim") is None:
        raise InputError(f"hidden_size {hidden} is smaller than num_attention_heads {heads}", path=p)
    experts = routed_experts(text)
    spec = ModelSpec(
        path=str(p),
        model_type=str(cfg.get("model_type", "unknown")),
        hidden_size=hidden,
        num_layers=_int(text, p, "num_hidden_layers", "n_layer", "num_layers", "n_layers",
                        limit=LIMITS["num_layers"]),
        num_heads=heads,
        num_kv_heads=_int(text, p, "num_key_value_heads", "num_kv_heads", default=heads,
                          limit=LIMITS["num_kv_heads"]),
        head_dim=_int(text, p, "head_dim", default=hidden // heads, limit=LIMITS["head_dim"]),
        intermediate_size=_int(text, p, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size",
                               default=4 * hidden, limit=LIMITS["intermediate_size"]),
        vocab_size=_int(text, p, "vocab_size", limit=LIMITS["vocab_size"]),
        tie_word_embeddings=tied(cfg),  # transformers' per-architecture default when unset
        dtype=normalize_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or text.get("torch_dtype")),
        max_position_embeddings=text.get("max_position_embeddings"),
        sliding_window=text.get("sliding_window") if isinstance(text.get("sliding_window"), int) else None,
        num_experts=_int({"num_experts": experts}, p, "num_experts", low=0, limit=LIMITS["num_experts"]),
        raw=cfg,
    )
    if spec.model_type == "falcon":  # multi-query: one key/value head (modeling_falcon.py)
        spec.num_kv_heads = falcon_kv_heads(text, heads)
    estimate_params(spec)
    if spec.num_params > MAX_PARAMS:
        raise InputError(f"describes {spec.num_params:.3g} parameters; larger than any real model "
                         f"(limit {MAX_PARAMS:.0e})", path=p)
    return spec

