# Quick start:  make example   (the main job on the bundled example)
#               make test      (ruff, then the whole test suite)
# Both create .venv and install everything they need on first use (Python 3.11, no GPU needed).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dsdoctor-installed

.PHONY: example test test-fast lint clean browser

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q -e .
	touch $(STAMP)

example: $(STAMP)
	@# exit 1 means findings (the bundled example has them on purpose); 2 would be a real failure
	$(BIN)/dsdoctor diagnose --out dsdoctor-out --force || test $$? -eq 1

lint: $(STAMP)
	$(BIN)/ruff check src tests bench scripts

# The HTML report's test opens it in a real headless browser: Debian's chromium, installed once (nothing to do
# when present). Installing is best effort and never fails `make test`: without root or passwordless sudo, apt-get,
# or a reachable mirror, the browser test skips and says why (DSDOCTOR_REQUIRE_BROWSER=1 makes it fail instead).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { command -v apt-get >/dev/null 2>&1 && echo "installing chromium (the HTML report's browser test)" && \
	    $(SUDO) timeout 240 apt-get update -q && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q chromium; \
	  } || echo "chromium could not be installed here: the browser test will skip (make test goes on)"

# make test: the whole suite, in parallel (pytest-xdist, one worker per core of a 2-core CI machine, handed one
# test at a time, the slow ones first: tests/conftest.py), then the tests marked serial, alone.
# make test-fast: only the tests that start no process and run no real model (markers in pyproject.toml; process
# enforced by tests/conftest.py); make test runs every test, these included.
# PYTEST_ARGS adds pytest options to both, e.g. make test PYTEST_ARGS=--durations=25
JOBS ?= 2
PYTEST := $(BIN)/python -m pytest -q $(PYTEST_ARGS)
PARALLEL := -n $(JOBS) --maxschedchunk 1

test: lint browser
	$(PYTEST) $(PARALLEL) -m "not serial"
	$(PYTEST) -m serial || test $$? -eq 5  # 5: no test is marked serial

test-fast: lint
	$(PYTEST) $(PARALLEL) -m "not process and not deepspeed and not slow"

clean:
	rm -rf $(VENV) dsdoctor-out

# ---- GPU benchmarks (numbers in BENCHMARKS.md; each bench/<name>/README.md says what it measures) ----------
# Here (a machine with pip access):   make gpu-wheels       DeepSpeed 0.19.8 + its pure-Python needs as wheels in .whl/
# On the GPU machine, .whl/ carried over, one line per bench (OUT: where the raw outputs go):
#   make gpu-bench-plan OUT=$OUT      (likewise gpu-bench-edge, gpu-bench-loading, gpu-bench-trace, gpu-bench-trace-ab,
#                                      gpu-bench-compare, gpu-bench-config, gpu-bench-rlloop [GPUS=1|2], gpu-bench-rljob)
# The GPU machine's image has torch, transformers, accelerate and safetensors; the wheels go to $(GPU_SITE).
WHL ?= .whl
GPU_SITE ?= /tmp/site
OUT ?= out
GPU_ENV := PYTHONPATH=$(GPU_SITE):$(CURDIR)/src
WHEEL_PY ?= 3.12

GPUS ?= 1

.PHONY: gpu-wheels gpu-site gpu-bench-plan gpu-bench-edge bench-edge-tiny gpu-bench-loading gpu-bench-trace \
	gpu-bench-trace-ab gpu-bench-compare gpu-bench-config gpu-bench-rlloop gpu-bench-rljob gpu-bench-counters

gpu-wheels:
	mkdir -p $(WHL) $(WHL)/.src
	$(PYTHON) -m pip download -q --no-deps deepspeed==0.19.8 -d $(WHL)/.src
	DS_BUILD_OPS=0 $(PYTHON) -m pip wheel -q --no-deps $(WHL)/.src/deepspeed-0.19.8.tar.gz -w $(WHL)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(WHEEL_PY) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(WHL) \
	  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.5
	rm -rf $(WHL)/.src
	ls -1 $(WHL)

gpu-site:
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) $(WHL)/*.whl

gpu-bench-plan: gpu-site
	$(GPU_ENV) python3 bench/plan/run.py $(OUT)/plan --budget-s 330

gpu-bench-edge: gpu-site  # one GPU: runs capped just above and just below plan's line (bench/plan/edge_gpu.py)
	$(GPU_ENV) python3 bench/plan/edge_gpu.py $(OUT)/edge --budget-s 330 --lanes 3

bench-edge-tiny: $(STAMP)  # the same script on tiny models, on the CPU here (no caps): does it run?
	$(BIN)/python bench/plan/edge_gpu.py /tmp/dsdoctor-edge-tiny --tiny --budget-s 200 --lanes 2

gpu-bench-loading: gpu-site
	mkdir -p $(OUT)
	$(GPU_ENV) python3 bench/plan/loading_gpu.py /tmp/dsd-loading > $(OUT)/loading.jsonl

gpu-bench-trace: gpu-site
	$(GPU_ENV) python3 bench/trace/run_gpu.py $(OUT)/trace --budget 420

gpu-bench-trace-ab: gpu-site
	$(GPU_ENV) python3 bench/trace/run_gpu.py $(OUT)/trace --budget 340 --steps ab-2gpu,traced

gpu-bench-counters:  # no DeepSpeed needed: torch (CUDA) and transformers from the image
	mkdir -p $(OUT)
	PYTHONPATH=$(CURDIR)/src python3 bench/trace/counters_gpu.py --pairs 5 | tee $(OUT)/counters.json

gpu-bench-compare: gpu-site
	$(GPU_ENV) bash bench/compare/run_gpu.sh $(OUT)/compare

gpu-bench-config: gpu-site
	$(GPU_ENV) python3 bench/config/run.py $(OUT)/config --gpus 2 --timeout 160

gpu-bench-rlloop: gpu-site
	$(GPU_ENV) python3 -m torch.distributed.run --nproc_per_node $(GPUS) bench/rlloop/run_gpu.py --out $(OUT)/rlloop-$(GPUS)gpu

gpu-bench-rljob: gpu-site
	$(GPU_ENV) python3 bench/rlloop/job_gpu.py --out $(OUT)/rljob
