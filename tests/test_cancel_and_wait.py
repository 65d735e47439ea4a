"""Ending a background task (``prorsa_contract.aio.cancel_and_wait``) without eating the
caller's own cancellation.

Every Prorsa process ends its background tasks this way. A loop that ends a child task per
round (the fake kubelet stopping a pod's agent) and is itself cancelled while doing so must
end: once it swallowed its own cancellation and kept polling, and the teardown awaiting it
hung a whole `make test`.
"""

from __future__ import annotations

import asyncio

import pytest

from prorsa_contract.aio import cancel_and_wait


async def _slow_to_stop(stopping: asyncio.Event) -> None:
    """A child that takes a moment to clean up once cancelled, as an agent's stop does."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        stopping.set()
        await asyncio.sleep(0.2)
        raise


async def test_the_task_is_cancelled_and_waited_for() -> None:
    stopping = asyncio.Event()
    child = asyncio.create_task(_slow_to_stop(stopping))
    await asyncio.sleep(0)
    await cancel_and_wait(child)  # the child's CancelledError ends here
    assert child.cancelled() and stopping.is_set()
    await cancel_and_wait(None)
    await cancel_and_wait(child)  # already over: nothing to do


async def test_a_caller_cancelled_while_it_waits_is_cancelled() -> None:
    rounds = 0
    stopping = asyncio.Event()
    finished = False  # ends the loop when the test does, whatever cancel_and_wait did

    async def loop_that_ends_children() -> None:
        nonlocal rounds
        while not finished:
            rounds += 1
            child = asyncio.create_task(_slow_to_stop(stopping))
            await asyncio.sleep(0)
            await cancel_and_wait(child)
            await asyncio.sleep(0.01)

    owner = asyncio.create_task(loop_that_ends_children())
    await stopping.wait()  # the loop is inside cancel_and_wait, its child cleaning up
    owner.cancel()
    try:
        await asyncio.wait({owner}, timeout=5)
        assert owner.done(), f"the loop went on after its cancellation ({rounds} rounds)"
        assert owner.cancelled()
    finally:
        finished = True
        await asyncio.wait({owner}, timeout=5)


async def test_a_child_that_fails_still_says_so() -> None:
    async def failing() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            raise RuntimeError("cleanup failed")

    child = asyncio.create_task(failing())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await cancel_and_wait(child)


async def test_cleanup_of_a_cancelled_task_ends_every_child() -> None:
    """A cancelled task ending its children in its ``finally`` ends all of them: the
    cancellation it is handling is not a new one."""
    events = [asyncio.Event(), asyncio.Event()]
    children: list[asyncio.Task[None]] = []

    async def owner() -> None:
        children.extend(asyncio.create_task(_slow_to_stop(e)) for e in events)
        try:
            await asyncio.sleep(3600)
        finally:
            for child in children:
                await cancel_and_wait(child)

    task = asyncio.create_task(owner())
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled()
    assert all(child.cancelled() for child in children) and all(e.is_set() for e in events)


async def test_a_task_that_swallows_its_cancellation_is_cancelled_again() -> None:
    """A loop whose client turns a cancellation into an error it logs and carries on from
    (the fake kubelet polling the API server through aiohttp hung a `make test` so) still
    ends: it is cancelled again until it does."""
    swallowed = 0

    async def poller() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # "TimeoutError: logged, polling on"

    task = asyncio.create_task(poller())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), timeout=10)
    assert task.cancelled() and swallowed == 1
