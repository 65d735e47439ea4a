"""Two asyncio chores every Prorsa process repeats: stopping on signals, ending a task.

Here, in the one package that the operator, the in-pod agent, the SDK and the lab all
import, so each process stops the same way; it needs the standard library alone, so the
contract's promise (pydantic and nothing else) holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def on_stop_signals(callback: Callable[[], None]) -> None:
    """Call ``callback`` in the running loop on SIGINT or SIGTERM.

    Silently not where the loop cannot take signals: on Windows, or off the main thread
    (a test that runs a server in a thread stops it by other means).
    """
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, callback)


def drop_stop_signals() -> None:
    """Give SIGINT and SIGTERM back their default handling."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def stop_requested() -> Iterator[asyncio.Event]:
    """An event that SIGINT or SIGTERM sets while inside; default handling after."""
    stop = asyncio.Event()
    on_stop_signals(stop.set)
    try:
        yield stop
    finally:
        drop_stop_signals()


# A task still running this long after its cancellation is cancelled again: something
# it awaited swallowed the first one (a client's timeout that turns a cancellation into a
# TimeoutError, caught by a loop that logs errors and carries on).
RECANCEL_SECONDS = 1.0


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it has ended, so nothing outlives its owner.

    The task's own CancelledError ends here; the caller's does not. A caller cancelled
    while it waits (its owner shutting it down) is cancelled still: swallowing that made a
    loop calling this carry on forever, and whoever awaited the loop with it (a test
    stack's teardown once hung on the fake kubelet this way). A task that swallows its
    cancellation is cancelled again every ``RECANCEL_SECONDS`` until it ends.
    """
    if task is None:
        return
    current = asyncio.current_task()
    # Cancellations the caller already had (cleanup in a `finally` of a cancelled task
    # ends several tasks in turn) are not new ones.
    before = current.cancelling() if current is not None else 0
    while not task.done():
        task.cancel()
        # A caller cancelled here still waits for the task to end; its cancelling() count
        # says so below, and the cancellation is carried on.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({task}, timeout=RECANCEL_SECONDS)
    if current is not None and current.cancelling() > before:
        raise asyncio.CancelledError
    if not task.cancelled():
        error = task.exception()
        if error is not None:
            raise error
