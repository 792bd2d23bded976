"""Pick the load path: the fastest among those that fit, by tokens/s over all GPUs.

Plain loading serves one batch per GPU (replicas), ZeRO-3 one batch per rank, tensor parallelism one
batch over all GPUs; so throughput per machine, not per rank, decides. On a tie the simpler path wins.
"""
from __future__ import annotations

from dsdoctor.i18n import message_table, pick
from dsdoctor.units import human_bytes, human_rate

PREFERENCE = ("plain", "tp", "zero3", "zero3-offload", "zero3-offload-nvme")


def machine_tokens_per_s(path) -> float:
    return path.tokens_per_s * path.replicas


def choose(paths: list) -> object | None:
    fitting = [p for p in paths if p.fits]
    if not fitting:
        return None
    best = max(machine_tokens_per_s(p) for p in fitting)
    close = [p for p in fitting if machine_tokens_per_s(p) >= 0.95 * best]
    return min(close, key=lambda p: preference(p.name))


def preference(name: str) -> tuple:
    """Simpler first: plain, tp over all GPUs, tp groups (larger first), ZeRO-3, then paths added later."""
    if name in PREFERENCE:
        return (PREFERENCE.index(name) if PREFERENCE.index(name) < 2 else PREFERENCE.index(name) + 1, 0)
    if name.startswith("tp") and "x" in name:
        return (2, -int(name[2:].split("x")[0]))
    return (len(PREFERENCE) + 1, name)


def choose_tiered(plans: list, quantized: set) -> tuple:
    """Measured paths whose fit is verified first; a measured path that fits only unverified (DSD222) when
    none does; an estimate (device-map, serving engines) only when no measured path fits; quantized weights
    (they change the outputs) only when nothing in full precision fits. Within each tier a path that fits
    outright (its band's upper figure fits) before one at the edge (DSD234). Returns (chosen or None, the
    tier compared)."""
    exact = [p for p in plans if p.name not in quantized]  # full precision (an fp32 checkpoint's half row is not)
    measured = [p for p in exact if not p.estimate]
    tiers = [[p for p in measured if p.verdict != "unverified"], measured, exact, plans]
    for tier in tiers:
        for subset in ([p for p in tier if p.verdict == "fits"], tier):
            chosen = choose(subset)
            if chosen is not None:
                return chosen, tier
    return None, plans


TRAINING_PREFERENCE = ("zero2", "zero3-gather-once", "zero3", "zero3-offload", "zero3-offload-nvme")


def outright_first(rows: list) -> list:
    """The rows that fit outright (their upper figure fits), else those that fit by the prediction (edge)."""
    return [p for p in rows if p.verdict == "fits"] or [p for p in rows if p.fits]


def choose_training(paths: list, training: set) -> tuple:
    """With ``--loop``: the fastest fitting path the actor can train on (the inference-only paths are shown for
    reference, not recommended), one that fits outright before one at the edge; on a tie the simpler one.
    Returns (chosen or None, the paths compared)."""
    compared = [p for p in paths if p.name in training]
    fitting = outright_first(compared)
    if not fitting:
        return None, compared
    best = max(p.tokens_per_s * p.replicas for p in fitting)
    close = [p for p in fitting if p.tokens_per_s * p.replicas >= 0.95 * best]
    order = {name: i for i, name in enumerate(TRAINING_PREFERENCE)}
    return min(close, key=lambda p: order.get(p.name, len(order))), compared


WHY = message_table("plan.recommend.WHY")  # why the recommended path, in dsdoctor/messages.json


def why(chosen, paths: list, lang: str) -> str:
    others = [p for p in paths if p is not chosen]
    fits_others = [p for p in others if p.verdict == "fits"]
    text = pick(WHY["edge" if chosen.verdict == "edge" else "fits"], lang).format(
        name=chosen.name, peak=human_bytes(chosen.gpu_peak_bytes), speed=human_rate(machine_tokens_per_s(chosen)))
    if fits_others:
        best_other = max(fits_others, key=machine_tokens_per_s)
        text += pick(WHY["next"], lang).format(name=best_other.name, speed=human_rate(machine_tokens_per_s(best_other)))
    unfit = [p.name for p in others if not p.fits]
    edge = [p.name for p in others if p.verdict == "edge"]
    if edge:
        text += pick(WHY["edge others"], lang).format(names=", ".join(edge))
    if unfit:
        text += pick(WHY["unfit"], lang).format(names=", ".join(unfit))
    if chosen.verdict == "edge":  # only paths at the edge of their measured band remain
        text += pick(WHY["edge only"], lang)
    return text
