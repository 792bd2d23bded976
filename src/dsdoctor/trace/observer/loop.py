"""Generation inside training: what the observer adds for RLHF/GRPO-style loops (runs inside the user's rank).

* ``engine.backward`` and ``engine.step`` of every DeepSpeed engine write a ``train`` event (kind, time,
  duration), and so do ``torch.autograd.backward`` and every torch optimizer's step outside them, so the
  report can tell a loop that trains between its generates from an inference script that
  merely built an optimizer.
* per generate, how many forwards ran and how many parameter bytes ZeRO-3 had to gather for each of them
  (the partitioned, non-persistent parameters: ``ds_numel`` x element size), plus the model's KV shape, so the
  report can put a number on what generating under ZeRO-3 costs.
* with the ab variant ``gather-once`` the generate of a ZeRO-3 engine's module runs inside
  ``gather_once.gathered_for_generation``.

Every wrapper calls the original and swallows its own errors, like the rest of the observer.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time
import weakref

from dsdoctor.model.exact import count_parameters
from dsdoctor.trace.observer import recorder

# id(module) -> weak reference to the engine that wraps it; generate is called on engine.module
_ENGINES: dict[int, weakref.ref] = {}


def remember_engine(engine) -> None:
    try:
        module = getattr(engine, "module", None)
        if module is not None:
            _ENGINES[id(module)] = weakref.ref(engine)
    except Exception:
        pass


def engine_of(module):
    ref = _ENGINES.get(id(module))
    engine = ref() if ref is not None else None
    if engine is not None and getattr(engine, "module", None) is module:
        return engine
    return None


_inside = threading.local()  # depth of engine.backward/step: torch's own events inside them are not repeated


def _depth() -> int:
    return getattr(_inside, "depth", 0)


def _wrap_train_method(cls, name: str) -> None:
    original = cls.__dict__.get(name)
    if original is None or getattr(original, "_dsdoctor", False):
        return

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        rec = recorder.get()
        if rec is None or rec.busy:
            return original(self, *args, **kwargs)
        t0 = time.perf_counter()
        _inside.depth = _depth() + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _inside.depth = _depth() - 1
            try:
                rec.write("train", kind=name, duration_s=time.perf_counter() - t0, source="engine")
            except Exception:
                pass

    wrapper._dsdoctor = True
    setattr(cls, name, wrapper)


def patch_engine_class(ds) -> None:
    """Wrap ``DeepSpeedEngine.backward`` and ``.step`` (subclasses such as the hybrid engine inherit them)."""
    engine_cls = getattr(ds, "DeepSpeedEngine", None)
    if engine_cls is None:
        engine_cls = getattr(sys.modules.get("deepspeed.runtime.engine"), "DeepSpeedEngine", None)
    if engine_cls is None:
        return
    for name in ("backward", "step"):
        _wrap_train_method(engine_cls, name)


def _torch_event(kind: str, t0: float | None = None) -> None:
    if _depth():
        return
    rec = recorder.get() if os.environ.get(recorder.ENV_DIR) else None
    if rec is None or rec.busy:
        return
    try:
        rec.write("train", kind=kind, source="torch",
                  duration_s=None if t0 is None else time.perf_counter() - t0)
    except Exception:
        pass


def patch_torch_training(torch) -> None:
    """Loops that train without the engine's methods: ``torch.autograd.backward`` (what ``Tensor.backward``
    calls) and every optimizer's ``step`` (torch's global step post-hook)."""
    autograd = getattr(torch, "autograd", None)
    original = getattr(autograd, "backward", None)
    if original is not None and not getattr(original, "_dsdoctor", False):
        @functools.wraps(original)
        def backward(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _torch_event("backward", t0)

        backward._dsdoctor = True
        autograd.backward = backward
    import importlib

    register = getattr(importlib.import_module("torch.optim.optimizer"), "register_optimizer_step_post_hook", None)
    if register is not None and not getattr(torch, "_dsdoctor_step_hook", False):
        register(lambda *_args, **_kw: _torch_event("step"))
        torch._dsdoctor_step_hook = True


# ------------------------------------------------------------------ per-generate accounting

_GATHER_BYTES: dict[int, tuple[int, int, int]] = {}  # id(model) -> (gathered per forward, full, persistent)


def zero3_param_bytes(model) -> tuple[int, int, int]:
    """(bytes a forward gathers, bytes of all parameters, bytes of persistent parameters) of a ZeRO-3 model.

    A forward under ZeRO-3 fetches every partitioned parameter that is not persistent (parameters at or under
    ``stage3_param_persistence_threshold`` stay whole once fetched); each fetch brings the full ``ds_numel``
    elements onto the rank."""
    key = id(model)
    if key in _GATHER_BYTES:
        return _GATHER_BYTES[key]
    gathered = full = persistent = 0
    for p in model.parameters():
        if not hasattr(p, "ds_id"):
            continue
        size = int(p.ds_numel) * p.element_size()
        full += size
        if getattr(p, "ds_persist", False):
            persistent += size
        else:
            gathered += size
    _GATHER_BYTES[key] = (gathered, full, persistent)
    return _GATHER_BYTES[key]


def model_shape(model) -> dict:
    """What the KV cache of this model needs per position (from its config; no tensors touched)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None)
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if hidden and heads else None)
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "hidden_size": hidden,
            "vocab_size": getattr(cfg, "vocab_size", None)}


class ForwardCounter:
    """Counts the forwards of ``model`` while generate runs (a pre-hook on the top module, removed after)."""

    def __init__(self, model):
        self.count = 0
        self._handle = None
        try:
            self._handle = model.register_forward_pre_hook(self._hook)
        except Exception:
            self._handle = None

    def _hook(self, *_):
        self.count += 1

    def close(self) -> int | None:
        if self._handle is None:
            return None
        try:
            self._handle.remove()
        except Exception:
            pass
        return self.count


def generate_info(model) -> dict:
    """Fields for the generate phase start: the ZeRO-3 gather sizes and the model's KV shape."""
    info = {}
    try:
        gathered, full, persistent = zero3_param_bytes(model)
        first = next(iter(model.parameters()), None)
        if full:
            info.update(gather_bytes_per_forward=gathered, param_bytes=full, persistent_param_bytes=persistent)
        elif first is not None:
            info["param_bytes"] = count_parameters(model) * first.element_size()
        if first is not None:
            info["param_element_size"] = first.element_size()
        info["model_shape"] = model_shape(model)
        info["training_mode"] = bool(getattr(model, "training", False))
        zero = [p for p in model.parameters() if hasattr(p, "ds_id")]
        # the script gathers by itself (trl/DeepSpeed unwrap_model_for_generation): every parameter whole
        info["already_gathered"] = bool(zero) and all(getattr(p.ds_status, "name", None) == "AVAILABLE"
                                                      for p in zero)
    except Exception:
        pass
    return info
