"""Which trainer timestamps the webhook believes: a window around the server's wall clock.

Every elapsed time the Controller measures is ``now - ts`` on the trainer's clock, and the
server estimates that clock from the timestamps themselves. One timestamp in milliseconds,
``1e300``, or seconds since the trainer started would otherwise move the estimate of the
present by years: the next tick would find every trajectory silent for longer than its
TTL, and ``prorsa ingest`` could not even print the time. Such a value is a trainer bug,
so it is refused (422, naming the field) before anything is applied or measured.

The window is wide on purpose. Ahead: a trainer clock may run fast (an hour by default).
Behind: events may wait in a client's buffer or retries, and a snapshot's ``since`` may be
old (a week by default). Smaller errors within the window are the clock estimate's job
(:mod:`prorsa.clusters.clock`), and eviction never runs faster than real time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prorsa_contract.events import Event, FieldError, Snapshot


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeWindow:
    """Unix seconds the server accepts from a trainer: ``now - behind`` to ``now + ahead``."""

    now: float
    ahead: float
    behind: float

    @property
    def earliest(self) -> float:
        return self.now - self.behind

    @property
    def latest(self) -> float:
        return self.now + self.ahead

    def __contains__(self, ts: float) -> bool:
        return self.now - self.behind <= ts <= self.now + self.ahead

    def explain(self, ts: float) -> str:
        """Why ``ts`` is refused, for a trainer developer reading a 422."""
        side = "ahead of" if ts > self.now else "behind"
        return (
            f"{ts:.10g} is {abs(ts - self.now):.3g} s {side} the server's clock, outside the "
            f"window it accepts ({self.behind:g} s behind to {self.ahead:g} s ahead): send "
            "unix seconds from a synchronised clock"
        )


def events_outside(events: Sequence[Event], window: TimeWindow) -> list[FieldError]:
    """One error per event whose ``ts`` is outside ``window`` (none: the batch is fine)."""
    if not events:
        return []
    stamps = [e.ts for e in events]
    if window.earliest <= min(stamps) and max(stamps) <= window.latest:
        return []
    return [
        FieldError(i, "ts", window.explain(ts)) for i, ts in enumerate(stamps) if ts not in window
    ]


def snapshot_outside(snapshot: Snapshot, window: TimeWindow) -> list[FieldError]:
    """Errors for a snapshot's ``ts``, each ``since`` and ``weight_update.started_at``."""
    times: list[tuple[str, float]] = [("ts", snapshot.ts)]
    times += [(f"trajectories.{i}.since", t.since) for i, t in enumerate(snapshot.trajectories)]
    if snapshot.weight_update is not None:
        times.append(("weight_update.started_at", snapshot.weight_update.started_at))
    return [FieldError(None, field, window.explain(ts)) for field, ts in times if ts not in window]
