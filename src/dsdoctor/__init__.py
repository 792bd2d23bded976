"""dsdoctor: find, explain and fix why LLM inference with DeepSpeed runs out of memory or crawls.

Every CLI command is also a plain library function here. Imports are lazy so that
``import dsdoctor`` (and the static commands: check, split, explain) never load torch or deepspeed.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_API = {
    "check": "dsdoctor.config.check",
    "split": "dsdoctor.config.split",
    "explain": "dsdoctor.findings",
    "load_config": "dsdoctor.config.load",
    "effective_settings": "dsdoctor.config.effective",
    "plan": "dsdoctor.plan.api",
    "trace": "dsdoctor.trace.api",
    "ab": "dsdoctor.trace.api",
    "merge": "dsdoctor.checkpoint.merge",
    "verify": "dsdoctor.checkpoint.verify",
    "compare": "dsdoctor.compare.api",
    "diagnose": "dsdoctor.diagnose",
    "env": "dsdoctor.envinfo",
}

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str):
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'dsdoctor' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
