"""Trainer SDK: emit lifecycle events to the Prorsa webhook without ever blocking training.

``emit()`` encodes the event as JSON and appends it to a bounded in-memory buffer (a few
microseconds, never I/O, never a wait); a background sender (a thread for
:class:`EventEmitter`, a task for :class:`AsyncEventEmitter`) ships batches when
``batch_size`` events are buffered or ``flush_interval`` has passed, one request at a time
so the server applies events in the order they were emitted.

Delivery, both flavours (the policy is written once, in :meth:`_Core.deliver`, as a
generator of actions that the thread and the task each execute):

* 429, 5xx, connection errors and timeouts are retried with exponential backoff and full
  jitter, honouring Retry-After, until the emitter is closed. Event ids make retries
  idempotent: the server counts a replayed id instead of applying it twice. A 429 for the
  cluster's live-trajectory limit (``reason: trajectory_limit``: the batch applied but for
  the events that start new trajectories) sets the batch aside until Retry-After and sends
  the newer events meanwhile: their ends of trajectories are what makes room.
* 422: the server names the bad events; they are dropped (counted, logged with the
  reason) and the rest of the batch is sent again. 413: the batch is split in halves.
* 401 / 404 (a token being rotated, a cluster the operator is still registering) are
  retried for ``give_up_after`` seconds, then the batch is dropped, counted and logged.
  With ``token_file=`` (a mounted Secret) every request carries the file's token as it is
  then: a rotated Secret reaches the emitter when the kubelet refreshes the file.
* When the buffer is full the *oldest* events are dropped, counted in
  ``stats.dropped_overflow`` and logged (rate-limited); if a snapshot source is
  available the emitter then posts a snapshot, which repairs the server's view.
* A reply with ``resync: true`` (the server restarted and lost its state) makes the
  emitter post ``POST .../snapshot`` built by the ``snapshot`` callback (or by the
  built-in tracker with ``track=True``) before sending more events.
* ``emitter_id=`` names the emitter (``X-Prorsa-Emitter``) for trainers that run one per
  worker: its snapshots then replace only the trajectories it reported, so each worker
  resyncs on its own (and, with a snapshot source, once when it starts, which clears what
  a previous process of the same id left). Without it a snapshot replaces every trajectory.
* ``close()`` flushes what is buffered, within a timeout; whatever could not be delivered
  by then is counted as dropped and logged, never silently lost.

Recording: with ``record="events.ndjson"`` every event the webhook accepted is also
appended to that file, one JSON object per line, in the order the webhook applied it (a
batch is written once its 2xx reply arrives; events the webhook refused are left out), so
``prorsa plan --events`` replays the job as the operator saw it. The sender writes it (the
asyncio flavour from a thread), never ``emit()``.

TLS: an ``https://`` webhook's certificate is verified against ``verify``: a CA bundle
path (the webhook Secret's ``ca.crt``, a cert-manager issuer's CA), an ``ssl.SSLContext``,
or, by default, the system trust store. A certificate that does not verify is a
connection error like any other: retried, never sent around.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import logging
import math
import os
import random
import ssl
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Required, TypedDict, Unpack

import httpx
from pydantic import BaseModel
from pydantic_core import to_json

from prorsa_contract import __version__
from prorsa_contract.aio import cancel_and_wait
from prorsa_contract.events import EMITTER_HEADER, Snapshot, SnapshotTrajectory, valid_emitter
from prorsa_sdk.tracker import TrajectoryTracker

log = logging.getLogger("prorsa_sdk")

SENT_AT_HEADER = "X-Prorsa-Sent-At"
REPAIR_INTERVAL = 10.0  # seconds between snapshots that repair the server after drops

SnapshotRows = Snapshot | Iterable[SnapshotTrajectory | Mapping[str, Any]]
SnapshotSource = Callable[[], SnapshotRows]
AsyncSnapshotSource = Callable[[], SnapshotRows | Awaitable[SnapshotRows]]


@dataclass(frozen=True, slots=True)
class EmitterStats:
    """Counters since the emitter started; every event emitted ends up in exactly one of
    ``sent``, a ``dropped_*`` counter, or ``pending``."""

    emitted: int
    sent: int
    applied: int
    duplicates: int
    superseded: int
    dropped_overflow: int
    dropped_invalid: int
    dropped_undeliverable: int
    pending: int
    batches: int
    retries: int
    resyncs: int
    epoch: int | None
    recorded: int = 0  # events written to the ``record`` file

    @property
    def dropped(self) -> int:
        return self.dropped_overflow + self.dropped_invalid + self.dropped_undeliverable


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: sleep U(0, min(cap, base * 2**attempt))."""

    base: float = 0.05
    cap: float = 5.0

    def delay(self, attempt: int, *, retry_after: float | None = None) -> float:
        ceiling = min(self.cap, self.base * (2 ** min(attempt, 30)))
        pause = random.uniform(0.0, ceiling)
        if retry_after is not None:
            # The server said when; add a little jitter so clients do not return in step.
            pause = max(pause, retry_after * random.uniform(1.0, 1.2))
        return pause


# -- the delivery policy, written once as a generator (sans I/O) --------------------------


@dataclass(frozen=True, slots=True)
class _Post:
    path: str
    body: bytes


@dataclass(frozen=True, slots=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class _BuildSnapshot:
    pass


@dataclass(frozen=True, slots=True)
class _Record:
    """Append these events (accepted by the webhook) to the ``record`` file."""

    batch: list[bytes]


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> dict[str, Any]:
        try:
            data = json.loads(self.body)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}


_Action = _Post | _Sleep | _BuildSnapshot | _Record
_Result = _Reply | BaseException | Snapshot | None
Delivery = Generator[_Action, _Result, None]


@dataclass
class _Counters:
    emitted: int = 0
    sent: int = 0
    applied: int = 0
    duplicates: int = 0
    superseded: int = 0
    dropped_overflow: int = 0
    dropped_invalid: int = 0
    dropped_undeliverable: int = 0
    batches: int = 0
    retries: int = 0
    resyncs: int = 0
    epoch: int | None = None
    recorded: int = 0


@dataclass
class _DropLog:
    """Rate-limited warnings per cause: the first drop of a cause is logged at once, later
    ones are summed into one line at most every ``interval`` s, and ``flush`` (on close)
    reports whatever is left, so a storm of drops is loud but not a log flood."""

    interval: float = 10.0
    last: dict[str, float] = field(default_factory=dict)
    unreported: dict[str, tuple[int, str]] = field(default_factory=dict)

    def note(self, n: int, cause: str, why: str) -> None:
        count, _ = self.unreported.get(cause, (0, why))
        self.unreported[cause] = (count + n, why)
        now = time.monotonic()
        if now - self.last.get(cause, -math.inf) >= self.interval:
            self.last[cause] = now
            self._report(cause)

    def flush(self) -> None:
        for cause in list(self.unreported):
            self._report(cause)

    def _report(self, cause: str) -> None:
        count, why = self.unreported.pop(cause, (0, ""))
        if count:
            log.warning("prorsa emitter dropped %d event(s): %s", count, why)


def _reason(reply: object) -> str | None:
    """A refusal's ``reason`` (the webhook names it in its error body)."""
    if not isinstance(reply, _Reply):
        return None
    reason = reply.json().get("reason")
    return reason if isinstance(reason, str) else None


def _retry_after(reply: _Reply) -> float | None:
    raw = reply.headers.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


class _TokenFile:
    """The bearer token in a file, read again whenever the file changes.

    A Secret mounted as a volume is refreshed by the kubelet after a rotation (an atomic
    swap of the files, so a new inode); the stat check keeps the read off every request.
    A file that cannot be read later keeps the last token, logged once.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._stamp: tuple[int, int, int] | None = None
        self._token = ""
        self._warned = False
        if not self.token():  # at start, a missing or empty file is an error
            raise ValueError(f"token_file {self.path} holds no token")

    def token(self) -> str:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp != self._stamp:
                with open(self.path, encoding="utf-8") as f:
                    token = f.read().strip()
                if token:
                    self._token, self._stamp, self._warned = token, stamp, False
        except (OSError, UnicodeDecodeError) as exc:
            if not self._token:
                raise ValueError(f"cannot read token_file {self.path}: {exc}") from None
            if not self._warned:
                self._warned = True
                log.warning("prorsa token_file %s unreadable (%s); keeping its last token",
                            self.path, exc)  # fmt: skip
        return self._token


class _Core:
    """State and policy shared by both emitters; all mutation under ``self.lock``."""

    def __init__(
        self,
        *,
        url: str,
        namespace: str,
        name: str,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        emitter_id: str | None = None,
        batch_size: int = 500,
        flush_interval: float = 0.2,
        max_buffer: int = 100_000,
        give_up_after: float = 60.0,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.time,
        track: bool = False,
        record: str | os.PathLike[str] | None = None,
        has_snapshot: bool = False,
    ) -> None:
        if batch_size < 1 or max_buffer < batch_size:
            raise ValueError("need batch_size >= 1 and max_buffer >= batch_size")
        if flush_interval <= 0:
            raise ValueError("flush_interval must be > 0")
        # Opened here, so a path that cannot be written fails at construction.
        self.record_path = None if record is None else os.fspath(record)
        self.record_file = None if record is None else open(record, "ab")  # noqa: SIM115
        self.record_failed = False
        if (token is None) == (token_file is None):
            raise ValueError("give the bearer token as token= or as token_file= (exactly one)")
        self.token_file = _TokenFile(token_file) if token_file is not None else None
        if emitter_id is not None and not valid_emitter(emitter_id):
            raise ValueError(
                f"emitter_id {emitter_id!r}: 1-128 letters, digits and _.:- starting with a "
                "letter or digit"
            )
        self.emitter_id = emitter_id
        base = f"/v1/namespaces/{namespace}/rolloutclusters/{name}"
        self.url = url.rstrip("/")
        self.events_path = f"{base}/events"
        self.snapshot_path = f"{base}/snapshot"
        self.headers = {
            "Authorization": f"Bearer {(token or '').strip()}",
            "Content-Type": "application/json",
            "User-Agent": f"prorsa-sdk/{__version__}",
        }
        if emitter_id is not None:
            self.headers[EMITTER_HEADER] = emitter_id
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.max_buffer = max_buffer
        self.give_up_after = give_up_after
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.lock = threading.Lock()
        self.buffer: deque[bytes] = deque()  # events already encoded as JSON objects
        self.first_at = 0.0  # monotonic time the oldest buffered event arrived
        self.in_flight = 0
        # Batches set aside at the cluster's trajectory limit: (not before, batch), in order.
        self.held: deque[tuple[float, list[bytes]]] = deque()
        self.held_events = 0
        self.counters = _Counters()
        self.tracker = TrajectoryTracker() if track else None
        self.can_snapshot = has_snapshot or track
        # Events were dropped: post a snapshot when possible. A named emitter also posts
        # one at its start: a previous process of its id may have left trajectories.
        self.repair = emitter_id is not None and self.can_snapshot
        self.last_repair = -math.inf
        self.resync_warned_epoch: int | None = None
        self.abandon_at = math.inf  # monotonic deadline set by close(timeout)
        self.closed = False
        self.drops = _DropLog()
        self._limit_noted = -math.inf
        self._prefix = uuid.uuid4().hex[:12] + "-"
        self._seq = itertools.count()

    # -- producer side -------------------------------------------------------------------

    def make(
        self,
        kind: str,
        trajectory: str | None,
        ts: float | None,
        id: str | None,
        fields: dict[str, Any],
    ) -> dict[str, Any]:
        event: dict[str, Any] = {
            "id": id if id is not None else self._prefix + str(next(self._seq)),
            "ts": self.clock() if ts is None else ts,
        }
        if trajectory is not None:  # None: a cluster event (weight update)
            event["trajectory"] = trajectory
        event["type"] = kind
        for key, value in fields.items():
            if value is not None:
                event[key] = value
        return event

    def push(self, event: dict[str, Any]) -> int:
        """Encode and buffer one event; returns the new buffer length (0: refused).

        Encoding here, in the caller, keeps the sender's critical path to a join, so the
        next batch is ready the moment the previous reply arrives; an event that cannot
        be JSON (NaN, an object) is refused right here, counted and logged.
        """
        try:
            data = _encode(event)
        except (TypeError, ValueError) as exc:
            with self.lock:
                if self.closed:
                    raise RuntimeError("emit() on a closed prorsa emitter") from None
                self.counters.emitted += 1
                self.counters.dropped_invalid += 1
            self.drops.note(
                1, "json", f"event {event.get('type')!r} is not JSON ({exc}); first one shown"
            )
            return 0
        with self.lock:
            if self.closed:
                raise RuntimeError("emit() on a closed prorsa emitter")
            buf = self.buffer
            c = self.counters
            c.emitted += 1
            if self.tracker is not None:
                try:
                    self.tracker.apply(event)
                except Exception:  # a tracker bug must never reach the training loop
                    log.exception("prorsa trajectory tracker failed on %r", event.get("type"))
            if len(buf) + self.held_events >= self.max_buffer:
                if buf:
                    buf.popleft()
                else:  # everything waiting is set aside: the oldest of those goes
                    self._drop_oldest_held()
                c.dropped_overflow += 1
                self.repair = self.can_snapshot
                self.drops.note(
                    1,
                    "overflow",
                    f"buffer full ({self.max_buffer} events; is the webhook reachable?); "
                    f"oldest dropped, {c.dropped_overflow} so far",
                )
            if not buf:
                self.first_at = time.monotonic()
            buf.append(data)
            return len(buf)

    def due(self, *, now: float, flushing: bool) -> bool:
        """Whether a batch should leave now: full, old enough, or a flush/close asked."""
        n = len(self.buffer)
        if not n:
            return False
        return n >= self.batch_size or flushing or now - self.first_at >= self.flush_interval

    def take(self) -> list[bytes]:
        buf = self.buffer
        n = min(len(buf), self.batch_size)
        batch = [buf.popleft() for _ in range(n)]
        if buf:
            self.first_at = time.monotonic()
        self.in_flight = n
        return batch

    def idle(self) -> bool:
        return not self.buffer and not self.in_flight and not self.held

    def hold(self, batch: list[bytes], *, seconds: float) -> None:
        """Set ``batch`` aside for ``seconds`` (the trajectory limit); newer batches go."""
        with self.lock:
            self.held.append((time.monotonic() + seconds, batch))
            self.held_events += len(batch)

    def _drop_oldest_held(self) -> None:
        """One event of the oldest batch set aside, the caller holding ``lock``."""
        batch = self.held[0][1]
        batch.pop(0)
        self.held_events -= 1
        if not batch:
            self.held.popleft()

    def next_step(self, *, now: float, flushing: bool, closing: bool) -> list[bytes] | float | None:
        """The sender's next step, the caller holding ``lock``: a batch to deliver now,
        seconds to wait for one, or None once closing has nothing left to send."""
        if self.due(now=now, flushing=flushing or closing):
            return self.take()
        if self.held and (closing or self.held[0][0] <= now):
            _, batch = self.held.popleft()
            self.held_events -= len(batch)
            self.in_flight = len(batch)
            return batch
        if closing and not self.buffer:
            return None
        waits = [1.0]
        if self.buffer:
            waits.append(max(self.first_at + self.flush_interval - now, 0.001))
        if self.held:
            waits.append(max(self.held[0][0] - now, 0.001))
        return min(waits)

    def lost(self, batch: list[bytes]) -> None:
        """A bug broke the delivery of ``batch``: count it dropped so nothing hides it."""
        log.exception("prorsa emitter: unexpected error delivering a batch")
        self._drop(len(batch), "undeliverable", "internal error", cause="bug")
        with self.lock:
            self.in_flight = 0

    def write_record(self, batch: list[bytes]) -> None:
        """Append ``batch`` to the record file (the sender's thread; blocking)."""
        if self.record_file is None or self.record_failed:
            return
        try:
            self.record_file.write(b"\n".join(batch) + b"\n")
            self.record_file.flush()
        except (OSError, ValueError) as exc:  # ValueError: closed under a cancelled sender
            self.record_failed = True
            log.error(
                "prorsa emitter: cannot write the recording %s (%s); recording stopped, "
                "delivery goes on",
                self.record_path,
                exc,
            )
            return
        with self.lock:
            self.counters.recorded += len(batch)

    def close_out(self) -> EmitterStats:
        """Closed: what is still buffered is counted as dropped; the final stats."""
        if self.record_file is not None:
            with contextlib.suppress(OSError):
                self.record_file.close()
        with self.lock:
            self.closed = True
            left = len(self.buffer) + self.held_events
            self.buffer.clear()
            self.held.clear()
            self.held_events = 0
        if left:
            self._drop(
                left, "undeliverable", "emitter closed before they could be sent", cause="close"
            )
        self.drops.flush()
        stats = self.stats()
        if stats.dropped:
            log.warning("prorsa emitter closed: %s", stats)
        return stats

    def stats(self) -> EmitterStats:
        with self.lock:
            c = self.counters
            return EmitterStats(
                emitted=c.emitted,
                sent=c.sent,
                applied=c.applied,
                duplicates=c.duplicates,
                superseded=c.superseded,
                dropped_overflow=c.dropped_overflow,
                dropped_invalid=c.dropped_invalid,
                dropped_undeliverable=c.dropped_undeliverable,
                pending=len(self.buffer) + self.in_flight + self.held_events,
                batches=c.batches,
                retries=c.retries,
                resyncs=c.resyncs,
                epoch=c.epoch,
                recorded=c.recorded,
            )

    def tracked_snapshot(self) -> Snapshot:
        assert self.tracker is not None
        with self.lock:
            return self.tracker.snapshot(ts=self.clock())

    # -- delivery policy -----------------------------------------------------------------

    @staticmethod
    def _body(batch: list[bytes]) -> bytes:
        return b'{"events":[' + b",".join(batch) + b"]}"

    def _drop(
        self, n: int, kind: Literal["invalid", "undeliverable"], why: str, *, cause: str = ""
    ) -> None:
        with self.lock:
            if kind == "invalid":
                self.counters.dropped_invalid += n
            else:
                # The server's view now misses transitions: repair it with a snapshot.
                self.counters.dropped_undeliverable += n
                self.repair = self.can_snapshot
        if kind == "invalid":
            log.error("prorsa emitter dropped %d invalid event(s): %s", n, why)
        else:
            self.drops.note(n, cause or why, why)

    def _abandoned(self) -> bool:
        return time.monotonic() >= self.abandon_at

    def deliver(self, batch: list[bytes]) -> Delivery:
        """Send one batch to completion (or to a counted drop); may post a snapshot."""
        pieces = [batch]
        while pieces:
            part = pieces.pop()
            yield from self._deliver_one(part, pieces)
        with self.lock:
            self.in_flight = 0
        now = time.monotonic()
        if self.repair and not self._abandoned() and now - self.last_repair >= REPAIR_INTERVAL:
            # At most one repair snapshot per interval, however long the drops go on.
            with self.lock:
                self.repair = False
            reason = "the emitter started" if self.last_repair == -math.inf else None
            self.last_repair = now
            yield from self._resync(reason=reason or "events were dropped")

    def _deliver_one(self, batch: list[bytes], pieces: list[list[bytes]]) -> Delivery:
        attempt = 0
        first_client_error: float | None = None
        body = self._body(batch)
        while batch:
            result = yield _Post(self.events_path, body)
            if isinstance(result, _Reply) and 200 <= result.status < 300:
                reply = result.json()
                with self.lock:
                    c = self.counters
                    c.batches += 1
                    c.sent += len(batch)
                    c.applied += int(reply.get("applied", 0))
                    c.duplicates += int(reply.get("duplicates", 0))
                    c.superseded += int(reply.get("superseded", 0))
                    epoch = reply.get("epoch")
                    if isinstance(epoch, int):
                        if c.epoch is not None and epoch != c.epoch:
                            log.warning("prorsa webhook restarted (epoch %s -> %s)", c.epoch, epoch)
                        c.epoch = epoch
                if self.record_file is not None:
                    yield _Record(batch)
                if reply.get("resync") is True:
                    yield from self._resync(reason="the server asked (resync: true)")
                return
            status = result.status if isinstance(result, _Reply) else None
            if status == 422 and isinstance(result, _Reply):
                errors = result.json().get("errors") or []
                bad = {e.get("index") for e in errors if isinstance(e, dict)}
                bad.discard(None)
                if not bad:
                    self._drop(len(batch), "invalid", f"batch refused: {result.body[:300]!r}")
                    return
                shown = "; ".join(
                    f"{e.get('index')}:{e.get('field')}: {e.get('message')}" for e in errors[:3]
                )
                self._drop(len(bad), "invalid", f"the server refused them ({shown})")
                batch = [e for i, e in enumerate(batch) if i not in bad]
                body = self._body(batch)
                continue
            if status == 413:
                if len(batch) > 1:
                    half = len(batch) // 2
                    pieces.append(batch[half:])
                    pieces.append(batch[:half])
                    return
                self._drop(
                    1, "undeliverable", "one event is larger than the server accepts", cause="413"
                )
                return
            if status in (401, 403, 404):
                # A token being rotated or a cluster still being registered: retry a while.
                now = time.monotonic()
                first_client_error = first_client_error or now
                if now - first_client_error >= self.give_up_after:
                    self._drop(
                        len(batch),
                        "undeliverable",
                        f"HTTP {status} for {self.give_up_after:.0f}s (wrong token or cluster?)",
                        cause=f"http{status}",
                    )
                    return
            elif status == 429 and _reason(result) == "trajectory_limit":
                # Applied but for the events that start new trajectories. Trajectories that
                # end make room, and their ends are in the newer batches: send those first.
                retry_after = _retry_after(result) if isinstance(result, _Reply) else None
                if not self._abandoned():
                    with self.lock:
                        self.counters.retries += 1
                    if self._limit_noted + 60.0 <= time.monotonic():
                        self._limit_noted = time.monotonic()
                        log.warning(
                            "prorsa webhook at the cluster's trajectory limit "
                            "(spec.trainer.maxLiveTrajectories): new trajectories wait"
                        )
                    self.hold(batch, seconds=retry_after or 1.0)
                    return
            elif status is not None and status != 429 and status < 500:
                text = result.body[:300] if isinstance(result, _Reply) else b""
                self._drop(
                    len(batch), "undeliverable", f"HTTP {status}: {text!r}", cause=f"http{status}"
                )
                return
            if self._abandoned():
                why = f"HTTP {status}" if status else f"{type(result).__name__}: {result}"
                self._drop(
                    len(batch), "undeliverable", f"closing while undelivered ({why})", cause="close"
                )
                return
            retry_after = _retry_after(result) if isinstance(result, _Reply) else None
            with self.lock:
                self.counters.retries += 1
            if attempt == 0 and not isinstance(result, _Reply):
                log.info("prorsa webhook unreachable (%s); retrying", type(result).__name__)
            yield _Sleep(self.backoff.delay(attempt, retry_after=retry_after))
            attempt += 1

    def _resync(self, *, reason: str) -> Delivery:
        """Post a snapshot (from the user's callback or the tracker), retrying transients."""
        if not self.can_snapshot:
            with self.lock:
                epoch = self.counters.epoch
            if self.resync_warned_epoch != epoch:
                self.resync_warned_epoch = epoch
                log.warning(
                    "prorsa webhook needs a snapshot (%s) but the emitter has no snapshot "
                    "source: pass snapshot=... or track=True; the forecast misses "
                    "trajectories that started before the server's restart",
                    reason,
                )
            return
        built = yield _BuildSnapshot()
        if not isinstance(built, Snapshot):
            log.error("prorsa snapshot callback failed: %r; resync postponed", built)
            return
        body = _dumps(built.model_dump(mode="json", exclude_none=True))
        attempt = 0
        while True:
            result = yield _Post(self.snapshot_path, body)
            if isinstance(result, _Reply) and 200 <= result.status < 300:
                with self.lock:
                    self.counters.resyncs += 1
                    self.repair = False  # the snapshot repairs drops before it too
                self.last_repair = time.monotonic()
                if self.record_file is not None:
                    log.warning(
                        "prorsa emitter: a resync snapshot of %d trajectories was posted; "
                        "the recording %s holds events only",
                        len(built.trajectories),
                        self.record_path,
                    )
                log.info(
                    "prorsa resync: posted %d live trajectories (%s)",
                    len(built.trajectories),
                    reason,
                )
                return
            status = result.status if isinstance(result, _Reply) else None
            transient = status is None or status == 429 or status >= 500
            if not transient or self._abandoned():
                detail = result.body[:300] if isinstance(result, _Reply) else result
                log.error("prorsa snapshot refused (HTTP %s): %r", status, detail)
                return
            retry_after = _retry_after(result) if isinstance(result, _Reply) else None
            yield _Sleep(self.backoff.delay(attempt, retry_after=retry_after))
            attempt += 1

    def send_headers(self) -> dict[str, str]:
        headers = {**self.headers, SENT_AT_HEADER: repr(self.clock())}
        if self.token_file is not None:
            headers["Authorization"] = f"Bearer {self.token_file.token()}"
        return headers


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


# The stdlib encoder: the judge of what is JSON, for any event the fast path declines.
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_PLAIN = frozenset((str, int, bool))


def _encode(event: dict[str, Any]) -> bytes:
    """One event as compact JSON; TypeError or ValueError when it cannot be JSON.

    Encoding sits on the trainer's thread for every event. A lifecycle event is a flat
    dict of str, int, bool and finite floats, which pydantic-core's serializer writes about
    six times faster than the stdlib encoder; anything else (a NaN, a nested value, a str
    subclass) goes to the stdlib encoder, so what is refused, and why, is exactly what
    ``json.dumps(allow_nan=False)`` decides.
    """
    for key, value in event.items():
        kind = type(value)
        if kind is float:
            if not -math.inf < value < math.inf:
                break
        elif kind not in _PLAIN or type(key) is not str:
            break
    else:
        try:
            return to_json(event)
        except ValueError:  # e.g. a lone surrogate, which the stdlib escapes instead
            pass
    return _ENCODE(event).encode()


def _as_snapshot(rows: SnapshotRows, *, ts: float) -> Snapshot:
    if isinstance(rows, Snapshot):
        return rows
    items = [r if isinstance(r, BaseModel) else SnapshotTrajectory.model_validate(r) for r in rows]
    return Snapshot(ts=ts, trajectories=items)


# -- typed helpers, shared by both flavours -------------------------------------------------


class _Helpers(ABC):
    """One method per event type of the webhook CONTRACT (None fields are omitted)."""

    @abstractmethod
    def emit(
        self,
        type: str,
        trajectory: str | None,
        *,
        ts: float | None = None,
        id: str | None = None,
        **fields: Any,
    ) -> str: ...

    def sample_dispatched(
        self,
        trajectory: str,
        *,
        group: str | None = None,
        task: str | None = None,
        prompt_tokens: int | None = None,
        ts: float | None = None,
    ) -> str:
        return self.emit(
            "sample_dispatched",
            trajectory,
            ts=ts,
            group=group,
            task=task,
            prompt_tokens=prompt_tokens,
        )

    def sandbox_started(
        self,
        trajectory: str,
        *,
        mode: Literal["prewarm", "cold"],
        image: str | None = None,
        node_class: str | None = None,
        ts: float | None = None,
    ) -> str:
        return self.emit(
            "sandbox_started", trajectory, ts=ts, mode=mode, image=image, node_class=node_class
        )

    def request_queued(
        self,
        trajectory: str,
        *,
        prompt_tokens: int,
        turn: int,
        request: str | None = None,
        ts: float | None = None,
    ) -> str:
        return self.emit(
            "request_queued",
            trajectory,
            ts=ts,
            prompt_tokens=prompt_tokens,
            turn=turn,
            request=request,
        )

    def prefill_started(
        self,
        trajectory: str,
        *,
        request: str | None = None,
        instance: str | None = None,
        ts: float | None = None,
    ) -> str:
        """Only from code that sees the prefill engine start (a router or an engine-side
        hook). A client behind a PD router does not: the engine queues the request first,
        and the reply names no prefill engine. Leave it out there."""
        return self.emit("prefill_started", trajectory, ts=ts, request=request, instance=instance)

    def prefill_finished(
        self,
        trajectory: str,
        *,
        request: str | None = None,
        instance: str | None = None,
        ts: float | None = None,
    ) -> str:
        """When the first token streams back (the prefill's end plus the KV transfer), with
        ``instance`` only if the client knows it. A blocking (non-streaming) call does not
        see that moment: send no prefill event at all, rather than one when the reply
        arrives, which would show the request in prefill for its whole decode. The
        Controller then reads the prefill engines' queues instead."""
        return self.emit("prefill_finished", trajectory, ts=ts, request=request, instance=instance)

    def decode_finished(
        self,
        trajectory: str,
        *,
        output_tokens: int,
        finish: Literal["tool", "stop", "length", "abort"],
        ts: float | None = None,
    ) -> str:
        return self.emit(
            "decode_finished", trajectory, ts=ts, output_tokens=output_tokens, finish=finish
        )

    def tool_started(
        self, trajectory: str, *, tool: str | None = None, ts: float | None = None
    ) -> str:
        return self.emit("tool_started", trajectory, ts=ts, tool=tool)

    def tool_finished(
        self, trajectory: str, *, result_tokens: int | None = None, ts: float | None = None
    ) -> str:
        return self.emit("tool_finished", trajectory, ts=ts, result_tokens=result_tokens)

    def reward_started(self, trajectory: str, *, ts: float | None = None) -> str:
        return self.emit("reward_started", trajectory, ts=ts)

    def reward_finished(self, trajectory: str, *, accepted: bool, ts: float | None = None) -> str:
        return self.emit("reward_finished", trajectory, ts=ts, accepted=accepted)

    def trajectory_dropped(
        self, trajectory: str, *, reason: str | None = None, ts: float | None = None
    ) -> str:
        return self.emit("trajectory_dropped", trajectory, ts=ts, reason=reason)

    # Cluster events: no trajectory. Emit them where the trainer changes the rollout
    # engines' weights, so the Controller sees the re-prefill burst coming.

    def weight_update_started(
        self,
        *,
        version: int,
        expected_seconds: float | None = None,
        ts: float | None = None,
        id: str | None = None,
    ) -> str:
        """Just before the engines load ``version``; ``expected_seconds``: how long it takes.

        When several processes may report the same update, pass the same ``id`` from each
        (say ``f"weights-{version}-started"``): the webhook applies it once.
        """
        return self.emit(
            "weight_update_started",
            None,
            ts=ts,
            id=id,
            version=version,
            expected_seconds=expected_seconds,
        )

    def weight_update_finished(
        self,
        *,
        version: int,
        reprefill_trajectories: int,
        ts: float | None = None,
        id: str | None = None,
    ) -> str:
        """Once ``version`` is loaded; ``reprefill_trajectories``: live trajectories whose
        context will be computed again on it (interrupted generations, tool calls in
        progress)."""
        return self.emit(
            "weight_update_finished",
            None,
            ts=ts,
            id=id,
            version=version,
            reprefill_trajectories=reprefill_trajectories,
        )


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


# -- what both flavours share ---------------------------------------------------------------


class EmitterOptions(TypedDict, total=False):
    """The settings both emitters take by keyword (defaults in brackets)."""

    url: Required[str]  # the webhook's base URL
    namespace: Required[str]  # the RolloutCluster's namespace
    name: Required[str]  # and name
    token: str  # the trainer's bearer token, or:
    token_file: str | os.PathLike[str]  # a file holding it, re-read when it changes
    emitter_id: str  # [none] this emitter's stable id, one per worker (snapshots scoped to it)
    track: bool  # [False] snapshots from the built-in tracker (one emitter sees all)
    batch_size: int  # [500] events per request
    flush_interval: float  # [0.2] seconds an event may wait for a fuller batch
    max_buffer: int  # [100_000] events buffered before the oldest are dropped
    give_up_after: float  # [60] seconds 401/404 are retried before a batch is dropped
    backoff: Backoff | None  # [Backoff()] retry delays
    clock: Callable[[], float]  # [time.time] the trainer clock events are stamped with
    record: str | os.PathLike[str] | None  # [None] append accepted events here (NDJSON)


class _Emitter(_Helpers):
    """Buffering and the public surface both flavours share; the sender is theirs."""

    def __init__(self, *, has_snapshot: bool, options: EmitterOptions) -> None:
        self._core = _Core(has_snapshot=has_snapshot, **options)
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


def _reply(response: httpx.Response) -> _Reply:
    return _Reply(status=response.status_code, headers=response.headers, body=response.content)


# -- the threaded flavour -------------------------------------------------------------------


class EventEmitter(_Emitter):
    """Thread-based emitter for synchronous trainers (safe to call from any thread).

    >>> em = EventEmitter(url="http://127.0.0.1:8787", namespace="rl", name="qwen3",
    ...                   token=open("token").read(), track=True)
    >>> em.request_queued("traj-1", prompt_tokens=2048, turn=0)
    >>> em.close()
    """

    def __init__(
        self,
        *,
        snapshot: SnapshotSource | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        verify: TlsVerify = None,
        **options: Unpack[EmitterOptions],
    ) -> None:
        super().__init__(has_snapshot=snapshot is not None, options=options)
        self._snapshot = snapshot
        self._client = httpx.Client(
            base_url=self._core.url,
            timeout=timeout,
            transport=transport,
            verify=tls_context(verify),
        )
        self._wake = threading.Condition(self._core.lock)
        self._stop = threading.Event()  # interrupts backoff sleeps on close
        self._thread = threading.Thread(target=self._run, name="prorsa-emitter", daemon=True)
        self._thread.start()

    def __enter__(self) -> EventEmitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _kick(self) -> None:
        with self._wake:
            self._wake.notify()

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Block until everything emitted so far was delivered (or dropped); False on timeout."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        with self._wake:
            self._flushing += 1
            self._wake.notify_all()
            try:
                while not self._core.idle():
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._thread.is_alive():
                        return False
                    self._wake.wait(min(left, 0.5))
                return True
            finally:
                self._flushing -= 1

    def close(self, timeout: float = 10.0) -> EmitterStats:
        """Flush within ``timeout`` seconds, then stop; the rest is counted as dropped."""
        core = self._core
        with self._wake:
            closed = core.closed
            if not closed:
                self._closing = True
                core.abandon_at = time.monotonic() + timeout
                self._wake.notify_all()
        if closed:  # stats() takes the lock the condition holds: read them outside it
            return core.stats()
        self._thread.join(timeout + 1.0)
        self._stop.set()
        self._thread.join(2.0)
        stats = core.close_out()
        self._client.close()
        return stats

    # -- sender thread -------------------------------------------------------------------

    def _run(self) -> None:
        core = self._core
        while True:
            with self._wake:
                while True:
                    step = core.next_step(
                        now=time.monotonic(), flushing=self._flushing > 0, closing=self._closing
                    )
                    if step is None:
                        return
                    if isinstance(step, list):
                        batch = step
                        break
                    self._wake.wait(step)
            try:
                self._drive(core.deliver(batch))
            except Exception:  # a bug must not kill delivery silently
                core.lost(batch)
            with self._wake:
                self._wake.notify_all()

    def _drive(self, gen: Delivery) -> None:
        result: _Result = None
        try:
            action = next(gen)
            while True:
                if isinstance(action, _Post):
                    result = self._post(action)
                elif isinstance(action, _Sleep):
                    self._stop.wait(action.seconds)
                    result = None
                elif isinstance(action, _Record):
                    self._core.write_record(action.batch)
                    result = None
                else:
                    result = self._build_snapshot()
                action = gen.send(result)
        except StopIteration:
            return

    def _post(self, action: _Post) -> _Reply | BaseException:
        try:
            r = self._client.post(
                action.path, content=action.body, headers=self._core.send_headers()
            )
        except httpx.HTTPError as exc:
            return exc
        return _reply(r)

    def _build_snapshot(self) -> Snapshot | BaseException:
        core = self._core
        try:
            if self._snapshot is None:
                return core.tracked_snapshot()
            ts = core.clock()
            return _as_snapshot(self._snapshot(), ts=ts)
        except Exception as exc:
            return exc


# -- the asyncio flavour --------------------------------------------------------------------


class AsyncEventEmitter(_Emitter):
    """asyncio emitter: ``emit()`` is a plain (non-async) call that never blocks the loop.

    >>> async with AsyncEventEmitter(url=..., namespace="rl", name="qwen3", token=t) as em:
    ...     em.request_queued("traj-1", prompt_tokens=2048, turn=0)
    """

    def __init__(
        self,
        *,
        snapshot: AsyncSnapshotSource | None = None,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: TlsVerify = None,
        **options: Unpack[EmitterOptions],
    ) -> None:
        super().__init__(has_snapshot=snapshot is not None, options=options)
        self._snapshot = snapshot
        self._timeout = timeout
        self._transport = transport
        self._verify = tls_context(verify)  # a missing bundle fails here, not in the loop
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None

    async def __aenter__(self) -> AsyncEventEmitter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the sender in the running loop (``emit()`` also starts it lazily)."""
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._stop = asyncio.Event()
        self._client = httpx.AsyncClient(
            base_url=self._core.url,
            timeout=self._timeout,
            transport=self._transport,
            verify=self._verify,
        )
        self._task = loop.create_task(self._run(), name="prorsa-emitter")

    def _kick(self) -> None:
        """Wake the sender: a first event starts the flush timer, a full batch is due."""
        if self._task is None:
            try:
                self._ensure_started()
            except RuntimeError:
                return  # no running loop here: start() or the next emit() picks it up
        if threading.get_ident() == self._loop_thread:
            assert self._wake is not None
            self._wake.set()
        elif self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until everything emitted so far was delivered (or dropped)."""
        self._ensure_started()
        assert self._wake is not None and self._changed is not None
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        self._flushing += 1
        self._wake.set()
        try:
            while not self._core.idle():
                left = deadline - time.monotonic()
                if left <= 0 or self._task is None or self._task.done():
                    return False
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
            return True
        finally:
            self._flushing -= 1

    async def aclose(self, timeout: float = 10.0) -> EmitterStats:
        """Flush within ``timeout`` seconds, then stop; the rest is counted as dropped."""
        core = self._core
        if core.closed:
            return core.stats()
        if self._task is None and core.buffer:
            self._ensure_started()
        if self._task is not None:
            assert self._wake is not None and self._stop is not None
            self._closing = True
            core.abandon_at = time.monotonic() + timeout
            self._wake.set()
            done, _ = await asyncio.wait({self._task}, timeout=timeout + 1.0)
            if not done:
                self._stop.set()
                await asyncio.wait({self._task}, timeout=2.0)
            if not self._task.done():
                await cancel_and_wait(self._task)
        stats = core.close_out()
        if self._client is not None:
            await self._client.aclose()
        return stats

    async def _run(self) -> None:
        core = self._core
        assert self._wake is not None and self._changed is not None
        while True:
            while True:
                with core.lock:
                    step = core.next_step(
                        now=time.monotonic(), flushing=self._flushing > 0, closing=self._closing
                    )
                if step is None:
                    return
                if isinstance(step, list):
                    batch = step
                    break
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), step)
            try:
                await self._drive(core.deliver(batch))
            except Exception:
                core.lost(batch)
            self._changed.set()

    async def _drive(self, gen: Delivery) -> None:
        assert self._stop is not None
        result: _Result = None
        try:
            action = next(gen)
            while True:
                if isinstance(action, _Post):
                    result = await self._post(action)
                elif isinstance(action, _Sleep):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), action.seconds)
                    result = None
                elif isinstance(action, _Record):
                    await asyncio.to_thread(self._core.write_record, action.batch)
                    result = None
                else:
                    result = await self._build_snapshot()
                action = gen.send(result)
        except StopIteration:
            return

    async def _post(self, action: _Post) -> _Reply | BaseException:
        assert self._client is not None
        try:
            r = await self._client.post(
                action.path, content=action.body, headers=self._core.send_headers()
            )
        except httpx.HTTPError as exc:
            return exc
        return _reply(r)

    async def _build_snapshot(self) -> Snapshot | BaseException:
        core = self._core
        try:
            if self._snapshot is None:
                return core.tracked_snapshot()
            ts = core.clock()
            rows = self._snapshot()
            if inspect.isawaitable(rows):
                rows = await rows
            return _as_snapshot(rows, ts=ts)
        except Exception as exc:
            return exc
