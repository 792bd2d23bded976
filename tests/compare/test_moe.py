"""``dsdoctor compare`` on a mixture of experts: a real Qwen3-MoE (transformers' own classes, the weights as
save_pretrained writes them) generates the same tokens whole and under ZeRO-3 on 2 DeepSpeed CPU ranks, and a copy
whose two experts of one layer are swapped (what a merge that orders experts wrong writes) is caught."""
import json
import shutil

import pytest

from tests.helpers import deepspeed_env, run_cli

SWAPPED = ("model.layers.0.mlp.experts.0.down_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from tests.scripts.moe_models import CONFIGS

    root = tmp_path_factory.mktemp("compare-moe")
    cfg = {k: v for k, v in CONFIGS["qwen3_moe"].items() if k != "architectures"}
    torch.manual_seed(0)
    # a wider init than the default 0.02: peaked logits with clear winners, like a trained model
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg,
                                                                                            initializer_range=0.2))
    model.save_pretrained(root / "ref")
    shutil.copytree(root / "ref", root / "swapped")
    tensors = load_file(root / "ref" / "model.safetensors")
    a, b = SWAPPED
    assert not torch.equal(tensors[a], tensors[b])
    tensors[a], tensors[b] = tensors[b].clone(), tensors[a].clone()
    save_file(tensors, root / "swapped" / "model.safetensors", metadata={"format": "pt"})
    return root


def _report(out):
    return json.loads((out / "report.json").read_text())


@pytest.mark.deepspeed
def test_plain_and_zero3_ranks_generate_the_same_tokens_on_a_moe(moe, tmp_path):
    out = tmp_path / "cmp"
    proc = run_cli("compare", moe / "ref", "--paths", "plain,zero3", "--gpus", "2", "--max-new-tokens", "8",
                   "--out", out, env=deepspeed_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = _report(out)
    runs = {r["label"]: r for r in report["runs"]}
    assert runs["zero3"]["ok"] and runs["zero3"]["ranks"] == 2
    assert runs["plain"]["tokens"] == runs["zero3"]["tokens"] and all(len(t) == 8 for t in runs["plain"]["tokens"])
    (pair,) = report["comparisons"]
    assert pair["status"] == "match"


@pytest.mark.process
def test_a_swapped_expert_is_caught(moe, tmp_path):
    out = tmp_path / "cmp"
    proc = run_cli("compare", moe / "ref", moe / "swapped", "--max-new-tokens", "8", "--out", out, "--quiet",
                   timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    report = _report(out)
    assert report["status"] == "mismatch" and "DSD501" in {f["code"] for f in report["findings"]}
    (pair,) = report["comparisons"]
    assert pair["status"] == "mismatch"
