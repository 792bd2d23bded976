"""The two layouts of a mixture-of-experts model's expert weights, and the conversion between them.

fused (transformers 5's modules): <p>.experts.gate_up_proj [E, 2I, H] (expert e's gate rows, then its up rows) and
  <p>.experts.down_proj [E, H, I].
per-expert (transformers 4.x's modules, and what 5's save_pretrained writes back, save_original_format):
  <p>.experts.<e>.gate_proj.weight [I, H], .up_proj.weight [I, H], .down_proj.weight [H, I]; Mixtral names them
  w1 / w3 / w2 under <layer>.block_sparse_moe (5: <layer>.mlp).
transformers 5.24's conversion_mapping.py fuses per-expert checkpoints on load for the model types in FAMILIES (its
"qwen2_moe" and "mixtral" patterns: MergeModulelist(dim=0) then Concatenate(dim=1)); 4.x loads only per-expert.
A conversion is a list of element ranges of the source tensors, flattened: no data is touched to plan it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dsdoctor.errors import InputError

QWEN2 = ("mlp", "gate_proj", "up_proj", "down_proj")
FAMILIES = {**dict.fromkeys(("qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "deepseek_v2", "deepseek_v3",
                             "glm4_moe", "dots1", "hunyuan_v1_moe", "qwen3_next"), QWEN2),
            "mixtral": ("block_sparse_moe", "w1", "w3", "w2"), "minimax": ("block_sparse_moe", "w1", "w3", "w2")}
LAYOUTS = ("per-expert", "fused")
MAX_EXPERTS = 4096  # per layer; the largest open models have 512: a crafted shape must not make millions of names
FUSED = re.compile(r"^(.+)\.experts\.(gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def layout_of(names) -> str | None:
    """'fused', 'per-expert', or None (no expert tensors)."""
    for name in names:
        if FUSED.match(name):
            return "fused"
        if PER_EXPERT.match(name):
            return "per-expert"
    return None


def conversion(shapes: dict[str, tuple], model_type, want: str) -> dict | None:
    """{output name: (shape, [(source name, first element, count), ...])} for every tensor, expert weights in the
    ``want`` layout; None when there is nothing to convert (no experts, already ``want``, a family not in FAMILIES)."""
    have = layout_of(shapes)
    style = FAMILIES.get(model_type)
    if style is None or have is None or have == want or want not in LAYOUTS:
        return None
    block, gate, up, down = style
    out: dict = {}
    old = (".mlp.", f".{block}.") if have == "fused" else (f".{block}.", ".mlp.")  # Mixtral's block renamed
    groups: dict[tuple, dict[int, str]] = {}
    for name, shape in shapes.items():
        m = (FUSED if have == "fused" else PER_EXPERT).match(name)
        if m is None:
            out[name] = (shape, [(name, 0, math.prod(shape))])
        elif have == "fused":
            _split(out, name, shape, m[1], m[2] == "gate_up_proj", (gate, up, down))
        else:
            groups.setdefault((m[1], m[3]), {})[int(m[2])] = name
    for (prefix, proj), experts in groups.items():
        if proj == up and (prefix, gate) not in groups:
            raise InputError(f"{prefix} has up projections but no gate projections: cannot fuse them")
        if proj in (gate, down):
            _join(out, shapes, prefix, experts, groups.get((prefix, up)) if proj == gate else None, proj == gate)
    return {name.replace(old[0], old[1]): value for name, value in out.items()}


def converted_shapes(shapes: dict[str, tuple], model_type, want: str) -> dict[str, tuple]:
    """``shapes`` ({name: shape}) as they are in the ``want`` layout: what merge's output must hold."""
    plan = conversion(shapes, model_type, want)
    return shapes if plan is None else {name: shape for name, (shape, _) in plan.items()}


def _split(out: dict, name: str, shape: tuple, prefix: str, gate_up: bool, names: tuple) -> None:
    if len(shape) != 3 or (gate_up and shape[1] % 2) or shape[0] > MAX_EXPERTS:
        raise InputError(f"expert tensor {name} has shape {list(shape)}, not [experts (at most {MAX_EXPERTS}), rows, "
                         "columns]"
                         + (" with an even number of rows (gate and up)" if gate_up else ""))
    experts, rows, cols = shape
    parts = [(names[0], 0), (names[1], rows // 2)] if gate_up else [(names[2], 0)]
    rows = rows // 2 if gate_up else rows
    for e in range(experts):
        for proj, first in parts:
            out[f"{prefix}.experts.{e}.{proj}.weight"] = ((rows, cols), [(name, (e * shape[1] + first) * cols,
                                                                          rows * cols)])


def _join(out: dict, shapes: dict, prefix: str, experts: dict, ups: dict | None, gate_up: bool) -> None:
    first = shapes[experts[min(experts)]]
    want = [experts, ups] if gate_up else [experts]
    if any(sorted(d or {}) != list(range(len(experts))) for d in want) or \
            any(shapes[n] != first for d in want for n in d.values()):
        raise InputError(f"the experts of {prefix} are not all there with one shape (experts "
                         f"{sorted(experts)}, up projections {sorted(ups or {})}): cannot fuse them")
    ranges = [(d[e], 0, math.prod(first)) for e in range(len(experts)) for d in want]
    rows = first[0] * (2 if gate_up else 1)
    out[f"{prefix}.experts.{'gate_up_proj' if gate_up else 'down_proj'}"] = ((len(experts), rows, first[1]), ranges)


def convert(items: dict, model_type, want, join) -> dict:
    """``items`` (tensors, stored entries, merge plans: anything with a shape) with the expert weights in ``want``;
    each output is ``join(name, shape, [(item, first element, count), ...])``."""
    plan = conversion({n: tuple(t.shape) for n, t in items.items()}, model_type, want)
    if plan is None:
        return items
    return {name: join(name, shape, [(items[s], a, n) for s, a, n in ranges]) for name, (shape, ranges) in plan.items()}


def cat(name, shape, parts):
    """Tensors in memory joined (verify's logits)."""
    import torch

    return torch.cat([t.reshape(-1)[a:a + n] for t, a, n in parts]).reshape(shape)


@dataclass(frozen=True)
class Joined:
    """A stored tensor seen in the other layout (verify's reference): ranges of stored tensors, read when loaded."""
    name: str
    shape: tuple
    parts: list  # (weights.Entry, first element, count), ...

    @property
    def dtype(self) -> str:
        return self.parts[0][0].dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def load(self):
        from dsdoctor.checkpoint.weights import load_tensor

        return cat(self.name, self.shape, [(load_tensor(e), a, n) for e, a, n in self.parts])


def plan_layout(keyed: list, model_type, want: str = "auto") -> tuple[list, dict | None]:
    """merge's (name, TensorPlan) pairs with the expert weights in ``want`` ('auto': per-expert for a model type
    transformers converts, which every release loads; else as saved), and what was written (None: no experts)."""
    from dsdoctor.config.versions import TRANSFORMERS_FUSED_EXPERTS, installed, version_tuple

    have = layout_of(name for name, _ in keyed)
    if have is None:
        return keyed, None
    want = ("per-expert" if model_type in FAMILIES else have) if want == "auto" else want
    release = installed("transformers")
    if want == "fused" and (version_tuple(release) or TRANSFORMERS_FUSED_EXPERTS) < TRANSFORMERS_FUSED_EXPERTS:
        raise InputError(f"--expert-layout fused: transformers {release} loads only per-expert weights (fused "
                         "expert tensors came with transformers 5)")
    plans = dict(keyed)
    out = convert(plans, model_type, want, _pieces)
    if out is plans and want != have:
        raise InputError(f"--expert-layout {want}: no known conversion of {have} expert weights for model_type "
                         f"{model_type!r} (known: {', '.join(sorted(FAMILIES))})")
    info = {"layout": want, "saved": have, "family": model_type, "transformers": release or "-",
            "example": next(n for n in out if layout_of([n]))}
    return list(out.items()), info


def _pieces(name: str, shape: tuple, parts: list):
    """A merge plan (pieces.TensorPlan) of the byte ranges of ``parts``."""
    from dataclasses import replace

    from dsdoctor.checkpoint.pieces import slice_pieces

    src = parts[0][0]
    if len(parts) == 1 and shape == src.shape:
        return replace(src, name=name)  # a tensor renamed, or not even that (a folded LoRA update keeps its compute)
    if any(t.compute is not None for t, _, _ in parts):
        raise InputError(f"{name}: a LoRA update folded into expert weights cannot change layout; give "
                         "--expert-layout the checkpoint's own layout")
    return replace(src, name=name, shape=shape, pieces=[p for t, a, n in parts for p in slice_pieces(t.pieces, a, n)])
