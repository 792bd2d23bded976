"""UI text: the language (English or Chinese, default from the locale) and the one store of texts.

Every text a user reads exists in both languages and lives in data, never in code: the words of commands'
outputs in ``messages.json`` (tables named after the module that reads them, ``{key: {"en": ..., "zh": ...}}``,
loaded once), the findings' rules in each package's ``rules.json`` (read by ``dsdoctor.findings``). Code looks a
text up by key and fills its ``{placeholders}``; ``tests/test_text.py`` holds every entry to both languages and
the same placeholders.
"""
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


def fill(texts: dict[str, str], **values) -> dict[str, str]:
    """``texts`` in every language with its placeholders filled; a ``{lang: text}`` value fills per language."""
    return {lang: texts[lang].format(**{k: v[lang] if isinstance(v, dict) else v for k, v in values.items()})
            for lang in LANGS}


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
