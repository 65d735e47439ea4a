"""The simulated KV hand-off between a prefill double and a decode double.

A PD router (smg) sends one request to a prefill engine and the same body to a decode
engine, adding ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``: the prefill
engine's address and a number both sides share. In SGLang the decode engine asks the
prefill engine's bootstrap server (mooncake's, on ``--disaggregation-bootstrap-port``) where
to receive the KV of that room, and the decode request starts only once the KV has
arrived; when the prefill side aborts, the transfer fails and the decode request is aborted.

The doubles keep that coupling without moving any KV:

* every double serves a bootstrap port (:func:`bootstrap_app`): ``GET /health`` answers
  ``OK`` as SGLang's bootstrap server does (smg checks at registration that the port
  accepts connections), and ``GET /_double/kv/{room}`` answers, once known, whether the
  prefill of that room finished (its KV transferred: the prefill double's request ends
  after its simulated transfer) or was aborted;
* the prefill side records each room's outcome in :class:`KvRooms` when its request ends;
* the decode side (:class:`KvFetcher`) long-polls the prefill's bootstrap server, so a
  decode request waits for its prefill plus the transfer, and a prefill abort (or a
  bootstrap server that cannot be reached) becomes a decode abort.

``/_double/kv/...`` is the double's own route; SGLang's bootstrap server has ``/route``
for the real rendezvous, which the doubles do not need.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from aiohttp import web

log = logging.getLogger("prorsa_lab.doubles.engine.kv_handoff")

Outcome = Literal["done", "aborted"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Bootstrap:
    """The bootstrap fields a PD router adds to a request."""

    host: str
    port: int
    room: int

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Bootstrap | None:
        """The fields of one (non-batched) ``/generate`` body; None when absent or batched."""
        host, port, room = (
            body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")
        )
        if not isinstance(host, str) or not host:
            return None
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            return None
        if not isinstance(room, int) or isinstance(room, bool):
            return None
        return cls(host=host, port=port, room=room)


@dataclass(slots=True)
class _Room:
    outcome: asyncio.Future[Outcome]
    created: float


@dataclass(kw_only=True)
class KvRooms:
    """The prefill side: each room's outcome, kept ``keep_seconds`` for a late decode ask.

    A decode double may ask before the prefill double has even received its half of the
    request (the router sends both at once), so asking creates the room too.
    """

    keep_seconds: float = 120.0
    _rooms: dict[int, _Room] = field(default_factory=dict)

    def _room(self, room: int) -> _Room:
        now = time.monotonic()
        entry = self._rooms.get(room)
        if entry is None:
            self._prune(now)
            entry = _Room(asyncio.get_running_loop().create_future(), now)
            self._rooms[room] = entry
        return entry

    def _prune(self, now: float) -> None:
        stale = [r for r, e in self._rooms.items() if now - e.created > self.keep_seconds]
        for room in stale:
            entry = self._rooms.pop(room)
            if not entry.outcome.done():
                entry.outcome.cancel()

    def resolve(self, room: int, outcome: Outcome) -> None:
        """The prefill of ``room`` ended; the first outcome stands."""
        entry = self._room(room)
        if not entry.outcome.done():
            entry.outcome.set_result(outcome)

    async def wait(self, room: int, timeout: float) -> Outcome | None:
        """The room's outcome, or None if it is still pending after ``timeout`` seconds."""
        entry = self._room(room)
        if not entry.outcome.done():
            await asyncio.wait({entry.outcome}, timeout=timeout)
        if not entry.outcome.done():
            return None
        # Cancelled: pruned before any prefill of this room ended, so the KV never comes.
        return "aborted" if entry.outcome.cancelled() else entry.outcome.result()

    def __len__(self) -> int:
        return len(self._rooms)


def bootstrap_app(rooms: Callable[[], KvRooms], *, poll_seconds: float = 10.0) -> web.Application:
    """The bootstrap server of one double (see the module docstring); ``rooms`` gives the
    engine's current registry (a restarted engine starts a new one)."""

    async def health(request: web.Request) -> web.Response:
        del request
        return web.Response(text="OK")

    async def kv(request: web.Request) -> web.Response:
        try:
            room = int(request.match_info["room"])
            timeout = min(float(request.query.get("timeout", poll_seconds)), 60.0)
        except ValueError:
            return web.json_response({"error": "room and timeout must be numbers"}, status=400)
        outcome = await rooms().wait(room, max(0.0, timeout))
        return web.json_response({"room": room, "status": outcome or "pending"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/_double/kv/{room}", kv)
    return app


class KvFetcher:
    """The decode side: waits for a room's KV at the prefill's bootstrap server."""

    def __init__(self, *, poll_seconds: float = 10.0, give_up_seconds: float = 600.0) -> None:
        self.poll_seconds = poll_seconds
        self.give_up_seconds = give_up_seconds
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, bootstrap: Bootstrap) -> bool:
        """True once the prefill's KV has arrived; False when the transfer failed."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.poll_seconds + 10)
            )
        url = f"http://{_host(bootstrap.host)}:{bootstrap.port}/_double/kv/{bootstrap.room}"
        deadline = time.monotonic() + self.give_up_seconds
        while time.monotonic() < deadline:
            try:
                async with self._session.get(
                    url, params={"timeout": str(self.poll_seconds)}
                ) as reply:
                    if reply.status != 200:
                        log.warning("bootstrap server %s answered %d", url, reply.status)
                        return False
                    status = str((await reply.json()).get("status"))
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.warning("KV hand-off from %s failed: %r", url, exc)
                return False
            if status in ("done", "aborted"):
                return status == "done"
        return False


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
