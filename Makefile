# The README's commands. `make test` and `make demo` build .venv themselves when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# One stamp per install: `make demo` installs the `demo` extra only (no test tooling);
# `make test` installs the `test` extra (a superset).
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test

.PHONY: test test-fast lint lint-quick typecheck pytest-fast bench demo venv clean engine-env \
	test-engine engine-study demo-sglang trainer-envs test-trainers

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

# ruff, the import-layer contracts of pyproject.toml ([tool.importlinter]), then mypy
# (strict, with the pydantic plugin: [tool.mypy]).
lint: lint-quick typecheck

# The checks that take seconds.
lint-quick: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# Incremental (.mypy_cache): a run after a small change re-checks what it touched.
typecheck: $(TEST_STAMP)
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

# What to run while working: every check of `make lint`, and the suite without the tests
# that run the whole operator on loopback (each marks itself `slow`; tests/conftest.py
# fails one that does not); `make test` runs everything. mypy runs beside the tests (one
# process each, two cores), not before them. The -m replaces pyproject's, so it names
# real_engine again (`make test-engine` runs those).
test-fast: lint-quick
	$(MAKE) --no-print-directory -j2 typecheck pytest-fast

pytest-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not real_engine"

bench: $(DEMO_STAMP)
	$(BIN)/prorsa bench all

# The whole system on this machine (no cluster, no GPU); e.g. DEMO_ARGS="--task math --no-live".
DEMO_ARGS ?=
demo: $(DEMO_STAMP)
	$(BIN)/prorsa demo $(DEMO_ARGS)

# The real SGLang 0.5.23 on this CPU: .venv-engine (sglang, mooncake's non-CUDA transfer
# engine, smg; about 10 minutes and 11 GB the first time, a no-op once built) and the tiny
# model; apt-installs libibverbs1 when missing (docs/testing.md).
engine-env:
	scripts/engine-env.sh

# tests/real_engine/ (pytest marker real_engine, left out of `make test`): the agent, the
# operator, its failure cases, SGLang's own flag validation and the demo against real engines
# behind the real smg (one shared cluster of three engines, then the demo's three).
test-engine: engine-env $(TEST_STAMP)
	PRORSA_REQUIRE_REAL_ENGINE=1 $(BIN)/python -m pytest -q --durations=0 \
		-m "real_engine and not study" tests/real_engine

# The study behind docs/sglang-role-switch.md's "Launched as prefill" and SGLang's own flip
# times (tests/real_engine/test_launched_as_prefill.py; three more engines).
engine-study: engine-env $(TEST_STAMP)
	PRORSA_REQUIRE_REAL_ENGINE=1 $(BIN)/python -m pytest -q -s -m study tests/real_engine

# The trainers' examples against the real packages (docs/trainers.md): .venv-verl and
# .venv-areal, one each (their pins conflict; several GB each, a no-op once built), then
# tests/test_verl_real.py and tests/test_areal_real.py, required to run, not skip.
trainer-envs:
	scripts/trainer-env.sh verl
	scripts/trainer-env.sh areal

test-trainers: trainer-envs
	PRORSA_REQUIRE_TRAINERS=1 .venv-verl/bin/python -m pytest -q tests/test_verl_real.py
	PRORSA_REQUIRE_TRAINERS=1 .venv-areal/bin/python -m pytest -q tests/test_areal_real.py

# `make demo` with real SGLang engines on this CPU instead of engine doubles. In a git
# worktree, PRORSA_ENGINE_ROOT=<main checkout> uses that checkout's .venv-engine and tiny
# model instead of building them again (prorsa_lab/sglang_cpu/environment.py).
demo-sglang: $(if $(PRORSA_ENGINE_ROOT),,engine-env) $(DEMO_STAMP)
	$(BIN)/prorsa demo --engine sglang $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis bench-out
