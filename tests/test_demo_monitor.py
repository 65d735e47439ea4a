"""What the demo's summary reads from the operator: figures of the rollout, not its drain."""

from __future__ import annotations

import httpx

from prorsa_lab.demo.monitor import Monitor
from prorsa_lab.demo.pod_directory import PodDirectory


async def test_the_wape_is_the_one_read_when_dispatching_stopped() -> None:
    # The Controller scores its last 60 horizons: read after the drain (no new trajectories,
    # a trickle of admissions) they describe the drain, not the rollout.
    readings = iter(
        [
            (100.0, {"prefillWape": 0.12, "decodeWape": 0.31}),
            (150.0, {"prefillWape": 0.10, "decodeWape": 0.25}),
            (210.0, {"prefillWape": 0.01, "decodeWape": 11.28}),
        ]
    )
    now = 0.0

    def clock() -> float:
        return now

    def reply(_request: httpx.Request) -> httpx.Response:
        nonlocal now
        now, accuracy = next(readings)
        return httpx.Response(200, json={"status": {"accuracy": accuracy}})

    directory = PodDirectory(api_url="http://api", namespace="rl", cluster="demo")
    monitor = Monitor(
        webhook="http://webhook",
        cluster_path="/v1/namespaces/rl/rolloutclusters/demo",
        api_url="http://api",
        namespace="rl",
        cluster="demo",
        token="t",
        agent_port=8080,
        directory=directory,
        clock=clock,
    )
    async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as http:
        monitor._http = http
        for _ in range(3):
            await monitor._status()
    assert monitor.accuracy_at(160.0) == {"prefillWape": 0.10, "decodeWape": 0.25}
    assert monitor.accuracy_at(90.0)["decodeWape"] == 11.28  # nothing before: the latest
    assert monitor.status["accuracy"]["decodeWape"] == 11.28


async def test_degraded_seconds_count_the_time_the_degraded_condition_was_true() -> None:
    def status(degraded: bool) -> dict:
        value = "True" if degraded else "False"
        return {"conditions": [{"type": "Degraded", "status": value}]}

    # (clock, Degraded): true from 10 s to 25 s, then again from 40 s to the last read.
    readings = iter([(0.0, False), (10.0, True), (20.0, True), (25.0, False), (40.0, True),
                     (42.5, True)])  # fmt: skip
    now = 0.0

    def reply(_request: httpx.Request) -> httpx.Response:
        nonlocal now
        now, degraded = next(readings)
        return httpx.Response(200, json={"status": status(degraded)})

    monitor = Monitor(
        webhook="http://webhook",
        cluster_path="/v1/namespaces/rl/rolloutclusters/demo",
        api_url="http://api",
        namespace="rl",
        cluster="demo",
        token="t",
        agent_port=8080,
        directory=PodDirectory(api_url="http://api", namespace="rl", cluster="demo"),
        clock=lambda: now,
    )
    async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as http:
        monitor._http = http
        for _ in range(6):
            await monitor._status()
    assert monitor.degraded_seconds == 15.0 + 2.5
