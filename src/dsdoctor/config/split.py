"""``dsdoctor split``: write the inference config of a training config.

Keeps the ZeRO stage (3) and offload_param; drops the optimizer, scheduler, offload_optimizer, gradient and
loss-scale keys and everything else the schema table (``schema.py``) marks; resolves every "auto" (from the
model where it depends on the model, else to what DeepSpeed would use) unless ``keep_auto``; keeps or sets
``train_micro_batch_size_per_gpu`` because ``deepspeed.initialize`` requires a batch size. The input is never
mutated; the output is written atomically and never overwritten without ``force``.
"""
from __future__ import annotations

import copy
import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.config.check import check, read_both
from dsdoctor.config.effective import AUTO
from dsdoctor.config.load import LoadedConfig, load_config
from dsdoctor.config.schema import REMOVED_TOP_LEVEL_KEYS, ZERO_FIELDS, lookup
from dsdoctor.errors import InputError
from dsdoctor.findings import Finding
from dsdoctor.i18n import LANGS, fill, message_table, pick
from dsdoctor.model.spec import load_model_spec
from dsdoctor.report.render import Style, findings_markdown, findings_text, markdown_table, text_table

TEXT = message_table("config.split.TEXT")  # the words of the rendered split and the reasons outside the table


@dataclass
class Change:
    key: str
    action: str  # drop | resolve | set
    old: object
    new: object  # None for drop
    reason: dict  # {"en", "zh"}

    def to_dict(self, lang: str) -> dict:
        return {"key": self.key, "action": self.action, "old": self.old, "new": self.new,
                "reason": pick(self.reason, lang)}


@dataclass
class SplitResult:
    source: str
    out: str
    kind: str
    keep_auto: bool
    config: dict  # what was written
    changes: list[Change]
    diff: str
    findings: list[Finding] = field(default_factory=list)  # check of the written config (inference)

    def to_dict(self, lang: str = "en") -> dict:
        return {"source": self.source, "out": self.out, "kind": self.kind, "keep_auto": self.keep_auto,
                "changes": [c.to_dict(lang) for c in self.changes], "config": self.config, "diff": self.diff,
                "findings": [f.to_dict(lang) for f in self.findings]}

    def _rows(self, lang):
        def show(v):
            return "-" if v is None else json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v
        return [(c.key, c.action, f"{show(c.old)} -> {show(c.new)}" if c.action != "drop" else show(c.old)[:40],
                 pick(c.reason, lang)) for c in self.changes]

    def to_text(self, lang: str = "en", style: Style | None = None) -> str:
        style = style or Style()
        out = f"{style.ok} " + pick(TEXT["wrote"], lang).format(out=self.out, source=self.source) + "\n\n"
        out += text_table(pick(TEXT["head"], lang), self._rows(lang)) + "\n" + self.diff + "\n"
        out += pick(TEXT["checked"], lang) + "\n"
        return out + findings_text(self.findings, lang, style)

    def to_markdown(self, lang: str = "en") -> str:
        head = pick(TEXT["head markdown"], lang)
        return (f"### dsdoctor split\n\n`{self.source}` -> `{self.out}`\n\n" + markdown_table(head, self._rows(lang))
                + "\n```diff\n" + self.diff + "```\n\n" + findings_markdown(self.findings, lang))




def inference_config(loaded: LoadedConfig, model=None, keep_auto: bool = False,
                     dtype: str | None = None) -> tuple[dict, list[Change]]:
    """The inference config of ``loaded`` and the change list (pure: nothing is written). With ``dtype`` (the
    dtype plan runs the model in on this GPU) the precision sections say that dtype. What ``check`` then
    finds that a deletion fixes (a finding's ``deletes``) is deleted too, so the result passes split's own check."""
    from dsdoctor.config.runner import is_init_inference_config

    if is_init_inference_config(loaded.raw):
        return _init_inference_config(loaded.raw)
    new, changes = _training_to_inference(loaded, model, keep_auto)
    if dtype is not None:
        _set_dtype(new, changes, dtype)
    return new, changes + _apply_deletions(new, model)


def _set_dtype(new: dict, changes: list[Change], dtype: str) -> None:
    """bf16.enabled / fp16.enabled as ``dtype`` needs them (a section only written where one is enabled)."""
    reason = fill(TEXT["run dtype"], dtype=dtype)
    for sect, on in (("bf16", dtype == "bf16"), ("fp16", dtype == "fp16")):
        name = "bfloat16" if sect == "bf16" and "bfloat16" in new and "bf16" not in new else sect
        section = new.get(name)
        if not isinstance(section, dict):
            if not on:
                continue
            section = new[name] = {}
        if section.get("enabled") is not on:
            changes.append(Change(f"{name}.enabled", "resolve" if "enabled" in section else "set",
                                  section.get("enabled"), on, reason))
            section["enabled"] = on


def _apply_deletions(new: dict, model) -> list[Change]:
    """Delete every key a finding of ``check`` on ``new`` says to delete (DSD109, DSD322), until none is left."""
    changes: list[Change] = []
    for _ in range(4):  # a deletion can uncover another finding; a few rounds settle every rule there is
        found = [f for f in check(LoadedConfig(path=None, raw=new, kind="dict"), mode="inference",
                                  model=model).findings if f.deletes]
        done = 0
        for f in found:
            for path in f.deletes:
                *parents, leaf = path.split(".")
                container = new
                for part in parents:
                    container = container.get(part) if isinstance(container, dict) else None
                if isinstance(container, dict) and leaf in container:
                    reason = {lang: f"{f.code}: {f.fix(lang)}" for lang in LANGS}
                    changes.append(Change(path, "drop", container.pop(leaf), None, reason))
                    done += 1
        if not done:
            break
    return changes


def _training_to_inference(loaded: LoadedConfig, model, keep_auto: bool) -> tuple[dict, list[Change]]:  # noqa: C901,PLR0912,PLR0915
    """A training config's inference config: the table's drops and resolves."""
    spec = load_model_spec(model) if model is not None else None
    eff, _hf = read_both(loaded, spec)
    raw = loaded.raw
    new = copy.deepcopy(raw)
    changes: list[Change] = []

    def row_reason(key):
        return lookup(key).reason

    def dropped(path):
        f = lookup(path)
        return f is not None and f.split == "drop"

    def drop(container, key, path, reason):
        changes.append(Change(path, "drop", container[key], None, reason))
        del container[key]

    def resolve(container, key, path, value, reason):
        changes.append(Change(path, "resolve" if key in container else "set", container.get(key), value, reason))
        container[key] = value

    # top level
    for key in list(new):
        if key in REMOVED_TOP_LEVEL_KEYS:
            drop(new, key, key, TEXT["rejected"])
        elif dropped(key):
            drop(new, key, key, row_reason(key))

    # precision sections: loss scaling goes, "auto" enabled is resolved from the model
    model_dtype = spec.dtype if spec else None
    for sect in ("fp16", "bf16", "bfloat16"):
        section = new.get(sect)
        if not isinstance(section, dict):
            continue
        for sub in list(section):
            path = f"{sect}.{sub}"
            if dropped(path):
                drop(section, sub, path, row_reason(path))
        if section.get("enabled") == AUTO and not keep_auto:
            want = model_dtype == ("fp16" if sect == "fp16" else "bf16")
            reason = row_reason(f"{sect}.enabled")
            resolve(section, "enabled", f"{sect}.enabled", bool(want), reason)

    # zero_optimization
    zero = new.get("zero_optimization")
    stage = eff.zero_stage
    if isinstance(zero, dict):
        invalid = {k for k, _ in eff.invalid_keys if k.startswith("zero_optimization.")}
        new_stage = 3 if stage == 3 else 0
        if "stage" in zero and (zero["stage"] != new_stage) and (zero["stage"] != AUTO or not keep_auto):
            if not (isinstance(zero["stage"], (int, float, str)) and str(zero["stage"]) == str(new_stage)):
                resolve(zero, "stage", "zero_optimization.stage", new_stage, row_reason("zero_optimization.stage"))
        for sub in list(zero):
            path = f"zero_optimization.{sub}"
            if path in invalid or sub not in ZERO_FIELDS:
                drop(zero, sub, path, TEXT["rejected"])
            elif sub == "offload_param" and new_stage < 3:
                drop(zero, sub, path, TEXT["below stage 3"])
            elif dropped(path):
                drop(zero, sub, path, row_reason(path))
        op = zero.get("offload_param")
        if isinstance(op, dict):
            for sub in list(op):
                path = f"zero_optimization.offload_param.{sub}"
                if path in invalid:
                    drop(op, sub, path, TEXT["rejected"])
                elif op[sub] == AUTO and not keep_auto:
                    drop(op, sub, path, TEXT["auto dropped"])
        elif op == AUTO and not keep_auto:
            drop(zero, "offload_param", "zero_optimization.offload_param", TEXT["auto dropped"])
        if not keep_auto:
            h = spec.hidden_size if spec else None
            fills = {"prefetch_bucket_size": int(0.9 * h * h) if h else None,
                     "param_persistence_threshold": 10 * h if h else None}
            for sub in list(zero):
                if zero[sub] != AUTO or sub == "stage":
                    continue
                path = f"zero_optimization.{sub}"
                f = lookup(path)
                value = fills.get(f.name) or (f.default if f.split == "resolve" else None)
                if value is None:
                    drop(zero, sub, path, TEXT["auto dropped"])
                else:
                    resolve(zero, sub, path, value, f.reason)

    # anything else DeepSpeed rejects (DSD114), wherever it sits, if an earlier rule did not already take it
    for path, _why in eff.invalid_keys:
        parts = path.split(".")
        container = new
        for part in parts[:-1]:
            container = container.get(part) if isinstance(container, dict) else None
        if isinstance(container, dict) and parts[-1] in container:
            drop(container, parts[-1], path, TEXT["rejected"])

    # batch size: deepspeed.initialize requires one; micro batch 1 is the sane value for inference
    micro = new.get("train_micro_batch_size_per_gpu")
    if micro is None or (micro == AUTO and not keep_auto):
        resolve(new, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu", 1,
                row_reason("train_micro_batch_size_per_gpu"))

    # any "auto" left anywhere (tensor_parallel, monitors, ...): DeepSpeed drops it inside sections
    if not keep_auto:
        for key in list(new):
            value = new[key]
            if value == AUTO:
                drop(new, key, key, TEXT["auto dropped"])
            elif isinstance(value, dict):
                for sub in list(value):
                    if value[sub] == AUTO:
                        drop(value, sub, f"{key}.{sub}", TEXT["auto dropped"])
    return new, changes


def _init_inference_config(raw: dict) -> tuple[dict, list[Change]]:
    """An init_inference config is already an inference config: it stays as it is, unless it carries a ZeRO
    section (``zero``, or a ZeRO config handed as ``args``) that init_inference ignores (DSD122); then the
    deepspeed.initialize config that does what that section asked for (stage 3 and its offload_param)."""
    from dsdoctor.config.checks_configs import meant_config, pick_dtype
    from dsdoctor.config.inference_config import read_inference_config

    settings = read_inference_config(raw)
    if not settings.zero:
        return copy.deepcopy(raw), []
    dtype = settings.dtype if settings.dtype_set and settings.dtype in ("bf16", "fp16") else pick_dtype(None)[0]
    new = meant_config(settings.zero, dtype)
    changes = [Change(k, "drop", raw[k], None, TEXT["init_inference key"]) for k in raw]
    changes += [Change(k, "set", None, v, TEXT["init_inference meant"]) for k, v in new.items()]
    return new, changes


def split(config, out: str | os.PathLike, model: str | os.PathLike | None = None, keep_auto: bool = False,
          force: bool = False, dtype: str | None = None) -> SplitResult:
    """Write the inference config of ``config`` (path, dict or LoadedConfig) to ``out``; ``dtype``: the dtype
    plan runs the model in on this GPU (``diagnose`` passes it, so the config and the code agree)."""
    loaded = config if isinstance(config, LoadedConfig) else load_config(config)
    out_path = Path(out)
    if loaded.path and out_path.exists() and out_path.resolve() == Path(loaded.path).resolve():
        raise InputError("is the input config; write the inference config to another file", path=out_path)
    if loaded.ref_path and out_path.exists() and out_path.resolve() == Path(loaded.ref_path).resolve():
        raise InputError("is the DeepSpeed config the YAML names; write to another file", path=out_path)
    if loaded.ref_missing:
        raise InputError(f"names a DeepSpeed config that does not exist: {loaded.ref_path}", path=loaded.path)
    inputs = [p for p in (loaded.path, loaded.ref_path) if p]
    door.check_output_path(out_path, force, inputs, kind="file")
    new, changes = inference_config(loaded, model=model, keep_auto=keep_auto, dtype=dtype)
    text = json.dumps(new, indent=2, ensure_ascii=False) + "\n"
    before = json.dumps(loaded.raw, indent=2, ensure_ascii=False) + "\n"
    diff = "".join(difflib.unified_diff(before.splitlines(True), text.splitlines(True),
                                        fromfile=loaded.ref_path or loaded.name, tofile=str(out_path)))
    door.atomic_write_text(out_path, text, force=force, inputs=inputs)
    findings = check(LoadedConfig(path=None, raw=new, kind="dict"), mode="inference", model=model).findings
    return SplitResult(source=loaded.name, out=str(out_path), kind=loaded.kind, keep_auto=keep_auto, config=new,
                       changes=changes, diff=diff, findings=findings)
