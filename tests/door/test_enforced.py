"""Only ``dsdoctor.door`` opens files: every module of src/dsdoctor is parsed and each call that opens,
reads, writes, copies, renames, maps or deletes a file by itself fails the test, naming the module, line and
call. The few calls that cannot go through the door are listed below, each with the reason."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT

SRC = ROOT / "src" / "dsdoctor"
DOOR = SRC / "door"

# calls by their full dotted name (as written, after resolving `import x as y` / `from x import y`)
FORBIDDEN_CALLS = {
    "open", "io.open", "codecs.open", "os.open", "os.fdopen",
    "os.replace", "os.rename", "os.renames", "os.remove", "os.unlink", "os.makedirs", "os.mkdir", "os.rmdir",
    "os.removedirs", "os.link", "os.symlink", "os.truncate", "os.mkfifo", "os.mknod", "os.chmod",
    "json.load", "json.dump", "pickle.load", "pickle.dump", "marshal.load",
    "numpy.load", "numpy.save", "numpy.savez", "numpy.fromfile", "numpy.memmap", "numpy.loadtxt",
    "torch.load", "torch.save", "safetensors.safe_open", "safetensors.torch.load_file",
    "safetensors.torch.save_file", "safetensors.numpy.load_file", "safetensors.numpy.save_file",
    "mmap.mmap", "zipfile.ZipFile", "tarfile.open", "yaml.load", "yaml.safe_load", "yaml.full_load",
    "yaml.unsafe_load", "yaml.load_all", "yaml.safe_load_all", "yaml.dump", "yaml.safe_dump",
}
FORBIDDEN_PREFIXES = ("shutil.", "tempfile.")
ALLOWED_CALLS = {"shutil.which"}  # looks a program up on PATH; opens nothing
# methods of pathlib.Path (and file-like objects) that touch files, whatever the receiver is
FORBIDDEN_METHODS = {"read_text", "read_bytes", "write_text", "write_bytes", "open", "unlink", "mkdir", "rmdir",
                     "touch", "symlink_to", "hardlink_to", "chmod", "savefig", "from_file", "to_file"}
# Path.rename/replace take one path; str.replace and dataclasses.replace take two arguments or keywords
ONE_ARGUMENT_METHODS = {"rename", "replace"}
# libraries that open files by name: the door's check_library_files must run before them
LIBRARY_OPENERS = {"from_pretrained"}

# (module, enclosing function, call) -> why it may stay outside the door
EXCEPTIONS = {
    ("config/load.py", "_parse_yaml", "yaml.load"):
        "parses text the door already read (a bounded SafeLoader subclass), not a file",
    ("config/load.py", "parse_command", "yaml.safe_load"):
        "parses one flag value of a launch command the door already read, not a file",
    ("checkpoint/unpickle.py", "load", "zipfile.ZipFile"):
        "wraps the file object door.open_binary opened and checked",
    ("calibrate/measure.py", "nvme_read_bandwidth", "os.fdopen"):
        "wraps the descriptor of the probe file door.probe_file made (and removes)",
    ("trace/plot.py", "_plot_rank", "savefig"): "draws into an io.BytesIO; door.write_new writes the bytes",
    ("plan/plot.py", "render_png", "savefig"): "draws into an io.BytesIO; door.write_new writes the bytes",
    ("checkpoint/verify.py", "_load_config", "from_pretrained"):
        "transformers reads config.json, which door.check_library_files bounded just before",
    ("compare/prompts.py", "_load_tokenizer", "from_pretrained"):
        "transformers reads the tokenizer files, which door.check_library_files checked just before",
    ("compare/runner.py", "load", "from_pretrained"):
        "runs in the user's ranks; the parent checked every file of the model folder (compare.api)",
}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted name, from the module's imports (at any level)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    names.setdefault("np", "numpy")
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _receiver(node: ast.Attribute) -> str | None:
    return node.value.id if isinstance(node.value, ast.Name) else None


def file_calls(path: Path) -> list[tuple[int, str, str]]:
    """(line, enclosing function, call) of every call in ``path`` that would touch a file by itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    aliases = _aliases(tree)
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Call):
                call = _offending(child, aliases)
                if call:
                    found.append((child.lineno, function, call))
            visit(child, function)

    visit(tree, "<module>")
    return found


def _offending(call: ast.Call, aliases: dict[str, str]) -> str | None:
    func = call.func
    name = _dotted(func, aliases)
    if name is not None and name.split(".")[0] == "dsdoctor":
        return None  # dsdoctor's own functions (the door among them)
    if name in ALLOWED_CALLS:
        return None
    if name in FORBIDDEN_CALLS or (name and name.startswith(FORBIDDEN_PREFIXES)):
        return name
    if isinstance(func, ast.Attribute) and _receiver(func) != "door":
        if func.attr in FORBIDDEN_METHODS or func.attr in LIBRARY_OPENERS:
            return func.attr
        if func.attr in ONE_ARGUMENT_METHODS and len(call.args) == 1 and not call.keywords:
            return func.attr
    return None


def modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if DOOR not in p.parents)


def test_no_module_but_the_door_touches_files():
    stray = []
    used = set()
    for path in modules():
        rel = path.relative_to(SRC).as_posix()
        for line, function, call in file_calls(path):
            key = (rel, function, call)
            if key in EXCEPTIONS:
                used.add(key)
                continue
            stray.append(f"{rel}:{line} in {function}(): {call}(...) -- go through dsdoctor.door")
    assert not stray, "file access outside dsdoctor.door:\n" + "\n".join(stray)
    assert used == set(EXCEPTIONS), f"exceptions no longer needed (remove them): {set(EXCEPTIONS) - used}"


def test_the_check_finds_a_stray_open(tmp_path):
    """The test above can fail: each kind of stray call, planted in a copy of a real module, is found."""
    source = (SRC / "plan" / "workload.py").read_text(encoding="utf-8")
    planted = {
        "open": "def stray(p):\n    return open(p).read()\n",
        "os.replace": "import os\ndef stray(a, b):\n    os.replace(a, b)\n",
        "read_text": "from pathlib import Path\ndef stray(p):\n    return Path(p).read_text()\n",
        "shutil.rmtree": "import shutil\ndef stray(p):\n    shutil.rmtree(p)\n",
        "tempfile.mkdtemp": "import tempfile as t\ndef stray():\n    return t.mkdtemp()\n",
        "torch.load": "def stray(p):\n    import torch\n    return torch.load(p)\n",
        "json.load": "import json\ndef stray(fh):\n    return json.load(fh)\n",
        "safetensors.safe_open": "from safetensors import safe_open\ndef stray(p):\n    return safe_open(p, 'pt')\n",
        "mmap.mmap": "import mmap\ndef stray(fd):\n    return mmap.mmap(fd, 0)\n",
        "numpy.load": "import numpy as np\ndef stray(p):\n    return np.load(p)\n",
        "replace": "def stray(p, q):\n    p.replace(q)\n",
        "unlink": "def stray(p):\n    p.unlink()\n",
        "from_pretrained": "def stray(d):\n    from transformers import AutoConfig\n    return AutoConfig.from_pretrained(d)\n",
    }
    for call, code in planted.items():
        bad = tmp_path / "workload.py"
        bad.write_text(source + "\n\n" + code, encoding="utf-8")
        assert [c for _, f, c in file_calls(bad) if f == "stray"] == [call], call
    clean = tmp_path / "clean.py"
    clean.write_text(source + "\n\ndef fine(s, d):\n    import dataclasses\n"
                     "    return s.replace('a', 'b'), dataclasses.replace(d, x=1)\n", encoding="utf-8")
    assert file_calls(clean) == []


@pytest.mark.process
def test_the_door_imports_only_the_standard_library_and_errors():
    """It runs inside the user's ranks (trace observer, compare runner, NCCL worker): nothing heavy at import."""
    import subprocess
    import sys

    code = ("import sys; import dsdoctor.door; "
            "print(sorted(m for m in sys.modules if m.startswith('dsdoctor') or m.split('.')[0] in "
            "('torch', 'numpy', 'deepspeed', 'transformers', 'yaml', 'safetensors')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src")}).stdout
    loaded = eval(out)  # noqa: S307 -- a list of names this test printed
    assert not [m for m in loaded if not m.startswith("dsdoctor")], loaded  # no torch, numpy, yaml...
    assert {m for m in loaded if not m.startswith("dsdoctor.door")} == {"dsdoctor", "dsdoctor._version",
                                                                        "dsdoctor.errors"}
