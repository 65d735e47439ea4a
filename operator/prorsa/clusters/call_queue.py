"""One cluster's Controller, called by one caller at a time: the calls waiting are the queue.

The Controller is not thread-safe, so every call into it goes through one lock, the
operator's control calls (tick, engine states, persistence) ahead of the event batches
waiting for it (:class:`~prorsa.clusters.control_lock.ControlFirstLock`). Small batches
apply inline, which costs a few milliseconds at most; large batches and control ticks,
whose cost grows with the batch or with the number of live trajectories, run in a worker
thread so the event loop keeps serving other requests and other clusters meanwhile. The
queue's length in events is bounded (``max_pending_events``) and a batch that would exceed
it is refused with :class:`~prorsa.clusters.limits.QueueFull` and a Retry-After computed
from the measured apply rate.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from prorsa.clusters.control_lock import ControlFirstLock
from prorsa.clusters.limits import QueueFull
from prorsa.core.controller import Controller

T = TypeVar("T")


class CallQueue:
    """The lock around one Controller, the events waiting for it and its apply rate."""

    def __init__(self, controller: Controller, *, max_pending_events: int) -> None:
        self._controller = controller
        self._max_pending = max_pending_events
        self._lock = ControlFirstLock()  # ticks before queued batches (control_lock.py)
        self._seconds_per_event = 5e-6  # EWMA of apply cost, for Retry-After
        self.pending_events = 0

    def check_capacity(self, incoming: int = 1) -> None:
        """Raise :class:`QueueFull` when ``incoming`` more events would overflow the queue.

        A lone batch larger than the bound is still admitted into an empty queue (the body
        size limit bounds it), so a legal batch is never refused forever.
        """
        pending = self.pending_events
        if pending and pending + incoming > self._max_pending:
            wait = pending * self._seconds_per_event
            raise QueueFull(pending=pending, retry_after=max(1, math.ceil(wait)))

    async def call(
        self,
        fn: Callable[[], T],
        *,
        offload: bool,
        pending: int,
        on_error: Callable[[], None] | None = None,
        control: bool = False,
    ) -> T:
        """Run ``fn`` alone on the Controller, as a task a cancelled request cannot abort
        (``control``: ahead of the event batches waiting for it).

        Shielding matters: if a client hangs up while its batch waits or runs, the batch
        still applies exactly once (its ids are already in the dedupe window), and a thread
        is never left running on the Controller after the lock was released.
        """
        self.pending_events += pending
        task = asyncio.ensure_future(
            self._locked(fn, offload=offload, pending=pending, control=control)
        )

        def done(t: asyncio.Future[T]) -> None:
            self.pending_events -= pending
            if (t.cancelled() or t.exception() is not None) and on_error is not None:
                on_error()

        task.add_done_callback(done)
        return await asyncio.shield(task)

    async def _locked(
        self, fn: Callable[[], T], *, offload: bool, pending: int, control: bool
    ) -> T:
        async with self._lock.hold(control=control):
            start = time.perf_counter()
            result = await asyncio.to_thread(fn) if offload else fn()
            if pending:
                per_event = (time.perf_counter() - start) / pending
                self._seconds_per_event += 0.2 * (per_event - self._seconds_per_event)
            return result

    async def idle(self) -> None:
        """Wait until every queued call has run (orderly shutdown)."""
        async with self._lock.hold(control=False):
            return

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[Controller]:
        """Hold the Controller alone, e.g. to persist its statistics consistently.

        Batches arriving meanwhile queue up (and get 429 past ``max_pending_events``);
        keep the block short and do blocking work in a thread.
        """
        async with self._lock.hold(control=True):
            yield self._controller
