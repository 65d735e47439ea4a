"""Slow and stalled clients cannot hold the webhook's connections or its memory budget.

Raw sockets on loopback send headers or bodies slowly, or stop halfway. The timeouts are
shortened for the tests; every wait is a generous deadline on an eventual outcome, never
a tight timing, so a loaded machine makes the tests slower but not flaky.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from conftest import make_spec

from prorsa.clusters import ClusterRegistry, IngestLimits
from prorsa.core.controller import Controller
from prorsa.ingest import WebhookServer

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BASE = "/v1/namespaces/rl/rolloutclusters/c"
PATIENCE = 30.0  # seconds to wait for an eventual outcome on a loaded machine


def batch(prefix: str, n: int) -> bytes:
    now = time.time()
    events = [
        {
            "id": f"{prefix}{i}",
            "type": "request_queued",
            "trajectory": f"{prefix}-t{i}",
            "ts": now,
            "prompt_tokens": 1000,
            "turn": 0,
        }
        for i in range(n)
    ]
    return json.dumps({"events": events}).encode()


@dataclass
class Served:
    url: str
    http: httpx.AsyncClient
    server: WebhookServer

    async def post(self, body: bytes) -> httpx.Response:
        headers = {**AUTH, "Content-Type": "application/json"}
        return await self.http.post(f"{BASE}/events", content=body, headers=headers)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        parts = urlsplit(self.url)
        assert parts.hostname is not None and parts.port is not None
        return await asyncio.open_connection(parts.hostname, parts.port)


@asynccontextmanager
async def serve(limits: IngestLimits) -> AsyncIterator[Served]:
    registry = ClusterRegistry(limits=limits)
    registry.add(namespace="rl", name="c", token=TOKEN, controller=Controller(make_spec()))
    server = WebhookServer(registry)
    async with server.serving() as url, httpx.AsyncClient(base_url=url, timeout=PATIENCE) as http:
        yield Served(url=url, http=http, server=server)


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {PATIENCE}s: {what}"
        await asyncio.sleep(0.02)


async def closed_within_patience(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection.

    A server that closes while bytes the client trickled are still unread in its socket
    makes the kernel answer with a reset instead of an orderly close (on a loaded machine
    the trickle often gets there first): closed all the same, with nothing answered.
    """
    chunks: list[bytes] = []

    async def drain() -> None:
        while chunk := await reader.read(65536):
            chunks.append(chunk)

    with suppress(ConnectionResetError):
        await asyncio.wait_for(drain(), timeout=PATIENCE)
    return b"".join(chunks)


def request_head(*, length: int | None, extra: str = "") -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"POST {BASE}/events HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n{extra}\r\n"
    ).encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


# -- headers ----------------------------------------------------------------------------


async def test_a_connection_that_never_finishes_its_headers_is_closed() -> None:
    async with serve(IngestLimits(header_timeout_seconds=0.5)) as srv:
        reader, writer = await srv.connect()
        writer.write(f"POST {BASE}/events HTTP/1.1\r\nHost: test\r\n".encode())
        await writer.drain()
        assert await closed_within_patience(reader) == b""  # closed, nothing answered
        writer.close()

        # Trickling a byte at a time does not keep a connection open either.
        reader, writer = await srv.connect()

        async def trickle() -> None:
            for byte in f"POST {BASE}/events HTTP/1.1\r\nX-Padding: {'a' * 4000}":
                writer.write(byte.encode())
                await asyncio.sleep(0.05)

        dripping = asyncio.create_task(trickle())
        try:
            assert await closed_within_patience(reader) == b""
        finally:
            dripping.cancel()
            writer.close()
        # Meanwhile and afterwards, normal trainers are served.
        assert (await srv.post(batch("n", 3))).status_code == 200


async def test_headers_sent_within_the_timeout_are_served_normally() -> None:
    async with serve(IngestLimits(header_timeout_seconds=5.0)) as srv:
        reader, writer = await srv.connect()
        body = batch("a", 2)
        head = request_head(length=len(body), extra="Connection: close\r\n")
        for i in range(0, len(head), 40):  # slowly, but well within the timeout
            writer.write(head[i : i + 40])
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(body)
        reply = await closed_within_patience(reader)
        writer.close()
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


# -- bodies -----------------------------------------------------------------------------


async def test_a_stalled_body_gets_408_and_releases_what_it_held() -> None:
    limits = IngestLimits(body_timeout_seconds=0.5)
    async with serve(limits) as srv:
        body = batch("s", 28)
        reader, writer = await srv.connect()
        writer.write(request_head(length=len(body)) + body[:500])
        await writer.drain()
        reply = await closed_within_patience(reader)
        writer.close()
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"0.5" in reply and b"body" in reply  # says what took too long
        await until(lambda: srv.server.inflight_bytes == 0, "budget released")
        value = srv.server.metrics.registry.get_sample_value(
            "prorsa_webhook_rejects_total", {"reason": "timeout"}
        )
        assert value == 1
        assert (await srv.post(batch("n", 3))).status_code == 200


async def test_stalled_clients_hold_only_the_bytes_they_sent() -> None:
    """Four bodies without a Content-Length, stalled after a few bytes, once reserved the
    whole batch limit each: a normal batch then got 429 until they gave up."""
    limits = IngestLimits(max_batch_bytes=4_000, max_inflight_bytes=6_000)
    async with serve(limits) as srv:
        stalled = []
        for _ in range(4):
            reader, writer = await srv.connect()
            writer.write(request_head(length=None) + chunk(b'{"events": ['))
            await writer.drain()
            stalled.append((reader, writer))
        await until(lambda: srv.server.inflight_bytes == 4 * 12, "stalled bodies counted")
        normal = batch("n", 28)
        assert 3_000 < len(normal) < 4_000
        r = await srv.post(normal)
        assert r.status_code == 200, r.text
        for _, writer in stalled:
            writer.close()
        await until(lambda: srv.server.inflight_bytes == 0, "budget released on hang-up")


async def test_bytes_that_arrived_count_against_the_budget() -> None:
    limits = IngestLimits(max_batch_bytes=4_000, max_inflight_bytes=6_000)
    async with serve(limits) as srv:
        big = batch("b", 28)
        reader, writer = await srv.connect()
        writer.write(request_head(length=len(big)) + big[:3_000])
        await writer.drain()
        await until(lambda: srv.server.inflight_bytes == 3_000, "partial body counted")
        r = await srv.post(batch("n", 28))  # 3.4 kB more than 6 kB can hold
        assert r.status_code == 429
        assert int(r.headers["Retry-After"]) >= 1
        writer.write(big[3_000:])  # the slow body completes: both fit one after the other
        reply = await closed_within_patience_or_reply(reader)
        writer.close()
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        await until(lambda: srv.server.inflight_bytes == 0, "budget released")
        assert (await srv.post(batch("n", 28))).status_code == 200


async def test_a_body_declared_past_the_limit_is_413_even_while_the_budget_is_held() -> None:
    """Found by `prorsa bench attack`: while other bodies held the in-flight budget, a
    body declared past the size limit got 429 "retry shortly", which no retry could ever
    satisfy. The declared size is checked first: 413, as when the server is idle."""
    limits = IngestLimits(max_batch_bytes=4_000, max_inflight_bytes=6_000)
    async with serve(limits) as srv:
        big = batch("b", 28)
        _reader, writer = await srv.connect()
        writer.write(request_head(length=len(big)) + big[:3_000])
        await writer.drain()
        try:
            await until(lambda: srv.server.inflight_bytes == 3_000, "partial body counted")
            for what, size in (("events", 5_000), ("snapshot", 64 << 20)):
                oversized = request_head(length=size).replace(b"/events", f"/{what}".encode())
                r_reader, r_writer = await srv.connect()
                r_writer.write(oversized)
                await r_writer.drain()
                reply = await closed_within_patience_or_reply(r_reader)
                r_writer.close()
                assert reply.startswith(b"HTTP/1.1 413"), (what, reply[:200])
            # A batch that fits the limit but not the budget now is still told to retry.
            assert (await srv.post(batch("n", 28))).status_code == 429
        finally:
            writer.close()


async def closed_within_patience_or_reply(reader: asyncio.StreamReader) -> bytes:
    """The status line and headers of one reply on a kept-alive connection."""
    return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=PATIENCE)


async def test_many_slow_bodies_neither_block_trainers_nor_stay_forever() -> None:
    """The issue's scenario, scaled down: more slow bodies than the budget could reserve,
    each sending a little at a time. Trainers are served meanwhile; the slow ones get 408."""
    limits = IngestLimits(
        max_batch_bytes=4_000, max_inflight_bytes=10_000, body_timeout_seconds=2.0
    )
    async with serve(limits) as srv:

        async def slow_sender(i: int) -> bytes:
            body = batch(f"slow{i}-", 28)
            reader, writer = await srv.connect()
            writer.write(request_head(length=len(body)))

            async def drip() -> None:
                for k in range(0, len(body), 20):
                    writer.write(body[k : k + 20])
                    await writer.drain()
                    await asyncio.sleep(0.2)

            dripping = asyncio.create_task(drip())
            try:
                return await closed_within_patience_or_reply(reader)
            except (ConnectionError, asyncio.IncompleteReadError):
                return b"closed"
            finally:
                dripping.cancel()
                writer.close()

        senders = [asyncio.create_task(slow_sender(i)) for i in range(8)]  # 3x the budget
        await until(lambda: srv.server.inflight_bytes >= 8 * 20, "slow bodies arriving")
        r = await srv.post(batch("n", 28))
        assert r.status_code == 200, r.text
        replies = await asyncio.wait_for(asyncio.gather(*senders), timeout=PATIENCE * 2)
        assert all(r.startswith(b"HTTP/1.1 408") for r in replies), replies
        await until(lambda: srv.server.inflight_bytes == 0, "budget released")
        assert (await srv.post(batch("m", 28))).status_code == 200
