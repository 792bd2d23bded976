"""DSD340-DSD344: what trace sees at deepspeed.initialize. Texts in English and Chinese."""
from __future__ import annotations

from dsdoctor.findings import explanation, rule

rule(
    "DSD340", "unpartitioned-model-at-initialize", "warning",
    message={
        "en": "rank {rank}: the model reached deepspeed.initialize (ZeRO-3) unpartitioned: {unpartitioned} of "
              "{params} parameters ({bytes}) have no ZeRO id because {why}; initialize moves the whole model to "
              "each GPU before it partitions, so the OOM happens there, before offload_param can act",
        "zh": "rank {rank}：模型以未分片状态到达 deepspeed.initialize（ZeRO-3）：{params} 个参数中有 {unpartitioned} 个"
              "（{bytes}）没有 ZeRO id，原因是{why}；initialize 在分片之前把整个模型搬到每张 GPU 上，OOM 就发生在那里，"
              "offload_param 还来不及起作用",
    },
    phrases={
        "no-hf-config": {"en": "no HfDeepSpeedConfig was created and the model was not built under zero.Init",
                         "zh": "没有创建 HfDeepSpeedConfig，模型也不是在 zero.Init 下构建的"},
        "created-after": {"en": "HfDeepSpeedConfig was created after the model was built ({api})",
                          "zh": "HfDeepSpeedConfig 是在模型构建（{api}）之后才创建的"},
        "not-alive": {"en": "HfDeepSpeedConfig was created but was no longer alive when {api} ran (no reference kept)",
                      "zh": "HfDeepSpeedConfig 虽已创建，但 {api} 运行时它已不存活（没有保留引用）"},
        "outside-zero-init": {"en": "the model was built outside zero.Init", "zh": "模型是在 zero.Init 之外构建的"},
    },
    fix={
        "en": "Create dschf = HfDeepSpeedConfig(ds_config) before from_pretrained and keep the reference alive until "
              "deepspeed.initialize (transformers holds it only weakly), or build the model inside "
              "`with deepspeed.zero.Init(config_dict_or_path=ds_config):`",
        "zh": "在 from_pretrained 之前创建 dschf = HfDeepSpeedConfig(ds_config)，并把这个引用一直保留到 "
              "deepspeed.initialize 之后（transformers 只持有它的弱引用）；或在 "
              "`with deepspeed.zero.Init(config_dict_or_path=ds_config):` 中构建模型",
    },
    explanation=explanation(
        en=(
            """\
At `deepspeed.initialize` with ZeRO stage 3, counts the model's parameters that carry no `ds_id`: those
were not created under `zero.Init` and are whole tensors on every rank.
""",
            """\
ZeRO-3 saves memory only for a model built partitioned. transformers builds it so inside
`from_pretrained` only while a `HfDeepSpeedConfig` object with stage 3 is alive (it keeps a weak
reference). Created after `from_pretrained`, or created and dropped (`HfDeepSpeedConfig(cfg)` without
assigning it), it does nothing: every rank loads the full model on the CPU, and `deepspeed.initialize`
sees no partitioned parameter and runs `module.to(device)` before partitioning. A 70B model OOMs there
on every GPU, whatever `offload_param` says; `dsdoctor split` cannot help.
""",
            """\
model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
HfDeepSpeedConfig(ds_config)                     # too late, and not kept
engine = deepspeed.initialize(model=model, config=ds_config)[0]
""",
            """\
dschf = HfDeepSpeedConfig(ds_config)             # first, and keep the reference
model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
engine = deepspeed.initialize(model=model, config=ds_config)[0]
or: with deepspeed.zero.Init(config_dict_or_path=ds_config): model = MyModel(...)
""",
        ),
        zh=(
            """\
在 ZeRO stage 3 的 `deepspeed.initialize` 处，统计模型中没有 `ds_id` 的参数：它们不是在 `zero.Init` 下创建的，
在每个 rank 上都是完整张量。
""",
            """\
只有以分片方式构建的模型，ZeRO-3 才能省显存。transformers 只有在一个 stage 3 的 `HfDeepSpeedConfig` 对象存活时
（它只保存弱引用）才会在 `from_pretrained` 中这样构建。在 `from_pretrained` 之后才创建，或创建后就丢掉
（`HfDeepSpeedConfig(cfg)` 没有赋值给变量），它都不起作用：每个 rank 都在 CPU 上加载完整模型，而
`deepspeed.initialize` 看不到任何已分片的参数，会先执行 `module.to(device)` 再分片。70B 模型会在那里让每张 GPU
OOM，无论 `offload_param` 怎么写；`dsdoctor split` 也帮不上忙。
""",
            """\
model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
HfDeepSpeedConfig(ds_config)                     # 太晚了，而且没有保留引用
engine = deepspeed.initialize(model=model, config=ds_config)[0]
""",
            """\
dschf = HfDeepSpeedConfig(ds_config)             # 先创建，并保留引用
model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
engine = deepspeed.initialize(model=model, config=ds_config)[0]
或者：with deepspeed.zero.Init(config_dict_or_path=ds_config): model = MyModel(...)
""",
        ),
    ),
)
