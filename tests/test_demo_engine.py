"""``prorsa demo --engine``: the double by default, the real SGLang on request.

The real run itself is ``tests/real_engine/test_demo_sglang.py`` (``make test-engine``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from prorsa.cli import build_parser
from prorsa.commands import demo as demo_command
from prorsa_lab.demo.run import (
    SGLANG_DURATION,
    SGLANG_MODEL,
    DemoInterrupted,
    DemoOptions,
    demo_manifest,
    run_demo,
)
from prorsa_lab.demo.trainer import HEAD_TOKENS, PROMPT_IDS, prompt_ids


def test_the_double_stays_the_default() -> None:
    args = build_parser().parse_args(["demo"])
    assert args.engine == "double" and args.instances is None
    assert DemoOptions().engine == "double"


def test_each_engine_has_its_own_defaults() -> None:
    """The real engines run 150 s (three 50 s phases, so that the three runs of `make
    demo-sglang` fit in 15 minutes) on three instances with 3 trajectories each."""
    double = demo_command.options(build_parser().parse_args(["demo"]))
    assert (double.duration, double.instances, double.trajectories) == (240.0, 4, 24)
    real = demo_command.options(build_parser().parse_args(["demo", "--engine", "sglang"]))
    assert (real.duration, real.instances, real.trajectories) == (SGLANG_DURATION, 3, 9)
    assert real.phases.spans(real.duration) == [
        (0.0, 50.0, "tools"),
        (50.0, 100.0, "reasoning"),
        (100.0, 150.0, "tools"),
    ]
    assert real.model == SGLANG_MODEL
    given = ["demo", "--engine", "sglang", "--duration", "60", "--trajectories", "3"]
    short = demo_command.options(build_parser().parse_args(given))
    assert (short.duration, short.trajectories) == (60.0, 3)


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


def test_real_engine_prompts_share_no_prefix_between_calls() -> None:
    # Every call's ids branch from every other call's within its first tokens, so a real
    # prefill engine's radix cache cannot serve one call's prompt from another's, and a
    # call's ids are the same in every run (the switching and the static run send alike).
    calls = [f"traj-{t}@{turn}" for t in range(60) for turn in range(10)]
    heads = {tuple(prompt_ids(rid, 2_000)[:HEAD_TOKENS]) for rid in calls}
    assert len(heads) == len(calls)
    ids = prompt_ids("traj-3@2", 2_000)
    assert ids == prompt_ids("traj-3@2", 2_000) and len(ids) == 2_000
    assert all(20 <= i < 250 for i in ids)
    assert ids[HEAD_TOKENS:] == [PROMPT_IDS[i % len(PROMPT_IDS)] for i in range(3, 2_000)]
    assert len(prompt_ids("traj-0@0", 2)) == 2
