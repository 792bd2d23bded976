"""An unchanged inference script that fails only because its DeepSpeed config is a training config, each way
such a run really fails (ab must name the variant that runs as the fix):

    deepspeed --num_gpus 2 fails_with_training_config.py --config CONFIG --how kill
    deepspeed --num_gpus 2 fails_with_training_config.py --config CONFIG --how hang
    python fails_with_training_config.py --config CONFIG --how none     # one rank, no launcher

--how kill: once deepspeed.initialize has built an optimizer, the rank sends itself SIGKILL, as the kernel's OOM
killer does to a rank whose pinned optimizer state does not fit in host memory (a CPU machine in CI cannot be
driven into the real OOM killer without endangering everything else on it; the signal, the launcher's exit code
and the missing traceback are the real ones). --how hang: with an optimizer, rank 0 waits in a barrier that
rank 1 never calls (a rank that took another code path), a real hang: no progress, no CPU. --how none: nothing
is injected, the config decides (a config with "auto" top-level numbers makes deepspeed.initialize raise).
"""
import argparse
import os
import signal
import sys

if "RANK" not in os.environ:  # one rank without a launcher: the environment a launcher would set
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_models import llama  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--how", choices=("kill", "hang", "none"), default="none")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()

    torch.manual_seed(0)
    deepspeed.init_distributed()
    rank = dist.get_rank()
    model = llama()
    model.generation_config.pad_token_id = 0
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=a.config)
    built = engine.optimizer is not None and type(engine.optimizer).__name__ != "DeepSpeedZeRoOffload"
    if built and a.how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if built and a.how == "hang" and rank == 0:
        dist.barrier()  # rank 1 never gets here: it generates and exits
    engine.module.eval()
    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        for _ in range(2):  # a repeated generate: the first and the steady state
            out = engine.module.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                         synced_gpus=dist.get_world_size() > 1)
    print(f"rank {rank} generated {int(out.shape[-1] - ids.shape[-1])}", flush=True)


if __name__ == "__main__":
    main()
