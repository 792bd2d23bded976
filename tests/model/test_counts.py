"""One owner per count: config.json -> ``model.formulas``, a live torch model -> ``model.exact``; the
parameter types (``model.inventory``) import neither, so the model package has no import circle."""
import ast
import json

from dsdoctor.model.exact import count_parameters
from dsdoctor.model.formulas import EXACT_TYPES, from_formula
from dsdoctor.model.spec import load_model_spec
from tests.helpers import ROOT

MODEL = ROOT / "src" / "dsdoctor" / "model"


class _Param:
    def __init__(self, numel, ds_numel=None):
        self._numel = numel
        if ds_numel is not None:
            self.ds_numel = ds_numel  # what a ZeRO-3 partitioned parameter carries: its full size

    def numel(self):
        return self._numel


class _Module:
    def __init__(self, params):
        self._params = params

    def parameters(self):
        return iter(self._params)


def test_live_count_takes_partitioned_parameters_whole():
    assert count_parameters(_Module([_Param(6), _Param(4)])) == 10
    assert count_parameters(_Module([_Param(0, ds_numel=4096), _Param(3)])) == 4099  # the shard is empty
    assert count_parameters(_Module([])) == 0


def test_spec_counts_are_the_inventory_counts_for_every_exact_architecture(tmp_path):
    for path in sorted((ROOT / "tests" / "data" / "arch_configs").glob("*.json")):
        (tmp_path / "config.json").write_text(path.read_text())
        spec = load_model_spec(tmp_path)
        inv = from_formula(spec)
        assert spec.model_type in EXACT_TYPES, path.name
        assert (spec.num_params, spec.embedding_params, spec.per_layer_params, spec.largest_param_numel) == \
            (inv.num_params, inv.numel("embedding"), inv.layer_params(0), inv.largest), path.name
        assert spec.counted_by == inv.counted_by == "formula", path.name


def test_unknown_architecture_counts_list_as_many_tensors_whatever_the_experts(tmp_path):
    """A model_type without a builder: its experts are two fused tensors per layer, so an untrusted config.json
    with thousands of experts costs ``check`` no more than one with four; the spec carries the inventory's counts
    and says they are approximate."""
    raw = json.loads((ROOT / "tests" / "data" / "arch_configs" / "llama-2-7b.json").read_text())
    sizes = {}
    for experts in (4, 16384):
        raw.update(model_type="some_new_arch", num_local_experts=experts, num_experts_per_tok=2)
        (tmp_path / "config.json").write_text(json.dumps(raw))
        spec = load_model_spec(tmp_path)
        inv = from_formula(spec)
        assert spec.counted_by == inv.counted_by == "formula-approx"
        assert (spec.num_params, spec.active_params) == (inv.num_params, inv.active_params)
        sizes[experts] = len(inv.params)
        expert = 3 * 4096 * 11008 * 32 * experts
        assert inv.num_params - inv.active_params == expert - expert * 2 // experts
    assert sizes[4] == sizes[16384]


def _model_imports(path):
    """dsdoctor.model modules that ``path`` imports anywhere (module level or inside a function)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsdoctor.model."):
            out.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("dsdoctor.model.")}
    return out


def test_model_package_has_no_import_circle():
    graph = {p.stem: _model_imports(p) for p in MODEL.glob("*.py")}
    assert graph["inventory"] == set()  # the types: both builders import them, they import no builder

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m)] == []


# A parameter counter is arithmetic on a model's width and depth fields (hidden size times intermediate size,
# vocabulary or experts) or a sum of numel over a live model's parameters. Only dsdoctor.model may hold one.
_WIDTH = {"hidden_size", "n_embd", "d_model", "hidden"}
_DEPTH = {"intermediate", "intermediate_size", "moe_intermediate_size", "ffn_dim", "n_inner", "vocab", "vocab_size",
          "num_experts", "num_local_experts", "n_routed_experts"}


def _field(node):
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and node.args and isinstance(node.args[0], ast.Constant):
        return node.args[0].value
    return None


def _fields(node, alias):
    out = set()
    for n in ast.walk(node):
        out |= {_field(n)} & (_WIDTH | _DEPTH)
        if isinstance(n, ast.Name):
            out |= alias.get(n.id, set())
    return out


def _aliases(fn) -> dict:
    """Local names bound to a width or depth field (``h, i = cfg.hidden_size, cfg.intermediate_size``)."""
    alias = {}
    for n in ast.walk(fn):
        if not isinstance(n, ast.Assign):
            continue
        target, value = n.targets[0], n.value
        pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
            else [(target, value)]
        for t, v in pairs:
            if isinstance(t, ast.Name):
                alias[t.id] = _fields(v, alias)
    return alias


def _counters(tree) -> list[str]:
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        alias = _aliases(fn)
        for n in ast.walk(fn):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult):
                a, b = _fields(n.left, alias), _fields(n.right, alias)
                if (a & _WIDTH and b & _DEPTH) or (b & _WIDTH and a & _DEPTH):
                    found.append(f"{fn.name}: {ast.unparse(n)}")
            elif isinstance(n, ast.Call) and getattr(n.func, "id", None) == "sum" and n.args:
                text = ast.unparse(n.args[0])
                if "numel" in text and "parameters()" in text:
                    found.append(f"{fn.name}: sum({text})")
    return found


def test_one_parameter_counter_in_src():
    found = {}
    for path in sorted((ROOT / "src" / "dsdoctor").rglob("*.py")):
        if path.parent == MODEL:
            continue
        hits = _counters(ast.parse(path.read_text()))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert found == {}, "count parameters through dsdoctor.model (formulas: config.json; exact: a torch model)"


def test_the_counter_test_finds_counters():
    """The scanner above finds both kinds (it must be able to fail)."""
    code = ("def f(spec, model):\n    h, i = spec.hidden_size, spec['intermediate_size']\n    x = 3 * h * i\n"
            "    return x + sum(p.numel() for p in model.parameters())\n"
            "def g(shape, batch):\n    return batch * shape.hidden\n")
    assert len(_counters(ast.parse(code))) == 2
