"""Serving engines for pure batch generation: ``vllm`` and ``sglang``, R replicas of tensor parallelism over K
GPUs each. Estimates: modelled from the engines' documented memory accounting, not measured by dsdoctor.

Memory, per GPU of a replica (K divides the GPUs and the attention heads; K below the key/value heads divides
them, K above replicates them):

* vLLM takes ``gpu_memory_utilization`` (0.9 by default) of the GPU: its weight shard (the linears, the
  embedding and the lm_head split K ways), the activation peak of its profiling forward over
  ``max_num_batched_tokens`` tokens, the sampler's float32 logits for ``max_num_seqs`` sequences, CUDA graphs
  for the decode batch sizes (``CUDA_GRAPHS``, assumed), the CUDA context and NCCL; what is left becomes the
  KV cache, allocated up front in paged blocks of 16 tokens. It refuses to start when the pool cannot hold one
  sequence of ``max_model_len`` tokens (the emitted command sets it to prompt + new tokens).
* SGLang keeps ``mem_fraction_static`` (``SGLANG_STATIC``, about what it picks on an 80 GB GPU) for the weights
  and its KV pool (token granular); activations, logits and CUDA graphs live in the rest of the GPU.

Speed: decode runs as captured CUDA graphs, so there is no eager per-layer launch overhead: one step reads the
shard's weights and the KV cache at the HBM rate (or computes the matmul FLOPs), adds two all-reduces per layer
inside the graph with K > 1 (``GRAPH_ALLREDUCE_S``, assumed) and the engine's own host work per step
(scheduling, input preparation, sampling: Python per step, taken as the machine's per-token eager work of
``generate`` at that batch, measured by calibrate). Prefill is plain's compute over the replica's batch. A
replica serves the sequences its K GPUs would serve as plain ranks (batch x K), as many at once as its KV pool
holds. What the user gives up: training-time features (no ZeRO, no optimizer or gradients) and exact greedy
equality with ``transformers`` ``generate`` (other kernels, batch-dependent numerics).
"""
from __future__ import annotations

import dataclasses
import math

from dsdoctor.plan.loading import plain_methods
from dsdoctor.plan.memory import CUDA_CONTEXT, NCCL_BUFFERS, PathMemory, allocated
from dsdoctor.plan.paths.base import LoadPath
from dsdoctor.plan.paths.plain import plain_layout
from dsdoctor.plan.speed import Speed, _by_batch, _linear_params, _prefill_s, expert_elems
from dsdoctor.plan.workload import Workload

VLLM_UTILIZATION = 0.9  # gpu_memory_utilization's default
SGLANG_STATIC = 0.88  # mem_fraction_static: SGLang picks it from the GPU's memory (assumed)
BLOCK_TOKENS = 16  # vLLM's block_size
MAX_BATCHED_TOKENS = 8192  # the profiling forward's tokens (max_num_batched_tokens)
MAX_NUM_SEQS = 256  # max_num_seqs: the sampler's logits in the profiling run
CUDA_GRAPHS = 512 * 2**20  # per GPU, captured decode graphs (assumed)
GRAPH_ALLREDUCE_S = 15e-6  # one custom all-reduce of a decode step inside a CUDA graph (assumed)


def serving_splits(gpus: int, heads: int, kv_heads: int) -> list[int]:
    """Tensor-parallel degrees K the engines accept on this machine, smallest first."""
    return [k for k in range(1, gpus + 1)
            if gpus % k == 0 and heads % k == 0 and (kv_heads % k == 0 or k % kv_heads == 0)]


def _shard_bytes(shape, b: int, k: int) -> int:
    """Weights on one GPU: linears, embeddings and the lm_head split K ways (vocab-parallel), norms whole."""
    total = 0
    for p in shape.inventory.params:
        split = p.kind in ("linear", "embedding", "lm_head") and len(p.shape) == 2
        total += math.ceil(p.numel / k) if split else p.numel
    return total * b


def _kv_bytes_per_token(shape, b: int, k: int) -> float:
    """KV bytes of one token on one GPU: heads split K ways, at least one key/value head per GPU."""
    per_head = 2 * shape.head_dim
    return sum(max(elems / k, per_head) for elems in shape.kv_elems_per_token) * b


def engine_memory(engine: str, shape, wl: Workload, gpu_memory: int, k: int, context: int | None,
                  share: float | None = None) -> dict:
    """The engine's memory on one GPU of a K-GPU replica: its parts, the KV pool and what fits in it; ``share``:
    vLLM's ``gpu_memory_utilization`` (default 0.9)."""
    b = wl.dtype_bytes
    weights = _shard_bytes(shape, b, k)
    tokens = min(wl.batch * k * wl.prompt_len, MAX_BATCHED_TOKENS)
    profile = Workload(1, max(tokens, 1), 1, wl.dtype)
    act = allocated(plain_layout(1), shape, profile, phases=("prefill",)).gpu_breakdown.get("activations", 0) / k
    logits = MAX_NUM_SEQS * shape.vocab * 4
    outside = (context if context is not None else CUDA_CONTEXT) + (NCCL_BUFFERS if k > 1 else 0)
    if engine == "vllm":
        share = share or VLLM_UTILIZATION
        pool = share * gpu_memory - outside - weights - act - logits - CUDA_GRAPHS
    else:
        share = SGLANG_STATIC
        pool = share * gpu_memory - outside - weights
        pool = min(pool, gpu_memory - outside - weights - act - logits - CUDA_GRAPHS)
    per_token = _kv_bytes_per_token(shape, b, k)
    seq_tokens = wl.prompt_len + wl.new_tokens
    block = BLOCK_TOKENS if engine == "vllm" else 1
    per_seq = math.ceil(seq_tokens / block) * block * per_token
    seqs = int(max(pool, 0) // per_seq) if per_seq else 0
    return {"weights": int(weights), "activations": int(act), "logits": int(logits), "cuda_graphs": CUDA_GRAPHS,
            "outside": int(outside), "share": share, "pool": int(max(pool, 0)), "per_seq": int(per_seq),
            "per_token": per_token, "seqs": seqs, "need": int(weights + act + logits + CUDA_GRAPHS + per_seq)}


def engine_speed(shape, wl: Workload, figures, k: int, batch: int) -> Speed:
    """One generate of ``batch`` sequences on a K-GPU replica, decode as CUDA graphs."""
    b = wl.dtype_bytes
    inv = shape.inventory
    lin, head, emb = _linear_params(shape)
    routed, touched, per_token = expert_elems(shape, batch)  # a MoE reads the experts its tokens chose
    other = inv.num_params - lin - head - routed - (emb if head != emb or not inv.tied else 0)
    read = ((lin + head + touched) / k + max(other, 0)) * b  # as plain's step reads: the embedding is looked up
    avg_ctx = wl.prompt_len + wl.new_tokens / 2
    host = engine_step_s(figures, batch)
    terms = {"weights": max(read / figures.hbm_read, 2 * (lin + head + per_token) / k * batch / figures.matmul_flops),
             "kv_cache": batch * avg_ctx * _kv_bytes_per_token(shape, b, k) / figures.hbm_read,
             "engine_step": host}
    if k > 1:
        terms["allreduce"] = shape.layers * 2 * GRAPH_ALLREDUCE_S
    step = sum(terms.values())
    replica = dataclasses.replace(wl, batch=batch)
    prefill = _prefill_s(shape, replica, k, figures) + host
    total = prefill + max(wl.new_tokens - 1, 0) * step
    bound = "hbm" if terms["weights"] + terms["kv_cache"] >= step / 2 else "overhead"
    return Speed(step, prefill, batch * wl.new_tokens / total, batch / step, bound,
                 {key: round(v, 6) for key, v in terms.items()})


def engine_step_s(figures, batch: int) -> float:
    """The engine's host work per decode step: the machine's per-token eager work of generate at ``batch``."""
    return _by_batch(figures.values, "token", batch)


def vllm_launch(model: str, k: int, replicas: int, dtype: str, max_len: int, seqs: int) -> str:
    return (f"vllm serve {model} --tensor-parallel-size {k}"
            + (f" --data-parallel-size {replicas}" if replicas > 1 else "")
            + f" --gpu-memory-utilization {VLLM_UTILIZATION} --max-model-len {max_len} --max-num-seqs {seqs} "
            f"--dtype {_engine_dtype(dtype)}")


def sglang_launch(model: str, k: int, replicas: int, dtype: str, max_len: int, seqs: int) -> str:
    return (f"python -m sglang.launch_server --model-path {model} --tp {k}" + (f" --dp {replicas}" if replicas > 1 else "")
            + f" --mem-fraction-static {SGLANG_STATIC} --context-length {max_len} --max-running-requests {seqs} "
            f"--dtype {_engine_dtype(dtype)}")


def vllm_code(model: str, k: int, replicas: int, dtype: str, max_len: int, seqs: int) -> str:
    launch = vllm_launch(model, k, replicas, dtype, max_len, seqs)
    groups = "one such process per group of GPUs, CUDA_VISIBLE_DEVICES=0,1,...\n" if replicas > 1 else "\n"
    return (f"# vLLM, {_split(k, replicas)} (an estimate, not measured by dsdoctor); as a server:\n#   {launch}\n"
            f"# or offline batch generation on one replica ({groups.rstrip() or 'all GPUs'}):\n"
            "from vllm import LLM, SamplingParams\n"
            f"llm = LLM(model={model!r}, tensor_parallel_size={k}, gpu_memory_utilization={VLLM_UTILIZATION}, "
            f"max_model_len={max_len}, dtype={_engine_dtype(dtype)!r})\n"
            "outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=N))\n" + GIVES_UP)


def sglang_code(model: str, k: int, replicas: int, dtype: str, max_len: int, seqs: int) -> str:
    launch = sglang_launch(model, k, replicas, dtype, max_len, seqs)
    return (f"# SGLang, {_split(k, replicas)} (an estimate, not measured by dsdoctor); as a server:\n#   {launch}\n"
            "# or offline batch generation:\nimport sglang as sgl\n"
            f"llm = sgl.Engine(model_path={model!r}, tp_size={k}, dp_size={replicas}, "
            f"mem_fraction_static={SGLANG_STATIC}, context_length={max_len})\n"
            "outs = llm.generate(prompts, {\"temperature\": 0.0, \"max_new_tokens\": N})\n" + GIVES_UP)


GIVES_UP = ("# what you give up: training-time features (no ZeRO, optimizer or gradients in the engine), and greedy\n"
            "# outputs token-for-token equal to transformers' generate (other kernels, batch-dependent numerics)\n")


def _engine_dtype(dtype: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]


def _split(k: int, replicas: int) -> str:
    return f"{replicas} replica(s) of tensor parallelism over {k} GPU(s)"


class Vllm(LoadPath):
    """vLLM: the tensor-parallel degree K (with GPUs / K replicas) that fits and generates the most tokens per
    second on the machine; when none fits, the largest."""
    name = "vllm"
    engine = "vllm"
    estimate = True
    searched = False
    serving = True

    def __init__(self):
        self.k = 1  # GPUs per replica (the row's ranks; ``tp`` stays AutoTP's)

    @classmethod
    def instances(cls, ctx):
        splits = serving_splits(ctx.hw.gpus, ctx.shape.heads, ctx.shape.kv_heads)
        return [cls()] if splits else []

    def _split(self, ctx, wl) -> tuple[int, dict]:
        splits = serving_splits(ctx.hw.gpus, ctx.shape.heads, ctx.shape.kv_heads)
        best = None
        for k in splits:
            info = engine_memory(self.engine, ctx.shape, wl, ctx.hw.gpu_memory, k, ctx.context_bytes)
            if info["seqs"] >= 1:
                batch = min(wl.batch * k, info["seqs"])
                machine = engine_speed(ctx.shape, wl, ctx.figures, k, batch).tokens_per_s * (ctx.hw.gpus // k)
                if best is None or machine > best[0]:
                    best = (machine, k, info)
        if best is not None:
            return best[1], best[2]
        k = splits[-1]
        return k, engine_memory(self.engine, ctx.shape, wl, ctx.hw.gpu_memory, k, ctx.context_bytes)

    def memory(self, ctx, wl, ratio=None):
        k, info = self._split(ctx, wl)
        self.k = k
        replicas = ctx.hw.gpus // k
        batch = min(wl.batch * k, max(info["seqs"], 1))
        kv = int(min(info["pool"], batch * info["per_seq"])) if info["seqs"] else info["per_seq"]
        parts = {"weights_resident": info["weights"], "activations": info["activations"], "logits": info["logits"],
                 "cuda_graphs": info["cuda_graphs"], "kv_cache": kv}
        peak = sum(parts.values())
        # the engine takes its share of the GPU whatever the workload; outside it: the context, NCCL and the
        # memory the engine leaves unused, so that reserved + outside is the GPU's memory when it fits
        taken = int(info["share"] * ctx.hw.gpu_memory) - info["outside"]
        reserved = max(taken, info["need"])
        outside = info["outside"] + ctx.hw.gpu_memory - int(info["share"] * ctx.hw.gpu_memory)
        notes = [f"{_split(k, replicas)}; KV pool {info['pool'] / 2**30:.1f} GiB per GPU holds {info['seqs']} "
                 f"sequence(s) of {wl.prompt_len + wl.new_tokens} tokens; {batch} served at once per replica",
                 "assumed: CUDA graphs 512 MiB per GPU, graph all-reduce 15 us; engine step = generate's per-token "
                 "eager work (not measured for the engine)"]
        mem = PathMemory(self.name, k, replicas, int(peak), int(outside), 0, "decode", parts, {}, info["weights"], 0,
                         notes)
        mem.with_reserved(reserved)
        mem.fragmentation_bytes = 0
        self._info, self._batch = info, batch
        return mem

    def loading_methods(self, ctx, mem):
        methods = plain_methods(ctx.ckpt, ctx.wl.dtype, ctx.hw.gpus, ctx.weights)[:1]
        methods[0].method, methods[0].assumes = "engine", self.engine
        methods[0].notes = [f"{self.engine} maps the safetensors files; each worker reads its own slices"]
        return methods

    def speed(self, ctx, mem):
        return engine_speed(ctx.shape, ctx.wl, ctx.figures, mem.ranks, self._batch)

    def _args(self, ctx) -> tuple:
        return (ctx.model, self.k, ctx.hw.gpus // self.k, ctx.run_dtype, ctx.wl.prompt_len + ctx.wl.new_tokens,
                max(self._batch, 1))

    def code(self, ctx, row):
        return (vllm_code if self.engine == "vllm" else sglang_code)(*self._args(ctx))

    def launch(self, ctx) -> str:
        """The one-line server command (DSD223 quotes it)."""
        return (vllm_launch if self.engine == "vllm" else sglang_launch)(*self._args(ctx))

    def row(self, ctx, mem, speed, fit, method, methods, searched):
        info = self._info
        tokens = int(info["pool"] // info["per_token"]) if info["per_token"] else 0
        if ctx.pos_limit:
            tokens = min(tokens, ctx.pos_limit)
        max_prompt = tokens - ctx.wl.new_tokens
        return super().row(ctx, mem, speed, fit, method, methods,
                           (info["seqs"] or None, max_prompt if max_prompt and max_prompt > 0 else None))


class Sglang(Vllm):
    name = "sglang"
    engine = "sglang"
