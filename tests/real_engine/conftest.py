"""Fixtures of the real-engine suite: SGLang 0.5.23 on this CPU behind the real smg.

Every test here is marked ``real_engine``; ``make test`` leaves them out (``-m "not
real_engine"`` in ``pyproject.toml``) and ``make test-engine`` runs them after building
the engine environment (``scripts/engine-env.sh``). Without that environment they skip
with the command to run, unless ``PRORSA_REQUIRE_REAL_ENGINE=1`` (CI), where a missing
environment fails them instead: CI must not pass by skipping.

Engines are the cost here (minutes to start, 3.5 GB each, at most three at once): the
agent's and the operator's tests share one cluster of three (``shared_cluster.py``), in the
order :data:`MODULE_ORDER` sets, and it is stopped before the demo starts its own.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from prorsa_lab.doubles.stack import Stack
from prorsa_lab.sglang_cpu.environment import (
    ENGINE_VENV,
    MODEL_DIR,
    MODEL_SCRIPT,
    CpuEngineEnv,
    EngineEnvMissing,
)

from .engine_helpers import ROOT
from .shared_cluster import SharedCluster

REQUIRE = os.environ.get("PRORSA_REQUIRE_REAL_ENGINE", "") == "1"

MODULE_ORDER = (
    "test_agent_sglang",  # read-only checks on the shared cluster as it comes up (1P:2D)
    "test_operator_sglang",  # switches and failure cases on it
    "test_sglang_validation",  # no engine (the shared cluster stops first)
    "test_profile_sglang",  # one engine of its own, without a PD role
    "test_prefill_reentry",  # two of its own behind smg
    "test_demo_sglang",  # its own three engines
    "test_launched_as_prefill",  # the study (not in make test-engine): its own three
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run this directory's modules in :data:`MODULE_ORDER`, leaving every other item (and
    the order within a module) as collected."""
    here = os.path.dirname(__file__)
    slots = [i for i, item in enumerate(items) if str(item.path).startswith(here + os.sep)]

    def rank(item: pytest.Item) -> int:
        name = item.path.stem
        return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)

    ordered = sorted((items[i] for i in slots), key=rank)
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item


def _find_env() -> CpuEngineEnv:
    try:
        return CpuEngineEnv.find(ROOT)
    except EngineEnvMissing:
        python = ROOT / ENGINE_VENV / "bin" / "python"
        if not (ROOT / ENGINE_VENV / ".complete").exists():
            raise
        # The environment is there but not the model: build it (about 15 s, no download).
        subprocess.run([str(python), str(ROOT / MODEL_SCRIPT), str(ROOT / MODEL_DIR)], check=True)
        return CpuEngineEnv.find(ROOT)


@pytest.fixture(scope="session")
def engine_env() -> CpuEngineEnv:
    try:
        return _find_env()
    except EngineEnvMissing as exc:
        if REQUIRE:
            pytest.fail(f"PRORSA_REQUIRE_REAL_ENGINE=1 but {exc}")
        pytest.skip(str(exc))


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def shared(engine_env: CpuEngineEnv, tmp_path_factory) -> AsyncIterator[SharedCluster]:
    holder = SharedCluster(engine_env=engine_env, log_dir=tmp_path_factory.mktemp("shared"))
    try:
        yield holder
    finally:
        await holder.close()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def cluster(shared: SharedCluster) -> Stack:
    """The shared cluster of three real engines, up and converged (1P:2D, smg agreeing)."""
    return await shared.get()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engines_stopped(shared: SharedCluster) -> None:
    """No engine of the shared cluster left running (from the first test that asks on:
    :data:`MODULE_ORDER` puts those after the cluster's)."""
    await shared.close()
