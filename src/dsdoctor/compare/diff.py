"""Compare two run records prompt by prompt.

For each prompt: the first generated position where the tokens differ, the reference's top-2 logit margin
there (a near-tie flips on rounding noise; a broken load flips on a clear winner), and the largest logit
difference over the positions whose inputs were still identical (the shared prefix, including the
divergent position itself). Logits are compared on the probe token ids plus the top-k ids both runs
recorded.

Classification (tolerance scales with the dtype's precision and the logits' magnitude):
  match     same tokens, logits within tolerance
  drift     same tokens, logits beyond tolerance somewhere on identical inputs: a different model (an error)
  near-tie  tokens differ where the reference's choice and the other's were within 2x tolerance, and the
            shared prefix agreed within tolerance: rounding, not corruption
  mismatch  anything else: the load path computes a different function
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

# Allowed |logit difference| per unit of logit scale, by compute dtype. Reordered float sums (another
# kernel, tensor-parallel all-reduce, a gathered vs a resident weight) move fp32 logits by ~1e-6 relative;
# bf16 keeps 8 mantissa bits and accumulates rounding over every layer.
TOLERANCE = {"fp32": 1e-3, "fp16": 2e-2, "bf16": 1e-1}
STATUSES = ("match", "drift", "near-tie", "mismatch")


def tolerance(dtype: str, scale: float) -> float:
    return TOLERANCE.get(dtype, TOLERANCE["bf16"]) * max(1.0, abs(scale))


@dataclass
class PromptDiff:
    prompt: int  # index into the prompt list
    status: str  # match | drift | near-tie | mismatch
    compared: int  # generated positions compared
    first_divergence: int | None = None  # generated position, 0-based
    token_ref: int | None = None
    token_other: int | None = None
    margin_ref: float | None = None  # reference top-1 minus top-2 logit at the divergent position
    gap_other: float | None = None  # reference logit of its own pick minus of the other's pick (None: outside top-k)
    max_logit_diff: float = 0.0  # over the shared prefix
    max_diff_position: int | None = None
    tolerance: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _step_diff(a: dict, b: dict) -> float:
    """Largest |logit difference| at one position: probe ids, and top-k ids both runs recorded."""
    diffs = [abs(x - y) for x, y in zip(a["probe_logits"], b["probe_logits"])]
    top_b = dict(zip(b["top_ids"], b["top_logits"]))
    diffs += [abs(v - top_b[t]) for t, v in zip(a["top_ids"], a["top_logits"]) if t in top_b]
    return max(diffs, default=0.0)


def diff_prompt(index: int, ref: dict, other: dict, dtype: str) -> PromptDiff:
    """``ref``/``other``: one prompt's record from two runs (tokens and per-step logits)."""
    if ref["input_ids"] != other["input_ids"]:
        raise ValueError(f"prompt {index}: the runs saw different inputs")
    tok_a, tok_b = ref["tokens"], other["tokens"]
    n = min(len(tok_a), len(tok_b), len(ref["steps"]), len(other["steps"]))
    first = next((i for i in range(n) if tok_a[i] != tok_b[i]), None)
    if first is None and len(tok_a) != len(tok_b):
        first = n
    shared = n if first is None else min(first + 1, n)  # the divergent step still had identical inputs
    scale = max((abs(ref["steps"][i]["top_logits"][0]) for i in range(shared)), default=1.0)
    tol = tolerance(dtype, scale)
    max_diff, where = 0.0, None
    for i in range(shared):
        d = _step_diff(ref["steps"][i], other["steps"][i])
        if d > max_diff:
            max_diff, where = d, i
    result = PromptDiff(index, "match", n, max_logit_diff=round(max_diff, 6), max_diff_position=where,
                        tolerance=round(tol, 6))
    if first is None:
        result.status = "match" if max_diff <= tol else "drift"
        return result
    result.first_divergence = first
    if first < n:
        step = ref["steps"][first]
        result.token_ref, result.token_other = tok_a[first], tok_b[first]
        logits = step["top_logits"]
        result.margin_ref = round(logits[0] - logits[1], 6) if len(logits) > 1 else None
        ranked = dict(zip(step["top_ids"], logits))
        if tok_b[first] in ranked and tok_a[first] in ranked:
            result.gap_other = round(ranked[tok_a[first]] - ranked[tok_b[first]], 6)
    near = result.gap_other is not None and result.gap_other <= 2 * tol and max_diff <= tol
    result.status = "near-tie" if near else "mismatch"
    return result


def diff_runs(ref: dict, other: dict, dtype: str) -> list[PromptDiff]:
    if len(ref["prompts"]) != len(other["prompts"]):
        raise ValueError("the runs saw a different number of prompts")
    if ref["probe_ids"] != other["probe_ids"]:
        raise ValueError("the runs recorded different probe token ids")
    return [diff_prompt(i, a, b, dtype) for i, (a, b) in enumerate(zip(ref["prompts"], other["prompts"]))]
