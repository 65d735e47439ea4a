"""The `prorsa` command as a user runs it: subprocesses, real files, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CLUSTER = {
    "apiVersion": "prorsa.io/v1alpha1",
    "kind": "RolloutCluster",
    "metadata": {"name": "qwen3-coder", "namespace": "rl"},
    "spec": {
        "model": {"path": "/models/Qwen3-235B-A22B-FP8", "servedName": "qwen3"},
        "engine": {"gpusPerInstance": 8, "tensorParallelSize": 8},
        "gpuBudget": 64,
        "roles": {"prefill": {"min": 1, "initial": 4}, "decode": {"min": 1}},
        "capacity": {"prefillTokensPerSecond": 20000, "decodeKvTokens": 1300000},
    },
}


def prorsa(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prorsa.cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=120,
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(CLUSTER))
    return path


def write_events(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_help_lists_subcommands() -> None:
    out = prorsa("--help")
    assert out.returncode == 0
    assert "plan" in out.stdout and "bench" in out.stdout


def test_unknown_input_is_a_one_line_error_with_exit_2() -> None:
    for args in (["frobnicate"], ["plan", "--nope"]):
        out = prorsa(*args)
        assert out.returncode == 2
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_plan_prints_the_decision(tmp_path: Path, cluster: Path) -> None:
    events = [
        {
            "id": f"q{i}",
            "ts": 100.0 + 15.0 * i,
            "trajectory": f"t{i}",
            "type": "request_queued",
            "prompt_tokens": 100_000,
            "turn": 0,
        }
        for i in range(20)
    ]
    engines = [
        {
            "instance": f"qwen3-coder-engine-{i}",
            "role": "prefill" if i < 4 else "decode",
            "kvUsedTokens": 100_000,
            "kvCapacityTokens": 1_300_000,
        }
        for i in range(8)
    ]
    (tmp_path / "engines.json").write_text(json.dumps(engines))
    out = prorsa(
        "plan",
        "--cluster",
        str(cluster),
        "--events",
        str(write_events(tmp_path / "ev.ndjson", events)),
        "--engines",
        str(tmp_path / "engines.json"),
    )
    assert out.returncode == 0, out.stderr
    decision = json.loads(out.stdout)
    assert set(decision) == {
        "at",
        "mode",
        "target",
        "safetyMargin",
        "forecast",
        "capacity",
        "switches",
        "reason",
    }
    assert decision["at"] == 385.0 and decision["mode"] == "predictive"
    # 2M tokens queued over 5 minutes = 2e6 / (10 s · 20k) = 10 instances at the end:
    # a lasting shift, worth more prefill than 4.
    assert decision["forecast"]["components"]["ready"] == 2_000_000
    assert decision["target"]["prefill"] > 4, decision["reason"]
    assert decision["switches"][0]["from"] == "decode"
    # Pure tensor-parallel attention (no --enable-dp-attention): colocation may win.
    assert "prorsa plan: advice: attention is not data-parallel" in out.stderr
    # A running cluster (it has prefill engines): the operator, in Auto, makes the switches.
    first = decision["switches"][0]
    made = f"{first['instance']}: {first['from']} -> {first['to']}"
    assert f"prorsa plan: switching Auto: the operator would start {made}" in out.stderr
    # Fresh engines, all decode: the operator's bootstrap runs first, as it would live.
    for engine in engines:
        engine["role"] = "decode"
    (tmp_path / "engines.json").write_text(json.dumps(engines))
    out = prorsa(
        "plan",
        "--cluster",
        str(cluster),
        "--events",
        str(tmp_path / "ev.ndjson"),
        "--engines",
        str(tmp_path / "engines.json"),
    )
    assert out.returncode == 0, out.stderr
    assert (
        "prorsa plan: bootstrap: the operator would first start qwen3-coder-engine-0: "
        "decode -> prefill" in out.stderr
    )


def test_plan_at_a_chosen_time_and_from_stdin(cluster: Path) -> None:
    line = json.dumps(
        {
            "id": "a",
            "ts": 5.0,
            "trajectory": "t",
            "type": "request_queued",
            "prompt_tokens": 10,
            "turn": 0,
        }
    )
    out = prorsa(
        "plan", "--cluster", str(cluster), "--events", "-", "--at", "100", stdin=line + "\n"
    )
    assert out.returncode == 0, out.stderr
    decision = json.loads(out.stdout)
    assert decision["at"] == 100.0 and decision["mode"] == "reactive"  # 95 s > 3 horizons


def test_plan_names_the_bad_line_and_field(tmp_path: Path, cluster: Path) -> None:
    good = {
        "id": "a",
        "ts": 5.0,
        "trajectory": "t",
        "type": "request_queued",
        "prompt_tokens": 10,
        "turn": 0,
    }
    path = write_events(tmp_path / "ev.ndjson", [good, good | {"id": "b", "prompt_tokens": 2.5}])
    out = prorsa("plan", "--cluster", str(cluster), "--events", str(path))
    assert out.returncode == 2
    assert f"{path}:2: prompt_tokens:" in out.stderr
    assert out.stdout == ""


def test_plan_refuses_a_bad_cluster_naming_every_field(tmp_path: Path) -> None:
    """Every problem in one pass: field types, enums and the cross-field rules together."""
    bad = json.loads(json.dumps(CLUSTER))
    bad["spec"]["gpuBudget"] = 60
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    out = prorsa("plan", "--cluster", str(path), "--events", "-", "--at", "1", stdin="")
    assert out.returncode == 2
    assert f"{path}: spec.gpuBudget: 60 is not a multiple of engine.gpusPerInstance (8)" in (
        out.stderr
    )
    bad["spec"]["engine"] |= {"transferBackend": "nixl", "tensorParallelSize": "8"}
    bad["spec"]["switching"] = {"mode": "Sometimes"}
    path.write_text(yaml.safe_dump(bad))
    out = prorsa("plan", "--cluster", str(path))
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    for field in (
        "spec.engine.transferBackend",
        "spec.engine.tensorParallelSize",
        "spec.switching.mode",
        "spec.gpuBudget",
    ):
        assert any(line.startswith(f"{path}: {field}: ") for line in lines), (field, lines)
    assert lines[-1] == f"prorsa plan: error: {path}: 4 problems; nothing was planned"


def test_plan_without_events_checks_the_deployment(tmp_path: Path, cluster: Path) -> None:
    out = prorsa("plan", "--cluster", str(cluster))
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith(
        "rl/qwen3-coder: 8 instances of 8 GPUs (gpuBudget 64), starting at 4P:4D"
    )
    assert "advice: attention is not data-parallel" in out.stdout
    assert "colocated" in out.stdout
    dp = json.loads(json.dumps(CLUSTER))
    dp["spec"]["engine"]["extraArgs"] = ["--attn-dp-size", "2", "--chunked-prefill-size", "8192"]
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump(dp))
    out = prorsa("plan", "--cluster", str(path))
    assert out.returncode == 0, out.stderr
    assert "attention data-parallel over 2 ranks of tensor parallel 4" in out.stdout
    assert "not data-parallel" not in out.stdout
    assert "each rank prefills chunks of 4096 tokens" in out.stdout


def test_plan_names_a_missing_manifest(tmp_path: Path) -> None:
    out = prorsa("plan", "--cluster", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"prorsa plan: error: {tmp_path / 'nope.yaml'}: No such file or directory"
    )


def prorsa_without_lab(*args: str) -> subprocess.CompletedProcess[str]:
    """`prorsa` where the lab is not installed, as in the operator and engine images."""
    code = (
        "import sys; sys.modules['prorsa_lab'] = None; "
        "from prorsa.cli import main; sys.exit(main())"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args", [["bench", "rollout", "--quick"], ["demo", "--no-live"], ["engine-double", "--help"]]
)
def test_lab_commands_without_the_lab_say_what_to_install(args: list[str]) -> None:
    out = prorsa_without_lab(*args)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"prorsa {args[0]}: error: needs the Prorsa lab (package prorsa_lab")
    assert "pip install -e ." in line
    assert "Traceback" not in out.stderr


def test_shipped_commands_run_the_same_without_the_lab(cluster: Path, tmp_path: Path) -> None:
    out = prorsa_without_lab("--help")
    assert out.returncode == 0, out.stderr
    assert "bench" in out.stdout and "prorsa_lab not installed" in out.stdout
    queued = {"id": "q", "ts": 100.0, "trajectory": "t", "type": "request_queued"}
    events = write_events(tmp_path / "e.ndjson", [queued | {"prompt_tokens": 1000, "turn": 0}])
    args = ("plan", "--cluster", str(cluster), "--events", str(events))
    plan, with_lab = prorsa_without_lab(*args), prorsa(*args)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout) == json.loads(with_lab.stdout)
