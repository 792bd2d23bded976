"""DSD4xx: findings of ``dsdoctor merge`` and ``dsdoctor verify``. Torch-free."""
from dsdoctor.findings import explanation, rule

rule(
    "DSD401", "missing-weights", "error",
    message={"en": "{count} weight(s) the model expects are not in {out_dir}: {names}",
             "zh": "{out_dir} 缺少模型需要的 {count} 个权重: {names}"},
    fix={"en": "re-run `dsdoctor merge` on the complete checkpoint; do not load with strict=False",
         "zh": "对完整的检查点重新运行 `dsdoctor merge`;不要用 strict=False 加载"},
    explanation=explanation(
        en=(
            "Compares the keys of the weight files with the state dict of the model built from its config "
                "on the meta device.",
            "A missing weight is left at its random initialization. `load_state_dict(strict=False)` (what "
                "DeepSpeed's `load_state_dict_from_zero_checkpoint` uses) accepts this silently, and the model "
                "produces garbage.",
            "A merge of a checkpoint whose frozen layers were excluded, or a conversion that dropped "
                "`lm_head.weight`.",
            "Merge with `dsdoctor merge CKPT OUT --model MODEL_DIR` and run `dsdoctor verify OUT --model "
                "MODEL_DIR` before using the weights.",
        ),
        zh=(
            "把权重文件的键与按配置在 meta 设备上构建的模型的 state dict 比较。",
            "缺失的权重保持随机初始化。`load_state_dict(strict=False)`(DeepSpeed 的 "
                "`load_state_dict_from_zero_checkpoint` 就这样做)会静默接受,模型输出乱码。",
            "合并时排除了冻结层,或转换时丢了 `lm_head.weight`。",
            "用 `dsdoctor merge CKPT OUT --model MODEL_DIR` 合并,使用前先运行 `dsdoctor verify OUT --model MODEL_DIR`。",
        ),
    ),
)

rule(
    "DSD402", "unexpected-weights", "warning",
    message={"en": "{count} weight(s) in {out_dir} are not in the model: {names}",
             "zh": "{out_dir} 中有 {count} 个模型不认识的权重: {names}"},
    fix={"en": "check that --model is the architecture these weights were trained with",
         "zh": "确认 --model 与训练这些权重的模型结构一致"},
    explanation=explanation(
        en=(
            "Lists keys of the weight files that the model built from the config does not have.",
            "`from_pretrained` ignores them with a warning, so a renamed or wrapped module (a `module.` "
                "prefix, a PEFT wrapper) loads as random weights while the real ones are ignored.",
            "Weights saved from a wrapper: `module.model.layers.0...` instead of `model.layers.0...`.",
            "Point --model at the matching config, or strip the wrapper prefix before saving.",
        ),
        zh=(
            "列出权重文件中、按配置构建的模型没有的键。",
            "`from_pretrained` 只给出警告就忽略它们:被改名或被包装的模块(`module.` 前缀、PEFT 包装)"
                "会以随机权重加载,真正的权重却被忽略。",
            "从包装器保存的权重: `module.model.layers.0...` 而不是 `model.layers.0...`。",
            "让 --model 指向匹配的配置,或在保存前去掉包装前缀。",
        ),
    ),
)

rule(
    "DSD403", "shape-mismatch", "error",
    message={"en": "{count} weight(s) have a shape other than the model's: {details}",
             "zh": "{count} 个权重的形状与模型不符: {details}"},
    fix={"en": "use the config the checkpoint was trained with (vocab size, hidden size, heads)",
         "zh": "使用训练该检查点时的配置(词表大小、隐藏维度、头数)"},
    explanation=explanation(
        en=(
            "Compares every weight's shape with the parameter of the model built from the config.",
            "`from_pretrained` refuses mismatched shapes unless `ignore_mismatched_sizes=True`, which "
                "re-initializes them randomly. A tensor-parallel shard merged as if it were whole also shows up "
                "here.",
            "`model.embed_tokens.weight` saved as [32001, 4096] after adding a token, config says 32000.",
            "Load the config saved with the checkpoint, or resize the embeddings before saving.",
        ),
        zh=(
            "把每个权重的形状与按配置构建的模型参数比较。",
            "`from_pretrained` 拒绝形状不符的权重,除非 `ignore_mismatched_sizes=True`,那会随机重新初始化。"
                "把张量并行的分片当完整权重合并也会出现在这里。",
            "添加一个 token 后 `model.embed_tokens.weight` 保存为 [32001, 4096],配置仍是 32000。",
            "使用与检查点一起保存的配置,或在保存前调整嵌入大小。",
        ),
    ),
)

rule(
    "DSD404", "empty-weights", "error",
    message={"en": "{count} weight(s) are empty (0 elements), saved without gathering ZeRO-3 partitions: {names}",
             "zh": "{count} 个权重为空(0 个元素),是在没有收集 ZeRO-3 分片的情况下保存的: {names}"},
    fix={"en": "merge the DeepSpeed checkpoint with `dsdoctor merge CKPT OUT`, or save with "
               "stage3_gather_16bit_weights_on_model_save: true",
         "zh": "用 `dsdoctor merge CKPT OUT` 合并 DeepSpeed 检查点,或保存时设置 "
               "stage3_gather_16bit_weights_on_model_save: true"},
    explanation=explanation(
        en=(
            "Flags tensors with zero elements where the model expects a real parameter.",
            "Under ZeRO-3 each parameter is a placeholder of shape [0] outside a gather. "
                "`model.save_pretrained()` or `torch.save(model.state_dict())` on a ZeRO-3 engine therefore "
                "writes empty tensors: a file that looks fine and holds no weights.",
            "`engine.module.save_pretrained(out)` with `zero_optimization.stage: 3` and no gather.",
            "`engine.save_checkpoint(dir)` then `dsdoctor merge dir out`, or set "
                "`stage3_gather_16bit_weights_on_model_save: true` and use `engine.save_16bit_model`.",
        ),
        zh=(
            "标出元素个数为 0、而模型需要真实参数的张量。",
            "在 ZeRO-3 下,参数在 gather 之外只是形状为 [0] 的占位符。对 ZeRO-3 引擎调用 "
                "`model.save_pretrained()` 或 `torch.save(model.state_dict())` 会写出空张量:文件看似正常,却没有权重。",
            "`zero_optimization.stage: 3` 下不做 gather 就调用 `engine.module.save_pretrained(out)`。",
            "先 `engine.save_checkpoint(dir)` 再 `dsdoctor merge dir out`,或设置 "
                "`stage3_gather_16bit_weights_on_model_save: true` 并使用 `engine.save_16bit_model`。",
        ),
    ),
)

rule(
    "DSD405", "non-finite-weights", "error",
    message={"en": "{count} weight(s) contain NaN or Inf: {names}",
             "zh": "{count} 个权重包含 NaN 或 Inf: {names}"},
    fix={"en": "merge an earlier checkpoint tag (--tag) from before the loss diverged",
         "zh": "改用损失发散之前的检查点 tag(--tag)进行合并"},
    explanation=explanation(
        en=(
            "Scans every tensor for NaN and Inf values, one tensor at a time.",
            "A single NaN weight makes every output NaN. Training that diverged (often fp16 overflow) "
                "saves such weights, and converting to fp16 can turn large fp32 values into Inf.",
            "Converting with `--dtype fp16` a model whose weights exceed 65504.",
            "Merge an earlier tag, or merge with `--dtype bf16` / `fp32`.",
        ),
        zh=(
            "逐个张量检查 NaN 和 Inf。",
            "一个 NaN 权重就会让所有输出变成 NaN。训练发散(常见于 fp16 溢出)会保存这样的权重;"
                "转成 fp16 时超过 65504 的 fp32 值会变成 Inf。",
            "用 `--dtype fp16` 转换权重超过 65504 的模型。",
            "合并更早的 tag,或用 `--dtype bf16` / `fp32` 合并。",
        ),
    ),
)

rule(
    "DSD406", "dtype-differs-from-config", "info",
    message={"en": "{count} floating weight(s) are {found} but the config says {expected}",
             "zh": "{count} 个浮点权重是 {found},但配置写的是 {expected}"},
    fix={"en": "pass dtype= explicitly to from_pretrained, or merge with --dtype {expected_short}",
         "zh": "调用 from_pretrained 时显式传 dtype=,或用 --dtype {expected_short} 合并"},
    explanation=explanation(
        en=(
            "Compares the dtype of floating tensors with `torch_dtype`/`dtype` in config.json.",
            "Loaders that follow the config cast on load: fp32 files loaded as bf16 double the read time "
                "for nothing, and bf16 files loaded as fp32 double the memory.",
            "`dsdoctor merge` writes fp32 by default while the config says bfloat16.",
            "Merge with `--dtype bf16` for inference, or pass `dtype=torch.float32` when you need fp32.",
        ),
        zh=(
            "把浮点张量的 dtype 与 config.json 中的 `torch_dtype`/`dtype` 比较。",
            "按配置加载时会转换类型: fp32 文件按 bf16 加载白白多花一倍读取时间;bf16 文件按 fp32 加载多占一倍内存。",
            "`dsdoctor merge` 默认写 fp32,而配置写的是 bfloat16。",
            "推理时用 `--dtype bf16` 合并;需要 fp32 时显式传 `dtype=torch.float32`。",
        ),
    ),
)

rule(
    "DSD407", "tied-weights-differ", "error",
    message={"en": "tied weights {names} are stored with different values (max |diff| {max_diff})",
             "zh": "绑定的权重 {names} 存储的值不同(最大 |差| {max_diff})"},
    fix={"en": "keep one copy: the model ties them on load and one of the two is silently discarded",
         "zh": "只保留一份:模型加载时会绑定它们,其中一份会被静默丢弃"},
    explanation=explanation(
        en=(
            "Checks weights the model ties (input embeddings and `lm_head` when `tie_word_embeddings` is "
                "true): when both are stored they must be equal.",
            "After loading, the model ties the two and keeps only one; which one depends on the loader, so "
                "outputs differ between load paths.",
            "A conversion that wrote `lm_head.weight` from an untied training run into a tied config.",
            "Store the tied weight once (as `dsdoctor merge` does) and set `tie_word_embeddings` to match "
                "how the model was trained.",
        ),
        zh=(
            "检查模型绑定的权重(`tie_word_embeddings` 为 true 时的输入嵌入和 `lm_head`):两者都存储时必须相等。",
            "加载后模型会绑定两者只留一份;留哪份取决于加载方式,于是不同加载路径输出不同。",
            "把未绑定训练得到的 `lm_head.weight` 写进了绑定的配置。",
            "绑定的权重只存一份(`dsdoctor merge` 就是这样做的),并让 `tie_word_embeddings` 与训练方式一致。",
        ),
    ),
)

rule(
    "DSD408", "weights-differ-from-reference", "error",
    message={"en": "{count} weight(s) differ from the reference {reference} (largest |diff| {max_diff} in {worst})",
             "zh": "{count} 个权重与参考 {reference} 不同(最大 |差| {max_diff},在 {worst})"},
    fix={"en": "check the merge dtype and tag; compare the same step of the same run",
         "zh": "检查合并的 dtype 和 tag;比较同一次训练的同一步"},
    explanation=explanation(
        en=(
            "Compares every tensor with the same key in the reference weights, in fp32, with a tolerance "
                "that allows one rounding of the narrower dtype.",
            "Two conversions of one checkpoint must agree; a difference beyond rounding means a wrong "
                "tag, a wrong rebuild rule, or weights from another run.",
            "`dsdoctor verify out --model m --reference zero_to_fp32_out`.",
            "Re-merge from the intended tag and compare again.",
        ),
        zh=(
            "把每个张量与参考权重中同名张量按 fp32 比较,容差允许较窄 dtype 的一次舍入。",
            "同一检查点的两次转换必须一致;超出舍入的差异说明 tag 错误、重建规则错误或权重来自另一次训练。",
            "`dsdoctor verify out --model m --reference zero_to_fp32_out`。",
            "从正确的 tag 重新合并后再比较。",
        ),
    ),
)

rule(
    "DSD409", "logits-differ-from-reference", "error",
    message={"en": "logits differ from the reference: max |diff| {max_diff} (tolerance {tolerance}), "
                   "top-1 agreement {agreement}",
             "zh": "logits 与参考不同: 最大 |差| {max_diff}(容差 {tolerance}),top-1 一致率 {agreement}"},
    fix={"en": "find the first differing weight with DSD408, or compare the two load paths with `dsdoctor compare`",
         "zh": "用 DSD408 找到第一个不同的权重,或用 `dsdoctor compare` 比较两种加载方式"},
    explanation=explanation(
        en=(
            "Builds the model from its config on the CPU, runs one fixed batch of token ids with these "
                "weights and with the reference weights, and compares the logits.",
            "Weights can match key by key and still produce other outputs (a missing tie, a wrong buffer); "
                "the logits are what users see.",
            "`dsdoctor verify out --model m --reference hf_saved`.",
            "Fix the weights DSD408 names, then verify again.",
        ),
        zh=(
            "在 CPU 上按配置构建模型,用本权重和参考权重分别对一批固定的 token id 前向,比较 logits。",
            "权重逐个相同也可能输出不同(缺少绑定、buffer 错误);用户看到的是 logits。",
            "`dsdoctor verify out --model m --reference hf_saved`。",
            "修正 DSD408 指出的权重后再次验证。",
        ),
    ),
)

rule(
    "DSD410", "merged-without-config", "warning",
    message={"en": "no config.json in {searched}: {out_dir} holds weights only and from_pretrained cannot load it",
             "zh": "{searched} 中没有 config.json: {out_dir} 只有权重,from_pretrained 无法加载"},
    fix={"en": "re-run with --model DIR (the model's config and tokenizer directory), or copy config.json in",
         "zh": "加上 --model DIR(模型配置和分词器所在目录)重新运行,或把 config.json 复制进去"},
    explanation=explanation(
        en=(
            "After a merge, checks that a config.json was copied next to the weights.",
            "`from_pretrained(out)` needs config.json (and the tokenizer files for a pipeline). DeepSpeed "
                "checkpoints saved outside the HF Trainer do not carry them.",
            "`dsdoctor merge ckpt out` where ckpt came from a plain `engine.save_checkpoint`.",
            "`dsdoctor merge ckpt out --model path/to/original-model`.",
        ),
        zh=(
            "合并后检查权重旁边是否复制了 config.json。",
            "`from_pretrained(out)` 需要 config.json(做 pipeline 还需要分词器文件)。不经 HF Trainer 保存的 "
                "DeepSpeed 检查点里没有这些文件。",
            "ckpt 来自普通的 `engine.save_checkpoint`,运行 `dsdoctor merge ckpt out`。",
            "`dsdoctor merge ckpt out --model path/to/original-model`。",
        ),
    ),
)

rule(
    "DSD411", "shared-weights-copied", "info",
    message={"en": "{names} share storage in the checkpoint but config.json does not tie them; wrote a copy of each",
             "zh": "{names} 在检查点中共享存储,但 config.json 没有声明绑定;已各写一份"},
    fix={"en": "set tie_word_embeddings: true in config.json if the model ties them, then merge again to store "
               "them once",
         "zh": "如果模型确实绑定它们,在 config.json 中设置 tie_word_embeddings: true,再合并一次即可只存一份"},
    explanation=explanation(
        en=(
            "Reports parameters DeepSpeed recorded as shared (`shared_params`) that the config does not "
                "declare tied.",
            "Writing them once would lose one of them when the loader does not tie; writing both costs "
                "disk and memory and lets them drift apart if trained further.",
            "A model that ties `lm_head` to the embeddings in code, with `tie_word_embeddings` missing from "
                "config.json.",
            "Declare the tie in config.json, so the weight is stored once and tied on load.",
        ),
        zh=(
            "报告 DeepSpeed 记录为共享(`shared_params`)、但配置没有声明绑定的参数。",
            "只写一份时,不做绑定的加载器会丢掉其中一个;写两份则多占磁盘和内存,继续训练时还会分叉。",
            "模型在代码里把 `lm_head` 绑定到嵌入,但 config.json 里没有 `tie_word_embeddings`。",
            "在 config.json 中声明绑定,权重只存一份,加载时再绑定。",
        ),
    ),
)

rule(
    "DSD412", "params-only-in-module-weights", "info",
    message={"en": "{count} parameter(s) are in no fp32 partition and no frozen record, only in the 16-bit module "
                   "weights; taken from there: {names}",
             "zh": "{count} 个参数不在任何 fp32 分区和冻结记录中,只在 16 位模块权重里;已从那里取出: {names}"},
    fix={"en": "nothing to do for inference; these are the 16-bit values (DeepSpeed's zero_to_fp32 drops them)",
         "zh": "推理无需处理;这些是 16 位的值(DeepSpeed 的 zero_to_fp32 会丢掉它们)"},
    explanation=explanation(
        en=(
            "At ZeRO-1/2, reports parameters that only the checkpoint's 16-bit `module` state dict holds.",
            "DeepSpeed 0.19.8 writes no `frozen_param_shapes` with the bf16 ZeRO-1 optimizer, so "
                "`zero_to_fp32` silently leaves frozen parameters (a frozen base model under LoRA, a frozen "
                "embedding) out of its output, and `load_state_dict(strict=False)` keeps them random.",
            "`bf16.enabled: true`, `zero_optimization.stage: 1`, part of the model with "
                "`requires_grad=False`.",
            "`dsdoctor merge` takes them from the module weights (their trained values, in 16 bits) and "
                "says so; `dsdoctor verify` confirms no weight is missing.",
        ),
        zh=(
            "在 ZeRO-1/2 下,报告只存在于检查点 16 位 `module` state dict 中的参数。",
            "DeepSpeed 0.19.8 在 bf16 ZeRO-1 优化器下不写 `frozen_param_shapes`,于是 `zero_to_fp32` 的输出静默"
                "缺少冻结参数(LoRA 下冻结的基座、冻结的嵌入),`load_state_dict(strict=False)` 让它们保持随机。",
            "`bf16.enabled: true`、`zero_optimization.stage: 1`,部分模型 `requires_grad=False`。",
            "`dsdoctor merge` 从模块权重中取出它们(训练后的值,16 位)并给出说明;`dsdoctor verify` 确认没有缺失权重。",
        ),
    ),
)

rule(
    "DSD413", "implausible-weight-values", "error",
    message={"en": "{count} weight(s) hold values no trained model has (largest |x| {largest} in {worst}, limit "
                   "{limit}): {names}",
             "zh": "{count} 个权重含有训练过的模型不会有的值(最大 |x| {largest},在 {worst},上限 {limit}): {names}"},
    fix={"en": "treat the file as corrupt: merge again from the checkpoint (dsdoctor merge checks every CRC-32) or "
               "copy it again from where it was saved",
         "zh": "把文件当作已损坏:从检查点重新合并(dsdoctor merge 会校验每个 CRC-32),或从保存处重新复制"},
    explanation=explanation(
        en=("Reads every floating parameter (not buffers, which may hold mask constants such as -1e4 or "
                   "the dtype's minimum) one chunk at a time and flags those whose largest magnitude exceeds "
                   "1e4.",
                   "Trained transformer weights stay orders of magnitude below 1e4: they are trained and run in "
                   "16-bit formats whose matmuls overflow long before (fp16 ends at 65504, and a row of 4096 "
                   "weights of 1e4 times unit activations is 4e7), and weight decay pulls them toward 0; the "
                   "largest outliers reported for public LLMs are in the tens to hundreds. Damaged bytes, on "
                   "the other hand, read as floats land above 1e4 for almost half of all bit patterns: 64 "
                   "flipped bytes in a shard made an embedding value of 2.97e38. Such a file loads without "
                   "an error and the model's outputs are garbage or NaN.",
                   "A shard copied over a flaky link: `model.embed_tokens.weight` holds 2.97e38.",
                   "Merge the weights again from the DeepSpeed checkpoint with `dsdoctor merge` (it checks the "
                   "CRC-32 of every zip record it reads), or copy the file again; then verify."),
        zh=("逐块读取每个浮点参数(不含 buffer,它们可能存有 -1e4 或 dtype 最小值之类的掩码常量),"
                  "标出最大绝对值超过 1e4 的参数。",
                  "训练过的 Transformer 权重比 1e4 小几个数量级:它们用 16 位格式训练和运行,矩阵乘法早就会溢出"
                  "(fp16 上限 65504;4096 个 1e4 的权重乘以单位激活就是 4e7),权重衰减也把它们拉向 0;"
                  "公开大模型中报告的最大离群权重在几十到几百。而损坏的字节当作浮点数读时,将近一半的位模式都超过 1e4:"
                  "一个分片里被改写的 64 个字节让嵌入中出现了 2.97e38。这样的文件加载时不报错,模型输出却是乱码或 NaN。",
                  "经由不稳定链路复制的分片: `model.embed_tokens.weight` 中有 2.97e38。",
                  "用 `dsdoctor merge` 从 DeepSpeed 检查点重新合并(它会校验读到的每个 zip 记录的 CRC-32),"
                  "或重新复制文件;然后再验证。"),
    ),
)

rule(
    "DSD414", "stale-partial-output", "warning",
    message={"en": "{path} ({size}) is the partial output of an interrupted dsdoctor run; nothing uses it",
             "zh": "{path}({size})是一次被中断的 dsdoctor 运行留下的不完整输出;没有任何东西使用它"},
    fix={"en": "delete it: rm -rf '{path}'",
         "zh": "删除它: rm -rf '{path}'"},
    explanation=explanation(
        en=("When dsdoctor writes an output folder, it lists the hidden `.NAME.XXXXXXXX.partial` and "
                   "`.NAME.XXXXXXXX.old` folders beside it that carry dsdoctor's marker and that no running "
                   "dsdoctor holds (it holds the output's lock while writing).",
                   "dsdoctor builds every output in such a hidden folder and renames it into place at the end; "
                   "Ctrl-C, SIGTERM, SIGHUP and SIGQUIT remove it, but a run killed with SIGKILL (or by the "
                   "out-of-memory killer, or a power cut) cannot. A merge's partial folder can hold tens of "
                   "gigabytes, invisible to `ls`.",
                   "`kill -9` of `dsdoctor merge ckpt merged/` leaves `.merged.k2j4x9ab.partial`.",
                   "Delete the folder named in the message. dsdoctor never deletes it itself: only you know "
                   "whether something else uses it."),
        zh=("dsdoctor 写输出目录时,会列出旁边带有 dsdoctor 标记、且没有正在运行的 dsdoctor 持有"
                  "(写入时它持有输出的锁)的隐藏目录 `.NAME.XXXXXXXX.partial` 和 `.NAME.XXXXXXXX.old`。",
                  "dsdoctor 的每个输出都先在这样的隐藏目录里生成,最后再改名就位;Ctrl-C、SIGTERM、SIGHUP、SIGQUIT "
                  "会删掉它,但被 SIGKILL(或 OOM killer、断电)杀掉的运行做不到。合并的中间目录可能有几十 GB,`ls` 还看不见。",
                  "`kill -9` 掉 `dsdoctor merge ckpt merged/` 后留下 `.merged.k2j4x9ab.partial`。",
                  "删除消息中给出的目录。dsdoctor 自己从不删除它:只有你知道是否还有别的东西在用。"),
    ),
)

rule(
    "DSD415", "unsafe-model-file-skipped", "warning",
    message={"en": "{file} was not copied into the output: it {problem}",
             "zh": "{file} 没有复制到输出中:它{problem}"},
    phrases={"link_out": {"en": "is a symbolic link out of {folder} (to {target})",
                          "zh": "是指向 {folder} 之外的符号链接(指向 {target})"},
             "not_regular": {"en": "is not a regular file", "zh": "不是普通文件"},
             "unreadable": {"en": "cannot be read ({error})", "zh": "无法读取({error})"}},
    fix={"en": "copy the real file into the model folder (or pass --model with the original model folder) and "
               "merge again",
         "zh": "把真实文件复制到模型目录(或用 --model 指向原始模型目录)后重新合并"},
    explanation=explanation(
        en=("Before copying config.json and the tokenizer files next to the merged weights, checks that "
                   "each is a regular file inside the model folder. A symbolic link is followed only when it "
                   "stays inside the folder, or goes from a Hugging Face cache snapshot to the same "
                   "repository's blobs.",
                   "A checkpoint folder is untrusted input. A `tokenizer.json` that links to `/etc/shadow` or "
                   "`~/.ssh/id_rsa` would be copied into a folder that is then uploaded or shared; a FIFO "
                   "would block the merge forever.",
                   "`ckpt/tokenizer.json -> /etc/shadow`.",
                   "Put the real tokenizer files in the model folder, or point --model at the original model."),
        zh=("在把 config.json 和分词器文件复制到合并后的权重旁边之前,检查每个文件都是模型目录内的普通文件。"
                  "符号链接只有留在目录内、或从 Hugging Face 缓存的 snapshot 指向同一仓库的 blobs 时才会被跟随。",
                  "检查点目录是不可信的输入。指向 `/etc/shadow` 或 `~/.ssh/id_rsa` 的 `tokenizer.json` 会被复制到随后"
                  "上传或分享的目录中;FIFO 会让合并永远阻塞。",
                  "`ckpt/tokenizer.json -> /etc/shadow`。",
                  "把真实的分词器文件放进模型目录,或让 --model 指向原始模型。"),
    ),
)

rule(
    "DSD416", "checkpoint-without-crc", "info",
    message={"en": "{count} checkpoint file(s) were saved without CRC-32 checksums ({files}): damaged bytes in "
                   "them cannot be detected",
             "zh": "{count} 个检查点文件保存时没有 CRC-32 校验和({files}):其中损坏的字节无法被发现"},
    fix={"en": "run `dsdoctor verify` on the output; save future checkpoints with torch's default "
               "(torch.serialization.set_crc32_options(True))",
         "zh": "对输出运行 `dsdoctor verify`;今后保存检查点时使用 torch 的默认设置"
               "(torch.serialization.set_crc32_options(True))"},
    explanation=explanation(
        en=("Reports rank files whose zip records all carry a CRC-32 of 0: torch.save wrote them with "
                   "`torch.serialization.set_crc32_options(False)`.",
                   "`dsdoctor merge` checks the CRC-32 of every record it reads, which catches a flipped byte "
                   "in a shard. Without checksums it can only copy what it finds.",
                   "A training script that turned CRCs off to save faster.",
                   "Keep torch's default, and run `dsdoctor verify` on the merged weights (it flags NaN, Inf "
                   "and implausible values)."),
        zh=("报告所有 zip 记录的 CRC-32 都为 0 的 rank 文件:它们是在 "
                  "`torch.serialization.set_crc32_options(False)` 下由 torch.save 写出的。",
                  "`dsdoctor merge` 会校验读到的每个记录的 CRC-32,能发现分片中被改写的字节;没有校验和时只能照搬。",
                  "为了保存更快而关闭 CRC 的训练脚本。",
                  "保持 torch 的默认设置,并对合并后的权重运行 `dsdoctor verify`(它会标出 NaN、Inf 和不合理的值)。"),
    ),
)
