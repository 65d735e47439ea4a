"""The threaded emitter: a sender thread executes the core's delivery for sync trainers.

``emit()`` (any thread) buffers through :class:`~prorsa_sdk.emitter_core.EmitterCore` and
wakes the thread; the thread takes batches, drives :meth:`EmitterCore.deliver` with httpx's
blocking client and sleeps its backoffs on an Event that ``close()`` sets.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Unpack

import httpx

from prorsa_contract.events import Snapshot
from prorsa_sdk.emitter_base import (
    EmitterBase,
    EmitterOptions,
    SnapshotSource,
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


class EventEmitter(EmitterBase):
    """Thread-based emitter for synchronous trainers (safe to call from any thread).

    >>> em = EventEmitter(url="http://127.0.0.1:8787", namespace="rl", name="qwen3",
    ...                   token=open("token").read(), track=True)
    >>> em.request_queued("traj-1", prompt_tokens=2048, turn=0)
    >>> em.close()
    """

    def __init__(
        self,
        *,
        snapshot: SnapshotSource | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        verify: TlsVerify = None,
        **options: Unpack[EmitterOptions],
    ) -> None:
        super().__init__(has_snapshot=snapshot is not None, options=options)
        self._snapshot = snapshot
        self._client = httpx.Client(
            base_url=self._core.url,
            timeout=timeout,
            transport=transport,
            verify=tls_context(verify),
        )
        self._wake = threading.Condition(self._core.lock)
        self._stop = threading.Event()  # interrupts backoff sleeps on close
        self._thread = threading.Thread(target=self._run, name="prorsa-emitter", daemon=True)
        self._thread.start()

    def __enter__(self) -> EventEmitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _kick(self) -> None:
        with self._wake:
            self._wake.notify()

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Block until everything emitted so far was delivered (or dropped); False on timeout."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        with self._wake:
            self._flushing += 1
            self._wake.notify_all()
            try:
                while not self._core.idle():
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._thread.is_alive():
                        return False
                    self._wake.wait(min(left, 0.5))
                return True
            finally:
                self._flushing -= 1

    def close(self, timeout: float = 10.0) -> EmitterStats:
        """Flush within ``timeout`` seconds, then stop; the rest is counted as dropped."""
        core = self._core
        with self._wake:
            closed = core.closed
            if not closed:
                self._closing = True
                core.abandon_at = time.monotonic() + timeout
                self._wake.notify_all()
        if closed:  # stats() takes the lock the condition holds: read them outside it
            return core.stats()
        self._thread.join(timeout + 1.0)
        self._stop.set()
        self._thread.join(2.0)
        stats = self._close_out()
        self._client.close()
        return stats

    # -- sender thread -------------------------------------------------------------------

    def _run(self) -> None:
        core = self._core
        while True:
            with self._wake:
                while True:
                    step = core.next_step(
                        now=time.monotonic(), flushing=self._flushing > 0, closing=self._closing
                    )
                    if step is None:
                        return
                    if isinstance(step, list):
                        batch = step
                        break
                    self._wake.wait(step)
            try:
                self._drive(core.deliver(batch))
            except Exception:  # a bug must not kill delivery silently
                core.lost(batch)
            with self._wake:
                self._wake.notify_all()

    def _drive(self, gen: Delivery) -> None:
        result: Result = None
        try:
            action = next(gen)
            while True:
                if isinstance(action, Post):
                    result = self._post(action)
                elif isinstance(action, Sleep):
                    self._stop.wait(action.seconds)
                    result = None
                elif isinstance(action, Record):
                    self._record(action.batch)
                    result = None
                else:
                    result = self._build_snapshot()
                action = gen.send(result)
        except StopIteration:
            return

    def _post(self, action: Post) -> Reply | BaseException:
        try:
            r = self._client.post(action.path, content=action.body, headers=self._send_headers())
        except httpx.HTTPError as exc:
            return exc
        return as_reply(r)

    def _build_snapshot(self) -> Snapshot | BaseException:
        core = self._core
        try:
            if self._snapshot is None:
                return core.tracked_snapshot()
            ts = core.clock()
            return as_snapshot(self._snapshot(), ts=ts)
        except Exception as exc:
            return exc
