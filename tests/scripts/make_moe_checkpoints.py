"""Write real ZeRO-3 checkpoints of tiny mixture-of-experts models, in one launch (2 CPU ranks).

Run under the launcher:  DS_ACCELERATOR=cpu deepspeed --num_gpus 2 make_moe_checkpoints.py OUT NAME [NAME ...]
NAME is FAMILY-LAYOUT (moe_models.CONFIGS, layout fused or per-expert), e.g. qwen3_moe-fused, mixtral-per-expert;
each writes OUT/NAME/ckpt/ (``latest`` + global_step2) and, from rank 0, OUT/NAME/model/config.json. ``dsmoe``
writes OUT/dsmoe/ckpt/: a model with a DeepSpeed-MoE layer (deepspeed.moe.layer.MoE, 4 experts, ep_size 2) under
ZeRO-2 (DeepSpeed 0.19.8 refuses its MoE under ZeRO-3), whose expert weights go to layer_*_expert_* files.
Two AdamW steps on different tokens per rank, so the fp32 masters differ from the initial weights.
"""
import json
import os
import sys

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_models  # noqa: E402

DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}


def train(engine, vocab: int, rank: int, steps: int = 2):
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 8), generator=gen)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss if hasattr(out, "loss") else out)
        engine.step()


def make_hf(out: str, name: str, rank: int):
    family, layout = name.split("-", 1)
    model = moe_models.build(family, layout)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=dict(DS_CONFIG, zero_optimization={"stage": 3}))
    train(engine, model.config.vocab_size, rank)
    engine.save_checkpoint(os.path.join(out, name, "ckpt"), tag="global_step2")
    if rank == 0:
        os.makedirs(os.path.join(out, name, "model"), exist_ok=True)
        with open(os.path.join(out, name, "model", "config.json"), "w") as fh:
            json.dump(moe_models.CONFIGS[family], fh, indent=2)


class DsMoeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from deepspeed.moe.layer import MoE

        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.moe = MoE(hidden_size=16, expert=torch.nn.Linear(16, 16), num_experts=4, ep_size=2, k=1)
        self.head = torch.nn.Linear(16, 50)

    def forward(self, input_ids, labels):
        hidden, aux, _ = self.moe(self.embed(input_ids))
        logits = self.head(hidden)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1)) + aux


def make_dsmoe(out: str, rank: int):
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = DsMoeModel()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups,
                                      config=dict(DS_CONFIG, zero_optimization={"stage": 2}))
    train(engine, 50, rank)
    engine.save_checkpoint(os.path.join(out, "dsmoe", "ckpt"), tag="global_step2")


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out, names = argv[0], argv[1:]
    # no shared-memory all-reduce kernel: its ranks spin while they wait (minutes on busy cores); gloo blocks
    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ.get("RANK", "0"))
    for name in names:
        if name == "dsmoe":
            make_dsmoe(out, rank)
        else:
            make_hf(out, name, rank)
    print("MAKE_MOE_CHECKPOINTS_OK", flush=True)


if __name__ == "__main__":
    main()
