"""dsdoctor: find, explain and fix why LLM inference with DeepSpeed runs out of memory or crawls.

The library API is ``dsdoctor.api`` (one plain function per command). The names that do not collide with a
subpackage are also reachable here, lazily: ``dsdoctor.check``, ``split``, ``explain``, ``ab``, ``merge``,
``verify``, ``env``, ``load_config``, ``effective_settings``. (``plan``, ``trace``, ``compare`` and
``diagnose`` are subpackages/modules too; use ``dsdoctor.api`` for those.) ``import dsdoctor`` never loads
torch or deepspeed.
"""
from __future__ import annotations

import importlib

from dsdoctor._version import __version__

_API = {
    "check": "dsdoctor.api",
    "split": "dsdoctor.api",
    "explain": "dsdoctor.api",
    "ab": "dsdoctor.api",
    "merge": "dsdoctor.api",
    "verify": "dsdoctor.api",
    "env": "dsdoctor.api",
    "load_config": "dsdoctor.config.load",
    "effective_settings": "dsdoctor.config.effective",
}

__all__ = sorted(_API) + ["__version__", "api"]


def __getattr__(name: str):
    module = _API.get(name)
    if module is None:
        if name == "api":
            return importlib.import_module("dsdoctor.api")
        raise AttributeError(f"module 'dsdoctor' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
