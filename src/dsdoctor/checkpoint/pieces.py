"""The pieces a merge plan is made of, shared by ``plan.py`` and the ZeRO-3 / ZeRO-1/2 rebuild rules
(``zero3.py``, ``zero12.py``), which ``plan.build_plan`` dispatches to."""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from dsdoctor.checkpoint.layout import Layout
from dsdoctor.checkpoint.unpickle import TensorRef, short_repr
from dsdoctor.errors import InputError


@dataclass(frozen=True)
class Piece:
    ref: TensorRef
    start: int  # element index into ref (flattened)
    count: int
    divisor: float = 1.0  # the shard holds the value times this (a row-parallel bias pre-divided by the TP size)


@dataclass
class TensorPlan:
    name: str
    shape: tuple
    dtype: str  # source dtype of the pieces (all pieces share it)
    pieces: list[Piece]
    kind: str  # trainable | frozen | buffer | module | folded
    # folded tensors (a LoRA update added to its base weight): computed from the pieces, which are read (and
    # CRC-checked) through the callable it is given; returns the tensor in float32
    compute: Callable | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class MergePlan:
    stage: int
    world_size: int
    tensors: list[TensorPlan]  # in DeepSpeed's order: buffers, frozen, trainable
    aliases: dict[str, str] = field(default_factory=dict)  # shared (tied) name -> name that holds the data
    ds_version: str | None = None
    tp_size: int = 1  # tensor-parallel (AutoTP) ranks the shards were split over
    source: str = "zero"  # zero | universal (a ds_to_universal folder)
    recorded: dict[str, tuple] = field(default_factory=dict)  # name -> shape as the input records it (merge checks)


@dataclass
class States:
    layout: Layout
    model: list[dict]
    optim: list[dict]  # optimizer_state_dict of each rank
    optim_tops: list[dict] = field(default_factory=list)  # each optim file's whole dict (ds_version, ds_config)


def split_range(chunks: list[TensorRef], start: int, count: int) -> list[Piece]:
    """Pieces covering elements [start, start+count) of the virtual concatenation of ``chunks``."""
    pieces, base = [], 0
    end = start + count
    for ref in chunks:
        n = ref.numel
        lo, hi = max(start, base), min(end, base + n)
        if lo < hi:
            pieces.append(Piece(ref, lo - base, hi - lo))
        base += n
        if base >= end:
            break
    if sum(p.count for p in pieces) != count:
        raise InputError(f"partition ends early: wanted elements {start}..{end} of {base}",
                         path=chunks[0].path if chunks else None)
    return pieces


def shape_of(shape, path) -> tuple:
    if not isinstance(shape, (tuple, list)) or len(shape) > 16 or \
            not all(isinstance(d, int) and 0 <= d < 2**48 for d in shape):
        raise InputError(f"invalid parameter shape {short_repr(shape)}", path=path)
    return tuple(shape)


def recorded_shapes(sd: dict, path) -> dict[str, tuple]:
    """Every tensor's shape as a model-states file records it, apart from how a plan rebuilds it: the buffers and
    16-bit parameters of its module state dict (tied aliases and ZeRO-3's empty stand-ins left out), then
    frozen_param_shapes and param_shapes."""
    def table(key) -> dict:
        return sd.get(key) if isinstance(sd.get(key), dict) else {}

    shared, buffers = table("shared_params"), set(sd.get("buffer_names") or [])
    out = {n: tuple(r.shape) for n, r in table("module").items()
           if isinstance(r, TensorRef) and (r.numel or n in buffers) and n not in shared}
    for group in [table("frozen_param_shapes"), *(sd.get("param_shapes") or [])]:
        out.update({n: shape_of(s, path) for n, s in group.items()})
    return out


def flat_groups(states: States, key: str, kind: str) -> list[list[TensorRef]]:
    """Each rank's flat fp32 partitions (``key`` of its optim-states file), or an error naming the file."""
    out = []
    for p, osd in zip(states.layout.optim_files, states.optim):
        flat = osd.get(key)
        if not isinstance(flat, list) or not all(isinstance(t, TensorRef) for t in flat):
            raise InputError(f"no {key} in a {kind} optim-states file", path=p)
        out.append(flat)
    return out


def slice_pieces(pieces: list[Piece], start: int, count: int, divisor: float = 1.0,
                 ends: list[int] | None = None) -> list[Piece]:
    """Pieces covering elements [start, start+count) of the concatenation of ``pieces`` (``ends``: their
    cumulative counts, when the caller slices the same list many times)."""
    ends = ends if ends is not None else list(_ends(pieces))
    out, end = [], start + count
    i = bisect.bisect_right(ends, start)
    while count and i < len(pieces) and (ends[i] - pieces[i].count) < end:
        p = pieces[i]
        base = ends[i] - p.count
        lo, hi = max(start, base), min(end, ends[i])
        if lo < hi:
            out.append(Piece(p.ref, p.start + lo - base, hi - lo, p.divisor * divisor))
        i += 1
    if sum(p.count for p in out) != count:
        raise InputError(f"a shard ends early: wanted elements {start}..{end} of {ends[-1] if ends else 0}",
                         path=pieces[0].ref.path if pieces else None)
    return out


def _ends(pieces: list[Piece]):
    total = 0
    for p in pieces:
        total += p.count
        yield total
