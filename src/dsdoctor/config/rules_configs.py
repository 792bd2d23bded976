"""DSD120-DSD139: what the runner, the mode, the init_inference schema and the installed versions make of a
config. Texts in English and Chinese."""
from __future__ import annotations

from dsdoctor.findings import explanation, rule

_LISTS = {  # several phrases joined (DSD128)
    "list1": {"en": "{p0}", "zh": "{p0}"},
    "list2": {"en": "{p0}; {p1}", "zh": "{p0}；{p1}"},
    "list3": {"en": "{p0}; {p1}; {p2}", "zh": "{p0}；{p1}；{p2}"},
}

rule(
    "DSD120", "predict-with-generate-under-zero3", "error",
    message={
        "en": "{runner}: predict_with_generate with ZeRO-3 ({mode}): {what}",
        "zh": "{runner}：ZeRO-3 下使用 predict_with_generate（{mode}）：{what}",
    },
    phrases={
        "refused": {"en": "LLaMA-Factory refuses it while parsing its arguments (\"`predict_with_generate` is "
                          "incompatible with DeepSpeed ZeRO-3.\")",
                    "zh": "LLaMA-Factory 解析参数时就会拒绝（\"`predict_with_generate` is incompatible with DeepSpeed "
                          "ZeRO-3.\"）"},
        "slow": {"en": "every rank gathers every layer for every generated token (synced_gpus), many times slower "
                       "than a plain load",
                 "zh": "每生成一个 token 每个 rank 都要 gather 每一层（synced_gpus），比直接加载慢很多倍"},
        "size-model": {"en": "{params} params, {bytes} in bf16", "zh": "{params} 参数，bf16 下 {bytes}"},
        "size-name": {"en": "{size} by its name {name}, about {bytes} in bf16",
                      "zh": "按名字 {name} 为 {size}，bf16 下约 {bytes}"},
        "fits": {"en": "The model ({size}) fits one GPU", "zh": "模型（{size}）单卡放得下"},
        "fits-unknown": {"en": "If the model fits one GPU (an 8B model is about 15 GiB in bf16)",
                         "zh": "如果单卡放得下模型（8B 模型 bf16 约 15 GiB）"},
        "way-out-tp": {"en": "The model ({size}) needs about {gpus} GPUs for its weights: batch-generate from the "
                             "saved model with a serving engine using tensor parallelism (vLLM/SGLang, tensor parallel "
                             "size {gpus} or more), or predict without predict_with_generate; keep ZeRO-3 for training",
                       "zh": "模型（{size}）仅权重就需要约 {gpus} 张 GPU：用支持张量并行的推理服务引擎（vLLM/SGLang，张量并行度 "
                             "{gpus} 或以上）对保存的模型批量生成，或不用 predict_with_generate 做预测；ZeRO-3 留给训练"},
        "way-out": {"en": "{fits}: drop `deepspeed` from the predict run and start one replica per GPU on a shard of "
                          "the data, or batch-generate with a serving engine (vLLM, SGLang); keep ZeRO-3 for training",
                    "zh": "{fits}：预测时去掉 `deepspeed`，每张 GPU 跑一个副本处理一部分数据，或用推理服务引擎（vLLM、SGLang）"
                          "批量生成；ZeRO-3 留给训练"},
    },
    fix={
        "en": "{way_out}",
        "zh": "{way_out}",
    },
    explanation=explanation(
        en=(
            """\
Flags generation (`predict_with_generate: true`) through a trainer whose DeepSpeed config is ZeRO-3.
""",
            """\
LLaMA-Factory refuses the combination when it parses its arguments: "`predict_with_generate` is
incompatible with DeepSpeed ZeRO-3". The HF Seq2SeqTrainer accepts it, but ZeRO-3 is SPMD: every rank
gathers every layer for every generated token (`synced_gpus` on), so generation runs many times slower
than a plain load. A model that fits one GPU (an 8B model is about 16 GiB in bf16) needs no ZeRO-3 to
generate at all.
""",
            """\
do_predict: true
predict_with_generate: true
deepspeed: examples/deepspeed/ds_z3_config.json
""",
            """\
Drop `deepspeed:` from the predict YAML and run one replica per GPU on a shard of the data, or
batch-generate with a serving engine (vLLM, SGLang) from the saved model. Keep ZeRO-3 for training.
""",
        ),
        zh=(
            """\
检查通过训练框架在 ZeRO-3 配置下做生成（`predict_with_generate: true`）。
""",
            """\
LLaMA-Factory 在解析参数时就会拒绝："`predict_with_generate` is incompatible with DeepSpeed ZeRO-3"。
HF Seq2SeqTrainer 虽然接受，但 ZeRO-3 是 SPMD：每生成一个 token，每个 rank 都要 gather 每一层
（`synced_gpus` 开启），生成比直接加载慢很多倍。单卡放得下的模型（8B 模型 bf16 约 16 GiB）生成时根本
不需要 ZeRO-3。
""",
            """\
do_predict: true
predict_with_generate: true
deepspeed: examples/deepspeed/ds_z3_config.json
""",
            """\
预测用的 YAML 去掉 `deepspeed:`，每张 GPU 跑一个副本处理一部分数据；或用推理服务引擎（vLLM、SGLang）
对保存的模型批量生成。ZeRO-3 留给训练。
""",
        ),
    ),
)

rule(
    "DSD121", "trainer-inference-needs-zero3", "error",
    message={
        "en": "{runner} in {mode} mode with ZeRO stage {stage}: the Trainer's inference path raises "
              "\"ZeRO inference only makes sense with ZeRO Stage 3 - please adjust your config\"",
        "zh": "{runner} 在 {mode} 模式下使用 ZeRO stage {stage}：Trainer 的推理路径会报错 "
              "\"ZeRO inference only makes sense with ZeRO Stage 3 - please adjust your config\"",
    },
    fix={
        "en": "Evaluate/predict without DeepSpeed (drop the deepspeed argument), or use a stage-3 config",
        "zh": "评估/预测时不要用 DeepSpeed（去掉 deepspeed 参数），或改用 stage 3 配置",
    },
    explanation=explanation(
        en=(
            """\
Flags evaluation or prediction without training (`do_eval`/`do_predict`, no `do_train`) through the HF
Trainer with a ZeRO stage below 3.
""",
            """\
Without training, the Trainer builds DeepSpeed through `deepspeed_init(inference=True)`
(transformers/integrations/deepspeed.py), which accepts only ZeRO-3 (stages 1 and 2 shard nothing a
forward pass uses) and raises a ValueError before the first batch. It also deletes the optimizer section,
so optimizer findings do not apply on this path.
""",
            """\
do_predict: true
deepspeed: ds_z2_config.json
""",
            """\
do_predict: true      (no deepspeed: the model fits one GPU)
or deepspeed: ds_z3_config.json when it does not fit.
""",
        ),
        zh=(
            """\
检查通过 HF Trainer 只做评估或预测（`do_eval`/`do_predict`，没有 `do_train`）时 ZeRO stage 低于 3。
""",
            """\
不训练时，Trainer 通过 `deepspeed_init(inference=True)`（transformers/integrations/deepspeed.py）构建
DeepSpeed，它只接受 ZeRO-3（stage 1、2 对前向计算用到的东西不做任何分片），在第一个 batch 之前就抛出
ValueError。它还会删除 optimizer 段，所以优化器相关的问题在这条路径上不适用。
""",
            """\
do_predict: true
deepspeed: ds_z2_config.json
""",
            """\
do_predict: true      （不用 deepspeed：单卡放得下模型）
放不下时用 deepspeed: ds_z3_config.json
""",
        ),
    ),
)

rule(
    "DSD122", "zero-ignored-by-init-inference", "error",
    message={
        "en": "init_inference config with a zero section ({asked}): deepspeed.init_inference never partitions or "
              "offloads, so every GPU loads the whole model",
        "zh": "init_inference 配置中有 zero 段（{asked}）：deepspeed.init_inference 从不分片也不卸载，"
              "每张 GPU 都会加载整个模型",
    },
    fix={
        "en": "For ZeRO-3 inference call deepspeed.initialize(model=model, config={config}) (no optimizer), "
              "building the model under HfDeepSpeedConfig or zero.Init; {dtype_note}",
        "zh": "要做 ZeRO-3 推理，请调用 deepspeed.initialize(model=model, config={config})（不带优化器），并在 "
              "HfDeepSpeedConfig 或 zero.Init 下构建模型；{dtype_note}",
    },
    phrases={
        "bf16-gpu": {"en": "bf16 because the {gpu} ({source}) supports it", "zh": "用 bf16：{gpu}（{source}）支持"},
        "fp16-gpu": {"en": "fp16 because the {gpu} ({source}) has no bf16 (compute capability < 8.0)",
                     "zh": "用 fp16：{gpu}（{source}）不支持 bf16（compute capability < 8.0）"},
        "bf16-unknown-gpu": {"en": "bf16 assumed (the GPU {gpu!r} is not known); use fp16 on GPUs older than Ampere",
                             "zh": "假定 bf16（未知的 GPU {gpu!r}）；Ampere 之前的 GPU 请用 fp16"},
        "bf16-no-gpu": {"en": "bf16 assumed (no GPU found or given: pass --gpu-name); use fp16 on GPUs older than "
                              "Ampere",
                        "zh": "假定 bf16（未找到也未指定 GPU：传 --gpu-name）；Ampere 之前的 GPU 请用 fp16"},
    },
    explanation=explanation(
        en=(
            """\
Flags a `zero` section in a config for `deepspeed.init_inference`.
""",
            """\
`DeepSpeedInferenceConfig` has a `zero` field, so the section passes validation, but nothing in the
inference engine reads it: no partitioning, no offload_param. The model stays whole on every GPU (or
is split by tensor parallelism only), and the OOM the section was meant to prevent happens anyway.
ZeRO-3 inference is `deepspeed.initialize` with a stage-3 config and no optimizer.
""",
            """\
deepspeed.init_inference(model, config={"dtype": "bf16",
    "zero": {"stage": 3, "offload_param": {"device": "cpu"}}})
""",
            """\
ds_config = {"bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": 1,
             "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true}}}
dschf = HfDeepSpeedConfig(ds_config)   # before from_pretrained, kept alive
model = AutoModelForCausalLM.from_pretrained(...)
engine = deepspeed.initialize(model=model, config=ds_config)[0]
""",
        ),
        zh=(
            """\
检查传给 `deepspeed.init_inference` 的配置中的 `zero` 段。
""",
            """\
`DeepSpeedInferenceConfig` 有 `zero` 字段，所以能通过校验，但推理引擎从不读取它：不分片，也没有
offload_param。模型在每张 GPU 上都是完整的（最多按张量并行切分），这个段本想避免的 OOM 照样发生。
ZeRO-3 推理应使用 `deepspeed.initialize` 加 stage 3 配置、不带优化器。
""",
            """\
deepspeed.init_inference(model, config={"dtype": "bf16",
    "zero": {"stage": 3, "offload_param": {"device": "cpu"}}})
""",
            """\
ds_config = {"bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": 1,
             "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true}}}
dschf = HfDeepSpeedConfig(ds_config)   # 在 from_pretrained 之前创建并保持存活
model = AutoModelForCausalLM.from_pretrained(...)
engine = deepspeed.initialize(model=model, config=ds_config)[0]
""",
        ),
    ),
)

rule(
    "DSD123", "top-level-zero-key-ignored", "error",
    message={
        "en": "top-level \"zero\" key ({asked}): deepspeed.initialize reads only \"zero_optimization\" and ignores "
              "unknown top-level keys, so ZeRO stage {stage} takes effect",
        "zh": "顶层 \"zero\" 键（{asked}）：deepspeed.initialize 只读取 \"zero_optimization\"，会忽略未知的顶层键，"
              "实际生效的是 ZeRO stage {stage}",
    },
    fix={
        "en": "Rename \"zero\" to \"zero_optimization\": {config}",
        "zh": "把 \"zero\" 改名为 \"zero_optimization\"：{config}",
    },
    explanation=explanation(
        en=(
            """\
Flags a top-level `zero` key in a config for `deepspeed.initialize`.
""",
            """\
DeepSpeed ignores top-level keys it does not know, and the ZeRO section is spelled
`zero_optimization`. A `zero` section is silently dropped: stage 0, no partitioning, no offload, and
the model is copied whole to every GPU.
""",
            """\
{"zero": {"stage": 3, "offload_param": {"device": "cpu"}}, "train_micro_batch_size_per_gpu": 1}
""",
            """\
{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "train_micro_batch_size_per_gpu": 1}
""",
        ),
        zh=(
            """\
检查 `deepspeed.initialize` 配置中的顶层 `zero` 键。
""",
            """\
DeepSpeed 会忽略不认识的顶层键，而 ZeRO 段的名字是 `zero_optimization`。`zero` 段被静默丢弃：stage 0、
不分片、不卸载，模型被完整复制到每张 GPU。
""",
            """\
{"zero": {"stage": 3, "offload_param": {"device": "cpu"}}, "train_micro_batch_size_per_gpu": 1}
""",
            """\
{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "train_micro_batch_size_per_gpu": 1}
""",
        ),
    ),
)

rule(
    "DSD124", "init-inference-value-rejected", "error",
    message={
        "en": "{key}: deepspeed.init_inference rejects this ({why})",
        "zh": "{key}：deepspeed.init_inference 会拒绝它（{why}）",
    },
    fix={
        "en": "Correct or delete {key}",
        "zh": "改正或删除 {key}",
    },
    explanation=explanation(
        en=(
            """\
Checks a `deepspeed.init_inference` config the way `DeepSpeedInferenceConfig` (pydantic, extra keys
forbidden) validates it: unknown keys in `tensor_parallel`, `moe`, `quant`, `zero`, `checkpoint_config`,
a `dtype` outside fp16/bf16/fp32/int8 and their spellings, non-integer sizes, `max_out_tokens` <= 0.
""",
            """\
init_inference raises a ValidationError on the first one, after the model has already been loaded.
""",
            """\
{"dtype": "bfloat", "tensor_parallel": {"tp_size": 2, "tp_degree": 2}, "max_out_tokens": 0}
""",
            """\
{"dtype": "bf16", "tensor_parallel": {"tp_size": 2}, "max_out_tokens": 1024}
""",
        ),
        zh=(
            """\
按 `DeepSpeedInferenceConfig`（pydantic，禁止多余的键）的方式检查 `deepspeed.init_inference` 配置：
`tensor_parallel`、`moe`、`quant`、`zero`、`checkpoint_config` 中的未知键，fp16/bf16/fp32/int8 及其写法之外的
`dtype`，非整数的大小，`max_out_tokens` <= 0。
""",
            """\
init_inference 遇到第一个就抛出 ValidationError，而那时模型已经加载完了。
""",
            """\
{"dtype": "bfloat", "tensor_parallel": {"tp_size": 2, "tp_degree": 2}, "max_out_tokens": 0}
""",
            """\
{"dtype": "bf16", "tensor_parallel": {"tp_size": 2}, "max_out_tokens": 1024}
""",
        ),
    ),
)

rule(
    "DSD125", "init-inference-fp16-default", "warning",
    message={
        "en": "init_inference config without dtype: DeepSpeed casts the model to fp16 (the default){model_note}",
        "zh": "init_inference 配置未设置 dtype：DeepSpeed 会把模型转换为 fp16（默认值）{model_note}",
    },
    phrases={
        "model-bf16": {"en": ": the model ({model}) is bf16, so it is cast to fp16",
                       "zh": "：模型（{model}）是 bf16，会被转换成 fp16"},
        "model-fp16": {"en": ": the model is fp16 already", "zh": "：模型本来就是 fp16"},
        "model-unknown": {"en": " (pass --model to know the model's dtype; bf16 models are cast)",
                          "zh": "（传 --model 以获知模型精度；bf16 模型会被转换）"},
    },
    fix={
        "en": "Set \"dtype\": \"{dtype}\" (torch.{torch_dtype}) in the init_inference config",
        "zh": "在 init_inference 配置中设置 \"dtype\": \"{dtype}\"（torch.{torch_dtype}）",
    },
    explanation=explanation(
        en=(
            """\
Flags a `deepspeed.init_inference` config that does not set `dtype`.
""",
            """\
`DeepSpeedInferenceConfig.dtype` defaults to `torch.float16`, and init_inference converts the module to
it. A bf16 model (Llama, Mistral, Qwen, ...) is silently cast to fp16: activations beyond 65504
overflow to inf/NaN, or the text quietly changes. The tokens then differ from a plain bf16 load.
""",
            """\
deepspeed.init_inference(model, config={"tensor_parallel": {"tp_size": 2}})
""",
            """\
deepspeed.init_inference(model, config={"tensor_parallel": {"tp_size": 2}, "dtype": "bf16"})
""",
        ),
        zh=(
            """\
检查未设置 `dtype` 的 `deepspeed.init_inference` 配置。
""",
            """\
`DeepSpeedInferenceConfig.dtype` 默认是 `torch.float16`，init_inference 会把模块转换成它。bf16 模型
（Llama、Mistral、Qwen 等）被悄悄转成 fp16：超过 65504 的激活溢出为 inf/NaN，或者文本悄悄变了，
生成的 token 与直接按 bf16 加载不同。
""",
            """\
deepspeed.init_inference(model, config={"tensor_parallel": {"tp_size": 2}})
""",
            """\
deepspeed.init_inference(model, config={"tensor_parallel": {"tp_size": 2}, "dtype": "bf16"})
""",
        ),
    ),
)

rule(
    "DSD126", "auto-prefetch-bucket-float", "error",
    message={
        "en": "\"stage3_prefetch_bucket_size\": \"auto\" with transformers {transformers} and DeepSpeed {deepspeed}: "
              "{filler} fills it with the float 0.9*hidden^2{value}, which DeepSpeed >= 0.15 rejects "
              "(ValidationError int_from_float)",
        "zh": "\"stage3_prefetch_bucket_size\": \"auto\"，transformers {transformers}、DeepSpeed {deepspeed}："
              "{filler} 会填入浮点数 0.9*hidden^2{value}，DeepSpeed >= 0.15 会拒绝（ValidationError int_from_float）",
    },
    fix={
        "en": "Upgrade to transformers >= 4.45.0 (and accelerate >= 0.31.0), or write an integer: "
              "\"stage3_prefetch_bucket_size\": {suggested}",
        "zh": "升级到 transformers >= 4.45.0（以及 accelerate >= 0.31.0），或写成整数："
              "\"stage3_prefetch_bucket_size\": {suggested}",
    },
    explanation=explanation(
        en=(
            """\
Flags `"stage3_prefetch_bucket_size": "auto"` when the installed (or given) transformers fills it with a
float and the installed DeepSpeed validates it as an integer.
""",
            """\
transformers before 4.45.0 filled the key with `0.9 * hidden_size * hidden_size`, a float
(15099494.4 for a 4096-wide model); the cast to int arrived in 4.45.0 (accelerate's own fill in 0.31.0).
DeepSpeed 0.15 moved its config to pydantic v2, which refuses a float with a fractional part for an int
field: `Input should be a valid integer, got a number with a fractional part [type=int_from_float]`.
The run dies in `deepspeed.initialize`, after the model has been loaded.
""",
            """\
transformers 4.44.2, deepspeed 0.15.0,
"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}
""",
            """\
pip install "transformers>=4.45.0", or
"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 15099494}
""",
        ),
        zh=(
            """\
当安装的（或指定的）transformers 会用浮点数填充 `"stage3_prefetch_bucket_size": "auto"`、而安装的
DeepSpeed 要求整数时报告。
""",
            """\
4.45.0 之前的 transformers 用 `0.9 * hidden_size * hidden_size` 填充它，是浮点数（4096 宽的模型为
15099494.4）；4.45.0 才转成 int（accelerate 自己的填充在 0.31.0 修复）。DeepSpeed 0.15 把配置改用
pydantic v2，它拒绝把带小数的浮点数赋给整数字段：`Input should be a valid integer, got a number with a
fractional part [type=int_from_float]`。运行会在模型加载完之后死在 `deepspeed.initialize`。
""",
            """\
transformers 4.44.2、deepspeed 0.15.0，
"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}
""",
            """\
pip install "transformers>=4.45.0"，或
"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 15099494}
""",
        ),
    ),
)

rule(
    "DSD127", "offload-pin-memory-version-default", "warning",
    message={
        "en": "zero_optimization.{section}.pin_memory is not set: DeepSpeed {deepspeed} {behaviour}",
        "zh": "未设置 zero_optimization.{section}.pin_memory：DeepSpeed {deepspeed} {behaviour}",
    },
    phrases={
        "false": {"en": "defaults it to false: offloaded tensors live in pageable memory (several times slower copies)",
                  "zh": "默认为 false：卸载的张量放在可分页内存中（拷贝慢数倍）"},
        "maybe-false": {"en": "may default it to false (the default became true in 0.19.x, PR #8207; 0.19.8 is known "
                              "to default to true)",
                        "zh": "可能默认为 false（默认值在 0.19.x 中改为 true，PR #8207；已知 0.19.8 默认为 true）"},
    },
    fix={
        "en": "Set zero_optimization.{section}.pin_memory explicitly (true when the host has the memory); "
              "DeepSpeed 0.19.8 defaults it to true",
        "zh": "显式设置 zero_optimization.{section}.pin_memory（主机内存足够时设为 true）；DeepSpeed 0.19.8 默认为 true",
    },
    explanation=explanation(
        en=(
            """\
Flags an offload section without `pin_memory` when the DeepSpeed version in use defaults it to false (or
when the version cannot tell).
""",
            """\
Older DeepSpeed releases defaulted `offload_param.pin_memory` and `offload_optimizer.pin_memory` to
false; DeepSpeed PR #8207 (August 2026) made true the default, and 0.19.8 has it. Unpinned host memory
takes a staged, synchronous copy: measured on an H200, a zero3-offload generate was several times slower
unpinned than pinned. The same config is fast on one machine and slow on another.
""",
            """\
"offload_param": {"device": "cpu"}        with deepspeed 0.18.x
""",
            """\
"offload_param": {"device": "cpu", "pin_memory": true}
""",
        ),
        zh=(
            """\
当所用 DeepSpeed 版本的默认值是 false（或无法判断版本）时，检查未设置 `pin_memory` 的 offload 段。
""",
            """\
较早的 DeepSpeed 版本中 `offload_param.pin_memory` 和 `offload_optimizer.pin_memory` 默认为 false；
DeepSpeed PR #8207（2026 年 8 月）把默认值改为 true，0.19.8 包含此改动。未锁页的主机内存走分段的同步
拷贝：在 H200 上实测，zero3-offload 的生成不锁页比锁页慢数倍。同一份配置在一台机器上快、在另一台上慢。
""",
            """\
"offload_param": {"device": "cpu"}        搭配 deepspeed 0.18.x
""",
            """\
"offload_param": {"device": "cpu", "pin_memory": true}
""",
        ),
    ),
)

rule(
    "DSD128", "hybrid-engine-at-inference", "warning",
    message={
        "en": "hybrid_engine is enabled: {problems}",
        "zh": "启用了 hybrid_engine：{problems}",
    },
    phrases=dict(_LISTS, **{
        "engine": {"en": "deepspeed.initialize returns a DeepSpeedHybridEngine whose generate swaps in inference "
                         "kernels (only for model families with a DeepSpeed injection policy)",
                   "zh": "deepspeed.initialize 返回 DeepSpeedHybridEngine，其 generate 会换入推理 kernel（只支持 DeepSpeed "
                         "有注入策略的模型族）"},
        "gathers-all": {"en": "under ZeRO-3 with pin_parameters (default true) generate gathers every layer first, so "
                              "the whole model sits on each GPU during generation",
                        "zh": "ZeRO-3 下 pin_parameters（默认 true）会在生成前 gather 所有层，生成期间整个模型都在每张 GPU 上"},
        "gathers-all-offload": {"en": "under ZeRO-3 with pin_parameters (default true) generate gathers every layer "
                                      "first, so the whole model sits on each GPU during generation and offload_param "
                                      "does not lower the generate peak",
                                "zh": "ZeRO-3 下 pin_parameters（默认 true）会在生成前 gather 所有层，生成期间整个模型都在"
                                      "每张 GPU 上，offload_param 也不能降低生成峰值"},
        "tp-divides": {"en": "inference_tp_size {tp} does not divide the {gpus} ranks",
                       "zh": "inference_tp_size {tp} 不能整除 {gpus} 个 rank"},
        "unpin": {"en": "inside DeepSpeed-Chat set \"pin_parameters\": false when the gathered model does not fit a GPU",
                  "zh": "在 DeepSpeed-Chat 中，gather 后的模型放不下单卡时设 \"pin_parameters\": false"},
        "tp-divisor": {"en": "make inference_tp_size a divisor of {gpus}", "zh": "把 inference_tp_size 设为 {gpus} 的约数"},
        "bypass": {"en": "or generate through engine.module.generate to bypass it",
                   "zh": "或通过 engine.module.generate 绕过它"},
    }),
    fix={
        "en": "For inference alone delete hybrid_engine (it is DeepSpeed-Chat's RLHF generation engine); {fix}",
        "zh": "仅做推理时请删除 hybrid_engine（它是 DeepSpeed-Chat 的 RLHF 生成引擎）；{fix}",
    },
    explanation=explanation(
        en=(
            """\
Reads a `hybrid_engine` section (DeepSpeed-Chat's engine that switches a training model to inference
kernels for generation) and reports what it does at inference.
""",
            """\
With `enabled: true`, `deepspeed.initialize` returns a `DeepSpeedHybridEngine`. Its `generate` swaps in
inference containers, which exist only for the model families DeepSpeed has injection policies for.
Under ZeRO-3 with `pin_parameters` (the default, true) it gathers every layer before generating, so the
whole model sits on each GPU during generation: ZeRO-3's partitioning and offload_param do not lower the
generate peak. `inference_tp_size` must divide the number of ranks.
""",
            """\
"hybrid_engine": {"enabled": true, "inference_tp_size": 1},
"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}
""",
            """\
Plain ZeRO-3 inference: delete hybrid_engine. Keep it only inside DeepSpeed-Chat step 3 training, with
"pin_parameters": false when the gathered model does not fit a GPU.
""",
        ),
        zh=(
            """\
读取 `hybrid_engine` 段（DeepSpeed-Chat 在生成时把训练模型切换成推理 kernel 的引擎），报告它在推理时
的作用。
""",
            """\
`enabled: true` 时 `deepspeed.initialize` 返回 `DeepSpeedHybridEngine`。它的 `generate` 换入推理容器，
而推理容器只对 DeepSpeed 有注入策略的模型族存在。在 ZeRO-3 下、`pin_parameters` 为默认的 true 时，
生成前会 gather 所有层，生成期间整个模型都在每张 GPU 上：ZeRO-3 的分片和 offload_param 都不能降低生成
峰值。`inference_tp_size` 必须能整除 rank 数。
""",
            """\
"hybrid_engine": {"enabled": true, "inference_tp_size": 1},
"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}
""",
            """\
普通的 ZeRO-3 推理：删除 hybrid_engine。只在 DeepSpeed-Chat 第 3 步训练中保留，gather 后的模型放不下
单卡时设 "pin_parameters": false。
""",
        ),
    ),
)

rule(
    "DSD129", "weight-quantization-not-applied", "warning",
    message={
        "en": "weight_quantization.{part}: {problem}",
        "zh": "weight_quantization.{part}：{problem}",
    },
    phrases={
        "needs-stage3": {"en": "int{bits} weights are made only under zero.Init, which needs ZeRO stage 3; with stage "
                               "{stage} nothing is quantized",
                         "zh": "int{bits} 权重只在 zero.Init 下生成，而 zero.Init 需要 ZeRO stage 3；stage {stage} 下什么也"
                               "不会被量化"},
        "zero-init-only": {"en": "takes effect only if the model is built under zero.Init with this config (int{bits} "
                                 "weights, CUDA only); deepspeed.initialize does not quantize a model that is already "
                                 "built",
                           "zh": "只有模型在使用此配置的 zero.Init 下构建时才生效（int{bits} 权重，仅 CUDA）；"
                                 "deepspeed.initialize 不会量化已经构建好的模型"},
        "post-init-ignored": {"en": "deepspeed.initialize ignores it; it acts only when the script calls "
                                    "_init_group_wise_weight_quantization(model, ds_config) itself",
                              "zh": "deepspeed.initialize 会忽略它；只有脚本自己调用 "
                                    "_init_group_wise_weight_quantization(model, ds_config) 时才生效"},
        "use-stage3": {"en": "Use \"zero_optimization\": {{\"stage\": 3}} and build the model under "
                             "HfDeepSpeedConfig(ds_config) (created before from_pretrained) or "
                             "deepspeed.zero.Init(config_dict_or_path=ds_config)",
                       "zh": "使用 \"zero_optimization\": {{\"stage\": 3}}，并在 HfDeepSpeedConfig(ds_config)（在 "
                             "from_pretrained 之前创建）或 deepspeed.zero.Init(config_dict_or_path=ds_config) 下构建模型"},
        "hf-config-first": {"en": "Create HfDeepSpeedConfig(ds_config) before from_pretrained and keep it alive "
                                  "(dsdoctor trace shows whether the model reached initialize partitioned)",
                            "zh": "在 from_pretrained 之前创建 HfDeepSpeedConfig(ds_config) 并保持存活（dsdoctor trace "
                                  "可显示模型到达 initialize 时是否已分片）"},
        "call-post-init": {"en": "Call deepspeed.inference.quantization.quantization._init_group_wise_weight_quantization"
                                 "(model, ds_config) after loading, or use quantized_initialization",
                           "zh": "加载后调用 deepspeed.inference.quantization.quantization._init_group_wise_weight_quantization"
                                 "(model, ds_config)，或改用 quantized_initialization"},
    },
    fix={
        "en": "{fix}",
        "zh": "{fix}",
    },
    explanation=explanation(
        en=(
            """\
Reads the ZeRO-Inference `weight_quantization` section and says whether it takes effect.
""",
            """\
`deepspeed.initialize` never quantizes a model it is given. `quantized_initialization` (int4/int8
weights) acts only while the model is built under `zero.Init` with this config and ZeRO stage 3
(`HfDeepSpeedConfig(ds_config)` before `from_pretrained`, or `with deepspeed.zero.Init(config_dict_or_path=
ds_config)`), and needs CUDA. `post_init_quant` acts only when the script calls
`_init_group_wise_weight_quantization(model, ds_config)` itself. Otherwise the weights stay 16-bit and
the memory the section promised is not saved.
""",
            """\
{"weight_quantization": {"quantized_initialization": {"num_bits": 4, "group_size": 64}},
 "zero_optimization": {"stage": 2}}
""",
            """\
{"weight_quantization": {"quantized_initialization": {"num_bits": 4, "group_size": 64}},
 "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
with HfDeepSpeedConfig(ds_config) created before from_pretrained.
""",
        ),
        zh=(
            """\
读取 ZeRO-Inference 的 `weight_quantization` 段，判断它是否生效。
""",
            """\
`deepspeed.initialize` 从不量化传给它的模型。`quantized_initialization`（int4/int8 权重）只在模型于
ZeRO stage 3、使用此配置的 `zero.Init` 下构建时生效（在 `from_pretrained` 之前创建
`HfDeepSpeedConfig(ds_config)`，或 `with deepspeed.zero.Init(config_dict_or_path=ds_config)`），且需要 CUDA。
`post_init_quant` 只在脚本自己调用 `_init_group_wise_weight_quantization(model, ds_config)` 时生效。否则
权重仍是 16 位，这个段承诺省下的显存并没有省下。
""",
            """\
{"weight_quantization": {"quantized_initialization": {"num_bits": 4, "group_size": 64}},
 "zero_optimization": {"stage": 2}}
""",
            """\
{"weight_quantization": {"quantized_initialization": {"num_bits": 4, "group_size": 64}},
 "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
并在 from_pretrained 之前创建 HfDeepSpeedConfig(ds_config)。
""",
        ),
    ),
)

rule(
    "DSD130", "autotp-zero3-rejected-by-version", "error",
    message={
        "en": "AutoTP ({source} = {tp_size}) with ZeRO-3 on DeepSpeed {deepspeed}: releases before 0.19.4 support "
              "AutoTP only with ZeRO stages 0-2, so deepspeed.initialize refuses this config",
        "zh": "DeepSpeed {deepspeed} 上 AutoTP（{source} = {tp_size}）与 ZeRO-3 同用：0.19.4 之前的版本只支持 AutoTP "
              "配合 ZeRO stage 0-2，deepspeed.initialize 会拒绝此配置",
    },
    fix={
        "en": "Upgrade to deepspeed >= 0.19.4, or use AutoTP with ZeRO stage 0-2 (or ZeRO-3 without AutoTP)",
        "zh": "升级到 deepspeed >= 0.19.4，或让 AutoTP 搭配 ZeRO stage 0-2（或只用 ZeRO-3、不用 AutoTP）",
    },
    explanation=explanation(
        en=(
            """\
Flags `tensor_parallel.autotp_size` > 1 together with ZeRO stage 3 when the DeepSpeed in use is older than
0.19.4.
""",
            """\
AutoTP inside `deepspeed.initialize` supported ZeRO stages 0, 1 and 2 only; DeepSpeed PR #8167 (July
2026, in 0.19.4) allowed stage 3 ("AutoTP + ZeRO stage 3 is supported for both inference and training",
runtime/engine.py in 0.19.8). The same config runs on one machine and is refused on another.
""",
            """\
deepspeed 0.18.9, {"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3}}
""",
            """\
pip install "deepspeed>=0.19.4", or {"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 0}}
""",
        ),
        zh=(
            """\
当所用 DeepSpeed 早于 0.19.4 时，检查 `tensor_parallel.autotp_size` > 1 与 ZeRO stage 3 同时出现。
""",
            """\
`deepspeed.initialize` 中的 AutoTP 原先只支持 ZeRO stage 0、1、2；DeepSpeed PR #8167（2026 年 7 月，
进入 0.19.4）放开了 stage 3（0.19.8 的 runtime/engine.py："AutoTP + ZeRO stage 3 is supported for both
inference and training"）。同一份配置在一台机器上能跑，在另一台上被拒绝。
""",
            """\
deepspeed 0.18.9，{"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3}}
""",
            """\
pip install "deepspeed>=0.19.4"，或 {"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 0}}
""",
        ),
    ),
)

rule(
    "DSD131", "llamafactory-pure-bf16-zero3", "error",
    message={
        "en": "LLaMA-Factory: pure_bf16 with ZeRO-3: LLaMA-Factory raises \"`pure_bf16` is incompatible with "
              "DeepSpeed ZeRO-3.\" while parsing its arguments",
        "zh": "LLaMA-Factory：pure_bf16 与 ZeRO-3 同用：LLaMA-Factory 解析参数时会报错 \"`pure_bf16` is "
              "incompatible with DeepSpeed ZeRO-3.\"",
    },
    fix={
        "en": "Replace pure_bf16: true with bf16: true (mixed precision), or use a ZeRO-2 config",
        "zh": "把 pure_bf16: true 改为 bf16: true（混合精度），或改用 ZeRO-2 配置",
    },
    explanation=explanation(
        en=(
            """\
Flags `pure_bf16: true` in a LLaMA-Factory YAML whose DeepSpeed config is ZeRO-3.
""",
            """\
LLaMA-Factory checks its arguments before loading anything and refuses this combination, so the run
ends at start-up with a ValueError.
""",
            """\
pure_bf16: true
deepspeed: examples/deepspeed/ds_z3_config.json
""",
            """\
bf16: true
deepspeed: examples/deepspeed/ds_z3_config.json
""",
        ),
        zh=(
            """\
检查 DeepSpeed 配置为 ZeRO-3 的 LLaMA-Factory YAML 中的 `pure_bf16: true`。
""",
            """\
LLaMA-Factory 在加载任何东西之前检查参数，会拒绝这个组合，运行在启动时就以 ValueError 结束。
""",
            """\
pure_bf16: true
deepspeed: examples/deepspeed/ds_z3_config.json
""",
            """\
bf16: true
deepspeed: examples/deepspeed/ds_z3_config.json
""",
        ),
    ),
)
