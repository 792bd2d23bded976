"""The meta-device parameter inventory, kept per model config in dsdoctor's cache folder.

Building the inventory imports torch and transformers and builds the model on the meta device: seconds, most of
a plan's time. The result depends only on the config, the installed transformers and torch, and dsdoctor's own
counter, so it is kept in ``<cache>/inventory-<key>.json`` (``calibrate.profile.cache_dir``) and a second plan of
the same model reads it instead, importing neither. The key hashes config.json's parsed content, the probe
length, the two releases, dsdoctor's version and the source of the counter (``model/exact.py``,
``inventory.py``, ``moe.py``): any change builds anew. The file is untrusted like every cached file: read
through the door within its kind's bounds (``door.INVENTORY_CACHE``), its key compared, every value checked
(``model.inventory.inventory_from_dict``); a damaged or forged one is ignored with a warning and rebuilt.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import sys
from pathlib import Path

from dsdoctor import door
from dsdoctor._version import __version__
from dsdoctor.errors import InputError, one_line
from dsdoctor.model.inventory import Inventory, inventory_from_dict, inventory_to_dict

SCHEMA = "dsdoctor-inventory/1"
_MEMO: dict[str, Inventory | None] = {}  # key -> inventory, within one process
_COUNTER = ("exact.py", "inventory.py", "moe.py")  # the code an inventory comes from


def cache_key(raw: dict, positions: int) -> str | None:
    """The key of ``raw``'s inventory here, or None without transformers (nothing to build, nothing to keep)."""
    from dsdoctor.config.versions import installed

    releases = {name: installed(name) for name in ("transformers", "torch")}
    if releases["transformers"] is None:
        return None
    text = json.dumps({"schema": SCHEMA, "config": json.dumps(raw, sort_keys=True), "positions": positions,
                       "releases": releases, "dsdoctor": __version__, "counter": _counter_hash()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _counter_hash() -> str:
    model_dir = Path(__file__).resolve().parents[1] / "model"
    return hashlib.sha256(b"".join(door.read_bytes(model_dir / f, door.PACKAGE_DATA) for f in _COUNTER)).hexdigest()


def cache_path(key: str) -> Path:
    from dsdoctor.calibrate.profile import cache_dir

    return cache_dir() / f"inventory-{key[:32]}.json"


def _read(path: Path, key: str) -> tuple[bool, Inventory | None]:
    """(found, the inventory or None where transformers cannot build the model); a damaged file is not found."""
    if not os.path.lexists(path):
        return False, None
    try:
        data = door.read_json(path, door.INVENTORY_CACHE)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("key") != key:
            raise ValueError("written for another config, release or dsdoctor")
        inv = data.get("inventory")
        return True, None if inv is None else inventory_from_dict(inv)
    except (InputError, ValueError, TypeError) as exc:
        why = exc.one_line() if isinstance(exc, InputError) else f"{exc}"
        print(f"dsdoctor: warning: ignoring the cached parameter inventory {path} ({one_line(why, 300)}); "
              "building it again", file=sys.stderr)
        return False, None


def _write(path: Path, key: str, inv: Inventory | None) -> None:
    data = {"schema": SCHEMA, "key": key, "inventory": None if inv is None else inventory_to_dict(inv)}
    try:
        door.write_cache_file(path, json.dumps(data, separators=(",", ":")) + "\n")
    except InputError as exc:  # a read-only or odd cache folder costs the next plan time, never this one
        print(f"dsdoctor: note: the parameter inventory is not cached ({one_line(exc.one_line(), 300)})",
              file=sys.stderr)


def exact_inventory_cached(raw: dict, positions: int, path=None) -> Inventory | None:
    """``model.exact.exact_inventory(raw, positions)``: from this process's memo, else the cache file, else
    built on the meta device (and kept in both). None where transformers cannot build the model. ``path`` (the
    config.json) only names the file in an error."""
    key = cache_key(raw, positions)
    if key is None or key not in _MEMO:
        found, inv = _read(cache_path(key), key) if key else (False, None)
        if not found:
            from dsdoctor.model.exact import exact_inventory

            inv = exact_inventory(raw, probe_positions=positions, path=path)
            if key:
                _write(cache_path(key), key, inv)
        if key is None:
            return inv
        _MEMO[key] = inv
    return copy.deepcopy(_MEMO[key])
