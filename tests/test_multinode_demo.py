"""``prorsa demo --nodes-per-instance 2``: the demo on two-pod instances loses nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The multinode demo: left out by `make test-fast`.
pytestmark = pytest.mark.slow


def test_demo_on_two_node_instances_switches_whole_groups_and_loses_nothing(tmp_path: Path) -> None:
    # Which way the Controller moves in 90 s of phases depends on how fast two busy cores
    # serve them; the move back to decode on two-pod groups is pinned without timing by
    # test_multinode_e2e::test_two_node_instances_come_up_and_follow_demand_both_ways.
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "prorsa.cli", "demo", "--nodes-per-instance", "2",
         "--duration", "90", "--phase-seconds", "30", "--instances", "4", "--no-live",
         "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=420,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nodes_per_instance"] == 2
    assert summary["pods"] == 8  # four instances, a leader and a worker each
    assert summary["switch_directions"].get("decode->prefill", 0) >= 1, summary
    assert set(summary["switch_directions"]) <= {"decode->prefill", "prefill->decode"}, summary
    assert summary["switch_results"].get("succeeded", 0) >= 1, summary
    assert summary["requests_sent"] > 20
    assert summary["requests_completed"] == summary["requests_sent"]
    assert summary["requests_failed"] == 0 and summary["tokens_lost"] == 0
    assert summary["events_dropped"] == 0
    assert "8 pods, 2 per instance" in proc.stdout
