"""Gather a ZeRO-3 model once for a whole ``generate`` and lift ZeRO-3's per-module hooks meanwhile.

Under ZeRO-3 every forward of ``generate`` (one per new token) fetches and releases every partitioned
parameter through hooks DeepSpeed put on every module (``DeepSpeedZeRoOffload._register_deepspeed_module``).
``GatheredParameters`` alone makes the weights whole but leaves those hooks running on every module of every
forward. This context does what DeepSpeed's own ``deepspeed.runtime.zero.stage3.unwrap_model_for_generation``
and trl's ``unwrap_model_for_generation(gather_deepspeed3_params=True)`` do, plus one thing they leave:

1. all-gather every parameter once (``GatheredParameters``): full weights on every rank while generating;
2. remove the per-module forward/backward hooks (``forward_hooks``/``backward_hooks`` of the parameter
   offload object) and clear each parameter's active-submodule set;
3. (``restore_linear``) while generating, put back ``torch.nn.functional.linear``: once ZeRO-3's ``Init`` ran
   (a model built under ``zero.Init`` or converted at ``deepspeed.initialize``, ``memory_efficient_linear`` on,
   the default) DeepSpeed has replaced it process-wide with ``zero3_linear_wrap``, an autograd
   Function around matmul ("This will persist unless manually reset"), which every linear then pays for;
4. afterwards re-register the hooks (``_register_deepspeed_module`` on the root, which also invalidates the
   parameter coordinator's trace: the next training forward records it again, without prefetch) and
   re-partition (leaving ``GatheredParameters``).

What stays: the root module's start-of-forward hook (``reset_step``, cheap once the trace is complete), the
one all-gather per generate, and the re-recorded trace on the next training forward.
Imported lazily, only inside a rank that has torch and deepspeed.
"""
from __future__ import annotations

import contextlib


def parameter_offload(engine):
    """The object that owns ZeRO-3's module hooks: the stage-3 optimizer's ``parameter_offload``, or the
    ``DeepSpeedZeRoOffload`` an optimizer-less ZeRO-3 engine keeps as its optimizer."""
    opt = getattr(engine, "optimizer", None)
    if opt is None:
        return None
    offload = getattr(opt, "parameter_offload", None) or opt
    if hasattr(offload, "forward_hooks") and hasattr(offload, "_register_deepspeed_module"):
        return offload
    return None


def why_not(engine, model) -> str | None:
    """None when gather-once applies, else the reason it does not."""
    if engine is None:
        return "generate was not called on a DeepSpeed engine's module"
    try:
        if engine.zero_optimization_stage() != 3:
            return "not ZeRO-3"
    except Exception:
        return "not a ZeRO engine"
    offload = parameter_offload(engine)
    if offload is None:
        return "no ZeRO-3 parameter offload object"
    if not offload.forward_hooks:
        return "the module hooks are already off (the script gathers by itself)"
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if all(getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE for p in model.parameters()
           if hasattr(p, "ds_id")):
        return "the parameters are already gathered"
    return None


@contextlib.contextmanager
def _plain_linear():
    import torch

    try:
        from deepspeed.runtime.zero.linear import zero3_linear_wrap
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Ins
    except Exception:
        yield False
        return
    original = getattr(Ins, "linear_bk", None)
    if original is None or torch.nn.functional.linear is not zero3_linear_wrap:
        yield False
        return
    torch.nn.functional.linear = original
    try:
        yield True
    finally:
        torch.nn.functional.linear = zero3_linear_wrap


@contextlib.contextmanager
def _without_root_hook(offload):
    """Take the root module's start-of-forward hook (``reset_step``) off, and put the same function back."""
    handle = getattr(offload, "fwd_pre_hook", None)
    hooks = getattr(offload.module, "_forward_pre_hooks", {})
    fn = hooks.get(getattr(handle, "id", None)) if handle is not None else None
    if fn is None:
        yield False
        return
    handle.remove()
    try:
        yield True
    finally:
        offload.fwd_pre_hook = offload.module.register_forward_pre_hook(fn)


@contextlib.contextmanager
def gathered_for_generation(engine, restore_linear: bool = True, lift_root_hook: bool = False):
    """Run the body with the whole model gathered and ZeRO-3's module hooks off (see the module doc).
    ``lift_root_hook`` also takes the root's ``reset_step`` hook off (bench/rlloop measures what it costs)."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    offload = parameter_offload(engine)
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        for hook in list(offload.forward_hooks) + list(offload.backward_hooks):
            hook.remove()
        offload.forward_hooks = []
        offload.backward_hooks = []
        for p in params:
            active = getattr(p, "ds_active_sub_modules", None)
            if active is not None:
                active.clear()
        try:
            with contextlib.ExitStack() as stack:
                if restore_linear:
                    stack.enter_context(_plain_linear())
                if lift_root_hook:
                    stack.enter_context(_without_root_hook(offload))
                yield
        finally:
            offload._register_deepspeed_module(offload.module)
