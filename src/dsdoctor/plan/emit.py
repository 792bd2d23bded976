"""The code a plan recommends, for the chosen path and loading method, in the run dtype."""
from __future__ import annotations

from dsdoctor.plan import recommend as rec

TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def _tp_code(model: str, tp: int, replicas: int, dtype: str, loading: str) -> str:
    td = TORCH_DTYPE[dtype]
    if replicas > 1:
        groups = [",".join(str(g) for g in range(r * tp, (r + 1) * tp)) for r in range(replicas)]
        launch = (f"# {replicas} replicas of tensor parallelism over {tp} GPUs: one launch per group, each with "
                  f"its own batch\n"
                  + "".join(f"#   deepspeed --include localhost:{g} --master_port {29500 + i} run.py"
                            f"{' &' if i < replicas - 1 else ''}\n" for i, g in enumerate(groups)))
    else:
        launch = f"# deepspeed --num_gpus {tp} run.py\n"
    head = launch + "import torch, deepspeed\nfrom transformers import AutoConfig, AutoModelForCausalLM\n"
    tail = "out = engine.module.generate(**inputs, max_new_tokens=N)  # same inputs on every rank of a group\n"
    if loading == "meta-checkpoint":
        return (head + f"config = AutoConfig.from_pretrained({model!r})\n"
                f"with deepspeed.OnDevice(dtype={td}, device=\"meta\"):\n"
                f"    model = AutoModelForCausalLM.from_config(config, dtype={td})\n"
                "# checkpoints.json: {\"type\": \"ds_model\", \"checkpoints\": [the checkpoint files], \"version\": 1.0}\n"
                f"engine = deepspeed.init_inference(model, tensor_parallel={{\"tp_size\": {tp}}}, dtype={td}, "
                f"checkpoint=\"checkpoints.json\", replace_with_kernel_inject=True)\n" + tail)
    if loading == "pre-sharded":
        return (head + "# once, on a machine that holds the model: init_inference(..., "
                f"save_mp_checkpoint_path=\"sharded\") with tp_size {tp}\n"
                f"config = AutoConfig.from_pretrained({model!r})\n"
                f"with deepspeed.OnDevice(dtype={td}, device=\"meta\"):\n"
                f"    model = AutoModelForCausalLM.from_config(config, dtype={td})\n"
                f"engine = deepspeed.init_inference(model, tensor_parallel={{\"tp_size\": {tp}}}, dtype={td}, "
                f"checkpoint=\"sharded/ds_inference_config.json\", replace_with_kernel_inject=True)\n" + tail)
    return (head + f"model = AutoModelForCausalLM.from_pretrained({model!r}, dtype={td})  # on the host, every rank\n"
            f"engine = deepspeed.init_inference(model, tensor_parallel={{\"tp_size\": {tp}}}, dtype={td}, "
            f"replace_with_kernel_inject=False)\n" + tail)


def code_for_plan(path, model: str, gpus: int, dtype: str, knobs=None) -> str:
    """``path`` is a ``PathPlan``; paths of other modules carry their own code in ``path.code``."""
    own = getattr(path, "code", None)
    if own:
        return own
    if path.tp:
        replicas = path.replicas if path.name != "tp" else 1
        return _tp_code(model, path.tp, replicas, dtype, path.loading or "cpu-model")
    code = rec.code_for(path.name, model, gpus, dtype, knobs)
    if path.name == "plain" and path.loading == "cpu-then-to":
        code = code.replace(", device_map=device)", ").to(device)  # CPU first: a lower host peak")
    return code
