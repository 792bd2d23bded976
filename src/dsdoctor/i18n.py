"""Language choice: English and Chinese. Default from the locale (LC_ALL, LC_MESSAGES, LANG)."""
from __future__ import annotations

import os

LANGS = ("en", "zh")


def default_lang() -> str:
    for var in ("DSDOCTOR_LANG", "LC_ALL", "LC_MESSAGES", "LANG"):
        value = os.environ.get(var, "")
        if value:
            return "zh" if value.lower().startswith("zh") else "en"
    return "en"


def pick(texts: dict[str, str] | str, lang: str) -> str:
    """Text in ``lang``, falling back to English."""
    if isinstance(texts, str):
        return texts
    return texts.get(lang) or texts["en"]


_MESSAGES: dict | None = None


def message_table(name: str) -> dict[str, dict[str, str]]:
    """One module's table of UI texts ({key: {"en": ..., "zh": ...}}) from messages.json (data, not code)."""
    global _MESSAGES
    if _MESSAGES is None:
        import json
        from pathlib import Path

        from dsdoctor import door

        _MESSAGES = json.loads(door.read_text(Path(__file__).with_name("messages.json"), door.PACKAGE_DATA))
    return _MESSAGES[name]
