"""Read a DeepSpeed config from JSON, HJSON, an accelerate YAML, a trainer YAML or a Python dict.

DeepSpeed parses its config with hjson and raises on duplicate keys; this loader does the same and turns
every way a file can be bad (missing, a directory, empty, binary, not UTF-8, invalid syntax, duplicate keys,
not an object, too big) into one ``InputError`` naming the file and the problem.

An accelerate YAML (``accelerate config`` output) is turned into the DeepSpeed dict accelerate itself
builds (``accelerate.utils.dataclasses.DeepSpeedPlugin.__post_init__``): either the JSON its
``deepspeed_config_file`` points to, or a dict built from ``zero_stage``, ``offload_*_device``, ... A trainer
YAML (axolotl, LLaMA-Factory) that names a DeepSpeed JSON in ``deepspeed:`` is followed to that file.
"""
from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsdoctor import door
from dsdoctor.errors import InputError, printable

MAX_BYTES = door.DS_CONFIG.max_bytes  # real configs are a few KiB
YAML_SUFFIXES = (".yaml", ".yml")



@dataclass
class LoadedConfig:
    """A config as DeepSpeed will see it.

    ``raw`` is the DeepSpeed config dict (a deep copy: callers may not mutate the input through it).
    For YAML inputs ``source`` holds the YAML's own fields and ``ref_path`` the DeepSpeed JSON it names;
    ``ref_missing`` is true when that file does not exist (``raw`` then holds only what the YAML says).
    """

    path: str | None
    raw: dict
    kind: str
    source: dict | None = None
    ref_path: str | None = None
    ref_missing: bool = False
    num_processes: int | None = None  # accelerate YAML: how many ranks it launches
    mixed_precision: str | None = None  # accelerate YAML / trainer YAML: "bf16", "fp16", "no"
    notes: list[str] = field(default_factory=list)
    stage_from_name: int | None = None  # a missing referenced file's ZeRO stage, as its name says (ds_z3_config.json)
    _readings: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.path or "<dict>"

    def effective(self, filler: str = "deepspeed", hidden_size: int | None = None):
        """``effective_settings`` of this config, read once per (filler, hidden_size) and shared by every
        caller (check, split, plan), with the file named in any error. Callers must not mutate it."""
        key = (filler, hidden_size if filler == "hf-trainer" else None)
        if key not in self._readings:
            from dsdoctor.config.effective import effective_settings

            try:
                self._readings[key] = effective_settings(self.raw, filler, hidden_size=key[1])
            except InputError as exc:
                if exc.path is None:
                    raise InputError(exc.problem, path=self.ref_path or self.path, hint=exc.hint) from None
                raise
        return self._readings[key]

    def to_dict(self) -> dict:
        return {
            "path": self.path, "kind": self.kind, "ref_path": self.ref_path, "ref_missing": self.ref_missing,
            "num_processes": self.num_processes, "mixed_precision": self.mixed_precision,
        }


class DuplicateKeyError(ValueError):
    pass


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKeyError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def load_config(source: str | os.PathLike | dict) -> LoadedConfig:
    """Load a config file (or take a dict) and return the DeepSpeed dict it amounts to."""
    if isinstance(source, dict):
        door.check_tree(source, None, door.DS_CONFIG)
        _check_keys_are_strings(source, None)
        return LoadedConfig(path=None, raw=_plain(copy.deepcopy(source)), kind="dict")
    if not isinstance(source, (str, os.PathLike)):
        raise InputError(f"expected a config path or a dict, not {type(source).__name__}")
    path = Path(source)
    text = read_text(path)
    system = door.outside_tree(path)
    if system:  # a system file named on the command line: read only when it is a config, never echoed
        _require_config_words(path, text, None)
    if not text.lstrip().startswith(("{", "[")) and looks_like_command(text):
        return from_command(path, text)
    data, kind = _parse_file(path, text)
    if system and not _has_config_keys(data, accelerate=True):
        raise _not_a_config(path, None)
    if kind == "yaml":
        return _from_yaml(path, data)
    if is_trainer_args(data):
        return _from_trainer_args(path, data, "trainer-args")  # a TrainingArguments JSON
    return LoadedConfig(path=str(path), raw=data, kind=kind)


_TRAINING_ARGUMENT_KEYS = ("output_dir", "do_train", "do_eval", "do_predict", "per_device_train_batch_size",
                           "per_device_eval_batch_size", "predict_with_generate", "model_name_or_path",
                           "learning_rate", "num_train_epochs")


def is_trainer_args(data: dict) -> bool:
    """A trainer's arguments (TrainingArguments JSON, ...) naming a DeepSpeed config in ``deepspeed``, not a
    DeepSpeed config (which has no ``deepspeed`` key; ``bf16: true`` is a TrainingArguments flag there)."""
    from dsdoctor.config.schema import DEEPSPEED_TOP_LEVEL_KEYS

    if not isinstance(data.get("deepspeed"), (str, dict)) or "zero_optimization" in data:
        return False
    return any(k in data for k in _TRAINING_ARGUMENT_KEYS) or not any(k in DEEPSPEED_TOP_LEVEL_KEYS for k in data)


def read_text(path: Path) -> str:
    """The file's text, or an InputError saying why it cannot be a config. Only a regular file of at most
    ``MAX_BYTES`` is read: a FIFO, a device (``/dev/zero``) or a socket is refused before it is opened."""
    if not path.exists():
        raise InputError("no such file", path=path)
    if path.is_dir():
        raise InputError("is a directory, expected a DeepSpeed config file", path=path)
    blob = door.read_bytes(path, door.DS_CONFIG)
    if b"\x00" in blob:
        raise InputError("is a binary file, not a DeepSpeed config (JSON, HJSON or YAML)", path=path)
    try:
        text = blob.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"is not UTF-8 text (bad byte at offset {exc.start})", path=path) from None
    if not text.strip():
        raise InputError("is empty", path=path)
    return text


def _parse_file(path: Path, text: str | None = None) -> tuple[Any, str]:
    text = read_text(path) if text is None else text
    looks_yaml = path.suffix.lower() in YAML_SUFFIXES or not text.lstrip().startswith(("{", "[", "//", "#", "/*"))
    if looks_yaml:
        _bound_slow_parse(text, path, "YAML")
        data = _parse_yaml(text, path)
        kind = "yaml"
    else:
        data, kind = _parse_json(text, path)
    if not isinstance(data, dict):
        what = "a list" if isinstance(data, list) else f"a {type(data).__name__}"
        raise InputError(f"top level is {what}; a DeepSpeed config is an object ({{...}})", path=path)
    door.check_tree(data, path, door.DS_CONFIG)  # before any recursive walk: depth, size, cycles
    _check_keys_are_strings(data, path)
    return _plain(data), kind


def _bound_slow_parse(text: str, path: Path, what: str) -> None:
    """YAML and HJSON are parsed in pure Python, about a megabyte a second: past the bound, refuse at once
    rather than run for minutes (a real config is a few KiB; plain JSON, parsed in C, may be larger)."""
    size = len(text.encode("utf-8"))
    if size > door.DS_CONFIG.slow_parse_bytes:
        raise InputError(f"is {size} bytes of {what}; a {what} config is limited to "
                         f"{door.DS_CONFIG.slow_parse_bytes} bytes (plain JSON may be larger)", path=path)


def _strict(loads, text: str, path: Path):
    """``loads`` with DeepSpeed's refusal of duplicate keys; too deep a nesting is bad input too."""
    try:
        return loads(text, object_pairs_hook=_no_duplicates)
    except DuplicateKeyError as exc:
        raise InputError(f"{exc} (DeepSpeed rejects duplicate keys)", path=path) from None
    except RecursionError:
        raise InputError("is nested too deeply", path=path) from None


def _parse_json(text: str, path: Path) -> tuple[Any, str]:
    door.json_bound(text, path, door.DS_CONFIG)  # before json.loads builds millions of objects
    try:
        return _strict(json.loads, text, path), "json"
    except ValueError as first:
        json_error = first
    _bound_slow_parse(text, path, "HJSON")
    import hjson  # DeepSpeed's own parser: comments, unquoted keys, trailing commas

    try:
        return _strict(hjson.loads, text, path), "hjson"
    except InputError:
        raise
    except Exception as exc:  # hjson raises HjsonDecodeError and, on odd input, other ValueErrors
        where = ""
        if isinstance(json_error, json.JSONDecodeError):
            where = f" at line {json_error.lineno} column {json_error.colno}"
        detail = json_error.msg if isinstance(json_error, json.JSONDecodeError) else str(exc)
        raise InputError(f"invalid JSON/HJSON{where}: {detail}", path=path) from None


class YamlBombError(ValueError):
    pass


def bounded_yaml_loader(max_nodes: int = door.DS_CONFIG.max_nodes, max_depth: int = door.DS_CONFIG.max_depth):  # noqa: C901
    """A ``yaml.SafeLoader`` subclass that refuses what ``safe_load`` accepts and nothing downstream survives:
    an alias to an anchor that is still being defined (a structure containing itself), more than
    ``max_nodes`` nodes once aliases are expanded (billion laughs: 9 levels of 9 aliases are 3.9 billion),
    nesting deeper than ``max_depth``. Duplicate keys are an error, as in DeepSpeed.

    The count happens while composing, before any Python object is built, so a bomb costs microseconds."""
    import yaml

    class Loader(yaml.SafeLoader):
        def __init__(self, stream):
            super().__init__(stream)
            self._open_anchors: list[str] = []
            self._expanded = 0
            self._sizes: dict[int, int] = {}
            self._depth = 0
            self._through_alias = False

        def _count(self, n: int, mark, alias: bool = False) -> None:
            self._expanded += n
            self._through_alias = self._through_alias or alias
            if self._expanded > max_nodes:
                how = "expands to more than {} values through aliases" if self._through_alias else \
                    "has more than {} values"
                raise YamlBombError(f"{how.format(max_nodes)} at line {mark.line + 1}; not a config")

        def _size(self, node) -> int:
            """Nodes in ``node`` with every alias expanded (the graph is acyclic: cycles are refused)."""
            cached = self._sizes.get(id(node))
            if cached is not None:
                return cached
            if isinstance(node, yaml.SequenceNode):
                size = 1 + sum(self._size(child) for child in node.value)
            elif isinstance(node, yaml.MappingNode):
                size = 1 + sum(self._size(k) + self._size(v) for k, v in node.value)
            else:
                size = 1
            self._sizes[id(node)] = size
            return size

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                if event.anchor in self._open_anchors:
                    raise YamlBombError(f"alias *{event.anchor} at line {event.start_mark.line + 1} refers to "
                                        f"its own anchor (a structure containing itself); not a config")
                node = self.anchors.get(event.anchor)
                if node is not None:
                    self._count(self._size(node), event.start_mark, alias=True)
                return super().compose_node(parent, index)
            event = self.peek_event()
            anchor = getattr(event, "anchor", None)
            self._depth += 1
            if self._depth > max_depth:
                raise YamlBombError(f"is nested more than {max_depth} levels deep at line "
                                    f"{event.start_mark.line + 1}; not a config")
            self._count(1, event.start_mark)
            if anchor is not None:
                self._open_anchors.append(anchor)
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
                if anchor is not None:
                    self._open_anchors.pop()

    def construct_mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        out = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, "unhashable key", key_node.start_mark) from None
            if key in out:
                raise DuplicateKeyError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
            out[key] = loader.construct_object(value_node, deep=deep)
        return out

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return Loader


def _parse_yaml(text: str, path: Path) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=bounded_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except DuplicateKeyError as exc:
        raise InputError(f"{exc} (duplicate keys are ambiguous)", path=path) from None
    except YamlBombError as exc:
        raise InputError(str(exc), path=path) from None
    except RecursionError:
        raise InputError("is nested too deeply", path=path) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"invalid YAML{where}: {problem}", path=path) from None


_JSON_SCALARS = (str, int, float, bool, type(None))
_YAML_TYPES = {"date": "a date", "datetime": "a date and time", "set": "a set", "frozenset": "a set",
               "bytes": "binary data", "bytearray": "binary data"}


def _check_keys_are_strings(data, path):
    """Every key a string and every value one JSON can hold (a DeepSpeed config is JSON: YAML's dates, sets
    and binary values would end ``split``'s output, or DeepSpeed, in an error); the key is named."""
    stack = [(data, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if not isinstance(k, str):
                    raise InputError(f"key {printable(repr(k))[:80]}{_at(where)} is not a string", path=path)
                stack.append((v, f"{where}.{k}" if where else k))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
        elif not isinstance(node, _JSON_SCALARS):
            what = _YAML_TYPES.get(type(node).__name__, f"a {type(node).__name__}")
            raise InputError(f"{printable(where) or 'the value'} is {what}; a DeepSpeed config holds only JSON "
                             "values (strings, numbers, true/false, null, lists, objects): quote it", path=path)


def _at(where: str) -> str:
    return f" in {printable(where)}" if where else ""


def _plain(node):
    """OrderedDicts (hjson) to dicts, tuples to lists: one shape for everything downstream."""
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    return node


# --- YAML flavours -------------------------------------------------------------------------------------

def _from_yaml(path: Path, data: dict) -> LoadedConfig:
    ds = data.get("deepspeed_config")
    if ds is not None or data.get("distributed_type") == "DEEPSPEED":
        return _from_accelerate_yaml(path, data, ds if ds is not None else {})
    if isinstance(data.get("deepspeed"), (str, dict)):
        return _from_trainer_args(path, data, "trainer-yaml")
    # a DeepSpeed config written as YAML (GPT-NeoX style) or something without DeepSpeed keys at all
    return LoadedConfig(path=str(path), raw=data, kind="yaml")


def _int_or_none(value):
    try:
        return int(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


def _read_ref(yaml_path: Path, ref: str, expect: str = "deepspeed") -> tuple[Path, dict | None]:
    """The file another config names (``deepspeed_config_file``, ``deepspeed:``, ``--deepspeed_config``...),
    parsed. A file outside the user's tree (``door.outside_tree``) is read only when it is a config of the ``expect``ed
    kind: a crafted YAML naming ``/etc/shadow`` or ``~/.ssh/id_rsa`` must not get its lines parsed as keys and
    written by ``split`` into an output, nor quoted in an error."""
    ref_path = Path(os.path.expanduser(ref))
    if not ref_path.is_absolute():
        # accelerate and the trainers resolve against the working directory; the YAML's own directory is the
        # other common intent. Take whichever exists, preferring the working directory.
        candidates = [Path.cwd() / ref_path, yaml_path.parent / ref_path]
        ref_path = next((c for c in candidates if c.exists()), yaml_path.parent / ref_path)
    if not ref_path.exists():
        return ref_path, None
    if not door.outside_tree(ref_path, yaml_path):
        data, _kind = _parse_file(ref_path)
        return ref_path, data
    text = read_text(ref_path)
    _require_config_words(ref_path, text, yaml_path)
    data, _kind = _parse_file(ref_path, text)
    if not _has_config_keys(data, accelerate=expect == "accelerate", trainer=expect == "trainer"):
        raise _not_a_config(ref_path, yaml_path)
    return ref_path, data


# --- files outside the user's tree ---------------------------------------------------------------------------

_ACCELERATE_KEYS = ("deepspeed_config", "distributed_type", "compute_environment")
_TRAINER_KEYS = ("deepspeed", "model_name_or_path", "output_dir", "stage", "base_model")


def _config_words():
    from dsdoctor.config.schema import DEEPSPEED_TOP_LEVEL_KEYS

    words = sorted(set(DEEPSPEED_TOP_LEVEL_KEYS) | set(_ACCELERATE_KEYS) | set(_TRAINER_KEYS), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, words)))


def _require_config_words(path: Path, text: str, named_by: Path | None) -> None:
    """Refuse, before parsing (whose errors could quote it), a file outside the user's tree that names no config
    key at all (``door.require_words``)."""
    door.require_words(path, text, _config_words(), door.DS_CONFIG.what, named_by)


def _has_config_keys(data, accelerate: bool = False, trainer: bool = False) -> bool:
    from dsdoctor.config.schema import DEEPSPEED_TOP_LEVEL_KEYS

    if not isinstance(data, dict) or not data:
        return isinstance(data, dict)
    keys = set(DEEPSPEED_TOP_LEVEL_KEYS) | (set(_ACCELERATE_KEYS) if accelerate else set()) | \
        (set(_TRAINER_KEYS) if trainer or accelerate else set())
    return any(k in keys for k in data)


def _not_a_config(path: Path, named_by: Path | None) -> InputError:
    return door.refused_outside(path, door.DS_CONFIG.what, named_by)


def _from_accelerate_yaml(path: Path, data: dict, ds: Any) -> LoadedConfig:
    if not isinstance(ds, dict):
        raise InputError(f"deepspeed_config must be a mapping, not {type(ds).__name__}", path=path)
    mixed = data.get("mixed_precision")
    mixed = str(mixed).lower() if mixed is not None else None
    loaded = LoadedConfig(
        path=str(path), raw={}, kind="accelerate-yaml", source=copy.deepcopy(ds),
        num_processes=_int_or_none(data.get("num_processes")), mixed_precision=mixed,
    )
    ref = ds.get("deepspeed_config_file")
    if ref not in (None, "none", ""):
        if not isinstance(ref, str):
            raise InputError(f"deepspeed_config_file must be a path, not {ref!r}", path=path)
        ref_path, ref_data = _read_ref(path, ref)
        loaded.ref_path = str(ref_path)
        if ref_data is None:
            loaded.ref_missing = True
            loaded.notes.append(f"deepspeed_config_file {ref} not found; only the YAML's own keys are checked")
            raw: dict = {}
        else:
            raw = ref_data
        # accelerate fills the file's "auto" from its plugin defaults, and fp16/bf16 from mixed_precision
        loaded.raw = _fill_accelerate_precision(_fill_accelerate_plugin(raw, ds), mixed)
        return loaded
    loaded.raw = accelerate_plugin_dict(ds, mixed)
    return loaded


def accelerate_plugin_dict(ds: dict, mixed_precision: str | None = None) -> dict:
    """The DeepSpeed dict ``DeepSpeedPlugin`` builds from an accelerate YAML's ``deepspeed_config`` keys
    when no config file is given (accelerate 1.15, ``utils/dataclasses.py``), plus mixed precision."""
    stage = ds.get("zero_stage", 2)
    opt_dev = ds.get("offload_optimizer_device", "none")
    par_dev = ds.get("offload_param_device", "none")
    opt_nvme = ds.get("offload_optimizer_nvme_path", "none")
    par_nvme = ds.get("offload_param_nvme_path", "none")
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": ds.get("gradient_accumulation_steps", "auto"),
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": opt_dev, "nvme_path": opt_nvme if opt_dev == "nvme" else None},
            "offload_param": {"device": par_dev, "nvme_path": par_nvme if par_dev == "nvme" else None},
            "stage3_gather_16bit_weights_on_model_save": bool(ds.get("zero3_save_16bit_model", False)),
        },
    }
    clipping = ds.get("gradient_clipping", "auto")
    if clipping:
        config["gradient_clipping"] = clipping
    return _fill_accelerate_precision(config, mixed_precision)


def _fill_accelerate_plugin(raw: dict, ds: dict) -> dict:
    """``DeepSpeedPlugin.__post_init__`` with a config file: "auto" at these keys becomes the plugin's value
    (its default when the YAML does not set it: ZeRO stage 2, no offload), as ``fill_match`` does."""
    raw = copy.deepcopy(raw)
    plugin = {
        "gradient_accumulation_steps": ds.get("gradient_accumulation_steps", "auto"),
        "gradient_clipping": ds.get("gradient_clipping", "auto"),
        "zero_optimization.stage": ds.get("zero_stage", 2),
        "zero_optimization.offload_optimizer.device": ds.get("offload_optimizer_device", "none"),
        "zero_optimization.offload_param.device": ds.get("offload_param_device", "none"),
        "zero_optimization.offload_param.nvme_path": ds.get("offload_param_nvme_path", "none"),
        "zero_optimization.offload_optimizer.nvme_path": ds.get("offload_optimizer_nvme_path", "none"),
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": bool(ds.get("zero3_save_16bit_model", False)),
    }
    if "gradient_accumulation_steps" not in raw:
        raw["gradient_accumulation_steps"] = 1
    for dotted, value in plugin.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) == "auto":
            node[leaf] = value
    return raw


def _fill_accelerate_precision(raw: dict, mixed: str | None) -> dict:
    raw = copy.deepcopy(raw)
    if mixed in ("bf16", "fp16"):
        other = "fp16" if mixed == "bf16" else "bf16"
        section = raw.get(mixed)
        if not isinstance(section, dict):
            raw[mixed] = {"enabled": True}
        elif section.get("enabled", "auto") == "auto":
            section["enabled"] = True
        if isinstance(raw.get(other), dict) and raw[other].get("enabled") == "auto":
            raw[other]["enabled"] = False
    return raw


# ms-swift's built-in DeepSpeed configs (``--deepspeed zero3`` names a file shipped in swift/config/): what
# each one sets that matters here; every other key in them is "auto" or a training knob.
SWIFT_BUILTIN = {
    "zero0": {"stage": 0}, "zero1": {"stage": 1}, "zero2": {"stage": 2}, "zero3": {"stage": 3},
    "default-zero2": {"stage": 2}, "default-zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "zero3_offload": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                      "offload_param": {"device": "cpu", "pin_memory": True}},
}


def _swift_builtin(name: str) -> dict:
    zero = copy.deepcopy(SWIFT_BUILTIN[name])
    if zero["stage"] == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                     "reduce_bucket_size": "auto"})
    return {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "zero_optimization": zero,
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}


def trainer_precision(args: dict) -> str | None:
    """bf16/fp16 as TrainingArguments (and LLaMA-Factory, ms-swift, axolotl) say it."""
    def true(v):
        return v is True or (isinstance(v, str) and v.strip().lower() in ("true", "1", "yes"))

    if true(args.get("bf16")) or true(args.get("pure_bf16")) or str(args.get("torch_dtype", "")).lower() in (
            "bfloat16", "bf16"):
        return "bf16"
    if true(args.get("fp16")) or str(args.get("torch_dtype", "")).lower() in ("float16", "fp16"):
        return "fp16"
    return None


def _from_trainer_args(path: Path, data: dict, kind: str) -> LoadedConfig:
    """A trainer's own arguments (LLaMA-Factory/axolotl/ms-swift YAML, TrainingArguments JSON, a command line)
    whose ``deepspeed`` names a DeepSpeed JSON, an ms-swift built-in config, or holds the dict inline."""
    ref = data["deepspeed"]
    mixed = trainer_precision(data)
    loaded = LoadedConfig(path=str(path), raw={}, kind=kind, source=copy.deepcopy(data), mixed_precision=mixed)
    if isinstance(ref, dict):
        _check_keys_are_strings(ref, path)
        loaded.raw = _fill_accelerate_precision(_plain(copy.deepcopy(ref)), mixed)
        return loaded
    if not isinstance(ref, str) or not ref.strip():
        raise InputError(f"deepspeed must be a path or a mapping, not {ref!r}", path=path)
    if ref in SWIFT_BUILTIN and not Path(ref).exists():
        loaded.ref_path = f"ms-swift built-in {ref}"
        loaded.raw = _fill_accelerate_precision(_swift_builtin(ref), mixed)
        loaded.notes.append(f"deepspeed: {ref} is ms-swift's built-in config (swift/config/{ref}.json)")
        return loaded
    ref_path, ref_data = _read_ref(path, ref)
    loaded.ref_path = str(ref_path)
    if ref_data is None:
        loaded.ref_missing = True
        loaded.stage_from_name = stage_in_name(ref)
        hint = f" (its name says ZeRO stage {loaded.stage_from_name})" if loaded.stage_from_name is not None else ""
        loaded.notes.append(f"deepspeed config {ref} named in this file was not found{hint}; its keys are not checked")
    else:
        loaded.raw = _fill_accelerate_precision(ref_data, mixed)
    return loaded


_STAGE_IN_NAME = re.compile(r"(?:^|[^a-z])(?:z|zero|stage|zero_stage|zero-stage)[_-]?([0-3])(?![0-9])", re.IGNORECASE)


def stage_in_name(ref: str) -> int | None:
    """The ZeRO stage a config's file name states (ds_z3_config.json, zero3_offload.json, zero_stage2.json)."""
    m = _STAGE_IN_NAME.search(Path(str(ref)).name)
    return int(m.group(1)) if m else None


# --- command lines -------------------------------------------------------------------------------------

_LAUNCHERS = ("deepspeed", "torchrun", "accelerate", "python", "python3", "swift", "llamafactory-cli", "lmf",
              "axolotl", "nohup")
_ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


_LAUNCHER_IN_LINE = re.compile("|".join(map(re.escape, _LAUNCHERS)))


def launch_words(text: str, every: bool = False):
    """The words of each command line of a launch line or shell script: continuation lines joined, comments
    dropped, a line with unbalanced quotes skipped. The one reader of launch lines (``check``'s command configs
    here, the RL jobs of ``config/rl.py``). ``every``: every line (assignments too), else only lines naming a
    launcher. ``shlex`` is pure Python and quadratic in a token's length (a 2 MB line takes minutes), so at most
    as many bytes as a YAML file may hold in all are split: past them no more lines come (with ``every``, none:
    the text is no launch script), so any file's cost stays bounded (a real launch script is a few KiB)."""
    import shlex

    budget = door.DS_CONFIG.slow_parse_bytes
    if every and len(text) > budget:
        return
    for line in text.replace("\\\r\n", " ").replace("\\\n", " ").splitlines():
        if not every and not _LAUNCHER_IN_LINE.search(line):
            continue
        budget -= len(line)
        if budget < 0:
            return
        try:
            yield shlex.split(line, comments=True)
        except ValueError:  # unbalanced quotes: not a command line
            continue


def launch_flags(tokens: list[str]) -> tuple[dict[str, str], list[str]]:
    """``--key value``, ``--key=value`` and bare ``--flag`` (``"true"``), dashes in names as underscores, and hydra's
    ``a.b.c=value`` overrides, as text; and the positional words. A word is a flag's value unless it is an
    option itself (``-x``, ``--y``; a negative number is a value)."""
    flags: dict[str, str] = {}
    positional: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--") and len(tok) > 2:
            key, eq, value = tok[2:].partition("=")
            if not eq:
                nxt = tokens[i + 1] if i + 1 < len(tokens) else "-"
                value, i = ("true", i) if nxt.startswith("-") and not _NEGATIVE.fullmatch(nxt) else (nxt, i + 1)
            flags[key.replace("-", "_")] = value
        elif _HYDRA.fullmatch(tok):  # a.b.c=value, +a.b=value
            key, _, value = tok.lstrip("+").partition("=")
            flags[key] = value
        elif not tok.startswith("-"):
            positional.append(tok)
        i += 1
    return flags, positional


_NEGATIVE = re.compile(r"-\d[\d.e+-]*")
_HYDRA = re.compile(r"\+?\+?[A-Za-z_][\w.]*\.[\w.]+=.*")


def _command_tokens(text: str) -> list[str]:
    """The words of the first launch command in ``text`` (``export``/``cd`` lines and leading VAR=value
    assignments skipped)."""
    for tokens in launch_words(text):
        while tokens and _ENV_ASSIGN.match(tokens[0]):  # CUDA_VISIBLE_DEVICES=0,1 NPROC_PER_NODE=2 swift sft ...
            tokens.pop(0)
        if tokens and tokens[0].rsplit("/", 1)[-1] in _LAUNCHERS:
            return tokens
    return []


def looks_like_command(text: str) -> bool:
    """A launch command line or a shell script with one (a line whose first word, after VAR=value assignments,
    is a launcher or trainer CLI)."""
    return bool(_command_tokens(text))


def parse_command(text: str) -> dict:
    """A launch command (``swift sft --deepspeed zero3 ...``, ``deepspeed run.py --deepspeed ds.json
    --do_predict ...``, ``llamafactory-cli train x.yaml``) as the trainer's arguments. Values are read as YAML
    scalars (``true``, ``8``), as HfArgumentParser and ms-swift read them. ``_command`` holds the program and
    sub-command, ``_script`` the first positional file."""
    import yaml

    flags, positional = launch_flags(_command_tokens(text))
    out: dict = {}
    for key, value in flags.items():
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        out[key] = parsed if isinstance(parsed, (str, int, float, bool)) else value
    out["_command"] = " ".join(positional[:2])
    script = next((p for p in positional if p.endswith((".py", ".yaml", ".yml", ".json"))), None)
    if script:
        out["_script"] = script
    return out


def from_command(path: Path, text: str) -> LoadedConfig:
    args = parse_command(text)
    script = args.get("_script")
    if "deepspeed" not in args and isinstance(args.get("config_file"), str) and \
            args.get("_command", "").startswith("accelerate"):  # accelerate launch --config_file acc.yaml ...
        ref_path, _data = _read_ref(path, args["config_file"], expect="accelerate")
        if not ref_path.exists():
            raise InputError(f"names accelerate config {args['config_file']}, which was not found", path=path)
        return load_config(ref_path)
    if "deepspeed" not in args and script and script.endswith((".yaml", ".yml")):
        # llamafactory-cli train x.yaml / axolotl train x.yml: the YAML holds the arguments
        ypath, ydata = _read_ref(path, script, expect="trainer")
        if ydata is None:
            raise InputError(f"names {script}, which was not found (the trainer's arguments are in it)", path=path)
        if isinstance(ydata, dict):
            merged = dict(ydata, **{k: v for k, v in args.items() if not k.startswith("_")})
            merged["_command"] = args["_command"]
            if isinstance(merged.get("deepspeed"), (str, dict)):
                return _from_trainer_args(ypath, merged, "command")
    if "deepspeed" in args and args["deepspeed"] is not True:
        return _from_trainer_args(path, args, "command")
    for key in ("deepspeed_config", "deepscale_config", "ds_config"):  # deepspeed.add_config_arguments, scripts
        if isinstance(args.get(key), str):
            ref_path, ref_data = _read_ref(path, args[key])
            args["_raw_deepspeed"] = key
            loaded = LoadedConfig(path=str(path), raw=ref_data or {}, kind="command", source=args,
                                  ref_path=str(ref_path), ref_missing=ref_data is None)
            if ref_data is None:
                loaded.stage_from_name = stage_in_name(args[key])
                loaded.notes.append(f"--{key} {args[key]} was not found; its keys are not checked")
            return loaded
    raise InputError("is a command line without --deepspeed CONFIG or --deepspeed_config CONFIG (nothing names a "
                     "DeepSpeed config)", path=path)
