"""``prorsa demo --engine sglang`` as a user runs it (``make demo-sglang``): three real
SGLang engines on this CPU, the operator, smg and the demo trainer; the summary names the
engine and nothing is lost. With ``--record``, the run's recording is replayed in the
simulator on the manifest's profiled capacity and set beside what the real engines took
(how close it came is a figure for docs/benchmarks.md, not an assertion: it depends on
this machine's load)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .engine_helpers import ROOT

pytestmark = pytest.mark.real_engine


def test_the_demo_runs_on_the_real_engine(engine_env, engines_stopped, tmp_path):
    del engine_env  # built (or the test skipped / failed with the command to run)
    del engines_stopped  # the shared cluster's engines make room for the demo's
    out = tmp_path / "demo"
    command = [sys.executable, "-m", "prorsa.cli", "demo", "--engine", "sglang"]
    command += ["--duration", "60", "--no-live", "--out", str(out)]
    command += ["--record", str(out / "recorded")]
    # One live trajectory per engine, not the default three: with 9 the engines' KV
    # transfers (mooncake over TCP) were now and then refused at load 11-14 ("TCP lane
    # queue-full"), and the trainer's resumes of those calls ran out, in static runs as in
    # switching ones (docs/demo.md, "Runs of the real-engine demo"); this test checks that
    # the demo runs and loses nothing on the real engine, not how it moves the split (20 s
    # phases are too short for that on two cores).
    command += ["--trajectories", "3"]
    # No static run: it would load three more engines (minutes in CI); the comparison
    # against a static split is tests/test_demo.py's, on the engine doubles.
    command += ["--baseline", "none"]
    proc = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "engine        sglang 0.5.23" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == {"name": "sglang", "version": "0.5.23"}
    assert summary["instances"] == 3 and summary["pods"] == 3
    assert summary["requests_sent"] > 0
    assert summary["requests_completed"] == summary["requests_sent"]
    assert summary["requests_failed"] == 0 and summary["tokens_lost"] == 0
    assert summary["events_dropped"] == 0
    replay = summary["replay"]
    if summary["trajectories_finished"] == 0:
        assert replay is None  # nothing to time
        return
    check = replay["switching"]
    assert check["policy"] == "prorsa" and check["count"] == summary["trajectories_finished"]
    assert check["error"] is None and check["predictedSeconds"] > 0, check
    print("replay of the real-engine run:", json.dumps(check))
