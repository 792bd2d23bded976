"""The load paths plan compares: one type per path, each declaring what plan needs of it (``base.py``).

``plan()`` loops over ``REGISTRY`` in order: that order is the order of the result's rows. Adding a path is
adding one type (a subclass of ``LoadPath``, usually in a module of its own here) and listing it below. A
path the shared memory model does not cover (a serving engine such as vLLM or SGLang, with its own KV-cache
pool) overrides ``memory()``, ``loading_methods()``, ``speed()`` and ``code()`` with models of its own
(``serving.py``).
"""
from __future__ import annotations

from dsdoctor.plan.paths.base import LoadPath, PlanContext
from dsdoctor.plan.paths.device_map import DeviceMap
from dsdoctor.plan.paths.loop import Zero2, Zero3GatherOnce
from dsdoctor.plan.paths.plain import Plain, PlainHalf
from dsdoctor.plan.paths.quantized import BnbInt8, BnbNf4, Zero3Int4, Zero3OffloadInt4
from dsdoctor.plan.paths.serving import Sglang, Vllm
from dsdoctor.plan.paths.tp import Tp, TpGroups
from dsdoctor.plan.paths.zero3 import Zero3, Zero3Nvme, Zero3Offload, config_path

REGISTRY: tuple[type[LoadPath], ...] = (
    Plain, Tp, TpGroups, Zero3, Zero3Offload, Zero3Nvme,  # measured on GPUs
    DeviceMap, Vllm, Sglang, BnbInt8, BnbNf4, Zero3Int4, Zero3OffloadInt4,  # estimates
    PlainHalf,  # an fp32 checkpoint in half precision
    Zero2, Zero3GatherOnce,  # --loop only
)


def paths_for(ctx: PlanContext) -> list[LoadPath]:
    """Every path of this plan, in the registry's order."""
    return [p for cls in REGISTRY if ctx.loop or not cls.loop_only for p in cls.instances(ctx)]


def quantized_names() -> set[str]:
    return {name for cls in REGISTRY if cls.quantized for name in getattr(cls, "names", (cls.name,))}


def serving_names() -> set[str]:
    return {cls.name for cls in REGISTRY if cls.serving}


def training_names() -> set[str]:
    return {cls.name for cls in REGISTRY if cls.trains}


def by_name(name: str) -> type[LoadPath] | None:
    """The type of a path with a fixed name (not a tp group's ``tpKxR``)."""
    return next((cls for cls in REGISTRY if cls.name == name), None)


__all__ = ["REGISTRY", "LoadPath", "PlanContext", "by_name", "config_path", "paths_for", "quantized_names",
           "serving_names", "training_names"]
