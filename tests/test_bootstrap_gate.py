"""The agent's gate on the PD bootstrap port (prorsa_agent.bootstrap_gate), in front of a
stand-in for SGLang's bootstrap server on loopback: what a decode engine's heartbeat and
route lookups get from it, closed and open."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest_asyncio
from aiohttp import web

from prorsa_agent.bootstrap_gate import BootstrapGate, hold_seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest_asyncio.fixture
async def sglang_bootstrap() -> AsyncIterator[tuple[int, list[tuple[str, bytes]]]]:
    """SGLang's bootstrap server as a decode engine sees it: /health always 200, /route."""
    seen: list[tuple[str, bytes]] = []

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def route(request: web.Request) -> web.Response:
        seen.append((request.method + " " + request.path_qs, await request.read()))
        if request.method == "PUT":
            return web.Response(text="registered")
        return web.json_response({"rank_ip": "10.0.0.7", "rank_port": 41234})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_route("*", "/route", route)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port, seen
    await runner.cleanup()


@contextlib.asynccontextmanager
async def _serving(engine_port: int, *, hold: float) -> AsyncIterator[BootstrapGate]:
    """A gate on a free loopback port in front of ``engine_port``, stopped at the end."""
    gate = BootstrapGate(
        host="127.0.0.1", port=0, engine_host="127.0.0.1", engine_port=engine_port, hold=hold
    )
    await gate.start()
    try:
        yield gate
    finally:
        await gate.stop()


async def test_closed_it_fails_heartbeats_and_passes_everything_else(sglang_bootstrap):
    port, seen = sglang_bootstrap
    async with (
        _serving(port, hold=60.0) as gate,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gate.port}") as c,
    ):
        assert not gate.is_open
        assert (await c.get("/health")).status_code == 503
        route = await c.get("/route", params={"engine_rank": 0, "target_dp_group": 0})
        assert route.status_code == 200
        assert route.json() == {"rank_ip": "10.0.0.7", "rank_port": 41234}
        put = await c.put("/route", json={"rank_port": 5})
        assert put.status_code == 200 and put.text == "registered"
    assert seen == [
        ("GET /route?engine_rank=0&target_dp_group=0", b""),
        ("PUT /route", b'{"rank_port":5}'),
    ]


async def test_it_opens_only_once_closed_for_the_hold(sglang_bootstrap):
    port, _ = sglang_bootstrap
    async with (
        _serving(port, hold=0.3) as gate,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gate.port}") as c,
    ):
        assert await gate.open()  # closed since the start; the hold may not be over
        assert (await c.get("/health")).status_code == 200
        gate.close()
        closed = time.monotonic()
        assert (await c.get("/health")).status_code == 503
        assert await gate.open()
        assert time.monotonic() - closed >= 0.3
        assert (await c.get("/health")).status_code == 200
        gate.close()
        gate.close()  # closed twice: still counted from the first
        opening = asyncio.create_task(gate.open())
        await asyncio.sleep(0)
        gate.close()  # the engine restarted meanwhile: decode, the gate stays closed
        assert await opening is False and not gate.is_open


async def test_an_open_gate_answers_heartbeats_itself_and_reports_a_dead_server():
    """The heartbeat is the gate's own answer (the agent closes it when the engine exits);
    a route lookup that cannot reach SGLang's server fails as it would without the gate."""
    async with _serving(_free_port(), hold=0.0) as gate:
        assert await gate.open()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gate.port}") as c:
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/route", params={"engine_rank": 0})).status_code == 502


async def test_heartbeats_are_answered_while_the_agents_loop_is_stalled(sglang_bootstrap):
    """The gate serves on a thread of its own: a decode engine gives up on a heartbeat
    after 3 s, and the agent's loop blocked longer than that must not drop a prefill."""
    port, _ = sglang_bootstrap
    async with _serving(port, hold=0.0) as gate:
        assert await gate.open()
        url = f"http://127.0.0.1:{gate.port}/health"

        def heartbeat() -> int:
            return httpx.get(url, timeout=30.0).status_code

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # Waited for here, blocking this loop (the agent's) the whole time: a gate
            # served on it could not answer, and this would raise after 30 s.
            assert pool.submit(heartbeat).result(timeout=30.0) == 200


def test_the_hold_outlasts_the_decode_engines_heartbeat_failures():
    assert hold_seconds({}) == 15.0  # SGLang's 2 failures, 5 s apart, and one more interval
    assert hold_seconds({"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1"}) == 3.0
    env = {"SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "4"}
    assert hold_seconds(env) == 25.0
    assert hold_seconds({"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "soon"}) == 15.0
