"""A discrete-event loop in virtual time: callbacks ordered by (time, insertion order).

Everything the loop holds is plain data and bound methods (no closures), so a running
simulation can be copied with :mod:`pickle` and both copies go on identically: the
foresight reference (:mod:`prorsa_lab.sim.reference`) forks the simulator that way.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class SimulationError(RuntimeError):
    """The simulation cannot go on (for instance it ran past its time limit)."""


class _Every:
    """``fn(now)`` every ``interval`` seconds while the loop runs (see :meth:`Loop.every`)."""

    __slots__ = ("fn", "interval", "loop")

    def __init__(self, loop: Loop, interval: float, fn: Callable[[float], Any]) -> None:
        self.loop = loop
        self.interval = interval
        self.fn = fn

    def __call__(self) -> None:
        loop = self.loop
        if loop.stopped:
            return
        self.fn(loop.now)
        loop.at(loop.now + self.interval, self)


class Loop:
    """Runs callbacks in virtual time; nothing here reads a wall clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0  # insertion order: the tie-break of equal times (reproducible)
        self.stopped = False
        self.processed = 0

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` at virtual time ``when`` (never earlier than now)."""
        if when < self.now:
            when = self.now
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn, args))

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + max(delay, 0.0), fn, *args)

    def every(self, interval: float, fn: Callable[[float], Any], *, start: float = 0.0) -> None:
        """Call ``fn(now)`` at ``start`` and then every ``interval`` until the loop stops."""
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.at(start, _Every(self, interval, fn))

    def stop(self) -> None:
        self.stopped = True

    def run(self, *, until: float) -> None:
        """Process events until :meth:`stop` is called; raise past ``until`` seconds."""
        heap = self._heap
        pop = heapq.heappop
        while heap and not self.stopped:
            when, _seq, fn, args = pop(heap)
            if when > until:
                # Put it back: a caller that steps the clock (tests, forks) runs it later.
                heapq.heappush(heap, (when, _seq, fn, args))
                raise SimulationError(f"simulation did not finish within {until:.0f} s")
            self.now = when
            fn(*args)
            self.processed += 1
        if not self.stopped:
            raise SimulationError(f"simulation ran out of events at t={self.now:.1f} s")
