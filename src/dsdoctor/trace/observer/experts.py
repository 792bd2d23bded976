"""What a mixture of experts gathered under ZeRO-3 while generate ran (runs inside the user's rank).

ZeRO-3 gathers a module's parameters in its pre-forward hook. A fused experts module (transformers 5: 3-D tensors)
is gathered whole, every expert; a block made a ZeRO-3 leaf (``set_z3_leaf_modules``) is gathered whole at its own
entry; a block with one module per expert gathers each expert it runs, and runs only those some token chose. Per
generate the observer counts, per decoder layer, the experts gathered and their bytes (summed over the forwards);
for one-module-per-expert blocks that are not leaves, each expert a forward enters is also written at once
(``expert`` events: forward, layer, expert), before DeepSpeed's own hook gathers it, so a rank stuck in that
all-gather still leaves behind which expert it was gathering.
"""
from __future__ import annotations

import re

from dsdoctor.model.exact import partitioned_bytes

_EXPERTS = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.(?:.+\.)?experts(?:\.(\d+))?$")


class ExpertGathers:
    """Pre-forward hooks on the experts of a ZeRO-3 partitioned MoE, for one generate (removed by ``close``)."""

    def __init__(self, model, rec):
        self.rec, self.forward, self.handles = rec, -1, []
        self.layers: dict[int, list] = {}  # layer -> [experts gathered over the forwards, bytes gathered]
        self.info: dict = {}
        for name, module in model.named_modules():
            m = _EXPERTS.search(name)
            if m is None or not partitioned_bytes(module):
                continue
            layer, index = int(m.group(1)), m.group(2)
            if index is None and not any(True for _ in module.parameters(recurse=False)):
                continue  # the ModuleList of per-expert modules: never called itself
            block_name = name.rsplit(".", 2 if index is not None else 1)[0]
            block = model.get_submodule(block_name)
            leaf = bool(getattr(block, "_z3_leaf", False))
            if not self.info:
                cls = type(block)
                self.info = {"block": f"{cls.__module__}.{cls.__name__}", "fused": index is None, "leaf": leaf}
            if index is None:  # fused: every expert in one module, gathered whole
                first = next(module.parameters(recurse=False))
                self.info["experts"] = int(getattr(first, "ds_shape", first.shape)[0])
                self._watch(module, layer, None, self.info["experts"], partitioned_bytes(module))
            elif leaf:  # a leaf block: gathered whole at its own entry, once per layer
                self.info["experts"] = len(getattr(block, "experts", ())) or 1
                if not any(h[1] == layer for h in self.handles):
                    self._watch(block, layer, None, self.info["experts"], partitioned_bytes(block.experts))
            else:
                self.info["experts"] = len(getattr(block, "experts", ())) or 1
                self._watch(module, layer, int(index), 1, partitioned_bytes(module))
        if self.handles:
            self.handles.append((model.register_forward_pre_hook(self._next_forward, prepend=True), None))

    def _watch(self, module, layer: int, index, experts: int, nbytes: int) -> None:
        self.handles.append((module.register_forward_pre_hook(self._hook(layer, index, experts, nbytes),
                                                              prepend=True), layer))

    def _next_forward(self, *_):
        self.forward += 1

    def _hook(self, layer: int, index, experts: int, nbytes: int):
        def hook(*_):
            entry = self.layers.setdefault(layer, [0, 0])
            entry[0] += experts
            entry[1] += nbytes
            if index is not None:  # one module per expert, not a leaf: which expert, before DeepSpeed gathers it
                self.rec.write("expert", forward=self.forward, layer=layer, expert=index)
        return hook

    def close(self) -> dict | None:
        for h, _layer in self.handles:
            try:
                h.remove()
            except Exception:
                pass
        if not self.handles:
            return None
        return dict(self.info, forwards=self.forward + 1,
                    layers={str(k): {"experts": v[0], "bytes": v[1]} for k, v in sorted(self.layers.items())})
