"""Host memory of loading a checkpoint, per loading method (issue 12 item 4).

A process's resident memory has two kinds of pages, and they count differently:

* **anonymous** (``RssAnon``): heap, tensors materialized on the CPU, pinned buffers. Never shared between
  processes and never reclaimed: this is what runs a host (or a container) out of memory.
* **file-backed** (``RssFile``): a memory-mapped checkpoint's pages. Every process that maps the same file
  shows them in its RSS, but the page cache holds them once; the kernel can drop them under pressure
  (clean pages), and a cgroup charges them once. ``ps`` sums them per process; ``free`` does not.

What transformers 5 and DeepSpeed 0.19 do (read in their sources, measured by ``bench/plan/loading_gpu.py``).
The rule behind every figure: a mapped page counts in RSS once it is *read*, and leaves when its file is
*unmapped*; safetensors keeps one mapping per file, alive while any tensor of that file is.

* ``from_pretrained`` (``PreTrainedModel._load_pretrained_model``) maps every shard at once
  (``safe_open(..., backend="mmap")``, or ``torch.load(mmap=True)`` for a zip ``.bin``: the same pages) and
  closes the handles only after ``convert_and_load_state_dict_in_model`` has placed every weight.
* ``device_map="cuda"``: each weight is copied to the GPU inside that loop, so every page is read while every
  file is still mapped: the whole checkpoint is file-backed RSS at the end of the load.
* on the CPU without a dtype change, ``tensor[...]`` keeps a view of the mapping: no page is read during
  ``from_pretrained``. ``.to("cuda")`` then reads one tensor at a time and drops its CPU view; a file is
  unmapped when its last tensor has moved. At most about one shard is resident: the largest file.
* on the CPU with a dtype change, every weight is converted (read) inside the loop: the whole checkpoint is
  mapped and read, plus an anonymous copy of every weight.
* legacy (pre-zip) ``.bin``: read whole by ``torch.load`` without a mapping (anonymous).
* under ZeRO-3 (``HfDeepSpeedConfig`` kept alive) rank 0 loads every file with ``map_location="cpu"`` and keeps
  the merged state dict until every partition has been filled: the whole checkpoint is read while mapped. The
  other ranks read keys only (``map_location="meta"``).
* ``deepspeed.init_inference`` (AutoTP) with a CPU-built model: each rank does what ``cpu-then-to`` does;
  with ``tp_size`` > 1 it slices each linear on the CPU first (one sliced weight at a time: not measured).
  From a meta-device model with a checkpoint description each rank reads one checkpoint file at a time;
  from a pre-sharded checkpoint (``save_mp_checkpoint_path``) only its own slice files.

What the user's transformers does decides these figures (``Checkpoint.loader``, from ``plan --transformers-version``
or the installed release; each method's ``assumes`` says which it took). Read in each release's ``modeling_utils.py``
(the thresholds: ``config/versions.py``):

* ``tf5`` (5.0 and later): as above; measured on 5.17.
* ``tf4-meta`` (4.51 to 4.57): the model is always built on the meta device (4.51 pops ``low_cpu_mem_usage``:
  "Not used anymore"), and ``load_shard_file`` loads one shard at a time, so a file is mapped only while its
  tensors are placed: ``to-gpu`` holds about one shard file-backed, not the whole checkpoint. On the CPU the
  tensors stay views of the mapping, as in 5. Under ZeRO-3 every rank calls ``load_state_dict`` on every
  safetensors shard (``map_location="cpu"``, one shard at a time); only rank 0 copies the values into the
  partitions (``GatheredParameters(..., modifier_rank=0)``), so rank 0 reads about one shard at a time.
* ``tf4-eager`` (before 4.51): ``low_cpu_mem_usage`` defaults to False unless a ``device_map`` is given, and then
  ``from_pretrained`` allocates every parameter on the CPU before it copies each shard in: a full anonymous copy
  of the weights per process (``cpu-then-to``; AutoTP's ``cpu-model``: one per rank, 8 x 135 GiB for a 72B on
  8 GPUs). With a ``device_map`` (``to-gpu``) it loads on meta, one shard at a time, as ``tf4-meta``.

The per-process floor (``PROCESS_BASE``, ``ZERO3_RUNTIME``, ``PROCESS_FILE``) is a measured machine figure,
not derived from a model: the memory each process held at the END of its load on one H200 host (weights on
the GPU, checkpoint unmapped), 1B and 7B alike, in ``bench/plan/runs/loading-gpu-run1.tar.gz``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

GiB = 1024**3
# Measured machine figures (one H200 host; torch 2.11 + CUDA 12, transformers 5.17, DeepSpeed 0.19.8): what a
# process holds at the end of a load, before and after which no weight is on the host. Another machine or
# software stack differs by some tenths of a GiB; they are not fitted to the loading peaks.
PROCESS_BASE = GiB // 2  # anonymous: python + torch + transformers + the CUDA context's host side (0.48-0.50)
ZERO3_RUNTIME = int(0.43 * GiB)  # anonymous, per rank, added once zero.Init has run (0.92-0.93 GiB in all)
PROCESS_FILE = int(0.42 * GiB)  # file-backed: shared libraries (libtorch, CUDA, NCCL) every process maps (0.41-0.44)
DEFAULT_SHARD = 5 * 10**9  # assumed when the directory has no weights: most published checkpoints use 5 GB shards
# (transformers 4 save_pretrained; transformers 5 writes 50 GB shards)


LOADERS = ("tf5", "tf4-meta", "tf4-eager")  # how from_pretrained loads, by transformers release (module docstring)


def loader_for(version: tuple | None) -> str:
    """The loading behaviour of a transformers release (None: not known, the newest is assumed)."""
    from dsdoctor.config.versions import TRANSFORMERS_META_LOAD, TRANSFORMERS_ZERO3_RANK0_READS

    if version is None or version >= TRANSFORMERS_ZERO3_RANK0_READS:
        return "tf5"
    return "tf4-meta" if version >= TRANSFORMERS_META_LOAD else "tf4-eager"


def transformers_loading(given: str | None = None) -> dict:
    """The transformers release the host figures assume: ``given`` (``--transformers-version``), else the one
    installed here (its dist-info, no import), else the newest (assumed); and its loading behaviour."""
    from dsdoctor.config.versions import resolve_versions, version_tuple

    versions = resolve_versions({"transformers": given} if given else None)
    version = versions.get("transformers")
    source = versions.sources.get("transformers") if version else "assumed"
    return {"version": version, "source": source, "loader": loader_for(version_tuple(version))}


@dataclass
class Checkpoint:
    """What the model directory holds (format, dtype, total bytes, the largest file) and how the user's
    transformers will read it (``loader``: one of ``LOADERS``)."""
    format: str  # safetensors | bin | bin-legacy | unknown
    total_bytes: int
    largest_file_bytes: int
    files: int
    dtype: str | None
    seen: bool  # read from the directory (False: assumed)
    loader: str = "tf5"

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
            from dsdoctor import door
            from dsdoctor.errors import InputError

            try:  # the zip format (torch >= 1.6) starts with PK; older pickles are read whole
                if door.read_head(directory / files[0][0], 2, door.WEIGHTS_BIN) != b"PK":
                    fmt = "bin-legacy"
            except InputError:
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
    file_bytes: int  # checkpoint pages mapped at once, counted once (the page cache)
    file_rss_bytes: int  # file-backed pages as the processes' RSS shows them: checkpoint + libraries, summed
    processes: int
    code: str  # what to write
    notes: list = field(default_factory=list)
    base_bytes: int = 0  # the processes' anonymous floor (PROCESS_BASE, + ZERO3_RUNTIME under zero.Init)
    assumes: str = "tf5"  # the loading behaviour these figures take: a transformers loader, or "deepspeed"

    @property
    def peak_bytes(self) -> int:
        """What must fit in host memory: anonymous pages. Mapped checkpoint pages are clean and file-backed:
        the kernel (and a cgroup limit) reclaims them under pressure instead of failing; they cost speed."""
        return self.anon_bytes

    @property
    def rss_bytes(self) -> int:
        """The processes' peak RSS summed (what ``ps`` adds up): anonymous + file-backed."""
        return self.anon_bytes + self.file_rss_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["peak_bytes"] = self.peak_bytes
        return d


def _converts(ckpt: Checkpoint, load_dtype: str) -> bool:
    return ckpt.dtype is not None and ckpt.dtype != load_dtype


def _load(method: str, procs: int, base: int, extra_anon: int, mapped_per_proc: int, mapped_once: int,
          code: str, notes: list | None = None, assumes: str = "tf5") -> HostLoad:
    """A method's figures from its mechanism: per process a floor, the anonymous copies it makes and the
    checkpoint pages it has read while still mapped; the page cache holds mapped pages once."""
    return HostLoad(method, base + extra_anon, mapped_once, (mapped_per_proc + PROCESS_FILE) * procs, procs, code,
                    notes or [], base, assumes)


def _one_shard(ckpt: Checkpoint) -> int:
    return min(ckpt.largest_file_bytes, ckpt.total_bytes)


def _cpu_build(ckpt: Checkpoint, load_dtype: str, weights: int) -> tuple[int, int, list]:
    """One process builds the model on the CPU and moves it: (anonymous bytes, mapped pages read, notes)."""
    if ckpt.loader == "tf4-eager":  # every parameter allocated on the CPU, then each shard copied in
        legacy = ckpt.largest_file_bytes if ckpt.format == "bin-legacy" else 0
        return weights + legacy, 0 if legacy else _one_shard(ckpt), [
            "transformers < 4.51 without a device_map (low_cpu_mem_usage False) allocates every weight on the CPU "
            "and copies each shard into it: a full anonymous copy per process"]
    if ckpt.format == "bin-legacy":  # read whole into anonymous memory, converted copies beside it
        extra = weights if _converts(ckpt, load_dtype) else 0
        return ckpt.total_bytes + extra, 0, ["a legacy (pre-zip) .bin is read whole into anonymous memory"]
    if _converts(ckpt, load_dtype):  # every weight read and converted while every file is mapped
        return weights, ckpt.total_bytes, ["a dtype conversion on the CPU makes an anonymous copy of every weight "
                                           "and reads the whole checkpoint while it is mapped"]
    # views of the mapping; .to() reads one tensor at a time and a file is unmapped after its last tensor
    return 0, _one_shard(ckpt), []


def plain_methods(ckpt: Checkpoint, load_dtype: str, procs: int, weights: int) -> list[HostLoad]:
    """One process per GPU, each loading the whole model."""
    base = PROCESS_BASE * procs
    legacy = ckpt.format == "bin-legacy"
    if ckpt.loader == "tf5":
        # straight to the GPU: every page read while every file is mapped; conversions happen on the GPU
        mapped = 0 if legacy else ckpt.total_bytes
        to_gpu = _load("to-gpu", procs, base, ckpt.total_bytes * procs if legacy else 0, mapped, mapped,
                       'from_pretrained(path, dtype=DTYPE, device_map=f"cuda:{local_rank}")')
    else:  # transformers 4 with a device_map: on meta, one shard at a time, each unmapped before the next
        shard = 0 if legacy else _one_shard(ckpt)
        to_gpu = _load("to-gpu", procs, base, ckpt.largest_file_bytes * procs if legacy else 0, shard,
                       min(ckpt.total_bytes, shard * procs),
                       'from_pretrained(path, dtype=DTYPE, device_map=f"cuda:{local_rank}")',
                       ["transformers 4 loads one shard at a time (load_shard_file)"], assumes=ckpt.loader)
    out = [to_gpu]
    # on the CPU first, then .to("cuda")
    anon, mapped, notes = _cpu_build(ckpt, load_dtype, weights)
    out.append(_load("cpu-then-to", procs, base, anon * procs, mapped, min(ckpt.total_bytes, mapped * procs),
                     'from_pretrained(path, dtype=DTYPE).to(f"cuda:{local_rank}")', notes, ckpt.loader))
    return _keyword(out, ckpt)


def _keyword(methods: list[HostLoad], ckpt: Checkpoint) -> list[HostLoad]:
    """transformers 4 spells from_pretrained's dtype ``torch_dtype`` (``dtype`` only from 4.56)."""
    if ckpt.loader != "tf5":
        for m in methods:
            m.code = m.code.replace("from_pretrained(path, dtype=", "from_pretrained(path, torch_dtype=")
    return methods


def zero3_methods(ckpt: Checkpoint, load_dtype: str, ranks: int, weights: int) -> list[HostLoad]:
    """``from_pretrained`` under ``zero.Init``: rank 0 copies the checkpoint into the partitions; the other ranks
    read keys only (transformers >= 5), or open every shard too (transformers 4, one shard at a time)."""
    legacy = ckpt.format == "bin-legacy"
    base = (PROCESS_BASE + ZERO3_RUNTIME) * ranks
    code = "HfDeepSpeedConfig(ds_config) kept alive, then from_pretrained(path, dtype=DTYPE)"
    if ckpt.loader == "tf5":
        mapped = 0 if legacy else ckpt.total_bytes
        load = _load("zero-init", ranks, base, ckpt.total_bytes if legacy else 0, 0, mapped, code,
                     ["rank 0 maps the checkpoint, the other ranks build from keys (transformers >= 5); "
                      "transformers 4 reads every shard on every rank"])
    else:
        mapped = 0 if legacy else _one_shard(ckpt)
        load = _load("zero-init", ranks, base, ckpt.largest_file_bytes if legacy else 0, 0, mapped,
                     code,
                     ["transformers 4: every rank opens every shard, one at a time (safetensors tensors stay lazy "
                      "views); rank 0 copies them into the partitions: about one shard read at a time"],
                     ckpt.loader)
    load.file_rss_bytes += mapped  # rank 0 only
    return _keyword([load], ckpt)


def tp_methods(ckpt: Checkpoint, load_dtype: str, tp: int, replicas: int, weights: int,
               largest_param_bytes: int, kernel_inject: bool = True) -> list[HostLoad]:
    """AutoTP over ``tp`` ranks, ``replicas`` groups: ``tp * replicas`` processes. The methods that load
    through kernel injection only where DeepSpeed can inject this model (``shape.kernel_injectable``)."""
    procs = tp * replicas
    base = PROCESS_BASE * procs
    out = []
    # every rank builds the model on the CPU (as cpu-then-to), init_inference slices it (tp > 1)
    anon, mapped, notes = _cpu_build(ckpt, load_dtype, weights)
    if tp > 1:
        anon += largest_param_bytes
    notes = notes + (["every rank holds a full CPU copy"] if anon >= weights else
                     ["every rank maps the checkpoint, about one shard at a time: file-backed, shared through "
                      "the page cache"])
    out.append(_load("cpu-model", procs, base, anon * procs, mapped, min(ckpt.total_bytes, mapped * procs),
                     "model = from_pretrained(path, dtype=DTYPE)  # on the CPU, every rank\n"
                     "engine = deepspeed.init_inference(model, tensor_parallel={\"tp_size\": TP}, dtype=DTYPE)",
                     notes, ckpt.loader))
    if not kernel_inject:
        return _keyword(out, ckpt)
    # meta-device model + checkpoint description: one checkpoint file at a time per rank
    out.append(_load("meta-checkpoint", procs, base, ckpt.largest_file_bytes * procs, 0, 0,
                     "with deepspeed.OnDevice(dtype=DTYPE, device=\"meta\"): model = "
                     "AutoModelForCausalLM.from_config(config)\n"
                     "engine = deepspeed.init_inference(model, tensor_parallel={\"tp_size\": TP}, dtype=DTYPE, "
                     "checkpoint=\"checkpoints.json\", replace_with_kernel_inject=True)",
                     ["needs kernel injection (replace_with_kernel_inject=True) and a DeepSpeed injection "
                      "policy for the architecture; checkpoints.json lists the checkpoint files; the injected "
                      "kernels' workspace is not in the GPU peak (modelled for AutoTP without injection)"],
                     "deepspeed"))
    # pre-sharded: each rank reads its own slice
    out.append(_load("pre-sharded", procs, base, -(-weights // tp) * procs, 0, 0,
                     "engine = deepspeed.init_inference(model_on_meta, tensor_parallel={\"tp_size\": TP}, "
                     "checkpoint=\"sharded/ds_inference_config.json\", replace_with_kernel_inject=True)",
                     ["write the shards once with init_inference(..., save_mp_checkpoint_path=DIR) on a "
                      "machine that can hold the full model; kernel injection as for meta-checkpoint"],
                     "deepspeed"))
    return _keyword(out, ckpt)


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
    base = method.base_bytes
    host["process_base"] = base
    if method.anon_bytes > base:
        host["load_anon"] = method.anon_bytes - base
    mem.host_breakdown = host
    mem.host_peak_bytes = int(other_sum + method.peak_bytes)
    mem.host_file_bytes = int(method.file_bytes)  # reported beside the peak, not part of it
    return method, ok
