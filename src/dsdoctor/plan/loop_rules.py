"""Plan findings for generation inside training (DSD207-DSD209), ``dsdoctor plan --loop``. Torch-free."""
from __future__ import annotations

from dsdoctor.findings import explanation, rule


def _x(what_en, why_en, ex_en, use_en, what_zh, why_zh, ex_zh, use_zh) -> dict:
    return explanation(en=(what_en, why_en, ex_en, use_en), zh=(what_zh, why_zh, ex_zh, use_zh))


_CODE = ("```python\nfrom deepspeed.runtime.zero.stage3 import unwrap_model_for_generation\n"
         "with unwrap_model_for_generation(engine):\n    rollouts = engine.module.generate(**prompts, max_new_tokens=256)\n```")

rule(
    "DSD207", "loop-gather-once-fits", "info",
    message={"en": "in the training loop, zero3-gather-once generates about {once_tps} tokens/s per GPU against "
                   "{z3_tps} with ZeRO-3's per-layer gathers ({speedup}x), for a GPU peak of {once_peak} against "
                   "{z3_peak} (+{extra})",
             "zh": "训练循环中，zero3-gather-once 每卡约 {once_tps} tokens/s，ZeRO-3 逐层收集为 {z3_tps}（{speedup} 倍），"
                   "GPU 峰值 {once_peak} 对 {z3_peak}（多 {extra}）"},
    fix={"en": "wrap each rollout generate in deepspeed.runtime.zero.stage3.unwrap_model_for_generation(engine)",
         "zh": "把每次 rollout 的 generate 包进 deepspeed.runtime.zero.stage3.unwrap_model_for_generation(engine)"},
    explanation=_x(
        "With `--loop`, compares the path `zero3-gather-once` (the model gathered once per generate, ZeRO-3's "
        "module hooks lifted) with plain ZeRO-3 generate, both with the loop's training state on the GPU.",
        "ZeRO-3 generate gathers every layer for every new token. Gathering once costs the whole weights on "
        "every GPU while generating, which this plan says fits.",
        "`dsdoctor plan --model llama-7b --gpus 2 --batch 4 --new-tokens 32 --loop`",
        _CODE,
        "在 `--loop` 下，对比 `zero3-gather-once` 路径（每次 generate 收集一次模型、摘掉 ZeRO-3 模块钩子）与普通 ZeRO-3 "
        "generate，两者都计入循环的训练状态。",
        "ZeRO-3 generate 每生成一个 token 都要收集每一层。只收集一次的代价是生成期间每卡放下完整权重，本规划显示放得下。",
        "`dsdoctor plan --model llama-7b --gpus 2 --batch 4 --new-tokens 32 --loop`",
        _CODE,
    ),
)

rule(
    "DSD208", "loop-gather-once-does-not-fit", "warning",
    message={"en": "zero3-gather-once needs {need} per GPU while generating ({limits} limit): the whole model "
                   "does not fit beside the training state; ZeRO-3 generate peaks at {z3_peak}",
             "zh": "zero3-gather-once 生成期间每卡需要 {need}（受限于 {limits}）：完整模型与训练状态放不到一起；"
                   "ZeRO-3 generate 峰值 {z3_peak}"},
    fix={"en": "more GPUs, offload_optimizer to free GPU memory, or a separate inference engine (vLLM with "
               "tensor parallelism) for rollouts",
         "zh": "更多 GPU、用 offload_optimizer 腾出显存，或用独立推理引擎（带张量并行的 vLLM）做 rollout"},
    explanation=_x(
        "With `--loop`, the path `zero3-gather-once` exceeds the GPU (or host) memory.",
        "Gathering the whole model for each generate needs its full weights on every GPU on top of the ZeRO-3 "
        "partitions, the training state, KV cache and activations.",
        "A 70B policy on 8 x 80 GiB: 140 GiB of bf16 weights cannot be gathered on one GPU.",
        "Keep ZeRO-3 generate, or give rollouts to an inference engine that shards the model by tensor "
        "parallelism (vLLM, as OpenRLHF does), with its weights synced after each step.",
        "在 `--loop` 下，`zero3-gather-once` 路径超出 GPU（或主机）内存。",
        "每次 generate 收集整个模型，需要在 ZeRO-3 分区、训练状态、KV cache 和激活之外，再在每张 GPU 上放一份完整权重。",
        "8 x 80 GiB 上的 70B policy：140 GiB 的 bf16 权重无法收集到一张 GPU 上。",
        "保留 ZeRO-3 generate，或把 rollout 交给按张量并行切分模型的推理引擎（vLLM，OpenRLHF 即如此），每步后同步权重。",
    ),
)

rule(
    "DSD209", "loop-zero2-fits", "info",
    message={"en": "ZeRO-2 fits the actor on {gpus} GPU(s) (peak {peak} per GPU with its training state): "
                   "rollouts at plain speed, about {tps} tokens/s per GPU, with no gather at all",
             "zh": "ZeRO-2 在 {gpus} 张 GPU 上放得下 actor（含训练状态每卡峰值 {peak}）：rollout 以普通速度运行，"
                   "每卡约 {tps} tokens/s，完全无需收集"},
    fix={"en": "train the actor with zero_optimization.stage 2",
         "zh": "actor 用 zero_optimization.stage 2 训练"},
    explanation=_x(
        "With `--loop`, the path `zero2` (whole weights on every GPU, gradients and optimizer state partitioned) "
        "fits.",
        "ZeRO-3 only pays off when the weights do not fit whole; when they do, ZeRO-2 generates at plain speed "
        "(DeepSpeed-Chat users report 0.8 s per generation at ZeRO-2 against 72 s at ZeRO-3, 7B on 8 GPUs).",
        "`dsdoctor plan --model llama-7b --gpus 8 --loop`",
        "```json\n{\"zero_optimization\": {\"stage\": 2}}\n```",
        "在 `--loop` 下，`zero2` 路径（每卡完整权重，梯度和优化器状态分片）放得下。",
        "ZeRO-3 只有在权重整体放不下时才划算；放得下时 ZeRO-2 以普通速度生成（DeepSpeed-Chat 用户报告 8 卡 7B 在 "
        "ZeRO-2 下每次生成 "
        "0.8 秒，ZeRO-3 下 72 秒）。",
        "`dsdoctor plan --model llama-7b --gpus 8 --loop`",
        "```json\n{\"zero_optimization\": {\"stage\": 2}}\n```",
    ),
)
