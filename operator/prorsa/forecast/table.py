"""The trajectory table: every live trajectory's place in the Figure 4 state machine.

Columns live in numpy arrays indexed by a slot per trajectory (struct of arrays), so a
control tick reads 100k trajectories with a handful of vectorised masks instead of a Python
loop, while applying one event stays a dict lookup and a few scalar writes. A live
trajectory costs ~100 bytes of columns plus its id and dict entry.

Events that do not fit the current state never raise: each is resolved by a fixed rule and
counted by kind in :attr:`TrajectoryTable.anomalies`, so a trainer bug shows up in metrics
instead of crashing the controller.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from prorsa import events as ev

# State codes. FREE marks an unused slot.
FREE, STARTING, READY, PREFILL, DECODE, TOOL, REWARD = range(7)
STATE_NAMES = ("free", "starting", "ready", "prefill", "decode", "tool", "reward")
STATE_CODE = {name: code for code, name in enumerate(STATE_NAMES)}

MODE_UNKNOWN, MODE_PREWARM, MODE_COLD = 0, 1, 2
MODE_CODE = {"prewarm": MODE_PREWARM, "cold": MODE_COLD}
MODE_NAMES = ("unknown", "prewarm", "cold")

ANOMALY_KINDS = (
    "duplicate",  # an event id seen before (idempotent replay)
    "stale",  # older than the trajectory's current state: applied state is newer
    "unknown_trajectory",  # first heard of mid-life: created in the event's state
    "finished_trajectory",  # the trajectory already left the table
    "unexpected_transition",  # valid state change not allowed from the current state: applied
    "evicted",  # silent for longer than the TTL: removed at a tick
)


class Observer(Protocol):
    """What the table tells the statistics as lifecycle facts become known."""

    def on_startup(self, *, key: tuple[object, ...], seconds: float) -> None: ...
    def on_dispatch_delay(self, *, seconds: float) -> None: ...
    def on_first_prompt(self, *, task: int, tokens: float) -> None: ...
    def on_growth(self, *, key: tuple[object, ...], tokens: float, result_known: bool) -> None: ...
    def on_tool(self, *, key: tuple[object, ...], seconds: float) -> None: ...
    def on_reward(self, *, task: int, seconds: float, accepted: bool) -> None: ...
    def on_arrival(self, *, ts: float, tokens: float) -> None: ...
    def on_admission(self, *, ts: float, tokens: float) -> None: ...
    def on_prefill_interval(self, *, tokens: float, seconds: float) -> None: ...


class Interner:
    """Small ints for label strings (tasks, tools, images, instances), capped in number.

    Past the cap every new label maps to one shared "other" code, which keeps memory
    bounded when a trainer puts unbounded values in a label field.
    """

    OTHER = 0

    def __init__(self, *, cap: int = 8192) -> None:
        self._codes: dict[str, int] = {"": 0}
        self.names: list[str] = [""]
        self._cap = cap

    def code(self, name: str | None) -> int:
        if name is None:
            return -1
        code = self._codes.get(name)
        if code is None:
            if len(self.names) >= self._cap:
                return self.OTHER
            code = self._codes[name] = len(self.names)
            self.names.append(name)
        return code

    def get(self, name: str) -> int | None:
        return self._codes.get(name)

    def name(self, code: int) -> str | None:
        return None if code < 0 else self.names[code]


def turn_bucket(turn: int) -> int:
    """Turns 0, 1, 2–3, 4–7, ...: tool behaviour shifts with depth, but slowly."""
    return min(int(turn).bit_length(), 8)


def load_bucket(n_in_tool: int) -> int:
    """Concurrent tool load in factors of four (sandboxes slow down under load)."""
    return min(int(n_in_tool).bit_length() // 2, 10)


@dataclass(frozen=True, slots=True)
class ApplyResult:
    applied: int
    duplicates: int
    anomalies: int


_COLUMNS: tuple[tuple[str, type, float], ...] = (
    ("state", np.int8, FREE),
    ("since", np.float64, 0.0),  # entry into the current state (trainer clock)
    ("x", np.float64, 0.0),  # full prompt of the current request; context in tool/reward
    ("result", np.float64, -1.0),  # tool result tokens when tool_finished said so
    ("dispatched", np.float64, math.nan),
    ("launched", np.float64, math.nan),  # sandbox launch a_k
    ("first_prompt", np.float64, math.nan),  # prompt_tokens announced at dispatch
    ("tool_done", np.bool_, False),
    ("queued_once", np.bool_, False),  # has any request been queued yet
    ("mode", np.int8, MODE_UNKNOWN),
    ("task", np.int32, -1),
    ("group", np.int32, -1),
    ("tool", np.int32, -1),
    ("image", np.int32, -1),
    ("node", np.int32, -1),
    ("instance", np.int32, -1),
    ("turn", np.int32, 0),
    ("tool_load", np.int8, 0),
)


class TrajectoryTable:
    """Applies lifecycle events (Figure 4 / DESIGN.md) to per-trajectory state."""

    def __init__(
        self,
        *,
        observer: Observer,
        dedupe_window: int = 262_144,
        finished_window: int = 131_072,
        initial_capacity: int = 1024,
    ) -> None:
        self._obs = observer
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._hwm = 0  # slots [0, hwm) have been used at least once
        self._capacity = 0
        self.cols: dict[str, np.ndarray] = {}
        self._grow(initial_capacity)
        self._seen_ids: OrderedDict[str, None] = OrderedDict()
        self._dedupe_window = dedupe_window
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._finished_window = finished_window
        self.counts = [0] * len(STATE_NAMES)
        self.anomalies: dict[str, int] = dict.fromkeys(ANOMALY_KINDS, 0)
        self.events_applied = 0
        self.last_event_ts: float | None = None
        self.tasks = Interner()
        self.tools = Interner()
        self.images = Interner()
        self.nodes = Interner()
        self.instances = Interner(cap=4096)
        self.groups: dict[str, int] = {}
        self._group_names: list[str | None] = []
        self._group_live: list[int] = []
        self._group_free: list[int] = []
        # Per prefill instance, the busy interval in progress: [in flight, start, tokens].
        self._busy: dict[int, list[float]] = {}
        self._handlers: dict[str, Callable[[ev.Event], None]] = {
            "sample_dispatched": self._sample_dispatched,
            "sandbox_started": self._sandbox_started,
            "request_queued": self._request_queued,
            "prefill_started": self._prefill_started,
            "prefill_finished": self._prefill_finished,
            "decode_finished": self._decode_finished,
            "tool_started": self._tool_started,
            "tool_finished": self._tool_finished,
            "reward_started": self._reward_started,
            "reward_finished": self._reward_finished,
            "trajectory_dropped": self._trajectory_dropped,
        }

    # -- storage -------------------------------------------------------------------------

    def _grow(self, capacity: int) -> None:
        for name, dtype, fill in _COLUMNS:
            new = np.full(capacity, fill, dtype=dtype)
            old = self.cols.get(name)
            if old is not None:
                new[: len(old)] = old
            self.cols[name] = new
            setattr(self, "_" + name, new)
        self._capacity = capacity

    def _alloc(self, trajectory: str, state: int, ts: float) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            if self._hwm == self._capacity:
                self._grow(self._capacity * 2)
            slot = self._hwm
            self._hwm += 1
        for name, _dtype, fill in _COLUMNS:
            self.cols[name][slot] = fill
        self._state[slot] = state
        self._since[slot] = ts
        self.counts[state] += 1
        self._slots[trajectory] = slot
        return slot

    def _release(self, trajectory: str, slot: int) -> None:
        self.counts[int(self._state[slot])] -= 1
        self._state[slot] = FREE
        g = int(self._group[slot])
        if g >= 0:
            self._group_live[g] -= 1
            if self._group_live[g] == 0:
                name = self._group_names[g]
                if name is not None:
                    del self.groups[name]
                self._group_names[g] = None
                self._group_free.append(g)
        del self._slots[trajectory]
        self._free.append(slot)
        self._finished[trajectory] = None
        if len(self._finished) > self._finished_window:
            self._finished.popitem(last=False)

    def _set_state(self, slot: int, state: int, ts: float) -> None:
        old = int(self._state[slot])
        if old != state:
            self.counts[old] -= 1
            self.counts[state] += 1
            self._state[slot] = state
        self._since[slot] = ts

    def _join_group(self, slot: int, name: str | None) -> None:
        if name is None or self._group[slot] >= 0:
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
        self._group[slot] = g
        self._group_live[g] += 1

    @property
    def hwm(self) -> int:
        return self._hwm

    def __len__(self) -> int:
        return len(self._slots)

    def group_live_counts(self) -> np.ndarray:
        return np.asarray(self._group_live, dtype=np.int64)

    # -- applying events -----------------------------------------------------------------

    def apply(self, events: Iterable[ev.Event]) -> ApplyResult:
        applied = duplicates = 0
        before = sum(self.anomalies.values())
        seen = self._seen_ids
        handlers = self._handlers
        for event in events:
            if event.id in seen:
                duplicates += 1
                self.anomalies["duplicate"] += 1
                continue
            seen[event.id] = None
            handlers[event.type](event)
            applied += 1
            if self.last_event_ts is None or event.ts > self.last_event_ts:
                self.last_event_ts = event.ts
        while len(seen) > self._dedupe_window:
            seen.popitem(last=False)
        self.events_applied += applied
        anomalies = sum(self.anomalies.values()) - before - duplicates
        return ApplyResult(applied=applied, duplicates=duplicates, anomalies=anomalies)

    def _lookup(self, event: ev.Event, *, create_state: int | None) -> int | None:
        """The event's slot, or None when it must be ignored (counted)."""
        slot = self._slots.get(event.trajectory)
        if slot is not None:
            if event.ts < self._since[slot]:
                self.anomalies["stale"] += 1
                return None
            return slot
        if event.trajectory in self._finished:
            self.anomalies["finished_trajectory"] += 1
            return None
        if create_state is None:
            self.anomalies["unknown_trajectory"] += 1
            return None
        return self._alloc(event.trajectory, create_state, event.ts)

    def _expect(self, slot: int, allowed: tuple[int, ...]) -> None:
        if int(self._state[slot]) not in allowed:
            self.anomalies["unexpected_transition"] += 1

    def _sample_dispatched(self, e: ev.Event) -> None:
        assert isinstance(e, ev.SampleDispatched)
        if e.trajectory in self._slots:
            self.anomalies["unexpected_transition"] += 1
            return
        slot = self._lookup(e, create_state=STARTING)
        if slot is None:
            return
        self._dispatched[slot] = e.ts
        self._task[slot] = self.tasks.code(e.task)
        if e.prompt_tokens is not None:
            self._first_prompt[slot] = e.prompt_tokens
        self._join_group(slot, e.group)

    def _sandbox_started(self, e: ev.Event) -> None:
        assert isinstance(e, ev.SandboxStarted)
        known = e.trajectory in self._slots
        slot = self._lookup(e, create_state=STARTING)
        if slot is None:
            return
        if known:
            self._expect(slot, (STARTING,))
        else:
            self.anomalies["unknown_trajectory"] += 1
        self._set_state(slot, STARTING, e.ts)
        self._launched[slot] = e.ts
        self._mode[slot] = MODE_CODE[e.mode]
        self._image[slot] = self.images.code(e.image)
        self._node[slot] = self.nodes.code(e.node_class)

    def startup_key(self, slot: int) -> tuple[object, ...]:
        """Conditioning class of Eq. 6: (mode, image, node class)."""
        return (int(self._mode[slot]), int(self._image[slot]), int(self._node[slot]))

    def tool_key(self, slot: int) -> tuple[object, ...]:
        """Conditioning class of Eq. 9: (task, tool, turn, concurrent tool load)."""
        return (
            int(self._task[slot]),
            int(self._tool[slot]),
            turn_bucket(int(self._turn[slot])),
            int(self._tool_load[slot]),
        )

    def _request_queued(self, e: ev.Event) -> None:
        assert isinstance(e, ev.RequestQueued)
        known = e.trajectory in self._slots
        slot = self._lookup(e, create_state=READY)
        if slot is None:
            return
        if not known:
            self.anomalies["unknown_trajectory"] += 1
        state = int(self._state[slot])
        obs = self._obs
        if known:
            self._expect(slot, (STARTING, TOOL, READY, DECODE))
            if state == STARTING and not self._queued_once[slot]:
                if not math.isnan(self._launched[slot]):
                    obs.on_startup(key=self.startup_key(slot), seconds=e.ts - self._launched[slot])
                elif not math.isnan(self._dispatched[slot]):
                    obs.on_startup(key=("dispatch",), seconds=e.ts - self._dispatched[slot])
                if not math.isnan(self._dispatched[slot]) and self._mode[slot] != MODE_COLD:
                    obs.on_dispatch_delay(seconds=e.ts - self._dispatched[slot])
            elif state == TOOL:
                known_result = self._result[slot] >= 0
                base = self._x[slot] + (self._result[slot] if known_result else 0.0)
                obs.on_growth(
                    key=(int(self._task[slot]), int(self._tool[slot])),
                    tokens=e.prompt_tokens - base,
                    result_known=bool(known_result),
                )
        if not self._queued_once[slot]:
            obs.on_first_prompt(task=int(self._task[slot]), tokens=float(e.prompt_tokens))
            self._queued_once[slot] = True
        self._set_state(slot, READY, e.ts)
        self._x[slot] = e.prompt_tokens
        self._turn[slot] = e.turn
        self._instance[slot] = -1
        obs.on_arrival(ts=e.ts, tokens=float(e.prompt_tokens))

    def _prefill_started(self, e: ev.Event) -> None:
        assert isinstance(e, ev.PrefillStarted)
        slot = self._lookup(e, create_state=PREFILL)
        if slot is None:
            return
        self._expect(slot, (READY, PREFILL))
        self._set_state(slot, PREFILL, e.ts)
        if e.instance is not None:
            m = self.instances.code(e.instance)
            self._instance[slot] = m
            busy = self._busy.get(m)
            if busy is None or busy[0] <= 0:
                self._busy[m] = [1.0, e.ts, 0.0]
            else:
                busy[0] += 1

    def _prefill_finished(self, e: ev.Event) -> None:
        assert isinstance(e, ev.PrefillFinished)
        slot = self._lookup(e, create_state=DECODE)
        if slot is None:
            return
        self._expect(slot, (PREFILL, READY))
        tokens = float(self._x[slot])
        m = int(self._instance[slot])
        if e.instance is not None and m < 0:
            m = self.instances.code(e.instance)
        busy = self._busy.get(m)
        if busy is not None and busy[0] > 0:
            busy[0] -= 1
            busy[2] += tokens
            if busy[0] <= 0:
                self._obs.on_prefill_interval(tokens=busy[2], seconds=e.ts - busy[1])
        self._set_state(slot, DECODE, e.ts)
        self._obs.on_admission(ts=e.ts, tokens=tokens)

    def _decode_finished(self, e: ev.Event) -> None:
        assert isinstance(e, ev.DecodeFinished)
        slot = self._lookup(e, create_state=DECODE)
        if slot is None:
            return
        self._expect(slot, (DECODE, PREFILL))
        self._x[slot] += e.output_tokens
        if e.finish == "tool":
            self._enter_tool(slot, e.ts)
        elif e.finish == "abort":
            # Cancel-and-resend: prompt + partial output goes back to the ready queue.
            self._set_state(slot, READY, e.ts)
        else:
            self._set_state(slot, REWARD, e.ts)

    def _enter_tool(self, slot: int, ts: float) -> None:
        self._set_state(slot, TOOL, ts)
        self._tool_done[slot] = False
        self._result[slot] = -1.0
        self._tool_load[slot] = load_bucket(self.counts[TOOL])

    def _tool_started(self, e: ev.Event) -> None:
        assert isinstance(e, ev.ToolStarted)
        slot = self._lookup(e, create_state=TOOL)
        if slot is None:
            return
        self._expect(slot, (TOOL, DECODE))
        self._enter_tool(slot, e.ts)
        self._tool[slot] = self.tools.code(e.tool)

    def _tool_finished(self, e: ev.Event) -> None:
        assert isinstance(e, ev.ToolFinished)
        slot = self._lookup(e, create_state=TOOL)
        if slot is None:
            return
        self._expect(slot, (TOOL,))
        if int(self._state[slot]) == TOOL and not self._tool_done[slot]:
            self._obs.on_tool(key=self.tool_key(slot), seconds=e.ts - self._since[slot])
        else:
            self._set_state(slot, TOOL, e.ts)
        self._tool_done[slot] = True
        if e.result_tokens is not None:
            self._result[slot] = e.result_tokens

    def _reward_started(self, e: ev.Event) -> None:
        assert isinstance(e, ev.RewardStarted)
        slot = self._lookup(e, create_state=REWARD)
        if slot is None:
            return
        self._expect(slot, (REWARD, DECODE, TOOL))
        self._set_state(slot, REWARD, e.ts)

    def _reward_finished(self, e: ev.Event) -> None:
        assert isinstance(e, ev.RewardFinished)
        slot = self._slots.get(e.trajectory)
        if slot is None:
            kind = "finished_trajectory" if e.trajectory in self._finished else "unknown_trajectory"
            self.anomalies[kind] += 1
            return
        if int(self._state[slot]) == REWARD and e.ts >= self._since[slot]:
            self._obs.on_reward(
                task=int(self._task[slot]), seconds=e.ts - self._since[slot], accepted=e.accepted
            )
        else:
            self.anomalies["unexpected_transition"] += 1
        self._release(e.trajectory, slot)

    def _trajectory_dropped(self, e: ev.Event) -> None:
        slot = self._slots.get(e.trajectory)
        if slot is None:
            kind = "finished_trajectory" if e.trajectory in self._finished else "unknown_trajectory"
            self.anomalies[kind] += 1
            return
        self._release(e.trajectory, slot)

    # -- snapshot and housekeeping -------------------------------------------------------

    def load_snapshot(self, snapshot: ev.Snapshot) -> None:
        """Replace the table with the trainer's view (resync after an operator restart)."""
        for trajectory, slot in list(self._slots.items()):
            self._release(trajectory, slot)
        self._finished.clear()
        self._busy.clear()
        for t in snapshot.trajectories:
            if t.trajectory in self._slots:
                continue
            slot = self._alloc(t.trajectory, STATE_CODE[t.state], t.since)
            self._x[slot] = t.context_tokens
            self._task[slot] = self.tasks.code(t.task)
            self._turn[slot] = t.turn
            self._queued_once[slot] = t.state != "starting"
            self._join_group(slot, t.group)
            if t.instance is not None:
                self._instance[slot] = self.instances.code(t.instance)
            if t.mode is not None:
                self._mode[slot] = MODE_CODE[t.mode]
                if t.state == "starting":
                    self._launched[slot] = t.since
            elif t.state == "starting":
                self._dispatched[slot] = t.since
            if t.tool is not None:
                self._tool[slot] = self.tools.code(t.tool)
            if t.state == "tool":
                self._tool_load[slot] = load_bucket(self.counts[TOOL])
        if self.last_event_ts is None or snapshot.ts > self.last_event_ts:
            self.last_event_ts = snapshot.ts

    def evict_older_than(self, cutoff: float) -> int:
        """Drop trajectories that have sat in one state since before ``cutoff``."""
        n = self._hwm
        live = self._state[:n] != FREE
        old = np.flatnonzero(live & (self._since[:n] < cutoff))
        if not len(old):
            return 0
        by_slot = {slot: t for t, slot in self._slots.items()}
        for slot in old.tolist():
            self._release(by_slot[slot], slot)
        self.anomalies["evicted"] += len(old)
        return len(old)

    def state_counts(self) -> dict[str, int]:
        return {STATE_NAMES[i]: self.counts[i] for i in range(1, len(STATE_NAMES))}

    def slot_of(self, trajectory: str) -> int | None:
        return self._slots.get(trajectory)
