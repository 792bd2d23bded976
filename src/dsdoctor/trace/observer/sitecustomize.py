"""Loaded by Python at start-up because dsdoctor put this directory first on PYTHONPATH.

It installs dsdoctor's observer (only when a trace directory is set) and then runs the sitecustomize that
would have been loaded without us, so a site's own customisation keeps working. Nothing here may raise.
"""
import os
import sys


def _install_observer():
    if not os.environ.get("PYTHON_DSDOCTOR_TRACE_DIR"):
        return
    try:
        from dsdoctor.trace.observer import hooks

        hooks.install()
    except Exception as exc:  # never break the user's program
        sys.stderr.write(f"dsdoctor: observer not installed: {type(exc).__name__}: {exc}\n")


def _chain_next_sitecustomize():
    """Execute the next ``sitecustomize`` on sys.path after this directory, as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    try:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.stderr.write(f"dsdoctor: the site's sitecustomize failed: {type(exc).__name__}: {exc}\n")


_install_observer()
_chain_next_sitecustomize()
