"""What makes the operator tick at once rather than at the end of its period.

A weight update: its duration (seconds to tens of seconds) is the lead time for switching
decode instances to prefill while nothing runs on them, before the trainer resends every
interrupted generation. Waiting for the end of the tick period would waste most of it.
An engine turning Ready before the bootstrap: the trainer waits for the cluster's Ready,
which the bootstrap brings.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from conftest import cluster_runtime, make_spec

from prorsa.control.runtime import ClusterLoopSettings
from prorsa.core.actions import ActionState
from prorsa_contract import events as ev


async def _run_until_second_tick(batch: list[ev.Event]) -> float | None:
    """Seconds from posting ``batch`` to the runtime's next tick (None: none within 5 s)."""
    # A period far longer than the test: only a wake-up can tick a second time.
    runtime = cluster_runtime(
        make_spec(), options=ClusterLoopSettings(persist=False, tick_seconds=3600.0)
    )
    handle = runtime.handle
    first, second = asyncio.Event(), asyncio.Event()

    async def tick_once() -> Any:
        (second if first.is_set() else first).set()

    async def shutdown() -> None:
        pass

    runtime.tick_once = tick_once  # type: ignore[method-assign]
    runtime.shutdown = shutdown  # type: ignore[method-assign]
    loop = asyncio.create_task(runtime.run())
    try:
        await asyncio.wait_for(first.wait(), timeout=30)
        posted = time.monotonic()
        await handle.apply(batch, received=posted)
        try:
            await asyncio.wait_for(second.wait(), timeout=5)
        except TimeoutError:
            return None
        return time.monotonic() - posted
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_an_announced_weight_update_ticks_at_once() -> None:
    now = time.time()
    started = ev.WeightUpdateStarted(
        id="w-1", type="weight_update_started", ts=now, version=1, expected_seconds=12.0
    )
    waited = await _run_until_second_tick([started])
    assert waited is not None, "the runtime waited for its period after a weight update"


async def test_ordinary_events_wait_for_the_period() -> None:
    queued = ev.RequestQueued(
        id="t-1#0",
        type="request_queued",
        ts=time.time(),
        trajectory="t-1",
        prompt_tokens=100,
        turn=0,
    )
    assert await _run_until_second_tick([queued]) is None


def _pod(*, ready: bool, phase: str = "Running") -> dict[str, Any]:
    status = "True" if ready else "False"
    return {"status": {"phase": phase, "conditions": [{"type": "Ready", "status": status}]}}


def test_an_engine_turning_ready_before_the_bootstrap_ticks_at_once() -> None:
    """The trainer waits for Ready, which the bootstrap brings, and the bootstrap starts at
    the first tick that finds every engine answering: the last engine's readiness should not
    wait up to a tick period on top of a cluster's start."""
    runtime = cluster_runtime(make_spec(), options=ClusterLoopSettings(persist=False))
    assert runtime.awaiting_engines
    assert not runtime.on_pod_event(kind="MODIFIED", pod=_pod(ready=False))
    assert runtime.on_pod_event(kind="MODIFIED", pod=_pod(ready=True))


def test_once_the_bootstrap_began_readiness_waits_for_the_period() -> None:
    """Switches relabel pods and turn them Ready again: those events must not tick a running
    cluster on every flip; a deleted or failed pod still does."""
    runtime = cluster_runtime(make_spec(), options=ClusterLoopSettings(persist=False))
    for state in (ActionState(bootstrap_started=True), ActionState(bootstrapped=True)):
        runtime.actions = state
        assert not runtime.awaiting_engines
        assert not runtime.on_pod_event(kind="MODIFIED", pod=_pod(ready=True))
        assert runtime.on_pod_event(kind="DELETED", pod=_pod(ready=True))
        assert runtime.on_pod_event(kind="MODIFIED", pod=_pod(ready=False, phase="Failed"))
