"""``prorsa bench scale`` at a tiny size (issue 36): two operator replicas, two clusters of
four engine pods, a trainer's load and a storm. What the bench prints is what
docs/benchmarks.md publishes at full size, so its JSON must have every figure, and the
storm must converge with no engine switched twice and none left draining."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prorsa_lab.bench.scale_bench import Sizes, measure

# `prorsa bench scale` at a tiny size: two replicas, two clusters: left out by `make test-fast`.
pytestmark = pytest.mark.slow


async def test_the_scale_bench_reports_every_figure_and_its_storm_converges(
    tmp_path: Path,
) -> None:
    sizes = Sizes(
        clusters=2,
        instances=4,
        trajectories=200,
        horizon=1.0,
        steady=5.0,
        storm_moves=1,
        switch_seconds=0.3,
        storm_timeout=180.0,
    )
    result = json.loads(json.dumps(await measure(sizes, tmp_path)))
    assert [c["name"] for c in result["clusters"]] == ["scale-0", "scale-1"]
    assert [c["task"] for c in result["clusters"]] == ["coding", "general"]
    for cluster in result["clusters"]:
        assert cluster["ticks"] >= 3, cluster
        assert 0 < cluster["tickP99Ms"] <= cluster["tickP99BucketMs"], cluster
        assert cluster["liveTrajectories"] == 200, cluster
        assert cluster["stormSeconds"] is not None, cluster
    storm = result["storm"]
    assert storm["converged"] is True, storm
    assert storm["doubleSwitches"] == 0, storm
    assert storm["leftDraining"] == 0, storm
    # Every cluster moved at least one engine.
    assert storm["switchesStarted"] >= 2 and storm["enginesFlipped"] >= 2, storm
    assert storm["seconds"] > 0
    assert result["apiCallsPerTick"] > 0
    assert result["apiCallsPerSwitch"] > 0
    assert result["apiCalls"]["storm"]["switches"] >= 2
    assert result["agentPollsPerSecond"] > 0
    assert result["webhookBatchP99Ms"] > 0
    assert result["throttled"] == 0
    assert 0 < result["rssBytes"] < 1 << 30
    assert result["openFiles"] > 0
    trainer = result["trainer"]
    assert trainer["dropped"] == 0 and trainer["sentEventsPerSecond"] > 0, trainer
    assert result["machine"]["cpus"] >= 1 and len(result["machine"]["loadAverageStart"]) == 3
