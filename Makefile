# The README's commands. `make test` and `make demo` build .venv themselves when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# One stamp per install: `make demo` installs the `demo` extra only (no test tooling);
# `make test` installs the `test` extra (a superset).
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test

.PHONY: test test-fast lint bench demo venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(TEST_STAMP)

$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $(DEMO_STAMP)

venv: $(TEST_STAMP)

# ruff, mypy (strict, with the pydantic plugin: [tool.mypy]), then the import-layer
# contracts of pyproject.toml ([tool.importlinter]).
lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest -q

# The suite without the tests that run the whole operator on loopback (marked `slow` in
# tests/conftest.py): what to run while working; `make test` runs everything.
test-fast: lint
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(DEMO_STAMP)
	$(BIN)/prorsa bench all

# The whole system on this machine (no cluster, no GPU); e.g. DEMO_ARGS="--task math --no-live".
DEMO_ARGS ?=
demo: $(DEMO_STAMP)
	$(BIN)/prorsa demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis bench-out
