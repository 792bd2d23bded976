"""The prompts every load path sees: token-id lists, identical for every path.

A prompt file holds one prompt per line: a JSON list of token ids (``[1, 15043, 3186]``), a JSON object
with ``"ids"`` or ``"text"``, or a plain line of text. Text needs a tokenizer in MODEL_DIR; it is
tokenized once here, so every path gets the same ids. Without a file: a few deterministic prompts drawn
from a seeded generator over the vocabulary (no torch needed).
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

from dsdoctor import door
from dsdoctor.errors import InputError

DEFAULT_COUNT = 4
DEFAULT_LENGTHS = (8, 12, 16, 24)
DEFAULT_SEED = 1234


def default_prompts(vocab_size: int, special_ids=(), count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[list[int]]:
    """``count`` token-id prompts from a seeded generator, avoiding special tokens."""
    if vocab_size < 8:
        raise InputError(f"vocab_size {vocab_size} is too small to draw prompts from")
    rng = random.Random(seed)
    banned = {int(i) for i in special_ids if isinstance(i, int)}
    low = 3 if vocab_size > 16 else 0  # skip the usual pad/bos/eos ids at the start of the vocabulary
    out = []
    for n in range(count):
        length = DEFAULT_LENGTHS[n % len(DEFAULT_LENGTHS)]
        ids = []
        while len(ids) < length:
            t = rng.randrange(low, vocab_size)
            if t not in banned:
                ids.append(t)
        out.append(ids)
    return out


def _parse_line(line: str, lineno: int, path: Path):
    """-> ('ids', [..]) or ('text', str)."""
    stripped = line.strip()
    if stripped.startswith("[") or stripped.startswith("{"):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise InputError(f"line {lineno}: invalid JSON: {exc.msg}", path=path) from None
        except RecursionError:
            raise InputError(f"line {lineno}: nested too deeply", path=path) from None
        if isinstance(value, dict):
            if "ids" in value:
                value = value["ids"]
            elif "input_ids" in value:
                value = value["input_ids"]
            elif isinstance(value.get("text"), str):
                return "text", value["text"]
            else:
                raise InputError(f"line {lineno}: a JSON object needs \"ids\" or \"text\"", path=path)
        if not isinstance(value, list) or not value:
            raise InputError(f"line {lineno}: token ids must be a non-empty JSON list", path=path)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise InputError(f"line {lineno}: token ids must be integers", path=path)
        return "ids", value
    return "text", line.rstrip("\r\n")


def load_prompts(path: str | os.PathLike, vocab_size: int, model_dir: str | os.PathLike | None = None) -> list[list[int]]:
    """Token-id prompts from a prompt file (see the module doc). Blank lines and ``#`` comments are skipped."""
    p = Path(path)
    if not p.exists():
        raise InputError("prompt file not found", path=p)
    text = door.read_text(p, door.PROMPTS)  # a FIFO or /dev/zero is refused
    parsed = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parsed.append((lineno, *_parse_line(line, lineno, p)))
    if not parsed:
        raise InputError("prompt file has no prompts", path=p)
    tokenizer = None
    if any(kind == "text" for _, kind, _ in parsed):
        tokenizer = _load_tokenizer(model_dir, p)
    prompts = []
    for lineno, kind, value in parsed:
        ids = list(tokenizer(value)["input_ids"]) if kind == "text" else value
        if not ids:
            raise InputError(f"line {lineno}: the prompt tokenizes to nothing", path=p)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InputError(f"line {lineno}: token id {bad[0]} is outside the vocabulary (size {vocab_size})", path=p)
        prompts.append([int(t) for t in ids])
    return prompts


def _load_tokenizer(model_dir, prompt_path: Path):
    files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if model_dir is None or not any((Path(model_dir) / f).exists() for f in files):
        raise InputError(
            "has text prompts but the model directory has no tokenizer", path=prompt_path,
            hint="write token-id lists, one JSON list per line, e.g. [1, 450, 4996]",
        )
    door.check_library_files([Path(model_dir) / f for f in files + ("special_tokens_map.json",)], door.MODEL_FILE)
    from transformers import AutoTokenizer  # heavy: only for text prompts

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as exc:  # a broken tokenizer file is bad input, not an internal error
        raise InputError(f"cannot load the tokenizer: {exc}", path=model_dir) from None
