"""What trace says about a mixture of experts under ZeRO-3 (DSD341, DSD342), from what the observer wrote
(``trace/observer/experts.py``): per generate, the experts and bytes each rank gathered per MoE layer; for blocks
with one module per expert, each expert a forward entered, written before DeepSpeed gathered it. Torch-free."""
from __future__ import annotations

from dsdoctor.findings import Finding, Phrase
from dsdoctor.units import human_bytes

MAX_LISTED = 12  # experts named per rank in DSD341


def _block(records) -> dict:
    for rec in records:
        for p in rec.phases:
            if p.name == "generate" and isinstance(p.info.get("moe"), dict):
                return p.info["moe"]
    return {}


def _class_parts(block: str) -> tuple[str, str]:
    module, _, cls = (block or "<the sparse MoE block>").rpartition(".")
    return module or "your_model", cls


def different_experts(ranks, records) -> list[Finding]:
    """DSD341: a run that did not finish (a hang, a collective that timed out, or, on gloo, a rank aborted on
    mismatched sizes) in which the ranks entered different experts in the same forward and layer: the first such
    (forward, layer), every rank's experts there."""
    failed = any(r.status != "ok" for r in ranks)
    entered = {rec.rank: rec.experts for rec in records if rec.experts}
    if not failed or len(entered) < 2:
        return []
    sets: dict[int, dict[tuple[int, int], set]] = {}
    for rank, rows in entered.items():
        for forward, layer, expert in rows:
            sets.setdefault(rank, {}).setdefault((forward, layer), set()).add(expert)
    for key in sorted({k for per in sets.values() for k in per}):
        seen = {rank: sorted(per.get(key, ())) for rank, per in sorted(sets.items())}
        if len({tuple(v) for v in seen.values()}) < 2:
            continue
        module, cls = _class_parts(_block(records).get("block", ""))
        items = [Phrase("rank", {"rank": rank, "experts": _listed(experts)}) for rank, experts in seen.items()]
        return [Finding("DSD341", {"forward": key[0], "layer": key[1], "per_rank": Phrase.join("list", items),
                                   "block": cls, "cls": cls, "module": module})]
    return []


def _listed(experts: list) -> str:
    if not experts:
        return "none"
    shown = ", ".join(map(str, experts[:MAX_LISTED]))
    return shown + (f" (+{len(experts) - MAX_LISTED})" if len(experts) > MAX_LISTED else "")


def gathers_per_layer(records) -> list[Finding]:
    """DSD342: per finished generate of a ZeRO-3 MoE, what each rank gathered per MoE layer and forward."""
    out = []
    by_index: dict[int, list] = {}
    for rec in records:
        for p in rec.phases:
            g = p.info.get("moe_gathers") if p.name == "generate" else None
            if isinstance(g, dict) and isinstance(g.get("layers"), dict) and g.get("forwards"):
                by_index.setdefault(p.index, []).append((rec.rank, g))
    for index, rows in sorted(by_index.items()):
        items, block = [], ""
        for rank, g in rows:
            layers = [v for v in g["layers"].values() if isinstance(v, dict)]
            experts = sum(int(v.get("experts") or 0) for v in layers)
            nbytes = sum(int(v.get("bytes") or 0) for v in layers)
            forwards = int(g["forwards"])
            if not layers:
                continue
            block = str(g.get("block") or block)
            items.append(Phrase("rank", {"rank": rank, "experts": f"{experts / forwards / len(layers):.1f}",
                                         "bytes": human_bytes(nbytes / forwards), "layers": len(layers),
                                         "forwards": forwards}))
        if items:
            out.append(Finding("DSD342", {"block": block.rpartition(".")[2], "index": index,
                                          "per_rank": Phrase.join("list", items)}))
        break  # the first generate says it; later ones gather the same per forward
    return out
