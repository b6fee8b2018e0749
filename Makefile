# One command sets up and runs each job on a fresh machine (Python 3.10+).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is pinned here, in the same pip command as everything that depends on it,
# so pip never pulls a multi-GB CUDA build. pyproject.toml keeps a range for GPU users.
TORCH_PIN ?= torch==2.13.0
RUN_DIR ?= runs/demo

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)" -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m tiderl.cli demo --config configs/kg_sao_tiny.yaml --run-dir $(RUN_DIR)

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache
