"""Host memory of loading a checkpoint, per loading method (issue 12 item 4).

A process's resident memory has two kinds of pages, and they count differently:

* **anonymous** (``RssAnon``): heap, tensors materialized on the CPU, pinned buffers. Never shared between
  processes and never reclaimed: this is what runs a host (or a container) out of memory.
* **file-backed** (``RssFile``): a memory-mapped checkpoint's pages. Every process that maps the same file
  shows them in its RSS, but the page cache holds them once; the kernel can drop them under pressure
  (clean pages), and a cgroup charges them once. ``ps`` sums them per process; ``free`` does not.

What transformers 5 and DeepSpeed 0.19 do (read in their sources, measured by ``bench/plan/loading_gpu.py``):

* ``from_pretrained`` of safetensors memory-maps every shard (``safe_open(..., backend="mmap")``), builds the
  model on the meta device and materializes each tensor on its target device; with ``device_map="cuda"`` the
  mapped shards stay open until the end of the load, so the whole checkpoint shows as file-backed RSS.
* on the CPU, a tensor whose dtype matches the checkpoint's stays a view of the mapping (no copy);
  a dtype conversion materializes an anonymous copy of every weight.
* ``.bin`` checkpoints: ``torch.load(mmap=True, weights_only=True)`` for the zip format (file-backed), all
  shards' state dicts merged before loading; the legacy (pre-zip) format is read whole (anonymous).
* under ZeRO-3 (``HfDeepSpeedConfig`` kept alive), rank 0 maps the checkpoint on the CPU and the other ranks
  only read keys on the meta device; each module is built under ``zero.Init`` and partitioned.
* ``deepspeed.init_inference`` (AutoTP) slices whatever model it gets: built on the CPU by each rank, every
  rank maps (or, with a dtype conversion, copies) the whole model; from a meta-device model with a checkpoint
  description (``checkpoint=`` JSON, kernel injection) each rank reads one checkpoint file at a time; from a
  pre-sharded checkpoint (``save_mp_checkpoint_path``) each rank reads only its own slice files.

Per process, python + torch + the CUDA runtime hold about ``PROCESS_BASE`` of anonymous memory.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

GiB = 1024**3
PROCESS_BASE = 1 * GiB  # python, torch, CUDA runtime: anonymous, per process (13.5 GiB measured - 12.6 GiB mapped)
DEFAULT_SHARD = 5 * 10**9  # assumed when the directory has no weights: most published checkpoints use 5 GB shards
# (transformers 4 save_pretrained; transformers 5 writes 50 GB shards)


@dataclass
class Checkpoint:
    """What the model directory holds: format, dtype, total bytes and the largest file."""
    format: str  # safetensors | bin | bin-legacy | unknown
    total_bytes: int
    largest_file_bytes: int
    files: int
    dtype: str | None
    seen: bool  # read from the directory (False: assumed)

    def to_dict(self) -> dict:
        return asdict(self)


def find_checkpoint(config_path: str | None, weights_bytes: int, dtype: str | None) -> Checkpoint:
    """The checkpoint next to ``config.json``; without files, a safetensors checkpoint is assumed."""
    files: list[tuple[str, int]] = []
    directory = Path(config_path).parent if config_path else None
    fmt = "unknown"
    if directory is not None and directory.is_dir():
        for pattern, kind in (("*.safetensors", "safetensors"), ("*.bin", "bin")):
            found = [(p.name, p.stat().st_size) for p in sorted(directory.glob(pattern)) if p.is_file()]
            if found:
                files, fmt = found, kind
                break
        if fmt == "bin" and files:
            try:  # the zip format (torch >= 1.6) starts with PK; older pickles are read whole
                with open(directory / files[0][0], "rb") as fh:
                    if fh.read(2) != b"PK":
                        fmt = "bin-legacy"
            except OSError:
                pass
    if files:
        total = sum(s for _, s in files)
        return Checkpoint(fmt, total, max(s for _, s in files), len(files), dtype, True)
    largest = min(weights_bytes, DEFAULT_SHARD)
    return Checkpoint("safetensors", weights_bytes, largest, max(1, -(-weights_bytes // DEFAULT_SHARD)), dtype, False)


@dataclass
class HostLoad:
    """Host memory of one loading method, all processes of the machine together."""
    method: str
    anon_bytes: int  # anonymous pages: heap, CPU copies, pinned buffers (decides fits)
    file_bytes: int  # file-backed pages mapped at once, counted once (the page cache)
    file_rss_bytes: int  # file-backed pages as the processes' RSS shows them (summed over processes)
    processes: int
    code: str  # what to write
    notes: list = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """What must fit in host memory: anonymous pages. Mapped checkpoint pages are clean and file-backed:
        the kernel (and a cgroup limit) reclaims them under pressure instead of failing; they cost speed."""
        return self.anon_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["peak_bytes"] = self.peak_bytes
        return d


def _converts(ckpt: Checkpoint, load_dtype: str) -> bool:
    return ckpt.dtype is not None and ckpt.dtype != load_dtype


def plain_methods(ckpt: Checkpoint, load_dtype: str, procs: int, weights: int) -> list[HostLoad]:
    """One process per GPU, each loading the whole model."""
    base = PROCESS_BASE * procs
    legacy = ckpt.format == "bin-legacy"
    out = []
    # straight to the GPU: every shard mapped until the load ends; conversions happen on the GPU
    anon = base + (ckpt.total_bytes * procs if legacy else 0)
    file = 0 if legacy else ckpt.total_bytes
    out.append(HostLoad("to-gpu", anon, file, file * procs, procs,
                        'from_pretrained(path, dtype=DTYPE, device_map=f"cuda:{local_rank}")'))
    # on the CPU first: mapped views (or converted copies), then .to("cuda")
    convert = _converts(ckpt, load_dtype) or legacy
    anon = base + (weights * procs if convert else 0)
    file = 0 if legacy else ckpt.total_bytes
    notes = ["a dtype conversion on the CPU makes an anonymous copy of every weight"] if convert else []
    out.append(HostLoad("cpu-then-to", anon, file, file * procs, procs,
                        'from_pretrained(path, dtype=DTYPE).to(f"cuda:{local_rank}")', notes))
    return out


def zero3_methods(ckpt: Checkpoint, load_dtype: str, ranks: int, weights: int) -> list[HostLoad]:
    """``from_pretrained`` under ``zero.Init``: rank 0 reads the checkpoint, the others keys only."""
    legacy = ckpt.format == "bin-legacy"
    anon = PROCESS_BASE * ranks + (ckpt.total_bytes if legacy else 0)
    file = 0 if legacy else ckpt.total_bytes
    return [HostLoad("zero-init", anon, file, file, ranks,
                     "HfDeepSpeedConfig(ds_config) kept alive, then from_pretrained(path, dtype=DTYPE)",
                     ["rank 0 maps the checkpoint, the other ranks build from keys (transformers >= 5); "
                      "transformers 4 reads every shard on every rank"])]


def tp_methods(ckpt: Checkpoint, load_dtype: str, tp: int, replicas: int, weights: int,
               largest_param_bytes: int) -> list[HostLoad]:
    """AutoTP over ``tp`` ranks, ``replicas`` groups: ``tp * replicas`` processes."""
    procs = tp * replicas
    base = PROCESS_BASE * procs
    legacy = ckpt.format == "bin-legacy"
    convert = _converts(ckpt, load_dtype) or legacy
    out = []
    # every rank builds the model on the CPU, init_inference slices it
    anon = base + (weights * procs if convert else largest_param_bytes * procs)
    file = 0 if legacy else ckpt.total_bytes
    notes = (["every rank holds a full CPU copy (dtype conversion or a legacy .bin)"] if convert else
             ["every rank maps the whole checkpoint: file-backed, shared through the page cache"])
    out.append(HostLoad("cpu-model", anon, file, file * procs, procs,
                        "model = from_pretrained(path, dtype=DTYPE)  # on the CPU, every rank\n"
                        "engine = deepspeed.init_inference(model, tensor_parallel={\"tp_size\": TP}, dtype=DTYPE)",
                        notes))
    # meta-device model + checkpoint description: one checkpoint file at a time per rank
    anon = base + ckpt.largest_file_bytes * procs
    out.append(HostLoad("meta-checkpoint", anon, 0, 0, procs,
                        "with deepspeed.OnDevice(dtype=DTYPE, device=\"meta\"): model = "
                        "AutoModelForCausalLM.from_config(config)\n"
                        "engine = deepspeed.init_inference(model, tensor_parallel={\"tp_size\": TP}, dtype=DTYPE, "
                        "checkpoint=\"checkpoints.json\", replace_with_kernel_inject=True)",
                        ["needs kernel injection (replace_with_kernel_inject=True) and a DeepSpeed injection "
                         "policy for the architecture; checkpoints.json lists the checkpoint files; the injected "
                         "kernels' workspace is not in the GPU peak (modelled for AutoTP without injection)"]))
    # pre-sharded: each rank reads its own slice
    anon = base + -(-weights // tp) * procs
    out.append(HostLoad("pre-sharded", anon, 0, 0, procs,
                        "engine = deepspeed.init_inference(model_on_meta, tensor_parallel={\"tp_size\": TP}, "
                        "checkpoint=\"sharded/ds_inference_config.json\", replace_with_kernel_inject=True)",
                        ["write the shards once with init_inference(..., save_mp_checkpoint_path=DIR) on a "
                         "machine that can hold the full model; kernel injection as for meta-checkpoint"]))
    return out


PREFERENCE = ("to-gpu", "cpu-then-to", "zero-init", "cpu-model", "meta-checkpoint", "pre-sharded")


def choose_method(methods: list[HostLoad], host_memory: int, other_anon: int = 0) -> tuple[HostLoad, bool]:
    """The simplest method whose anonymous peak (plus the path's other host memory) fits; else the smallest."""
    for m in methods:
        if m.peak_bytes + other_anon <= host_memory:
            return m, True
    return min(methods, key=lambda m: m.peak_bytes), False


LOADING_KEYS = ("checkpoint_while_loading", "model_copy_while_sharding")


def methods_for(family: str, ckpt: Checkpoint, load_dtype: str, ranks: int, replicas: int, weights: int,
                largest_param_bytes: int) -> list[HostLoad]:
    if family == "plain":
        return plain_methods(ckpt, load_dtype, replicas, weights)
    if family == "tp":
        return tp_methods(ckpt, load_dtype, ranks, replicas, weights, largest_param_bytes)
    return zero3_methods(ckpt, load_dtype, ranks, weights)


def apply_loading(mem, methods: list[HostLoad], host_memory: int) -> tuple[HostLoad, bool]:
    """Replace a path's generic checkpoint line by the loading method that fits (anonymous and
    file-backed apart); return the method and whether it fits."""
    other = {k: v for k, v in mem.host_breakdown.items() if k not in LOADING_KEYS}
    other_sum = sum(other.values())
    method, ok = choose_method(methods, host_memory, other_sum)
    host = dict(other)
    base = PROCESS_BASE * method.processes
    host["process_base"] = base
    if method.anon_bytes > base:
        host["load_anon"] = method.anon_bytes - base
    mem.host_breakdown = host
    mem.host_peak_bytes = int(other_sum + method.peak_bytes)
    mem.host_file_bytes = int(method.file_bytes)  # reported beside the peak, not part of it
    return method, ok
