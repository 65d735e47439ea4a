"""`prorsa bench ingest` runs end to end (a tiny run; figures are printed, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import make_spec

from prorsa.core.controller import Controller
from prorsa_contract.events import parse_events
from prorsa_lab.bench.ingest_bench import workload


def test_workload_is_a_valid_lifecycle_stream() -> None:
    items = list(workload(3000, prefix="w-", live=50))
    events = [
        {"id": f"w{i}", "ts": float(i), "trajectory": traj, "type": kind, **fields}
        for i, (kind, traj, fields) in enumerate(items)
    ]
    controller = Controller(make_spec())
    result = controller.observe(parse_events(events))
    assert result.applied == 3000
    assert result.anomalies == 0  # every trajectory's events come in lifecycle order
    assert 0 < sum(controller.live_trajectories().values()) <= 50


def test_bench_runs_and_reports_every_figure() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "prorsa.cli", "bench", "ingest", "--events", "4000",
         "--seconds", "0.5", "--rate", "4000", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    figures = json.loads(r.stdout)
    assert figures["throughput"]["events"] == 4000 and figures["throughput"]["dropped"] == 0
    assert figures["throughput"]["eventsPerSecond"] > 0
    assert figures["serverEventsPerCpuSecond"] > 0
    assert figures["latency"]["non200"] == 0 and figures["latency"]["batches"] == 4
    assert figures["latency"]["p99Ms"] >= figures["latency"]["p50Ms"] > 0
