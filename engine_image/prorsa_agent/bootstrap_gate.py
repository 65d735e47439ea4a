"""The PD bootstrap port, served by the agent in front of SGLang's own bootstrap server.

SGLang 0.5.23's decode engines keep, per prefill bootstrap address, the prefill ranks' ZMQ
ports and the fact that they registered their KV buffers there
(``srt/disaggregation/common/conn.py``, ``CommonKVReceiver._setup_bootstrap_infos`` and the
manager's ``connection_pool``). A role flip tears the prefill's KV manager down, and a flip
back to prefill builds a new one on new ports, with no registrations, at the same address:
a decode engine that served with it before pairs with it again through its stale entry, and
the request waits (in the prefill's bootstrap queue, and on the decode side for its KV)
until ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s) fails it. Found by the real-engine
operator test: an engine flipped prefill -> decode -> prefill, and the next request through
smg hung. A decode engine drops an address only when the bootstrap server's ``/health``
fails ``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` (2) checks in a row, one every
``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL`` (5 s) (``_start_heartbeat_checker_thread``,
``_handle_node_failure``), and SGLang's own ``/health`` there always answers 200.

So the agent serves the bootstrap port the pod announces (``sglang.ai/bootstrap-port``) and
SGLang's server listens on another one that the agent sets (``--disaggregation-bootstrap-port``):
every request is passed through but ``/health``, which the gate answers itself: 503 while the
engine is not serving as prefill (or not running), 200 otherwise. After a flip to prefill
the gate opens only once it has been closed for ``hold`` seconds, the decodes' failed checks
and one more interval for their phase: by then every decode engine has dropped what it kept
of the engine's last prefill term. The switch reports
success (the operator relabels the pod, smg routes to it) only once the gate is open, so a
flip back within ``hold`` takes that much longer, and any later one nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping

import aiohttp
from aiohttp import web

log = logging.getLogger("prorsa_agent.bootstrap_gate")

HEARTBEAT_INTERVAL_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"
HEARTBEAT_FAILURES_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"
HEARTBEAT_INTERVAL = 5.0
HEARTBEAT_FAILURES = 2
"""SGLang 0.5.23's defaults for the two (``srt/environ.py``)."""

MAX_BODY = 1 << 20
"""The bootstrap server's requests carry a rank's address or a few room ids."""


def hold_seconds(env: Mapping[str, str]) -> float:
    """How long the gate stays closed before it opens: every decode engine's heartbeat has
    failed as often as it takes to drop the address, plus one interval for where in its
    period each decode was. Read from the variables the decode engines run with (the
    operator gives every engine pod the same environment)."""
    try:
        interval = float(env.get(HEARTBEAT_INTERVAL_ENV) or HEARTBEAT_INTERVAL)
        failures = int(env.get(HEARTBEAT_FAILURES_ENV) or HEARTBEAT_FAILURES)
    except ValueError:
        interval, failures = HEARTBEAT_INTERVAL, HEARTBEAT_FAILURES
    return max(0.0, interval) * (max(1, failures) + 1)


class BootstrapGate:
    """``await gate.start()``; ``close()`` when the engine leaves prefill (or exits, or
    restarts in its launch role decode); ``await gate.open()`` once it serves as prefill
    again. ``close``/``open`` run on the agent's loop; the server on the gate's own thread
    reads only whether it is open."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        engine_host: str,
        engine_port: int,
        hold: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host = host
        self.port = port
        self.upstream = f"http://{engine_host}:{engine_port}"
        self.hold = hold
        self._clock = clock
        # The engine starts as decode: closed from the start.
        self._closed_since: float | None = clock()
        self._closings = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def is_open(self) -> bool:
        return self._closed_since is None

    def close(self) -> None:
        """The engine is not serving as prefill (any more): decode engines asking the
        gate's ``/health`` hear 503 from now on."""
        self._closings += 1
        if self._closed_since is None:
            self._closed_since = self._clock()
            log.info("bootstrap port %d closed: the engine is not serving as prefill", self.port)

    async def open(self) -> bool:
        """Open once closed for ``hold`` seconds; False if closed again meanwhile (the
        engine restarted: it serves as decode)."""
        closings = self._closings
        while self._closed_since is not None:
            left = self._closed_since + self.hold - self._clock()
            if left <= 0:
                self._closed_since = None
                log.info("bootstrap port %d open: the engine serves as prefill", self.port)
                break
            log.info(
                "bootstrap port %d opens in %.1f s (decode engines drop stale ports)",
                self.port,
                left,
            )
            await asyncio.sleep(left)
            if self._closings != closings:
                return False
        return True

    async def start(self) -> None:
        """Serve on a thread and event loop of its own: a decode engine's heartbeat gives up
        after 3 s (``timeout=(2, 3)``), and two late answers drop a prefill that serves. The
        agent's loop (in tests, the whole stack's on a busy 2-core machine) once stalled that
        long, and an open gate on it looked like a dead prefill."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=loop.run_forever, name=f"bootstrap-gate-{self.port}", daemon=True
        )
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._serve(), loop))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None
        with contextlib.suppress(Exception):
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._shutdown(), loop))
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join, 5.0)
        if not thread.is_alive():
            loop.close()

    async def _serve(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=10), auto_decompress=False
        )
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        self._runner = runner
        await web.TCPSite(runner, self.host, self.port, reuse_address=True).start()
        if self.port == 0:
            self.port = int(runner.addresses[0][1])

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _forward(self, request: web.Request) -> web.Response:
        if request.path == "/health":
            # Answered here: the agent closes the gate whenever the engine is not running
            # as prefill (an exit included), which is all a decode's heartbeat asks.
            if not self.is_open:
                return web.Response(status=503, text="not serving as prefill")
            return web.Response(text="OK")
        assert self._session is not None
        body = await request.read()
        headers = {"Content-Type": request.content_type} if body else {}
        try:
            async with self._session.request(
                request.method,
                self.upstream + request.path_qs,
                data=body or None,
                headers=headers,
            ) as reply:
                payload = await reply.read()
                return web.Response(
                    status=reply.status,
                    body=payload,
                    content_type=reply.content_type if payload else None,
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            # As a decode engine would find SGLang's own server down: a failed check.
            return web.Response(status=502, text=f"the engine's bootstrap server: {exc!r}")
