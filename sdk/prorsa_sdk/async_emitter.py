"""The asyncio emitter: a task in the trainer's loop executes the core's delivery.

``emit()`` is a plain call that buffers through
:class:`~prorsa_sdk.emitter_core.EmitterCore` and wakes the task (from another thread too);
the task drives :meth:`EmitterCore.deliver` with httpx's async client, and writes the
recording from a worker thread so the loop never blocks on a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import threading
import time
from typing import Unpack

import httpx

from prorsa_contract.aio import cancel_and_wait
from prorsa_contract.events import Snapshot
from prorsa_sdk.emitter_base import (
    AsyncSnapshotSource,
    EmitterBase,
    EmitterOptions,
    TlsVerify,
    as_reply,
    tls_context,
)
from prorsa_sdk.emitter_core import (
    Delivery,
    EmitterStats,
    Post,
    Record,
    Reply,
    Result,
    Sleep,
    as_snapshot,
)


class AsyncEventEmitter(EmitterBase):
    """asyncio emitter: ``emit()`` is a plain (non-async) call that never blocks the loop.

    >>> async with AsyncEventEmitter(url=..., namespace="rl", name="qwen3", token=t) as em:
    ...     em.request_queued("traj-1", prompt_tokens=2048, turn=0)
    """

    def __init__(
        self,
        *,
        snapshot: AsyncSnapshotSource | None = None,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: TlsVerify = None,
        **options: Unpack[EmitterOptions],
    ) -> None:
        super().__init__(has_snapshot=snapshot is not None, options=options)
        self._snapshot = snapshot
        self._timeout = timeout
        self._transport = transport
        self._verify = tls_context(verify)  # a missing bundle fails here, not in the loop
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None

    async def __aenter__(self) -> AsyncEventEmitter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the sender in the running loop (``emit()`` also starts it lazily)."""
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._stop = asyncio.Event()
        self._client = httpx.AsyncClient(
            base_url=self._core.url,
            timeout=self._timeout,
            transport=self._transport,
            verify=self._verify,
        )
        self._task = loop.create_task(self._run(), name="prorsa-emitter")

    def _kick(self) -> None:
        """Wake the sender: a first event starts the flush timer, a full batch is due."""
        if self._task is None:
            try:
                self._ensure_started()
            except RuntimeError:
                return  # no running loop here: start() or the next emit() picks it up
        if threading.get_ident() == self._loop_thread:
            assert self._wake is not None
            self._wake.set()
        elif self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until everything emitted so far was delivered (or dropped)."""
        self._ensure_started()
        assert self._wake is not None and self._changed is not None
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        self._flushing += 1
        self._wake.set()
        try:
            while not self._core.idle():
                left = deadline - time.monotonic()
                if left <= 0 or self._task is None or self._task.done():
                    return False
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
            return True
        finally:
            self._flushing -= 1

    async def aclose(self, timeout: float = 10.0) -> EmitterStats:
        """Flush within ``timeout`` seconds, then stop; the rest is counted as dropped."""
        core = self._core
        if core.closed:
            return core.stats()
        if self._task is None and core.buffer:
            self._ensure_started()
        if self._task is not None:
            assert self._wake is not None and self._stop is not None
            self._closing = True
            core.abandon_at = time.monotonic() + timeout
            self._wake.set()
            done, _ = await asyncio.wait({self._task}, timeout=timeout + 1.0)
            if not done:
                self._stop.set()
                await asyncio.wait({self._task}, timeout=2.0)
            if not self._task.done():
                await cancel_and_wait(self._task)
        stats = self._close_out()
        if self._client is not None:
            await self._client.aclose()
        return stats

    async def _run(self) -> None:
        core = self._core
        assert self._wake is not None and self._changed is not None
        while True:
            while True:
                with core.lock:
                    step = core.next_step(
                        now=time.monotonic(), flushing=self._flushing > 0, closing=self._closing
                    )
                if step is None:
                    return
                if isinstance(step, list):
                    batch = step
                    break
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), step)
            try:
                await self._drive(core.deliver(batch))
            except Exception:
                core.lost(batch)
            self._changed.set()

    async def _drive(self, gen: Delivery) -> None:
        assert self._stop is not None
        result: Result = None
        try:
            action = next(gen)
            while True:
                if isinstance(action, Post):
                    result = await self._post(action)
                elif isinstance(action, Sleep):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), action.seconds)
                    result = None
                elif isinstance(action, Record):
                    await asyncio.to_thread(self._record, action.batch)
                    result = None
                else:
                    result = await self._build_snapshot()
                action = gen.send(result)
        except StopIteration:
            return

    async def _post(self, action: Post) -> Reply | BaseException:
        assert self._client is not None
        try:
            r = await self._client.post(
                action.path, content=action.body, headers=self._send_headers()
            )
        except httpx.HTTPError as exc:
            return exc
        return as_reply(r)

    async def _build_snapshot(self) -> Snapshot | BaseException:
        core = self._core
        try:
            if self._snapshot is None:
                return core.tracked_snapshot()
            ts = core.clock()
            rows = self._snapshot()
            if inspect.isawaitable(rows):
                rows = await rows
            return as_snapshot(rows, ts=ts)
        except Exception as exc:
            return exc
