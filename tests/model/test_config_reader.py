"""Issue 32.3 / 33.2: one reader of a model's config.json (``model.spec.read_config_json``: the door's bounds,
depth and node count, the outside-the-tree rule); transformers' own validation of a config it ships is bad input
naming the file, exit 2, no traceback."""
from __future__ import annotations

import ast
import json

import pytest

from dsdoctor.errors import InputError
from tests.helpers import EXAMPLES, ROOT, run_cli

SRC = ROOT / "src" / "dsdoctor"
READS = {"read_text", "read_bytes", "read_json", "open_fd", "open_binary"}


def _readers_of_model_config() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in READS and \
                    any(isinstance(a, ast.Attribute) and a.attr == "MODEL_CONFIG" for a in node.args):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def test_config_json_has_one_reader():
    readers = _readers_of_model_config()
    assert len(readers) == 1 and readers[0].startswith("model/spec.py:"), readers


def test_the_one_reader_bounds_depth_for_every_caller(tmp_path):
    """merge's own copy skipped the depth check; the one reader refuses a deep config.json for every caller."""
    from dsdoctor.checkpoint.merge import _read_config

    (tmp_path / "config.json").write_text('{"hidden_size": 8, "x": ' + "[" * 200 + "]" * 200 + "}")
    with pytest.raises(InputError, match="nest"):
        _read_config(tmp_path)


@pytest.mark.process
def test_a_config_transformers_refuses_is_named_with_the_file(tmp_path):
    pytest.importorskip("transformers")
    cfg = json.loads((EXAMPLES / "llama-7b" / "config.json").read_text())
    cfg["head_dim"] = 127  # RoPE needs an even rotary dimension: transformers' own validator refuses it
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run_cli("plan", "--model", tmp_path, "--counts", "meta", timeout=300)
    assert r.returncode == 2 and f"{tmp_path / 'config.json'}: transformers refuses this llama config" in r.stderr
    assert "head_dim" in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "internal error" not in r.stderr
