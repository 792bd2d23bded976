"""ZeRO-1/2 rebuild rule (deepspeed/utils/zero_to_fp32.py, 0.19.8).

Each parameter group is one flat fp32 vector split into equal partitions, one per rank
(``single_partition_of_fp32_groups``). Concatenated over ranks, parameters follow ``param_shapes`` in order,
each followed by its entry of ``param_alignment_paddings`` when present; the vector's tail is padding up
to a multiple of 2*W. Frozen parameters are stored whole in the one model-states file; where DeepSpeed
recorded none (bf16 ZeRO-1), parameters found only in the 16-bit module state dict are taken from there.
"""
from __future__ import annotations

import math

from dsdoctor.checkpoint.pieces import Piece, States, TensorPlan, flat_groups, shape_of, split_range
from dsdoctor.checkpoint.unpickle import TensorRef
from dsdoctor.errors import InputError


def plan_zero12(states: States, world: int) -> list[TensorPlan]:
    out: list[TensorPlan] = []
    model0 = states.model[0]
    path0 = states.layout.model_files[0]

    frozen = model0.get("frozen_param_fragments") or {}
    for name, shape in (model0.get("frozen_param_shapes") or {}).items():
        shape = shape_of(shape, path0)
        frag = frozen.get(name)
        if not isinstance(frag, TensorRef) or frag.numel != math.prod(shape):
            raise InputError(f"frozen parameter {name} is missing or has the wrong size", path=path0)
        out.append(TensorPlan(name, shape, frag.dtype, [Piece(frag, 0, frag.numel)], "frozen"))

    per_rank = flat_groups(states, "single_partition_of_fp32_groups", "ZeRO-1/2")
    param_shapes = model0["param_shapes"]
    n_groups = len(per_rank[0])
    if any(len(g) != n_groups for g in per_rank) or len(param_shapes) != n_groups:
        raise InputError(f"{len(param_shapes)} parameter groups in param_shapes but the ranks hold "
                         f"{[len(g) for g in per_rank]} fp32 groups", path=states.layout.tag_dir)
    paddings = states.optim[0].get("param_alignment_paddings")
    align = 2 * world
    for g, shapes in enumerate(param_shapes):
        chunks = [ranks[g] for ranks in per_rank]
        avail = sum(c.numel for c in chunks)
        pads = paddings[g] if paddings is not None else None
        if pads is not None and len(pads) != len(shapes):
            raise InputError(f"group {g}: {len(shapes)} parameters but {len(pads)} alignment paddings",
                             path=states.layout.optim_files[0])
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            shape = shape_of(shape, path0)
            n = math.prod(shape)
            out.append(TensorPlan(name, shape, chunks[0].dtype, split_range(chunks, offset, n), "trainable"))
            offset += n + (pads[i] if pads is not None else 0)
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise InputError(f"group {g}: param_shapes account for {offset} elements but the partitions hold "
                             f"{avail}", path=states.layout.optim_files[0],
                             hint="model-states and optim-states files come from different runs")
    return out + untracked_module_params(states, {t.name for t in out})


def untracked_module_params(states: States, have: set[str]) -> list[TensorPlan]:
    """Parameters in the 16-bit ``module`` state dict that neither the fp32 partitions nor the frozen records
    hold. DeepSpeed 0.19.8 writes no frozen_param_shapes with the bf16 ZeRO-1 optimizer, so zero_to_fp32
    silently drops frozen parameters there; at stage 1/2 the module state dict still has them whole."""
    sd = states.model[0]
    skip = have | set(sd.get("buffer_names") or []) | set(sd.get("shared_params") or {})
    out = []
    for name, ref in (sd.get("module") or {}).items():
        if name not in skip and isinstance(ref, TensorRef) and ref.numel > 0:
            out.append(TensorPlan(name, tuple(ref.shape), ref.dtype, [Piece(ref, 0, ref.numel)], "module"))
    return out
