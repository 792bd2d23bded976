"""The measurements of ``dsdoctor calibrate``: each a small function that imports torch itself and returns
plain numbers (bytes/s, seconds, FLOP/s). Nothing here is fitted: every figure is timed on this machine.

Timing rule: warm up once, synchronize, time several repetitions, keep the median (the fastest is an
optimist, the mean is hurt by one hiccup of a shared host).
"""
from __future__ import annotations

import os
import statistics
import time

from dsdoctor.model.exact import count_parameters

MiB = 1024**2


def _median_time(fn, reps: int, sync=None) -> float:
    fn()
    if sync:
        sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------ host side

def host_memcpy_bandwidth(size: int = 256 * MiB) -> float:
    """Bytes/s of one host memcpy (read + write counted once, as a copy's size)."""
    import torch

    src = torch.empty(size, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), 5)
    return size / t


def cpu_matmul_flops(n: int = 1024) -> float:
    import torch

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    t = _median_time(lambda: a @ b, 5)
    return 2 * n**3 / t


# ------------------------------------------------------------------------------------------ GPU side

def _sync():
    import torch

    torch.cuda.synchronize()


def transfer_bandwidths(size: int = 256 * MiB) -> dict:
    """Host<->device bytes/s, pinned and pageable, plus the latency of one small pinned copy."""
    import torch

    out = {}
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    for pinned in (True, False):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)
        kind = "pinned" if pinned else "pageable"
        t = _median_time(lambda h=host, p=pinned: dev.copy_(h, non_blocking=p), 5, _sync)
        out[f"h2d_{kind}"] = size / t
        t = _median_time(lambda h=host: h.copy_(dev, non_blocking=False), 5, _sync)
        out[f"d2h_{kind}"] = size / t
        del host
    small = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    dsmall = torch.empty(4096, dtype=torch.uint8, device="cuda")
    out["h2d_latency_s"] = _median_time(lambda: dsmall.copy_(small, non_blocking=True), 50, _sync)
    return out


def hbm_bandwidth(size: int = 1024 * MiB) -> dict:
    """Device copy bandwidth (bytes read + written per second) and the read rate of a batch-1 matmul over a
    large weight: what a decode step does to every weight."""
    import torch

    a = torch.empty(size, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = _median_time(lambda a=a, b=b: b.copy_(a), 10, _sync)
    copy_bw = 2 * size / t
    del a, b
    k, n = 8192, 28672  # one 8B-model MLP weight, 470 MB
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    rates = {}
    for m in (1, 16, 64):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        t = _median_time(lambda x=x: torch.nn.functional.linear(x, w), 10, _sync)
        rates[m] = n * k * 2 / t
    return {"hbm_copy": copy_bw, "hbm_weight_read": rates[1], "weight_read_by_batch": rates}


def matmul_flops() -> dict:
    """bf16 matmul FLOP/s at a large square shape and at prefill-like shapes (tokens x hidden x out)."""
    import torch

    out = {}
    for name, (m, k, n) in {"square_8192": (8192, 8192, 8192), "tokens_2048_k4096_n14336": (2048, 4096, 14336),
                            "tokens_512_k4096_n4096": (512, 4096, 4096)}.items():
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        t = _median_time(lambda a=a, b=b: torch.nn.functional.linear(a, b), 10, _sync)
        out[name] = 2 * m * k * n / t
    return out


def attention_flops(batch: int = 4, seq: int = 2048, heads: int = 32, head_dim: int = 128) -> float:
    """Causal SDPA FLOP/s (4 * b * h * s^2 * d / 2 useful FLOPs) at a prefill shape."""
    import torch

    q = torch.randn(batch, heads, seq, head_dim, dtype=torch.bfloat16, device="cuda")
    t = _median_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), 10, _sync)
    return 4 * batch * heads * seq * seq * head_dim / 2 / t


def context_bytes() -> dict:
    """Device memory this process uses outside the caching allocator (CUDA context, cuBLAS handles):
    used per cudaMemGetInfo minus torch's reserved, on a GPU nothing else uses."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    others = None
    try:
        procs = torch.cuda.list_gpu_processes()
        others = max(procs.count("process") - 1, 0) if "process" in procs else None
    except Exception:
        pass
    return {"context_bytes": total - free - reserved, "gpu_total_bytes": total, "other_processes": others}


# ---------------------------------------------------------------------------------- eager overheads

def stack_config(layers: int, hidden: int = 2048, inter: int = 8192, vocab: int = 1024):
    """A small stack of real-size Llama decoder layers (a 1B model's layer shape) with a small vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=hidden // 128, num_key_value_heads=max(hidden // 256, 1), head_dim=128,
                       vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False)


def _decode_step_seconds(model, batch: int, device, new: int = 24, prompt: int = 16, reps: int = 3,
                         warm: bool = True) -> float:
    """Per generated token, prefill excluded: (t(1 + new) - t(1)) / new."""
    import torch

    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=device)
    kw = dict(do_sample=False, pad_token_id=0)

    def gen(n):
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, **kw)

    sync = _sync if device.type == "cuda" else None
    if warm:
        gen(2)
    t1 = _median_time(lambda: gen(1), reps, sync)
    tn = _median_time(lambda: gen(1 + new), reps, sync)
    return max(tn - t1, 0.0) / new


def _settle(fn, tolerance: float = 0.05, tries: int = 5) -> int:
    """Run ``fn`` (returns seconds) until two runs in a row agree within ``tolerance``: a fresh machine's
    first seconds (clocks, caches, lazy initialisation) measured 2x slow on the H200 host (bench/speed runs
    1 and 3). Returns the runs it took."""
    prev = fn()
    for n in range(2, tries + 1):
        cur = fn()
        if abs(cur - prev) <= tolerance * max(prev, 1e-9):
            return n
        prev = cur
    return tries


def eager_overheads(device_type: str = "cuda", batches=(1, 16, 64), layer_counts=(2, 8), hbm_read=None,
                    hidden: int = 2048, inter: int = 8192, extend_s: float = 25.0) -> dict:
    """Per decoder layer and per generated token, the host-side time of eager PyTorch + transformers'
    generate: a small stack of real-size Llama layers at 2 and 8 layers, per batch; the per-layer
    difference minus the layer's weight read at the measured HBM rate. Interleaved and repeated, the
    median kept, so that one slow moment of a shared host does not decide."""
    import torch
    from transformers import LlamaForCausalLM

    device = torch.device(device_type)
    lo, hi = layer_counts
    models = {}
    for n in (lo, hi):
        with torch.device(device):
            models[n] = LlamaForCausalLM(stack_config(n, hidden, inter)).to(torch.bfloat16).eval()
    weight_s = 2 * count_parameters(models[lo].model.layers[0]) / hbm_read if hbm_read else 0.0  # bf16
    settle = _settle(lambda: _decode_step_seconds(models[hi], 1, device, new=16, reps=1))
    samples = {b: ([], []) for b in batches}
    start = time.perf_counter()
    rounds = 0
    # rounds over all batches (a slow moment touches one round of each, not one batch), at least 3; more,
    # up to 6 and ``extend_s`` seconds, while the last 3 rounds disagree by more than 10% at some batch: a
    # freshly started H200 host read 25-100% slow for its first minute (bench/speed runs 1, 3 and 4)
    while rounds < 3 or (rounds < 6 and time.perf_counter() - start < extend_s
                         and max(_spread(samples[b][0][-3:]) for b in batches) > 0.10):
        for batch in batches:
            steps = {n: _decode_step_seconds(models[n], batch, device, new=16, reps=1, warm=rounds == 0)
                     for n in (lo, hi)}
            per_layer = (steps[hi] - steps[lo]) / (hi - lo)
            samples[batch][0].append(max(per_layer - weight_s, 0.0))
            samples[batch][1].append(max(steps[lo] - lo * per_layer, 0.0))
        rounds += 1
    out = {}
    for batch, (layer, token) in samples.items():  # the last 3 rounds
        out[batch] = {"layer_s": statistics.median(layer[-3:]), "token_s": statistics.median(token[-3:]),
                      "layer_spread": _spread(layer[-3:]), "layer_rounds_s": layer}
    out["settle_runs"] = settle
    out["rounds"] = rounds
    return out


def _spread(xs) -> float:
    return (max(xs) - min(xs)) / max(statistics.median(xs), 1e-9) if xs else 0.0


def _hooked(model) -> int:
    """Modules whose forward runs (ModuleList/ModuleDict hold hooks that never fire)."""
    import torch

    return sum(1 for m in model.modules() if not isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)))


def zero3_hook_cost(offload: bool = False, layers: int = 4) -> dict:
    """ZeRO-3's per-module fetch/release hooks on one GPU: a small stack of real-size decoder layers' decode
    step under ``deepspeed.initialize`` (stage 3, no optimizer) minus the same model loaded plainly, per
    hooked module. With ``offload`` the bytes copied from the host are subtracted at the measured rate by
    the caller's model, not here: this is the time beyond plain."""
    import deepspeed
    import torch
    import transformers.generation.utils  # noqa: F401  (a lazy import inside zero.Init breaks)
    from transformers import LlamaForCausalLM

    device = torch.device("cuda", torch.cuda.current_device())
    cfg = stack_config(layers)
    with torch.device(device):
        plain = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    modules = _hooked(plain)
    params = sum(1 for _ in plain.parameters())
    nbytes = count_parameters(plain) * 2
    zero = {"stage": 3}
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
              "steps_per_print": 10**9}
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        model = LlamaForCausalLM(cfg)
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.module.eval()
    _decode_step_seconds(plain, 1, device, new=4, reps=1)
    _decode_step_seconds(engine.module, 1, device, new=4, reps=1)
    t_plain, t_zero = [], []
    for _ in range(3):  # alternated, so that a slow moment of the host falls on both
        t_plain.append(_decode_step_seconds(plain, 1, device, new=16, reps=1, warm=False))
        t_zero.append(_decode_step_seconds(engine.module, 1, device, new=16, reps=1, warm=False))
    try:
        engine.destroy()
    except Exception:
        pass
    del engine, model, plain
    tp, tz = statistics.median(t_plain), statistics.median(t_zero)
    return {"extra_s": max(tz - tp, 0.0), "modules": modules, "params": params, "param_bytes": nbytes,
            "plain_step_s": tp, "zero3_step_s": tz, "plain_steps_s": t_plain, "zero3_steps_s": t_zero}


def nvme_read_bandwidth(path: str, size: int = 512 * MiB) -> float:
    """Sequential read bytes/s of a fresh file under ``path``, with its pages dropped from the cache first.
    The file is removed at the end, on an error and on SIGINT/SIGTERM/SIGHUP/SIGQUIT."""
    from dsdoctor import door

    with door.probe_file(path, ".dsdoctor-calibrate-") as (fd, name):
        chunk = os.urandom(8 * MiB)
        with os.fdopen(fd, "wb") as fh:
            for _ in range(size // len(chunk)):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        rfd = door.open_fd(name, door.PROBE)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            read = 0
            while True:
                b = os.read(rfd, 8 * MiB)
                if not b:
                    break
                read += len(b)
            return read / (time.perf_counter() - t0)
        finally:
            os.close(rfd)
