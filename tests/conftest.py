"""Shared fixtures (a small RolloutCluster spec, an event builder) and the ``slow`` marks.

``make test-fast`` (``pytest -m "not slow"``) leaves out the tests that run the whole
operator on loopback (kopf, the Kubernetes API emulator, engine doubles with their agents,
often the real smg or a ``prorsa operator`` process): each takes from a few seconds to a
minute. ``make test`` runs them all. The marks live here, in one list, rather than in each
module, so a newcomer finds them in one place; a test file added to a module listed here is
slow too.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from prorsa.core.spec import RolloutClusterSpec, parse_cluster
from prorsa_contract.events import Event, parse_events

# Modules whose every test runs the operator end to end.
SLOW_MODULES = {
    "test_operator_e2e.py": "the operator's scenarios against the emulator and engine doubles",
    "test_multinode_e2e.py": "two-pod instances end to end, with and without LeaderWorkerSet",
    "test_multinode_demo.py": "the multinode demo",
    "test_demo.py": "`prorsa demo` end to end, its switching and static runs",
    "test_operator_ha.py": "a `prorsa operator` process killed mid-switch, the standby takes over",
    "test_operator_labels.py": "the stack's pods and their labels",
    "test_smg_router.py": "the real smg against the stack",
    "test_smg_dp_routing.py": "the real smg with DP engines",
    "test_scale_bench.py": "`prorsa bench scale` at a tiny size: two replicas, two clusters",
    "test_operator_upgrade.py": "`helm upgrade` mid-switch, the operator's pods rolled",
}
# Single tests that run the whole operator in an otherwise quick module.
SLOW_TESTS = {
    # The whole operator throttled by the API emulator.
    "test_api_throttle.py": {"test_a_throttled_operator_backs_off_then_carries_on"},
    # Two chaos rounds against two operator replicas, the real smg and the stack.
    "test_chaos_suite.py": {"test_two_chaos_rounds_converge_and_the_trainer_loses_nothing"},
    "test_chart.py": {
        # The chart's RBAC held against every call of a whole operator scenario.
        "test_rbac_allows_every_call_the_operator_makes_and_grants_nothing_it_does_not",
    },
    "test_kubectl_view.py": {
        "test_engine_pods_are_ready_and_events_print_kubectls_columns",
        "test_describe_lists_every_switch_the_status_shows",
        "test_the_fake_kubelet_writes_container_statuses_kubectl_counts_ready_from",
    },
    "test_operator_degraded.py": {
        "test_an_agent_that_times_out_degrades_the_cluster_for_all_to_see"
    },
    "test_operator_spec_update.py": {"test_a_smoothing_edit_reaches_the_running_operator"},
    "test_trainer_token.py": {"test_the_operator_follows_a_rotation_while_a_trainer_posts"},
    "test_webhook_tls.py": {"test_the_operator_webhook_serves_https_and_the_sdk_verifies_it"},
    "test_memory_bounds.py": {"test_the_operator_stays_under_the_charts_memory_limit_at_the_cap"},
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.name
        name = getattr(item, "originalname", item.name)
        if module in SLOW_MODULES or name in SLOW_TESTS.get(module, ()):
            item.add_marker(pytest.mark.slow)


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
    from prorsa.k8s.runtime import ClusterLoopSettings, ClusterRuntime
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
        options=options or ClusterLoopSettings(persist=False),
        post_event=post_event or _no_event,
    )
