"""DSD1xx: what is wrong with a DeepSpeed config for inference. Texts in English and Chinese.

Other packages reuse these codes when they observe the same problem at run time (e.g. trace sees an
optimizer built at inference: DSD101)."""
from __future__ import annotations

from dsdoctor.findings import explanation, rule

rule(
    "DSD101", "optimizer-in-inference", "error",
    message={
        "en": "optimizer section ({optimizer}) in an inference config: deepspeed.initialize builds a ZeRO optimizer "
              "that costs {cost}",
        "zh": "推理配置中含有 optimizer 段（{optimizer}）：deepspeed.initialize 会构建 ZeRO 优化器，代价为{cost}",
    },
    phrases={  # the cost, as config check estimates it or trace measures it
        "host": {"en": "about {amount} of extra pinned host memory per rank", "zh": "每个 rank 约多占 {amount} 锁页主机内存"},
        "gpu": {"en": "about {amount} of extra GPU memory per rank", "zh": "每个 rank 约多占 {amount} 显存"},
        "per-shard-param": {"en": "about {bytes} B of pinned host memory per parameter of each rank's shard",
                            "zh": "每个 rank 的参数分片每个参数约 {bytes} 字节锁页主机内存"},
        "master-on-gpu": {"en": "fp32 master weights and gradient partitions on every GPU",
                          "zh": "每张 GPU 上的 fp32 主权重和梯度分区"},
        "with-bucket": {"en": "{cost} + a {bucket} GPU reduce bucket (world size {world})",
                        "zh": "{cost}，外加 {bucket} 的 GPU reduce bucket（world size {world}）"},
        "measured": {"en": "{amount} per rank, measured at initialize", "zh": "每个 rank {amount}（在 initialize 时实测）"},
        "partitions": {"en": "its fp32 partitions and buckets", "zh": "其 fp32 分区和各类 bucket"},
    },
    fix={
        "en": "Delete the optimizer and scheduler sections: dsdoctor split {config} -o ds_infer.json",
        "zh": "删除 optimizer 和 scheduler 段：dsdoctor split {config} -o ds_infer.json",
    },
    explanation=explanation(
        en=(
            """\
Flags an `optimizer` section in a config used for inference.
""",
            """\
`deepspeed.initialize` builds an optimizer whenever the config has an `optimizer` section. With ZeRO-3
that is `DeepSpeedZeroOptimizer_Stage3`: fp32 master copies of the weights (on the CPU with
offload_optimizer), a flat fp32 gradient partition and a GPU reduce bucket of `reduce_bucket_size`
elements (default 5e8). Measured on 2 x H200 with a 1.35B model: about 17 bytes of pinned host memory per
parameter of each rank's shard (8.5 GB per billion parameters per rank with 2 ranks) and a 3.7x slower
initialize. Inference never calls `step()`: all of it is waste, and for a 70B model
it is the difference between running and an OOM.
""",
            """\
{"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
 "zero_optimization": {"stage": 3}}
""",
            """\
{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
Without an optimizer, stage 3 gives `DeepSpeedZeRoOffload` (ZeRO-Inference). `dsdoctor split` writes it.
""",
        ),
        zh=(
            """\
检查用于推理的配置中是否含有 `optimizer` 段。
""",
            """\
只要配置里有 `optimizer` 段，`deepspeed.initialize` 就会构建优化器。ZeRO-3 下是
`DeepSpeedZeroOptimizer_Stage3`：权重的 fp32 主副本（开启 offload_optimizer 时在 CPU 上）、扁平的 fp32
梯度分区，以及 `reduce_bucket_size` 个元素的 GPU reduce bucket（默认 5e8）。
在 2 张 H200 上用 1.35B 模型实测：每个 rank 的参数分片每个参数约多占 17 字节锁页主机内存（2 个 rank 时每 10 亿参数每 rank
约 8.5 GB），initialize 慢 3.7 倍。推理从不调用 `step()`，这些全是浪费；
对 70B 模型来说，这就是能跑和 OOM 的区别。
""",
            """\
{"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
 "zero_optimization": {"stage": 3}}
""",
            """\
{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
没有优化器时，stage 3 得到 `DeepSpeedZeRoOffload`（ZeRO-Inference）。`dsdoctor split` 会生成它。
""",
        ),
    ),
)

rule(
    "DSD102", "offload-optimizer-in-inference", "warning",
    message={
        "en": "zero_optimization.offload_optimizer.device = {device} in an inference config: inference has no "
              "optimizer step, yet {master} of fp32 master weights per node go to {device}",
        "zh": "推理配置中 zero_optimization.offload_optimizer.device = {device}：推理没有优化器更新，"
              "却仍有每节点 {master} 的 fp32 主权重被卸载到 {device}",
    },
    fix={
        "en": "Delete zero_optimization.offload_optimizer (keep offload_param if you need to save GPU memory)",
        "zh": "删除 zero_optimization.offload_optimizer（如需节省显存，保留 offload_param）",
    },
    explanation=explanation(
        en=(
            """\
Flags `zero_optimization.offload_optimizer` with a device other than "none" in an inference config.
""",
            """\
offload_optimizer moves the optimizer's fp32 state and its step to the CPU (or NVMe). Together with an
optimizer section it makes DeepSpeed allocate fp32 master weights in host memory, pinned by default
(about 4 bytes per parameter per node before Adam's moments, plus buffers). It does nothing to lower the
GPU memory of a forward pass: that is `offload_param`'s job. People copy it from ZeRO-3 offload training
configs and pay for it in host RAM and start-up time.
""",
            """\
"zero_optimization": {"stage": 3,
  "offload_optimizer": {"device": "cpu", "pin_memory": true},
  "offload_param": {"device": "cpu", "pin_memory": true}}
""",
            """\
"zero_optimization": {"stage": 3,
  "offload_param": {"device": "cpu", "pin_memory": true}}
""",
        ),
        zh=(
            """\
检查推理配置中 device 不为 "none" 的 `zero_optimization.offload_optimizer`。
""",
            """\
offload_optimizer 把优化器的 fp32 状态及其更新计算移到 CPU（或 NVMe）。配合 optimizer 段，DeepSpeed
会在主机内存中分配 fp32 主权重，默认还是锁页内存（在 Adam 动量之外每个参数约 4 字节，另加缓冲区）。
它完全不能降低前向计算的显存，那是 `offload_param` 的作用。这个键常从 ZeRO-3 offload 训练配置照抄过来，
代价是主机内存和启动时间。
""",
            """\
"zero_optimization": {"stage": 3,
  "offload_optimizer": {"device": "cpu", "pin_memory": true},
  "offload_param": {"device": "cpu", "pin_memory": true}}
""",
            """\
"zero_optimization": {"stage": 3,
  "offload_param": {"device": "cpu", "pin_memory": true}}
""",
        ),
    ),
)

rule(
    "DSD103", "zero3-with-tensor-parallel", "warning",
    message={
        "en": "ZeRO stage {stage} combined with tensor parallelism ({source} = {tp_size}): every forward still "
              "all-gathers each layer on top of the tensor-parallel split{version_note}",
        "zh": "ZeRO stage {stage} 与张量并行（{source} = {tp_size}）同时使用：在张量并行切分之外，"
              "每次前向仍要 all-gather 每一层{version_note}",
    },
    phrases={  # what the DeepSpeed version in use does with AutoTP + ZeRO-3 (empty for other TP spellings)
        "none": {"en": "", "zh": ""},
        "accepts": {"en": "; DeepSpeed {version} accepts AutoTP with ZeRO-3 (since 0.19.4), so this runs, slowly",
                    "zh": "；DeepSpeed {version} 接受 AutoTP 与 ZeRO-3 同用（0.19.4 起），能运行但很慢"},
        "refuses": {"en": "; DeepSpeed {version} refuses AutoTP with ZeRO-3 (accepted from 0.19.4, see DSD130)",
                    "zh": "；DeepSpeed {version} 拒绝 AutoTP 与 ZeRO-3 同用（0.19.4 起才接受，见 DSD130）"},
        "not-installed": {"en": "; DeepSpeed is not installed here: 0.19.4 and later accept AutoTP with ZeRO-3, "
                                "older releases refuse it",
                          "zh": "；此处未安装 DeepSpeed：0.19.4 及以后接受 AutoTP 与 ZeRO-3 同用，更早的版本会拒绝"},
    },
    fix={
        "en": "Pick one path: tensor parallelism (deepspeed.init_inference with tensor_parallel.tp_size, no "
              "zero_optimization) when the split model fits the GPUs, else ZeRO-3 (with offload_param) without TP",
        "zh": "二选一：模型切分后放得下时用张量并行（deepspeed.init_inference + tensor_parallel.tp_size，"
              "不带 zero_optimization），否则用不带张量并行的 ZeRO-3（可加 offload_param）",
    },
    explanation=explanation(
        en=(
            """\
Flags ZeRO stage 3 together with a tensor-parallel degree above 1 (`mp_size`,
`tensor_parallel.tp_size`, `tensor_parallel.autotp_size`, or `--tp`).
""",
            """\
Tensor parallelism splits each weight across GPUs and keeps the pieces resident; ZeRO-3 partitions
weights and gathers every layer before each use. Combined, each rank still gathers its TP shard of every
layer on every forward (one token at a time during generation), so you pay ZeRO-3's communication and
TP's collectives together. `init_inference` ignores a `zero` section altogether, and AutoTP inside
`deepspeed.initialize` with ZeRO-3 is a training path. For inference choose the one that fits.
""",
            """\
{"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}}
""",
            """\
deepspeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.bfloat16)
or {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}} without TP.
""",
        ),
        zh=(
            """\
检查 ZeRO stage 3 与大于 1 的张量并行度（`mp_size`、`tensor_parallel.tp_size`、
`tensor_parallel.autotp_size` 或 `--tp`）同时出现。
""",
            """\
张量并行把每个权重切到多张 GPU 上并常驻；ZeRO-3 把权重分片，每次使用前 gather 整层。两者叠加时，
每次前向（生成时每个 token 一次）每个 rank 仍要 gather 自己那份张量并行分片，ZeRO-3 的通信和张量并行的
集合通信都要付出。`init_inference` 完全忽略 `zero` 段，而 `deepspeed.initialize` 里的 AutoTP + ZeRO-3
是训练路径。推理时请选其一。
""",
            """\
{"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}}
""",
            """\
deepspeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.bfloat16)
或不带张量并行的 {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
""",
        ),
    ),
)

rule(
    "DSD104", "zero-config-for-init-inference", "error",
    message={
        "en": "config mixes init_inference keys ({inference_keys}) with deepspeed.initialize keys ({other_keys}): "
              "DeepSpeedInferenceConfig forbids extra keys and raises a ValidationError",
        "zh": "配置混用了 init_inference 的键（{inference_keys}）和 deepspeed.initialize 的键（{other_keys}）："
              "DeepSpeedInferenceConfig 禁止多余的键，会抛出 ValidationError",
    },
    fix={
        "en": "Give init_inference only its own keys (tensor_parallel, dtype, replace_with_kernel_inject, ...); "
              "use zero_optimization only with deepspeed.initialize",
        "zh": "init_inference 只传它自己的键（tensor_parallel、dtype、replace_with_kernel_inject 等）；"
              "zero_optimization 只用于 deepspeed.initialize",
    },
    explanation=explanation(
        en=(
            """\
Flags a config that carries `deepspeed.init_inference` keys (mp_size, tensor_parallel.tp_size,
replace_with_kernel_inject, dtype, ...) together with keys only `deepspeed.initialize` understands
(zero_optimization, train_batch_size, optimizer, fp16, ...).
""",
            """\
`DeepSpeedInferenceConfig` is a pydantic model with extra="forbid": passing a training config to
`init_inference` raises a ValidationError. Its `zero` field exists, but nothing in the inference engine
uses it, so ZeRO settings never take effect on that path. And `deepspeed.initialize` silently ignores
the init_inference keys. Whichever function gets this config, half of it is wrong.
""",
            """\
{"mp_size": 2, "dtype": "bf16", "zero_optimization": {"stage": 3}, "train_batch_size": 8}
""",
            """\
deepspeed.init_inference(model, config={"tensor_parallel": {"tp_size": 2}, "dtype": "bf16"})
or deepspeed.initialize(model=model, config={"zero_optimization": {"stage": 3},
                                             "train_micro_batch_size_per_gpu": 1})
""",
        ),
        zh=(
            """\
检查同时含有 `deepspeed.init_inference` 的键（mp_size、tensor_parallel.tp_size、
replace_with_kernel_inject、dtype 等）和只有 `deepspeed.initialize` 才认识的键（zero_optimization、
train_batch_size、optimizer、fp16 等）的配置。
""",
            """\
`DeepSpeedInferenceConfig` 是 extra="forbid" 的 pydantic 模型：把训练配置传给 `init_inference` 会抛出
ValidationError。它虽有 `zero` 字段，但推理引擎从不使用，ZeRO 设置在这条路径上不会生效。而
`deepspeed.initialize` 会静默忽略 init_inference 的键。无论传给哪个函数，总有一半配置是错的。
""",
            """\
{"mp_size": 2, "dtype": "bf16", "zero_optimization": {"stage": 3}, "train_batch_size": 8}
""",
            """\
deepspeed.init_inference(model, config={"tensor_parallel": {"tp_size": 2}, "dtype": "bf16"})
或 deepspeed.initialize(model=model, config={"zero_optimization": {"stage": 3},
                                             "train_micro_batch_size_per_gpu": 1})
""",
        ),
    ),
)

rule(
    "DSD105", "unfilled-auto", "warning",
    message={
        "en": "{count} \"auto\" value(s) that nothing fills outside the HF Trainer/accelerate: {summary}",
        "zh": "{count} 个 \"auto\" 值在 HF Trainer/accelerate 之外无人填充：{summary}",
    },
    fix={
        "en": "Replace every \"auto\" with a number or true/false: dsdoctor split {config} -o ds_infer.json "
              "--model MODEL_DIR resolves them",
        "zh": "把每个 \"auto\" 换成具体数值或 true/false：dsdoctor split {config} -o ds_infer.json "
              "--model MODEL_DIR 会自动填好",
    },
    explanation=explanation(
        en=(
            """\
Lists "auto" values in a config used outside the HF Trainer / accelerate, and what each becomes.
""",
            """\
Only the HF Trainer and accelerate replace "auto" (from TrainingArguments and the model's hidden size);
plain `deepspeed.initialize` and `HfDeepSpeedConfig` do not. Inside DeepSpeed's pydantic sections an
"auto" is dropped before validation, so the default wins silently: `"stage": "auto"` is stage 0 (no
sharding at all), `"enabled": "auto"` is off (fp32 weights: twice the memory of bf16), `"device": "auto"`
is no offload. In top-level numbers (train_batch_size, gradient_clipping) and optimizer params "auto" is
passed through and crashes later with a TypeError. Marked `-> TypeError` in the message. Even accelerate
fills the batch size only from a dataloader: `accelerator.prepare(model)` for inference, with no
dataloader, raises a ValueError while `train_micro_batch_size_per_gpu` is "auto".
""",
            """\
{"bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
 "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}
""",
            """\
{"bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": 1,
 "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 15099494}}
""",
        ),
        zh=(
            """\
列出在 HF Trainer / accelerate 之外使用的配置里的 "auto" 值，以及它们实际变成什么。
""",
            """\
只有 HF Trainer 和 accelerate 会替换 "auto"（依据 TrainingArguments 和模型的 hidden size）；
直接调用 `deepspeed.initialize` 或 `HfDeepSpeedConfig` 都不会。在 DeepSpeed 的 pydantic 配置段里，
"auto" 会在校验前被丢弃，于是默认值悄悄生效：`"stage": "auto"` 就是 stage 0（完全不分片），
`"enabled": "auto"` 就是关闭（fp32 权重，显存是 bf16 的两倍），`"device": "auto"` 就是不卸载。
顶层数值（train_batch_size、gradient_clipping）和优化器参数里的 "auto" 会原样传下去，随后以 TypeError
崩溃，消息中标为 `-> TypeError`。即便是 accelerate，也只会从 dataloader 推出批大小：推理时不传 dataloader
调用 `accelerator.prepare(model)`，只要 `train_micro_batch_size_per_gpu` 还是 "auto" 就会抛出 ValueError。
""",
            """\
{"bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
 "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}
""",
            """\
{"bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": 1,
 "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 15099494}}
""",
        ),
    ),
)

rule(
    "DSD106", "offload-param-below-stage3", "warning",
    message={
        "en": "zero_optimization.offload_param.device = {device} with ZeRO stage {stage}: DeepSpeed ignores "
              "offload_param below stage 3, so no parameter leaves the GPU",
        "zh": "ZeRO stage {stage} 下设置了 zero_optimization.offload_param.device = {device}："
              "stage 3 以下 DeepSpeed 忽略 offload_param，参数不会离开 GPU",
    },
    fix={
        "en": "Set zero_optimization.stage to 3 to offload parameters, or delete offload_param",
        "zh": "要卸载参数请把 zero_optimization.stage 设为 3，否则删除 offload_param",
    },
    explanation=explanation(
        en=(
            """\
Flags `offload_param` with a device in a config whose ZeRO stage is below 3.
""",
            """\
Only ZeRO-3 partitions parameters, so only ZeRO-3 can offload them. At stage 0-2 every rank keeps the
whole model on its GPU and `offload_param` is silently ignored: you believe the weights live in CPU
memory while the GPU runs out.
""",
            """\
"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}
""",
            """\
"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}
""",
        ),
        zh=(
            """\
检查 ZeRO stage 低于 3 却设置了 `offload_param` 设备的配置。
""",
            """\
只有 ZeRO-3 对参数分片，也只有 ZeRO-3 能卸载参数。stage 0-2 时每个 rank 都在 GPU 上保留完整模型，
`offload_param` 被静默忽略：你以为权重在 CPU 内存里，GPU 却已经爆了。
""",
            """\
"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}
""",
            """\
"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}
""",
        ),
    ),
)

rule(
    "DSD107", "pinned-host-memory", "info",
    message={
        "en": "offload_param to {device} with pin_memory (the default) page-locks {pinned} of host memory "
              "on each node; it cannot be swapped and counts against ulimit -l and container limits",
        "zh": "offload_param 卸载到 {device} 且开启 pin_memory（默认开启），每个节点锁定 {pinned} 主机内存；"
              "锁页内存不能换出，受 ulimit -l 和容器内存上限约束",
    },
    fix={
        "en": "Keep pin_memory if the host has that much free RAM (pinned transfers are several times faster); "
              "set zero_optimization.offload_param.pin_memory to false only when host memory is tight",
        "zh": "主机空闲内存足够时保留 pin_memory（锁页传输快数倍）；只有主机内存紧张时才把 "
              "zero_optimization.offload_param.pin_memory 设为 false",
    },
    explanation=explanation(
        en=(
            """\
Reports how much page-locked (pinned) host memory `offload_param` with `pin_memory` asks for.
""",
            """\
It is not bad by itself: pinned memory is what makes GPU<->CPU transfers fast and overlapped, and
`pin_memory` defaults to true in DeepSpeed 0.19. But every rank pins its partition of the weights, so a
node pins the whole model (for NVMe: the swap buffers), and pinned pages cannot be swapped out. On hosts
with tight memlock limits, in containers, or next to a data loader, allocation fails or the OOM killer
fires. Unpinned offload works but was several times slower in our measurements.
""",
            """\
"offload_param": {"device": "cpu"}          (pin_memory defaults to true)
""",
            """\
"offload_param": {"device": "cpu", "pin_memory": true}    when the host has the RAM
"offload_param": {"device": "cpu", "pin_memory": false}   only when it does not
""",
        ),
        zh=(
            """\
报告 `offload_param` 开启 `pin_memory` 时需要多少锁页（pinned）主机内存。
""",
            """\
它本身不是错误：锁页内存让 GPU<->CPU 传输更快、可与计算重叠，DeepSpeed 0.19 中 `pin_memory` 默认为
true。但每个 rank 都会锁定自己那份权重分片，一个节点合计锁定整个模型（NVMe 时是交换缓冲区），
且锁页内存不能换出。在 memlock 上限很低的主机、容器中，或与数据加载器争内存时，分配会失败或触发
OOM killer。不锁页也能运行，但我们实测慢数倍。
""",
            """\
"offload_param": {"device": "cpu"}          （pin_memory 默认为 true）
""",
            """\
"offload_param": {"device": "cpu", "pin_memory": true}    主机内存足够时
"offload_param": {"device": "cpu", "pin_memory": false}   仅在不够时
""",
        ),
    ),
)

rule(
    "DSD108", "nvme-without-path", "error",
    message={
        "en": "zero_optimization.{section}.device = nvme but nvme_path is not set: DeepSpeed fails when it "
              "creates the swap files",
        "zh": "zero_optimization.{section}.device = nvme 但未设置 nvme_path：DeepSpeed 创建交换文件时会失败",
    },
    fix={
        "en": "Set zero_optimization.{section}.nvme_path to a directory on a local NVMe drive",
        "zh": "把 zero_optimization.{section}.nvme_path 设为本地 NVMe 盘上的目录",
    },
    explanation=explanation(
        en=(
            """\
Flags NVMe offload (ZeRO-Infinity) without `nvme_path`.
""",
            """\
With device "nvme" DeepSpeed swaps tensors to files under `nvme_path`. The default is null, so the
swapper has nowhere to write and initialization fails after the model has been partially built.
""",
            """\
"offload_param": {"device": "nvme"}
""",
            """\
"offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true}
""",
        ),
        zh=(
            """\
检查未设置 `nvme_path` 的 NVMe 卸载（ZeRO-Infinity）。
""",
            """\
device 为 "nvme" 时，DeepSpeed 把张量交换到 `nvme_path` 下的文件。默认值为 null，交换器无处可写，
初始化会在模型部分构建之后失败。
""",
            """\
"offload_param": {"device": "nvme"}
""",
            """\
"offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true}
""",
        ),
    ),
)

rule(
    "DSD109", "stage3-knob-raises-peak", "warning",
    message={
        "en": "zero_optimization.{knob} = {value} (DeepSpeed default {default}) raises the per-GPU peak at "
              "inference: up to {bytes} of weights held on every GPU",
        "zh": "zero_optimization.{knob} = {value}（DeepSpeed 默认 {default}）抬高推理时的单卡峰值："
              "每张 GPU 最多驻留 {bytes} 权重",
    },
    fix={
        "en": "Lower zero_optimization.{knob} (or delete it to get DeepSpeed's default {default})",
        "zh": "调小 zero_optimization.{knob}（或删除它以使用 DeepSpeed 默认值 {default}）",
    },
    explanation=explanation(
        en=(
            """\
Flags ZeRO-3 knobs set above DeepSpeed's defaults that raise the per-GPU peak at inference:
`stage3_prefetch_bucket_size` (elements fetched ahead of use), `stage3_max_live_parameters` (gathered
elements kept alive) and `stage3_param_persistence_threshold` (parameters smaller than this are never
partitioned and stay whole on every GPU).
""",
            """\
Training configs raise these to hide communication behind a long backward pass. At inference there is
no backward to hide behind: the extra gathered weights only raise the peak, and with a high persistence
threshold ZeRO-3 stops sharding much of the model at all. With `--model`, dsdoctor converts them to
bytes for your model.
""",
            """\
"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e9,
                      "stage3_prefetch_bucket_size": 5e9}
""",
            """\
"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e5,
                      "stage3_prefetch_bucket_size": 5e7}
""",
        ),
        zh=(
            """\
检查设得高于 DeepSpeed 默认值、会抬高推理时单卡峰值的 ZeRO-3 参数：`stage3_prefetch_bucket_size`
（提前拉取的元素数）、`stage3_max_live_parameters`（保持已 gather 的元素数）和
`stage3_param_persistence_threshold`（小于该值的参数不分片，在每张 GPU 上常驻完整副本）。
""",
            """\
训练配置调大它们，是为了把通信藏在漫长的反向传播后面。推理没有反向传播可藏：多 gather 的权重只会
抬高峰值；持久化阈值过高时，ZeRO-3 干脆不再对模型的大部分分片。给出 `--model` 时，dsdoctor
会按你的模型换算成字节。
""",
            """\
"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e9,
                      "stage3_prefetch_bucket_size": 5e9}
""",
            """\
"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e5,
                      "stage3_prefetch_bucket_size": 5e7}
""",
        ),
    ),
)

rule(
    "DSD110", "fp16-for-bf16-model", "error",
    message={
        "en": "fp16 is enabled ({source}) but the model's weights are {model_dtype}: values beyond fp16's range "
              "overflow to inf/NaN and generation produces garbage",
        "zh": "启用了 fp16（{source}），但模型权重是 {model_dtype}：超出 fp16 范围的数值会溢出为 inf/NaN，"
              "生成结果是乱码",
    },
    fix={
        "en": "Set fp16.enabled to false and bf16.enabled to true",
        "zh": "把 fp16.enabled 设为 false，bf16.enabled 设为 true",
    },
    explanation=explanation(
        en=(
            """\
Flags fp16 enabled in the config for a model whose checkpoint is bf16 (config.json `torch_dtype`).
""",
            """\
bf16 has fp32's exponent range; fp16 tops out at 65504. Models trained in bf16 (Llama 2/3, Mistral,
Qwen2, ...) have activations that exceed fp16's range, so a cast to fp16 gives inf/NaN logits or
quietly worse text. DeepSpeed casts the module to fp16 when `fp16.enabled` is true.
""",
            """\
{"fp16": {"enabled": true}}     with a config.json saying "torch_dtype": "bfloat16\"
""",
            """\
{"bf16": {"enabled": true}}
""",
        ),
        zh=(
            """\
检查模型检查点为 bf16（config.json 中的 `torch_dtype`）时，配置却启用了 fp16。
""",
            """\
bf16 的指数范围与 fp32 相同；fp16 最大只到 65504。以 bf16 训练的模型（Llama 2/3、Mistral、Qwen2 等）
的激活值会超出 fp16 范围，转成 fp16 会得到 inf/NaN 的 logits，或悄悄变差的文本。`fp16.enabled` 为
true 时 DeepSpeed 会把模块转换为 fp16。
""",
            """\
{"fp16": {"enabled": true}}     而 config.json 中是 "torch_dtype": "bfloat16\"
""",
            """\
{"bf16": {"enabled": true}}
""",
        ),
    ),
)

rule(
    "DSD111", "zero3-single-gpu-without-offload", "warning",
    message={
        "en": "ZeRO-3 on {gpus} GPU without offload_param: there is no other rank to shard with, so the GPU "
              "holds every weight and ZeRO-3 only adds gather overhead",
        "zh": "在 {gpus} 张 GPU 上使用 ZeRO-3 且未开启 offload_param：没有其他 rank 可以分片，GPU 仍保存全部权重，"
              "ZeRO-3 只增加 gather 开销",
    },
    fix={
        "en": "Load the model without DeepSpeed (model.to('cuda')), or set zero_optimization.offload_param.device "
              "to cpu if it does not fit",
        "zh": "不用 DeepSpeed 直接加载（model.to('cuda')）；如果放不下，把 zero_optimization.offload_param.device "
              "设为 cpu",
    },
    explanation=explanation(
        en=(
            """\
Flags ZeRO stage 3 on a single GPU with no parameter offload.
""",
            """\
ZeRO-3 saves memory by splitting weights across ranks. With one rank the "partition" is the whole
model, so peak GPU memory is the same as a plain load, while every forward still runs ZeRO-3's
gather/release hooks. Measured on one H200 with a 7B-shaped Llama: a plain load was several times
faster at the same peak. ZeRO-3 on one GPU only pays off with offload_param (weights in CPU memory,
streamed per layer).
""",
            """\
deepspeed --num_gpus 1 infer.py   with "zero_optimization": {"stage": 3}
""",
            """\
model.to("cuda") without DeepSpeed, or
"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true}}
""",
        ),
        zh=(
            """\
检查单张 GPU 上未开启参数卸载的 ZeRO stage 3。
""",
            """\
ZeRO-3 靠把权重切分到多个 rank 来省显存。只有一个 rank 时，"分片"就是整个模型，显存峰值与直接加载
相同，而每次前向仍要执行 ZeRO-3 的 gather/release 钩子。在一张 H200 上用 7B 规模的 Llama 实测：
直接加载在同样峰值下快数倍。单卡 ZeRO-3 只有配合 offload_param（权重放 CPU 内存、逐层传输）才划算。
""",
            """\
deepspeed --num_gpus 1 infer.py   配合 "zero_optimization": {"stage": 3}
""",
            """\
不用 DeepSpeed，直接 model.to("cuda")，或
"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true}}
""",
        ),
    ),
)

rule(
    "DSD112", "training-only-keys", "info",
    message={
        "en": "{count} training-only key(s) have no effect at inference: {keys}",
        "zh": "{count} 个仅用于训练的键在推理时不起作用：{keys}",
    },
    fix={
        "en": "Remove them: dsdoctor split {config} -o ds_infer.json",
        "zh": "删除它们：dsdoctor split {config} -o ds_infer.json",
    },
    explanation=explanation(
        en=(
            """\
Lists keys that only matter for training (gradient accumulation and clipping, loss scaling, gradient
buckets, activation checkpointing, save-time gathering, ...).
""",
            """\
They do no harm by themselves, but they show the config was written for training, hide the few keys
that matter at inference, and some ("auto" batch sizes, gradient_clipping) crash outside the HF
Trainer. `dsdoctor split` removes them and prints the reason for each.
""",
            """\
"gradient_accumulation_steps": 8, "gradient_clipping": 1.0,
"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}
""",
            """\
"fp16": {"enabled": true}, "train_micro_batch_size_per_gpu": 1
""",
        ),
        zh=(
            """\
列出只对训练有意义的键（梯度累积与裁剪、loss scaling、梯度 bucket、激活检查点、保存时 gather 等）。
""",
            """\
它们本身无害，但说明这个配置是为训练写的，会掩盖推理时真正重要的几个键，而且其中一些（"auto" 批大小、
gradient_clipping）在 HF Trainer 之外会崩溃。`dsdoctor split` 会删除它们并逐条给出原因。
""",
            """\
"gradient_accumulation_steps": 8, "gradient_clipping": 1.0,
"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}
""",
            """\
"fp16": {"enabled": true}, "train_micro_batch_size_per_gpu": 1
""",
        ),
    ),
)

rule(
    "DSD113", "referenced-config-missing", "warning",
    message={
        "en": "the DeepSpeed config this YAML names ({ref}) does not exist: only the YAML's own keys were checked",
        "zh": "此 YAML 引用的 DeepSpeed 配置（{ref}）不存在：只检查了 YAML 自身的键",
    },
    fix={
        "en": "Run dsdoctor check on the DeepSpeed JSON itself, or fix the path in the YAML",
        "zh": "直接对 DeepSpeed JSON 运行 dsdoctor check，或修正 YAML 中的路径",
    },
    explanation=explanation(
        en=(
            """\
Flags an accelerate YAML (`deepspeed_config_file`) or a trainer YAML (axolotl, LLaMA-Factory:
`deepspeed:`) whose DeepSpeed config file cannot be found.
""",
            """\
All the settings that matter live in that file. Relative paths are resolved against the working
directory at launch (dsdoctor also tries the YAML's directory), so the same YAML works from one directory
and fails from another. Nothing in it can be checked until the file is found.
""",
            """\
deepspeed: deepspeed_configs/zero3.json      (run from another directory)
""",
            """\
dsdoctor check deepspeed_configs/zero3.json, or an absolute path in the YAML.
""",
        ),
        zh=(
            """\
检查 accelerate YAML（`deepspeed_config_file`）或训练框架 YAML（axolotl、LLaMA-Factory 的
`deepspeed:`）引用的 DeepSpeed 配置文件是否找不到。
""",
            """\
真正重要的设置都在那个文件里。相对路径在启动时按当前工作目录解析（dsdoctor 也会尝试 YAML 所在目录），
所以同一个 YAML 在一个目录能用、换个目录就失败。找不到文件就什么也检查不了。
""",
            """\
deepspeed: deepspeed_configs/zero3.json      （在其他目录下运行）
""",
            """\
dsdoctor check deepspeed_configs/zero3.json，或在 YAML 中写绝对路径。
""",
        ),
    ),
)

rule(
    "DSD114", "key-rejected-by-deepspeed", "error",
    message={
        "en": "{key}: DeepSpeed rejects this key ({why})",
        "zh": "{key}：DeepSpeed 会拒绝此键（{why}）",
    },
    fix={
        "en": "Delete or correct {key}",
        "zh": "删除或改正 {key}",
    },
    explanation=explanation(
        en=(
            """\
Flags keys DeepSpeed 0.19 rejects when it parses the config: unknown or misspelled keys inside
`zero_optimization` and its `offload_*` sections (pydantic extra="forbid"), values out of range, and
top-level sections that were removed in 0.19 (nebula, amp, compression_training, ...).
""",
            """\
`deepspeed.initialize` raises before anything runs. Top-level unknown keys are ignored, so a leading
underscore "comments out" a top-level key, but inside `zero_optimization` it does not: `_offload_param`
is an unknown key there and fails validation.
""",
            """\
"zero_optimization": {"stage": 3, "_offload_param": {"device": "cpu"},
                      "stage3_max_reuse_distance": -1}
""",
            """\
"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 1e9}
""",
        ),
        zh=(
            """\
检查 DeepSpeed 0.19 解析配置时会拒绝的键：`zero_optimization` 及其 `offload_*` 段中未知或拼错的键
（pydantic extra="forbid"）、超出范围的值，以及 0.19 已移除的顶层段（nebula、amp、
compression_training 等）。
""",
            """\
`deepspeed.initialize` 在运行任何东西之前就会报错。顶层未知键会被忽略，所以加下划线可以"注释掉"
顶层键；但在 `zero_optimization` 里不行：`_offload_param` 在那里是未知键，校验会失败。
""",
            """\
"zero_optimization": {"stage": 3, "_offload_param": {"device": "cpu"},
                      "stage3_max_reuse_distance": -1}
""",
            """\
"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 1e9}
""",
        ),
    ),
)

rule(
    "DSD115", "zero-stage-1-2-for-inference", "warning",
    message={
        "en": "ZeRO stage {stage} at inference shards only optimizer state and gradients: every GPU still holds "
              "all weights, and without an optimizer deepspeed.initialize asserts \"zero stage {stage} requires "
              "an optimizer\"",
        "zh": "推理时 ZeRO stage {stage} 只对优化器状态和梯度分片：每张 GPU 仍保存全部权重；没有 optimizer 时 "
              "deepspeed.initialize 会断言失败（\"zero stage {stage} requires an optimizer\"）",
    },
    fix={
        "en": "Use stage 3 to shard weights across GPUs, or stage 0 (and no optimizer) when the model fits one GPU",
        "zh": "要把权重分片到多张 GPU 请用 stage 3；模型放得进单卡时用 stage 0（且不要 optimizer）",
    },
    explanation=explanation(
        en=(
            """\
Flags ZeRO stage 1 or 2 in a config used for inference.
""",
            """\
Stages 1 and 2 partition optimizer state (1) and gradients (2). Inference has neither, so every GPU
keeps a full copy of the weights: the same memory as no ZeRO at all. Worse, once the optimizer section
is removed (as it should be for inference), `deepspeed.initialize` fails with
`AssertionError: zero stage 2 requires an optimizer` (runtime/engine.py). Only stage 3 shards weights.
""",
            """\
{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}
""",
            """\
{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}     to shard weights
{"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 1}     when one GPU holds the model
""",
        ),
        zh=(
            """\
检查用于推理的配置中的 ZeRO stage 1 或 2。
""",
            """\
stage 1 和 2 分别对优化器状态（1）和梯度（2）分片。推理两者都没有，所以每张 GPU 仍保存完整的权重副本，
显存与不用 ZeRO 完全相同。更糟的是，一旦删掉 optimizer 段（推理本就应该删），`deepspeed.initialize`
会报 `AssertionError: zero stage 2 requires an optimizer`（runtime/engine.py）。只有 stage 3 会对权重分片。
""",
            """\
{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}
""",
            """\
{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}     对权重分片
{"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 1}     单卡放得下模型时
""",
        ),
    ),
)

rule(
    "DSD116", "no-deepspeed-keys", "warning",
    message={
        "en": "{config} has none of the keys a DeepSpeed config is made of (zero_optimization, fp16, bf16, "
              "optimizer, train_micro_batch_size_per_gpu, ...): everything above is DeepSpeed's defaults",
        "zh": "{config} 不含任何 DeepSpeed 配置的键（zero_optimization、fp16、bf16、optimizer、"
              "train_micro_batch_size_per_gpu 等）：上面显示的全是 DeepSpeed 默认值",
    },
    fix={
        "en": "Pass the DeepSpeed config file itself (the JSON given to deepspeed.initialize or --deepspeed)",
        "zh": "请传入 DeepSpeed 配置文件本身（传给 deepspeed.initialize 或 --deepspeed 的 JSON）",
    },
    explanation=explanation(
        en=(
            """\
Flags a file that parses but contains no DeepSpeed key at all: a model's config.json, a trainer YAML
without a `deepspeed:` entry, a GPT-NeoX generation config.
""",
            """\
DeepSpeed ignores unknown top-level keys, so such a file "works" and means ZeRO stage 0, fp32, no
offload. Usually the wrong file was passed, and every setting dsdoctor shows is just a default.
""",
            """\
dsdoctor check ./Llama-3-8B/config.json
""",
            """\
dsdoctor check ds_config.json
""",
        ),
        zh=(
            """\
检查能够解析、但完全不含 DeepSpeed 键的文件：模型的 config.json、没有 `deepspeed:` 项的训练框架 YAML、
GPT-NeoX 的生成配置等。
""",
            """\
DeepSpeed 会忽略未知的顶层键，所以这种文件也能"运行"，效果是 ZeRO stage 0、fp32、不卸载。通常是传错了
文件，dsdoctor 显示的每一项都只是默认值。
""",
            """\
dsdoctor check ./Llama-3-8B/config.json
""",
            """\
dsdoctor check ds_config.json
""",
        ),
    ),
)

# DSD322 is in the `scripts` range (DSD318-329) although it is a config rule: it came with issue 16 (trace on
# real scripts), whose range it uses.
rule(
    "DSD322", "stage3-prefetch-disabled", "warning",
    message={
        "en": "{knobs}: ZeRO-3 prefetches nothing, so every layer waits for its own all-gather",
        "zh": "{knobs}：ZeRO-3 不做任何预取，每一层都要等待自己的 all-gather",
    },
    fix={
        "en": "Delete {keys} (DeepSpeed's defaults prefetch {default_prefetch} elements, keep {default_live} live)",
        "zh": "删除 {keys}（DeepSpeed 默认预取 {default_prefetch} 个元素，保留 {default_live} 个活跃元素）",
    },
    explanation=explanation(
        en=(
            """\
Flags `stage3_prefetch_bucket_size` or `stage3_max_live_parameters` set to 0 under ZeRO-3.
""",
            """\
DeepSpeed's parameter coordinator (runtime/zero/partitioned_param_coordinator.py) fetches the next
layers ahead of use only while the prefetch bucket is above 0 and fewer than `max_live_parameters`
elements are gathered. At 0 nothing is fetched ahead: each layer's all-gather starts when the layer is
called and the GPU waits for it, every layer, every generated token. Memory drops a little; speed drops
a lot. Configs set 0 to save memory, or to silence an assertion in older releases.
""",
            """\
"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0,
                      "stage3_prefetch_bucket_size": 0}
""",
            """\
"zero_optimization": {"stage": 3}
(or lower values such as 1e7 to bound the prefetch without switching it off)
""",
        ),
        zh=(
            """\
检查 ZeRO-3 下被设为 0 的 `stage3_prefetch_bucket_size` 或 `stage3_max_live_parameters`。
""",
            """\
DeepSpeed 的参数协调器（runtime/zero/partitioned_param_coordinator.py）只有在预取 bucket 大于 0、且已
gather 的元素少于 `max_live_parameters` 时才会提前拉取后续层。设为 0 时不会提前拉取任何东西：每层的
all-gather 在该层被调用时才开始，GPU 只能等待，每一层、每个生成的 token 都如此。内存省得不多，速度却
慢很多。有的配置设 0 是为了省内存，或为了绕过旧版本的断言。
""",
            """\
"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0,
                      "stage3_prefetch_bucket_size": 0}
""",
            """\
"zero_optimization": {"stage": 3}
（或用 1e7 这类较小的值限制预取，而不是关掉它）
""",
        ),
    ),
)
