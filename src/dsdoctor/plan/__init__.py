"""``dsdoctor plan``: memory and speed of each load path for an inference run, and which one to use.

``dsdoctor.plan`` names both this package and the library function (``dsdoctor/__init__.py`` maps the
public name lazily); once the package is imported Python binds the attribute to the package, so the
package itself is callable and forwards to ``dsdoctor.plan.api.plan``.
"""
from __future__ import annotations

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from dsdoctor.plan.api import plan

        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
