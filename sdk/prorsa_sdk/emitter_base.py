"""What both emitters share: their options, TLS, the token and recording, ``emit()``.

:class:`EmitterBase` holds the :class:`~prorsa_sdk.emitter_core.EmitterCore` and the
public surface (the typed helpers, ``emit``, ``stats``); each driver adds its sender and
executes the core's actions: :class:`~prorsa_sdk.sync_emitter.EventEmitter` on a thread,
:class:`~prorsa_sdk.async_emitter.AsyncEventEmitter` on asyncio.
"""

from __future__ import annotations

import os
import ssl
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import httpx
from pydantic import BaseModel

from prorsa_contract import __version__
from prorsa_contract.events import EMITTER_HEADER, Snapshot
from prorsa_sdk.emitter_core import (
    CoreOptions,
    EmitterCore,
    EmitterStats,
    Reply,
    SnapshotRows,
)
from prorsa_sdk.emitter_files import Recording, TokenFile
from prorsa_sdk.event_helpers import EventHelpers

SENT_AT_HEADER = "X-Prorsa-Sent-At"

SnapshotSource = Callable[[], SnapshotRows]
AsyncSnapshotSource = Callable[[], SnapshotRows | Awaitable[SnapshotRows]]


TlsVerify = str | os.PathLike[str] | ssl.SSLContext | None
"""A CA bundle path, a ready context, or None for the system trust store."""


def tls_context(verify: TlsVerify) -> ssl.SSLContext:
    """The client context that checks the webhook's certificate (hostname included)."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    if verify is None:
        return ssl.create_default_context()
    path = os.fspath(verify)
    if not os.path.isfile(path):
        raise ValueError(f"verify: no CA bundle at {path!r}")
    return ssl.create_default_context(cafile=path)


class EmitterOptions(CoreOptions, total=False):
    """The settings both emitters take by keyword: the core's (:class:`CoreOptions`) and
    the token and recording, which the drivers handle (defaults in brackets)."""

    token: str  # the trainer's bearer token, or:
    token_file: str | os.PathLike[str]  # a file holding it, re-read when it changes
    record: str | os.PathLike[str] | None  # [None] append accepted events here (NDJSON)


_DRIVER_OPTIONS = frozenset(("token", "token_file", "record"))


class EmitterBase(EventHelpers):
    """Buffering and the public surface both emitters share; the sender is theirs."""

    def __init__(self, *, has_snapshot: bool, options: EmitterOptions) -> None:
        token, token_file = options.get("token"), options.get("token_file")
        record = options.get("record")
        settings = cast(CoreOptions, {k: v for k, v in options.items() if k not in _DRIVER_OPTIONS})
        recording = None if record is None else os.fspath(record)
        self._core = EmitterCore(has_snapshot=has_snapshot, recording=recording, **settings)
        if (token is None) == (token_file is None):
            raise ValueError("give the bearer token as token= or as token_file= (exactly one)")
        self._token_file = TokenFile(token_file) if token_file is not None else None
        self._headers = {
            "Authorization": f"Bearer {(token or '').strip()}",
            "Content-Type": "application/json",
            "User-Agent": f"prorsa-sdk/{__version__}",
        }
        if self._core.emitter_id is not None:
            self._headers[EMITTER_HEADER] = self._core.emitter_id
        # Opened last, so a bad setting creates no file; an unwritable path fails here.
        self._recording = None if record is None else Recording(record)
        self._flushing = 0
        self._closing = False

    @property
    def stats(self) -> EmitterStats:
        return self._core.stats()

    def snapshot_now(self) -> Snapshot:
        """The tracker's snapshot (``track=True``): what a resync would post."""
        if self._core.tracker is None:
            raise RuntimeError("snapshot_now() needs track=True")
        return self._core.tracked_snapshot()

    def emit(
        self,
        type: str,
        trajectory: str | None,
        *,
        ts: float | None = None,
        id: str | None = None,
        **fields: Any,
    ) -> str:
        """Buffer one event (never blocks on I/O, never awaits); returns its id. Thread-safe.

        ``trajectory`` is None for the cluster events (weight updates), which name none.
        """
        event = self._core.make(type, trajectory, ts, id, fields)
        self._pushed(self._core.push(event))
        ident: str = event["id"]
        return ident

    def emit_event(self, event: BaseModel | Mapping[str, Any]) -> str:
        """Buffer a pre-built event (a :mod:`prorsa_contract.events` model or a wire dict)."""
        data = event.model_dump(exclude_none=True) if isinstance(event, BaseModel) else dict(event)
        self._pushed(self._core.push(data))
        return str(data["id"])

    def _pushed(self, n: int) -> None:
        """The buffer holds ``n`` events: a first one starts the flush timer, a full batch
        is due; either way the sender must look."""
        if n == 1 or n == self._core.batch_size:
            self._kick()

    @abstractmethod
    def _kick(self) -> None:
        """Wake the sender."""

    # -- what the drivers share to execute the core's actions ------------------------------

    def _send_headers(self) -> dict[str, str]:
        """A request's headers: the token as the token file holds it now, and the time."""
        headers = {**self._headers, SENT_AT_HEADER: repr(self._core.clock())}
        if self._token_file is not None:
            headers["Authorization"] = f"Bearer {self._token_file.token()}"
        return headers

    def _record(self, batch: list[bytes]) -> None:
        """Append ``batch`` to the recording (blocking: the sender's thread)."""
        if self._recording is not None and self._recording.write(batch):
            self._core.recorded(len(batch))

    def _close_out(self) -> EmitterStats:
        """Closed: the recording too; what is still buffered is counted as dropped."""
        if self._recording is not None:
            self._recording.close()
        return self._core.close_out()


def as_reply(response: httpx.Response) -> Reply:
    """What the core is sent for an HTTP answer."""
    return Reply(status=response.status_code, headers=response.headers, body=response.content)
