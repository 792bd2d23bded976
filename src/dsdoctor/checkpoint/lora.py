"""PEFT LoRA checkpoints: recognise them, and write either a PEFT adapter or base weights with the update folded in.

A PEFT-wrapped model trained under DeepSpeed saves its state dict as it is in memory (PEFT 0.21, tuners/lora):
every key starts with ``base_model.model.``; a wrapped layer ``X`` keeps its original weight as
``X.base_layer.weight`` (frozen: ZeRO keeps it in ``frozen_param_fragments``) beside the trained
``X.lora_A.<adapter>.weight`` [r, in] and ``X.lora_B.<adapter>.weight`` [out, r] (an embedding:
``X.lora_embedding_A.<adapter>`` [r, num] and ``X.lora_embedding_B.<adapter>`` [dim, r]; DoRA adds
``X.lora_magnitude_vector.<adapter>.weight`` [out]); ``modules_to_save`` layers keep a trained copy
``X.modules_to_save.<adapter>.*`` beside ``X.original_module.*``. Written as they are beside a base config,
``from_pretrained`` finds none of its keys and initialises every weight anew, without an error.

Two outputs, as PEFT itself defines them:
- the adapter (``save_pretrained``, utils/save_and_load.py): the LoRA tensors and the modules_to_save copies,
  the adapter name removed from the key (``X.lora_A.weight``; DoRA's ``X.lora_magnitude_vector``),
  ``adapter_model.safetensors`` beside the run's ``adapter_config.json``;
- the merged weights (``merge_and_unload``, tuners/lora/layer.py ``get_delta_weight``): in the base model's key
  names, ``W + transpose(B @ A, fan_in_fan_out) * scaling`` with ``scaling = lora_alpha / r``
  (``lora_alpha / sqrt(r)`` with ``use_rslora``; ``alpha_pattern`` per layer), computed in float32 from the
  fp32 masters and rounded once to the output dtype; DoRA scales each output row by
  ``magnitude / ||W + delta||`` as PEFT's ``DoraLinearVariant.merge_unsafe`` does.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.checkpoint.pieces import MergePlan, TensorPlan
from dsdoctor.errors import InputError, printable

PEFT_PREFIX = "base_model.model."
PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|"
                      r"lora_magnitude_vector)\.(?P<adapter>[^.]+)(?:\.(?P<leaf>weight|bias))?$")
SAVED_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|"
                       r"lora_magnitude_vector)(?:\.(?P<leaf>weight|bias))?$")
CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_PATTERNS = 4096
MAX_PATTERN_CHARS = 256


@dataclass
class AdapterConfig:
    path: Path
    r: int
    alpha: float
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    use_dora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    bias: str = "none"
    lora_bias: bool = False
    base: str | None = None  # base_model_name_or_path, as recorded (never followed: see merge.py)
    # which layers PEFT wraps (tuners_utils.check_target_module_exists): names, or one regex; None: unknown
    target_modules: list | str | None = None
    exclude_modules: list | str | None = None
    modules_to_save: list = field(default_factory=list)
    some_layers: bool = False  # layers_to_transform: only some layers of those named are wrapped

    def _pattern(self, table: dict, module: str):
        """PEFT's get_pattern_key: the first key that matches the end of the module name (``(.*\\.)?(key)$``)."""
        for key in table:
            if module == key or module.endswith("." + key):
                return key
            if re.escape(key) != key and re.match(rf"(.*\.)?({key})$", module):
                return key
        return None

    def targets(self, module: str) -> bool | None:
        """Whether PEFT wraps base-model layer ``module`` with this config (None: the config does not say)."""
        if _matches(self.exclude_modules, module) or any(re.match(rf"(^|.*\.){m}($|\..*)", module)
                                                          for m in self.modules_to_save):
            return False
        if self.target_modules is None or self.target_modules == "all-linear":
            return None
        if not _matches(self.target_modules, module):
            return False
        return None if self.some_layers and not isinstance(self.target_modules, str) else True

    def rank(self, module: str) -> int:
        key = self._pattern(self.rank_pattern, module)
        return self.rank_pattern[key] if key is not None else self.r

    def scaling(self, module: str, r: int) -> float:
        key = self._pattern(self.alpha_pattern, module)
        alpha = self.alpha_pattern[key] if key is not None else self.alpha
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _matches(targets, module: str) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets or ())


def contradictions(cfg: AdapterConfig, layers: dict[str, set], modules: set[str] | None) -> list[str]:
    """What adapter_config.json says that the adapter's tensors contradict, PEFT then loading another model than
    the one trained: a LoRA layer target_modules leaves out (its tensors dropped), a layer it targets that has no
    LoRA tensors (an untrained one added), use_dora or lora_bias against the tensors. ``layers``: each LoRA
    layer's name in the base model -> its parts; ``modules``: the base model's layers that hold a weight."""
    out, shown = [], printable(repr(cfg.target_modules))[:80]
    left_out = sorted(m for m in layers if cfg.targets(m) is False)
    if left_out:
        out.append(f"target_modules {shown} leaves out LoRA layer(s) {_few(left_out)}")
    extra = sorted(m for m in (modules or set()) - set(layers) if cfg.targets(m))
    if extra:
        out.append(f"target_modules {shown} targets {_few(extra)}, which hold(s) no LoRA tensors")
    for flag, part in (("use_dora", "lora_magnitude_vector"), ("lora_bias", "lora_B.bias")):
        odd = sorted(m for m, parts in layers.items() if (part in parts) != getattr(cfg, flag))
        if odd:
            out.append(f"{flag} is {str(getattr(cfg, flag)).lower()} but LoRA layer(s) {_few(odd)} "
                       f"{'lack' if getattr(cfg, flag) else 'have'} {part}")
    return out


def _few(items: list[str]) -> str:
    return ", ".join(items[:3]) + (f", ... ({len(items) - 3} more)" if len(items) > 3 else "")


@dataclass
class LoraModule:
    path: str  # the layer's name in the PEFT model (X above)
    parts: dict = field(default_factory=dict)  # lora_A, lora_B, lora_B.bias, magnitude... -> TensorPlan
    base_weight: TensorPlan | None = None
    base_bias: TensorPlan | None = None

    @property
    def embedding(self) -> bool:
        return "lora_embedding_A" in self.parts


@dataclass
class Adapter:
    """A LoRA checkpoint: its adapter name, its LoRA layers, its modules_to_save copies."""

    name: str
    modules: dict[str, LoraModule]
    saved: dict[str, str]  # modules_to_save key -> the key in the base model
    prefixed: bool  # keys start with base_model.model.


def detect(plan: MergePlan) -> Adapter | None:
    """The adapter in a merge plan, or None when no key is a LoRA key. A PEFT model of another method (keys
    ``*.base_layer.*`` and no LoRA tensor) is refused: dsdoctor writes LoRA adapters only."""
    names = [t.name for t in plan.tensors]
    found = {n: m for n in names if (m := LORA_KEY.match(n))}
    if not found:
        wrapped = [n for n in names if ".base_layer." in n]
        if wrapped:
            raise InputError(f"a PEFT checkpoint without LoRA tensors ({len(wrapped)} wrapped layers, e.g. "
                             f"{wrapped[0]}): a PEFT method other than LoRA, which dsdoctor does not merge",
                             hint="save the adapter with PEFT's save_pretrained from the training run")
        return None
    adapters = sorted({m["adapter"] for m in found.values()})
    if len(adapters) > 1:
        raise InputError(f"{len(adapters)} LoRA adapters in one checkpoint ({', '.join(adapters[:5])}): dsdoctor "
                         "writes one adapter at a time and cannot tell which one was trained",
                         hint="delete the other adapters before saving (model.delete_adapter), then save again")
    adapter = adapters[0]
    by_name = {t.name: t for t in plan.tensors}
    modules: dict[str, LoraModule] = {}
    for n, m in found.items():
        mod = modules.setdefault(m["module"], LoraModule(m["module"]))
        key = m["part"] + (".bias" if m["leaf"] == "bias" else "")
        mod.parts[key] = by_name[n]
    for path, mod in modules.items():
        for stem in (f"{path}.base_layer.", f"{path}."):
            if mod.base_weight is None and stem + "weight" in by_name:
                mod.base_weight = by_name[stem + "weight"]
                mod.base_bias = by_name.get(stem + "bias")
        if mod.base_weight is None:
            raise InputError(f"LoRA layer {path} has no base weight ({path}.base_layer.weight) in the checkpoint",
                             hint="save the whole model (engine.save_checkpoint), not only the trainable tensors")
    saved = {}
    mark = f".modules_to_save.{adapter}."
    for n in names:
        if mark in n:
            saved[n] = n.replace(mark, ".", 1)
    return Adapter(adapter, modules, saved, all(n.startswith(PEFT_PREFIX) for n in names))


# ---- adapter_config.json -----------------------------------------------------------------------------------
def find_config(given, folders: list[Path]) -> tuple[Path | None, list[Path]]:
    """The adapter_config.json to use: the one given (a file or a folder holding it), else the first in
    ``folders`` (the run's: tag folder, checkpoint folder, its parent)."""
    if given is not None:
        p = Path(given)
        p = p / CONFIG_NAME if p.is_dir() else p
        if not p.is_file():
            raise InputError("no adapter_config.json here", path=given)
        return p, [p]
    searched = []
    for d in folders:
        if d is None or d in searched:
            continue
        searched.append(d)
        if (d / CONFIG_NAME).is_file():
            return d / CONFIG_NAME, searched
    return None, searched


def _number(cfg: dict, key: str, path, default=None, positive=True):
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            (positive and value <= 0):
        raise InputError(f"{key} is {printable(repr(value))[:60]}, not a positive number", path=path)
    return value


def _patterns(cfg: dict, key: str, path) -> dict:
    table = cfg.get(key) or {}
    if not isinstance(table, dict) or len(table) > MAX_PATTERNS or not all(
            isinstance(k, str) and 0 < len(k) <= MAX_PATTERN_CHARS and isinstance(v, (int, float))
            and not isinstance(v, bool) and v > 0 for k, v in table.items()):
        numbers = " to positive numbers" if key.endswith("_pattern") else ""
        raise InputError(f"{key} is not a bounded set of layer-name patterns{numbers}", path=path)
    for k in table:
        try:
            re.compile(k)
        except re.error:
            raise InputError(f"{key}: {printable(k)[:80]} is not a valid pattern", path=path) from None
    return table


def read_config(path: Path) -> AdapterConfig:
    cfg = door.read_json(path, door.ADAPTER_CONFIG)
    if not isinstance(cfg, dict):
        raise InputError("not a JSON object", path=path)
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InputError(f"peft_type is {printable(repr(peft_type))[:40]}: dsdoctor merges LoRA adapters only",
                         path=path)
    r = _number(cfg, "r", path)
    if not isinstance(r, int):
        raise InputError(f"r is {r}, not an integer", path=path)
    flags = {}
    for key in ("use_rslora", "fan_in_fan_out", "use_dora", "lora_bias"):
        value = cfg.get(key, False)
        if not isinstance(value, bool):
            raise InputError(f"{key} is {printable(repr(value))[:40]}, not true or false", path=path)
        flags[key] = value
    bias = cfg.get("bias", "none")
    if bias not in ("none", "all", "lora_only"):
        raise InputError(f"bias is {printable(repr(bias))[:40]}, not none, all or lora_only", path=path)
    base = cfg.get("base_model_name_or_path")
    return AdapterConfig(path=path, r=r, alpha=_number(cfg, "lora_alpha", path, default=8), bias=bias,
                         rank_pattern=_patterns(cfg, "rank_pattern", path),
                         alpha_pattern=_patterns(cfg, "alpha_pattern", path),
                         base=base if isinstance(base, str) else None, **flags,
                         target_modules=_names(cfg, "target_modules", path), some_layers=bool(
                             cfg.get("layers_to_transform") not in (None, [])),
                         exclude_modules=_names(cfg, "exclude_modules", path),
                         modules_to_save=_names(cfg, "modules_to_save", path, one_regex=False) or [])


def _names(cfg: dict, key: str, path, one_regex: bool = True):
    """Layer names (a list), or one pattern (a string, where ``one_regex``), bounded and compiled; None: absent."""
    value = cfg.get(key)
    names = [value] if isinstance(value, str) and one_regex else value
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) and len(n) <= 16 * MAX_PATTERN_CHARS for n in names):
        raise InputError(f"{key} is not a list of layer names{' or one pattern' if one_regex else ''}", path=path)
    if isinstance(value, list):
        _patterns({key: dict.fromkeys(names, 1)}, key, path)  # bounded, each a pattern that compiles
        return value
    try:  # one pattern, which may be longer than a name
        re.compile(value)
    except re.error:
        raise InputError(f"{key}: {printable(value)[:80]} is not a valid pattern", path=path) from None
    return value


def relative(path: str, adapter: Adapter) -> str:
    """A layer's name in the base model (PEFT matches rank_pattern / alpha_pattern against it)."""
    return path[len(PEFT_PREFIX):] if adapter.prefixed else path


def check_ranks(adapter: Adapter, cfg: AdapterConfig) -> None:
    """Each layer's rank (lora_A's rows) is the one the config gives it; else the config is another run's."""
    for mod in adapter.modules.values():
        a = mod.parts.get("lora_A") or mod.parts.get("lora_embedding_A")
        b = mod.parts.get("lora_B") or mod.parts.get("lora_embedding_B")
        if a is None or b is None:
            raise InputError(f"LoRA layer {mod.path} has {', '.join(sorted(mod.parts))} but not both A and B")
        r = a.shape[0]
        want = cfg.rank(relative(mod.path, adapter))
        if r != want:
            raise InputError(f"{cfg.path.name} gives layer {relative(mod.path, adapter)} rank {want}, but its lora_A "
                             f"has {r} rows: the config belongs to another run", path=cfg.path,
                             hint="pass --adapter-config with the run's own adapter_config.json")


# ---- the two outputs ----------------------------------------------------------------------------------------
def saved_key(name: str, adapter: Adapter) -> str:
    """PEFT's key in adapter_model.safetensors (_remove_adapter_name_from_state_dict_key; DoRA's
    magnitude without ``.weight``)."""
    m = LORA_KEY.match(name)
    if m and m["adapter"] == adapter.name:
        key = f"{m['module']}.{m['part']}"
        if m["leaf"] and m["part"] != "lora_magnitude_vector":
            key += "." + m["leaf"]
        return key
    return adapter.saved.get(name, name)


def adapter_plan(plan: MergePlan, adapter: Adapter, cfg: AdapterConfig) -> list[tuple[str, TensorPlan]]:
    """(key, tensor) of the PEFT adapter: LoRA tensors, modules_to_save copies, and the biases PEFT saves."""
    check_ranks(adapter, cfg)
    lora_layers = set(adapter.modules)
    out = []
    for t in plan.tensors:
        take = LORA_KEY.match(t.name) is not None or t.name in adapter.saved
        if not take and t.name.endswith(".bias") and cfg.bias != "none":
            layer = t.name.rsplit(".", 2)[0] if t.name.endswith(".base_layer.bias") else None
            take = cfg.bias == "all" or layer in lora_layers
        if take:
            out.append((saved_key(t.name, adapter), t))
    return out


def base_key(name: str, adapter: Adapter) -> str | None:
    """The key in the base model, or None for a tensor that folding consumes (LoRA, original_module)."""
    if LORA_KEY.match(name) or ".original_module." in name:
        return None
    name = adapter.saved.get(name, name)
    name = name[len(PEFT_PREFIX):] if adapter.prefixed and name.startswith(PEFT_PREFIX) else name
    return name.replace(".base_layer.", ".")


def merged_plan(plan: MergePlan, adapter: Adapter, cfg: AdapterConfig) -> tuple[list[tuple[str, TensorPlan]], dict]:
    """(key, tensor) in the base model's names, every LoRA layer's update folded into its base weight; and the
    tied aliases renamed the same way."""
    check_ranks(adapter, cfg)
    folded = {}
    for mod in adapter.modules.values():
        if len(mod.parts["lora_A" if "lora_A" in mod.parts else "lora_embedding_A"].shape) != 2:
            raise InputError(f"LoRA layer {mod.path} is a convolution: dsdoctor folds LoRA into linear and "
                             "embedding layers only", hint="merge without --merge-lora to write the PEFT adapter")
        if "lora_magnitude_vector" in mod.parts and mod.embedding:
            raise InputError(f"LoRA layer {mod.path} is a DoRA embedding, which dsdoctor does not fold",
                             hint="merge without --merge-lora to write the PEFT adapter")
        scale = cfg.scaling(relative(mod.path, adapter), mod.parts.get("lora_A", mod.parts.get("lora_embedding_A")).shape[0])
        folded[mod.base_weight.name] = _fold_weight(mod, scale, cfg.fan_in_fan_out)
        if "lora_B.bias" in mod.parts:
            if mod.base_bias is None:
                raise InputError(f"LoRA layer {mod.path} has a lora_B bias but its base layer has none: PEFT cannot "
                                 "merge it either")
            folded[mod.base_bias.name] = _fold_bias(mod, scale)
    out, seen = [], {}
    for t in plan.tensors:
        key = base_key(t.name, adapter)
        if key is None:
            continue
        if key in seen:
            raise InputError(f"{seen[key]} and {t.name} both become {key} in the base model")
        seen[key] = t.name
        out.append((key, folded.get(t.name, t)))
    aliases = {}
    for alias, src in plan.aliases.items():
        a, s = base_key(alias, adapter), base_key(src, adapter)
        if a is not None and s is not None:
            aliases[a] = s
    return out, aliases


def _values(read, plan: TensorPlan):
    import torch

    parts = [read(p) for p in plan.pieces]
    flat = torch.cat(parts) if len(parts) != 1 else parts[0]
    return flat.float().reshape(plan.shape)


def _fold_weight(mod: LoraModule, scale: float, fan_in_fan_out: bool) -> TensorPlan:
    base = mod.base_weight
    emb = mod.embedding
    a = mod.parts["lora_embedding_A" if emb else "lora_A"]
    b = mod.parts["lora_embedding_B" if emb else "lora_B"]
    magnitude = mod.parts.get("lora_magnitude_vector")
    flip = True if emb else fan_in_fan_out  # an embedding's update is transposed (PEFT's Embedding layer)
    r = a.shape[0]
    out_rows, in_cols = (b.shape[0], a.shape[1])
    want = (in_cols, out_rows) if flip else (out_rows, in_cols)
    if b.shape[1] != r or tuple(base.shape) != want:
        raise InputError(f"LoRA layer {mod.path}: lora A {list(a.shape)} and B {list(b.shape)} do not fit its base "
                         f"weight {list(base.shape)}")

    def compute(read):
        weight = _values(read, base)
        delta = _values(read, b) @ _values(read, a)
        delta = (delta.T if flip else delta) * scale
        if magnitude is None:
            return weight + delta
        import torch

        norm = torch.linalg.norm((weight.T if flip else weight) + (delta.T if flip else delta), dim=1)
        factor = (_values(read, magnitude).reshape(-1) / norm).view(-1, 1)
        return (factor.T if flip else factor) * (weight + delta)

    pieces = base.pieces + a.pieces + b.pieces + (magnitude.pieces if magnitude is not None else [])
    return TensorPlan(base.name, tuple(base.shape), "float32", pieces, "folded", compute=compute)


def _fold_bias(mod: LoraModule, scale: float) -> TensorPlan:
    base, extra = mod.base_bias, mod.parts["lora_B.bias"]

    def compute(read):
        return _values(read, base) + _values(read, extra) * scale

    return TensorPlan(base.name, tuple(base.shape), "float32", base.pieces + extra.pieces, "folded", compute=compute)


# ---- weights on disk: the two forms, for verify and compare ----------------------------------------------------
def is_adapter_dir(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / CONFIG_NAME).is_file() and not (p / "config.json").is_file()


def peft_keys(names) -> list[str]:
    """Keys of a PEFT model's own state dict (wrapped, or adapter tensors): what from_pretrained cannot load."""
    return [n for n in names if n.startswith(PEFT_PREFIX) or LORA_KEY.match(n) or ".base_layer." in n
            or ".modules_to_save." in n or ".original_module." in n]


def fold_into(base: dict, adapter: dict, cfg: AdapterConfig):
    """Base tensors (a state dict) with a saved adapter's updates added, as merge_and_unload would: a dict of
    the changed tensors (float32) by base key, and the adapter keys that fit no base tensor."""
    layers: dict[str, dict] = {}
    unfit = []
    for key, t in adapter.items():
        m = SAVED_KEY.match(key)
        if m is None:
            name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
            layers.setdefault("", {})[name] = t  # a modules_to_save copy or a bias: replaces the base tensor
            continue
        module = m["module"][len(PEFT_PREFIX):] if m["module"].startswith(PEFT_PREFIX) else m["module"]
        layers.setdefault(module, {})[m["part"] + (".bias" if m["leaf"] == "bias" else "")] = t
    out = {}
    for name, t in layers.pop("", {}).items():
        if name not in base or tuple(base[name].shape) != tuple(t.shape):
            unfit.append(name)
        else:
            out[name] = t.float()
    for module, parts in layers.items():
        weight = base.get(module + ".weight")
        emb = "lora_embedding_A" in parts
        a, b = parts.get("lora_embedding_A" if emb else "lora_A"), parts.get("lora_embedding_B" if emb else "lora_B")
        if weight is None or a is None or b is None or a.dim() != 2 or b.dim() != 2:
            unfit.append(module)
            continue
        flip = True if emb else cfg.fan_in_fan_out
        delta = b.float() @ a.float()
        delta = (delta.T if flip else delta) * cfg.scaling(module, a.shape[0])
        if tuple(delta.shape) != tuple(weight.shape):
            unfit.append(module)
            continue
        w = weight.float()
        merged = w + delta
        if "lora_magnitude_vector" in parts:
            import torch

            norm = torch.linalg.norm(merged.T if flip else merged, dim=1)
            factor = (parts["lora_magnitude_vector"].float().reshape(-1) / norm).view(-1, 1)
            merged = (factor.T if flip else factor) * merged
        out[module + ".weight"] = merged
        if "lora_B.bias" in parts and module + ".bias" in base:
            out[module + ".bias"] = base[module + ".bias"].float() + parts["lora_B.bias"].float() * \
                cfg.scaling(module, a.shape[0])
    return out, unfit
