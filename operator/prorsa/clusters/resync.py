"""Resync: whether replies ask the trainer for a snapshot, and what a snapshot supersedes.

A snapshot lists every live trajectory as the trainer sees it (or, from a named emitter,
that emitter's). Events stamped before it that arrive after it (from a buffer, a retry or
another emitter) are already reflected in it: they are superseded and not applied, so no
transition is applied twice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from prorsa.core.forecast.emitters import MAX_EMITTERS
from prorsa_contract.events import CLUSTER_EVENT_TYPES, Event


class ResyncState:
    """The snapshots asked for and received, and the cutoff each one set."""

    def __init__(self, *, resync: bool) -> None:
        self._resync = resync
        self.snapshot_ts: float | None = None  # the last snapshot of every trajectory
        # Per named emitter: its last snapshot's ts (its events stamped earlier are
        # superseded), and, while ``resync`` holds, the emitters that have resynced.
        self._emitter_snapshot_ts: OrderedDict[str, float] = OrderedDict()
        self._resynced: OrderedDict[str, None] = OrderedDict()

    @property
    def resync(self) -> bool:
        """True until the trainer has posted a snapshot of every trajectory to this epoch
        (one without an emitter id; named emitters each resync on their own)."""
        return self._resync

    def resync_for(self, emitter: str | None) -> bool:
        """Whether the replies to ``emitter`` ask for its snapshot: until it has posted
        one to this epoch (or a snapshot of every trajectory came)."""
        return self._resync and (emitter is None or emitter not in self._resynced)

    def request(self) -> None:
        """Ask the trainer for a snapshot in the next reply (e.g. after losing state)."""
        self._resync = True
        self._resynced.clear()

    def superseded(
        self, events: Sequence[Event], emitter: str | None
    ) -> tuple[Sequence[Event], list[Event]]:
        """``events`` less the trajectory events a named emitter's last snapshot holds
        already (stamped before it), and those. Its cluster events stay: a snapshot of one
        emitter's trajectories says nothing of a weight update's end."""
        mine = None if emitter is None else self._emitter_snapshot_ts.get(emitter)
        every = self.snapshot_ts
        if mine is None or (every is not None and every >= mine):
            return events, []
        kept: list[Event] = []
        stale: list[Event] = []
        for e in events:
            (kept if not e.ts < mine or e.type in CLUSTER_EVENT_TYPES else stale).append(e)
        return kept, stale

    def move_cutoff(self, ts: float, emitter: str | None) -> Callable[[], None]:
        """A snapshot stamped ``ts`` joins the queue: events stamped before it are
        superseded from now on. Returns what undoes it, should the snapshot not load
        (unless a later snapshot moved the cutoff meanwhile)."""
        cutoffs = self._emitter_snapshot_ts
        if emitter is None:
            every = self.snapshot_ts
            self.snapshot_ts = ts

            def undo_every() -> None:
                if self.snapshot_ts == ts:
                    self.snapshot_ts = every

            return undo_every
        previous = cutoffs.pop(emitter, None)
        cutoffs[emitter] = ts
        if len(cutoffs) > MAX_EMITTERS:
            cutoffs.popitem(last=False)

        def undo_emitter() -> None:
            if cutoffs.get(emitter) == ts:
                if previous is None:
                    del cutoffs[emitter]
                else:
                    cutoffs[emitter] = previous

        return undo_emitter

    def loaded(self, emitter: str | None) -> None:
        """A snapshot loaded: the resync it answers is done."""
        if emitter is None:
            self._resync = False
            self._resynced.clear()
        elif self._resync:
            self._resynced[emitter] = None
            if len(self._resynced) > MAX_EMITTERS:
                self._resynced.popitem(last=False)
