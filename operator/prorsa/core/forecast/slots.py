"""The table's storage: a slot per live trajectory, typed columns at those slots.

Columns live in typed ``array.array`` buffers indexed by slot (struct of arrays). Writing an
event is a dict lookup and a few native scalar writes; a control tick wraps the buffers as
numpy arrays without copying (:meth:`SlotStore.views`) and reads 100k trajectories with a
handful of vectorised masks instead of a Python loop. A live trajectory costs ~70 bytes of
columns plus its id and dict entry.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import Field, dataclass, field, fields
from typing import Any

import numpy as np

from prorsa_contract import events as ev

# State codes of the paper's Figure 4. FREE marks an unused slot.
FREE, STARTING, READY, PREFILL, DECODE, TOOL, REWARD = range(7)
STATE_NAMES = ("free", "starting", "ready", "prefill", "decode", "tool", "reward")
STATE_CODE = {name: code for code, name in enumerate(STATE_NAMES)}

MODE_UNKNOWN, MODE_PREWARM, MODE_COLD = 0, 1, 2
MODE_CODE = {"prewarm": MODE_PREWARM, "cold": MODE_COLD}

# Events of the whole cluster (weight updates): they touch no slot.
CLUSTER_EVENTS = (ev.WeightUpdateStarted, ev.WeightUpdateFinished)
# Events that end a trajectory: applied even when older than its state.
REMOVALS = frozenset({"reward_finished", "trajectory_dropped"})


def _column(code: str, dtype: type[np.generic], fill: float) -> Any:
    """A column of :class:`Columns`: its ``array`` typecode, numpy dtype and fresh value."""
    return field(
        default_factory=lambda: array(code),
        metadata={"code": code, "dtype": dtype, "fill": fill},
    )


@dataclass(frozen=True, slots=True)
class Columns:
    """The table's typed column buffers, one slot per trajectory.

    Named attributes (not ``setattr`` on the table) so every read and write is type-checked;
    the buffers themselves grow in place, so references to them stay valid.
    """

    state: array[int] = _column("b", np.int8, FREE)
    since: array[float] = _column("d", np.float64, 0.0)  # entry into the current state
    queued: array[float] = _column("d", np.float64, 0.0)  # the prompt now waiting was queued
    x: array[float] = _column("d", np.float64, 0.0)  # prompt now; context in tool/reward
    result: array[float] = _column("d", np.float64, -1.0)  # tool result tokens, if said
    cached: array[float] = _column("d", np.float64, 0.0)  # last prefilled prompt: cached
    dispatched: array[float] = _column("d", np.float64, math.nan)
    launched: array[float] = _column("d", np.float64, math.nan)  # sandbox launch a_k
    first_prompt: array[float] = _column("d", np.float64, math.nan)  # said at dispatch
    tool_done: array[int] = _column("b", np.int8, 0)
    queued_once: array[int] = _column("b", np.int8, 0)  # has any request been queued yet
    mode: array[int] = _column("b", np.int8, MODE_UNKNOWN)
    task: array[int] = _column("i", np.int32, -1)
    group: array[int] = _column("i", np.int32, -1)
    tool: array[int] = _column("i", np.int32, -1)
    image: array[int] = _column("i", np.int32, -1)
    node: array[int] = _column("i", np.int32, -1)
    instance: array[int] = _column("i", np.int32, -1)
    turn: array[int] = _column("i", np.int32, 0)
    tool_load: array[int] = _column("b", np.int8, 0)
    inferred: array[int] = _column("b", np.int8, 0)  # in decode by infer_admitted, not an event
    emitter: array[int] = _column("i", np.int32, 0)  # who reported it last (0: none named)

    def buffers(self) -> Iterator[tuple[str, array[Any], Field[Any]]]:
        """Each column's name, buffer and field (its metadata: code, dtype, fill)."""
        for f in fields(self):
            yield f.name, getattr(self, f.name), f

    def grow(self, capacity: int) -> None:
        """Extends every buffer to ``capacity`` fresh slots, in place."""
        for _name, arr, f in self.buffers():
            fill = f.metadata["fill"]
            value = fill if f.metadata["code"] == "d" else int(fill)
            arr.extend(array(f.metadata["code"], [value]) * (capacity - len(arr)))

    def reset(self, slot: int) -> None:
        """Gives ``slot`` every column's fresh value."""
        for _name, arr, f in self.buffers():
            arr[slot] = f.metadata["fill"]

    def views(self) -> dict[str, np.ndarray]:
        """Zero-copy numpy views, by column name."""
        return {
            name: np.frombuffer(arr, dtype=f.metadata["dtype"]) for name, arr, f in self.buffers()
        }


class SlotStore:
    """Which slot each live trajectory holds, how many are in each state, their groups,
    and the trajectories that ended (so their late events cannot bring them back).

    Every container here is made once and changed in place: the parts of the table that
    apply events hold references to them (``c``, ``counts``, ``slots``, ``finished``).
    """

    def __init__(self, *, finished_window: int, initial_capacity: int) -> None:
        self.slots: dict[str, int] = {}
        self._free: list[int] = []
        self.hwm = 0  # slots [0, hwm) have been used at least once
        self._capacity = 0
        self.c = Columns()
        self._grow(initial_capacity)
        self.counts = [0] * len(STATE_NAMES)
        self.finished: OrderedDict[str, None] = OrderedDict()
        self._finished_window = finished_window
        self.groups: dict[str, int] = {}
        self._group_names: list[str | None] = []
        self._group_live: list[int] = []
        self._group_free: list[int] = []

    def _grow(self, capacity: int) -> None:
        # In place, so references to the buffers stay valid. No numpy view may be alive here.
        self.c.grow(capacity)
        self._capacity = capacity

    def views(self) -> dict[str, np.ndarray]:
        """Zero-copy numpy views of the columns, valid until the next applied event.

        Readers (the tick) must drop them before more events are applied: a live view pins
        the buffers, and growing the table would then fail.
        """
        return self.c.views()

    def alloc(self, trajectory: str, state: int, ts: float) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            if self.hwm == self._capacity:
                self._grow(self._capacity * 2)
            slot = self.hwm
            self.hwm += 1
        self.c.reset(slot)
        self.c.state[slot] = state
        self.c.since[slot] = ts
        self.c.queued[slot] = ts
        self.counts[state] += 1
        self.slots[trajectory] = slot
        return slot

    def release(self, trajectory: str, slot: int, *, ended: bool = True) -> None:
        self.counts[int(self.c.state[slot])] -= 1
        self.c.state[slot] = FREE
        g = int(self.c.group[slot])
        if g >= 0:
            self._group_live[g] -= 1
            if self._group_live[g] == 0:
                name = self._group_names[g]
                if name is not None:
                    del self.groups[name]
                self._group_names[g] = None
                self._group_free.append(g)
        del self.slots[trajectory]
        self._free.append(slot)
        if ended:
            self.tombstone(trajectory)

    def release_slots(self, slots: list[int], *, ended: bool) -> None:
        """Release the live trajectories at ``slots`` (one pass over the slot map)."""
        wanted = set(slots)
        for trajectory, slot in [(t, s) for t, s in self.slots.items() if s in wanted]:
            self.release(trajectory, slot, ended=ended)

    def tombstone(self, trajectory: str) -> None:
        """Remember that ``trajectory`` ended (the newest ``finished_window`` of them), so
        its late or out-of-order events cannot bring it back."""
        finished = self.finished
        finished[trajectory] = None
        finished.move_to_end(trajectory)
        if len(finished) > self._finished_window:
            finished.popitem(last=False)

    def join_group(self, slot: int, name: str | None) -> None:
        if name is None or self.c.group[slot] >= 0:
            return
        g = self.groups.get(name)
        if g is None:
            if self._group_free:
                g = self._group_free.pop()
                self._group_names[g] = name
                self._group_live[g] = 0
            else:
                g = len(self._group_names)
                self._group_names.append(name)
                self._group_live.append(0)
            self.groups[name] = g
        self.c.group[slot] = g
        self._group_live[g] += 1

    def group_live_counts(self) -> np.ndarray:
        return np.asarray(self._group_live, dtype=np.int64)

    def split_at_limit(
        self, events: list[ev.Event], limit: int
    ) -> tuple[list[ev.Event], list[ev.Event]]:
        """``events`` that fit under ``limit`` live trajectories, and the rest: those that
        would start a trajectory past it, with every later event of that trajectory.

        Events of live trajectories always fit (a trajectory that ends frees its slot, so
        refusing those would keep the table full for good), as do ends of unknown ones.
        What is refused is left out whole per trajectory, so a resent batch applies it in
        order. A batch that cannot reach the limit is not looked at.
        """
        slots = self.slots
        room = limit - len(slots)
        if len(events) <= room:
            return events, []
        finished = self.finished
        fits: list[ev.Event] = []
        left: list[ev.Event] = []
        started: set[str] = set()
        refused: set[str] = set()
        for event in events:
            if isinstance(event, CLUSTER_EVENTS):
                fits.append(event)
                continue
            t = event.trajectory
            if t in refused:
                left.append(event)
            elif t in slots or t in started or event.type in REMOVALS or t in finished:
                fits.append(event)
            elif room > 0:
                room -= 1
                started.add(t)
                fits.append(event)
            else:
                refused.add(t)
                left.append(event)
        return fits, left
