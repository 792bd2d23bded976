# Quick start:  make example   (the main job on the bundled example)
#               make test      (ruff, then the whole test suite)
# Both create .venv and install everything they need on first use (Python 3.11, no GPU needed).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dsdoctor-installed

.PHONY: example test test-fast lint clean

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

test: lint
	$(BIN)/python -m pytest -q

test-fast: lint
	$(BIN)/python -m pytest -q -m "not deepspeed"

clean:
	rm -rf $(VENV) dsdoctor-out
