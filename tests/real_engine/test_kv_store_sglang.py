"""The engine image's KV store backend inside SGLang 0.5.23 (no engine started, ~20 s).

``kv_backend_probe.py`` runs in ``.venv-engine``: two backends built as SGLang's scheduler
builds them (``StorageBackendFactory.create_backend("dynamic", ...)`` with the extra-config
the agent renders) share one directory, as two engines of a cluster; pages are keyed by
SGLang's own storage hash chain with the request's ``extra_key``. The stale-page case comes
first: a page written under one weight version is never found under the next.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from prorsa_lab.sglang_cpu.environment import CpuEngineEnv

from .engine_helpers import ROOT

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def probe(engine_env: CpuEngineEnv, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    shared = tmp_path_factory.mktemp("kv-store")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "engine_image"), str(ROOT / "sdk")]),
    }
    done = subprocess.run(
        [str(engine_env.python), str(Path(__file__).with_name("kv_backend_probe.py")), str(shared)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_page_of_old_weights_is_never_served_after_an_update(probe: dict[str, Any]) -> None:
    assert probe["class"] == "SharedKVStore"
    assert probe["written"] == probe["pages"] == 4
    assert probe["hit_same_version_other_engine"] == 4  # same weights: another engine hits
    assert probe["read_back_equal"]
    assert probe["hit_next_version"] == 0  # the next weight version: every page misses
    assert probe["hit_no_extra_key"] == 0


def test_a_flip_keeps_every_engines_entries(probe: dict[str, Any]) -> None:
    assert probe["entries_before_flip"] == 6  # engine a's four pages, engine b's two
    assert probe["entries_after_flip"] == probe["entries_before_flip"]
    assert probe["hit_after_flip"] == 4
    assert probe["other_engine_hit_after_flip"] == 2
    # SGLang's own file backend, cleared the same way, wipes the shared directory: the
    # hazard this backend exists for (docs/sglang-role-switch.md §3).
    assert probe["entries_after_builtin_clear"] == 0
