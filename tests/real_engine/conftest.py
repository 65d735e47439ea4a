"""Fixtures of the real-engine suite: SGLang 0.5.23 on this CPU behind the real smg.

Every test here is marked ``real_engine``; ``make test`` leaves them out (``-m "not
real_engine"`` in ``pyproject.toml``) and ``make test-engine`` runs them after building
the engine environment (``scripts/engine-env.sh``). Without that environment they skip
with the command to run, unless ``PRORSA_REQUIRE_REAL_ENGINE=1`` (CI), where a missing
environment fails them instead: CI must not pass by skipping. The helpers the modules
share are in ``engine_helpers.py``.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from prorsa_lab.sglang_cpu.environment import (
    ENGINE_VENV,
    MODEL_DIR,
    MODEL_SCRIPT,
    CpuEngineEnv,
    EngineEnvMissing,
)

from .engine_helpers import ROOT

REQUIRE = os.environ.get("PRORSA_REQUIRE_REAL_ENGINE", "") == "1"


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
