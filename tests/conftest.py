"""Shared fixtures: a small RolloutCluster spec and an event builder."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from prorsa.core.spec import RolloutClusterSpec, parse_cluster
from prorsa_contract.events import Event, parse_events


def make_spec(**spec: Any) -> RolloutClusterSpec:
    body: dict[str, Any] = {"model": {"path": "/models/m"}, "gpuBudget": 64}
    for key, value in spec.items():
        body[key] = value
    manifest = {
        "apiVersion": "prorsa.io/v1alpha1",
        "kind": "RolloutCluster",
        "metadata": {"name": "c", "namespace": "rl"},
        "spec": body,
    }
    return parse_cluster(manifest).spec


class EventLog:
    """Builds valid lifecycle events with unique ids, in the order written."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.raw: list[dict[str, Any]] = []

    def __call__(self, type: str, trajectory: str, ts: float, **fields: Any) -> EventLog:
        self.raw.append(
            {"id": f"e{next(self._ids)}", "type": type, "trajectory": trajectory, "ts": ts} | fields
        )
        return self

    def cluster(self, type: str, ts: float, **fields: Any) -> EventLog:
        """A cluster event (weight update): no trajectory."""
        self.raw.append({"id": f"e{next(self._ids)}", "type": type, "ts": ts} | fields)
        return self

    def take(self) -> list[Event]:
        out, self.raw = parse_events(self.raw), []
        return out


@pytest.fixture
def log() -> EventLog:
    return EventLog()


@pytest.fixture
def spec() -> RolloutClusterSpec:
    return make_spec()


async def _no_event(kind: str, reason: str, message: str) -> None:
    return None


def cluster_runtime(
    spec: RolloutClusterSpec,
    *,
    kube: Any = None,
    agents: Any = None,
    options: Any = None,
    post_event: Any = None,
) -> Any:
    """A ``ClusterRuntime`` for rl/c on a handle of its own, with the doubles a test passes
    (None for the parts it never reaches), real metrics and no persistence by default."""
    from prometheus_client import CollectorRegistry

    from prorsa.clusters import ClusterRegistry
    from prorsa.core.controller import Controller
    from prorsa.k8s.runtime import ClusterRuntime, OperatorOptions
    from prorsa.operator_metrics import OperatorMetrics

    handle = ClusterRegistry().add(namespace="rl", name="c", token="t", controller=Controller(spec))
    return ClusterRuntime(
        namespace="rl",
        name="c",
        spec=spec,
        uid="u",
        handle=handle,
        kube=kube,
        agents=agents,
        metrics=OperatorMetrics(CollectorRegistry()),
        options=options or OperatorOptions(persist=False),
        post_event=post_event or _no_event,
    )
