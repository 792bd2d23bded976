"""Findings of plan's load paths and loading methods (DSD210-DSD219). Torch-free."""
from __future__ import annotations

from dsdoctor.findings import rule

PAST_MAX_POSITIONS = rule(
    "DSD210", "past-max-positions", "warning",
    message={
        "en": "prompt + new tokens = {total} is past the model's position limit {limit}; {encoding} positions run "
              "past it, but the model was trained only to {limit}",
        "zh": "prompt + 新 token = {total}，超过了模型的位置上限 {limit}；{encoding} 位置编码可以越过它运行，"
              "但模型只训练到 {limit}",
    },
    fix={
        "en": "keep prompt + new tokens within {limit}, or use a RoPE scaling (rope_scaling) the model supports",
        "zh": "把 prompt + 新 token 控制在 {limit} 以内，或使用模型支持的 RoPE 缩放（rope_scaling）",
    },
    explanation={
        "en": """\
## What it does
Plans a run longer than `max_position_embeddings` for a model whose positions are computed (RoPE, ALiBi),
and says so.

## Why is this bad?
transformers runs it: rotary and ALiBi positions have no table to run out of. But the model has never seen
positions past its limit; quality usually drops there. Models with a learned position table (GPT-2, OPT,
GPT-Neo) cannot run past it at all, and plan refuses those.

## Example
A Llama with `max_position_embeddings: 4096`, prompt 4096, 64 new tokens.

## Use instead
Stay within the limit, or set a `rope_scaling` the model was tuned for.
""",
        "zh": """\
## 作用
模型的位置是计算出来的（RoPE、ALiBi），而运行长度超过 `max_position_embeddings` 时，照常做计划并指出这一点。

## 为什么不好？
transformers 能运行：旋转和 ALiBi 位置没有会用完的表。但模型从没见过超过上限的位置，那里的质量通常会下降。
使用可学习位置表的模型（GPT-2、OPT、GPT-Neo）根本无法越过上限，plan 会拒绝它们。

## 示例
`max_position_embeddings: 4096` 的 Llama，prompt 4096，新 token 64。

## 应该这样
保持在上限以内，或设置模型针对其调过的 `rope_scaling`。
""",
    },
)

NO_BF16 = rule(
    "DSD211", "bf16-on-gpu-without-bf16", "warning",
    message={
        "en": "{gpu} (compute capability {capability}) has no bf16: the emitted config and code use fp16",
        "zh": "{gpu}（计算能力 {capability}）不支持 bf16：给出的配置和代码改用 fp16",
    },
    fix={
        "en": "run in fp16 ({{\"fp16\": {{\"enabled\": true}}}}, dtype=torch.float16); check the model tolerates fp16",
        "zh": "用 fp16 运行（{{\"fp16\": {{\"enabled\": true}}}}，dtype=torch.float16）；确认模型在 fp16 下不溢出",
    },
    explanation={
        "en": """\
## What it does
Checks the run dtype against the GPU: bf16 needs compute capability 8.0 (Ampere) or later, read from
`nvidia-smi --query-gpu=compute_cap` or the GPU's name.

## Why is this bad?
On a V100 or T4, bf16 kernels are missing or emulated: DeepSpeed refuses or runs far slower, and the
`{"bf16": {"enabled": true}}` config copied from an A100 recipe fails at start.

## Example
`dsdoctor plan --model ./llama --gpu-name V100` with a bf16 checkpoint.

## Use instead
`{"fp16": {"enabled": true}}` and `dtype=torch.float16`; models trained in bf16 can overflow in fp16, so
compare a few outputs.
""",
        "zh": """\
## 作用
检查运行精度与 GPU 是否匹配：bf16 需要计算能力 8.0（Ampere）及以上，从 `nvidia-smi --query-gpu=compute_cap`
或 GPU 名称读取。

## 为什么不好？
V100、T4 上 bf16 内核缺失或靠模拟：DeepSpeed 会拒绝或慢得多，从 A100 配方抄来的 `{"bf16": {"enabled": true}}`
一启动就失败。

## 示例
对 bf16 检查点运行 `dsdoctor plan --model ./llama --gpu-name V100`。

## 应该这样
`{"fp16": {"enabled": true}}` 和 `dtype=torch.float16`；bf16 训练的模型在 fp16 下可能溢出，先对比几条输出。
""",
    },
)

LOADING_METHOD = rule(
    "DSD212", "loading-method-decides-host-fit", "info",
    message={
        "en": "{path} fits the host only with loading method {method} ({method_peak} of {host}); {default} would "
              "need {default_peak}",
        "zh": "{path} 只有用加载方法 {method} 才放得进主机内存（{method_peak}，主机 {host}）；{default} 需要 "
              "{default_peak}",
    },
    fix={
        "en": "load with {method} (see the recommended code)",
        "zh": "用 {method} 加载（见推荐代码）",
    },
    explanation={
        "en": """\
## What it does
Models the host memory of each way to load the checkpoint for the path (plan/loading.py): anonymous memory
(CPU copies, heap) apart from file-backed pages (a memory-mapped checkpoint, shared by every process through
the page cache), and picks the simplest method that fits.

## Why is this bad?
Tensor parallelism where every rank builds the model on the CPU holds one copy per rank when a dtype
conversion (or a legacy `.bin`) materializes it: 8 copies of a 72B model on 8 GPUs is 1.1 TiB. The load is
killed by the OOM killer before the GPUs see a byte.

## Example
Qwen2-72B, 8 x 80 GiB, 1 TiB of host memory, loaded in fp16 from a bf16 checkpoint.

## Use instead
A meta-device model with a checkpoint description (`checkpoint="checkpoints.json"`), pre-sharded
checkpoints (`save_mp_checkpoint_path`), fewer ranks per host (tensor-parallel groups with replicas), or no
dtype conversion.
""",
        "zh": """\
## 作用
为每种加载方式建模主机内存（plan/loading.py）：匿名内存（CPU 拷贝、堆）与文件页（内存映射的检查点，
经页缓存被所有进程共享）分开计算，选出放得下的最简单方法。

## 为什么不好？
张量并行时若每个 rank 都在 CPU 上构建模型，一旦发生 dtype 转换（或旧式 `.bin`），每个 rank 都持有一份完整拷贝：
8 卡跑 72B 就是 1.1 TiB。加载过程会在 GPU 拿到任何数据之前被 OOM killer 杀掉。

## 示例
Qwen2-72B，8 x 80 GiB，主机 1 TiB，从 bf16 检查点以 fp16 加载。

## 应该这样
meta 设备上的模型加检查点描述（`checkpoint="checkpoints.json"`）、预切分检查点（`save_mp_checkpoint_path`）、
每台主机更少的 rank（张量并行组加副本），或避免 dtype 转换。
""",
    },
)

ESTIMATED_PATHS = rule(
    "DSD213", "unmeasured-paths", "info",
    message={
        "en": "{paths}: modelled from the libraries' sources, not yet measured on a GPU (marked ~)",
        "zh": "{paths}：依据库源码建模，尚未在 GPU 上测量（标记为 ~）",
    },
    fix={
        "en": "measure before relying on them: dsdoctor trace on the GPU, or bench/plan",
        "zh": "依赖它们之前先测量：在 GPU 上用 dsdoctor trace，或 bench/plan",
    },
    explanation={
        "en": """\
## What it does
Marks the load paths whose memory and speed are modelled but have not been checked against a GPU run
(accelerate's `device_map="auto"`, bitsandbytes int8/nf4, ZeRO-Inference int4 weights).

## Why is this bad?
The measured paths (plain, tp, ZeRO-3) are within a fraction of a percent on the recorded runs; these are
not: their workspaces and kernel speeds come from reading the code, and can be off by tens of percent.

## Example
`dsdoctor plan --model ./llama-70b --gpus 1` lists `bnb-nf4~`.

## Use instead
Run the path once with `dsdoctor trace` and compare.
""",
        "zh": """\
## 作用
标出内存和速度只是建模、尚未与 GPU 实测对照的加载方式（accelerate 的 `device_map="auto"`、bitsandbytes
int8/nf4、ZeRO-Inference int4 权重）。

## 为什么不好？
已测量的方式（plain、tp、ZeRO-3）在记录的运行上误差不到百分之一；这些不是：它们的工作区和内核速度来自读代码，
可能偏差几十个百分点。

## 示例
`dsdoctor plan --model ./llama-70b --gpus 1` 会列出 `bnb-nf4~`。

## 应该这样
先用 `dsdoctor trace` 实际运行一次并对照。
""",
    },
)

APPROXIMATE_COUNTS = rule(
    "DSD214", "formula-counts-approximate", "warning",
    message={
        "en": "no exact formula for model_type {model_type}: the parameter count {count} is a Llama-style "
              "approximation",
        "zh": "model_type {model_type} 没有精确公式：参数量 {count} 是按 Llama 结构的近似值",
    },
    fix={
        "en": "install transformers and use --counts meta (or auto) for exact counts",
        "zh": "安装 transformers，用 --counts meta（或 auto）得到精确参数量",
    },
    explanation={
        "en": """\
## What it does
With `--counts formula` (no torch), parameters are counted from config.json by per-architecture formulas
that match transformers' modules exactly (tested against the meta-device build). For an architecture
without one, a Llama-style formula is used and this finding says so.

## Why is this bad?
The count sets the weight memory of every path. A Llama formula on BLOOM counts a gated MLP BLOOM does not
have: 10.1B instead of 7.1B.

## Example
`dsdoctor plan --model ./some-new-arch --counts formula`

## Use instead
`--counts meta` with transformers installed builds the model on the meta device and counts exactly.
""",
        "zh": """\
## 作用
使用 `--counts formula`（不需要 torch）时，按各架构的公式从 config.json 计算参数量，公式与 transformers 的模块
完全一致（已对照 meta 设备构建测试）。没有专门公式的架构按 Llama 结构近似，并给出本提示。

## 为什么不好？
参数量决定每种方式的权重内存。把 Llama 公式套在 BLOOM 上会多算一个 BLOOM 没有的门控 MLP：101 亿而不是 71 亿。

## 示例
`dsdoctor plan --model ./some-new-arch --counts formula`

## 应该这样
安装 transformers，用 `--counts meta` 在 meta 设备上构建模型精确计数。
""",
    },
)
