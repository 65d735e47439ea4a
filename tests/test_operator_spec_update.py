"""Spec edits reach the running operator whole (issue 13 item 10): applied between two
Controller calls, never beside a tick or a batch, and visible in what the operator does."""

from __future__ import annotations

import asyncio

import pytest
from conftest import cluster_runtime, make_spec

from prorsa.control.runtime import ClusterLoopSettings
from prorsa_lab.doubles.stack import PATIENCE, cluster_manifest, stack


async def test_a_spec_update_waits_for_the_tick_that_holds_the_controller() -> None:
    old = make_spec(switching={"drainTimeoutSeconds": 30})
    new = make_spec(forecast={"horizonSeconds": 30}, switching={"smoothingSeconds": 0})

    async def post_event(kind: str, reason: str, message: str) -> None:
        raise AssertionError("a spec update posts no event")

    # A spec update talks to no API: no Kubernetes or agent double.
    runtime = cluster_runtime(old, options=ClusterLoopSettings(), post_event=post_event)
    handle = runtime.handle
    async with handle.exclusive() as controller:  # a tick (or a batch) in progress
        update = asyncio.create_task(runtime.update_spec(new))
        await asyncio.sleep(0.05)
        assert not update.done()
        assert controller.spec is old and controller.horizon == 10.0
        assert controller.smoother.seconds == old.switching.smoothing_seconds
    await asyncio.wait_for(update, 5)
    controller = handle.controller
    assert controller.spec is new and runtime.spec is new
    assert controller.horizon == 30.0 and controller.smoother.seconds == 0


@pytest.mark.slow  # the whole operator: left out by `make test-fast`
async def test_a_smoothing_edit_reaches_the_running_operator() -> None:
    """`kubectl edit` of switching.smoothingSeconds: the status's reason says what the
    split is now planned on (the Controller's smoother, not only its spec, changed)."""
    async with stack() as env:
        await env.create_cluster(cluster_manifest())
        await env.kubelet.wait_running(4)

        async def reason() -> str:
            status = (await env.get_cluster()).get("status") or {}
            return str((status.get("target") or {}).get("reason") or "")

        await env.wait_for(reason, timeout=2 * PATIENCE, what="a first status")
        assert "planned on" not in await reason()  # smoothingSeconds 0: each horizon
        await env.patch_cluster("demo", {"spec": {"switching": {"smoothingSeconds": 120}}})

        async def smoothed() -> bool:
            return "over 120s" in await reason()

        await env.wait_for(smoothed, timeout=2 * PATIENCE, what="the split planned over 120 s")
        generation = int((await env.get_cluster())["metadata"]["generation"])

        async def observed() -> bool:
            status = (await env.get_cluster()).get("status") or {}
            return int(status.get("observedGeneration") or 0) == generation

        await env.wait_for(observed, timeout=2 * PATIENCE, what="the new generation observed")
