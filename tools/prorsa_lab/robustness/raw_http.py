"""A raw HTTP/1.1 client for hostile requests: any bytes, sent in pieces, stalled.

HTTP clients refuse to send what an attacker sends (a header with control characters, two
Content-Lengths, a body shorter than declared, a request that never ends), so the attack
suites write bytes on a socket of their own. Each request gets a fresh connection. The
reply is read concurrently with the writing, as a server may answer (413, 401) and close
before the body is sent, and parsed by h11 (httpx's HTTP/1.1 parser).

What comes back is an :class:`Outcome`: a status, or how the connection ended without
one: ``closed`` (the server hung up with no reply: its header deadline), ``reset`` (the
connection was reset before a reply could be read), ``timeout`` (the client's own
deadline passed: a server that never answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import h11

REPLY_LIMIT = 1 << 20  # bytes of a reply body kept


@dataclass(frozen=True, slots=True, kw_only=True)
class RawRequest:
    """Bytes to write on a fresh connection: ``pieces`` in order, ``pause`` seconds apart,
    then ``hold`` seconds with the connection open and nothing more sent."""

    pieces: tuple[bytes, ...]
    pause: float = 0.0
    hold: float = 0.0

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.pieces)


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """How one request ended: ``status`` when a reply came, else ``ending``."""

    status: int | None
    ending: str  # "reply" | "closed" | "reset" | "timeout"
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0

    @property
    def label(self) -> str:
        """The status as text, or the ending: what the summary counts by."""
        return str(self.status) if self.status is not None else self.ending

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        return next((v for k, v in self.headers if k == lowered), None)


def request_bytes(
    method: str,
    target: str,
    *,
    headers: list[tuple[str, str]] | list[tuple[bytes, bytes]] | None = None,
    body: bytes = b"",
    length: int | bool | None = True,
) -> bytes:
    """A request's head and body. ``length``: True sets Content-Length to the body's size,
    an int declares that size whatever the body, None or False sends none."""
    lines = [f"{method} {target} HTTP/1.1".encode(), b"Host: prorsa-attack", b"Connection: close"]
    for name, value in headers or []:
        n = name if isinstance(name, bytes) else name.encode("latin-1")
        v = value if isinstance(value, bytes) else value.encode("latin-1")
        lines.append(n + b": " + v)
    if length is True:
        lines.append(f"Content-Length: {len(body)}".encode())
    elif isinstance(length, int) and not isinstance(length, bool):
        lines.append(f"Content-Length: {length}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def chunked(*parts: bytes, last: bool = True) -> bytes:
    """``parts`` as chunked transfer coding (with the final zero chunk when ``last``)."""
    out = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts if p)
    return out + (b"0\r\n\r\n" if last else b"")


async def send(host: str, port: int, request: RawRequest, *, deadline: float) -> Outcome:
    """Send ``request`` on a new connection and read the reply within ``deadline`` s."""
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), deadline)
    except (OSError, TimeoutError):
        return Outcome(status=None, ending="reset", seconds=time.perf_counter() - start)
    parser = h11.Connection(our_role=h11.CLIENT)
    # h11 reads replies only once it has seen a request: give it one it never sends.
    parser.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    parser.send(h11.EndOfMessage())

    async def write() -> None:
        for i, piece in enumerate(request.pieces):
            if i and request.pause:
                await asyncio.sleep(request.pause)
            writer.write(piece)
            await writer.drain()
        if request.hold:
            await asyncio.sleep(request.hold)

    writing = asyncio.ensure_future(write())
    try:
        outcome = await asyncio.wait_for(_read(reader, parser), deadline)
    except TimeoutError:
        outcome = Outcome(status=None, ending="timeout")
    finally:
        writing.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await writing
        writer.transport.abort()
    return Outcome(
        status=outcome.status,
        ending=outcome.ending,
        body=outcome.body,
        headers=outcome.headers,
        seconds=time.perf_counter() - start,
    )


async def _read(reader: asyncio.StreamReader, parser: h11.Connection) -> Outcome:
    status: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    body = bytearray()
    while True:
        try:
            event = parser.next_event()
        except h11.RemoteProtocolError:
            # Bytes that are no HTTP reply: count what came as a reply we could not parse.
            return Outcome(status=status, ending="reply" if status else "reset")
        if event is h11.NEED_DATA:
            try:
                data = await reader.read(65536)
            except OSError:
                return Outcome(
                    status=status, ending="reply" if status else "reset", body=bytes(body)
                )
            parser.receive_data(data)
            continue
        if isinstance(event, h11.Response):
            status = event.status_code
            headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers)
        elif isinstance(event, h11.Data):
            if len(body) < REPLY_LIMIT:
                body += event.data[: REPLY_LIMIT - len(body)]
        elif isinstance(event, h11.EndOfMessage):
            return Outcome(status=status, ending="reply", body=bytes(body), headers=headers)
        elif isinstance(event, h11.ConnectionClosed):
            if status is not None:
                return Outcome(status=status, ending="reply", body=bytes(body), headers=headers)
            return Outcome(status=None, ending="closed")
