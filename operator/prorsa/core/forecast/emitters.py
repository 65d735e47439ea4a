"""Which emitter reported each trajectory last, for trainers that run one per worker.

Trainers that run one emitter per worker name it (``X-Prorsa-Emitter``): each trajectory
belongs to the emitter that reported it last, and a snapshot from a named emitter replaces
that emitter's trajectories alone (:meth:`EmitterScope.emitting`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np

from prorsa.core.forecast.interner import Interner
from prorsa.core.forecast.slots import CLUSTER_EVENTS, FREE, SlotStore
from prorsa_contract import events as ev

# Distinct emitter ids one table tells apart (workers of one trainer; ids must be stable).
MAX_EMITTERS = 4096


class TooManyEmitters(ValueError):
    """A new emitter id past :data:`MAX_EMITTERS`: its trajectories could not be told apart."""


class EmitterScope:
    """The emitter whose events apply now, and each live trajectory's emitter."""

    def __init__(self, *, store: SlotStore) -> None:
        self._store = store
        # Emitter ids; code 0 ("") is a trainer that names none. ``current`` is the one
        # whose events apply now (None: unnamed), ``scoped`` whether any was ever named.
        self.emitters = Interner(cap=MAX_EMITTERS + 1)
        self.current: int | None = None
        self.scoped = False

    @contextmanager
    def emitting(self, emitter: str | None) -> Iterator[None]:
        """Events applied and snapshots loaded in this block come from ``emitter``.

        Each trajectory belongs to the emitter that reported it last, so a trainer with one
        emitter per worker (verl's agent-loop workers) can resync one worker: a snapshot
        loaded under a named emitter replaces that emitter's trajectories alone. None is a
        trainer that names no emitter: its events belong to the unnamed one, and its
        snapshot replaces every trajectory, as it always has. Raises
        :class:`TooManyEmitters` for a new id past :data:`MAX_EMITTERS`.
        """
        code: int | None = None
        if emitter is not None:
            known = self.emitters.get(emitter)
            if known is None and len(self.emitters.names) > MAX_EMITTERS:
                raise TooManyEmitters(
                    f"more than {MAX_EMITTERS} emitter ids: give each worker a stable one"
                )
            code = known if known is not None else self.emitters.code(emitter)
            self.scoped = True
        previous, self.current = self.current, code
        try:
            yield
        finally:
            self.current = previous

    def own(self, events: Iterable[ev.Event]) -> None:
        """Each live trajectory of ``events`` now belongs to the current emitter."""
        code = self.current or 0
        slots = self._store.slots
        owner = self._store.c.emitter
        for event in events:
            if not isinstance(event, CLUSTER_EVENTS):
                slot = slots.get(event.trajectory)
                if slot is not None:
                    owner[slot] = code

    def _live_mask(self, code: int) -> np.ndarray:
        n = self._store.hwm
        cols = self._store.views()
        mine: np.ndarray = (cols["state"][:n] != FREE) & (cols["emitter"][:n] == code)
        return mine

    def live_of(self, emitter: str | None) -> int:
        """Live trajectories a snapshot from ``emitter`` replaces (None: all of them)."""
        if emitter is None:
            return len(self._store.slots)
        code = self.emitters.get(emitter)
        if code is None:
            return 0
        return int(np.count_nonzero(self._live_mask(code)))

    def counts(self) -> dict[str, int]:
        """Live trajectories by the emitter that reported them last ("": none named)."""
        n = self._store.hwm
        cols = self._store.views()
        codes = cols["emitter"][:n][cols["state"][:n] != FREE]
        counts = np.bincount(codes, minlength=1)
        return {self.emitters.names[c]: int(counts[c]) for c in np.flatnonzero(counts)}

    def release(self, code: int) -> None:
        """Drop the live trajectories emitter ``code`` reported last (they are not ended:
        nothing is remembered of them)."""
        mine = np.flatnonzero(self._live_mask(code))
        if len(mine):
            self._store.release_slots(mine.tolist(), ended=False)
