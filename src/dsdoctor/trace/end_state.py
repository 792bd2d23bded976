"""The seed's end state as an ab variant: once a variant has run on a GPU (so the model, workload and GPU are
known from its trace), plan's memory model says whether the inference config runs without ZeRO-3 (``plain``: the
whole model on each GPU) or at least without offload_param (``split-no-offload``); the first that fits is measured
too, so ab weighs the way out itself, not only the rewrites of the user's config."""
from __future__ import annotations

FILL = 0.9  # of the GPU's memory: what a measured end state may be planned to take (the allocator's slack above)


def end_state_variants(results, chosen: list[str]) -> list[str]:
    """The end-state variant to add (none, or one of ``plain``, ``split-no-offload``) for the variants run."""
    ran = next((v for v in results if v.status == "ok" and v.shape and v.gpu_total_bytes), None)
    if ran is None:
        return []
    for name, path in (("plain", "plain"), ("split-no-offload", "zero3")):
        if fits(ran.shape, path, ran.gpu_total_bytes):
            return [] if name in chosen else [name]
    return []


def fits(shape: dict, path: str, gpu_total: int) -> bool:
    """The upper figure of plan's allocated generate peak of ``path`` for the traced shape (the peak times its
    measured band's worst case, plan/band.py) is within FILL of the GPU."""
    try:
        from dsdoctor.plan.api import allocated_upper, generate_peak

        dtype = {"fp32": "fp32", "fp16": "fp16"}.get(shape.get("dtype") or "", None)
        mem = generate_peak(shape["model_config"], path, int(shape["batch"]), int(shape["prompt_len"]),
                            int(shape["new_tokens"]), gpus=max(int(shape.get("world_size") or 1), 1), dtype=dtype)
    except Exception:  # an architecture plan does not model: no end state is guessed
        return False
    return mem is not None and allocated_upper(path, mem.gpu_peak_bytes) <= FILL * gpu_total
