"""The guard table: every kind of file dsdoctor reads or writes, with the guards that apply to it.

An input ``Kind`` says what the file is called in messages, the most bytes read from it (``None``: it is
never read whole; it is streamed, mapped or handed to a library, after the regular-file check), its text
encoding (``None``: bytes), the bounds of its parsed tree and of one line. Every input is a regular file,
checked on the open descriptor (a FIFO cannot block, ``/dev/zero`` cannot fill memory), whatever its kind.

An ``OutputKind`` says how an output is written: whether it carries dsdoctor's marker, what ``--force`` may
replace, whether it is built aside and renamed into place, and its mode before the umask. Every output is
locked against a second dsdoctor, never written through a link, a device, a FIFO or a socket, and removed on
an error or a signal while it is being built (``door.write``).
"""
from __future__ import annotations

from dataclasses import dataclass

KiB, MiB, GiB = 2**10, 2**20, 2**30


@dataclass(frozen=True)
class Kind:
    """How one kind of input file is read."""

    what: str  # its name in messages ("DeepSpeed config file")
    max_bytes: int | None  # None: never read whole (streamed, mapped, or opened by a library after the checks)
    encoding: str | None = "utf-8-sig"  # None: bytes; "utf-8-sig" accepts a BOM
    max_depth: int | None = None  # parsed trees: nesting
    max_nodes: int | None = None  # parsed trees: values, shared sub-trees counted every time they appear
    max_line: int | None = None  # line-oriented files: longer lines are dropped as damaged
    slow_parse_bytes: int | None = None  # the bound when parsed in pure Python (YAML, HJSON)
    # outside the user's tree (door.outside_tree): read only when one of these appears in it (its content never
    # shown); () never read there; None: the rule is not this kind's (dsdoctor's own files, checkpoint members)
    words: tuple[bytes, ...] | None = None


DEPTH = 64  # the deepest real DeepSpeed/accelerate/HF config is about 6 levels
NODES = 100_000  # real configs hold fewer than 1,000 values

# ---- inputs: untrusted files ---------------------------------------------------------------------------------
DS_CONFIG = Kind("DeepSpeed config file", 16 * MiB, max_depth=DEPTH, max_nodes=NODES, slow_parse_bytes=64 * KiB)
RL_JOB = Kind("RL job file", 1 * MiB, max_depth=DEPTH, max_nodes=NODES, slow_parse_bytes=64 * KiB,  # plan --loop --job
              words=(b"models", b"openrlhf", b"verl", b"trl", b"deepspeed", b"model_name_or_path", b"vllm"))
MODEL_CONFIG = Kind("model config.json", 16 * MiB, max_depth=DEPTH, max_nodes=NODES,
                    words=(b'"hidden_size"', b'"n_embd"', b'"d_model"', b'"model_type"', b'"text_config"'))
ADAPTER_CONFIG = Kind("PEFT adapter_config.json", 16 * MiB, max_depth=DEPTH, max_nodes=NODES,
                      words=(b'"peft_type"', b'"lora_alpha"', b'"target_modules"'))
PROMPTS = Kind("prompt file", 64 * MiB, words=())
MACHINE_PROFILE = Kind("machine profile", 4 * MiB, "utf-8", DEPTH, NODES, words=(b'"fingerprint"',))  # ~3 KiB
LATEST = Kind("`latest` file", 4 * KiB, None)  # one tag name; one linked out of its folder is not read (layout.py)
RANK_FILE = Kind("checkpoint file", None, None)  # zip directory and data.pkl bounded by checkpoint.unpickle
SAFETENSORS = Kind("safetensors file", None, None, DEPTH, 2_000_000)  # header: 100 MB, 2M values (~250k tensors)
WEIGHTS_INDEX = Kind("index file", 64 * MiB, "utf-8", DEPTH, 2_000_000, words=(b'"weight_map"',))
WEIGHTS_BIN = Kind("weights file", None, None)  # torch.load(weights_only=True, mmap=True)
MODEL_FILE = Kind("model file", 1 * GiB, None)  # tokenizer and generation files: copied, or opened by a library
TRACE_RECORD = Kind("trace record", None, "utf-8", max_line=64 * MiB)  # rank-R.HOST.PID.jsonl, line by line
STACK_DUMP = Kind("stack dump", 16 * MiB, "utf-8")
NODE_RECORD = Kind("node record (done.json)", 1 * MiB, "utf-8", DEPTH, NODES)
RUN_LOG = Kind("run log", None, "utf-8")  # only its tail is read
FIGURE = Kind("figure", 64 * MiB, None)  # a PNG dsdoctor drew, embedded into HTML
PROBE = Kind("calibrate probe file", None, None)  # written and read back by calibrate --nvme-path

# ---- inputs dsdoctor wrote itself, read back across a process boundary -----------------------------------------
COMPARE_JOB = Kind("compare job file", 256 * MiB, "utf-8")
COMPARE_RECORD = Kind("compare record", 256 * MiB, "utf-8")
NCCL_RESULT = Kind("NCCL measurement", 1 * MiB, "utf-8")
PACKAGE_DATA = Kind("dsdoctor data file", 16 * MiB, "utf-8")
INVENTORY_CACHE = Kind("cached parameter inventory", 64 * MiB, "utf-8", 8, 4_000_000)  # a 70B: ~60 KiB
PROC = Kind("/proc file", 64 * MiB, None)  # kernel files: size 0 in stat, read to their end

INPUTS = {name: kind for name, kind in globals().items() if isinstance(kind, Kind)}


@dataclass(frozen=True)
class OutputKind:
    """How one kind of output is written."""

    name: str
    marker: bool  # carries .dsdoctor-output (folders)
    force_replaces: str  # what --force may replace
    built_aside: bool  # built in a hidden sibling and renamed into place (never seen half-written)
    mode: int  # before the umask
    used_by: str


OUTPUTS = (
    OutputKind("output folder", True, "a folder with dsdoctor's marker holding only what dsdoctor wrote there",
               True, 0o777, "merge OUT, trace/ab/compare/diagnose --out, plan --plot"),
    OutputKind("output file", False, "a regular file that is not an input of the command", True, 0o666,
               "split -o, calibrate --out"),
    OutputKind("node folder", True, "a folder with dsdoctor's marker holding only what dsdoctor wrote there",
               False, 0o777, "multi-node trace DIR/node-K (the other nodes watch it; done.json is written last)"),
    OutputKind("shared report file", False, "a file the folder's marker lists as dsdoctor's, unchanged since",
               True, 0o666, "multi-node trace DIR/report.*, timeline*; trace --report-only"),
    OutputKind("cache file", False, "always replaced (dsdoctor's own cache), never through a link", True, 0o666,
               "the machine profile cache, plan's parameter inventory cache"),
    OutputKind("scratch folder", False, "never replaces: a new private folder, removed at the end", False,
               0o700, "trace/ab/compare without --out, calibrate's workers, ab's verdict"),
    OutputKind("probe file", False, "never replaces: a new private file, removed at the end", False, 0o600,
               "calibrate --nvme-path"),
    OutputKind("rank record", False, "never replaces: appended into a folder the parent created", False, 0o666,
               "trace observer in the user's ranks, compare runner, calibrate NCCL worker"),
)
