"""compare must not pass broken weights because the tokens happened to match: logits beyond tolerance on
identical inputs mean the two loads are not the same model (DSD503, an error, exit 1)."""
import json
import shutil

import pytest

from tests.helpers import run_cli

WEIGHT = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from tests.compare.test_cli import _save_tiny_llama

    root = tmp_path_factory.mktemp("drift")
    ref = _save_tiny_llama(root / "ref")
    broken = root / "broken"
    shutil.copytree(ref, broken)
    tensors = load_file(ref / "model.safetensors")
    w = tensors[WEIGHT].clone()
    w[0] = 0  # one output row of one MLP weight zeroed: small enough that some prompts keep their tokens
    tensors[WEIGHT] = w
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    return ref, broken


@pytest.mark.process
def test_same_tokens_with_logits_beyond_tolerance_fail_the_compare(weights, tmp_path):
    from dsdoctor.compare.api import compare

    ref, broken = weights
    result = compare(ref, broken, paths="plain", dtype="fp32", max_new_tokens=16)
    diffs = result.pairs[0].diffs
    kept = [d for d in diffs if d.status == "drift"]
    assert kept, [d.status for d in diffs]  # the case at hand: tokens identical, logits not
    assert all(d.max_logit_diff > d.tolerance for d in kept)

    # only the prompts whose tokens matched: still exit 1, with an error finding naming the difference
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(json.dumps(result.prompts[d.prompt]) + "\n" for d in kept))
    proc = run_cli("compare", ref, broken, "--paths", "plain", "--dtype", "fp32", "--prompts", prompts,
                   "--format", "json", "--quiet")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    statuses = [p["status"] for p in report["comparisons"][0]["prompts"]]
    assert statuses == ["drift"] * len(kept)
    (finding,) = report["findings"]
    assert finding["code"] == "DSD503" and finding["severity"] == "error"
    assert "not the same model" in finding["message"]


@pytest.mark.process
def test_identical_weights_still_match(weights, tmp_path):
    ref, _ = weights
    copy = tmp_path / "copy"
    shutil.copytree(ref, copy)
    proc = run_cli("compare", ref, copy, "--paths", "plain", "--dtype", "fp32", "--quiet")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
