"""The library API: one plain function per command, taking plain values (paths, numbers, strings).

    from dsdoctor.api import check, split, plan, merge, verify, compare, trace, ab, diagnose, env, explain

Each returns a small result object with ``to_dict(lang)``, ``to_text(lang)`` and ``to_markdown(lang)`` and,
where it applies, ``findings``. Importing this module is cheap: each function imports its package on call,
so ``check``/``split``/``explain`` never load torch or deepspeed.
"""
from __future__ import annotations


def check(config, mode=None, model=None, gpus=None, tp=None, versions=None, gpu_name=None, runner=None):
    """What a DeepSpeed config (path or dict) really does for what runs it (runner, mode), and its findings.
    ``versions``: {"deepspeed": "0.15.0", ...} instead of the installed ones; ``gpu_name``: "A100", "V100"."""
    from dsdoctor.config.check import check as run
    return run(config, mode=mode, model=model, gpus=gpus, tp=tp, versions=versions, gpu_name=gpu_name, runner=runner)


def split(config, out, model=None, keep_auto=False, force=False):
    """Write the inference config of a training config to ``out`` (atomically)."""
    from dsdoctor.config.split import split as run
    return run(config, out, model=model, keep_auto=keep_auto, force=force)


def explain(code, lang="en"):
    """The long explanation of a finding code, as text."""
    from dsdoctor.findings import explain as run
    return run(code, lang)


def calibrate(out=None, nvme_path=None, **kwargs):
    """Measure this machine's figures and write its profile (see dsdoctor.calibrate.api.calibrate)."""
    from dsdoctor.calibrate.api import calibrate as run
    return run(out=out, nvme_path=nvme_path, **kwargs)


def plan(model, **kwargs):
    """Predicted memory and speed of every load path, and the recommendation; every keyword a field of
    ``dsdoctor.plan.request.PlanRequest`` (batch, prompt_len, new_tokens, dtype, gpus, gpu_memory, config, loop, ...)."""
    from dsdoctor.plan.api import plan as run
    return run(model, **kwargs)


def plan_job(job=None, **kwargs):
    """An RL job's models on the same GPUs: per-GPU memory of every arrangement and the fastest that fits.
    ``job``: a job file, launch line, dict or ``RlJob``; or the models as ``actor=``, ``ref=``, ``critic=``,
    ``reward=`` (``MODEL[:opts]``); every keyword a field of ``dsdoctor.plan.request.JobRequest``."""
    from dsdoctor.plan.loop_job import plan_job as run
    return run(job, **kwargs)


def trace(command, out=None, timeout=None, **kwargs):
    """Run ``command`` (a list of strings) with the observer in every rank; the per-rank report."""
    from dsdoctor.trace.api import trace as run
    return run(command, out=out, timeout=timeout, **kwargs)


def trace_report(out, **kwargs):
    """Rebuild the whole report of a multi-node trace from ``out``/node-K/ (``dsdoctor trace --report-only``)."""
    from dsdoctor.trace.api import report_only as run
    return run(out, **kwargs)


def ab(command, variants=None, out=None, timeout=None, **kwargs):
    """Run ``command`` once per DeepSpeed config variant and diagnose the difference."""
    from dsdoctor.trace.api import ab as run
    return run(command, variants=variants, out=out, timeout=timeout, **kwargs)


def merge(ckpt_dir, out_dir, **kwargs):
    """Consolidate DeepSpeed ZeRO shards into safetensors that from_pretrained loads."""
    from dsdoctor.checkpoint.merge import merge as run
    return run(ckpt_dir, out_dir, **kwargs)


def verify(out_dir, model, reference=None, **kwargs):
    """Check weights strictly against the model their config describes (and a reference)."""
    from dsdoctor.checkpoint.verify import verify as run
    return run(out_dir, model, reference=reference, **kwargs)


def compare(model_dir, model_dir_b=None, **kwargs):
    """Greedy tokens of several load paths (or two weight directories), compared prompt by prompt."""
    from dsdoctor.compare.api import compare as run
    return run(model_dir, model_dir_b, **kwargs)


def diagnose(**kwargs):
    """The whole troubleshooting; writes a report directory (see dsdoctor.diagnose.diagnose)."""
    from dsdoctor.diagnose import diagnose as run
    return run(**kwargs)


def env(check_ops=True):
    """Versions and hardware for a bug report."""
    from dsdoctor.envinfo import env as run
    return run(check_ops=check_ops)
