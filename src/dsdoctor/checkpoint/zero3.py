"""ZeRO-3 rebuild rule (deepspeed/utils/zero_to_fp32.py, 0.19.8).

Each rank r keeps its fp32 partitions as flat groups; concatenated, they hold every trainable parameter in
``param_shapes`` order, ``ceil(n/W)`` elements each. A parameter's full tensor is the concatenation over
ranks of its slice ``[offset, offset + ceil(n/W))``, trimmed to n. Frozen parameters are 16-bit fragments of
the same size in each rank's model-states file.
"""
from __future__ import annotations

import math

from dsdoctor.checkpoint.pieces import Piece, States, TensorPlan, flat_groups, shape_of, split_range
from dsdoctor.checkpoint.unpickle import TensorRef
from dsdoctor.errors import InputError


def _gather(chunks_per_rank: list[list[TensorRef]], offset: int, n: int, world: int) -> list[Piece]:
    per_rank = math.ceil(n / world)
    pieces, left = [], n
    for chunks in chunks_per_rank:
        take = min(per_rank, left)
        if take > 0:
            pieces += split_range(chunks, offset, take)
        left -= take
    return pieces


def plan_zero3(states: States, world: int) -> list[TensorPlan]:
    out: list[TensorPlan] = []
    model0 = states.model[0]
    path0 = states.layout.model_files[0]

    frozen_shapes = model0.get("frozen_param_shapes") or {}
    for name, shape in frozen_shapes.items():
        shape = shape_of(shape, path0)
        n = math.prod(shape)
        # the concatenation of every rank's whole fragment, trimmed to n (as zero_to_fp32 does)
        frags = []
        for p, sd in zip(states.layout.model_files, states.model):
            frag = (sd.get("frozen_param_fragments") or {}).get(name)
            if not isinstance(frag, TensorRef):
                raise InputError(f"frozen parameter {name} has no fragment", path=p)
            frags.append(frag)
        if sum(f.numel for f in frags) < n:
            raise InputError(f"frozen parameter {name}: fragments hold {sum(f.numel for f in frags)} of {n} elements",
                             path=states.layout.model_files[0])
        out.append(TensorPlan(name, shape, frags[0].dtype, split_range(frags, 0, n), "frozen"))

    groups = flat_groups(states, "fp32_flat_groups", "ZeRO-3")
    sizes = [sum(t.numel for t in g) for g in groups]
    if len(set(sizes)) != 1:
        detail = ", ".join(f"rank {r}: {s}" for r, s in enumerate(sizes))
        raise InputError(f"ranks hold fp32 partitions of different sizes ({detail})", path=states.layout.tag_dir,
                         hint="the files come from different runs or models")
    offset = 0
    for group in model0["param_shapes"]:
        for name, shape in group.items():
            shape = shape_of(shape, path0)
            n = math.prod(shape)
            pieces = _gather(groups, offset, n, world)
            out.append(TensorPlan(name, shape, groups[0][0].dtype, pieces, "trainable"))
            offset += math.ceil(n / world)
    if offset != sizes[0]:
        raise InputError(f"param_shapes account for {offset} elements per rank but the fp32 partitions hold "
                         f"{sizes[0]}", path=states.layout.optim_files[0],
                         hint="model-states and optim-states files come from different runs")
    return out
