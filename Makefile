# polyserve: `make run` starts the host, `make test` runs the tests. Each installs what it
# needs into .venv first: the host's dependencies for run, the dev extra for test/bench.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run autoscale build examples test test-fast lint bench gpu-check settings-table token clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# One stamp per extra: editing pyproject.toml reinstalls.
$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[$*]'
	touch $@

$(VENV)/.installed-host: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

run: $(VENV)/.installed-host
	$(BIN)/gunicorn -c gunicorn.conf.py

# The fleet's autoscaler (docs/autoscale.md); it needs POLYSERVE_DATABASE_URL.
autoscale: $(VENV)/.installed-host
	$(BIN)/polyserve autoscale

# The seed's `make build`: build what the examples need, then start the host.
build: examples run

examples: $(VENV)/.installed-build
	$(BIN)/python examples/python-onnx-tiny/train.py

# Test processes (pytest-xdist): most of a host test is waiting on its host, so three
# share two cores well. --dist loadfile keeps a module's tests, and the one host its
# fixture starts, in one process.
TEST_JOBS ?= 3

test: lint
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile

# The inner loop: lint, and every test that starts no gunicorn host.
test-fast: lint
	$(BIN)/python -m pytest -m "not gunicorn" -q -n $(TEST_JOBS) --dist loadfile

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Benchmarks never run in `make test`; tests/test_bench.py only checks they run. Writes
# bench/results/<date>.json, its chart, and BENCHMARKS.md (about 13 minutes).
bench: $(VENV)/.installed-dev
	@command -v wrk >/dev/null || { echo "wrk is missing: install it with 'apt-get install wrk' (Debian/Ubuntu) or your package manager"; exit 1; }
	$(BIN)/python bench/run.py

# On a machine with an NVIDIA GPU (docs/gpu.md): a GPU host and a CPU host side by side,
# an ONNX model space and torch spaces on each; prints what ran where, the device memory
# each added and gave back, and GPU against CPU latency. Then the tests marked `gpu`
# (tests/gpu/) and the GPU host's tests that need none.
# Runs with the venv's python, else the machine's python3 (PYTHONPATH holding the host's
# packages and this checkout, as ../shared/device/README.md sets it up).
GPU_PYTHON = $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

gpu-check:
	$(GPU_PYTHON) bench/gpu_check.py
	$(GPU_PYTHON) -m pytest -q -rs -p no:cacheprovider tests/gpu tests/hosts/test_gpu_host.py \
		tests/serve/test_gpu.py tests/serve/test_device_memory.py

# The settings tables of docs/settings.md and docs/autoscale.md, from their declarations.
settings-table: $(VENV)/.installed-host
	$(BIN)/python -m polyserve.settings --readme
	$(BIN)/python -m polyserve.autoscale.config --docs

# A fresh admin token (give it to deployers) and the POLYSERVE_DEPLOY_TOKEN_SHA256=... line
# to start the host with: the host then never holds the token itself.
token: $(VENV)/.installed-host
	@$(BIN)/python -m polyserve.control.auth admin-token

clean:
	rm -rf $(VENV) polyserve-data .pytest_cache .ruff_cache *.egg-info
