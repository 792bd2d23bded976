"""Findings about generation inside training under ZeRO-3 (DSD330-DSD332). Torch-free; registered by
``dsdoctor.trace.rules``."""
from __future__ import annotations

from dsdoctor.findings import explanation, rule

# which memory a peak is about, as in trace/rules.py: Phrase("gpu") / Phrase("host")
KIND = {"gpu": {"en": "GPU", "zh": "GPU "}, "host": {"en": "host", "zh": "主机"}}


def _x(what_en, why_en, ex_en, use_en, what_zh, why_zh, ex_zh, use_zh) -> dict:
    return explanation(en=(what_en, why_en, ex_en, use_en), zh=(what_zh, why_zh, ex_zh, use_zh))


_LOOP_EXAMPLE = (
    "```python\nengine, *_ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=z3)\n"
    "for step, batch in enumerate(rollout_loader):\n"
    "    rollouts = engine.module.generate(batch, max_new_tokens=256, synced_gpus=True)\n"
    "    loss = ppo_loss(engine(rollouts), ...)\n    engine.backward(loss)\n    engine.step()\n```")

_WAYS_OUT_EN = (
    "Four ways out, each with what it costs per GPU:\n\n"
    "1. **Gather once per generate and lift the hooks** (DeepSpeed 0.19.8 ships it as "
    "`deepspeed.runtime.zero.stage3.unwrap_model_for_generation(engine)`; trl as "
    "`unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params=True)`): one all-gather of all "
    "parameters, then the per-module hooks are removed for the generate and re-registered after. Memory: the "
    "ZeRO-3 partitions plus the whole weights plus KV cache and activations while generating (`dsdoctor plan "
    "--model DIR --loop`, path `zero3-gather-once`). Speed: about plain speed plus one all-gather per generate. "
    "`GatheredParameters` alone is not enough: the hooks still run on every module of every forward. What "
    "still separates it from plain speed, from DeepSpeed's source: `torch.nn.functional.linear` stays replaced "
    "process-wide by `zero3_linear_wrap` (an autograd Function around matmul) once ZeRO-3's `Init` ran (a "
    "model built under `zero.Init` or converted at `initialize`, with `memory_efficient_linear` on, the "
    "default); the root module keeps its start-of-forward hook (`reset_step`); and re-registering the "
    "hooks invalidates the parameter coordinator's trace, so the next training forward re-records it without "
    "prefetch. dsdoctor's `gather-once` ab variant also restores the plain linear while generating.\n"
    "2. **DeepSpeed's hybrid engine** (`\"hybrid_engine\": {\"enabled\": true, \"pin_parameters\": true}`): "
    "under ZeRO-3 it gathers all layers once per generate and runs DeepSpeed's inference kernels; only for "
    "model classes with an inference policy (GPT-2, GPT-J/Neo/NeoX, OPT, BLOOM, Llama, InternLM), CUDA only, "
    "otherwise it falls back to the plain generate with a warning; without `pin_parameters` it gathers layer "
    "by layer; shared prefill is refused under ZeRO-3. Memory as in 1, plus the kernels' workspace.\n"
    "3. **A separate inference engine for rollouts** (vLLM, as OpenRLHF and trl's `use_vllm` do): its own "
    "whole copy of the weights (divided by its tensor parallel size) plus its KV pool "
    "(`gpu_memory_utilization` of each GPU when colocated on the training GPUs), and a weight sync after "
    "every step (gather the ZeRO-3 parameters, `load_weights`). Fastest decode; costs the most memory.\n"
    "4. **ZeRO-2 for the actor when its parameters fit**: whole weights resident, gradients and optimizer "
    "state partitioned; generate runs at plain speed. Per GPU: weights + (gradients + 12 bytes/param of "
    "fp32 master and Adam moments) / ranks.")

_WAYS_OUT_ZH = (
    "四条出路，各自的每卡代价：\n\n"
    "1. **每次 generate 只收集一次并摘掉钩子**（DeepSpeed 0.19.8 自带 "
    "`deepspeed.runtime.zero.stage3.unwrap_model_for_generation(engine)`；trl 为 "
    "`unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params=True)`）：一次 all-gather 全部参数，"
    "生成期间移除逐模块钩子，结束后重新注册。内存：ZeRO-3 分区 + 完整权重 + 生成时的 KV cache 和激活（`dsdoctor plan "
    "--model DIR --loop` 的 `zero3-gather-once` 路径）。速度：约等于普通加载速度，加每次 generate 一次 all-gather。只用 "
    "`GatheredParameters` 不够：每次 forward 每个模块的钩子仍在运行。按 DeepSpeed 源码，离普通速度还差的部分："
    "ZeRO-3 的 `Init` 运行过之后（在 `zero.Init` 下构建或在 `initialize` 时转换，且 `memory_efficient_linear` "
    "为默认的开启），`torch.nn.functional.linear` 在整个进程里被替换为 `zero3_linear_wrap`"
    "（包着 matmul 的 autograd Function）；根模块仍保留 forward 起始钩子（`reset_step`）；重新注册钩子会使参数协调器的"
    " trace 失效，下一次训练 forward 要在无预取的情况下重新记录。dsdoctor 的 `gather-once` ab 变体在生成期间还会恢复"
    "原始 linear。\n"
    "2. **DeepSpeed hybrid engine**（`\"hybrid_engine\": {\"enabled\": true, \"pin_parameters\": true}`）："
    "ZeRO-3 下每次 generate 收集一次全部层并使用 DeepSpeed 推理内核；只支持有推理策略的模型类（GPT-2、"
    "GPT-J/Neo/NeoX、OPT、BLOOM、Llama、InternLM），仅 CUDA，否则带警告退回普通 generate；不开 `pin_parameters` 时逐层收集；"
    "ZeRO-3 下不支持 shared prefill。内存同 1，另加内核工作区。\n"
    "3. **用独立推理引擎做 rollout**（vLLM，OpenRLHF 和 trl 的 `use_vllm` 即如此）：它自己的一份完整权重（除以其张量并行数）"
    "加 KV 池（与训练同卡时占每卡 `gpu_memory_utilization`），每步之后同步权重（收集 ZeRO-3 参数后 `load_weights`）。"
    "解码最快，内存最贵。\n"
    "4. **参数放得下时 actor 用 ZeRO-2**：完整权重常驻，梯度和优化器状态分片；generate 以普通速度运行。每卡："
    "权重 +（梯度 + 每参数 12 字节的 fp32 主权重和 Adam 动量）/ rank 数。")

rule(
    "DSD330", "zero3-generate-inside-training", "warning",
    message={"en": "rank {ranks}: generate runs inside training under ZeRO-3 and took {generate_s}s of "
                   "{loop_s}s ({share}) over {generates} iteration(s) at {tokens_per_s} tokens/s; a generate "
                   "gathered up to {gathered} ({forwards} forwards x {per_forward})",
             "zh": "rank {ranks}：generate 在 ZeRO-3 训练循环内运行，{generates} 次迭代共 {loop_s} 秒中占 "
                   "{generate_s} 秒（{share}），{tokens_per_s} tokens/s；一次 generate 最多收集 {gathered}"
                   "（{forwards} 次 forward x {per_forward}）"},
    fix={"en": "gather the model once per generate and lift ZeRO-3's module hooks (DeepSpeed's or trl's "
               "unwrap_model_for_generation): +{extra} per GPU while generating (whole weights {full} instead "
               "of a 1/{world} shard {shard}) besides KV {kv}; compare: dsdoctor ab --variants as-is,gather-once "
               "-- COMMAND",
         "zh": "每次 generate 只收集一次模型并摘掉 ZeRO-3 的模块钩子（DeepSpeed 或 trl 的 "
               "unwrap_model_for_generation）：生成期间每卡多 {extra}（完整权重 {full}，而非 1/{world} 分片 "
               "{shard}），另有 KV {kv}；对比：dsdoctor ab --variants as-is,gather-once -- COMMAND"},
    explanation=_x(
        "Sees a rank whose DeepSpeed engine has an optimizer, runs `backward`/`step`, and generates with a "
        "ZeRO-3 partitioned model (RLHF/PPO/GRPO rollouts, evaluation with `generate`). It reports each "
        "generate's time, tokens/s, the parameter bytes ZeRO-3 gathered for it (partitioned, non-persistent "
        "parameter bytes x forwards) and its share of the iteration. The optimizer is needed here, so the "
        "inference finding DSD101 stays quiet.",
        "ZeRO-3 gathers every layer before its forward and releases it after. `generate` runs one forward per "
        "new token, so each token gathers the whole model again: the rollout runs at a fraction of plain "
        "speed (users of DeepSpeed-Chat report 72 s per generation at ZeRO-3 against 0.8 s at ZeRO-2 for a 7B "
        "actor on 8 GPUs).\n\n" + _WAYS_OUT_EN,
        _LOOP_EXAMPLE,
        "```python\nfrom deepspeed.runtime.zero.stage3 import unwrap_model_for_generation\n"
        "with unwrap_model_for_generation(engine):  # one all-gather, no per-module hooks\n"
        "    rollouts = engine.module.generate(batch, max_new_tokens=256)\n```",
        "发现某个 rank 的 DeepSpeed 引擎带优化器、执行了 `backward`/`step`，并用 ZeRO-3 分片模型做 generate（RLHF/PPO/GRPO "
        "rollout，或用 `generate` 做评估）。报告每次 generate 的耗时、tokens/s、ZeRO-3 为它收集的参数字节"
        "（分片且非常驻的参数字节 x "
        "forward 次数）及其在迭代中的占比。这里确实需要优化器，所以推理场景的 DSD101 不会报。",
        "ZeRO-3 在每层 forward 前收集该层、之后释放。`generate` 每生成一个 token 做一次 forward，于是每个 token 都要重新收集整个"
        "模型：rollout 只有普通速度的几分之一（DeepSpeed-Chat 用户报告 8 卡 7B actor 在 ZeRO-3 下每次生成 72 秒，ZeRO-2 下 "
        "0.8 秒）。\n\n" + _WAYS_OUT_ZH,
        _LOOP_EXAMPLE,
        "```python\nfrom deepspeed.runtime.zero.stage3 import unwrap_model_for_generation\n"
        "with unwrap_model_for_generation(engine):  # 一次 all-gather，没有逐模块钩子\n"
        "    rollouts = engine.module.generate(batch, max_new_tokens=256)\n```",
    ),
)

rule(
    "DSD331", "zero3-generate-gathered-once", "info",
    message={"en": "rank {ranks}: generate inside ZeRO-3 training already runs on the gathered model: "
                   "{generate_s}s of {loop_s}s ({share}) at {tokens_per_s} tokens/s",
             "zh": "rank {ranks}：ZeRO-3 训练循环内的 generate 已经在收集好的模型上运行：{loop_s} 秒中占 {generate_s} 秒"
                   "（{share}），{tokens_per_s} tokens/s"},
    fix={"en": "if rollouts still dominate: a separate inference engine (vLLM) for rollouts, or ZeRO-2 for the "
               "actor when its weights fit (dsdoctor plan --model DIR --loop)",
         "zh": "若 rollout 仍占主导：用独立推理引擎（vLLM）做 rollout，或在权重放得下时 actor 改用 ZeRO-2"
               "（dsdoctor plan --model DIR --loop）"},
    explanation=_x(
        "Sees generation inside a ZeRO-3 training loop where every parameter is already whole when generate "
        "starts (the script gathers, e.g. with `unwrap_model_for_generation`), or dsdoctor's `gather-once` "
        "variant did it.",
        "Nothing is wrong: this is the first way out. What is left to gain: " + _WAYS_OUT_EN.split("\n\n", 1)[1],
        _LOOP_EXAMPLE.replace("    rollouts = engine", "    with unwrap_model_for_generation(engine):\n"
                              "        rollouts = engine"),
        "Keep it; measure the remaining share against a vLLM rollout engine or ZeRO-2.",
        "发现 ZeRO-3 训练循环内的 generate 开始时所有参数已经完整（脚本自己收集，例如 `unwrap_model_for_generation`），"
        "或由 dsdoctor 的 `gather-once` 变体完成。",
        "没有问题：这就是第一条出路。还能提升的：" + _WAYS_OUT_ZH.split("\n\n", 1)[1],
        _LOOP_EXAMPLE.replace("    rollouts = engine", "    with unwrap_model_for_generation(engine):\n"
                              "        rollouts = engine"),
        "保持现状；把剩余占比与 vLLM rollout 引擎或 ZeRO-2 对比。",
    ),
)

rule(
    "DSD332", "gather-once-measured", "warning",
    message={"en": "gathering the model once per generate ran rollouts at {after} tokens/s against {before} "
                   "as-is ({speedup}x); generate peak {kind} memory {peak_after} against {peak_before}",
             "zh": "每次 generate 只收集一次模型后 rollout 为 {after} tokens/s，原样为 {before}（{speedup} 倍）；"
                   "generate 阶段{kind}内存峰值 {peak_after}，原样 {peak_before}"},
    phrases=KIND,
    fix={"en": "wrap the rollout: with deepspeed.runtime.zero.stage3.unwrap_model_for_generation(engine): "
               "out = engine.module.generate(...)",
         "zh": "包住 rollout：with deepspeed.runtime.zero.stage3.unwrap_model_for_generation(engine): "
               "out = engine.module.generate(...)"},
    explanation=_x(
        "Compares the run as-is with the `gather-once` variant: the same command, with every generate on a "
        "ZeRO-3 engine's module run on the model gathered once, ZeRO-3's module hooks removed and the plain "
        "`torch.nn.functional.linear` restored for its duration (in-process; your code is unchanged).",
        "The variant shows what the first way out of DSD330 gives on this run and what it costs in memory: "
        "the whole weights sit on every GPU while generating.",
        "7B on one H200, batch 4, prompt 512, 32 new tokens: as-is 13.1 tokens/s, gathered once with the hooks "
        "removed 29.2 tokens/s (the issue's measurement).",
        "```python\nfrom deepspeed.runtime.zero.stage3 import unwrap_model_for_generation\n"
        "with unwrap_model_for_generation(engine):\n    out = engine.module.generate(batch, max_new_tokens=256)\n```",
        "对比原样运行与 `gather-once` 变体：同一命令，ZeRO-3 引擎模块上的每次 generate 都在只收集一次的模型上运行，"
        "期间移除 ZeRO-3 模块钩子并恢复原始 `torch.nn.functional.linear`（进程内完成，代码不变）。",
        "这个变体显示 DSD330 第一条出路在本次运行中的收益和内存代价：生成期间每张 GPU 都放着完整权重。",
        "一张 H200 上的 7B，batch 4、提示 512、生成 32 token：原样 13.1 tokens/s，收集一次并移除钩子后 29.2 tokens/s。",
        "```python\nfrom deepspeed.runtime.zero.stage3 import unwrap_model_for_generation\n"
        "with unwrap_model_for_generation(engine):\n    out = engine.module.generate(batch, max_new_tokens=256)\n```",
    ),
)
