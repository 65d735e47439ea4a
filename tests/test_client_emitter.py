"""The trainer SDK's emitters against the real webhook, over loopback HTTP.

Failures are injected by a middleware in front of the real handlers: 429 with Retry-After,
503, a connection closed before the reply (and after the batch applied: a lost reply), a
server that hangs, a server that restarts and lost its state.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from conftest import make_spec

from prorsa.clusters import ClusterHandle, ClusterRegistry, IngestLimits
from prorsa.core.controller import Controller
from prorsa.core.spec import RolloutClusterSpec
from prorsa.ingest import WebhookServer
from prorsa_sdk import AsyncEventEmitter, Backoff, EmitterStats, EventEmitter

TOKEN = "tok-123"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
FAST = Backoff(base=0.01, cap=0.05)


@dataclass
class Chaos:
    """Scripted faults for the next requests to .../events and .../snapshot."""

    script: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def chaos(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self.inject(request, handler)

        return chaos

    async def inject(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.endswith(("/events", "/snapshot")) or not self.script:
            return await handler(request)
        action = self.script.pop(0)
        self.seen.append(action)
        if action == "429":
            await request.read()
            return web.json_response({"error": "busy"}, status=429, headers={"Retry-After": "0"})
        if action == "503":
            await request.read()
            return web.json_response({"error": "down"}, status=503)
        if action == "close":  # connection dropped before the server did anything
            await request.read()
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if action == "lost-reply":  # applied, then the connection dropped
            response = await handler(request)
            assert request.transport is not None
            request.transport.close()
            return response
        if action == "hang":
            await self.release.wait()
            return await handler(request)
        raise AssertionError(action)


@dataclass
class Webhook:
    url: str
    handle: ClusterHandle
    chaos: Chaos
    runner: web.AppRunner

    @property
    def live(self) -> dict[str, int]:
        return {k: v for k, v in self.handle.controller.live_trajectories().items() if v}


async def start_webhook(
    *,
    port: int = 0,
    limits: IngestLimits | None = None,
    chaos: Chaos | None = None,
    spec: RolloutClusterSpec | None = None,
) -> Webhook:
    registry = ClusterRegistry(limits=limits)
    controller = Controller(spec or make_spec())
    handle = registry.add(namespace="rl", name="c", token=TOKEN, controller=controller)
    chaos = chaos or Chaos()
    app = web.Application(middlewares=[chaos.middleware()])
    WebhookServer(registry).add_routes(app)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    return Webhook(url=url, handle=handle, chaos=chaos, runner=runner)


@pytest.fixture
async def hook() -> AsyncIterator[Webhook]:
    h = await start_webhook()
    yield h
    h.chaos.release.set()
    await h.runner.cleanup()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lifecycle(em: AsyncEventEmitter | EventEmitter, n: int, *, prefix: str = "t") -> None:
    """n trajectories through a tool turn; every odd one goes on to finish.

    6 events per trajectory, 7 more per odd one; the even ones stay live in ``tool``.
    """
    for i in range(n):
        t = f"{prefix}{i}"
        em.sample_dispatched(t, group=f"g{i // 8}", task="swe")
        em.request_queued(t, prompt_tokens=1000 + i, turn=0)
        em.prefill_started(t, instance="e-1")
        em.prefill_finished(t)
        em.decode_finished(t, output_tokens=50, finish="tool")
        em.tool_started(t, tool="bash")
        if i % 2:
            em.tool_finished(t, result_tokens=30)
            em.request_queued(t, prompt_tokens=1100 + i, turn=1)
            em.prefill_started(t)
            em.prefill_finished(t)
            em.decode_finished(t, output_tokens=20, finish="stop")
            em.reward_started(t)
            em.reward_finished(t, accepted=True)


def accounted(s: EmitterStats) -> bool:
    return s.emitted == s.sent + s.dropped + s.pending


# -- delivery -------------------------------------------------------------------------


async def test_async_emitter_delivers_everything_in_order(hook: Webhook) -> None:
    async with AsyncEventEmitter(
        url=hook.url, namespace="rl", name="c", token=TOKEN, batch_size=100, backoff=FAST
    ) as em:
        lifecycle(em, 100)
        assert await em.flush(timeout=10)
        stats = em.stats
    assert stats.emitted == stats.sent == hook.handle.applied == 950
    assert stats.dropped == 0 and stats.batches == 10 and accounted(stats)
    # In order: no event was stale for its trajectory, and the states are the real ones.
    assert hook.handle.anomalies == 0
    assert hook.live == {"tool": 50}


async def test_flush_interval_ships_a_partial_batch(hook: Webhook) -> None:
    async with AsyncEventEmitter(
        url=hook.url, namespace="rl", name="c", token=TOKEN, flush_interval=0.05
    ) as em:
        em.request_queued("t", prompt_tokens=10, turn=0)
        for _ in range(200):
            if hook.handle.applied:
                break
            await asyncio.sleep(0.01)
        assert hook.handle.applied == 1  # without flush(): the interval sent it


async def test_sync_emitter_from_many_threads(hook: Webhook) -> None:
    def work() -> EmitterStats:
        with EventEmitter(
            url=hook.url, namespace="rl", name="c", token=TOKEN, batch_size=64, backoff=FAST
        ) as em:
            threads = [
                threading.Thread(target=lifecycle, args=(em, 25), kwargs={"prefix": f"w{k}-"})
                for k in range(4)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return em.stats  # close() flushed

    stats = await asyncio.to_thread(work)
    assert stats.emitted == stats.sent == hook.handle.applied == 4 * 234
    assert stats.pending == 0 and accounted(stats)


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_retries_429_503_and_dropped_connections_without_loss_or_double_apply(
    hook: Webhook, flavour: str
) -> None:
    hook.chaos.script = ["429", "503", "close", "lost-reply", "503"]
    kw = dict(url=hook.url, namespace="rl", name="c", token=TOKEN, batch_size=50, backoff=FAST)
    if flavour == "async":
        async with AsyncEventEmitter(**kw) as em:
            lifecycle(em, 25)
            assert await em.flush(timeout=10)
            stats = em.stats
    else:

        def work() -> EmitterStats:
            with EventEmitter(**kw) as em:
                lifecycle(em, 25)
                assert em.flush(timeout=10)
                return em.stats

        stats = await asyncio.to_thread(work)
    assert hook.chaos.seen == ["429", "503", "close", "lost-reply", "503"]
    assert stats.retries == 5
    assert stats.dropped == 0 and stats.sent == stats.emitted == 234
    # The lost reply's batch was applied once; its replay was counted as duplicates.
    assert hook.handle.applied == 234
    assert hook.handle.duplicates == stats.duplicates == 50
    assert hook.live == {"tool": 13}


async def test_server_refusing_some_events_drops_only_those(
    hook: Webhook, caplog: pytest.LogCaptureFixture
) -> None:
    async with AsyncEventEmitter(url=hook.url, namespace="rl", name="c", token=TOKEN) as em:
        em.request_queued("a", prompt_tokens=10, turn=0)
        em.request_queued("b", prompt_tokens=-1, turn=0)  # invalid: negative
        em.emit("tool_started", "c", tool="x" * 500)  # invalid: name too long
        em.request_queued("d", prompt_tokens=10, turn=0)
        em.emit("request_queued", "e", prompt_tokens=float("nan"), turn=0)  # not even JSON
        assert await em.flush()
        stats = em.stats
    assert stats.dropped_invalid == 3 and stats.sent == 2 and accounted(stats)
    assert hook.live == {"ready": 2}
    assert "prompt_tokens" in caplog.text and "not JSON" in caplog.text


async def test_any_json_value_arrives_as_emitted(hook: Webhook) -> None:
    """Non-ASCII names, and enum values (which the stdlib encoder writes, not the fast
    path): the server sees what was emitted."""

    class Tool(enum.StrEnum):
        BASH = "bash"

    class Turn(enum.IntEnum):
        FIRST = 0

    async with AsyncEventEmitter(
        url=hook.url, namespace="rl", name="c", token=TOKEN, backoff=FAST
    ) as em:
        em.sample_dispatched("traj-é✓", group="g", task="数学")
        em.request_queued("traj-é✓", prompt_tokens=1000, turn=Turn.FIRST)
        em.prefill_finished("traj-é✓")
        em.decode_finished("traj-é✓", output_tokens=5, finish="tool")
        em.tool_started("traj-é✓", tool=Tool.BASH)
        assert await em.flush()
        stats = em.stats
    assert stats.sent == 5 and stats.dropped == 0
    table = hook.handle.controller.table
    assert table.slot_of("traj-é✓") is not None
    assert table.tasks.get("数学") is not None and table.tools.get("bash") is not None
    assert hook.live == {"tool": 1}


async def test_too_large_batches_are_split() -> None:
    hook = await start_webhook(limits=IngestLimits(max_batch_bytes=3_000))
    try:
        async with AsyncEventEmitter(
            url=hook.url, namespace="rl", name="c", token=TOKEN, batch_size=200, backoff=FAST
        ) as em:
            lifecycle(em, 50)
            assert await em.flush(timeout=20)
            stats = em.stats
        assert stats.sent == hook.handle.applied == 475 and stats.dropped == 0
        assert stats.batches > 2  # split until each piece fit
        assert hook.handle.anomalies == 0  # and still in order
    finally:
        await hook.runner.cleanup()


# -- never blocks, never drops silently -------------------------------------------------


async def test_emit_never_blocks_while_the_server_hangs(hook: Webhook) -> None:
    hook.chaos.script = ["hang"]
    async with AsyncEventEmitter(
        url=hook.url, namespace="rl", name="c", token=TOKEN, batch_size=100, backoff=FAST
    ) as em:
        em.request_queued("first", prompt_tokens=1, turn=0)
        await em.flush(timeout=0.2)  # the first batch is now stuck in the server
        for i in range(5_000):  # no await: this would deadlock if emit() waited
            em.request_queued(f"t{i}", prompt_tokens=1, turn=0)
        assert em.stats.pending == 5_001
        hook.chaos.release.set()
        assert await em.flush(timeout=20)
        assert em.stats.sent == 5_001


async def test_full_buffer_drops_oldest_counts_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "prorsa_sdk")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    em = AsyncEventEmitter(
        url=dead, namespace="rl", name="c", token=TOKEN, batch_size=10, max_buffer=100, backoff=FAST
    )
    for i in range(250):
        em.request_queued(f"t{i}", prompt_tokens=1, turn=0)
    await asyncio.sleep(0.05)
    stats = await em.aclose(timeout=0.3)
    assert stats.dropped_overflow >= 140  # at most one batch of 10 left the buffer
    assert stats.dropped_overflow + stats.dropped_undeliverable == 250
    assert stats.sent == 0 and stats.pending == 0 and accounted(stats)
    assert "buffer full" in caplog.text
    assert "closing while undelivered" in caplog.text or "closed before" in caplog.text


async def test_wrong_token_is_retried_a_while_then_dropped_loudly(
    hook: Webhook, caplog: pytest.LogCaptureFixture
) -> None:
    async with AsyncEventEmitter(
        url=hook.url,
        namespace="rl",
        name="c",
        token="wrong",
        give_up_after=0.2,
        backoff=FAST,
    ) as em:
        em.request_queued("a", prompt_tokens=1, turn=0)
        assert await em.flush(timeout=5)
        stats = em.stats
    assert stats.dropped_undeliverable == 1 and stats.retries >= 2
    assert "HTTP 401" in caplog.text
    assert hook.handle.applied == 0


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_a_rotated_token_file_is_picked_up_and_nothing_is_lost(
    hook: Webhook, flavour: str, tmp_path: Path
) -> None:
    """The server's token rotates (no overlap): batches get 401 and are retried until the
    trainer's mounted token file holds the new token; then every event arrives."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    options = dict(url=hook.url, namespace="rl", name="c", token_file=token_file, backoff=FAST)
    em: AsyncEventEmitter | EventEmitter = (
        AsyncEventEmitter(**options) if flavour == "async" else EventEmitter(**options)
    )
    if isinstance(em, AsyncEventEmitter):
        await em.start()
    lifecycle(em, 4, prefix="before")
    assert await _flush(em)
    hook.handle.set_token("rotated")  # what the operator does when the Secret changes
    lifecycle(em, 4, prefix="after")
    await asyncio.sleep(0.3)  # some 401s meanwhile
    assert hook.handle.applied == 38
    tmp = tmp_path / "token.new"  # the kubelet's atomic swap of a Secret volume's files
    tmp.write_text("rotated\n")
    tmp.replace(token_file)
    assert await _flush(em)
    stats = await em.aclose() if isinstance(em, AsyncEventEmitter) else em.close()
    assert stats.retries >= 1 and stats.dropped == 0 and accounted(stats)
    assert hook.handle.applied == 76


async def _flush(em: AsyncEventEmitter | EventEmitter, timeout: float = 10) -> bool:
    if isinstance(em, AsyncEventEmitter):
        return await em.flush(timeout=timeout)
    return await asyncio.to_thread(em.flush, timeout)


def test_a_token_and_a_token_file_are_one_or_the_other(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        EventEmitter(url="http://x", namespace="rl", name="c")
    with pytest.raises(ValueError, match="holds no token"):
        (tmp_path / "empty").write_text("\n")
        EventEmitter(url="http://x", namespace="rl", name="c", token_file=tmp_path / "empty")


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_at_the_trajectory_limit_new_trajectories_wait_and_the_rest_flows(
    flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One emitter, a cluster that holds 4 live trajectories: the batch that starts four
    more is set aside (429 trajectory_limit) while the next batches, which end the first
    four, go through; then the set-aside batch gets in. Nothing is dropped, nothing waits
    forever behind the refused batch."""
    spec = make_spec(trainer={"maxLiveTrajectories": 4}, forecast={"horizonSeconds": 1})
    hook = await start_webhook(spec=spec)  # Retry-After: one horizon
    options = dict(url=hook.url, namespace="rl", name="c", token=TOKEN, backoff=FAST)
    em: AsyncEventEmitter | EventEmitter = (
        AsyncEventEmitter(**options) if flavour == "async" else EventEmitter(**options)
    )
    try:
        if isinstance(em, AsyncEventEmitter):
            await em.start()
        for i in range(4):
            em.request_queued(f"old{i}", prompt_tokens=100, turn=0)
        assert await _flush(em)
        for i in range(4):
            em.request_queued(f"new{i}", prompt_tokens=100, turn=0)
        assert not await _flush(em, timeout=0.3)  # refused, set aside: still pending
        assert em.stats.pending == 4 and "trajectory limit" in caplog.text
        for i in range(4):
            em.reward_finished(f"old{i}", accepted=True)
        assert await _flush(em, timeout=30)  # the ends go first, then the new ones fit
        stats = await em.aclose() if isinstance(em, AsyncEventEmitter) else em.close()
        assert stats.dropped == 0 and accounted(stats) and stats.retries >= 1
        assert sorted(hook.handle.controller.table._slots) == [f"new{i}" for i in range(4)]
    finally:
        await hook.runner.cleanup()


def test_sync_close_gives_up_within_its_timeout() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    em = EventEmitter(url=dead, namespace="rl", name="c", token=TOKEN, backoff=FAST)
    for i in range(30):
        em.request_queued(f"t{i}", prompt_tokens=1, turn=0)
    start = time.monotonic()
    stats = em.close(timeout=0.5)
    assert time.monotonic() - start < 4.0
    assert stats.dropped_undeliverable == 30 and accounted(stats)
    with pytest.raises(RuntimeError):
        em.request_queued("late", prompt_tokens=1, turn=0)


def test_closing_twice_returns_the_same_stats() -> None:
    """A second close (a `with` block and an atexit hook, say) returns at once; it used to
    wait forever for the lock it held."""
    em = EventEmitter(url=f"http://127.0.0.1:{free_port()}", namespace="rl", name="c", token=TOKEN)
    first = em.close(timeout=0.1)
    box: list[EmitterStats] = []
    closer = threading.Thread(target=lambda: box.append(em.close()), daemon=True)
    closer.start()
    closer.join(5.0)
    assert box == [first]


# -- resync -----------------------------------------------------------------------------


async def test_restarted_server_is_resynced_from_the_tracker() -> None:
    hook = await start_webhook()
    port = int(hook.url.rsplit(":", 1)[1])
    em = AsyncEventEmitter(
        url=hook.url, namespace="rl", name="c", token=TOKEN, track=True, backoff=FAST
    )
    try:
        lifecycle(em, 40)
        assert await em.flush()
        first_epoch = em.stats.epoch
        assert em.stats.resyncs == 1  # a fresh server asks once; the tracker answered
        assert hook.live == {"tool": 20}
        await hook.runner.cleanup()  # the operator restarts: all state is lost

        lifecycle(em, 10, prefix="late")  # emitted while it is down: retried
        await asyncio.sleep(0.1)
        hook = await start_webhook(port=port)
        assert await em.flush(timeout=20)
        stats = em.stats
        assert stats.epoch is not None and first_epoch is not None and stats.epoch > first_epoch
        assert stats.resyncs == 2 and stats.dropped == 0
        assert hook.handle.resync is False
        # The new server knows every live trajectory, including those from before.
        assert hook.live == {"tool": 25}
        tracked = em.snapshot_now()
        assert len(tracked.trajectories) == 25
    finally:
        await em.aclose()
        await hook.runner.cleanup()


async def test_workers_with_an_emitter_each_resync_without_erasing_each_other() -> None:
    """verl's layout: one tracked emitter per worker, each seeing its own trajectories. The
    operator restarts; each worker's snapshot replaces its own trajectories alone, so the
    new server knows all of them (without ids the last snapshot would erase the others)."""
    hook = await start_webhook()
    port = int(hook.url.rsplit(":", 1)[1])
    options = dict(url=hook.url, namespace="rl", name="c", token=TOKEN, backoff=FAST)
    workers = [
        AsyncEventEmitter(**options, track=True, emitter_id=f"worker-{rank}") for rank in range(3)
    ]
    try:
        for rank, em in enumerate(workers):
            lifecycle(em, 10, prefix=f"w{rank}-")
        assert all([await em.flush() for em in workers])
        assert hook.live == {"tool": 15}
        await hook.runner.cleanup()  # the operator restarts: all state is lost
        hook = await start_webhook(port=port)
        for rank, em in enumerate(workers):  # the next batch of each learns of the restart
            em.request_queued(f"w{rank}-0", prompt_tokens=1200, turn=1)
        assert all([await em.flush(timeout=20) for em in workers])
        assert all(em.stats.resyncs == 2 and em.stats.dropped == 0 for em in workers)
        assert hook.live == {"ready": 3, "tool": 12}  # every worker's trajectories
    finally:
        for em in workers:
            await em.aclose()
        await hook.runner.cleanup()


async def test_a_restarted_worker_clears_what_its_previous_process_left(hook: Webhook) -> None:
    """A worker process dies with trajectories live; its replacement (same emitter id)
    posts its own, empty, view when it starts: no ghost waits an hour for eviction."""
    options = dict(url=hook.url, namespace="rl", name="c", token=TOKEN, backoff=FAST)
    async with AsyncEventEmitter(**options, track=True, emitter_id="worker-7") as old:
        lifecycle(old, 6, prefix="old-")
        assert await old.flush()
    async with AsyncEventEmitter(**options, track=True, emitter_id="worker-8") as other:
        lifecycle(other, 2, prefix="other-")
        assert await other.flush()
    assert hook.live == {"tool": 4}
    async with AsyncEventEmitter(**options, track=True, emitter_id="worker-7") as new:
        new.sample_dispatched("new-0", task="swe")
        assert await new.flush()
        assert new.stats.resyncs == 1
    assert hook.live == {"starting": 1, "tool": 1}  # new-0 and other-0


def test_an_emitter_id_must_be_a_header_value() -> None:
    with pytest.raises(ValueError, match="emitter_id"):
        EventEmitter(url="http://x", namespace="rl", name="c", token=TOKEN, emitter_id="a b")


def test_sync_resync_uses_the_user_callback() -> None:
    async def main() -> None:
        hook = await start_webhook()
        calls = []

        def snapshot() -> list[dict]:
            calls.append(time.time())
            return [
                {"trajectory": "x", "state": "tool", "since": time.time() - 2, "context_tokens": 9},
                {
                    "trajectory": "y",
                    "state": "reward",
                    "since": time.time() - 1,
                    "context_tokens": 5,
                },
            ]

        def work() -> EmitterStats:
            with EventEmitter(
                url=hook.url, namespace="rl", name="c", token=TOKEN, snapshot=snapshot
            ) as em:
                em.request_queued("z", prompt_tokens=1, turn=0)
                em.flush()
                return em.stats

        try:
            stats = await asyncio.to_thread(work)
            assert len(calls) == 1 and stats.resyncs == 1
            assert hook.handle.resync is False
            assert hook.live == {"tool": 1, "reward": 1}  # the snapshot replaced the table
        finally:
            await hook.runner.cleanup()

    asyncio.run(main())


async def test_without_a_snapshot_source_the_resync_request_is_logged_once(
    hook: Webhook, caplog: pytest.LogCaptureFixture
) -> None:
    async with AsyncEventEmitter(
        url=hook.url, namespace="rl", name="c", token=TOKEN, batch_size=10
    ) as em:
        lifecycle(em, 10)
        assert await em.flush()
    assert caplog.text.count("no snapshot source") == 1
    assert hook.handle.resync is True


async def test_async_snapshot_callback_and_repair_after_drops(hook: Webhook) -> None:
    calls = 0

    async def snapshot() -> list[dict]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        return [{"trajectory": "kept", "state": "ready", "since": time.time(), "context_tokens": 3}]

    hook.chaos.script = ["hang"]
    async with AsyncEventEmitter(
        url=hook.url,
        namespace="rl",
        name="c",
        token=TOKEN,
        snapshot=snapshot,
        batch_size=10,
        max_buffer=20,
        backoff=FAST,
    ) as em:
        em.request_queued("first", prompt_tokens=1, turn=0)
        await em.flush(timeout=0.1)
        for i in range(50):  # overflows while the server hangs
            em.request_queued(f"t{i}", prompt_tokens=1, turn=0)
        hook.chaos.release.set()
        assert await em.flush(timeout=10)
        stats = em.stats
    assert stats.dropped_overflow == 30
    assert calls >= 1 and stats.resyncs >= 1
    assert hook.handle.resync is False


async def test_httpx_transport_errors_are_retried_too(hook: Webhook) -> None:
    """A transport that fails twice (e.g. DNS, TLS) before reaching the real server."""
    failures = 2
    real = httpx.AsyncHTTPTransport()

    class Flaky(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            nonlocal failures
            if failures:
                failures -= 1
                raise httpx.ConnectTimeout("simulated", request=request)
            return await real.handle_async_request(request)

    async with AsyncEventEmitter(
        url=hook.url, namespace="rl", name="c", token=TOKEN, transport=Flaky(), backoff=FAST
    ) as em:
        em.request_queued("a", prompt_tokens=1, turn=0)
        assert await em.flush()
        assert em.stats.retries == 2 and em.stats.sent == 1


# -- cluster events: weight updates -----------------------------------------------------


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_weight_update_helpers_reach_the_table(hook: Webhook, flavour: str) -> None:
    kw = dict(url=hook.url, namespace="rl", name="c", token=TOKEN, track=True, backoff=FAST)

    def emit(em: AsyncEventEmitter | EventEmitter) -> list[str]:
        lifecycle(em, 4)
        return [
            em.weight_update_started(version=7, expected_seconds=3.0, id="weights-7-started"),
            em.weight_update_started(version=7, id="weights-7-started"),  # a second reporter
        ]

    if flavour == "async":
        async with AsyncEventEmitter(**kw) as em:
            ids = emit(em)
            assert await em.flush()
            pending = em.snapshot_now().weight_update
            em.weight_update_finished(version=7, reprefill_trajectories=2)
            assert await em.flush()
            after = em.snapshot_now().weight_update
            stats = em.stats
    else:

        def work() -> tuple[list[str], object, object, EmitterStats]:
            with EventEmitter(**kw) as em:
                ids = emit(em)
                assert em.flush()
                pending = em.snapshot_now().weight_update
                em.weight_update_finished(version=7, reprefill_trajectories=2)
                assert em.flush()
                return ids, pending, em.snapshot_now().weight_update, em.stats

        ids, pending, after, stats = await asyncio.to_thread(work)
    assert ids == ["weights-7-started"] * 2
    assert stats.dropped_invalid == 0 and stats.duplicates == 1 and accounted(stats)
    assert hook.handle.anomalies == 0
    wu = hook.handle.controller.table.weight_update
    assert (wu.version, wu.pending, wu.expected_seconds, wu.reprefill_trajectories) == (
        7,
        False,
        3.0,
        2,
    )
    # What a resync would have posted while the update was under way, and after it.
    assert pending is not None and (pending.version, pending.expected_seconds) == (7, 3.0)  # type: ignore[attr-defined]
    assert after is None
