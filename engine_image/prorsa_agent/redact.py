"""Keeping the engine admin key out of the pod's log.

The agent passes the key to SGLang as ``--admin-api-key``, and SGLang 0.5.23 prints its
resolved server arguments, that key included, when it starts (``srt/entrypoints/engine.py``
logs ``server_args=...`` at INFO, redacting only watermark secrets). So the agent reads the
engine's stdout and stderr itself and writes them on with every secret replaced: whoever
can read ``kubectl logs`` must not learn a key that unlocks ``/pd_role_switch``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

REDACTED = b"<redacted>"
CHUNK = 64 * 1024


def redact_argv(argv: Sequence[str], secrets: Sequence[str]) -> list[str]:
    """``argv`` with every secret replaced, for printing the engine command."""
    out = []
    for arg in argv:
        for secret in secrets:
            if secret:
                arg = arg.replace(secret, REDACTED.decode())
        out.append(arg)
    return out


class Redactor:
    """Replaces secrets in a byte stream read in arbitrary chunks.

    A secret may be split across two reads, so the last ``len(longest secret) - 1`` bytes
    are held back until the next chunk (or the end) shows whether they start one. A newline
    ends every secret (they are single tokens), so a chunk that ends a line is written whole:
    log lines are never delayed.
    """

    def __init__(self, secrets: Sequence[str]) -> None:
        self._secrets = sorted({s.encode() for s in secrets if s}, key=len, reverse=True)
        self._hold = max((len(s) for s in self._secrets), default=1) - 1
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._replace(self._pending + chunk)
        if data.endswith(b"\n") or self._hold == 0:
            self._pending = b""
            return data
        cut = max(len(data) - self._hold, data.rfind(b"\n") + 1)
        self._pending = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        data, self._pending = self._replace(self._pending), b""
        return data

    def _replace(self, data: bytes) -> bytes:
        for secret in self._secrets:
            data = data.replace(secret, REDACTED)
        return data


async def pump(
    reader: asyncio.StreamReader, write: Callable[[bytes], None], redactor: Redactor
) -> None:
    """Copy ``reader`` to ``write`` through ``redactor`` until the end of the stream."""
    while True:
        chunk = await reader.read(CHUNK)
        if not chunk:
            break
        out = redactor.feed(chunk)
        if out:
            write(out)
    rest = redactor.flush()
    if rest:
        write(rest)
