"""The emitter's sans-I/O core: the buffer, the counters and the delivery policy.

Both emitters (:mod:`prorsa_sdk.sync_emitter` on a thread, :mod:`prorsa_sdk.async_emitter`
on asyncio) run this same code. ``emit()`` encodes and buffers here; the sender asks
:meth:`EmitterCore.next_step` what to do and runs :meth:`EmitterCore.deliver`, a generator
that yields what the policy wants done (:class:`Post` a body, :class:`Sleep`, build a
snapshot, :class:`Record` a batch) and is sent what came of it (:class:`Reply`, an
exception, a Snapshot). The generator never touches the network, a file or the clock of a
sleep, so the retry policy is written once and each driver only executes actions. The
lock is here because ``emit()`` runs on the trainer's threads while the sender reads.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Required, TypedDict

from pydantic import BaseModel
from pydantic_core import to_json

from prorsa_contract.events import Snapshot, SnapshotTrajectory, valid_emitter
from prorsa_sdk.tracker import TrajectoryTracker

log = logging.getLogger("prorsa_sdk")

REPAIR_INTERVAL = 10.0  # seconds between snapshots that repair the server after drops

SnapshotRows = Snapshot | Iterable[SnapshotTrajectory | Mapping[str, Any]]
"""What a ``snapshot=`` callback returns: a Snapshot, or its live trajectories."""


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
class RetryBackoff:
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


class CoreOptions(TypedDict, total=False):
    """The core's settings, which both emitters take by keyword (defaults in brackets)."""

    url: Required[str]  # the webhook's base URL
    namespace: Required[str]  # the RolloutCluster's namespace
    name: Required[str]  # and name
    emitter_id: str  # [none] this emitter's stable id, one per worker (snapshots scoped to it)
    track: bool  # [False] snapshots from the built-in tracker (one emitter sees all)
    batch_size: int  # [500] events per request
    flush_interval: float  # [0.2] seconds an event may wait for a fuller batch
    max_buffer: int  # [100_000] events buffered before the oldest are dropped
    give_up_after: float  # [60] seconds 401/404 are retried before a batch is dropped
    backoff: RetryBackoff | None  # [RetryBackoff()] retry delays
    clock: Callable[[], float]  # [time.time] the trainer clock events are stamped with


# -- what the policy asks the drivers to do ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Post:
    path: str
    body: bytes


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class BuildSnapshot:
    pass


@dataclass(frozen=True, slots=True)
class Record:
    """Append these events (accepted by the webhook) to the ``record`` file."""

    batch: list[bytes]


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> dict[str, Any]:
        try:
            data = json.loads(self.body)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}


Action = Post | Sleep | BuildSnapshot | Record
Result = Reply | BaseException | Snapshot | None
Delivery = Generator[Action, Result, None]


@dataclass
class Counters:
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
class DropLog:
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
    if not isinstance(reply, Reply):
        return None
    reason = reply.json().get("reason")
    return reason if isinstance(reason, str) else None


def _retry_after(reply: Reply) -> float | None:
    raw = reply.headers.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


class EmitterCore:
    """State and policy shared by both emitters; all mutation under ``self.lock``."""

    def __init__(
        self,
        *,
        url: str,
        namespace: str,
        name: str,
        emitter_id: str | None = None,
        batch_size: int = 500,
        flush_interval: float = 0.2,
        max_buffer: int = 100_000,
        give_up_after: float = 60.0,
        backoff: RetryBackoff | None = None,
        clock: Callable[[], float] = time.time,
        track: bool = False,
        recording: str | None = None,
        has_snapshot: bool = False,
    ) -> None:
        """``recording``: the path accepted batches are recorded to (the driver writes
        them), None when nothing is recorded."""
        if batch_size < 1 or max_buffer < batch_size:
            raise ValueError("need batch_size >= 1 and max_buffer >= batch_size")
        if flush_interval <= 0:
            raise ValueError("flush_interval must be > 0")
        if emitter_id is not None and not valid_emitter(emitter_id):
            raise ValueError(
                f"emitter_id {emitter_id!r}: 1-128 letters, digits and _.:- starting with a "
                "letter or digit"
            )
        self.emitter_id = emitter_id
        self.recording = recording
        base = f"/v1/namespaces/{namespace}/rolloutclusters/{name}"
        self.url = url.rstrip("/")
        self.events_path = f"{base}/events"
        self.snapshot_path = f"{base}/snapshot"
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.max_buffer = max_buffer
        self.give_up_after = give_up_after
        self.backoff = backoff or RetryBackoff()
        self.clock = clock
        self.lock = threading.Lock()
        self.buffer: deque[bytes] = deque()  # events already encoded as JSON objects
        self.first_at = 0.0  # monotonic time the oldest buffered event arrived
        self.in_flight = 0
        # Batches set aside at the cluster's trajectory limit: (not before, batch), in order.
        self.held: deque[tuple[float, list[bytes]]] = deque()
        self.held_events = 0
        self.counters = Counters()
        self.tracker = TrajectoryTracker() if track else None
        self.can_snapshot = has_snapshot or track
        # Events were dropped: post a snapshot when possible. A named emitter also posts
        # one at its start: a previous process of its id may have left trajectories.
        self.repair = emitter_id is not None and self.can_snapshot
        self.last_repair = -math.inf
        self.resync_warned_epoch: int | None = None
        self.abandon_at = math.inf  # monotonic deadline set by close(timeout)
        self.closed = False
        self.drops = DropLog()
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
            data = encode(event)
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

    def recorded(self, n: int) -> None:
        """``n`` events were written to the recording."""
        with self.lock:
            self.counters.recorded += n

    def close_out(self) -> EmitterStats:
        """Closed: what is still buffered is counted as dropped; the final stats."""
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
            result = yield Post(self.events_path, body)
            if isinstance(result, Reply) and 200 <= result.status < 300:
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
                if self.recording is not None:
                    yield Record(batch)
                if reply.get("resync") is True:
                    yield from self._resync(reason="the server asked (resync: true)")
                return
            status = result.status if isinstance(result, Reply) else None
            if status == 422 and isinstance(result, Reply):
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
                retry_after = _retry_after(result) if isinstance(result, Reply) else None
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
                text = result.body[:300] if isinstance(result, Reply) else b""
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
            retry_after = _retry_after(result) if isinstance(result, Reply) else None
            with self.lock:
                self.counters.retries += 1
            if attempt == 0 and not isinstance(result, Reply):
                log.info("prorsa webhook unreachable (%s); retrying", type(result).__name__)
            yield Sleep(self.backoff.delay(attempt, retry_after=retry_after))
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
        built = yield BuildSnapshot()
        if not isinstance(built, Snapshot):
            log.error("prorsa snapshot callback failed: %r; resync postponed", built)
            return
        body = dumps(built.model_dump(mode="json", exclude_none=True))
        attempt = 0
        while True:
            result = yield Post(self.snapshot_path, body)
            if isinstance(result, Reply) and 200 <= result.status < 300:
                with self.lock:
                    self.counters.resyncs += 1
                    self.repair = False  # the snapshot repairs drops before it too
                self.last_repair = time.monotonic()
                if self.recording is not None:
                    log.warning(
                        "prorsa emitter: a resync snapshot of %d trajectories was posted; "
                        "the recording %s holds events only",
                        len(built.trajectories),
                        self.recording,
                    )
                log.info(
                    "prorsa resync: posted %d live trajectories (%s)",
                    len(built.trajectories),
                    reason,
                )
                return
            status = result.status if isinstance(result, Reply) else None
            transient = status is None or status == 429 or status >= 500
            if not transient or self._abandoned():
                detail = result.body[:300] if isinstance(result, Reply) else result
                log.error("prorsa snapshot refused (HTTP %s): %r", status, detail)
                return
            retry_after = _retry_after(result) if isinstance(result, Reply) else None
            yield Sleep(self.backoff.delay(attempt, retry_after=retry_after))
            attempt += 1


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


# The stdlib encoder: the judge of what is JSON, for any event the fast path declines.
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_PLAIN = frozenset((str, int, bool))


def encode(event: dict[str, Any]) -> bytes:
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


def as_snapshot(rows: SnapshotRows, *, ts: float) -> Snapshot:
    if isinstance(rows, Snapshot):
        return rows
    items = [r if isinstance(r, BaseModel) else SnapshotTrajectory.model_validate(r) for r in rows]
    return Snapshot(ts=ts, trajectories=items)
