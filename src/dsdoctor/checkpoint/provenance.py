"""Whether every rank file of a checkpoint comes from one save.

A tag folder is sometimes assembled by hand: a rank file copied in from another run, or from another step of
the same run. Each file then reads fine and the merge would stitch partitions of different models together,
silently. DeepSpeed writes what identifies a save into every file: the model-states files (one per rank with
ZeRO-3) carry ``global_steps``, ``global_samples``, ``skipped_steps``, ``dp_world_size``, ``mp_world_size``
and the parameter shapes; the optim-states files the optimizer's own step counter, the ZeRO stage and the
partition counts; all of them ``ds_version`` and ``ds_config``. Every one of these must agree across the
files; the file that differs from the others is named (exit 2). A tag named ``global_stepN`` (DeepSpeed's
default) decides a tie between two halves.

A field is compared among the files that carry it: older DeepSpeed versions and other writers leave some out.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from dsdoctor.checkpoint.pieces import States
from dsdoctor.checkpoint.unpickle import Opaque, TensorRef
from dsdoctor.errors import InputError, printable

MODEL_FIELDS = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size")
_TAG_STEP = re.compile(r"^global_step(\d+)$")
_ABSENT = "(absent)"


def _canonical(value, depth: int = 0) -> str:
    """A comparable text of a value read from a checkpoint (stand-ins and tensors by what they hold)."""
    if depth > 20:
        return "..."
    if isinstance(value, TensorRef):
        return f"tensor {value.dtype} {list(value.shape)}"
    if isinstance(value, Opaque):
        return f"<{value._qualname}>"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_canonical(k, depth + 1)}: {_canonical(v, depth + 1)}"
                               for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_canonical(v, depth + 1) for v in value) + "]"
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _optimizer_step(osd: dict):
    """The base optimizer's step counter (Adam's ``step``) as saved: ZeRO-3 keeps the torch optimizer's
    state under ``optimizer_state_dict``, ZeRO-1/2 under ``base_optimizer_state``."""
    base = osd.get("optimizer_state_dict") if isinstance(osd.get("optimizer_state_dict"), dict) else \
        osd.get("base_optimizer_state")
    state = base.get("state") if isinstance(base, dict) else None
    if not isinstance(state, dict):
        return _ABSENT
    steps = []
    for entry in list(state.values())[:64]:
        step = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(step, TensorRef):
            if step.numel != 1 or step.itemsize > 8:
                steps.append(f"tensor {list(step.shape)}")
                continue
            try:
                raw = step.read_data()
            except InputError:
                raw = b"?"
            steps.append(_tensor_number(raw, step.dtype))
        elif step is not None:
            steps.append(_canonical(step))
    if not steps:
        return _ABSENT
    return steps[0] if len(set(steps)) == 1 else "/".join(dict.fromkeys(steps))


def _tensor_number(raw: bytes, dtype: str) -> str:
    import struct

    formats = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i"}
    if dtype in formats and len(raw) == struct.calcsize(formats[dtype]):
        value = struct.unpack(formats[dtype], raw)[0]
        return f"{value:g}" if isinstance(value, float) else str(value)
    return raw.hex()


def _fields(states: States) -> list[tuple[str, list[tuple[Path, str]]]]:
    """(field name, [(file, its value as text)]) for every field that must agree across a group of files."""
    out = []
    model = list(zip(states.layout.model_files, states.model))
    optim = list(zip(states.layout.optim_files, states.optim))
    for name in MODEL_FIELDS:
        out.append((name, [(p, _canonical(sd.get(name, _ABSENT)) if name in sd else _ABSENT) for p, sd in model]))
    out.append(("param_shapes", [(p, _canonical(sd.get("param_shapes"))) for p, sd in model]))
    out.append(("frozen_param_shapes", [(p, _canonical(sd.get("frozen_param_shapes"))) for p, sd in model]))
    out.append(("optimizer step", [(p, _optimizer_step(osd)) for p, osd in optim]))
    for name in ("zero_stage", "partition_count"):
        out.append((name, [(p, _canonical(osd.get(name, _ABSENT)) if name in osd else _ABSENT) for p, osd in optim]))
    every = model + [(p, top) for p, top in zip(states.layout.optim_files, states.optim_tops or [])]
    for name in ("ds_version", "ds_config"):
        out.append((name, [(p, _canonical(sd.get(name)) if name in sd else _ABSENT) for p, sd in every]))
    return out


def check_one_save(states: States) -> None:
    """Raise an InputError naming the rank file whose save differs from the others' (step, world size,
    partition counts, parameter shapes, DeepSpeed version or config); the tag ``global_stepN`` breaks ties."""
    tag_step = _TAG_STEP.match(states.layout.tag or "")
    for name, values in _fields(states):
        values = [(p, v) for p, v in values if v != _ABSENT]
        counts = Counter(v for _, v in values)
        if len(counts) <= 1:
            continue
        ranked = counts.most_common()
        best = ranked[0][0]
        if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:  # a tie: the tag's step, else no majority
            tied = [v for v, c in ranked if c == ranked[0][1]]
            wanted = tag_step.group(1) if tag_step and name in ("global_steps", "optimizer step") else None
            best = next((v for v in tied if wanted is not None and v == wanted), None)
        if best is None:
            detail = "; ".join(f"{p.name}: {_short(v)}" for p, v in values[:8])
            raise InputError(f"rank files come from different saves: their {name} differ ({detail})",
                             path=states.layout.tag_dir, hint=_HINT)
        odd = [(p, v) for p, v in values if v != best]
        first, value = odd[0]
        agree = len(values) - len(odd)
        others = f"the other {agree} files have" if agree > 1 else \
            next(p.name for p, v in values if v == best) + " has"
        more = f" (so do {', '.join(p.name for p, _ in odd[1:4])}{', ...' if len(odd) > 4 else ''})" \
            if len(odd) > 1 else ""
        raise InputError(f"comes from a different save than the rest of tag {printable(states.layout.tag)}: its "
                         f"{name} is {_short(value)} where {others} {_short(best)}{more}", path=first, hint=_HINT)


_HINT = "a rank file from another run or step was copied in; take every rank file of the tag folder from one save"


def _short(text: str) -> str:
    text = printable(text)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["check_one_save"]
