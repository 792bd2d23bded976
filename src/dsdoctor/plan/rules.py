"""Findings of ``dsdoctor plan`` (DSD2xx). Torch-free: imported by ``dsdoctor explain``."""
from __future__ import annotations

from dsdoctor.findings import explanation, rule

rule(
    "DSD201", "zero3-not-needed", "warning",
    message={
        "en": "the config uses ZeRO-3, but the whole model fits on one GPU: plain loading peaks at {plain_peak} "
              "of {capacity} and runs about {speedup}x faster than {config_path}",
        "zh": "配置使用了 ZeRO-3，但整个模型放得进一张 GPU：直接加载峰值 {plain_peak}（容量 {capacity}），"
              "速度约为 {config_path} 的 {speedup} 倍",
    },
    fix={
        "en": "load the model without DeepSpeed, one replica per GPU (see the recommended code)",
        "zh": "不用 DeepSpeed，直接加载模型，每张 GPU 一个副本（见推荐代码）",
    },
    explanation=explanation(
        en=(
            """\
Compares the ZeRO-3 path your DeepSpeed config selects with loading the model whole on each GPU.
""",
            """\
ZeRO-3 exists to fit models that do not fit. At inference it gathers every layer from the other ranks
before each forward, for every generated token, and every rank must run every forward
(`synced_gpus=True`). When one GPU holds the model, that is pure cost: generation is several times
slower, and the per-GPU peak is barely lower because gathered layers, KV cache and activations are not
sharded.
""",
            """\
A 7B model, 80 GB GPUs, a training config with `"stage": 3` reused for `generate`.
""",
            """\
`AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")`, one process per
GPU, each with its own batch.
""",
        ),
        zh=(
            """\
比较 DeepSpeed 配置选择的 ZeRO-3 路径与在每张 GPU 上完整加载模型。
""",
            """\
ZeRO-3 是为放不下的模型准备的。推理时，每生成一个 token，每次前向之前都要从其他 rank 收集每一层，
而且每个 rank 都必须执行每次前向（`synced_gpus=True`）。模型放得进一张 GPU 时，这纯属开销：生成慢好几倍，
而每卡峰值几乎没有降低，因为收集的层、KV cache 和激活都不分片。
""",
            """\
7B 模型、80 GB GPU，把 `"stage": 3` 的训练配置拿来做 `generate`。
""",
            """\
`AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")`，每张 GPU 一个进程，
各自处理自己的 batch。
""",
        ),
    ),
)

rule(
    "DSD202", "fits-no-path", "error",
    message={
        "en": "no load path fits: the smallest, {path}, needs {need} per GPU of {capacity} and {host_need} of "
              "{host_capacity} host memory",
        "zh": "没有可行的加载方式：最省的 {path} 每张 GPU 需要 {need}（容量 {capacity}），主机内存需要 {host_need}"
              "（容量 {host_capacity}）",
    },
    fix={
        "en": "lower the batch or context (see 'what fits'), add GPUs, or quantize the weights",
        "zh": "减小 batch 或上下文长度（见“可容纳范围”），增加 GPU，或量化权重",
    },
    explanation=explanation(
        en=(
            """\
Predicts the peak memory of every load path (plain, tensor parallel, ZeRO-3, ZeRO-3 with CPU or NVMe
offload) for your model, workload and machine, and reports when none fits.
""",
            """\
The run will fail with CUDA out-of-memory or the host will start swapping or get OOM-killed, usually
after minutes of loading.
""",
            """\
A 70B model in bf16 (140 GB of weights) on one 24 GB GPU with 64 GB of host memory.
""",
            """\
Reduce the batch or the context (the plan lists the largest that fits per path), use more GPUs, or a
smaller or quantized model.
""",
        ),
        zh=(
            """\
针对你的模型、负载和机器，预测每种加载方式（直接加载、张量并行、ZeRO-3、ZeRO-3 CPU/NVMe 卸载）的显存峰值，
在全部放不下时报告。
""",
            """\
运行会因 CUDA out-of-memory 失败，或主机开始换页甚至被 OOM 杀掉，通常是在加载了几分钟之后。
""",
            """\
bf16 的 70B 模型（权重 140 GB），一张 24 GB GPU，64 GB 主机内存。
""",
            """\
减小 batch 或上下文（计划会列出每种方式可容纳的最大值），使用更多 GPU，或更小/量化的模型。
""",
        ),
    ),
)

rule(
    "DSD203", "training-config-costs-memory", "warning",
    message={
        "en": "the config's optimizer section makes deepspeed.initialize build optimizer state: {gpu_cost} more "
              "per GPU and {host_cost} more host memory, for nothing at inference",
        "zh": "配置中的 optimizer 会让 deepspeed.initialize 构建优化器状态：每张 GPU 多占 {gpu_cost}，主机多占 "
              "{host_cost}，推理时毫无用处",
    },
    fix={
        "en": "remove optimizer, scheduler and offload_optimizer from the inference config",
        "zh": "从推理配置中删除 optimizer、scheduler 和 offload_optimizer",
    },
    explanation=explanation(
        en=(
            """\
Counts what a reused training config adds to an inference run.
""",
            """\
With an `optimizer` section, `deepspeed.initialize` builds `DeepSpeedZeroOptimizer_Stage3`: fp32 master
partitions (4 bytes per parameter, on the host with `offload_optimizer`), a gradient partition and a GPU
reduce bucket of `reduce_bucket_size` elements. None of it is used by `generate`; it only raises the
peak and slows start-up.
""",
            """\
`{"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}`
""",
            """\
`dsdoctor split` writes an inference config without those keys.
""",
        ),
        zh=(
            """\
统计复用的训练配置给推理增加的内存。
""",
            """\
配置里有 `optimizer` 时，`deepspeed.initialize` 会构建 `DeepSpeedZeroOptimizer_Stage3`：fp32 主参数分片
（每参数 4 字节，开启 `offload_optimizer` 时在主机上）、梯度分片，以及 `reduce_bucket_size` 个元素的 GPU
reduce bucket。`generate` 一样都用不上，只会抬高峰值、拖慢启动。
""",
            """\
`{"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}`
""",
            """\
用 `dsdoctor split` 生成去掉这些键的推理配置。
""",
        ),
    ),
)

rule(
    "DSD204", "config-path-does-not-fit", "error",
    message={
        "en": "the config's path {path} needs {need} per GPU but the GPU has {capacity}",
        "zh": "配置对应的 {path} 每张 GPU 需要 {need}，但 GPU 只有 {capacity}",
    },
    fix={
        "en": "use the recommended path: {recommended}",
        "zh": "改用推荐的方式：{recommended}",
    },
    explanation=explanation(
        en=(
            """\
Predicts the per-GPU peak of the load path your DeepSpeed config selects (stage, offload) for the
workload, including what `torch.cuda.max_memory_allocated` does not see (CUDA context, NCCL buffers).
""",
            """\
The run will end in CUDA out-of-memory, at load or at the first long prompt.
""",
            """\
ZeRO-3 without offload for a 70B model on 2 x 80 GB.
""",
            """\
The recommended path in the plan, or the batch and context it lists as fitting.
""",
        ),
        zh=(
            """\
针对该负载，预测 DeepSpeed 配置所选加载方式（stage、offload）的每卡峰值，包括
`torch.cuda.max_memory_allocated` 看不到的部分（CUDA context、NCCL 缓冲区）。
""",
            """\
运行会在加载时或遇到第一个长 prompt 时因 CUDA out-of-memory 失败。
""",
            """\
2 x 80 GB 上不开卸载的 ZeRO-3 跑 70B 模型。
""",
            """\
使用计划中推荐的方式，或它列出的可容纳 batch 和上下文。
""",
        ),
    ),
)

rule(
    "DSD205", "hardware-assumed", "info",
    message={
        "en": "planned for assumed hardware: {assumed}",
        "zh": "按假定的硬件做的计划：{assumed}",
    },
    fix={
        "en": "pass --gpus, --gpu-memory, --host-memory and --h2d-bandwidth for your machine",
        "zh": "用 --gpus、--gpu-memory、--host-memory 和 --h2d-bandwidth 指定你的机器",
    },
    explanation=explanation(
        en=(
            """\
Says which hardware figures were neither given nor read from the machine (nvidia-smi, /proc/meminfo).
""",
            """\
The fit and the speed depend on them; a plan for an 80 GB GPU says little about a 24 GB one.
""",
            """\
`dsdoctor plan --model ./llama` on a machine without GPUs.
""",
            """\
`dsdoctor plan --model ./llama --gpus 8 --gpu-memory 80GiB --host-memory 1TiB`
""",
        ),
        zh=(
            """\
指出哪些硬件参数既没有给出，也没能从本机读到（nvidia-smi、/proc/meminfo）。
""",
            """\
能否放下和速度都取决于它们；按 80 GB GPU 做的计划对 24 GB 的卡没有参考意义。
""",
            """\
在没有 GPU 的机器上运行 `dsdoctor plan --model ./llama`。
""",
            """\
`dsdoctor plan --model ./llama --gpus 8 --gpu-memory 80GiB --host-memory 1TiB`
""",
        ),
    ),
)

rule(
    "DSD206", "offload-param-unpinned", "warning",
    message={
        "en": "offload_param has pin_memory false: every token copies {moved} per rank from pageable host memory, "
              "about {slowdown}x slower than pinned",
        "zh": "offload_param 的 pin_memory 为 false：每个 token 每个 rank 要从可分页内存拷贝 {moved}，"
              "比锁页内存慢约 {slowdown} 倍",
    },
    fix={
        "en": "set zero_optimization.offload_param.pin_memory to true if the host has {pinned} to pin",
        "zh": "若主机能锁定 {pinned}，把 zero_optimization.offload_param.pin_memory 设为 true",
    },
    explanation=explanation(
        en=(
            """\
Flags ZeRO-3 parameter offload from pageable (unpinned) host memory.
""",
            """\
With offload, every forward copies each rank's parameter shards from the host. Pageable memory is
staged through a pinned bounce buffer, so the copy runs at a fraction of PCIe bandwidth, and decode,
which is bound by that copy, slows by the same factor.
""",
            """\
`"offload_param": {"device": "cpu", "pin_memory": false}`
""",
            """\
`"offload_param": {"device": "cpu", "pin_memory": true}` when the host can hold the pinned shards
(torch rounds each pinned block up to a power of two; the plan counts that).
""",
        ),
        zh=(
            """\
标出从可分页（未锁页）主机内存做 ZeRO-3 参数卸载的配置。
""",
            """\
开启卸载后，每次前向都要从主机拷贝本 rank 的参数分片。可分页内存需经锁页中转缓冲区，拷贝只能达到 PCIe
带宽的一小部分，受其限制的 decode 也按同样比例变慢。
""",
            """\
`"offload_param": {"device": "cpu", "pin_memory": false}`
""",
            """\
主机放得下锁页分片时用 `"offload_param": {"device": "cpu", "pin_memory": true}`（torch 会把每块锁页内存
向上取整到 2 的幂，计划已计入）。
""",
        ),
    ),
)
from dsdoctor.plan import loop_rules, rules_paths  # noqa: E402,F401  (DSD207-DSD209 --loop; DSD210-DSD219)
