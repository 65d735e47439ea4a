"""The trajectory table: every live trajectory's place in the Figure 4 state machine.

The table is the one object the Controller and the forecast hold; its parts are modules of
their own, each holding one thing it does:

- :mod:`~prorsa.core.forecast.slots`: the storage, a slot per live trajectory in typed
  column buffers (struct of arrays) that a tick reads as numpy arrays without copying;
- :mod:`~prorsa.core.forecast.transitions`: what each lifecycle event does to its
  trajectory's slot, and the anomalies counted instead of raised;
- :mod:`~prorsa.core.forecast.weight_updates`: the weight updates announced (or guessed
  from aborts) and the prefix caches they flush;
- :mod:`~prorsa.core.forecast.prefill_sight`: prefills that no event reports;
- :mod:`~prorsa.core.forecast.emitters`: which emitter reported each trajectory last;
- :mod:`~prorsa.core.forecast.snapshot`: the trainer's snapshot loaded.

What is left here is the way in (:meth:`TrajectoryTable.apply`, which dedupes a batch and
hands each event to its handler) and what a tick reads of the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from prorsa.core.dedupe import DedupeWindow
from prorsa.core.forecast.emitters import EmitterScope
from prorsa.core.forecast.interner import Labels
from prorsa.core.forecast.prefill_sight import PrefillSight
from prorsa.core.forecast.slots import (
    CLUSTER_EVENTS,
    DECODE,
    FREE,
    PREFILL,
    READY,
    REMOVALS,
    STATE_NAMES,
    TOOL,
    SlotStore,
)
from prorsa.core.forecast.snapshot import load_snapshot
from prorsa.core.forecast.transitions import ANOMALY_KINDS, Observer, Transitions
from prorsa.core.forecast.weight_updates import WeightUpdate, WeightUpdates
from prorsa_contract import events as ev

# States whose trajectory holds a context that comes back to prefill (paper §3.1: after a
# weight update every carried-over trajectory re-prefills its whole context).
_HOLDS_CONTEXT = (READY, PREFILL, DECODE, TOOL)


@dataclass(frozen=True, slots=True)
class ApplyResult:
    applied: int
    duplicates: int
    anomalies: int


class TrajectoryTable:
    """Applies lifecycle events (the paper's Figure 4) to per-trajectory state."""

    def __init__(
        self,
        *,
        observer: Observer,
        dedupe_window: int = 65_536,
        finished_window: int = 131_072,
        initial_capacity: int = 1024,
    ) -> None:
        self._obs = observer
        store = self._store = SlotStore(
            finished_window=finished_window, initial_capacity=initial_capacity
        )
        # The containers the parts share, made once and changed in place.
        self._slots = store.slots
        self.counts = store.counts
        self.groups = store.groups
        self.anomalies: dict[str, int] = dict.fromkeys(ANOMALY_KINDS, 0)
        labels = self._labels = Labels()
        self.tasks = labels.tasks
        self.tools = labels.tools
        self.images = labels.images
        self.nodes = labels.nodes
        self.instances = labels.instances
        self._updates = WeightUpdates(store=store, anomalies=self.anomalies)
        self._sight = PrefillSight()
        self._scope = EmitterScope(store=store)
        self.emitters = self._scope.emitters
        self._transitions = Transitions(
            store=store,
            labels=labels,
            observer=observer,
            updates=self._updates,
            sight=self._sight,
            anomalies=self.anomalies,
        )
        self._handlers: dict[str, Callable[[Any, int | None], None]] = {
            **self._transitions.handlers(),
            "weight_update_started": self._updates.started,
            "weight_update_finished": self._updates.finished,
        }
        # Replayed event ids (0: the caller dedupes, e.g. the webhook's own window).
        self._dedupe = DedupeWindow(capacity=dedupe_window) if dedupe_window > 0 else None
        self.events_applied = 0
        self.last_event_ts: float | None = None

    # -- applying events -------------------------------------------------------------------

    def apply(self, events: Iterable[ev.Event]) -> ApplyResult:
        duplicates = 0
        window = self._dedupe
        if window is not None:
            # One pass over the ids (DedupeWindow.admit) instead of a call per event.
            batch = events if isinstance(events, list) else list(events)
            events, duplicates, _ = window.admit(batch)
        applied = stale = 0
        before = sum(self.anomalies.values())
        handlers = self._handlers
        slots = self._slots
        since = self._store.c.since
        latest = -math.inf
        try:
            for event in events:
                applied += 1
                ts = event.ts
                if ts > latest:
                    latest = ts
                if isinstance(event, CLUSTER_EVENTS):
                    handlers[event.type](event, None)
                    continue
                slot = slots.get(event.trajectory)
                if slot is not None and ts < since[slot] and event.type not in REMOVALS:
                    stale += 1  # the table already holds newer news of this trajectory
                    continue
                handlers[event.type](event, slot)
        except BaseException:
            if window is not None:
                # As if each id had been admitted just before its event: the ones after
                # the failure were never seen, so a retry applies them.
                window.forget(e.id for e in events[applied:])  # type: ignore[index]
            raise
        if self._scope.scoped:
            self._scope.own(events)
        self.anomalies["duplicate"] += duplicates
        self.anomalies["stale"] += stale
        if applied and (self.last_event_ts is None or latest > self.last_event_ts):
            self.last_event_ts = latest
        self.events_applied += applied
        anomalies = sum(self.anomalies.values()) - before - duplicates
        return ApplyResult(applied=applied, duplicates=duplicates, anomalies=anomalies)

    def set_dedupe_window(self, size: int) -> None:
        """Resize the replay window; 0 turns it off for callers that dedupe before us."""
        self._dedupe = DedupeWindow(capacity=size) if size > 0 else None

    def split_at_limit(
        self, events: list[ev.Event], limit: int
    ) -> tuple[list[ev.Event], list[ev.Event]]:
        """See :meth:`SlotStore.split_at_limit`."""
        return self._store.split_at_limit(events, limit)

    def load_snapshot(self, snapshot: ev.Snapshot) -> None:
        """Replace the table with the trainer's view (resync after an operator restart);
        under :meth:`emitting` a named emitter, only that emitter's trajectories."""
        load_snapshot(
            snapshot,
            store=self._store,
            labels=self._labels,
            scope=self._scope,
            transitions=self._transitions,
            updates=self._updates,
        )
        if self.last_event_ts is None or snapshot.ts > self.last_event_ts:
            self.last_event_ts = snapshot.ts

    # -- emitters --------------------------------------------------------------------------

    def emitting(self, emitter: str | None) -> AbstractContextManager[None]:
        """Events applied and snapshots loaded in this block come from ``emitter``
        (:meth:`EmitterScope.emitting`)."""
        return self._scope.emitting(emitter)

    def live_of(self, emitter: str | None) -> int:
        """Live trajectories a snapshot from ``emitter`` replaces (None: all of them)."""
        return self._scope.live_of(emitter)

    def emitter_counts(self) -> dict[str, int]:
        """Live trajectories by the emitter that reported them last ("": none named).

        Reads the columns: call it where no batch can apply meanwhile (the handle's lock).
        """
        return self._scope.counts()

    # -- weight updates and unseen prefills ------------------------------------------------

    @property
    def weight_update(self) -> WeightUpdate:
        """The last weight update the trainer announced, as of the events applied."""
        return self._updates.current

    @property
    def cache_flushes(self) -> int:
        """Weight updates so far (announced, or read from aborts): every prefix flushed."""
        return self._updates.cache_flushes

    @property
    def prefill_blind(self) -> bool:
        """Whether the trainer leaves out when prefills end (:class:`PrefillSight`)."""
        return self._sight.blind

    @property
    def inferred_admissions(self) -> int:
        return self._sight.inferred_admissions

    def infer_admitted(
        self, now: float, *, in_prefill: int | None, seconds_per_token: float
    ) -> int:
        """Move the ready requests of a blind trainer that have left prefill to ``decode``
        (:meth:`PrefillSight.left_prefill`). Returns how many moved."""
        sight = self._sight
        sight.seconds_per_token = max(seconds_per_token, 0.0)
        if not sight.blind or self.counts[READY] == 0:
            return 0
        moved = sight.left_prefill(self._store, now=now, in_prefill=in_prefill)
        self._transitions.admit_inferred(moved, now)
        sight.inferred_admissions += len(moved)
        return len(moved)

    @property
    def generated_tokens(self) -> int:
        """Output tokens of every decode_finished applied (aborted partial outputs too)."""
        return self._transitions.generated_tokens

    # -- what a tick reads -----------------------------------------------------------------

    @property
    def cols(self) -> dict[str, np.ndarray]:
        """Zero-copy numpy views of the columns, valid until the next applied event.

        Readers (the tick) must drop them before more events are applied: a live view pins
        the buffers, and growing the table would then fail.
        """
        return self._store.views()

    @property
    def hwm(self) -> int:
        """Slots [0, hwm) have been used at least once: the rows a tick reads."""
        return self._store.hwm

    def __len__(self) -> int:
        return len(self._slots)

    def state_counts(self) -> dict[str, int]:
        return {STATE_NAMES[i]: self.counts[i] for i in range(1, len(STATE_NAMES))}

    def slot_of(self, trajectory: str) -> int | None:
        return self._slots.get(trajectory)

    def group_live_counts(self) -> np.ndarray:
        return self._store.group_live_counts()

    def context_of(self, trajectory: str) -> float | None:
        """The context a live trajectory holds (tokens), None for an unknown one."""
        slot = self._slots.get(trajectory)
        return None if slot is None else float(self._store.c.x[slot])

    def live_contexts_by_instance(self) -> dict[str, float]:
        """Context tokens of live trajectories by the instance their last prefill ran on.

        Those contexts come back as the prefixes of their next prompts, and cache-aware
        routing sends them to the same instance: this is what each prefix cache is worth.
        One pass over the table for every instance (the tick prices several).
        """
        n = self.hwm
        cols = self.cols
        state = cols["state"][:n]
        codes = cols["instance"][:n]
        live = np.isin(state, (READY, PREFILL, DECODE, TOOL)) & (codes >= 0)
        if not live.any():
            return {}
        sums = np.bincount(codes[live], weights=cols["x"][:n][live])
        return {
            name: float(sums[code])
            for code in np.flatnonzero(sums)
            if (name := self.instances.name(int(code))) is not None
        }

    def live_context_on(self, instance: str) -> float:
        """Context tokens of live trajectories whose last prefill ran on ``instance``."""
        return self.live_contexts_by_instance().get(instance, 0.0)

    def reprefill_tokens(self) -> float:
        """Tokens of the live contexts that will re-prefill after a weight update.

        A trajectory that is ready, in prefill, decoding (to be interrupted and resent) or
        running a tool holds a context that comes back to prefill, and with every prefix
        cache flushed it computes all of it (paper §3.1).
        """
        n = self.hwm
        cols = self.cols
        holds = np.isin(cols["state"][:n], _HOLDS_CONTEXT)
        return float(cols["x"][:n][holds].sum())

    def prefill_waiting(self, now: float) -> tuple[int, float]:
        """Prompts queued whose prefill has not ended (``ready`` or ``prefill``), and the
        longest any of them has waited since it was queued (0 when none waits)."""
        waiting = self.counts[READY] + self.counts[PREFILL]
        if waiting == 0:
            return 0, 0.0
        n = self.hwm
        cols = self.cols
        state = cols["state"][:n]
        queued = cols["queued"][:n][(state == READY) | (state == PREFILL)]
        oldest = float(queued.min()) if len(queued) else now
        del cols, state
        return waiting, max(0.0, now - oldest)

    def evict_older_than(self, cutoff: float) -> int:
        """Drop trajectories that have sat in one state since before ``cutoff``."""
        n = self.hwm
        cols = self.cols
        live = cols["state"][:n] != FREE
        old = np.flatnonzero(live & (cols["since"][:n] < cutoff)).tolist()
        del cols, live
        if not old:
            return 0
        by_slot = {slot: t for t, slot in self._slots.items()}
        for slot in old:
            self._store.release(by_slot[slot], slot)
        self.anomalies["evicted"] += len(old)
        return len(old)
