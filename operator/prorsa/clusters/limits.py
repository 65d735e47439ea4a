"""The bounds that keep the webhook's memory and latency finite, and what a batch gets.

Every request is held to :class:`IngestLimits`; a batch the queue cannot take is refused
with :class:`QueueFull`, events past the live-trajectory limit with
:class:`TrajectoryLimit`, and an accepted batch is answered with its
:class:`BatchOutcome`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class IngestLimits:
    """Every bound that keeps the server's memory and latency finite under any input."""

    max_batch_bytes: int = 4 << 20
    """Largest ``POST .../events`` body (after any Content-Encoding); larger gets 413."""
    max_snapshot_bytes: int = 32 << 20
    """Largest ``POST .../snapshot`` body: a snapshot lists every live trajectory (the
    default cap of 100,000 at ~300 bytes each fits). Parsed, a snapshot takes about 12
    times its size in memory."""
    max_inflight_bytes: int = 16 << 20
    """Event batch bodies being read or parsed at once, whole server; beyond it 429: four
    of the largest batches, or 160 of the SDK's (500 events). Parsed events take about 10
    times their JSON's size, so this bounds that memory."""
    max_inflight_snapshot_bytes: int = 32 << 20
    """Snapshot bodies being read, parsed or loaded at once, whole server; beyond it 429:
    by default one snapshot of the largest size at a time."""
    max_pending_events: int = 50_000
    """Validated events waiting for one cluster's Controller; beyond it 429."""
    dedupe_window: int = 65_536
    """Most recent event ids remembered per cluster to count replays."""
    offload_events: int = 500
    """Batches of more events than this parse and apply in a worker thread. A batch of
    500 (the SDK's default) costs ~1 ms to parse and ~2-4 ms in the Controller: inline
    that is a short, bounded stall and the cheapest path; larger batches would stall the
    loop in proportion, so they move to a thread (at some cost in throughput)."""
    offload_ticks: bool = True
    """Run ``Controller.tick`` in a worker thread (its cost grows with live trajectories)."""
    header_timeout_seconds: float = 30.0
    """A connection must send a request's line and headers within this long of connecting
    (or of its previous reply, kept alive); then it is closed without a reply."""
    body_timeout_seconds: float = 60.0
    """A request must send its whole body within this long of its headers; then 408."""
    max_clock_ahead_seconds: float = 3600.0
    """Trainer timestamps (event ``ts``, snapshot times, ``X-Prorsa-Sent-At``) more than
    this far ahead of the server's wall clock are refused (422)."""
    max_clock_behind_seconds: float = 7 * 86400.0
    """... and more than this far behind it: milliseconds, seconds since the trainer
    started, or a clock years off are trainer bugs, not times."""

    def __post_init__(self) -> None:
        for name in (
            "max_batch_bytes",
            "max_snapshot_bytes",
            "max_inflight_bytes",
            "max_inflight_snapshot_bytes",
            "max_pending_events",
            "dedupe_window",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.offload_events < 0:
            raise ValueError("offload_events must be >= 0")
        for name in (
            "header_timeout_seconds",
            "body_timeout_seconds",
            "max_clock_ahead_seconds",
            "max_clock_behind_seconds",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0")


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What happened to one accepted batch, as the reply reports it."""

    accepted: int
    applied: int
    duplicates: int
    superseded: int
    anomalies: int


class TrajectoryLimit(Exception):
    """The cluster holds ``spec.trainer.maxLiveTrajectories``: events that would start new
    trajectories (``deferred`` of them), or a snapshot, were not applied. ``outcome`` is
    what the rest of the batch did; ``retry_after`` None means a retry cannot fit (a
    snapshot that lists more trajectories than the limit)."""

    def __init__(
        self,
        *,
        live: int,
        limit: int,
        deferred: int,
        retry_after: int | None,
        outcome: BatchOutcome | None = None,
    ) -> None:
        if outcome is None:
            what = "the snapshot was not loaded"
        else:
            what = (
                f"{deferred} event(s) that would start new trajectories were not applied "
                f"(the other {outcome.accepted} were: resending the whole batch is safe)"
            )
        super().__init__(
            f"{live} live trajectories, at spec.trainer.maxLiveTrajectories ({limit}): {what}"
        )
        self.live = live
        self.limit = limit
        self.deferred = deferred
        self.retry_after = retry_after
        self.outcome = outcome


class QueueFull(Exception):
    """The cluster's Controller is behind; the client should retry after ``retry_after`` s."""

    def __init__(self, *, pending: int, retry_after: int) -> None:
        super().__init__(f"{pending} events are waiting for the controller")
        self.pending = pending
        self.retry_after = retry_after
