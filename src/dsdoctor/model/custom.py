"""Model folders whose config.json needs custom code, and library errors made fit for one line.

dsdoctor loads models with ``trust_remote_code=False`` everywhere: a model folder is untrusted input, and its
``auto_map`` names Python files that ``trust_remote_code=True`` would import and run. transformers' own error
for such a folder is several lines long, asks for ``trust_remote_code=True`` and points a local folder at a
Hub URL (``https://hf.co//tmp/model``); these helpers say what is going on instead.
"""
from __future__ import annotations

import re


def custom_code_classes(cfg: dict) -> list[str]:
    """The classes a config's ``auto_map`` names when transformers does not ship its ``model_type`` itself
    (then only the folder's own code could build it); [] when transformers has the architecture."""
    auto = cfg.get("auto_map") if isinstance(cfg, dict) else None
    if not isinstance(auto, dict) or not auto:
        return []
    model_type = cfg.get("model_type")
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        CONFIG_MAPPING_NAMES = {}
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING_NAMES:
        return []
    names = []
    for value in auto.values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, str) and item not in names:
                names.append(item[:120])
    return names[:4]


_HUB_URL = re.compile(r"\s*You can inspect the repository content at https://hf\.co/\S*?\.?(?=\s|$)")


def library_error(exc: BaseException) -> str:
    """A library's error message on one line: its line breaks folded, a Hub URL built from a local path dropped."""
    text = _HUB_URL.sub("", str(exc))
    return " ".join(text.split())
