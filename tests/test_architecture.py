"""The architecture as tests: no import circle, the layers of docs/architecture.md, heavy imports kept off
the static paths. Read over the source with ``ast`` (nothing is imported), so a function-level import counts
as much as a module-level one: a circle hidden inside a function is still a circle."""
from __future__ import annotations

import ast
import collections
from pathlib import Path

from tests.helpers import ROOT

SRC = ROOT / "src"
PACKAGE = "dsdoctor"


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = f.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported dsdoctor module, line, at module level) for every import statement in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(n) for n in tree.body}
    top_level |= {id(c) for n in tree.body if isinstance(n, ast.If | ast.Try) for c in ast.walk(n)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            found.append((target, node.lineno, id(node) in top_level))
    return found


def _resolve(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in MODULES.items():
        for target, _, _ in _imports(name, path):
            if target.startswith(PACKAGE):
                resolved = _resolve(target)
                # `from pkg import module` names the package too: the package's own __init__ is not a dependency
                if resolved and resolved != name and not (resolved == PACKAGE and target != PACKAGE):
                    edges[name].add(resolved)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    nodes = set(edges) | {w for targets in edges.values() for w in targets}
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_even_through_function_level_imports():
    assert _cycles(_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# --- the layers (docs/architecture.md, "Rooms"): what each package may import from dsdoctor -----------------

FOUNDATION = {"dsdoctor", "dsdoctor._version", "dsdoctor.errors", "dsdoctor.units", "dsdoctor.door",
              "dsdoctor.i18n", "dsdoctor.findings", "dsdoctor.report", "dsdoctor.dtypes", "dsdoctor.gpus",
              "dsdoctor.machine", "dsdoctor.proctree", "dsdoctor.zero_costs"}
READING = {"dsdoctor.model", "dsdoctor.config"}
ALLOWED = {
    "dsdoctor.model": FOUNDATION,
    "dsdoctor.config": FOUNDATION | {"dsdoctor.model"},
    "dsdoctor.calibrate": FOUNDATION | READING,
    "dsdoctor.plan": FOUNDATION | READING | {"dsdoctor.calibrate"},
    # verify builds the model from its config.json; merge asks config/versions.py for the installed transformers
    "dsdoctor.checkpoint": FOUNDATION | READING,
    "dsdoctor.compare": FOUNDATION | {"dsdoctor.model", "dsdoctor.checkpoint"},  # an adapter read as merge reads it
    "dsdoctor.trace": FOUNDATION | READING | {"dsdoctor.calibrate", "dsdoctor.plan"},
    "dsdoctor.envinfo": FOUNDATION | {"dsdoctor.config"},
    # diagnose's own modules, each below the next: a step, its inputs, the way out, the pipeline
    "dsdoctor.diagnose_step": FOUNDATION,
    "dsdoctor.diagnose_inputs": FOUNDATION | READING | {"dsdoctor.diagnose_step"},
    "dsdoctor.diagnose_exit": FOUNDATION | {"dsdoctor.checkpoint", "dsdoctor.trace", "dsdoctor.diagnose_step",
                                            "dsdoctor.diagnose_inputs"},
    "dsdoctor.diagnose": FOUNDATION | READING | {"dsdoctor.calibrate", "dsdoctor.plan", "dsdoctor.checkpoint",
                                                 "dsdoctor.compare", "dsdoctor.trace", "dsdoctor.diagnose_step",
                                                 "dsdoctor.diagnose_inputs", "dsdoctor.diagnose_exit"},
}
# what another package may use of a package it is allowed to import: its public entry, nothing inside
PUBLIC = {"dsdoctor.plan": {"dsdoctor.plan.api"}}


def _room(module: str) -> str:
    """The package (or top-level module) a module belongs to: ``dsdoctor.plan.paths.tp`` -> ``dsdoctor.plan``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _violations(graph: dict[str, set[str]] | None = None) -> list[str]:
    out = []
    for name, targets in sorted((_graph() if graph is None else graph).items()):
        room = _room(name)
        for target in sorted(targets):
            other = _room(target)
            if other == room:
                continue
            if room in FOUNDATION:
                allowed = FOUNDATION
            elif room in ALLOWED:
                allowed = ALLOWED[room]
            else:  # the entry points (cli, api, __main__) may use everything
                continue
            if other not in allowed:
                out.append(f"{name} imports {target}: {room} may not use {other}")
            elif other in PUBLIC and target not in PUBLIC[other] and room != "dsdoctor.diagnose":
                out.append(f"{name} imports {target}: outside {other}, use {sorted(PUBLIC[other])}")
    return out


def test_every_package_imports_only_the_layers_below_it():
    assert _violations() == []


def test_the_layer_check_finds_a_wrong_way_import():
    graph = {"dsdoctor.model.spec": {"dsdoctor.plan.api"}, "dsdoctor.trace.report": {"dsdoctor.plan.memory"},
             "dsdoctor.config.load": {"dsdoctor.model.spec", "dsdoctor.door"}}
    assert _violations(graph) == [
        "dsdoctor.model.spec imports dsdoctor.plan.api: dsdoctor.model may not use dsdoctor.plan",
        "dsdoctor.trace.report imports dsdoctor.plan.memory: outside dsdoctor.plan, use ['dsdoctor.plan.api']"]


def test_every_package_has_a_place_in_the_layers():
    rooms = {_room(m) for m in MODULES}
    entry = {"dsdoctor.cli", "dsdoctor.api", "dsdoctor.__main__"}
    assert rooms - FOUNDATION - set(ALLOWED) - entry == set(), "add the new package to ALLOWED and docs/architecture.md"


HEAVY = ("torch", "deepspeed", "transformers", "safetensors", "accelerate", "numpy", "matplotlib")


def test_the_static_side_never_imports_heavy_packages_at_module_level():
    """check, split and explain (and everything they import) start in a fraction of a second without torch:
    heavy imports stay inside the functions that need them."""
    static_rooms = FOUNDATION | READING
    found = []
    for name, path in MODULES.items():
        if _room(name) not in static_rooms:
            continue
        for target, line, top_level in _imports(name, path):
            if top_level and target.split(".")[0] in HEAVY:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert found == []
