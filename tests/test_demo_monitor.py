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
