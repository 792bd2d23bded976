"""DSD5xx: what ``dsdoctor compare`` finds when the same weights go through different load paths.
Torch-free: imported by ``dsdoctor explain``."""
from dsdoctor.findings import explanation, rule

OUTPUT_MISMATCH = rule(
    "DSD501", "output-mismatch", "error",
    message={
        "en": "{other} differs from {ref} on {count}/{total} prompts: prompt {prompt}, generated position "
              "{position}, token {token_ref} vs {token_other}; the reference's top-2 margin there is {margin}, "
              "the largest logit difference over the shared prefix {max_diff} (tolerance {tol})",
        "zh": "{other} 与 {ref} 的输出在 {count}/{total} 个提示上不一致：提示 {prompt} 的第 {position} 个生成位置，"
              "token {token_ref} 对 {token_other}；参考结果在该处的 top-2 logit 差为 {margin}，"
              "共同前缀上的最大 logit 差为 {max_diff}（容差 {tol}）",
    },
    fix={
        "en": "Do not trust the {other} load: check which weights it really loaded (dsdoctor verify) and how "
              "its config differs from {ref}",
        "zh": "不要信任 {other} 的加载结果：检查它实际加载的权重（dsdoctor verify）以及其配置与 {ref} 的区别",
    },
    explanation=explanation(
        en=(
            """\
Runs the same prompts through two load paths (or two weight directories) with greedy decoding and
finds a position where the chosen tokens differ although the reference had a clear winner there,
or where the logits already differed beyond the dtype's tolerance before the tokens split.
""",
            """\
Greedy decoding of the same weights on the same inputs is deterministic up to rounding. A split on a
clear winner means the two paths compute different functions: a tensor missing, zeroed, transposed
or loaded into the wrong layer, a ZeRO-3 checkpoint saved without gathering (empty tensors), a merge
that dropped a shard, or a tensor-parallel split along the wrong dimension.
""",
            """\
dsdoctor compare ./merged ./reference
-> B differs from A on 4/4 prompts: prompt 0, generated position 0, token 59 vs 17 ...
""",
            """\
Find the broken tensor: `dsdoctor verify` the merged weights against the ZeRO shards, and rerun
`dsdoctor compare` until every prompt matches.
""",
        ),
        zh=(
            """\
用贪心解码让同一组提示分别经过两种加载方式（或两个权重目录），找出参考结果在某位置有明确最优 token
而两边选的 token 却不同的情况，或在 token 分叉之前 logit 差已超过该精度容差的情况。
""",
            """\
同一权重、同一输入的贪心解码除舍入误差外是确定的。在明确最优处分叉，说明两种加载方式算的是不同的
函数：某个张量缺失、被置零、被转置或加载到了错误的层，ZeRO-3 检查点未聚合就保存（空张量），合并时
丢了分片，或张量并行沿错误的维度切分。
""",
            """\
dsdoctor compare ./merged ./reference
-> B 与 A 的输出在 4/4 个提示上不一致：提示 0 的第 0 个生成位置，token 59 对 17 ...
""",
            """\
找出出错的张量：用 `dsdoctor verify` 对照 ZeRO 分片检查合并后的权重，再运行 `dsdoctor compare`
直到所有提示都一致。
""",
        ),
    ),
)

NEAR_TIE = rule(
    "DSD502", "near-tie-divergence", "info",
    message={
        "en": "{other} and {ref} split on {count}/{total} prompts at near-ties only (prompt {prompt}, position "
              "{position}: token {token_ref} vs {token_other}, within {gap} of each other, tolerance {tol}); "
              "the logits agreed before that",
        "zh": "{other} 与 {ref} 仅在近似平局处分叉（{count}/{total} 个提示；提示 {prompt} 第 {position} 个位置："
              "token {token_ref} 对 {token_other}，两者 logit 相差 {gap}，容差 {tol}）；此前 logit 一致",
    },
    fix={
        "en": "Nothing to fix; to confirm, rerun with --dtype fp32, where the split should disappear",
        "zh": "无需修复；如需确认，用 --dtype fp32 重新运行，分叉应当消失",
    },
    explanation=explanation(
        en=(
            """\
Reports a token split where the reference's own top choice and the other path's choice were within
twice the dtype tolerance of each other, and the logits matched within tolerance up to that point.
""",
            """\
It is not. Known non-equivalences reorder floating-point sums and move logits by a few ulps:
tensor-parallel all-reduce, kernel injection (fused kernels), ZeRO-3 gathered weights used by other
kernels, ZeRO weight quantization (zero_quantized_weights, lossy by design), and init_inference's fp16
default for a bf16 model. On a near-tie, a few ulps pick the other token and the continuations then
differ completely, which looks alarming but is rounding.
""",
            """\
tp differs at position 9, where the reference's top-2 margin was 0.004 (tolerance 0.1 in bf16).
""",
            """\
Rerun with --dtype fp32 to confirm the load is exact; keep the dtype and kernels the same in the paths
you compare.
""",
        ),
        zh=(
            """\
当分叉位置上参考结果的首选与另一路径的选择相差不超过两倍精度容差、且此前 logit 在容差内一致时报告。
""",
            """\
这并不是问题。已知的非等价会改变浮点求和顺序，使 logit 相差几个 ulp：张量并行的 all-reduce、内核注入
（融合内核）、ZeRO-3 聚合后的权重走不同内核、ZeRO 权重量化（zero_quantized_weights，本就有损），以及
init_inference 对 bf16 模型默认使用 fp16。在近似平局处，几个 ulp 就会选中另一个 token，之后的生成完全
不同，看起来吓人，实为舍入。
""",
            """\
tp 在第 9 个位置分叉，参考结果在该处的 top-2 差仅为 0.004（bf16 容差 0.1）。
""",
            """\
用 --dtype fp32 重新运行以确认加载是精确的；比较的各路径保持相同的数据类型和内核。
""",
        ),
    ),
)

LOGITS_DRIFT = rule(
    "DSD503", "logits-drift", "error",
    message={
        "en": "{other} generated the same tokens as {ref} but its logits differ by up to {max_diff}, {times}x the "
              "tolerance {tol} (prompt {prompt}, position {position}): the two loads are not the same model",
        "zh": "{other} 生成的 token 与 {ref} 相同，但 logit 最多相差 {max_diff}，是容差 {tol} 的 {times} 倍（提示 "
              "{prompt}，第 {position} 个位置）：两次加载的不是同一个模型",
    },
    fix={
        "en": "Do not trust the {other} load: find the tensor that differs (dsdoctor verify the weights, or diff "
              "the two state dicts) before using it",
        "zh": "不要信任 {other} 的加载结果：先找出不同的张量（用 dsdoctor verify 检查权重，或逐个对比两份 "
              "state dict）再使用",
    },
    explanation=explanation(
        en=(
            """\
Reports a load path whose greedy tokens match the reference on every prompt while its logits differ
by more than the dtype tolerance somewhere, on inputs that were still identical.
""",
            """\
Greedy tokens are a coarse check: a small model, or a few generated tokens, can pick the same argmax
with one MLP weight zeroed, a norm weight off or a layer loaded twice. The tolerance already covers
what reordered float sums do (tensor-parallel all-reduce, gathered ZeRO-3 weights, other kernels), so
logits beyond it on the same inputs mean the two loads compute different functions, whatever the
tokens say. This is an error, like a token mismatch (DSD501); only a split at a near-tie after logits
that agreed is rounding (DSD502).
""",
            """\
A vs B, fp32: same 16 tokens on 4 prompts, max logit difference 2.62 (tolerance 0.07).
""",
            """\
Find the tensor that differs: `dsdoctor verify` the weights, or compare the two state dicts tensor by
tensor; rerun `dsdoctor compare` until the logits agree.
""",
        ),
        zh=(
            """\
当某加载方式在所有提示上的贪心 token 都与参考一致、但在输入仍相同的位置上 logit 相差超过精度容差时报告。
""",
            """\
贪心 token 只是粗略的检查：小模型或少量生成 token 时，即使某个 MLP 权重被置零、某个 norm 权重不对或某层
被加载两次，argmax 也可能相同。容差已经涵盖了浮点求和顺序改变的影响（张量并行 all-reduce、ZeRO-3 聚合
后的权重、不同内核），所以相同输入上超过容差的 logit 差说明两次加载算的是不同的函数，无论 token 是否
一致。它与 token 不一致（DSD501）一样是错误；只有在此前 logit 一致的近似平局处分叉才是舍入（DSD502）。
""",
            """\
A 对 B，fp32：4 个提示上 16 个 token 相同，但最大 logit 差为 2.62（容差 0.07）。
""",
            """\
找出不同的张量：用 `dsdoctor verify` 检查权重，或逐个张量对比两份 state dict；重新运行
`dsdoctor compare` 直到 logit 一致。
""",
        ),
    ),
)


PATH_FAILED = rule(
    "DSD504", "load-path-failed", "error",
    message={
        "en": "the {path} load path failed: {error}",
        "zh": "{path} 加载方式运行失败：{error}",
    },
    fix={
        "en": "Read the worker log ({log}) and fix the load before comparing its outputs",
        "zh": "查看工作进程日志（{log}），先修复加载问题再比较输出",
    },
    explanation=explanation(
        en=(
            """\
Reports a load path whose worker (in this process, or the ranks started through DeepSpeed's launcher
or torchrun) crashed, timed out or wrote no record, so its outputs could not be compared.
""",
            """\
A path that cannot run cannot be trusted either; the usual causes are a DeepSpeed config the engine
rejects, a tensor-parallel size that does not divide the attention heads, an out-of-memory error, or
missing compiled ops on this machine.
""",
            """\
the tp load path failed: ranks exited with status 1: AssertionError: ...
""",
            """\
Read the last lines of the worker log shown in the report, fix the cause, rerun.
""",
        ),
        zh=(
            """\
当某加载方式的工作进程（本进程内，或经 DeepSpeed 启动器 / torchrun 启动的各 rank）崩溃、超时或未写出
结果，导致无法比较其输出时报告。
""",
            """\
无法运行的加载方式同样不可信；常见原因：DeepSpeed 引擎拒绝的配置、张量并行数不能整除注意力头数、
显存不足，或本机缺少编译好的算子。
""",
            """\
tp 加载方式运行失败：ranks exited with status 1: AssertionError: ...
""",
            """\
查看报告中给出的工作进程日志末尾，修复原因后重新运行。
""",
        ),
    ),
)

TP_NUMERICS = rule(
    "DSD505", "tensor-parallel-numerics", "info",
    message={
        "en": "{other} splits every matmul over {ranks} ranks and all-reduces partial sums: outputs are not "
              "bit-identical to {ref} (largest logit difference {max_diff}, tolerance {tol})",
        "zh": "{other} 将每个矩阵乘法切分到 {ranks} 个 rank 并对部分和做 all-reduce：输出与 {ref} 并非逐位相同"
              "（最大 logit 差 {max_diff}，容差 {tol}）",
    },
    fix={
        "en": "Judge tensor-parallel outputs by the tolerance, not by bit equality",
        "zh": "按容差而不是逐位相等来评判张量并行的输出",
    },
    explanation=explanation(
        en=(
            """\
Notes that a tensor-parallel load (deepspeed.init_inference with tensor_parallel, or AutoTP) was
compared and explains why its logits differ slightly from a single-device load.
""",
            """\
It is expected: each rank computes a partial matmul and an all-reduce adds the parts, so floating-point
sums happen in another order. dsdoctor runs tensor parallelism without kernel injection
(replace_with_kernel_inject=False) and with the dtype passed explicitly, so this reordering is the
only difference left; kernel injection and ZeRO weight quantization would add more.
""",
            """\
tp vs plain, bf16, 2 ranks: largest logit difference 0.03, tolerance 0.1: match.
""",
            """\
Nothing to change; if you use kernel injection in production, compare that configuration too.
""",
        ),
        zh=(
            """\
说明比较中包含张量并行加载（带 tensor_parallel 的 deepspeed.init_inference 或 AutoTP），并解释其 logit
为何与单卡加载略有不同。
""",
            """\
这是预期行为：每个 rank 计算部分矩阵乘法，再由 all-reduce 求和，浮点求和顺序因此改变。dsdoctor 运行
张量并行时不注入内核（replace_with_kernel_inject=False）并显式传入 dtype，所以剩下的唯一差异就是这种
重排；内核注入和 ZeRO 权重量化会带来更多差异。
""",
            """\
tp 对 plain，bf16，2 个 rank：最大 logit 差 0.03，容差 0.1：一致。
""",
            """\
无需修改；如果生产环境使用内核注入，也请比较那种配置。
""",
        ),
    ),
)

INIT_INFERENCE_DTYPE = rule(
    "DSD506", "init-inference-dtype-default", "info",
    message={
        "en": "deepspeed.init_inference casts the model to fp16 unless dtype is given; dsdoctor passed "
              "dtype={dtype} so {other} computes in the same dtype as {ref}",
        "zh": "deepspeed.init_inference 在未指定 dtype 时会把模型转为 fp16；dsdoctor 显式传入了 dtype={dtype}，"
              "因此 {other} 与 {ref} 使用相同的数据类型计算",
    },
    fix={
        "en": "Pass dtype={torch_dtype} to init_inference in your own code too",
        "zh": "在你自己的代码中也给 init_inference 传入 dtype={torch_dtype}",
    },
    explanation=explanation(
        en=(
            """\
Reminds that init_inference's dtype defaults to fp16 (DeepSpeed 0.19.8) whenever a tensor-parallel
path is compared.
""",
            """\
A bf16 model silently cast to fp16 can overflow in activations and gives outputs that differ from the
bf16 reference; the comparison would blame the load path for a dtype change.
""",
            """\
deepspeed.init_inference(model, tensor_parallel={"tp_size": 2})   # runs in fp16
""",
            """\
deepspeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.bfloat16)
""",
        ),
        zh=(
            """\
比较张量并行路径时提醒：init_inference 的 dtype 默认为 fp16（DeepSpeed 0.19.8）。
""",
            """\
bf16 模型被悄悄转成 fp16 后激活可能溢出，输出与 bf16 参考不同；比较结果会把数据类型的变化误判为
加载问题。
""",
            """\
deepspeed.init_inference(model, tensor_parallel={"tp_size": 2})   # 以 fp16 运行
""",
            """\
deepspeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.bfloat16)
""",
        ),
    ),
)
