"""A tick that keeps failing is visible to ``kubectl describe``, not only in the log.

The usual cause is RBAC: LeaderWorkerSets installed after the chart, so the operator finds
the API but may not create sets. Every tick fails before it writes the status; the
status's Degraded condition and one Warning Event must say what was refused and how to fix
it, and a success clears it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from conftest import cluster_runtime, make_spec
from kubernetes.client.exceptions import ApiException

from prorsa.control.runtime import ClusterLoopSettings
from prorsa.control.status import tick_failure

REFUSAL = (
    'leaderworkersets.leaderworkerset.x-k8s.io is forbidden: User "system:serviceaccount:'
    'prorsa:prorsa" cannot create resource "leaderworkersets" in API group '
    '"leaderworkerset.x-k8s.io" in the namespace "rl"'
)


def forbidden() -> ApiException:
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"kind": "Status", "message": REFUSAL, "code": 403})
    return exc


class Kube:
    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append(status)


async def test_a_refused_call_shows_in_the_status_and_one_warning_event() -> None:
    kube = Kube()
    events: list[tuple[str, str, str]] = []

    async def post_event(kind: str, reason: str, message: str) -> None:
        events.append((kind, reason, message))

    runtime = cluster_runtime(
        make_spec(),
        kube=kube,
        options=ClusterLoopSettings(persist=False, tick_seconds=0.01),
        post_event=post_event,
    )
    ticks = 0

    async def failing_tick() -> None:
        nonlocal ticks
        ticks += 1
        if ticks >= 3:
            runtime._stop.set()
        raise forbidden()

    runtime.tick_once = failing_tick  # type: ignore[method-assign]
    await asyncio.wait_for(runtime.run(), timeout=30)

    assert ticks == 3 and len(kube.statuses) == 3
    (degraded,) = [c for c in kube.statuses[-1]["conditions"] if c["type"] == "Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "Forbidden"
    assert 'cannot create resource "leaderworkersets"' in degraded["message"]
    assert "rbac.leaderWorkerSets=true" in degraded["message"]
    # Three failures with the same cause: one Event, not one per tick.
    assert [(k, r) for k, r, _ in events] == [("Warning", "Forbidden")]


def test_other_failures_keep_their_own_words() -> None:
    assert tick_failure(RuntimeError("boom")) == ("TickFailed", "RuntimeError('boom')")
    exc = ApiException(status=500, reason="Internal Server Error")
    assert tick_failure(exc) == ("APIError", "the API server answered 500: Internal Server Error")
