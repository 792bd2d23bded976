"""plan's meta-device inventory, kept per config in the cache folder (``plan/inventory_cache.py``): a hit is the
inventory a fresh build gives, without importing torch or transformers; a damaged or forged file is rebuilt; the
key follows the config's content and the installed releases."""
import json
import os
import subprocess
import sys

import pytest

from dsdoctor.plan import inventory_cache as ic
from tests.helpers import DATA, TINY_LLAMA, write_model_config

pytest.importorskip("transformers")
from dsdoctor.model.exact import exact_inventory  # noqa: E402

MOE = json.loads((DATA / "arch_configs" / "olmoe-1b-7b.json").read_text())
MOE.update(num_hidden_layers=2, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
           num_experts=4, num_experts_per_tok=2, vocab_size=128, bos_token_id=1, eos_token_id=2,
           pad_token_id=1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSDOCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ic, "_MEMO", {})
    return tmp_path / "cache"


def _no_build(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("built on the meta device although cached")
    monkeypatch.setattr("dsdoctor.model.exact.exact_inventory", refuse)


@pytest.mark.parametrize("raw", [TINY_LLAMA, MOE], ids=["dense", "moe"])
def test_a_hit_is_the_fresh_inventory(raw, cache, monkeypatch):
    fresh = exact_inventory(raw, probe_positions=64)
    assert fresh is not None and fresh.cache_layout
    assert ic.exact_inventory_cached(raw, 64) == fresh  # built, and written
    assert len(list(cache.glob("inventory-*.json"))) == 1
    monkeypatch.setattr(ic, "_MEMO", {})  # a new process: only the file
    _no_build(monkeypatch)
    hit = ic.exact_inventory_cached(raw, 64)
    assert hit == fresh and (hit.moe is not None) == (raw is MOE)
    assert hit.num_params == fresh.num_params and hit.active_params == fresh.active_params
    hit.params.clear()  # the caller's copy: the memo keeps its own
    assert ic.exact_inventory_cached(raw, 64) == fresh


def test_a_model_transformers_cannot_build_is_cached_as_none(cache, monkeypatch):
    raw = dict(TINY_LLAMA, model_type="my_private_arch")
    assert ic.exact_inventory_cached(raw, 64) is None
    monkeypatch.setattr(ic, "_MEMO", {})
    _no_build(monkeypatch)
    assert ic.exact_inventory_cached(raw, 64) is None


def _forge(entry: dict, path, how: str):
    inv = entry["inventory"]
    if how == "numel out of bounds":
        inv["params"][0][2] = [2**40, 2**40]
    elif how == "negative dimension":
        inv["params"][0][2] = [-1, 64]
    elif how == "unknown kind":
        inv["params"][0][3] = "rootkit"
    elif how == "name not under its module":
        inv["params"][0][0] = "elsewhere.weight"
    elif how == "a string for a count":
        inv["cache_layout"][0][0] = "64"
    elif how == "a window of 0":
        inv["cache_layout"][0][1] = 0
    elif how == "another config's key":
        entry["key"] = "0" * 64
    elif how == "zero experts":
        inv["moe"] = {"num_experts": 0, "top_k": 1, "moe_layers": [0], "expert_intermediate": 1,
                      "shared_experts": 0, "shared_intermediate": 0, "fused": True, "block_class": ""}
    path.write_text(json.dumps(entry))


DAMAGED = {"not JSON": lambda p: p.write_text("{garbage"), "not UTF-8": lambda p: p.write_bytes(b"\xff\xfe{"),
           "nested": lambda p: p.write_text("[" * 1000 + "]" * 1000), "empty": lambda p: p.write_text(""),
           "a list": lambda p: p.write_text("[]")}
FORGED = ["numel out of bounds", "negative dimension", "unknown kind", "name not under its module",
          "a string for a count", "a window of 0", "another config's key", "zero experts"]


@pytest.mark.parametrize("how", sorted(DAMAGED) + FORGED)
def test_a_damaged_or_forged_file_is_ignored_and_rebuilt(how, cache, monkeypatch, capsys):
    fresh = ic.exact_inventory_cached(TINY_LLAMA, 64)
    path = ic.cache_path(ic.cache_key(TINY_LLAMA, 64))
    good = json.loads(path.read_text())
    if how in DAMAGED:
        DAMAGED[how](path)
    else:
        _forge(json.loads(path.read_text()), path, how)
    capsys.readouterr()
    monkeypatch.setattr(ic, "_MEMO", {})
    assert ic.exact_inventory_cached(TINY_LLAMA, 64) == fresh
    err = capsys.readouterr().err
    assert "ignoring the cached parameter inventory" in err and "building it again" in err, err
    assert json.loads(path.read_text()) == good  # rewritten


def test_a_fifo_in_place_of_the_file_neither_blocks_nor_is_replaced(cache, capsys):
    path = ic.cache_path(ic.cache_key(TINY_LLAMA, 64))
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    assert ic.exact_inventory_cached(TINY_LLAMA, 64) == exact_inventory(TINY_LLAMA, probe_positions=64)
    err = capsys.readouterr().err
    assert "ignoring the cached parameter inventory" in err and "is not cached" in err, err
    assert not path.is_file()


def test_the_key_follows_the_content_the_releases_and_the_probe(monkeypatch):
    key = ic.cache_key(TINY_LLAMA, 64)
    reordered = dict(reversed(list(TINY_LLAMA.items())))
    assert ic.cache_key(reordered, 64) == key  # the content, not the key order or the file's spacing
    assert ic.cache_key(dict(TINY_LLAMA, hidden_size=128), 64) != key
    assert ic.cache_key(dict(TINY_LLAMA, rope_theta=1e6), 64) != key
    assert ic.cache_key(TINY_LLAMA, 128) != key
    from dsdoctor.config import versions

    real = versions.installed
    for name, release in (("transformers", "4.0.0"), ("torch", "1.0.0")):
        monkeypatch.setattr(versions, "installed", lambda n, name=name, release=release: release if n == name
                            else real(n))
        assert ic.cache_key(TINY_LLAMA, 64) != key, name
    monkeypatch.setattr(versions, "installed", lambda n: None if n == "transformers" else real(n))
    assert ic.cache_key(TINY_LLAMA, 64) is None  # nothing to build: no cache
    monkeypatch.setattr(versions, "installed", real)
    monkeypatch.setattr(ic, "_counter_hash", lambda: "another counter")
    assert ic.cache_key(TINY_LLAMA, 64) != key


@pytest.mark.process
def test_a_plan_of_a_cached_model_imports_neither_torch_nor_transformers(tmp_path):
    """The first plan builds the model on the meta device (and prints what every later one prints); the second
    reads the cache and never imports torch or transformers."""
    model = write_model_config(tmp_path / "model")
    env = dict(os.environ, DSDOCTOR_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import json, sys\nfrom dsdoctor.plan.api import plan\n"
            f"r = plan({str(model)!r}, gpus=1, gpu_memory='80GiB', detect=False, gpu_name='H100')\n"
            "print(json.dumps(r.to_dict('en'), sort_keys=True))\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)\n")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert runs[0].stderr.strip().endswith("['torch', 'transformers']"), runs[0].stderr[-500:]
    assert runs[1].stderr.strip() == "[]", runs[1].stderr[-2000:]
    first, second = (json.loads(r.stdout) for r in runs)
    assert second == first and second["model"]["counted_by"] == "meta"
