# polyserve: `make run` starts the host, `make test` runs the tests. Both install what
# is missing into .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run build examples test lint bench settings-table clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(STAMP)

run: install
	$(BIN)/gunicorn -c gunicorn.conf.py

# The seed's `make build`: build what the examples need, then start the host.
build: examples run

examples: install
	$(BIN)/python examples/python-onnx-tiny/train.py

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

# Benchmarks never run in `make test`; tests/test_bench.py only checks they run. Writes
# bench/results/<date>.json, its chart, and BENCHMARKS.md (about 5 minutes).
bench: install
	@command -v wrk >/dev/null || { echo "wrk is missing: install it with 'apt-get install wrk' (Debian/Ubuntu) or your package manager"; exit 1; }
	$(BIN)/python bench/run.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

settings-table: install
	$(BIN)/python -m polyserve.settings --readme

clean:
	rm -rf $(VENV) polyserve-data .pytest_cache .ruff_cache *.egg-info
