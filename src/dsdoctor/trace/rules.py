"""Findings from observed runs (DSD3xx). Torch-free: imported by ``dsdoctor explain``.

Problems that the config doctor also detects statically reuse its codes (DSD101 optimizer built for
inference, DSD103 ZeRO-3 with tensor parallelism); they are defined in ``dsdoctor.config.rules``.
"""
from __future__ import annotations

from dsdoctor.findings import explanation, rule

# which memory a peak is about: Phrase("gpu") / Phrase("host")
KIND = {"gpu": {"en": "GPU", "zh": "GPU "}, "host": {"en": "host", "zh": "主机"}}


rule(
    "DSD301", "generate-without-synced-gpus", "error",
    message={"en": "rank {ranks} called generate on a ZeRO-3 model over {world_size} ranks with synced_gpus off",
             "zh": "rank {ranks} 在 {world_size} 个 rank 的 ZeRO-3 模型上调用 generate 时 synced_gpus 为关闭"},
    fix={"en": "pass synced_gpus=True to generate (or keep an HfDeepSpeedConfig object alive)",
         "zh": "给 generate 传 synced_gpus=True（或保持一个 HfDeepSpeedConfig 对象存活）"},
    explanation=explanation(
        en=(
            "Sees `generate` run on a ZeRO-3 partitioned model in a multi-rank job while `synced_gpus` is off.",
            "ZeRO-3 is SPMD: every forward gathers each layer's shards from every rank. A rank that stops "
                "generating early (EOS, shorter prompt) stops joining those gathers and the others wait forever. "
                "transformers turns `synced_gpus` on only while an `HfDeepSpeedConfig` object is alive; after a "
                "plain `deepspeed.initialize` it stays off.",
            "```python\nengine = deepspeed.initialize(model=model, config=cfg)[0]\nengine.module.generate(ids)\n```",
            "```python\nengine.module.generate(ids, synced_gpus=True)\n```",
        ),
        zh=(
            "发现多 rank 任务中，ZeRO-3 分片模型上运行 `generate` 时 `synced_gpus` 是关闭的。",
            "ZeRO-3 是 SPMD：每次 forward 都要从所有 rank 收集每层的分片。提前结束生成的 rank（遇到 EOS、"
                "提示更短）不再参与收集，其余 rank 会永远等待。transformers 只在 `HfDeepSpeedConfig` 对象存活时"
                "自动打开 `synced_gpus`；直接用 `deepspeed.initialize` 时它是关闭的。",
            "```python\nengine = deepspeed.initialize(model=model, config=cfg)[0]\nengine.module.generate(ids)\n```",
            "```python\nengine.module.generate(ids, synced_gpus=True)\n```",
        ),
    ),
)

rule(
    "DSD302", "stage-differs-from-config", "warning",
    message={"en": "the config {source} asks for ZeRO stage {configured} but DeepSpeed ran stage {effective}",
             "zh": "配置 {source} 要求 ZeRO stage {configured}，但 DeepSpeed 实际运行的是 stage {effective}"},
    fix={"en": "write the stage as a number in the config (\"auto\" means stage 0 outside the HF Trainer)",
         "zh": "在配置里把 stage 写成数字（在 HF Trainer 之外 \"auto\" 等于 stage 0）"},
    explanation=explanation(
        en=(
            "Compares `zero_optimization.stage` in the config passed to DeepSpeed with "
                "`engine.zero_optimization_stage()` after `deepspeed.initialize`.",
            "DeepSpeed drops the value \"auto\" inside `zero_optimization` before validation, so the field takes its "
                "default: stage 0, no partitioning at all. Only the HF Trainer/accelerate fill \"auto\". The run then "
                "holds the whole model on every GPU while you believe it is sharded.",
            "```json\n{\"zero_optimization\": {\"stage\": \"auto\"}}\n```",
            "```json\n{\"zero_optimization\": {\"stage\": 3}}\n```",
        ),
        zh=(
            "对比传给 DeepSpeed 的配置中的 `zero_optimization.stage` 与 `deepspeed.initialize` 之后 "
                "`engine.zero_optimization_stage()` 的值。",
            "DeepSpeed 会在校验前丢弃 `zero_optimization` 里的 \"auto\"，字段取默认值 stage 0，即完全不分片。只有 "
                "HF Trainer/accelerate 会填充 \"auto\"。于是每张 GPU 都放着整个模型，而你以为它已经分片。",
            "```json\n{\"zero_optimization\": {\"stage\": \"auto\"}}\n```",
            "```json\n{\"zero_optimization\": {\"stage\": 3}}\n```",
        ),
    ),
)

rule(
    "DSD303", "zero-shards-to-init-inference", "error",
    message={"en": "rank {rank} read ZeRO shard files with torch.load ({files}) and then called init_inference",
             "zh": "rank {rank} 用 torch.load 读取了 ZeRO 分片文件（{files}），然后调用了 init_inference"},
    fix={"en": "let DeepSpeed load its own shards (engine.load_checkpoint) or merge them first: dsdoctor merge",
         "zh": "让 DeepSpeed 自己加载分片（engine.load_checkpoint），或先合并：dsdoctor merge"},
    explanation=explanation(
        en=(
            "Sees `torch.load` open `zero_pp_rank_*_model_states.pt` / `*_optim_states.pt` files outside DeepSpeed, "
                "followed by `deepspeed.init_inference` in the same rank.",
            "A ZeRO-3 shard holds a flat slice of every parameter (and `model_states` of a stage-3 run holds empty "
                "placeholders), not a state dict. Loading it by hand gives missing or `torch.Size([0])` weights: the "
                "model generates garbage, or loading fails late.",
            "```python\nsd = torch.load('ckpt/global_step100/zero_pp_rank_0_mp_rank_00_model_states.pt')\n"
                "model.load_state_dict(sd['module'], strict=False)\ndeepspeed.init_inference(model, dtype=torch.bfloat16)\n```",
            "```bash\ndsdoctor merge ckpt/ -o merged/   # then from_pretrained('merged/')\n```",
        ),
        zh=(
            "发现在 DeepSpeed 之外用 `torch.load` 打开了 `zero_pp_rank_*_model_states.pt` / `*_optim_states.pt`，"
                "随后同一 rank 调用了 `deepspeed.init_inference`。",
            "ZeRO-3 分片保存的是每个参数的扁平切片（stage 3 的 `model_states` 中只有空占位），不是 state dict。"
                "手动加载会得到缺失或 `torch.Size([0])` 的权重：模型输出乱码，或者加载很晚才失败。",
            "```python\nsd = torch.load('ckpt/global_step100/zero_pp_rank_0_mp_rank_00_model_states.pt')\n"
                "model.load_state_dict(sd['module'], strict=False)\ndeepspeed.init_inference(model, dtype=torch.bfloat16)\n```",
            "```bash\ndsdoctor merge ckpt/ -o merged/   # 然后 from_pretrained('merged/')\n```",
        ),
    ),
)

rule(
    "DSD304", "peak-phase", "info",
    message={"en": "peak {kind} memory {peak} on rank {rank} happened during {phase}",
             "zh": "rank {rank} 的{kind}内存峰值 {peak} 出现在 {phase} 阶段"},
    fix={"en": "{advice}", "zh": "{advice}"},
    phrases=dict(KIND, **{
        "peak-is": {"en": "the peak is {part}", "zh": "峰值来自{part}"},
        "load": {"en": "the weights at load: build the model inside ZeRO-3 (HfDeepSpeedConfig before from_pretrained)",
                 "zh": "加载时的权重：在 ZeRO-3 内构建模型（先创建 HfDeepSpeedConfig 再 from_pretrained）"},
        "init": {"en": "what deepspeed.initialize builds: use an inference-only config (dsdoctor split)",
                 "zh": "deepspeed.initialize 构建的东西：使用仅推理配置（dsdoctor split）"},
        "generate": {"en": "gathered layers, KV cache and activations: smaller batch or shorter generation; "
                           "dsdoctor ab shows whether offload_param matters",
                     "zh": "收集的层、KV cache 和激活：减小 batch 或缩短生成；dsdoctor ab 可显示 offload_param 是否相关"},
        "other": {"en": "something the script does outside the observed calls", "zh": "脚本在被观察调用之外做的事情"},
        # the same phases, fitted to what the script already does (trace/report.py _phase_advice)
        "load-partitioned": {
            "en": "the weights at load, already partitioned as they load (HfDeepSpeedConfig was created before "
                  "{loader}): more ranks or offload_param lower each rank's share",
            "zh": "加载时的权重，加载时已被分片（HfDeepSpeedConfig 在 {loader} 之前创建）：更多 rank 或 offload_param "
                  "可降低每个 rank 的份额"},
        "load-before-init-inference": {
            "en": "the whole model each rank loads before init_inference: load it in the dtype you run "
                  "(from_pretrained(..., dtype=torch.bfloat16)) so no wider copy is made",
            "zh": "init_inference 之前每个 rank 加载的完整模型：按运行时的精度加载（from_pretrained(..., "
                  "dtype=torch.bfloat16)），避免更宽的副本"},
        "load-whole": {"en": "the weights at load: every rank holds the whole model; plan shows which load path fits",
                       "zh": "加载时的权重：每个 rank 都持有整个模型；plan 可显示哪种加载方式放得下"},
        "init-inference": {
            "en": "what deepspeed.init_inference does with the weights (cast to its dtype, sliced for tensor "
                  "parallelism): pass the dtype the model already has",
            "zh": "deepspeed.init_inference 对权重做的事（转换精度、按张量并行切分）：传入模型已有的精度"},
        "init-no-optimizer": {
            "en": "what deepspeed.initialize builds (no optimizer was built: the weights and their partitioning)",
            "zh": "deepspeed.initialize 构建的东西（没有构建优化器：权重及其分片）"},
        "generate-plain": {"en": "the KV cache and activations of generate: a smaller batch or shorter generation "
                                 "lowers it",
                           "zh": "generate 的 KV cache 和激活：减小 batch 或缩短生成可以降低它"},
        "init-unpartitioned": {
            "en": "the whole unpartitioned model that deepspeed.initialize moves to the device: build it under "
                  "zero.Init (HfDeepSpeedConfig before from_pretrained, kept alive; see DSD340)",
            "zh": "deepspeed.initialize 搬到设备上的整个未分片模型：在 zero.Init 下构建它（在 from_pretrained 之前创建并保留 "
                  "HfDeepSpeedConfig；见 DSD340）"},
        # generation inside training (trace/loop.py): the optimizer is needed, the step runs between generates
        "init-training": {"en": "what deepspeed.initialize builds for training (ZeRO partitions, optimizer buffers): "
                                "more ranks, offload_optimizer, or a smaller reduce_bucket_size",
                          "zh": "deepspeed.initialize 为训练构建的东西（ZeRO 分区、优化器缓冲）：更多 rank、offload_optimizer "
                                "或更小的 reduce_bucket_size"},
        "training-step": {"en": "the training step between generates (forward activations, gathered parameters, "
                                "gradients, Adam moments from the first step): smaller micro-batch, activation "
                                "checkpointing",
                          "zh": "生成之间的训练步（前向激活、收集的参数、梯度、首次 step 后的 Adam 动量）：更小的 "
                                "micro-batch、激活检查点"},
    }),
    explanation=explanation(
        en=(
            "Names the phase (load, init, generate #n, or between phases) in which each run reached its memory peak.",
            "Where the peak happens decides the fix: at load or init it is the weights and what DeepSpeed builds "
                "(optimizer state, buckets); in generate it is gathered layers, KV cache and activations.",
            "Peak 61.2 GiB during init: the training config built an optimizer.",
            "Fix the phase that peaks: split the config for init peaks; smaller batch or shorter generation for "
                "generate peaks.",
        ),
        zh=(
            "指出每个运行在哪个阶段（load、init、第 n 次 generate，或阶段之间）达到内存峰值。",
            "峰值出现的位置决定修法：在 load 或 init 是权重和 DeepSpeed 建的东西（优化器状态、bucket）；在 generate "
                "是收集的层、KV cache 和激活。",
            "init 阶段峰值 61.2 GiB：训练配置建了优化器。",
            "针对峰值所在阶段修复：init 峰值就拆分配置；generate 峰值就减小 batch 或缩短生成长度。",
        ),
    ),
)

rule(
    "DSD305", "pinned-host-memory-high", "warning",
    message={"en": "ranks on {host} pinned {pinned} of host memory, {percent}% of its {total} RAM",
             "zh": "{host} 上的 rank 锁页了 {pinned} 主机内存，占 {total} 内存的 {percent}%"},
    fix={"en": "set offload_param.pin_memory false, or move fewer parameters to the CPU",
         "zh": "把 offload_param.pin_memory 设为 false，或者少卸载一些参数到 CPU"},
    explanation=explanation(
        en=(
            "Adds up the pinned (page-locked) host memory the CUDA host allocator holds in every rank of one host "
                "and compares it with the host's RAM.",
            "Pinned pages cannot be swapped or reclaimed. With `offload_param.pin_memory` (default true in 0.19.8) "
                "every rank pins its share of the offloaded weights plus staging buffers; past about half the RAM the "
                "OOM killer ends ranks without a Python error.",
            "```json\n{\"offload_param\": {\"device\": \"cpu\", \"pin_memory\": true}}\n```",
            "```json\n{\"offload_param\": {\"device\": \"cpu\", \"pin_memory\": false}}\n```",
        ),
        zh=(
            "把同一台主机上每个 rank 的 CUDA 主机分配器持有的锁页内存加起来，与主机内存比较。",
            "锁页内存不能被换出或回收。`offload_param.pin_memory`（0.19.8 默认 true）下每个 rank 都会锁住自己那份"
                "卸载权重和中转缓冲；超过约一半内存时，OOM killer 会直接杀掉 rank，没有 Python 报错。",
            "```json\n{\"offload_param\": {\"device\": \"cpu\", \"pin_memory\": true}}\n```",
            "```json\n{\"offload_param\": {\"device\": \"cpu\", \"pin_memory\": false}}\n```",
        ),
    ),
)

rule(
    "DSD306", "rank-hung", "error",
    message={"en": "rank {rank} stopped {phase} and did not finish within {timeout}s{where}",
             "zh": "rank {rank} 停在 {phase}，{timeout} 秒内没有结束{where}"},
    fix={"en": "{advice}", "zh": "{advice}"},
    phrases={
        "synced": {"en": "pass synced_gpus=True to generate (see DSD301)", "zh": "给 generate 传 synced_gpus=True（见 DSD301）"},
        "collectives": {"en": "make every rank run the same collectives; the stack in report.json shows where each rank waits",
                        "zh": "保证所有 rank 执行相同的集合通信；report.json 中的调用栈显示每个 rank 在哪里等待"},
    },
    explanation=explanation(
        en=(
            "The watchdog (`--timeout`) ended the run; each rank's last phase and Python stack show where it waited.",
            "A rank waiting in a collective that another rank never joins waits forever (NCCL's default timeout is "
                "long). Under ZeRO-3 the usual cause is generate without `synced_gpus`, or a rank that skipped a forward.",
            "Rank 0 finished generate and waits in a barrier; rank 1 waits for rank 0 to gather layer 0.",
            "Pass `synced_gpus=True` to generate; make every rank run the same collectives.",
        ),
        zh=(
            "看门狗（`--timeout`）结束了运行；每个 rank 最后所在的阶段和 Python 调用栈显示它在哪里等待。",
            "等待一个其他 rank 永远不会加入的集合通信，就会一直等下去（NCCL 默认超时很长）。ZeRO-3 下常见原因是 "
                "generate 没有 `synced_gpus`，或某个 rank 少跑了一次 forward。",
            "rank 0 已完成 generate 并在 barrier 等待；rank 1 在等 rank 0 收集第 0 层。",
            "给 generate 传 `synced_gpus=True`；保证所有 rank 执行相同的集合通信。",
        ),
    ),
)

rule(
    "DSD307", "rank-out-of-memory", "error",
    message={"en": "rank {rank} ran out of memory during {phase}: {error}",
             "zh": "rank {rank} 在 {phase} 阶段内存不足：{error}"},
    fix={"en": "run dsdoctor ab -- COMMAND to see whether offload_param or the workload drives the peak",
         "zh": "运行 dsdoctor ab -- COMMAND，看峰值是 offload_param 还是负载造成的"},
    explanation=explanation(
        en=(
            "Records an out-of-memory error raised inside an observed phase of a rank.",
            "An OOM says nothing by itself about what filled the memory: weights, optimizer state, gathered "
                "layers, KV cache or activations. The phase it happened in, and an A/B of the config, do.",
            "torch.OutOfMemoryError during generate#0 on rank 1.",
            "`dsdoctor ab -- deepspeed --num_gpus 2 infer.py` compares with and without offload_param.",
        ),
        zh=(
            "记录 rank 在某个被观察阶段内抛出的内存不足错误。",
            "OOM 本身不说明内存被什么占满：权重、优化器状态、收集的层、KV cache 还是激活。发生的阶段和配置的 A/B 对比能说明。",
            "rank 1 在 generate#0 期间出现 torch.OutOfMemoryError。",
            "`dsdoctor ab -- deepspeed --num_gpus 2 infer.py` 对比有无 offload_param。",
        ),
    ),
)

rule(
    "DSD308", "rank-failed", "error",
    message={"en": "the command exited with code {returncode}{detail}",
             "zh": "命令以返回码 {returncode} 退出{detail}"},
    fix={"en": "read the command's output in {log}", "zh": "查看命令输出：{log}"},
    explanation=explanation(
        en=(
            "The traced command failed for a reason other than out of memory or a hang.",
            "The memory and phase figures of a failed run describe only the part that ran.",
            "A ValidationError from init_inference given a training config.",
            "Fix the error shown, then trace again.",
        ),
        zh=(
            "被跟踪的命令因内存不足和挂起以外的原因失败。",
            "失败运行的内存和阶段数据只反映已运行的部分。",
            "给 init_inference 传训练配置导致 ValidationError。",
            "修复显示的错误后重新 trace。",
        ),
    ),
)

rule(
    "DSD309", "no-rank-observed", "warning",
    message={"en": "no rank called DeepSpeed, from_pretrained or generate that dsdoctor could observe",
             "zh": "没有观察到任何 rank 调用 DeepSpeed、from_pretrained 或 generate"},
    fix={"en": "make sure the command runs Python with the inherited PYTHONPATH (no -I/-S, no env reset)",
         "zh": "确认命令运行的 Python 继承了 PYTHONPATH（不要用 -I/-S，不要重置环境）"},
    explanation=explanation(
        en=(
            "The command ran but left no rank record.",
            "dsdoctor reaches ranks through a sitecustomize on PYTHONPATH. A launcher that clears the environment, "
                "`python -I`/`-S`, or a container entry point drops it, and there is nothing to report.",
            "`env -i python infer.py`",
            "`python infer.py`, `deepspeed ... infer.py` or `torchrun ... infer.py` with the environment kept.",
        ),
        zh=(
            "命令运行了，但没有留下任何 rank 记录。",
            "dsdoctor 通过 PYTHONPATH 上的 sitecustomize 进入 rank。清空环境的启动器、`python -I`/`-S` "
            "或容器入口会丢掉它，于是无从报告。",
            "`env -i python infer.py`",
            "保留环境运行 `python infer.py`、`deepspeed ... infer.py` 或 `torchrun ... infer.py`。",
        ),
    ),
)

# ------------------------------------------------------------------ ab diagnosis

rule(
    "DSD310", "parameter-gather-dominates", "warning",
    message={"en": "peak memory is lower without offload_param ({without} vs {with_}): the parameter gather "
                   "dominates the peak",
             "zh": "去掉 offload_param 后峰值更低（{without} 对 {with_}）：参数收集主导了峰值"},
    fix={"en": "lower stage3_prefetch_bucket_size and stage3_max_live_parameters, or drop offload_param",
         "zh": "调小 stage3_prefetch_bucket_size 和 stage3_max_live_parameters，或去掉 offload_param"},
    explanation=explanation(
        en=(
            "Compares the run as-is with the same run without `offload_param`.",
            "With offload the gathered layers travel through host staging and prefetch buffers sized by "
                "`stage3_prefetch_bucket_size`/`stage3_max_live_parameters`; when removing the offload lowers the peak, "
                "those buffers, not the resident weights, set it.",
            "as-is 40 GiB, no-offload-param 31 GiB.",
            "Smaller prefetch bucket: `dsdoctor ab --variants as-is,prefetch=1e7 -- ...`.",
        ),
        zh=(
            "对比原样运行与去掉 `offload_param` 的运行。",
            "开启卸载时，被收集的层要经过主机中转和预取缓冲，大小由 `stage3_prefetch_bucket_size`/"
                "`stage3_max_live_parameters` 决定；去掉卸载反而降低峰值，说明峰值来自这些缓冲，而非常驻权重。",
            "原样 40 GiB，无 offload_param 31 GiB。",
            "更小的预取 bucket：`dsdoctor ab --variants as-is,prefetch=1e7 -- ...`。",
        ),
    ),
)

rule(
    "DSD311", "activations-dominate", "warning",
    message={"en": "the peak does not move with offload_param ({with_} vs {without}{oom}): activations, KV cache "
                   "and output buffers dominate",
             "zh": "峰值不随 offload_param 变化（{with_} 对 {without}{oom}）：激活、KV cache 和输出缓冲占主导"},
    phrases={"oom-both": {"en": "; OOM in both", "zh": "；两者都 OOM"}},
    fix={"en": "shorten generation, use a smaller batch, or feed the input in chunks",
         "zh": "缩短生成长度、减小 batch，或把输入分块送入"},
    explanation=explanation(
        en=(
            "Compares the run as-is with the same run without `offload_param` and sees the same peak (or OOM in both).",
            "Offloading parameters only moves weights. When the peak stays, it is made by what grows with the "
                "workload: KV cache (batch x length x layers), activations and logits of the full vocabulary.",
            "Both variants OOM in generate#0 at batch 32, 4096 new tokens.",
            "Batch 8, max_new_tokens 1024, or chunk long prompts.",
        ),
        zh=(
            "对比原样运行与去掉 `offload_param` 的运行，峰值相同（或都 OOM）。",
            "卸载参数只移动权重。峰值不变说明它来自随负载增长的部分：KV cache（batch x 长度 x 层数）、激活和整个词表的 logits。",
            "batch 32、生成 4096 token 时两个变体都在 generate#0 OOM。",
            "batch 8、max_new_tokens 1024，或把长提示分块。",
        ),
    ),
)

rule(
    "DSD312", "offload-transfer-bottleneck", "warning",
    message={"en": "with offload_param {what}: the CPU-GPU transfer is the bottleneck",
             "zh": "开启 offload_param 时{what}：CPU-GPU 传输是瓶颈"},
    phrases={
        "slower": {"en": "tokens/s drops from {before:.1f} to {after:.1f}", "zh": "tokens/s 从 {before:.1f} 降到 {after:.1f}"},
        "host-grows": {"en": "host memory grows from {before} to {after}", "zh": "主机内存从 {before} 涨到 {after}"},
        "both": {"en": "{a} and {b}", "zh": "{a}，{b}"},
    },
    fix={"en": "offload fewer layers (move the offload boundary) and measure pin_memory on and off",
         "zh": "少卸载一些层（移动卸载边界），并测量 pin_memory 开和关"},
    explanation=explanation(
        en=(
            "Compares speed and host memory of the run as-is (with `offload_param`) and without it.",
            "Every generated token moves every offloaded weight over PCIe. When that collapses tokens/s or "
                "inflates host memory (pinned staging per rank), the transfer, not the GPU, sets the pace.",
            "as-is 3 tokens/s, no-offload-param 41 tokens/s.",
            "`dsdoctor ab --variants as-is,pin-memory-off,no-offload-param -- ...`; keep offload only if the GPU "
                "cannot hold the weights.",
        ),
        zh=(
            "对比原样（开启 `offload_param`）与去掉它时的速度和主机内存。",
            "每生成一个 token，所有卸载的权重都要经过 PCIe 搬运。若这让 tokens/s 暴跌或主机内存暴涨（每个 rank 的锁页中转），"
                "瓶颈是传输而非 GPU。",
            "原样 3 tokens/s，无 offload_param 41 tokens/s。",
            "`dsdoctor ab --variants as-is,pin-memory-off,no-offload-param -- ...`；只有 GPU 放不下权重时才保留卸载。",
        ),
    ),
)

rule(
    "DSD313", "ab-inconclusive", "info",
    message={"en": "no variant changed the picture decisively: {summary}",
             "zh": "没有变体带来决定性变化：{summary}"},
    fix={"en": "trace the run (dsdoctor trace) to see which phase peaks", "zh": "用 dsdoctor trace 查看哪个阶段是峰值"},
    explanation=explanation(
        en=(
            "The variants ran but neither memory nor speed differed by more than the noise threshold (10%).",
            "The config is not what limits this run.",
            "as-is 12.0 GiB, no-offload-param 12.1 GiB.",
            "Look at the workload (batch, lengths) and the phase of the peak.",
        ),
        zh=(
            "各变体都运行了，但内存和速度的差异都没有超过噪声阈值（10%）。",
            "限制这个运行的不是配置。",
            "原样 12.0 GiB，无 offload_param 12.1 GiB。",
            "检查负载（batch、长度）和峰值所在阶段。",
        ),
    ),
)

rule(
    "DSD314", "training-config-cost", "warning",
    message={"en": "the inference-only config ({variant}) lowers peak {kind} memory from {before} to {after}"
                   "{speed}",
             "zh": "仅推理配置（{variant}）把{kind}内存峰值从 {before} 降到 {after}{speed}"},
    phrases=KIND,
    fix={"en": "use the inference config: dsdoctor split CONFIG -o ds_infer.json",
         "zh": "使用推理配置：dsdoctor split CONFIG -o ds_infer.json"},
    explanation=explanation(
        en=(
            "Compares the run as-is with the same run given only the inference part of its config.",
            "A training config makes `deepspeed.initialize` build an optimizer (fp32 master partitions, gradient "
                "partitions, reduce buckets) that inference never uses.",
            "as-is 21.3 GiB host, split 9.8 GiB host.",
            "`dsdoctor split ds_config.json -o ds_infer.json` and pass that to the script.",
        ),
        zh=(
            "对比原样运行与只给配置推理部分的运行。",
            "训练配置会让 `deepspeed.initialize` 构建推理永远用不到的优化器（fp32 主权重分片、梯度分片、reduce bucket）。",
            "原样主机内存 21.3 GiB，拆分后 9.8 GiB。",
            "`dsdoctor split ds_config.json -o ds_infer.json`，把它传给脚本。",
        ),
    ),
)

rule(
    "DSD315", "offload-param-required", "info",
    message={"en": "without offload_param the run is out of memory ({without}); with it, peak {kind} {with_}"
                   "{speed}: the weights only fit offloaded",
             "zh": "去掉 offload_param 后内存不足（{without}）；开启时{kind}峰值 {with_}{speed}：权重只有卸载才放得下"},
    phrases=KIND,
    fix={"en": "keep offload_param and tune the transfer: pin_memory, stage3_prefetch_bucket_size, or more GPUs",
         "zh": "保留 offload_param 并调优传输：pin_memory、stage3_prefetch_bucket_size，或使用更多 GPU"},
    explanation=explanation(
        en=(
            "Compares the run as-is (with `offload_param`) with the same run without it, which runs out of memory.",
            "Then offloading is not the waste it often is: it is what makes the run fit. What is left to gain is in "
                "the transfer (pinned memory, prefetch size) or in sharding over more GPUs.",
            "as-is 21.0 GiB, 4 tokens/s; no-offload-param OOM.",
            "`dsdoctor ab --variants as-is,pin-memory-off,prefetch=1e8 -- ...` to tune the transfer.",
        ),
        zh=(
            "对比原样（开启 `offload_param`）与去掉它的运行，后者内存不足。",
            "这时卸载并非常见的浪费，而是让运行放得下的原因。剩下可提升的在传输（锁页内存、预取大小）或用更多 GPU 分片。",
            "原样 21.0 GiB、4 tokens/s；无 offload_param 时 OOM。",
            "`dsdoctor ab --variants as-is,pin-memory-off,prefetch=1e8 -- ...` 调优传输。",
        ),
    ),
)

# ------------------------------------------------------------------ how a run ended, and what ab could do

rule(
    "DSD318", "run-timed-out", "warning",
    message={"en": "the run did not end within {timeout}s; no rank was waiting on another: {where}",
             "zh": "运行在 {timeout} 秒内没有结束；没有 rank 在等待其他 rank：{where}"},
    fix={"en": "if the ranks were still working, give the run a longer --timeout; the stacks in report.json show "
               "where each rank was",
         "zh": "如果各 rank 仍在工作，请用更长的 --timeout；report.json 中的调用栈显示每个 rank 当时所在位置"},
    explanation=explanation(
        en=(
            "The watchdog (`--timeout`) ended the run while ranks were still running, and nothing shows them waiting "
        "on each other: no rank waited in a collective while another was elsewhere. It says where each rank was.",
            "A timeout is not a hang. A healthy ZeRO-3 generate spends much of its time in all-gathers, so two ranks "
        "stopped on the same line inside a collective are working, not stuck. Calling that a hang sends you "
        "looking for diverging collectives that do not exist.",
            "`dsdoctor trace --timeout 8 -- deepspeed --num_gpus 2 infer.py`: both ranks in generate#0 at infer.py:40.",
            "`dsdoctor trace --timeout 900 -- deepspeed --num_gpus 2 infer.py`, or a shorter generation while you "
        "trace.",
        ),
        zh=(
            "看门狗（`--timeout`）结束运行时各 rank 仍在运行，且没有迹象表明它们在互相等待：没有 rank 在集合通信中"
        "等待而另一个 rank 在别处。它会说明每个 rank 当时所在的位置。",
            "超时不等于卡死。健康的 ZeRO-3 generate 大部分时间都在 all-gather 中，两个 rank 停在同一行的集合通信里"
        "说明它们在工作，而不是卡住。把它叫作卡死，会让你去找并不存在的集合通信分歧。",
            "`dsdoctor trace --timeout 8 -- deepspeed --num_gpus 2 infer.py`：两个 rank 都在 infer.py:40 的 "
        "generate#0 中。",
            "`dsdoctor trace --timeout 900 -- deepspeed --num_gpus 2 infer.py`，或在跟踪时缩短生成长度。",
        ),
    ),
)

rule(
    "DSD319", "ranks-finished-command-lingered", "info",
    message={"en": "every rank finished (rank {ranks}) but the command was still running after {timeout}s",
             "zh": "所有 rank 都已完成（rank {ranks}），但命令在 {timeout} 秒后仍在运行"},
    fix={"en": "nothing is wrong with the ranks' work; find the launcher or helper process that did not exit",
         "zh": "各 rank 的工作没有问题；请找出没有退出的启动器或辅助进程"},
    explanation=explanation(
        en=(
            "The watchdog (`--timeout`) ended a command whose ranks had all exited successfully before it.",
            "The report of such a run is complete: every phase of every rank finished. What kept the command alive "
        "was a launcher waiting on something else, or a process the script started and did not end.",
            "Both ranks exit after generate; the script's own helper process keeps the launcher waiting.",
            "End helper processes before the script exits, or give the launcher time to tear down.",
        ),
        zh=(
            "看门狗（`--timeout`）结束了一个命令，而它的所有 rank 在此之前都已成功退出。",
            "这种运行的报告是完整的：每个 rank 的每个阶段都已结束。让命令继续存活的是在等待其他东西的启动器，或者脚本"
        "启动后没有结束的进程。",
            "两个 rank 都在 generate 后退出；脚本自己的辅助进程让启动器一直等待。",
            "在脚本退出前结束辅助进程，或给启动器留出清理时间。",
        ),
    ),
)

rule(
    "DSD320", "ab-variants-not-applied", "error",
    message={"en": "the config variants could not be applied ({variant}): {why}; ab stopped after {ran}",
             "zh": "配置变体无法应用（{variant}）：{why}；ab 在 {ran} 之后停止"},
    fix={"en": "{advice}", "zh": "{advice}"},
    phrases={
        "why-init-inference": {
            "en": "the run hands its config to deepspeed.init_inference, which takes an inference config, not a ZeRO one",
            "zh": "该运行把配置交给 deepspeed.init_inference，它接收的是推理配置而不是 ZeRO 配置"},
        "why-not-rewritable": {
            "en": "the config reached DeepSpeed in a form dsdoctor cannot rewrite (not a dict or a file)",
            "zh": "配置以 dsdoctor 无法改写的形式（不是 dict 或文件）到达 DeepSpeed"},
        "why-ended": {"en": "the run ended ({status}) before any config reached DeepSpeed",
                      "zh": "运行在任何配置到达 DeepSpeed 之前就结束了（{status}）"},
        "why-none": {"en": "no DeepSpeed config reached deepspeed.initialize or HfDeepSpeedConfig in this run",
                     "zh": "本次运行中没有 DeepSpeed 配置到达 deepspeed.initialize 或 HfDeepSpeedConfig"},
        "advice-plan": {
            "en": "compare load paths with dsdoctor plan (and their outputs with dsdoctor compare); ab varies "
                  "configs given to deepspeed.initialize or HfDeepSpeedConfig",
            "zh": "用 dsdoctor plan 比较加载方式（用 dsdoctor compare 比较输出）；ab 只能改写交给 "
                  "deepspeed.initialize 或 HfDeepSpeedConfig 的配置"},
        "advice-dict": {"en": "pass the config to deepspeed.initialize as a dict or a file path",
                        "zh": "把配置以 dict 或文件路径的形式传给 deepspeed.initialize"},
        "advice-trace": {"en": "fix the run first: dsdoctor trace -- COMMAND shows where it stops",
                         "zh": "先修复运行：dsdoctor trace -- COMMAND 会显示它停在哪里"},
        "advice-no-config": {
            "en": "ab needs a run that passes a DeepSpeed config; compare load paths with dsdoctor plan instead",
            "zh": "ab 需要一个会传入 DeepSpeed 配置的运行；改用 dsdoctor plan 比较加载方式"},
    },
    explanation=explanation(
        en=(
            "ab rewrites the DeepSpeed config inside each rank, where the script hands it to `deepspeed.initialize` or "
        "`HfDeepSpeedConfig`. The observer records whether the variant's config is what DeepSpeed received. When "
        "the config never reaches those calls (an `init_inference` script, or no DeepSpeed at all), no variant "
        "can change anything and ab stops instead of running the same program several times.",
            "Identical runs labelled as different configs compare noise: two runs of the same program can differ "
        "by tens of percent in tokens/s, and a table of them looks like a finding.",
            "`dsdoctor ab -- python bloom_init_inference.py`: init_inference takes an inference config, not a ZeRO "
        "config.",
            "Compare the load paths instead: `dsdoctor plan`, or `dsdoctor compare` for their outputs.",
        ),
        zh=(
            "ab 在每个 rank 内、脚本把 DeepSpeed 配置交给 `deepspeed.initialize` 或 `HfDeepSpeedConfig` 的地方改写配置。"
        "观察器会记录 DeepSpeed 收到的是否是变体的配置。若配置根本不经过这些调用（使用 `init_inference` 的脚本，"
        "或完全不用 DeepSpeed），任何变体都改变不了什么，ab 会停止，而不是把同一个程序运行多次。",
            "把相同的运行标成不同的配置，比较的只是噪声：同一程序的两次运行 tokens/s 可以相差几十个百分点，"
        "列成表却像是一个发现。",
            "`dsdoctor ab -- python bloom_init_inference.py`：init_inference 接收的是推理配置，而不是 ZeRO 配置。",
            "改为比较加载方式：`dsdoctor plan`，或用 `dsdoctor compare` 比较它们的输出。",
        ),
    ),
)

rule(
    "DSD321", "needs-launcher", "error",
    message={"en": "the script sets up distributed ranks but was started without a launcher: DeepSpeed looked "
                   "for MPI and failed ({error})",
             "zh": "脚本要建立分布式 rank，却没有通过启动器运行：DeepSpeed 转而寻找 MPI 并失败（{error}）"},
    fix={"en": "run it with the deepspeed launcher (deepspeed --num_gpus N script.py) or torchrun "
               "(torchrun --nproc_per_node N script.py)",
         "zh": "用 deepspeed 启动器（deepspeed --num_gpus N script.py）或 torchrun "
               "（torchrun --nproc_per_node N script.py）运行"},
    explanation=explanation(
        en=(
            "Sees a run started as `python script.py` fail with `No module named 'mpi4py'`.",
            "`deepspeed.init_distributed()` (also called by `deepspeed.initialize`) reads RANK, WORLD_SIZE and "
        "MASTER_ADDR from the environment a launcher sets. Without them it falls back to MPI discovery, which "
        "imports mpi4py: the error names a package you do not need.",
            "```bash\npython infer.py   # calls deepspeed.init_distributed()\n```",
            "```bash\ndeepspeed --num_gpus 2 infer.py\ntorchrun --nproc_per_node 2 infer.py\n```",
        ),
        zh=(
            "发现以 `python script.py` 启动的运行因 `No module named 'mpi4py'` 失败。",
            "`deepspeed.init_distributed()`（`deepspeed.initialize` 也会调用）从启动器设置的环境变量中读取 RANK、"
        "WORLD_SIZE 和 MASTER_ADDR。没有它们时会退回到 MPI 发现，从而导入 mpi4py：报错提到的是你并不需要的包。",
            "```bash\npython infer.py   # 调用了 deepspeed.init_distributed()\n```",
            "```bash\ndeepspeed --num_gpus 2 infer.py\ntorchrun --nproc_per_node 2 infer.py\n```",
        ),
    ),
)

from dsdoctor.trace import loop_rules  # noqa: E402,F401  (DSD330-DSD332: generation inside training)
