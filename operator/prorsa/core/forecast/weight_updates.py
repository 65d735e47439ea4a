"""Weight updates: what the trainer announced of them, and the prefix caches they flush.

Cluster events (``weight_update_started`` / ``finished``) touch no trajectory's slot: they
flush every cached prefix at once and leave a :class:`WeightUpdate` view that the forecast
reads. A trainer that does not send them leaves it to a guess from its aborts
(:meth:`WeightUpdates.note_abort`).
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass

from prorsa.core.forecast.slots import DECODE, SlotStore
from prorsa_contract import events as ev

# Aborts that read as a weight update (see WeightUpdates.note_abort): at least this many,
# and this share of the trajectories decoding, within this window; one per refractory period.
FLUSH_MIN_ABORTS = 8
FLUSH_SHARE = 0.5
FLUSH_WINDOW_SECONDS = 5.0
FLUSH_REFRACTORY_SECONDS = 30.0
# A weight update announced but not finished after this long (or four times its expected
# duration, if longer) is taken as abandoned: the forecast stops waiting for it.
UPDATE_GIVE_UP_SECONDS = 600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightUpdate:
    """What the trainer said of its weight updates (all None before the first one).

    ``pending`` holds from ``weight_update_started`` to ``weight_update_finished``: the
    engines are loading new weights, every generation in flight is being interrupted and
    every prefix cache is gone, so the live contexts will re-prefill once it ends.
    """

    pending: bool = False
    version: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    expected_seconds: float | None = None
    reprefill_trajectories: int | None = None
    last_seconds: float | None = None  # how long the last completed update took

    def in_progress(self, now: float) -> bool:
        """Pending and not abandoned: a trainer that crashed mid-update never says it
        finished, and the forecast must not wait for it forever."""
        if not self.pending or self.started_at is None:
            return False
        seconds = self.expected_seconds if self.expected_seconds is not None else self.last_seconds
        return now - self.started_at <= max(UPDATE_GIVE_UP_SECONDS, 4.0 * (seconds or 0.0))

    def expected_end(self, now: float) -> float:
        """When a pending update should end: its announced duration, else the last
        update's, else now; never in the past (an overdue update may end any moment)."""
        if not self.pending or self.started_at is None:
            return now
        seconds = self.expected_seconds if self.expected_seconds is not None else self.last_seconds
        return max(now, self.started_at + (seconds or 0.0))


class WeightUpdates:
    """The last weight update announced (:attr:`current`) and the cache flushes so far."""

    def __init__(self, *, store: SlotStore, anomalies: dict[str, int]) -> None:
        self._store = store
        self._anomalies = anomalies
        self.current = WeightUpdate()
        # Once the trainer announces updates, aborts are only aborts.
        self._announced = False
        # Recent abort times, and the cache flushes they were read as (weight updates).
        self._aborts: deque[float] = deque()
        self.cache_flushes = 0
        self._last_flush = -math.inf

    def _is_stale(self, version: int) -> bool:
        """An older version, or this one over already: a late or re-sent (new id) event."""
        wu = self.current
        if wu.version is None:
            return False
        return version < wu.version or (version == wu.version and not wu.pending)

    def started(self, e: ev.WeightUpdateStarted, _slot: int | None) -> None:
        wu = self.current
        if self._is_stale(e.version):
            self._anomalies["stale"] += 1
            return
        self._announced = True
        if wu.pending and wu.version == e.version:
            return  # the same update announced twice (a restart of the trainer's sync)
        self._flush(e.ts)
        self.current = WeightUpdate(
            pending=True,
            version=e.version,
            started_at=e.ts,
            expected_seconds=e.expected_seconds,
            last_seconds=wu.last_seconds,
        )

    def finished(self, e: ev.WeightUpdateFinished, _slot: int | None) -> None:
        wu = self.current
        if self._is_stale(e.version):
            self._anomalies["stale"] += 1
            return
        self._announced = True
        started = wu.started_at if wu.pending and wu.version == e.version else None
        if started is None:
            self._flush(e.ts)  # its start was never heard: the weights changed anyway
        self.current = WeightUpdate(
            pending=False,
            version=e.version,
            started_at=started,
            finished_at=e.ts,
            expected_seconds=wu.expected_seconds if started is not None else None,
            reprefill_trajectories=e.reprefill_trajectories,
            last_seconds=max(e.ts - started, 0.0) if started is not None else wu.last_seconds,
        )

    def load(self, update: ev.SnapshotWeightUpdate | None) -> None:
        """A snapshot's word on an update under way replaces ours; none means none."""
        wu = self.current
        if update is None:
            if wu.pending:
                self.current = WeightUpdate(
                    version=wu.version, started_at=wu.started_at, last_seconds=wu.last_seconds
                )
            return
        self._announced = True
        self.current = WeightUpdate(
            pending=True,
            version=update.version,
            started_at=update.started_at,
            expected_seconds=update.expected_seconds,
            last_seconds=wu.last_seconds,
        )

    def note_abort(self, ts: float) -> None:
        """Forget every cached prefix when aborts look like a weight update.

        A weight update aborts every generation in flight at once and flushes every prefix
        cache (SGLang flushes its radix cache with new weights), also under trajectories
        that were running tools. A trainer that does not send the weight-update events
        leaves it to this guess: half of the decoding trajectories aborted within a few
        seconds is taken as one. One that sends them has flushed already.
        """
        if self._announced:
            return
        aborts = self._aborts
        aborts.append(ts)
        while aborts and aborts[0] < ts - FLUSH_WINDOW_SECONDS:
            aborts.popleft()
        if ts - self._last_flush < FLUSH_REFRACTORY_SECONDS:
            return  # the rest of the same update's aborts
        decoding = self._store.counts[DECODE]
        if len(aborts) >= max(FLUSH_MIN_ABORTS, FLUSH_SHARE * (decoding + len(aborts))):
            aborts.clear()
            self._flush(ts)

    def _flush(self, ts: float) -> None:
        """Every cached prefix is gone (new weights): each next prefill computes it all."""
        n = self._store.hwm
        self._store.c.cached[:n] = array("d", bytes(8 * n))
        self._last_flush = ts
        self.cache_flushes += 1
