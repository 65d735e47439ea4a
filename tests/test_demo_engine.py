"""``prorsa demo --engine``: the double by default, the real SGLang on request.

The real run itself is ``tests/real_engine/test_demo_sglang.py`` (``make test-engine``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from prorsa.cli import build_parser
from prorsa_lab.demo.run import (
    SGLANG_MODEL,
    DemoInterrupted,
    DemoOptions,
    demo_manifest,
    run_demo,
)


def test_the_double_stays_the_default() -> None:
    args = build_parser().parse_args(["demo"])
    assert args.engine == "double" and args.instances is None
    assert DemoOptions().engine == "double"


def test_sglang_runs_at_most_three_one_cpu_instances() -> None:
    with pytest.raises(ValueError, match="at most 3 instances with --engine sglang"):
        DemoOptions(engine="sglang", instances=4)
    with pytest.raises(ValueError, match="one-node instances"):
        DemoOptions(engine="sglang", instances=2, nodes_per_instance=2)
    with pytest.raises(ValueError, match="unknown engine 'vllm'"):
        DemoOptions(engine="vllm")
    options = DemoOptions(engine="sglang", instances=3, model=SGLANG_MODEL)
    manifest = demo_manifest(options, model_path="/m/tiny")
    spec = manifest["spec"]
    assert spec["gpuBudget"] == 3 and spec["engine"]["gpusPerInstance"] == 1
    assert spec["model"] == {"path": "/m/tiny", "servedName": "tiny"}
    assert {"name": "PRORSA_DISABLE_HICACHE", "value": "1"} in spec["engine"]["env"]
    assert spec["capacity"]["decodeKvTokens"] == 16_384


def test_without_the_engine_environment_it_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a directory without .venv-engine
    monkeypatch.setattr("prorsa_lab.sglang_cpu.environment._checkout", lambda: tmp_path)
    options = DemoOptions(engine="sglang", instances=2, out=tmp_path / "out", live=False)
    with pytest.raises(DemoInterrupted, match=r"scripts/engine-env.sh. or .make engine-env"):
        asyncio.run(run_demo(options))


def test_a_worktree_uses_another_checkouts_engine_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PRORSA_ENGINE_ROOT: that checkout's .venv-engine and tiny model, this one's stand-ins."""
    from prorsa_lab.sglang_cpu.environment import (
        ENGINE_VENV,
        MODEL_DIR,
        STANDINS,
        CpuEngineEnv,
        EngineEnvMissing,
    )

    main, worktree = tmp_path / "main", tmp_path / "worktree"
    (main / ENGINE_VENV / "bin").mkdir(parents=True)
    (main / ENGINE_VENV / "bin" / "python").touch()
    (main / ENGINE_VENV / ".complete").touch()
    (main / MODEL_DIR).mkdir(parents=True)
    (main / MODEL_DIR / "config.json").write_text("{}")
    (worktree / STANDINS).mkdir(parents=True)
    (worktree / STANDINS / "sitecustomize.py").touch()
    with pytest.raises(EngineEnvMissing, match=r"\.venv-engine \(complete\)"):
        CpuEngineEnv.find(worktree)
    monkeypatch.setenv("PRORSA_ENGINE_ROOT", str(main))
    found = CpuEngineEnv.find(worktree)
    assert found.python == main / ENGINE_VENV / "bin" / "python"
    assert found.model == main / MODEL_DIR and found.standins == worktree / STANDINS
