"""The Ready condition says the cluster serves: what a trainer waits for before it starts.

Every engine starts as decode and smg refuses every request while it lists no prefill
worker (tests/test_smg_router_no_prefill.py), so a fresh cluster whose engines all answer
is not Ready until the bootstrap has a prefill engine serving: reason ``Bootstrapping``.
"""

from __future__ import annotations

import datetime
from types import SimpleNamespace
from typing import Any, cast

import pytest
from conftest import make_spec

from prorsa.clusters import WebhookCluster
from prorsa.control.metrics import OperatorMetrics
from prorsa.control.reconcile import Groups
from prorsa.control.status import StatusWriter
from prorsa.core.controller import Controller
from prorsa.core.readiness import readiness
from prorsa.core.types import TickInput
from prorsa.k8s.kube import Kube
from prorsa_contract.agent_api import EngineState

SPEC = make_spec(engine={"gpusPerInstance": 16}, roles={"prefill": {"initial": 2}})  # 4 engines
NAMES = [f"c-engine-{i}" for i in range(4)]
CREATED = datetime.datetime.now(datetime.UTC).isoformat()


class _Kube:
    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []

    async def patch_status(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        self.statuses.append(body)


async def _no_event(kind: str, reason: str, message: str) -> None:
    return None


def states(*roles: str) -> dict[str, EngineState]:
    """One state per engine: ``prefill``, ``decode``, ``switching`` or ``-`` (no answer)."""
    out = {}
    for name, role in zip(NAMES, roles, strict=True):
        if role == "-":
            continue
        switching = role == "switching"
        body = {"instance": name, "role": "decode" if switching else role, "switching": switching}
        out[name] = EngineState.model_validate(body)
    return out


class Cluster:
    def __init__(self) -> None:
        self.kube = _Kube()
        handle = SimpleNamespace(epoch=1, limit_hits=0)
        self.writer = StatusWriter(
            namespace="rl",
            name="c",
            kube=cast(Kube, self.kube),
            metrics=OperatorMetrics(),
            handle=cast(WebhookCluster, handle),
            post_event=_no_event,
        )
        self.controller = Controller(SPEC)
        self.now = 0.0

    async def tick(self, *roles: str) -> tuple[dict[str, str], str]:
        """The Ready condition and the phase this tick writes."""
        seen = states(*roles)
        self.now += 10.0
        decision = self.controller.tick(TickInput(now=self.now, engines=tuple(seen.values())))
        pods = [
            {"metadata": {"name": n, "uid": n, "creationTimestamp": CREATED}, "status": {}}
            for n in NAMES
        ]
        await self.writer.write(
            decision,
            pods,
            seen,
            unanswered={},
            spec=SPEC,
            generation=1,
            history=[],
            groups=Groups(nodes_per_instance=1, pods=4, managed_by="prorsa"),
        )
        status = self.kube.statuses[-1]
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        return ready, status["phase"]


async def test_ready_waits_for_the_bootstrap_to_serve_prefill() -> None:
    cluster = Cluster()
    ready, phase = await cluster.tick("decode", "decode", "-", "-")
    assert (ready["status"], ready["reason"], phase) == ("False", "EnginesStarting", "Pending")
    # Every engine answers, all decode: the router would refuse every request.
    ready, phase = await cluster.tick("decode", "decode", "decode", "decode")
    assert (ready["status"], ready["reason"], phase) == ("False", "Bootstrapping", "Pending")
    assert "4/4 engines answering, none serving prefill" in ready["message"]
    ready, _ = await cluster.tick("switching", "switching", "decode", "decode")
    assert (ready["status"], ready["reason"]) == ("False", "Bootstrapping")
    ready, phase = await cluster.tick("prefill", "prefill", "decode", "decode")
    assert (ready["status"], ready["reason"], phase) == ("True", "EnginesReady", "Running")
    assert "serving with 2 prefill and 2 decode" in ready["message"]
    # A later switch keeps it serving, so Ready holds.
    ready, _ = await cluster.tick("prefill", "switching", "decode", "decode")
    assert ready["status"] == "True"


async def test_a_cluster_that_stops_serving_prefill_is_not_ready_and_not_bootstrapping() -> None:
    cluster = Cluster()
    await cluster.tick("prefill", "decode", "decode", "decode")
    ready, _ = await cluster.tick("decode", "decode", "decode", "decode")
    assert (ready["status"], ready["reason"]) == ("False", "NoPrefillEngine")


@pytest.mark.parametrize(
    ("counts", "reason"),
    [
        ((0, 4, 0), "Bootstrapping"),
        ((4, 0, 0), "NoDecodeEngine"),
        ((1, 2, 0), "EnginesStarting"),
        ((1, 1, 2), "EnginesReady"),
    ],
)
def test_readiness_rule(counts: tuple[int, int, int], reason: str) -> None:
    prefill, decode, switching = counts
    verdict = readiness(
        expected=4, prefill=prefill, decode=decode, switching=switching, degraded=False
    )
    assert verdict.reason == reason and verdict.ready == (reason == "EnginesReady")
