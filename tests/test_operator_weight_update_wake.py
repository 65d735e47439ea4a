"""A weight update announced by the trainer makes the operator tick at once.

The update's duration (seconds to tens of seconds) is the lead time for switching decode
instances to prefill while nothing runs on them, before the trainer resends every
interrupted generation. Waiting for the end of the tick period would waste most of it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from conftest import cluster_runtime, make_spec

from prorsa.control.runtime import ClusterLoopSettings
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
