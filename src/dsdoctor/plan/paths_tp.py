"""Tensor-parallel groups with replicas: every (tp, replicas) split of the GPUs.

``tp`` is AutoTP over all GPUs (``memory.estimate_path``). A split ``tpKxR`` runs R independent AutoTP
groups of K GPUs (K divides the GPU count and the attention and key/value head counts), each with its own
batch: per GPU it is exactly AutoTP over K GPUs; the machine serves R batches at once.
"""
from __future__ import annotations

import dataclasses
import re

from dsdoctor.plan.memory import estimate_path

_SPLIT = re.compile(r"^tp(\d+)x(\d+)$")


def split_name(tp: int, replicas: int, gpus: int) -> str:
    return "tp" if tp == gpus else f"tp{tp}x{replicas}"


def parse_split(name: str, gpus: int) -> tuple[int, int] | None:
    """(tp, replicas) of a tensor-parallel path name, None for other paths."""
    if name == "tp":
        return gpus, 1
    m = _SPLIT.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def tp_splits(gpus: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """(tp, replicas) with 1 < tp < gpus, tp dividing the GPUs and both head counts; largest tp first."""
    out = []
    for tp in range(gpus - 1, 1, -1):
        if gpus % tp == 0 and heads % tp == 0 and kv_heads % tp == 0:
            out.append((tp, gpus // tp))
    return out


def estimate_split(tp: int, replicas: int, shape, wl, hw, knobs=None):
    """Per-GPU memory of one AutoTP group of ``tp`` GPUs (the same as tp over ``tp`` GPUs)."""
    mem = estimate_path("tp", shape, wl, dataclasses.replace(hw, gpus=tp), knobs)
    if mem is None:
        return None
    mem.name = split_name(tp, replicas, hw.gpus)
    mem.replicas = replicas
    return mem


def as_tp(mem):
    """The same memory under the name the speed model knows (``tp`` with ``mem.ranks`` GPUs)."""
    return dataclasses.replace(mem, name="tp")
