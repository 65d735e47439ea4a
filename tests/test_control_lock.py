"""The Controller's lock: a tick waiting behind the trainer's batches goes first.

At a real job's size a tick queued behind a few 2,000-event batches waited hundreds of
milliseconds for them (``prorsa bench scale``); these tests pin the order the lock gives
and that a cancelled waiter never strands it.
"""

from __future__ import annotations

import asyncio

import pytest

from prorsa.clusters.control_lock import ControlFirstLock


async def _run(lock: ControlFirstLock, name: str, order: list[str], *, control: bool) -> None:
    async with lock.hold(control=control):
        order.append(name)
        await asyncio.sleep(0)


async def test_a_tick_goes_before_the_batches_queued_ahead_of_it() -> None:
    lock, order = ControlFirstLock(), []
    await lock.acquire(control=False)  # a batch applying
    tasks = [asyncio.create_task(_run(lock, f"batch-{i}", order, control=False)) for i in range(3)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(_run(lock, "tick", order, control=True)))
    await asyncio.sleep(0)
    assert lock.waiting == (1, 3)
    lock.release()
    await asyncio.gather(*tasks)
    # The tick first; the batches in the order they came.
    assert order == ["tick", "batch-0", "batch-1", "batch-2"]
    assert not lock.locked()


async def test_an_uncontended_call_takes_the_lock_at_once() -> None:
    lock = ControlFirstLock()
    async with lock.hold(control=False):
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(RuntimeError, match="not held"):
        lock.release()


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    lock, order = ControlFirstLock(), []
    await lock.acquire(control=True)
    gone = asyncio.create_task(_run(lock, "gone", order, control=False))
    kept = asyncio.create_task(_run(lock, "kept", order, control=False))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    assert lock.waiting == (0, 1)
    lock.release()
    await kept
    assert order == ["kept"] and gone.cancelled() and not lock.locked()


async def test_a_waiter_cancelled_as_it_is_handed_the_lock_passes_it_on() -> None:
    lock, order = ControlFirstLock(), []
    await lock.acquire(control=False)
    first = asyncio.create_task(_run(lock, "first", order, control=True))
    second = asyncio.create_task(_run(lock, "second", order, control=False))
    await asyncio.sleep(0)
    lock.release()  # hands the lock to "first", which has not run yet...
    first.cancel()  # ...and is cancelled before it does
    await asyncio.gather(first, second, return_exceptions=True)
    assert order == ["second"] and not lock.locked()
