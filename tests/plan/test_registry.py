"""The load paths as a registry: every row of a plan comes from a registered path type, a new type is all a
new path needs, and plan's modules import each other without a circle."""
import ast
from pathlib import Path

from dsdoctor.plan import paths
from dsdoctor.plan.api import plan
from dsdoctor.plan.paths.plain import Plain
from tests.helpers import EXAMPLES

PLAN = Path(paths.__file__).resolve().parent.parent
LLAMA_7B = EXAMPLES / "llama-7b"


def _plan(**kw):
    return plan(LLAMA_7B, batch=1, prompt_len=256, new_tokens=16, gpus=4, gpu_memory="80GB", host_memory="1TiB",
                detect=False, gpu_name="H100", counts="formula", **kw)


def test_every_row_comes_from_a_registered_type_in_registry_order():
    fixed = [cls.name for cls in paths.REGISTRY]  # a tp group's type is named tpKxR, its rows tp2x2, ...
    loop_only = {cls.name for cls in paths.REGISTRY if cls.loop_only}
    for loop in (False, True):
        names = [p.name for p in _plan(loop=loop).paths]
        order = [fixed.index(n if n in fixed else "tpKxR") for n in names]
        assert order == sorted(order) and len(set(names)) == len(names)
        # plain-half: rows only for an fp32 checkpoint (tests/plan/test_lossy.py)
        assert set(fixed) - {"tpKxR", "plain-half"} - (set() if loop else loop_only) <= set(names) and "tp2x2" in names
        assert loop or not loop_only & set(names)


def test_a_new_path_is_one_registered_type(monkeypatch):
    class Replica(Plain):
        """A second plain path under another name, marked an estimate: planned and shown like any other."""
        name = "plain-again"
        estimate = True

    monkeypatch.setattr(paths, "REGISTRY", paths.REGISTRY + (Replica,))
    r = _plan()
    again, plain = r.path("plain-again"), r.path("plain")
    assert again is not None and again.estimate and r.paths[-1] is again
    assert (again.gpu_peak_bytes, again.gpu_reserved_bytes, again.tokens_per_s) == \
        (plain.gpu_peak_bytes, plain.gpu_reserved_bytes, plain.tokens_per_s)
    assert r.recommended.path == "plain"  # measured paths first


def _plan_imports(path: Path) -> tuple[set, set]:
    """(modules of dsdoctor.plan imported at the top, those imported inside a function)."""
    tree = ast.parse(path.read_text())
    top, inner = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dsdoctor.plan"):
            names = [node.module + "." + a.name for a in node.names] + [node.module]
            found = {n for n in names if (PLAN.parent / Path(*n.split(".")[1:])).with_suffix(".py").exists()
                     or (PLAN.parent / Path(*n.split(".")[1:]) / "__init__.py").exists()}
            (top if node.col_offset == 0 else inner).update(found)
    return top, inner


def test_plan_modules_import_each_other_without_a_circle():
    graph = {}
    for f in PLAN.rglob("*.py"):
        module = "dsdoctor." + ".".join(f.relative_to(PLAN.parent).with_suffix("").parts).removesuffix(".__init__")
        top, inner = _plan_imports(f)
        assert not inner, f"{module} imports plan modules inside a function: {sorted(inner)}"
        graph[module] = {m.removesuffix(".__init__") for m in top} - {module}
    done, active = set(), []

    def visit(m):
        assert m not in active, " -> ".join(active[active.index(m):] + [m])
        if m in done:
            return
        active.append(m)
        for n in graph.get(m, ()):
            if n != "dsdoctor.plan" and not m.startswith(n + "."):  # a package imports its own modules
                visit(n)
        active.pop()
        done.add(m)

    for m in graph:
        visit(m)
