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


def test_unknown_architecture_spec_counts_in_constant_time(tmp_path):
    """A model_type without a builder: the spec's closed form lists no tensors, so an untrusted config.json
    with thousands of experts costs ``check`` nothing; it equals the Llama-style inventory without biases."""
    raw = json.loads((ROOT / "tests" / "data" / "arch_configs" / "llama-2-7b.json").read_text())
    raw.update(model_type="some_new_arch", num_local_experts=4)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec = load_model_spec(tmp_path)
    inv = from_formula(spec)
    assert spec.counted_by == "formula" and inv.counted_by == "formula-approx"
    assert spec.num_params == inv.num_params and spec.per_layer_params == inv.layer_params(0)


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
