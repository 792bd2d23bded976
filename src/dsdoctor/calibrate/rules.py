"""Findings of calibrate and of plan's reserved-memory model (DSD220-229). Torch-free."""
from __future__ import annotations

from dsdoctor.findings import rule

FRAGMENTATION = rule(
    "DSD220", "allocator-fragmentation", "warning",
    message={
        "en": "{path}: the CUDA caching allocator would reserve {reserved} for an allocated peak of {allocated} "
              "({pct}% more, fragmentation from gather/release churn); with expandable segments about "
              "{reserved_expandable}",
        "zh": "{path}：CUDA 缓存分配器预计为 {allocated} 的 allocated 峰值保留 {reserved}（多 {pct}%，"
              "收集/释放交替造成碎片）；开启 expandable segments 约为 {reserved_expandable}",
    },
    fix={
        "en": "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting the run",
        "zh": "启动前设置 export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    },
    explanation={
        "en": """\
## What it does
Replays the run's allocations (load, prefill, decode; ZeRO-3's gathers and releases) through a model of
PyTorch's CUDA caching allocator and compares the reserved peak, the real OOM line, with the allocated
peak (`torch.cuda.max_memory_allocated`). Fires when reserved exceeds allocated by more than 15%.

## Why is this bad?
An OOM happens when the allocator cannot reserve more, not when live tensors fill the GPU. ZeRO-3
allocates and frees every gathered parameter each forward while the KV cache and activations, which live
longer, land in the freed holes; the next large gather finds no hole large enough and a new segment is
reserved. Measured on one H200: Qwen2.5-7B shape, zero3-offload, batch 2, prompt 1024: allocated 2.96 GiB,
reserved 5.05 GiB, 4.19 GiB with expandable segments.

## Example
`zero_optimization.offload_param.device = "cpu"` with batch 4 and 1024-token prompts on a 7B model.

## Use instead
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: a pool becomes one segment that grows by 2 MiB pages,
so a new request extends the free block at its end instead of taking a new segment.
""",
        "zh": """\
## 作用
用 PyTorch CUDA 缓存分配器的模型重放这次运行的分配（加载、prefill、decode，以及 ZeRO-3 的收集和释放），
比较 reserved 峰值（真正的 OOM 线）和 allocated 峰值（`torch.cuda.max_memory_allocated`）。reserved 比
allocated 多 15% 以上时报告。

## 为什么不好？
OOM 发生在分配器无法再保留显存时，而不是活跃张量占满 GPU 时。ZeRO-3 每次前向都分配并释放每个收集来的参数，
而寿命更长的 KV cache 和激活落进释放出的空洞；下一次大的收集找不到足够大的空洞，只好再保留一个新段。
在一张 H200 上实测：Qwen2.5-7B 形状、zero3-offload、batch 2、prompt 1024：allocated 2.96 GiB，reserved
5.05 GiB，开启 expandable segments 后 4.19 GiB。

## 示例
7B 模型，`zero_optimization.offload_param.device = "cpu"`，batch 4，1024 token 的 prompt。

## 应该这样
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`：每个池成为一个按 2 MiB 页增长的段，新请求可以扩展段尾的
空闲块，而不必占用新段。
""",
    },
)

PROFILE_OTHER_MACHINE = rule(
    "DSD221", "machine-profile-other-machine", "warning",
    message={
        "en": "the machine profile {source} was calibrated on another machine ({profile_machine}, {date}); "
              "this one is {this_machine}",
        "zh": "机器指标文件 {source} 是在另一台机器上校准的（{profile_machine}，{date}）；本机是 {this_machine}",
    },
    fix={
        "en": "run dsdoctor calibrate on this machine, or pass --machine only for planning another machine",
        "zh": "在本机运行 dsdoctor calibrate；只有在为另一台机器做计划时才用 --machine",
    },
    explanation={
        "en": """\
## What it does
Compares the hardware fingerprint of a profile given with `--machine` with the machine plan runs on.

## Why is this bad?
Speeds and the CUDA context size are figures of the machine that measured them: host-to-device
bandwidth, the host CPU's eager overhead per layer and ZeRO-3's hook cost differ between hosts by
factors. A plan for this machine from another machine's figures recommends the wrong path.

## Example
`dsdoctor plan --model ./m --machine h200.json` on an A100 host.

## Use instead
`dsdoctor calibrate` on the machine that will run the job; plan picks the profile up by itself.
""",
        "zh": """\
## 作用
比较 `--machine` 给出的指标文件的硬件指纹与运行 plan 的机器。

## 为什么不好？
速度和 CUDA context 大小是测量它们的那台机器的指标：主机到设备带宽、主机 CPU 每层的 eager 开销、
ZeRO-3 钩子开销在不同主机间可差数倍。用另一台机器的指标为本机做计划，会推荐错误的方式。

## 示例
在 A100 主机上运行 `dsdoctor plan --model ./m --machine h200.json`。

## 应该这样
在实际运行任务的机器上执行 `dsdoctor calibrate`；plan 会自动使用它。
""",
    },
)

AB_ATTRIBUTION = rule(
    "DSD345", "ab-peak-attribution", "info",
    message={"en": "generate peak by part (plan's breakdown for the same shape): {lines}",
             "zh": "生成峰值按部分拆分（同形状下 plan 的拆分）：{lines_zh}"},
    fix={"en": "the largest part is what to shrink; an unexplained remainder is memory plan does not model",
         "zh": "最大的部分就是要缩减的对象；未解释的余量是 plan 没有建模的内存"},
    explanation={
        "en": """\
## What it does
Splits each ab variant's measured generate peak into resident weights, gathered/prefetched parameters,
KV cache, activations and logits, using plan's model for the model config, batch, prompt and new tokens
the trace recorded, and states what plan does not explain as a remainder.

## Why is this bad?
A peak is one number; the fix depends on which part it is made of.

## Example
as-is (zero3-offload): 5.1 GiB = gathered/prefetched params 2.1 GiB + KV cache 1.2 GiB + ...

## Use instead
Shrink the largest part: prefetch knobs for gathered params, batch or new tokens for the KV cache.
""",
        "zh": """\
## 作用
用 plan 的模型（按 trace 记录的模型配置、batch、prompt 和新 token 数）把每个 ab 变体实测的生成峰值拆成常驻权重、
收集/预取的参数、KV cache、激活和 logits，plan 解释不了的部分作为余量列出。

## 为什么不好？
峰值只是一个数；怎么修取决于它由哪部分构成。

## 示例
as-is（zero3-offload）：5.1 GiB = 收集/预取的参数 2.1 GiB + KV cache 1.2 GiB + ……

## 应该这样
缩减最大的部分：收集的参数调预取参数，KV cache 调 batch 或新 token 数。
""",
    },
)

AB_VERDICT = rule(
    "DSD346", "ab-verdict", "warning",
    message={"en": "{verdict}", "zh": "{verdict_zh}"},
    fix={"en": "{advice}", "zh": "{advice_zh}"},
    explanation={
        "en": """\
## What it does
Reads the ab variants side by side with the attribution (DSD345): a generate peak lower without
offload_param means the parameter gather dominates; a peak made mostly of KV cache, activations and
logits means the output buffers dominate; tokens/s or host memory collapsing with offload means the
host-to-device copy is the bottleneck, with this machine's measured bandwidth (a calibrate profile) and
what pin_memory changed when that variant ran.

## Why is this bad?
Each cause has a different fix; tuning prefetch does nothing for a KV-cache-bound peak.

## Example
`dsdoctor ab --variants as-is,no-offload-param,pin-memory-off -- deepspeed --num_gpus 2 infer.py`

## Use instead
The advice in the finding.
""",
        "zh": """\
## 作用
结合拆分（DSD345）并排比较 ab 各变体：去掉 offload_param 后生成峰值更低，说明参数收集占主导；峰值主要由
KV cache、激活和 logits 构成，说明输出缓冲占主导；开启卸载后 tokens/s 或主机内存崩塌，说明主机到设备拷贝是
瓶颈，并给出本机实测带宽（calibrate 的指标文件）以及 pin_memory 变体的效果。

## 为什么不好？
每种原因的修法不同；KV cache 造成的峰值，调预取参数毫无作用。

## 示例
`dsdoctor ab --variants as-is,no-offload-param,pin-memory-off -- deepspeed --num_gpus 2 infer.py`

## 应该这样
按发现中的建议处理。
""",
    },
)
