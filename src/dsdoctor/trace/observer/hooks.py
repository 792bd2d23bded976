"""Wrappers installed into the user's process, as each library is imported.

A meta-path finder notices when ``deepspeed``, ``torch`` or the transformers modules are imported and patches
them right after they execute: ``deepspeed.initialize``, ``deepspeed.init_inference``, ``HfDeepSpeedConfig``,
``PreTrainedModel.from_pretrained`` / ``_from_config``, ``GenerationMixin.generate`` and ``torch.load``.
Every wrapper calls through to the original and swallows its own errors: observing must never change what
the program does (except the ab config rewrite, which is the point of ab).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import inspect
import json
import os
import re
import sys
import threading

from dsdoctor.model.exact import count_parameters
from dsdoctor.trace.observer import loop, recorder
from dsdoctor.trace.observer.experts import ExpertGathers

_SHARD_FILE = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_(?:model|optim)_states\.pt$")
_shard_loads: list[str] = []


def _safe(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        if os.environ.get("PYTHON_DSDOCTOR_DEBUG"):
            raise
        try:
            sys.stderr.write(f"dsdoctor: observer: {getattr(fn, '__name__', fn)}: {type(exc).__name__}: {exc}\n")
        except Exception:
            pass
        return None


def _variant_name() -> str | None:
    raw = os.environ.get(recorder.ENV_VARIANT)
    if not raw:
        return None
    try:
        return json.loads(raw)["name"]
    except Exception:
        return None


# ------------------------------------------------------------------------ config helpers

def _load_config_file(path) -> dict | None:
    from dsdoctor import door
    from dsdoctor.errors import InputError

    try:  # a regular file of bounded size (a FIFO would block the user's rank here)
        text = door.read_text(path, door.DS_CONFIG)
    except InputError:
        return None
    try:
        return json.loads(text)
    except ValueError:
        try:
            import hjson  # DeepSpeed parses configs with hjson

            return json.loads(json.dumps(hjson.loads(text)))
        except Exception:
            return None


def _config_summary(cfg) -> dict:
    if not isinstance(cfg, dict):
        return {}
    zero = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    def device(section):
        sec = zero.get(section)
        return sec.get("device") if isinstance(sec, dict) else None
    return {
        "stage": zero.get("stage"),
        "offload_param": device("offload_param"),
        "offload_optimizer": device("offload_optimizer"),
        "optimizer": (cfg.get("optimizer") or {}).get("type") if isinstance(cfg.get("optimizer"), dict) else None,
        "tp_size": _tp_from_config(cfg),
    }


def _tp_from_config(cfg: dict):
    tp = cfg.get("tensor_parallel")
    if isinstance(tp, dict):
        return tp.get("autotp_size") or tp.get("tp_size")
    return cfg.get("mp_size")


def _write_config(rec, api: str, source, passed, original=None, rewritable: bool = False, **extra) -> None:
    """One ``config`` event: what the script passed to ``api`` (after the ab rewrite, when one was applied).

    ``variant_applied`` names the ab variant whose config DeepSpeed received; ``rewritable`` says whether the
    observer could have rewritten this config at all (a dict or file it read; never init_inference's)."""
    fields = dict(api=api, source=source, config=_json_safe(passed), summary=_config_summary(passed),
                  rewritable=rewritable, variant=_variant_name(), variant_applied=None, **extra)
    if original is not None:
        fields["variant_applied"] = _variant_name()
        fields["variant_changed"] = _json_safe(original) != fields["config"]
        fields["summary_before_variant"] = _config_summary(original)
    rec.write("config", **fields)


def _model_config_dict(model) -> dict | None:
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if to_dict is None:
        return None
    return _json_safe(to_dict())


def _write_model(rec, model, api: str) -> None:
    """One ``model`` event: the model the run built (its class, parameter count, config.json as a dict), so a
    report can plan for the model the script really used. Written once per model object at load, and again
    when it is handed to DeepSpeed (that is the model the run serves)."""
    if model is None or not hasattr(model, "parameters"):
        return
    key = id(model)
    if key in _models_seen and not api.startswith("deepspeed."):  # handed to DeepSpeed: always say so
        return
    _models_seen.add(key)
    info = _model_info(model)
    cfg = _model_config_dict(model)
    rec.write("model", api=api, model_class=info.get("model_class"), num_params=info.get("num_params"),
              param_dtype=info.get("param_dtype"), zero3_partitioned=info.get("zero3_partitioned"),
              is_encoder_decoder=bool((cfg or {}).get("is_encoder_decoder")), config=cfg)


_models_seen: set[int] = set()


def _rewrite(cfg: dict) -> dict:
    name = _variant_name()
    if not name or name == "as-is":
        return cfg
    from dsdoctor.trace.variants import apply_variant

    return apply_variant(name, cfg)


def _json_safe(cfg):
    try:
        return json.loads(json.dumps(cfg, default=str))
    except Exception:
        return None


# ------------------------------------------------------------------------ deepspeed

def _resolve_initialize_config(bound):
    """(config dict or None, source text, setter that passes a rewritten dict back)."""
    args = bound.arguments
    for key in ("config", "config_params"):
        value = args.get(key)
        if value is not None:
            if isinstance(value, dict):
                return value, "dict", lambda new, k=key: args.__setitem__(k, new)
            if isinstance(value, (str, os.PathLike)):
                return _load_config_file(value), os.fspath(value), lambda new, k=key: args.__setitem__(k, new)
            return None, type(value).__name__, None
    ns = args.get("args")
    for attr in ("deepspeed_config", "deepscale_config"):
        path = getattr(ns, attr, None) if ns is not None else None
        if path:
            def setter(new, attr=attr):
                import copy

                ns2 = copy.copy(ns)
                setattr(ns2, attr, None)
                args["args"] = ns2
                args["config"] = new
            return _load_config_file(path), os.fspath(path), setter
    return None, None, None


def _device_of(section):
    if section is None:
        return None
    dev = getattr(section, "device", None)
    dev = getattr(dev, "value", dev)
    return None if dev in (None, "none") else str(dev)


def _optimizer_state_bytes(opt) -> int | None:
    """Bytes of the optimizer-side buffers DeepSpeed allocated up front (fp32 master partitions, flat gradient
    partitions, reduce buckets). Adam moments come later, at the first step(), and are not counted."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        try:
            if t is None or not hasattr(t, "untyped_storage"):
                return
            key = (t.device.type, t.untyped_storage().data_ptr())
            if key in seen or t.numel() == 0:
                return
            seen.add(key)
            total += t.untyped_storage().nbytes()
        except Exception:
            pass

    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition",
                 "grad_partitions_flat_buffer", "averaged_gradients"):
        value = getattr(opt, name, None)
        if isinstance(value, dict):
            value = list(value.values())
        for t in value if isinstance(value, (list, tuple)) else [value]:
            for x in t if isinstance(t, (list, tuple)) else [t]:
                add(x)
    for bucket in (getattr(opt, "ipg_buckets", None) or {}).values():
        add(getattr(bucket, "buffer", None))
    return total or None


def _world_size():
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size()
    except Exception:
        pass
    return None


def _engine_info(engine) -> dict:
    info = {"engine": type(engine).__name__}
    g = lambda name: _safe(getattr(engine, name)) if hasattr(engine, name) else None  # noqa: E731
    info["zero_stage"] = g("zero_optimization_stage")
    info["offload_param"] = _device_of(g("zero_offload_param"))
    info["offload_param_pin_memory"] = getattr(g("zero_offload_param"), "pin_memory", None)
    info["offload_optimizer"] = _device_of(g("zero_offload_optimizer"))
    opt = getattr(engine, "optimizer", None)
    name = type(opt).__name__ if opt is not None else None
    if name == "DeepSpeedZeRoOffload":  # ZeRO-Inference: parameter partitioning only, no optimizer
        name = None
    info["optimizer"] = name
    basic = getattr(engine, "basic_optimizer", None)
    info["base_optimizer"] = type(basic).__name__ if basic is not None else None
    info["optimizer_state_bytes"] = _optimizer_state_bytes(opt) if name else None
    info["dtype"] = "bf16" if g("bfloat16_enabled") else "fp16" if g("fp16_enabled") else "fp32"
    info["tp_size"] = g("autotp_size") or 1
    info["world_size"] = _world_size()
    return info


def _model_info(model) -> dict:
    info = {}
    try:
        params = list(model.parameters())
        info["zero3_partitioned"] = any(hasattr(p, "ds_id") for p in params[:50])
        info["num_params"] = count_parameters(model)
        info["param_dtype"] = str(params[0].dtype).replace("torch.", "") if params else None
        info["model_class"] = type(model).__name__
    except Exception:
        pass
    return info


def _partition_state(model) -> dict | None:
    """How much of ``model`` is ZeRO-3 partitioned as it reaches deepspeed.initialize: parameters without a
    ``ds_id`` were not built under zero.Init, and initialize moves the whole module to the device
    (runtime/engine.py ``_configure_distributed_model``: ``is_zero_init_model`` is false)."""
    if model is None or not hasattr(model, "parameters"):
        return None
    total = unpartitioned = 0
    nbytes = 0
    for p in model.parameters():
        total += 1
        if hasattr(p, "ds_id"):
            continue
        unpartitioned += 1
        nbytes += int(p.numel()) * int(p.element_size())
    return {"params": total, "unpartitioned": unpartitioned, "unpartitioned_bytes": nbytes,
            "hf_zero3_alive": _hf_zero3_enabled()}


def _patch_deepspeed(ds):  # noqa: PLR0915
    if getattr(ds, "_dsdoctor_patched", False):
        return
    ds._dsdoctor_patched = True
    _safe(loop.patch_engine_class, ds)  # train events: generation inside training
    original_initialize = ds.initialize
    sig = inspect.signature(original_initialize)

    @functools.wraps(original_initialize)
    def initialize(*args, **kwargs):
        rec = recorder.get()
        if rec is None or rec.busy:
            return original_initialize(*args, **kwargs)
        passed, source, original, setter = None, None, None, None
        try:
            bound = sig.bind_partial(*args, **kwargs)
            _safe(_write_model, rec, bound.arguments.get("model"), "deepspeed.initialize")
            passed, source, setter = _resolve_initialize_config(bound)
            if passed is not None and setter is not None:
                new = _rewrite(passed)
                if new is not passed:
                    setter(new)
                    original, passed = passed, new
                    args, kwargs = bound.args, bound.kwargs
        except Exception as exc:
            _safe(rec.write, "observer_error", where="initialize", error=repr(exc))
        _safe(_write_config, rec, "deepspeed.initialize", source, passed, original,
              rewritable=passed is not None and setter is not None)
        state = None
        try:
            state = _safe(_partition_state, sig.bind_partial(*args, **kwargs).arguments.get("model"))
        except Exception:
            pass
        token = _safe(rec.begin, "init", api="deepspeed.initialize", model_at_initialize=state)
        if token is None:
            return original_initialize(*args, **kwargs)
        try:
            result = original_initialize(*args, **kwargs)
        except BaseException as exc:
            _safe(rec.end, token, error=exc)
            raise
        engine = result[0] if isinstance(result, tuple) else result
        _safe(loop.remember_engine, engine)
        info = _safe(_engine_info, engine) or {}
        module = engine.module if hasattr(engine, "module") else engine
        info.update(_safe(_model_info, module) or {})
        _safe(rec.end, token, engine=info)
        return result

    ds.initialize = initialize

    original_init_inference = ds.init_inference

    @functools.wraps(original_init_inference)
    def init_inference(model, config=None, **kwargs):
        rec = recorder.get()
        if rec is None or rec.busy:
            return original_init_inference(model, config=config, **kwargs)
        cfg = config if isinstance(config, dict) else (_load_config_file(config) if config else None)
        summary = dict(_config_summary(cfg))
        summary["tp_size"] = _safe(_inference_tp, cfg, kwargs)
        _safe(_write_init_inference_config, rec, config, cfg, kwargs, summary)
        _safe(_write_model, rec, model, "deepspeed.init_inference")
        before = _safe(_model_info, model) or {}
        shards = list(_shard_loads)
        if shards:
            _safe(rec.write, "zero_shards_to_init_inference", files=shards)
        token = _safe(rec.begin, "init", api="deepspeed.init_inference")
        if token is None:
            return original_init_inference(model, config=config, **kwargs)
        try:
            engine = original_init_inference(model, config=config, **kwargs)
        except BaseException as exc:
            _safe(rec.end, token, error=exc)
            raise
        info = {"engine": type(engine).__name__, "optimizer": None, "optimizer_state_bytes": None,
                "offload_param": None, "offload_optimizer": None, "world_size": _world_size(),
                "zero_stage": 3 if before.get("zero3_partitioned") else 0}
        ecfg = getattr(engine, "_config", None)
        tp = getattr(getattr(ecfg, "tensor_parallel", None), "tp_size", None)
        info["tp_size"] = tp if tp is not None else summary.get("tp_size") or 1
        dtype = getattr(ecfg, "dtype", None)
        info["dtype"] = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}.get(
            str(dtype), str(dtype) if dtype is not None else None)
        info.update(before)
        _safe(rec.end, token, engine=info)
        return engine

    ds.init_inference = init_inference


def _write_init_inference_config(rec, config, cfg, kwargs, summary) -> None:
    """init_inference takes an inference config (or keyword arguments), never a ZeRO training config: ab's
    variants cannot be applied to it, and the event says so (``rewritable`` false)."""
    source = "dict" if isinstance(config, dict) else (os.fspath(config) if config else "kwargs")
    merged = dict(cfg or {}, **kwargs)  # as init_inference merges them: keyword arguments win (args= included)
    rec.write("config", api="deepspeed.init_inference", source=source, config=_json_safe(merged),
              summary=summary, rewritable=False, variant=_variant_name(), variant_applied=None)


def _inference_tp(cfg, kwargs):
    for source in (cfg or {}, kwargs):
        tp = source.get("tensor_parallel")
        if isinstance(tp, dict) and tp.get("tp_size"):
            return tp["tp_size"]
        tp_size = getattr(tp, "tp_size", None)
        if tp_size:
            return tp_size
        if source.get("mp_size"):
            return source["mp_size"]
    return None


# ------------------------------------------------------------------------ torch

def _patch_torch(torch):
    # per-phase GPU peaks without changing what the program reads about its own memory (see PeakLedger)
    _safe(recorder.shield_cuda_counters, getattr(torch, "_C", None))
    original_load = torch.load
    if getattr(original_load, "_dsdoctor", False):
        return

    @functools.wraps(original_load)
    def load(f, *args, **kwargs):
        try:
            if isinstance(f, (str, os.PathLike)) and _SHARD_FILE.search(os.fspath(f).replace(os.sep, "/")):
                frame, callers = sys._getframe(1), []
                while frame is not None and len(callers) < 4:
                    callers.append(frame.f_code.co_filename)
                    frame = frame.f_back
                if not any("deepspeed" in c for c in callers):  # DeepSpeed loading its own shards is the right way
                    _shard_loads.append(os.fspath(f))
        except Exception:
            pass
        return original_load(f, *args, **kwargs)

    load._dsdoctor = True
    torch.load = load
    _safe(loop.patch_torch_training, torch)  # train events of loops that step without the engine


# ------------------------------------------------------------------------ transformers

def _wrap_classmethod(cls, name: str, phase: str):
    raw = cls.__dict__.get(name)
    if raw is None or getattr(raw, "_dsdoctor", False):
        return
    func = raw.__func__ if isinstance(raw, classmethod) else raw

    @functools.wraps(func)
    def wrapper(klass, *args, **kwargs):
        rec = recorder.get()
        if rec is None or rec.busy:
            return func(klass, *args, **kwargs)
        token = _safe(rec.begin, phase, api=f"{klass.__name__}.{name}", hf_zero3=_hf_zero3_enabled())
        if token is None:
            return func(klass, *args, **kwargs)
        try:
            model = func(klass, *args, **kwargs)
        except BaseException as exc:
            _safe(rec.end, token, error=exc)
            raise
        _safe(rec.end, token, model=_safe(_model_info, model))
        _safe(_write_model, rec, model, f"{klass.__name__}.{name}")
        return model

    wrapper._dsdoctor = True
    setattr(cls, name, classmethod(wrapper))


def _patch_modeling_utils(mu):
    cls = getattr(mu, "PreTrainedModel", None)
    if cls is not None:
        _wrap_classmethod(cls, "from_pretrained", "load")
        _wrap_classmethod(cls, "_from_config", "load")


def _hf_zero3_enabled() -> bool:
    mod = sys.modules.get("transformers.integrations.deepspeed")
    try:
        return bool(mod and mod.is_deepspeed_zero3_enabled())
    except Exception:
        return False


def _generate_inputs(args, kwargs):
    for value in (kwargs.get("input_ids"), kwargs.get("inputs"), args[0] if args else None):
        if value is not None and hasattr(value, "shape"):
            return value
    return None


def _generate_workload(model, args, kwargs) -> dict:
    """Batch, prompt length, requested new tokens, and whether the model is an encoder-decoder."""
    info = {}
    inputs = _generate_inputs(args, kwargs)
    if inputs is not None:
        info["batch"], info["prompt_len"] = int(inputs.shape[0]), int(inputs.shape[-1])
    config = getattr(model, "config", None)
    info["encoder_decoder"] = bool(getattr(config, "is_encoder_decoder", False))
    gen_cfg = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    max_new = kwargs.get("max_new_tokens", getattr(gen_cfg, "max_new_tokens", None))
    if isinstance(max_new, int):
        info["max_new_tokens"] = max_new
    return info


def _generated_tokens(out, info: dict) -> dict:
    """Tokens generated, from generate's output. A decoder-only model returns prompt + new tokens; an
    encoder-decoder model (T5, BART) returns only the decoder's tokens, starting with its start token."""
    seq = out if hasattr(out, "shape") else getattr(out, "sequences", None)
    if seq is None or len(seq.shape) < 2:
        return {}
    length = int(seq.shape[-1])
    if info.get("encoder_decoder"):
        per_seq = max(0, length - 1)
    elif "prompt_len" in info:
        per_seq = max(0, length - info["prompt_len"])
    else:
        return {}
    return {"new_tokens": int(seq.shape[0]) * per_seq, "new_tokens_per_seq": per_seq}


def _patch_generation(gu):
    cls = getattr(gu, "GenerationMixin", None)
    if cls is None or getattr(cls.generate, "_dsdoctor", False):
        return
    original = cls.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        rec = recorder.get()
        if rec is None or rec.busy:
            return original(self, *args, **kwargs)
        info = {}
        try:
            requested = kwargs.get("synced_gpus")
            world = _world_size() or 1
            hf_z3 = _hf_zero3_enabled()
            first = next(iter(self.parameters()), None)
            info = {"synced_gpus_arg": requested, "hf_zero3": hf_z3, "world_size": world,
                    "synced_gpus": bool(requested) if requested is not None else bool(hf_z3 and world > 1),
                    "zero3_partitioned": first is not None and hasattr(first, "ds_id")}
            info.update(_generate_workload(self, args, kwargs))
            info.update(loop.generate_info(self))
            cfg_text = self.config.to_json_string(use_diff=False)  # for ab's reading of the peak (plan's shape)
            if len(cfg_text) < 50_000:
                info["model_config"] = json.loads(cfg_text)
        except Exception:
            pass
        gather = None
        if _variant_name() == "gather-once" and info.get("zero3_partitioned"):
            gather = _safe(_gather_once_context, self)
            info["gather_once"] = "applied" if not isinstance(gather, str) and gather is not None else \
                (gather or "observer error")
            if isinstance(gather, str):
                gather = None
        moe = _safe(ExpertGathers, self, rec) if info.get("zero3_partitioned") and gather is None else None
        if moe is not None and moe.info:
            info["moe"] = moe.info
        token = _safe(rec.begin, "generate", api="generate", **info)
        if token is None:
            if moe is not None:
                _safe(moe.close)
            return original(self, *args, **kwargs)
        counter = _safe(loop.ForwardCounter, self)
        stack = contextlib.ExitStack()
        if gather is not None:
            try:
                stack.enter_context(gather)
            except Exception as exc:  # the variant could not start: generate as the script asked
                _safe(rec.write, "observer_error", where="gather-once", error=repr(exc))
        try:
            with stack:
                out = original(self, *args, **kwargs)
        except BaseException as exc:
            _safe(rec.end, token, error=exc, forwards=counter.close() if counter else None,
                  moe_gathers=_safe(moe.close) if moe else None)
            raise
        extra = {"forwards": counter.close() if counter else None, "moe_gathers": _safe(moe.close) if moe else None}
        extra.update(_safe(_generated_tokens, out, info) or {})
        _safe(rec.end, token, **extra)
        return out

    generate._dsdoctor = True
    cls.generate = generate


def _gather_once_context(model):
    """The ab variant gather-once: a context for this generate, or the reason it does not apply."""
    from dsdoctor.trace.observer import gather_once

    engine = loop.engine_of(model)
    reason = gather_once.why_not(engine, model)
    return reason if reason else gather_once.gathered_for_generation(engine)


def _patch_hf_deepspeed(mod):
    cls = getattr(mod, "HfDeepSpeedConfig", None)
    if cls is None or getattr(cls.__init__, "_dsdoctor", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, config_file_or_dict, *args, **kwargs):
        rec = recorder.get()
        cfg, before = None, None
        source = "dict" if isinstance(config_file_or_dict, dict) else str(config_file_or_dict)
        if rec is not None:
            try:
                cfg = config_file_or_dict if isinstance(config_file_or_dict, dict) else \
                    _load_config_file(config_file_or_dict)
                if cfg is not None:
                    new = _rewrite(cfg)
                    if new is not cfg:
                        config_file_or_dict, before, cfg = new, cfg, new
            except Exception:
                pass
        original(self, config_file_or_dict, *args, **kwargs)
        if rec is not None:
            _safe(_write_config, rec, "HfDeepSpeedConfig", source, cfg, before, rewritable=cfg is not None,
                  is_zero3=_safe(self.is_zero3))

    __init__._dsdoctor = True
    cls.__init__ = __init__


def _patch_excepthook():
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        rec = recorder.get() if os.environ.get(recorder.ENV_DIR) else None
        if rec is not None:
            _safe(rec.write, "uncaught", error=recorder.describe_error(exc))
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook


# ------------------------------------------------------------------------ import hook

_TARGETS = {
    "torch": _patch_torch,
    "deepspeed": _patch_deepspeed,
    "transformers.modeling_utils": _patch_modeling_utils,
    "transformers.generation.utils": _patch_generation,
    "transformers.integrations.deepspeed": _patch_hf_deepspeed,
}


class _PostImportPatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for the target modules it wraps the real loader to patch after execution."""

    def __init__(self):
        self._busy = threading.local()

    def find_spec(self, name, path=None, target=None):
        if name not in _TARGETS:
            return None
        busy = getattr(self._busy, "names", None)
        if busy is None:
            busy = self._busy.names = set()
        if name in busy:
            return None
        busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        except Exception:
            return None
        finally:
            busy.discard(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_module(module, _orig=original_exec, _name=name):
            _orig(module)
            _safe(_TARGETS[_name], module)

        loader.exec_module = exec_module
        return spec


_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    sys.meta_path.insert(0, _PostImportPatcher())
    _patch_excepthook()
    for name, patch in _TARGETS.items():  # already imported (e.g. by another sitecustomize)
        if name in sys.modules:
            _safe(patch, sys.modules[name])
    if recorder.env_rank() is not None:
        # a launched rank: record from the start, so a rank that hangs before any observed call is seen too.
        # A plain `python infer.py` (and every launcher process) starts its record at the first observed call.
        recorder.get()
