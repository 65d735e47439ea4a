"""The Controller's lock, with its control calls ahead of the trainer's event batches.

One WebhookCluster serialises everything that touches its Controller: the trainer's event
batches and the operator's control calls (the tick, the engines' states, persistence). A
plain FIFO lock puts a tick behind every batch queued before it. At the size of a real job
(25,000 live trajectories, several thousand events a second, batches of 2,000) that is one
to three batches, and a Decision waits hundreds of milliseconds for events whose effect on
a forecast over a horizon of seconds is a fraction of a percent. A control call therefore
goes before any waiting batch; batches keep their order among themselves, and since the
control calls come about once a tick, batches are never starved.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class ControlFirstLock:
    """A non-reentrant asyncio lock with two queues: control waiters, then data waiters.

    The lock is handed over on release (the next waiter holds it as soon as it is woken),
    so a newcomer cannot take it between a release and the woken waiter's turn.
    """

    __slots__ = ("_control", "_data", "_held")

    def __init__(self) -> None:
        self._held = False
        self._control: deque[asyncio.Future[None]] = deque()
        self._data: deque[asyncio.Future[None]] = deque()

    def locked(self) -> bool:
        return self._held

    @property
    def waiting(self) -> tuple[int, int]:
        """(control, data) waiters, for tests and diagnostics."""
        return len(self._control), len(self._data)

    @asynccontextmanager
    async def hold(self, *, control: bool) -> AsyncIterator[None]:
        await self.acquire(control=control)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, *, control: bool) -> None:
        if not self._held and not self._control and not self._data:
            self._held = True
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._control if control else self._data
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed the lock as it was cancelled: pass it on
            else:
                queue.remove(waiter)
            raise

    def release(self) -> None:
        if not self._held:
            raise RuntimeError("ControlFirstLock released while not held")
        for queue in (self._control, self._data):
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # still held: handed to this waiter
                    return
        self._held = False
