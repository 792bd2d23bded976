"""Tensor-parallel (AutoTP) + ZeRO checkpoints: the shards of every tensor-parallel rank, put back together.

Each tensor-parallel rank ``mp_rank_MM`` saved a ZeRO checkpoint of its own shard of every parameter, so the
ZeRO-3 / ZeRO-1/2 rules (``zero3.py``, ``zero12.py``) rebuild each rank's shard as byte ranges. How the shards
make the full tensor is what DeepSpeed records beside them, in every model-states file, as
``universal_checkpoint_info`` (module_inject/layers.py ``collect_autotp_universal_checkpoint_info``,
DeepSpeed 0.19.8):

- ``affine_map.params``: per parameter (a regex ``^name$``), each rank's pieces as ``torch.as_strided``
  views of the full tensor (source) and of the shard (dest), the ranks holding each piece, and the factor
  the shard holds it by (``deepspeed/checkpoint/affine.py``);
- older category lists, used where no map is recorded: replicated, row-parallel (split along dim 1),
  sub-parameters with their shard widths, vocabulary (padding rows cut to ``original_vocab_size``).

A piece is turned into runs of elements contiguous on both sides, each run into byte ranges of the shard, so
the output is still streamed file to file. The result is what ``ds_to_universal`` rebuilds
(``merge_tp_slices``): the first rank that holds a replicated block supplies it, a scaled piece is divided
back, vocabulary rows past ``original_vocab_size`` are cut.
"""
from __future__ import annotations

import itertools
import math
import re

from dsdoctor.checkpoint.pieces import MergePlan, States, TensorPlan, slice_pieces
from dsdoctor.checkpoint.unpickle import Opaque, short_repr
from dsdoctor.errors import InputError, printable

MAX_RUNS = 50_000_000  # runs of contiguous elements in one merge: far above any real model's count
MAX_PATTERN = 1024  # characters of a recorded regex that is not the literal ^name$ form


def plan_tp(per_mp: list[States], build_plan) -> MergePlan:
    """One plan from the plans of each tensor-parallel rank (``build_plan`` of each rank's States)."""
    layout = per_mp[0].layout
    tp = len(per_mp)
    plans = [build_plan(s) for s in per_mp]
    ranks_txt = f"{tp} model-parallel ranks (mp_rank {', '.join(f'{m:02d}' for m in range(tp))})"
    info = recorded_info(per_mp[0].model[0])
    if not info:
        raise InputError(
            f"{ranks_txt}: a tensor-parallel + ZeRO checkpoint whose model-states files carry no "
            "universal_checkpoint_info, so it does not record the dimension each parameter was split along nor which "
            "parameters are replicated (DeepSpeed writes it with AutoTP, `tensor_parallel.autotp_size`; "
            "Megatron-style tensor parallelism does not); dsdoctor refuses rather than guess",
            path=layout.model_files[0],
            hint="merge it with the framework that did the tensor-parallel split, or save with tp_size 1")
    unsupported = info.get("autotp_unsupported_parameter_patterns") or {}
    if unsupported:
        pattern, reason = next(iter(unsupported.items()))
        raise InputError(f"{ranks_txt}: DeepSpeed recorded that it cannot describe the split of "
                         f"{len(unsupported)} parameter(s), e.g. {printable(pattern)[:120]}: {printable(reason)[:300]}",
                         path=layout.model_files[0], hint="merge it with the framework that did the split")
    recorded = Recorded(info, layout.model_files[0])
    by_rank = [{t.name: t for t in p.tensors} for p in plans]
    names = [t.name for t in plans[0].tensors]
    for m, table in enumerate(by_rank[1:], 1):
        if set(table) != set(names):
            odd = sorted(set(table) ^ set(names))
            raise InputError(f"tensor-parallel ranks 0 and {m} hold different parameters ({', '.join(odd[:4])})",
                             path=per_mp[m].layout.model_files[0],
                             hint="the files come from different runs")
    runs = [0]
    tensors = []
    for t0 in plans[0].tensors:
        if t0.kind == "buffer":
            tensors.append(t0)
            continue
        tensors.append(_rebuild(t0.name, [table[t0.name] for table in by_rank], recorded, runs))
    shards = [{n: s for n, s in p.recorded.items() if by_rank[0].get(n) is None or by_rank[0][n].kind != "buffer"}
              for p in plans]
    recorded = {**plans[0].recorded, **logical_shapes(info, shards, layout.model_files[0])}
    return MergePlan(stage=plans[0].stage, world_size=plans[0].world_size, tensors=tensors,
                     aliases=plans[0].aliases, ds_version=plans[0].ds_version, tp_size=tp, recorded=recorded)


def recorded_info(sd: dict) -> dict | None:
    """The universal_checkpoint_info a model-states file records (None: none)."""
    info = sd.get("universal_checkpoint_info")
    info = getattr(info, "state", None) if isinstance(info, Opaque) else info
    return info if isinstance(info, dict) and info else None


def logical_shapes(info: dict, shard_shapes: list[dict], path, maps_only: bool = False) -> dict[str, tuple]:
    """Each parameter's full shape as the recorded maps give it from every tensor-parallel rank's shard shapes
    (the category lists too unless ``maps_only``), vocabulary padding cut as the rebuild cuts it."""
    rec, out = Recorded(info, path), {}
    for name in shard_shapes[0]:
        amap = rec.affine(name)
        if amap is None and not maps_only:
            amap = _category_map(name, [list(s.get(name, ())) for s in shard_shapes], rec)
        if isinstance(amap, dict):
            shape = _ints(amap.get("logical_shape"), "logical_shape", path)
            vocab = _vocab(name, shape, rec)
            out[name] = tuple([vocab] + shape[1:] if vocab else shape)
    return out


def _vocab(name: str, shape: list[int], rec) -> int | None:
    """The recorded original_vocab_size of a vocabulary parameter padded past it (its rows are cut), else None."""
    vocab = rec.info.get("original_vocab_size")
    ok = isinstance(vocab, int) and shape and 0 < vocab < shape[0] and rec.matches("vocabulary_parameter_patterns", name)
    return vocab if ok else None


class Recorded:
    """The universal_checkpoint_info of a checkpoint, asked by parameter name."""

    def __init__(self, info: dict, path):
        self.path = path
        affine = info.get("affine_map") or {}
        if not isinstance(affine, dict):
            raise InputError(f"malformed universal_checkpoint_info: affine_map is {short_repr(affine)}", path=path)
        version = affine.get("version", 1)
        if not isinstance(version, int) or version > 1:
            raise InputError(f"the affine maps are in format version {short_repr(version)}; dsdoctor reads version 1 "
                             "(DeepSpeed 0.19.8)", path=path, hint="merge it with the DeepSpeed that saved it")
        self.maps = affine.get("params") or {}
        self.info = info
        if not isinstance(self.maps, dict):
            raise InputError("malformed universal_checkpoint_info: affine_map.params is not a mapping", path=path)

    def _patterns(self, key: str) -> list:
        value = self.info.get(key) or []
        return value if isinstance(value, list) else []

    def affine(self, name: str):
        return _lookup(self.maps, name, self.path)

    def matches(self, key: str, name: str) -> bool:
        return _lookup({p: True for p in self._patterns(key) if isinstance(p, str)}, name, self.path) is not None

    def sub_params(self, name: str):
        for entry in self._patterns("parameter_with_sub_params"):
            spec = entry.state if isinstance(entry, Opaque) else entry
            if isinstance(spec, dict) and _lookup({p: True for p in spec.get("patterns") or []}, name, self.path):
                return spec
        return None

    def widths(self, name: str):
        widths = self.info.get("sub_param_shard_widths") or {}
        return _lookup(widths, name, self.path) if isinstance(widths, dict) else None


def _lookup(table: dict, name: str, path):
    """The entry whose pattern matches ``name``: DeepSpeed writes ``^<re.escape(name)>$``, looked up as such;
    any other pattern is matched as a regex (bounded in length: the file is untrusted)."""
    literal = table.get("^" + re.escape(name) + "$")
    if literal is not None:
        return literal
    hits = []
    for pattern, value in table.items():
        if not isinstance(pattern, str) or (len(pattern) > 1 and pattern[0] == "^" and pattern[-1] == "$"
                                            and re.escape(_unescape(pattern[1:-1])) == pattern[1:-1]):
            continue  # another parameter's literal pattern
        if len(pattern) > MAX_PATTERN:
            raise InputError(f"a recorded parameter pattern is {len(pattern)} characters long", path=path)
        try:
            if re.match(pattern, name):
                hits.append(value)
        except re.error as exc:
            raise InputError(f"a recorded parameter pattern is not a valid regex ({printable(exc)})", path=path) from None
    if len(hits) > 1:
        raise InputError(f"{len(hits)} recorded patterns match parameter {name}", path=path)
    return hits[0] if hits else None


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


# ---- a parameter's layout as pieces, in DeepSpeed's to_dict form ------------------------------------------------
def _row_major(shape) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


def _split_map(shape, sizes, dim) -> dict:
    """contiguous_split_map: rank r holds block r along ``dim``."""
    full = _row_major(shape)
    ranks, start = {}, 0
    for r, size in enumerate(sizes):
        part = list(shape)
        part[dim] = size
        ranks[r] = {"shard_shape": part, "pieces": [{"shape": part, "source": [start * full[dim], full],
                                                      "dest": [0, _row_major(part)], "locations": [r]}]}
        start += size
    return {"logical_shape": list(shape), "ranks": ranks}


def _sub_param_map(shape, widths, dim) -> dict:
    """sub_param_map: sub-parameters (fused QKV) concatenated along ``dim``, each split over the ranks."""
    full = _row_major(shape)
    tp = len(widths[0])
    shard_shapes = []
    for r in range(tp):
        part = list(shape)
        part[dim] = sum(w[r] for w in widths)
        shard_shapes.append(part)
    ranks = {r: {"shard_shape": shard_shapes[r], "pieces": []} for r in range(tp)}
    dest_at, source_at = [0] * tp, 0
    for w in widths:
        for r in range(tp):
            piece = list(shape)
            piece[dim] = w[r]
            dest = _row_major(shard_shapes[r])
            ranks[r]["pieces"].append({"shape": piece, "source": [source_at * full[dim], full],
                                       "dest": [dest_at[r] * dest[dim], dest], "locations": [r]})
            source_at += w[r]
            dest_at[r] += w[r]
    return {"logical_shape": list(shape), "ranks": ranks}


def _category_map(name: str, shapes: list[list[int]], rec: Recorded) -> dict:
    """The layout the older category lists describe (ds_to_universal's branches, same order), from the shard
    shapes of every rank."""
    tp = len(shapes)
    if rec.matches("tp_replicated_parameter_patterns", name):
        shape = shapes[0]
        piece = {"shape": shape, "source": [0, _row_major(shape)], "dest": [0, _row_major(shape)],
                 "locations": list(range(tp))}
        return {"logical_shape": shape, "ranks": {r: {"shard_shape": shape, "pieces": [piece]} for r in range(tp)}}
    if rec.matches("parameter_to_average_patterns", name):
        raise InputError(f"{name}: DeepSpeed records it as averaged over the tensor-parallel ranks, a value no "
                         "rank holds; dsdoctor copies recorded values and does not average them", path=rec.path,
                         hint="convert with DeepSpeed's ds_to_universal, then merge its output (dsdoctor reads it)")
    if rec.matches("parameter_with_2_sub_params_cat_dim_0", name):
        if any(s[0] % 2 for s in shapes):
            raise InputError(f"{name}: recorded as two sub-parameters but a shard has an odd first dimension",
                             path=rec.path)
        half = [s[0] // 2 for s in shapes]
        return _sub_param_map([sum(s[0] for s in shapes)] + shapes[0][1:], [half, half], 0)
    spec = rec.sub_params(name)
    if spec is not None:
        dim = spec.get("partition_dim")
        widths = rec.widths(name)
        if not isinstance(dim, int) or not 0 <= dim < len(shapes[0]):
            raise InputError(f"{name}: malformed sub-parameter record {short_repr(spec)}", path=rec.path)
        if widths is None:
            sizes = spec.get("shape", [None] * (dim + 1))[dim]
            total = sum(s[dim] for s in shapes)
            sizes = list(sizes) if isinstance(sizes, (list, tuple)) else [total // sizes] * sizes \
                if isinstance(sizes, int) and sizes > 0 and total % sizes == 0 else None
            if sizes is None or any(x % tp for x in sizes):
                raise InputError(f"{name}: sub-parameters recorded without their shard widths and not evenly split",
                                 path=rec.path)
            widths = [[x // tp] * tp for x in sizes]
        full = list(shapes[0])
        full[dim] = sum(sum(w) for w in widths)
        return _sub_param_map(full, [list(w) for w in widths], dim)
    dim = 1 if rec.matches("parameter_with_row_parallelism_patterns", name) else 0
    if any(len(s) <= dim for s in shapes):
        raise InputError(f"{name}: a {len(shapes[0])}-dimensional shard cannot be split along dimension {dim}",
                         path=rec.path)
    full = list(shapes[0])
    full[dim] = sum(s[dim] for s in shapes)
    return _split_map(full, [s[dim] for s in shapes], dim)


# ---- pieces -> runs -> byte ranges -------------------------------------------------------------------------------
def _ints(value, what: str, path) -> list[int]:
    if not isinstance(value, (list, tuple)) or len(value) > 16 or \
            not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**48 for v in value):
        raise InputError(f"malformed affine map: {what} is {short_repr(value)}", path=path)
    return list(value)


def _runs(piece: dict, path):
    """(source offset, dest offset, length) of each run of elements contiguous in both the full tensor and the
    shard: the innermost dimensions whose strides are row-major on both sides make one run."""
    if not isinstance(piece, dict):
        raise InputError(f"malformed affine map: a piece is {short_repr(piece)}", path=path)
    shape = _ints(piece.get("shape"), "a piece's shape", path)
    source, dest = piece.get("source"), piece.get("dest")
    if not (isinstance(source, (list, tuple)) and len(source) == 2 and isinstance(dest, (list, tuple))
            and len(dest) == 2):
        raise InputError("malformed affine map: a piece without source and dest", path=path)
    (s_off,), s_str = _ints([source[0]], "an offset", path), _ints(source[1], "strides", path)
    (d_off,), d_str = _ints([dest[0]], "an offset", path), _ints(dest[1], "strides", path)
    if not len(shape) == len(s_str) == len(d_str):
        raise InputError("malformed affine map: a piece's shape and strides differ in length", path=path)
    if math.prod(shape) == 0:
        return
    inner, length = len(shape), 1
    while inner > 0 and (shape[inner - 1] == 1 or (s_str[inner - 1] == length and d_str[inner - 1] == length)):
        inner -= 1
        length *= shape[inner]
    for index in itertools.product(*(range(d) for d in shape[:inner])):
        yield (s_off + sum(i * st for i, st in zip(index, s_str)), d_off + sum(i * st for i, st in zip(index, d_str)),
               length)


def _rebuild(name: str, shards: list[TensorPlan], rec: Recorded, runs_seen: list[int]) -> TensorPlan:  # noqa: C901,PLR0912 (each check of a recorded map)
    path = rec.path
    amap = rec.affine(name)
    amap = amap if amap is not None else _category_map(name, [list(s.shape) for s in shards], rec)
    if not isinstance(amap, dict) or not isinstance(amap.get("ranks"), dict):
        raise InputError(f"malformed affine map for {name}: {short_repr(amap)}", path=path)
    shape = _ints(amap.get("logical_shape"), "logical_shape", path)
    numel = math.prod(shape)
    tp = len(shards)
    ranks = {}
    for key, entry in amap["ranks"].items():
        r = int(key) if isinstance(key, (int, str)) and str(key).isdigit() else -1
        if not 0 <= r < tp or not isinstance(entry, dict):
            raise InputError(f"the affine map of {name} names rank {short_repr(key)} of {tp}", path=path)
        want = _ints(entry.get("shard_shape"), "shard_shape", path)
        if math.prod(want) != shards[r].numel:
            raise InputError(f"{name}: the affine map gives tensor-parallel rank {r} a shard of shape {want}, but its "
                             f"files hold {list(shards[r].shape)}", path=path,
                             hint="the checkpoint files come from different runs")
        ranks[r] = entry.get("pieces") or []
    runs, written = [], set()
    for r in sorted(ranks):
        for piece in ranks[r]:
            locations = piece.get("locations") if isinstance(piece, dict) else None
            if not isinstance(locations, list) or r not in locations:
                raise InputError(f"malformed affine map for {name}: a piece of rank {r} lists {short_repr(locations)}",
                                 path=path)
            scale = piece.get("scale", 1.0)
            if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale == 0:
                raise InputError(f"malformed affine map for {name}: scale {short_repr(scale)}", path=path)
            start = piece["source"][0] if isinstance(piece.get("source"), (list, tuple)) else None
            if len(locations) > 1 and start in written:
                continue  # a replicated block: the first rank holding it supplies it, as DeepSpeed's rebuild does
            written.add(start)
            for src, dst, length in _runs(piece, path):
                runs.append((src, length, r, dst, float(scale)))
                runs_seen[0] += 1
                if runs_seen[0] > MAX_RUNS:
                    raise InputError(f"the affine maps describe more than {MAX_RUNS} separate runs of elements",
                                     path=path)
    vocab = _vocab(name, shape, rec)
    if vocab:  # padding rows cut, as ds_to_universal does
        limit = vocab * math.prod(shape[1:])
        runs = [(s, min(n, limit - s), r, d, k) for s, n, r, d, k in runs if s < limit]
        shape = [vocab] + shape[1:]
        numel = limit
    runs.sort()
    at, pieces = 0, []
    ends = [list(_cumulative(s.pieces)) for s in shards]
    for src, length, r, dst, scale in runs:
        if src != at:
            what = "leaves elements" if src > at else "writes elements twice"
            raise InputError(f"the affine map of {name} {what} (at offset {min(src, at)} of {numel})", path=path)
        if dst + length > shards[r].numel:
            raise InputError(f"the affine map of {name} reads past the end of tensor-parallel rank {r}'s shard",
                             path=path)
        pieces += slice_pieces(shards[r].pieces, dst, length, scale, ends[r])
        at += length
    if at != numel:
        raise InputError(f"the affine map of {name} covers {at} of its {numel} elements", path=path)
    return TensorPlan(name, tuple(shape), shards[0].dtype, pieces, shards[0].kind)


def _cumulative(pieces):
    total = 0
    for p in pieces:
        total += p.count
        yield total
