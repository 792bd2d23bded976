"""``--counts formula`` (no torch) against the model transformers builds on the meta device, for public
configs of the causal-LM architectures transformers ships (tests/data/arch_configs: hyperparameters from
the published config.json files)."""
import json
import subprocess
import sys

import pytest

from dsdoctor.model.formulas import BUILDERS, EXACT_TYPES, from_formula
from dsdoctor.model.spec import load_model_spec
from dsdoctor.plan.api import plan
from tests.helpers import ROOT

CONFIGS = sorted((ROOT / "tests" / "data" / "arch_configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_formula_matches_the_meta_device_model(path, tmp_path):
    pytest.importorskip("transformers")
    from dsdoctor.model.exact import exact_inventory

    raw = json.loads(path.read_text())
    (tmp_path / "config.json").write_text(path.read_text())
    spec = load_model_spec(tmp_path)
    formula = from_formula(spec)
    meta = exact_inventory(raw)
    assert meta is not None, "transformers cannot build it"
    assert formula.counted_by == "formula" and spec.model_type in EXACT_TYPES
    assert formula.num_params == meta.num_params
    assert spec.num_params == meta.num_params  # the spec (used by check) agrees too
    if spec.model_type in BUILDERS:  # the builders name every tensor as transformers does
        assert sorted((p.name, p.shape) for p in formula.params) == sorted((p.name, p.shape) for p in meta.params)
    assert sorted(formula.tied) == sorted(meta.tied)
    assert spec.tie_word_embeddings == bool(meta.tied)


def test_bloom_7b1_is_7_07b_by_formula():
    r = plan(ROOT / "tests" / "data" / "arch_configs" / "bloom-7b1.json", gpus=1, gpu_memory="80GiB",
             host_memory="256GiB", detect=False, counts="formula", gpu_name="H100")
    assert r.model["num_params"] == 7069016064 and r.model["counted_by"] == "formula"
    assert "DSD214" not in {f.code for f in r.findings}


def test_unknown_architecture_is_marked_approximate(tmp_path):
    raw = json.loads((ROOT / "tests" / "data" / "arch_configs" / "llama-2-7b.json").read_text())
    raw["model_type"] = "some_new_arch"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    r = plan(tmp_path, gpus=1, gpu_memory="80GiB", host_memory="256GiB", detect=False, counts="formula",
             gpu_name="H100")
    assert r.model["counted_by"] == "formula-approx"
    assert "DSD214" in {f.code for f in r.findings}


@pytest.mark.process
def test_formulas_import_no_torch():
    code = ("import sys; from dsdoctor.model.spec import load_model_spec; from dsdoctor.model.formulas import "
            f"from_formula; from_formula(load_model_spec({str(CONFIGS[0])!r})); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
