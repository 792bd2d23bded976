"""DeepSpeed universal checkpoints (``ds_to_universal`` output, DeepSpeed 0.19.8): every parameter already whole.

``deepspeed/checkpoint/ds_to_universal.py`` writes ``<folder>/zero/<param>/fp32.pt`` (and ``exp_avg.pt``,
``exp_avg_sq.pt``) per parameter: at ZeRO-1/2, and at ZeRO-3 with tensor parallelism, a dict whose ``param``
is the full tensor (tensor-parallel shards already put back together, vocabulary padding cut); at ZeRO-3
without tensor parallelism, the bare flat tensor, whose shape is in the copied model-states files'
``param_shapes``. It copies the ``*_model_states.pt`` files beside ``zero/``, and names the folder in the
checkpoint folder's ``latest_universal``. Frozen parameters of a ZeRO-3 checkpoint get no ``fp32.pt``; they
are still in the copied model-states files (``frozen_param_fragments``), read as ``zero3.py`` reads them.
"""
from __future__ import annotations

import math
from pathlib import Path

from dsdoctor.checkpoint import unpickle
from dsdoctor.checkpoint.layout import Layout, check_tp_ranks
from dsdoctor.checkpoint.pieces import MergePlan, Piece, TensorPlan, recorded_shapes, shape_of, split_range
from dsdoctor.checkpoint.tp import logical_shapes, recorded_info
from dsdoctor.checkpoint.unpickle import TensorRef, short_repr
from dsdoctor.errors import InputError, printable


def _name_ok(name) -> bool:
    return isinstance(name, str) and 0 < len(name) <= 1024 and "/" not in name and "\x00" not in name \
        and name not in (".", "..")


def plan_universal(layout: Layout) -> MergePlan:
    zero = layout.tag_dir / "zero"
    model = [unpickle.load(p) for p in layout.model_files]
    for p, sd in zip(layout.model_files, model):
        if not isinstance(sd, dict) or "buffer_names" not in sd:
            raise InputError("not a DeepSpeed model-states file (no buffer_names)", path=p)
    sd0, path0 = model[0], layout.model_files[0]
    check_tp_ranks(layout, sd0, path0)
    zero3 = path0.name.startswith("zero_pp_rank_")
    stage = 3 if zero3 else _stage(sd0)
    shapes = {}
    for group in sd0.get("param_shapes") or []:
        shapes.update(group if isinstance(group, dict) else {})
    frozen = dict(sd0.get("frozen_param_shapes") or {})
    module = sd0.get("module") or {}
    buffer_names = list(sd0.get("buffer_names") or [])
    on_disk = sorted(d.name for d in zero.iterdir() if d.is_dir() and (d / "fp32.pt").is_file()) if zero.is_dir() else []
    shared = sd0.get("shared_params") or {}
    shared = shared if isinstance(shared, dict) else {}
    # ds_to_universal also writes the module state dict's 16-bit tied aliases: the tie is kept instead
    extra = [n for n in on_disk if n not in shapes and n not in frozen and n not in buffer_names and n in module
             and n not in shared]
    if not shapes and not on_disk:
        raise InputError("a universal checkpoint folder with no zero/<param>/fp32.pt and no param_shapes",
                         path=layout.tag_dir)
    tensors = []
    for name in buffer_names:
        ref = module.get(name)
        if isinstance(ref, TensorRef):
            tensors.append(TensorPlan(name, tuple(ref.shape), ref.dtype, [Piece(ref, 0, ref.numel)], "buffer"))
    for name, kind in [(n, "frozen") for n in frozen] + [(n, "trainable") for n in shapes] + \
            [(n, "module") for n in extra]:
        if not _name_ok(name):
            raise InputError(f"malformed checkpoint: a parameter name is {short_repr(name)}", path=path0)
        f = zero / name / "fp32.pt"
        if f.is_file():
            tensors.append(_whole(name, unpickle.load(f), f, shapes.get(name), layout.tp_size, kind))
        elif kind == "frozen" and zero3 and layout.tp_size == 1:
            tensors.append(_frozen(name, shape_of(frozen[name], path0), layout, model))
        elif kind == "frozen" and zero3:
            raise InputError(f"frozen parameter {name} has no zero/{name}/fp32.pt: ds_to_universal does not write "
                             "the frozen parameters of a tensor-parallel ZeRO-3 checkpoint, and their shards are not "
                             "in this folder", path=layout.tag_dir,
                             hint="merge the original checkpoint (the folder ds_to_universal read) instead")
        else:
            raise InputError(f"missing zero/{printable(name)}/fp32.pt", path=layout.tag_dir,
                             hint="ds_to_universal was interrupted, or the folder was copied incompletely")
    names = {t.name for t in tensors}
    aliases = {a: s for a, s in shared.items()
               if isinstance(a, str) and isinstance(s, str) and s in names and a not in names}
    world = len(layout.model_files) if zero3 else _int(sd0.get("dp_world_size")) or 1
    return MergePlan(stage=stage, world_size=world, tensors=tensors, aliases=aliases, ds_version=sd0.get("ds_version"),
                     tp_size=layout.tp_size, source="universal", recorded=_recorded(layout, sd0, set(shapes) | set(frozen)))


def _recorded(layout: Layout, sd0: dict, params: set) -> dict:
    """The shapes the copied model-states files record; with tensor parallelism, the buffers' and each parameter's
    full shape from every rank's shard shapes and the recorded maps (nothing known without the maps)."""
    path0 = layout.model_files[0]
    recorded = recorded_shapes(sd0, path0)
    if layout.tp_size > 1:
        info = recorded_info(sd0)
        per = [recorded_shapes(unpickle.load(sub.model_files[0]), sub.model_files[0]) for sub in layout.mp_layouts]
        buffers = set(sd0.get("buffer_names") or [])
        recorded = {n: s for n, s in recorded.items() if n in buffers}
        shards = [{n: s for n, s in r.items() if n in params} for r in per]
        return {**recorded, **logical_shapes(info, shards, path0)} if info else {}  # {}: nothing to check against
    return recorded


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1_000_000 else None


def _stage(sd: dict) -> int:
    cfg = sd.get("ds_config")
    zero = cfg.get("zero_optimization") if isinstance(cfg, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return stage if stage in (1, 2) else 2


def _whole(name: str, obj, path: Path, recorded, tp: int, kind: str) -> TensorPlan:
    ref = obj.get("param") if isinstance(obj, dict) else obj
    if not isinstance(ref, TensorRef):
        raise InputError(f"no tensor in it (found {short_repr(obj)})", path=path)
    shape = tuple(ref.shape)
    if not isinstance(obj, dict):  # ZeRO-3 without tensor parallelism: flat; the shape is in param_shapes
        if recorded is None or tp != 1:
            raise InputError(f"{name} is stored flat and no shape is recorded for it", path=path)
        shape = shape_of(recorded, path)
    if math.prod(shape) != ref.numel:
        raise InputError(f"{name}: {ref.numel} elements for shape {list(shape)}", path=path)
    if recorded is not None and tp == 1 and math.prod(shape_of(recorded, path)) != ref.numel:
        raise InputError(f"{name} holds {ref.numel} elements, but the model-states files record shape "
                         f"{list(recorded)}", path=path, hint="the folder mixes files of different runs")
    return TensorPlan(name, shape, ref.dtype, [Piece(ref, 0, ref.numel)], kind)


def _frozen(name: str, shape: tuple, layout: Layout, model: list[dict]) -> TensorPlan:
    frags = []
    for p, sd in zip(layout.model_files, model):
        frag = (sd.get("frozen_param_fragments") or {}).get(name)
        if not isinstance(frag, TensorRef):
            raise InputError(f"frozen parameter {name} has no fragment", path=p)
        frags.append(frag)
    n = math.prod(shape)
    if sum(f.numel for f in frags) < n:
        raise InputError(f"frozen parameter {name}: fragments hold {sum(f.numel for f in frags)} of {n} elements",
                         path=layout.model_files[0])
    return TensorPlan(name, shape, frags[0].dtype, split_range(frags, 0, n), "frozen")
