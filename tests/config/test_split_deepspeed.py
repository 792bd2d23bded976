"""The split config, proved with real DeepSpeed: 2 CPU ranks, a ~30M-parameter Llama, one launch per config."""
import json
from pathlib import Path

import pytest

from dsdoctor.config.split import split
from tests.helpers import ROOT, deepspeed_launch, write_model_config

SCRIPT = ROOT / "tests" / "scripts" / "config_split_rank.py"

# a ZeRO-3 + offload_param training config as the HF Trainer leaves it after filling "auto" (numbers), with a
# torch AdamW (no compiled optimizer op needed on CPU)
TRAIN = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "zero_allow_untested_optimizer": True,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 10}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": False},
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 1_000_000,
        "stage3_prefetch_bucket_size": 1_000_000,
        "stage3_param_persistence_threshold": 10_000,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "steps_per_print": 2000,
}

MODEL = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=12000, max_position_embeddings=256)  # ~30M parameters


def _launch(cfg: Path, model: Path, out: Path) -> list[dict]:
    out.mkdir()
    proc = deepspeed_launch(SCRIPT, cfg, model, out, timeout=400)
    ranks = sorted(out.glob("rank*.json"))
    assert len(ranks) == 2, f"launch failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [json.loads(p.read_text()) for p in ranks]


@pytest.mark.deepspeed
def test_split_config_builds_zero_offload_generates_and_uses_less_host_memory(tmp_path):
    model = write_model_config(tmp_path / "model", **MODEL)
    train_cfg = tmp_path / "train.json"
    train_cfg.write_text(json.dumps(TRAIN))
    infer_cfg = tmp_path / "infer.json"
    result = split(train_cfg, infer_cfg, model=model)
    assert "optimizer" not in result.config and result.config["zero_optimization"]["stage"] == 3

    infer = _launch(infer_cfg, model, tmp_path / "infer_out")
    train = _launch(train_cfg, model, tmp_path / "train_out")
    n = infer[0]["n_params"]
    assert 20e6 < n < 60e6
    for r in infer:
        assert r["optimizer_class"] == "DeepSpeedZeRoOffload"
        assert r["zero_stage"] == 3 and r["offload_param"] == "cpu"
        assert r["generated"] is not None and len(r["generated"]) == 8
    assert infer[0]["generated"] == infer[1]["generated"]
    for r in train:
        assert r["optimizer_class"] == "DeepSpeedZeroOptimizer_Stage3"
        assert r["zero_stage"] == 3 and r["offload_param"] == "cpu"
    # the optimizer's fp32 state is several bytes per parameter per rank; ZeRO-Inference builds none of it
    saved = [t["rss_delta"] - i["rss_delta"] for t, i in zip(train, infer)]
    print("rss delta train", [t["rss_delta"] for t in train], "infer", [i["rss_delta"] for i in infer])
    for s in saved:
        assert s > 2 * n, f"split config saved only {s} bytes of host memory for {n} params"
