"""Unit tests of the comparison logic and the prompt file, no torch."""
import json

import pytest

from dsdoctor.compare.diff import TOLERANCE, diff_prompt, diff_runs, tolerance
from dsdoctor.compare.prompts import default_prompts, load_prompts
from dsdoctor.errors import InputError

PROBES = [0, 1, 2]


def step(top, probe=(0.0, 0.0, 0.0)):
    """top: [(token, logit), ...] sorted by logit."""
    return {"top_ids": [t for t, _ in top], "top_logits": [v for _, v in top], "probe_logits": list(probe)}


def record(tokens, steps, ids=(5, 6, 7)):
    return {"input_ids": list(ids), "tokens": list(tokens), "steps": steps}


CLEAR = [(10, 5.0), (11, 2.0), (12, 1.0)]


def test_identical_runs_match_with_zero_difference():
    a = record([10, 10], [step(CLEAR), step(CLEAR)])
    d = diff_prompt(0, a, json.loads(json.dumps(a)), "fp32")
    assert (d.status, d.first_divergence, d.max_logit_diff, d.compared) == ("match", None, 0, 2)
    assert d.tolerance == pytest.approx(TOLERANCE["fp32"] * 5.0)


def test_split_on_a_clear_winner_is_a_mismatch():
    a = record([10, 10], [step(CLEAR), step(CLEAR)])
    b = record([10, 11], [step(CLEAR), step([(11, 4.0), (10, 3.0), (12, 1.0)], probe=(0.5, 0, 0))])
    d = diff_prompt(0, a, b, "fp32")
    assert d.status == "mismatch"
    assert (d.first_divergence, d.token_ref, d.token_other) == (1, 10, 11)
    assert d.margin_ref == pytest.approx(3.0)
    assert d.max_logit_diff == pytest.approx(2.0)  # over top-k ids both recorded: token 10 is 5.0 vs 3.0
    assert d.max_diff_position == 1


def test_split_on_a_near_tie_with_agreeing_prefix_is_explained():
    tie = [(10, 3.0), (11, 2.9999), (12, 1.0)]
    tie_b = [(11, 3.0), (10, 2.9999), (12, 1.0)]
    a = record([7, 10, 4], [step(CLEAR), step(tie), step(CLEAR)])
    b = record([7, 11, 9], [step(CLEAR), step(tie_b), step([(9, 5.0)])])
    d = diff_prompt(0, a, b, "fp32")
    assert d.status == "near-tie", d
    assert d.gap_other == pytest.approx(1e-4)
    assert d.max_logit_diff <= d.tolerance


def test_near_tie_after_a_drifting_prefix_is_still_a_mismatch():
    shifted = [(10, 5.5), (11, 2.0), (12, 1.0)]
    tie = [(10, 3.0), (11, 2.9999)]
    a = record([10, 10], [step(CLEAR), step(tie)])
    b = record([10, 11], [step(shifted), step(list(reversed(tie)))])
    assert diff_prompt(0, a, b, "fp32").status == "mismatch"


def test_same_tokens_with_logits_beyond_tolerance_is_drift_and_tolerance_depends_on_dtype():
    a = record([10], [step(CLEAR)])
    b = record([10], [step([(10, 5.2), (11, 2.0), (12, 1.0)])])
    assert diff_prompt(0, a, b, "fp32").status == "drift"
    assert diff_prompt(0, a, b, "bf16").status == "match"
    assert tolerance("bf16", 0.1) == TOLERANCE["bf16"]  # logit scale below 1 counts as 1
    assert tolerance("fp32", 1) < tolerance("fp16", 1) < tolerance("bf16", 1)


def test_different_inputs_are_refused():
    a = record([10], [step(CLEAR)])
    with pytest.raises(ValueError):
        diff_prompt(0, a, record([10], [step(CLEAR)], ids=(1, 2)), "fp32")
    with pytest.raises(ValueError):
        diff_runs({"prompts": [a], "probe_ids": PROBES}, {"prompts": [a, a], "probe_ids": PROBES}, "fp32")


def test_default_prompts_are_deterministic_and_avoid_special_ids():
    a = default_prompts(300, special_ids=[1, 2, None])
    assert a == default_prompts(300, special_ids=[1, 2])
    assert len(a) == 4 and [len(p) for p in a] == [8, 12, 16, 24]
    assert all(3 <= t < 300 for p in a for t in p)
    assert default_prompts(300, seed=1) != a


def test_prompt_file_ids_objects_and_comments(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('# token ids\n[1, 2, 3]\n\n{"ids": [4, 5]}\n{"input_ids": [6]}\n', encoding="utf-8")
    assert load_prompts(f, vocab_size=10) == [[1, 2, 3], [4, 5], [6]]


@pytest.mark.parametrize("content,problem", [
    ("[1, 2,\n", "line 1: invalid JSON"),
    ("[]\n", "non-empty JSON list"),
    ('[1, "a"]\n', "must be integers"),
    ("[1, 99]\n", "token id 99 is outside the vocabulary"),
    ('{"foo": 1}\n', "needs \"ids\" or \"text\""),
    ("# only a comment\n\n", "has no prompts"),
    ("hello world\n", "no tokenizer"),
])
def test_bad_prompt_files_name_the_file_and_line(tmp_path, content, problem):
    f = tmp_path / "p.txt"
    f.write_text(content, encoding="utf-8")
    with pytest.raises(InputError) as info:
        load_prompts(f, vocab_size=10, model_dir=tmp_path)
    assert problem in str(info.value) and str(f) in str(info.value)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_prompts(tmp_path / "nope.txt", vocab_size=10)


def test_text_prompts_are_tokenized_once_with_the_model_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "[UNK]", "hello", "world"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    f = tmp_path / "prompts.txt"
    f.write_text('hello world\n{"text": "world hello hello"}\n[5, 4]\n', encoding="utf-8")
    assert load_prompts(f, vocab_size=6, model_dir=tmp_path) == [[4, 5], [5, 4, 4], [5, 4]]
