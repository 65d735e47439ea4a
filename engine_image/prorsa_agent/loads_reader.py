"""``/v1/loads`` for ``GET /v1/state``, within the operator's deadline.

The operator gives an agent 2 s to answer ``/v1/state`` and counts an engine that misses it
as unavailable: it plans no switch onto or away from it. SGLang answers ``/v1/loads`` from
its scheduler loop, between forward steps, and on a busy host a step can take seconds. A
busy engine is not an unavailable one, so the agent waits a bounded time for the read and
otherwise answers with the last one, while the read it started goes on in the background;
the next ``/v1/state`` joins that read instead of starting another.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prorsa_agent.engine_client import EngineClient, EngineUnavailable, Loads


class LoadsReader:
    """One ``/v1/loads`` read in flight at a time; a caller that cannot wait gets the last."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        wait: float,
        max_age: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._wait = wait
        self._max_age = max_age
        self._clock = clock
        self._read: asyncio.Task[Loads] | None = None
        self._last: tuple[float, Loads] | None = None

    async def loads(self) -> Loads:
        """This read's loads if it comes within ``wait``; else the last read, if it is at
        most ``max_age`` old; else :class:`EngineUnavailable`."""
        if self._read is None or self._read.done():
            self._read = asyncio.create_task(self._fetch())
            # A read nobody waited for to the end must not log "exception never retrieved".
            self._read.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            return await asyncio.wait_for(asyncio.shield(self._read), self._wait)
        except TimeoutError:
            last = self._last
            if last is not None and self._clock() - last[0] <= self._max_age:
                return last[1]
            raise EngineUnavailable(
                f"/v1/loads did not answer within {self._wait:g} s", timeout=True
            ) from None

    async def _fetch(self) -> Loads:
        loads = await self._engine.loads()
        self._last = (self._clock(), loads)
        return loads

    def close(self) -> None:
        if self._read is not None:
            self._read.cancel()
