"""The trajectory table: every live trajectory's place in the Figure 4 state machine.

Columns live in typed ``array.array`` buffers indexed by a slot per trajectory (struct of
arrays). Applying an event is a dict lookup and a few native scalar writes; a control tick
wraps the buffers as numpy arrays without copying (:attr:`TrajectoryTable.cols`) and reads
100k trajectories with a handful of vectorised masks instead of a Python loop. A live
trajectory costs ~70 bytes of columns plus its id and dict entry.

Events that do not fit the current state never raise: each is resolved by a fixed rule and
counted by kind in :attr:`TrajectoryTable.anomalies`, so a trainer bug shows up in metrics
instead of crashing the controller.

Cluster events (weight updates) touch no slot: they flush every cached prefix at once and
leave a :class:`WeightUpdate` view that the forecast reads.

Trainers that run one emitter per worker name it (``X-Prorsa-Emitter``): each trajectory
belongs to the emitter that reported it last, and a snapshot from a named emitter replaces
that emitter's trajectories alone (:meth:`TrajectoryTable.emitting`).
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import Field, dataclass, field, fields
from typing import Any, Protocol

import numpy as np

from prorsa.core.dedupe import DedupeWindow
from prorsa_contract import events as ev

# State codes. FREE marks an unused slot.
FREE, STARTING, READY, PREFILL, DECODE, TOOL, REWARD = range(7)
STATE_NAMES = ("free", "starting", "ready", "prefill", "decode", "tool", "reward")
STATE_CODE = {name: code for code, name in enumerate(STATE_NAMES)}

MODE_UNKNOWN, MODE_PREWARM, MODE_COLD = 0, 1, 2
MODE_CODE = {"prewarm": MODE_PREWARM, "cold": MODE_COLD}

ANOMALY_KINDS = (
    "duplicate",  # an event id seen before (idempotent replay)
    "stale",  # older than the trajectory's current state: applied state is newer
    "unknown_trajectory",  # first heard of mid-life: created in the event's state
    "finished_trajectory",  # the trajectory already left the table
    "unexpected_transition",  # valid state change not allowed from the current state: applied
    "evicted",  # silent for longer than the TTL: removed at a tick
)


# Figure 4: the states each event may arrive in. Anything else is applied but counted.
_FROM_STARTING = frozenset({STARTING})
_TO_READY = frozenset({STARTING, TOOL, READY, DECODE})
_TO_PREFILL = frozenset({READY, PREFILL})
_TO_DECODE = frozenset({PREFILL, READY})
# READY too: a trainer that neither streams nor sees the prefill engine (behind smg, a
# blocking generate call) goes from request_queued straight to decode_finished.
_AFTER_DECODE = frozenset({DECODE, PREFILL, READY})
_TO_TOOL = frozenset({TOOL, DECODE})
_FROM_TOOL = frozenset({TOOL})
_TO_REWARD = frozenset({REWARD, DECODE, TOOL})
_REMOVALS = frozenset({"reward_finished", "trajectory_dropped"})
_CLUSTER = (ev.WeightUpdateStarted, ev.WeightUpdateFinished)
# States whose trajectory holds a context that comes back to prefill (paper §3.1: after a
# weight update every carried-over trajectory re-prefills its whole context).
_HOLDS_CONTEXT = (READY, PREFILL, DECODE, TOOL)


class Observer(Protocol):
    """What the table tells the statistics as lifecycle facts become known."""

    def on_startup(self, *, key: tuple[object, ...], seconds: float) -> None: ...
    def on_dispatch_delay(self, *, seconds: float) -> None: ...
    def on_first_prompt(self, *, task: int, tokens: float) -> None: ...
    # The hot ones (every request, every tool) take positional arguments.
    def on_growth(self, key: tuple[object, ...], tokens: float, result_known: bool) -> None: ...
    def on_tool(self, key: tuple[object, ...], seconds: float) -> None: ...
    def on_reward(self, *, task: int, seconds: float, accepted: bool) -> None: ...
    def on_decode(
        self, task: int, turn: int, seconds: float, output: float, tool: bool
    ) -> None: ...
    def on_arrival(self, ts: float, tokens: float) -> None: ...
    def on_admission(self, ts: float, tokens: float, computed: float) -> None: ...
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


@dataclass(frozen=True, slots=True)
class ApplyResult:
    applied: int
    duplicates: int
    anomalies: int


# Aborts that read as a weight update (see TrajectoryTable._note_abort): at least this many,
# and this share of the trajectories decoding, within this window; one per refractory period.
FLUSH_MIN_ABORTS = 8
FLUSH_SHARE = 0.5
FLUSH_WINDOW_SECONDS = 5.0
FLUSH_REFRACTORY_SECONDS = 30.0
# A weight update announced but not finished after this long (or four times its expected
# duration, if longer) is taken as abandoned: the forecast stops waiting for it.
UPDATE_GIVE_UP_SECONDS = 600.0


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


# How many of the latest decodes tell whether the trainer reports prefills at all.
BLIND_DECODES = 64
# Distinct emitter ids one table tells apart (workers of one trainer; ids must be stable).
MAX_EMITTERS = 4096


class TooManyEmitters(ValueError):
    """A new emitter id past :data:`MAX_EMITTERS`: its trajectories could not be told apart."""


class TrajectoryTable:
    """Applies lifecycle events (Figure 4 / DESIGN.md) to per-trajectory state."""

    def __init__(
        self,
        *,
        observer: Observer,
        dedupe_window: int = 65_536,
        finished_window: int = 131_072,
        initial_capacity: int = 1024,
    ) -> None:
        self._obs = observer
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._hwm = 0  # slots [0, hwm) have been used at least once
        self._capacity = 0
        self._c = Columns()
        self._grow(initial_capacity)
        # Replayed event ids (0: the caller dedupes, e.g. the webhook's own window).
        self._dedupe = DedupeWindow(capacity=dedupe_window) if dedupe_window > 0 else None
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
        # Emitter ids; code 0 ("") is a trainer that names none. ``_emitter`` is the one
        # whose events apply now (None: unnamed), ``_scoped`` whether any was ever named.
        self.emitters = Interner(cap=MAX_EMITTERS + 1)
        self._emitter: int | None = None
        self._scoped = False
        self.groups: dict[str, int] = {}
        self._group_names: list[str | None] = []
        self._group_live: list[int] = []
        self._group_free: list[int] = []
        # Per prefill instance, the busy interval in progress: [in flight, start, tokens].
        self._busy: dict[int, list[float]] = {}
        # Recent abort times, and the cache flushes they were read as (weight updates).
        self._aborts: deque[float] = deque()
        self.cache_flushes = 0
        self._last_flush = -math.inf
        # Weight updates the trainer announced; once it does, aborts are only aborts.
        self._weight_update = WeightUpdate()
        self._announced_updates = False
        # Whether the trainer reports when prefills end (see ``prefill_blind``): the latest
        # decodes, True for one whose prefill no event reported.
        self._blind_decodes: deque[bool] = deque(maxlen=BLIND_DECODES)
        self.inferred_admissions = 0
        # Seconds per prompt token of the last infer_admitted: dates an admission no event
        # and no tick saw (a request queued and finished between two ticks).
        self._seconds_per_token = 0.0
        self._handlers: dict[str, Callable[[Any, int | None], None]] = {
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
            "weight_update_started": self._weight_update_started,
            "weight_update_finished": self._weight_update_finished,
        }

    # -- storage -------------------------------------------------------------------------

    def _grow(self, capacity: int) -> None:
        # In place, so references to the buffers stay valid. No numpy view may be alive here.
        self._c.grow(capacity)
        self._capacity = capacity

    @property
    def cols(self) -> dict[str, np.ndarray]:
        """Zero-copy numpy views of the columns, valid until the next applied event.

        Readers (the tick) must drop them before more events are applied: a live view pins
        the buffers, and growing the table would then fail.
        """
        return self._c.views()

    def _alloc(self, trajectory: str, state: int, ts: float) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            if self._hwm == self._capacity:
                self._grow(self._capacity * 2)
            slot = self._hwm
            self._hwm += 1
        self._c.reset(slot)
        self._c.state[slot] = state
        self._c.since[slot] = ts
        self.counts[state] += 1
        self._slots[trajectory] = slot
        return slot

    def _release(self, trajectory: str, slot: int, *, ended: bool = True) -> None:
        self.counts[int(self._c.state[slot])] -= 1
        self._c.state[slot] = FREE
        g = int(self._c.group[slot])
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
        if ended:
            self._tombstone(trajectory)

    def _tombstone(self, trajectory: str) -> None:
        """Remember that ``trajectory`` ended (the newest ``finished_window`` of them), so
        its late or out-of-order events cannot bring it back."""
        finished = self._finished
        finished[trajectory] = None
        finished.move_to_end(trajectory)
        if len(finished) > self._finished_window:
            finished.popitem(last=False)

    def _join_group(self, slot: int, name: str | None) -> None:
        if name is None or self._c.group[slot] >= 0:
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
        self._c.group[slot] = g
        self._group_live[g] += 1

    def set_dedupe_window(self, size: int) -> None:
        """Resize the replay window; 0 turns it off for callers that dedupe before us."""
        self._dedupe = DedupeWindow(capacity=size) if size > 0 else None

    @property
    def hwm(self) -> int:
        return self._hwm

    def __len__(self) -> int:
        return len(self._slots)

    def group_live_counts(self) -> np.ndarray:
        return np.asarray(self._group_live, dtype=np.int64)

    def context_of(self, trajectory: str) -> float | None:
        """The context a live trajectory holds (tokens), None for an unknown one."""
        slot = self._slots.get(trajectory)
        return None if slot is None else float(self._c.x[slot])

    def live_contexts_by_instance(self) -> dict[str, float]:
        """Context tokens of live trajectories by the instance their last prefill ran on.

        Those contexts come back as the prefixes of their next prompts, and cache-aware
        routing sends them to the same instance: this is what each prefix cache is worth.
        One pass over the table for every instance (the tick prices several).
        """
        n = self._hwm
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

    # -- applying events -----------------------------------------------------------------

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
        since = self._c.since
        latest = -math.inf
        try:
            for event in events:
                applied += 1
                ts = event.ts
                if ts > latest:
                    latest = ts
                if isinstance(event, _CLUSTER):
                    handlers[event.type](event, None)
                    continue
                slot = slots.get(event.trajectory)
                if slot is not None and ts < since[slot] and event.type not in _REMOVALS:
                    stale += 1  # the table already holds newer news of this trajectory
                    continue
                handlers[event.type](event, slot)
        except BaseException:
            if window is not None:
                # As if each id had been admitted just before its event: the ones after
                # the failure were never seen, so a retry applies them.
                window.forget(e.id for e in events[applied:])  # type: ignore[index]
            raise
        if self._scoped:
            self._own(events, self._emitter or 0)
        self.anomalies["duplicate"] += duplicates
        self.anomalies["stale"] += stale
        if applied and (self.last_event_ts is None or latest > self.last_event_ts):
            self.last_event_ts = latest
        self.events_applied += applied
        anomalies = sum(self.anomalies.values()) - before - duplicates
        return ApplyResult(applied=applied, duplicates=duplicates, anomalies=anomalies)

    # -- emitters -----------------------------------------------------------------------

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
            self._scoped = True
        previous, self._emitter = self._emitter, code
        try:
            yield
        finally:
            self._emitter = previous

    def _own(self, events: Iterable[ev.Event], code: int) -> None:
        """Each live trajectory of ``events`` now belongs to emitter ``code``."""
        slots = self._slots
        owner = self._c.emitter
        for event in events:
            if not isinstance(event, _CLUSTER):
                slot = slots.get(event.trajectory)
                if slot is not None:
                    owner[slot] = code

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
        slots = self._slots
        room = limit - len(slots)
        if len(events) <= room:
            return events, []
        finished = self._finished
        fits: list[ev.Event] = []
        left: list[ev.Event] = []
        started: set[str] = set()
        refused: set[str] = set()
        for event in events:
            if isinstance(event, _CLUSTER):
                fits.append(event)
                continue
            t = event.trajectory
            if t in refused:
                left.append(event)
            elif t in slots or t in started or event.type in _REMOVALS or t in finished:
                fits.append(event)
            elif room > 0:
                room -= 1
                started.add(t)
                fits.append(event)
            else:
                refused.add(t)
                left.append(event)
        return fits, left

    def live_of(self, emitter: str | None) -> int:
        """Live trajectories a snapshot from ``emitter`` replaces (None: all of them)."""
        if emitter is None:
            return len(self._slots)
        code = self.emitters.get(emitter)
        if code is None:
            return 0
        n = self._hwm
        cols = self.cols
        return int(np.count_nonzero((cols["state"][:n] != FREE) & (cols["emitter"][:n] == code)))

    def emitter_counts(self) -> dict[str, int]:
        """Live trajectories by the emitter that reported them last ("": none named).

        Reads the columns: call it where no batch can apply meanwhile (the handle's lock).
        """
        n = self._hwm
        cols = self.cols
        codes = cols["emitter"][:n][cols["state"][:n] != FREE]
        counts = np.bincount(codes, minlength=1)
        return {self.emitters.names[c]: int(counts[c]) for c in np.flatnonzero(counts)}

    def _note_abort(self, ts: float) -> None:
        """Forget every cached prefix when aborts look like a weight update.

        A weight update aborts every generation in flight at once and flushes every prefix
        cache (SGLang flushes its radix cache with new weights), also under trajectories
        that were running tools. A trainer that does not send the weight-update events
        leaves it to this guess: half of the decoding trajectories aborted within a few
        seconds is taken as one. One that sends them has flushed already.
        """
        if self._announced_updates:
            return
        aborts = self._aborts
        aborts.append(ts)
        while aborts and aborts[0] < ts - FLUSH_WINDOW_SECONDS:
            aborts.popleft()
        if ts - self._last_flush < FLUSH_REFRACTORY_SECONDS:
            return  # the rest of the same update's aborts
        if len(aborts) >= max(FLUSH_MIN_ABORTS, FLUSH_SHARE * (self.counts[DECODE] + len(aborts))):
            aborts.clear()
            self._flush_caches(ts)

    def _flush_caches(self, ts: float) -> None:
        """Every cached prefix is gone (new weights): each next prefill computes it all."""
        n = self._hwm
        self._c.cached[:n] = array("d", bytes(8 * n))
        self._last_flush = ts
        self.cache_flushes += 1

    def _create(self, e: ev.TrajectoryEvent, state: int, *, expected: bool = False) -> int | None:
        """A slot for a trajectory first heard of now, or None if it already finished."""
        if e.trajectory in self._finished:
            self.anomalies["finished_trajectory"] += 1
            return None
        if not expected:
            self.anomalies["unknown_trajectory"] += 1
        return self._alloc(e.trajectory, state, e.ts)

    def _move(self, slot: int, state: int, ts: float, allowed: frozenset[int]) -> int:
        """Enter ``state`` at ``ts``; count the move if the state machine does not allow it.

        The per-request handlers (request, prefill, tool) inline these lines: they run for
        most events, and there the call costs about as much as its body.
        """
        old = self._c.state[slot]
        if old not in allowed:
            self.anomalies["unexpected_transition"] += 1
        if old != state:
            counts = self.counts
            counts[old] -= 1
            counts[state] += 1
            self._c.state[slot] = state
        self._c.since[slot] = ts
        return old

    def _sample_dispatched(self, e: ev.SampleDispatched, slot: int | None) -> None:
        if slot is not None:
            self.anomalies["unexpected_transition"] += 1  # dispatched twice: keep the first
            return
        slot = self._create(e, STARTING, expected=True)
        if slot is None:
            return
        self._c.dispatched[slot] = e.ts
        self._c.task[slot] = self.tasks.code(e.task)
        if e.prompt_tokens is not None:
            self._c.first_prompt[slot] = e.prompt_tokens
        self._join_group(slot, e.group)

    def _sandbox_started(self, e: ev.SandboxStarted, slot: int | None) -> None:
        if slot is None:
            slot = self._create(e, STARTING)
            if slot is None:
                return
        else:
            self._move(slot, STARTING, e.ts, _FROM_STARTING)
        self._c.launched[slot] = e.ts
        self._c.mode[slot] = MODE_CODE[e.mode]
        self._c.image[slot] = self.images.code(e.image)
        self._c.node[slot] = self.nodes.code(e.node_class)

    def startup_key(self, slot: int) -> tuple[object, ...]:
        """Conditioning class of Eq. 6: (mode, image, node class)."""
        return (self._c.mode[slot], self._c.image[slot], self._c.node[slot])

    def tool_key(self, slot: int) -> tuple[object, ...]:
        """Conditioning class of Eq. 9: (task, tool, turn, concurrent tool load)."""
        return (
            self._c.task[slot],
            self._c.tool[slot],
            min(self._c.turn[slot].bit_length(), 8),  # turn_bucket, inline
            self._c.tool_load[slot],
        )

    def _request_queued(self, e: ev.RequestQueued, slot: int | None) -> None:
        obs = self._obs
        if slot is None:
            slot = self._create(e, READY)
            if slot is None:
                return
        else:
            old = self._c.state[slot]  # self._move(slot, READY, e.ts, _TO_READY), inline
            if old not in _TO_READY:
                self.anomalies["unexpected_transition"] += 1
            if old != READY:
                counts = self.counts
                counts[old] -= 1
                counts[READY] += 1
                self._c.state[slot] = READY
            self._c.since[slot] = e.ts
            if old == TOOL:
                result = self._c.result[slot]
                known = result >= 0
                obs.on_growth(
                    (self._c.task[slot], self._c.tool[slot]),
                    e.prompt_tokens - self._c.x[slot] - (result if known else 0.0),
                    known,
                )
            elif old == STARTING and not self._c.queued_once[slot]:
                launched, dispatched = self._c.launched[slot], self._c.dispatched[slot]
                if launched == launched:  # not NaN: the sandbox launch time is known
                    obs.on_startup(key=self.startup_key(slot), seconds=e.ts - launched)
                elif dispatched == dispatched:
                    obs.on_startup(key=("dispatch",), seconds=e.ts - dispatched)
                if dispatched == dispatched and self._c.mode[slot] != MODE_COLD:
                    obs.on_dispatch_delay(seconds=e.ts - dispatched)
        if not self._c.queued_once[slot]:
            obs.on_first_prompt(task=self._c.task[slot], tokens=float(e.prompt_tokens))
            self._c.queued_once[slot] = 1
        self._c.x[slot] = e.prompt_tokens
        self._c.turn[slot] = e.turn
        self._c.instance[slot] = -1
        self._c.inferred[slot] = 0
        obs.on_arrival(e.ts, e.prompt_tokens)

    def _prefill_started(self, e: ev.PrefillStarted, slot: int | None) -> None:
        if slot is None:
            slot = self._create(e, PREFILL)
            if slot is None:
                return
        else:
            old = self._c.state[slot]  # self._move(slot, PREFILL, e.ts, _TO_PREFILL), inline
            if old not in _TO_PREFILL:
                self.anomalies["unexpected_transition"] += 1
            if old != PREFILL:
                counts = self.counts
                counts[old] -= 1
                counts[PREFILL] += 1
                self._c.state[slot] = PREFILL
            self._c.since[slot] = e.ts
        if e.instance is not None:
            m = self.instances.code(e.instance)
            self._c.instance[slot] = m
            busy = self._busy.get(m)
            if busy is None or busy[0] <= 0:
                self._busy[m] = [1.0, e.ts, 0.0]
            else:
                busy[0] += 1

    def _prefill_finished(self, e: ev.PrefillFinished, slot: int | None) -> None:
        if slot is None:
            slot = self._create(e, DECODE)
            if slot is None:
                return
        else:
            # Trainers that only see the first token skip prefill_started: ready is fine.
            old = self._c.state[slot]  # self._move(slot, DECODE, e.ts, _TO_DECODE), inline
            if old not in _TO_DECODE:
                self.anomalies["unexpected_transition"] += 1
            if old != DECODE:
                counts = self.counts
                counts[old] -= 1
                counts[DECODE] += 1
                self._c.state[slot] = DECODE
            self._c.since[slot] = e.ts
        tokens = self._c.x[slot]
        self._c.inferred[slot] = 0
        self._admit(slot, e.ts)
        m = self._c.instance[slot]
        if m < 0 and e.instance is not None:
            m = self.instances.code(e.instance)
        busy = self._busy.get(m)
        if busy is not None and busy[0] > 0:
            busy[0] -= 1
            busy[2] += tokens
            if busy[0] <= 0:
                self._obs.on_prefill_interval(tokens=busy[2], seconds=e.ts - busy[1])

    def _admit(self, slot: int, ts: float) -> None:
        """The slot's prompt entered decode at ``ts``: its prefix is cached from now on."""
        tokens = self._c.x[slot]
        computed = max(tokens - self._c.cached[slot], 1.0)
        # A prefill done on the old weights during an update is flushed with them.
        self._c.cached[slot] = 0.0 if self._weight_update.pending else tokens
        self._obs.on_admission(ts, tokens, computed)

    def _decode_finished(self, e: ev.DecodeFinished, slot: int | None) -> None:
        if slot is None:
            slot = self._create(e, DECODE)
            if slot is None:
                return
        state = self._c.state[slot]
        # No event said this request's prefill ended: a trainer that does not stream.
        self._blind_decodes.append(state == READY or bool(self._c.inferred[slot]))
        if state == READY and e.finish != "abort":
            # Queued and done between two ticks: admitted some time in between.
            x = self._c.x[slot]
            self._admit(slot, min(self._c.since[slot] + x * self._seconds_per_token, e.ts))
            state = DECODE
        if state == DECODE and e.finish != "abort":
            # From request_queued when the prefill's end is unseen, like the elapsed time
            # of the decodes infer_admitted moves: the same clock for both.
            self._obs.on_decode(
                self._c.task[slot],
                min(self._c.turn[slot].bit_length(), 8),  # turn_bucket, inline
                e.ts - self._c.since[slot],
                e.output_tokens,
                e.finish == "tool",
            )
        self._c.x[slot] += e.output_tokens
        if e.finish == "tool":
            self._enter_tool(slot, e.ts, _AFTER_DECODE)
        elif e.finish == "abort":
            # Cancel-and-resend: prompt + partial output goes back to the ready queue. The
            # resend computes its whole prompt: an abort comes from a weight update, which
            # flushes the prefix caches, or from a switch, after which it lands elsewhere.
            self._c.cached[slot] = 0.0
            self._note_abort(e.ts)
            self._move(slot, READY, e.ts, _AFTER_DECODE)
        else:
            self._move(slot, REWARD, e.ts, _AFTER_DECODE)

    def _enter_tool(self, slot: int, ts: float, allowed: frozenset[int]) -> None:
        old = self._c.state[slot]  # self._move(slot, TOOL, ts, allowed), inline
        if old not in allowed:
            self.anomalies["unexpected_transition"] += 1
        counts = self.counts
        if old != TOOL:
            counts[old] -= 1
            counts[TOOL] += 1
            self._c.state[slot] = TOOL
        self._c.since[slot] = ts
        self._c.tool_done[slot] = 0
        self._c.result[slot] = -1.0
        self._c.tool_load[slot] = min(counts[TOOL].bit_length() // 2, 10)  # load_bucket

    def _tool_started(self, e: ev.ToolStarted, slot: int | None) -> None:
        if slot is None:
            slot = self._create(e, TOOL)
            if slot is None:
                return
        self._enter_tool(slot, e.ts, _TO_TOOL)
        self._c.tool[slot] = self.tools.code(e.tool)

    def _tool_finished(self, e: ev.ToolFinished, slot: int | None) -> None:
        if slot is None:
            slot = self._create(e, TOOL)
            if slot is None:
                return
        elif self._c.state[slot] == TOOL and not self._c.tool_done[slot]:
            self._obs.on_tool(self.tool_key(slot), e.ts - self._c.since[slot])
        else:
            self._move(slot, TOOL, e.ts, _FROM_TOOL)
        self._c.tool_done[slot] = 1
        if e.result_tokens is not None:
            self._c.result[slot] = e.result_tokens

    def _reward_started(self, e: ev.RewardStarted, slot: int | None) -> None:
        if slot is None:
            slot = self._create(e, REWARD)
            if slot is None:
                return
        self._move(slot, REWARD, e.ts, _TO_REWARD)

    def _reward_finished(self, e: ev.RewardFinished, slot: int | None) -> None:
        if slot is None:
            self._gone(e)
            self._tombstone(e.trajectory)
            return
        if self._c.state[slot] == REWARD and e.ts >= self._c.since[slot]:
            self._obs.on_reward(
                task=self._c.task[slot], seconds=e.ts - self._c.since[slot], accepted=e.accepted
            )
        else:
            self.anomalies["unexpected_transition"] += 1
        self._release(e.trajectory, slot)

    def _trajectory_dropped(self, e: ev.TrajectoryDropped, slot: int | None) -> None:
        if slot is None:
            # Heard before any other event of its trajectory (events out of order across
            # emitters or retries): the earlier ones still to come must not create it.
            self._gone(e)
            self._tombstone(e.trajectory)
            return
        self._release(e.trajectory, slot)

    # -- prefills that no event reports -------------------------------------------------

    @property
    def prefill_blind(self) -> bool:
        """Whether the trainer leaves out when prefills end (it neither streams nor sees
        the prefill engine): most of its latest decodes finished with no prefill event
        before them. Its requests then stay ``ready`` from request_queued to
        decode_finished, through prefill and decode alike. Until a first decode finishes
        nothing tells, and a ready request is taken as waiting for prefill, as before."""
        recent = self._blind_decodes
        return len(recent) > 0 and 2 * sum(recent) > len(recent)

    def infer_admitted(
        self, now: float, *, in_prefill: int | None, seconds_per_token: float
    ) -> int:
        """Move the ready requests of a blind trainer that have left prefill to ``decode``.

        ``in_prefill``: the requests the prefill engines hold, running or waiting (their
        ``/v1/state``). Prefill engines serve in arrival order, so those are the most
        recently queued; every older ready request is decoding. Without engine states, a
        request is taken as decoding once it has waited as long as its prompt takes at
        ``seconds_per_token``. A moved request keeps its ``since`` (when it was queued),
        as do the decode durations a blind trainer teaches, so the forecast's decode
        survival and its elapsed times stay on one clock. Returns how many moved.
        """
        self._seconds_per_token = max(seconds_per_token, 0.0)
        if not self.prefill_blind or self.counts[READY] == 0:
            return 0
        n = self._hwm
        cols = self.cols
        ready = np.flatnonzero(cols["state"][:n] == READY)
        since = cols["since"][:n][ready]
        x = cols["x"][:n][ready]
        del cols
        if in_prefill is not None:
            order = np.argsort(since, kind="stable")
            moved = ready[order[: max(len(ready) - max(in_prefill, 0), 0)]]
        else:
            moved = ready[now - since >= x * self._seconds_per_token]
        counts = self.counts
        for slot in moved.tolist():
            self._c.state[slot] = DECODE
            self._c.inferred[slot] = 1
            counts[READY] -= 1
            counts[DECODE] += 1
            # Admitted before this tick saw it: dated when its prefill should have ended,
            # within the time it could have (the accuracy windows score it there).
            q = self._c.since[slot]
            ts = min(q + self._c.x[slot] * self._seconds_per_token, math.nextafter(now, q))
            self._admit(slot, max(ts, q))
        self.inferred_admissions += len(moved)
        return len(moved)

    # -- weight updates (cluster events) -------------------------------------------------

    @property
    def weight_update(self) -> WeightUpdate:
        """The last weight update the trainer announced, as of the events applied."""
        return self._weight_update

    def _update_is_stale(self, version: int) -> bool:
        """An older version, or this one over already: a late or re-sent (new id) event."""
        wu = self._weight_update
        if wu.version is None:
            return False
        return version < wu.version or (version == wu.version and not wu.pending)

    def _weight_update_started(self, e: ev.WeightUpdateStarted, _slot: int | None) -> None:
        wu = self._weight_update
        if self._update_is_stale(e.version):
            self.anomalies["stale"] += 1
            return
        self._announced_updates = True
        if wu.pending and wu.version == e.version:
            return  # the same update announced twice (a restart of the trainer's sync)
        self._flush_caches(e.ts)
        self._weight_update = WeightUpdate(
            pending=True,
            version=e.version,
            started_at=e.ts,
            expected_seconds=e.expected_seconds,
            last_seconds=wu.last_seconds,
        )

    def _weight_update_finished(self, e: ev.WeightUpdateFinished, _slot: int | None) -> None:
        wu = self._weight_update
        if self._update_is_stale(e.version):
            self.anomalies["stale"] += 1
            return
        self._announced_updates = True
        started = wu.started_at if wu.pending and wu.version == e.version else None
        if started is None:
            self._flush_caches(e.ts)  # its start was never heard: the weights changed anyway
        self._weight_update = WeightUpdate(
            pending=False,
            version=e.version,
            started_at=started,
            finished_at=e.ts,
            expected_seconds=wu.expected_seconds if started is not None else None,
            reprefill_trajectories=e.reprefill_trajectories,
            last_seconds=max(e.ts - started, 0.0) if started is not None else wu.last_seconds,
        )

    def reprefill_tokens(self) -> float:
        """Tokens of the live contexts that will re-prefill after a weight update.

        A trajectory that is ready, in prefill, decoding (to be interrupted and resent) or
        running a tool holds a context that comes back to prefill, and with every prefix
        cache flushed it computes all of it (paper §3.1).
        """
        n = self._hwm
        cols = self.cols
        holds = np.isin(cols["state"][:n], _HOLDS_CONTEXT)
        return float(cols["x"][:n][holds].sum())

    def _gone(self, e: ev.TrajectoryEvent) -> None:
        kind = "finished_trajectory" if e.trajectory in self._finished else "unknown_trajectory"
        self.anomalies[kind] += 1

    # -- snapshot and housekeeping -------------------------------------------------------

    def load_snapshot(self, snapshot: ev.Snapshot) -> None:
        """Replace the table with the trainer's view (resync after an operator restart).

        Under :meth:`emitting` a named emitter, only that emitter's trajectories are
        replaced: the others, the ended ones remembered and the prefill busy intervals in
        progress stay, and a snapshot without a weight update leaves the one known alone
        (another emitter may have announced it).
        """
        code = self._emitter
        if code is None:
            for trajectory, slot in list(self._slots.items()):
                self._release(trajectory, slot)
            self._finished.clear()
            self._busy.clear()
        else:
            self._release_emitter(code)
            for t in snapshot.trajectories:
                self._finished.pop(t.trajectory, None)
        for t in snapshot.trajectories:
            held = self._slots.get(t.trajectory)
            if held is not None:
                if code is None or self._c.emitter[held] == code:
                    continue  # listed twice: the first row stands
                # Another emitter reported it last: the snapshot's word is the newer.
                self._release(t.trajectory, held, ended=False)
            slot = self._alloc(t.trajectory, STATE_CODE[t.state], t.since)
            self._c.emitter[slot] = code or 0
            self._c.x[slot] = t.context_tokens
            self._c.task[slot] = self.tasks.code(t.task)
            self._c.turn[slot] = t.turn
            self._c.queued_once[slot] = t.state != "starting"
            self._join_group(slot, t.group)
            if t.instance is not None:
                self._c.instance[slot] = self.instances.code(t.instance)
            if t.mode is not None:
                self._c.mode[slot] = MODE_CODE[t.mode]
                if t.state == "starting":
                    self._c.launched[slot] = t.since
            elif t.state == "starting":
                self._c.dispatched[slot] = t.since
            if t.tool is not None:
                self._c.tool[slot] = self.tools.code(t.tool)
            if t.state == "tool":
                self._c.tool_load[slot] = load_bucket(self.counts[TOOL])
        if code is None or snapshot.weight_update is not None:
            self._load_weight_update(snapshot.weight_update)
        if self.last_event_ts is None or snapshot.ts > self.last_event_ts:
            self.last_event_ts = snapshot.ts

    def _release_emitter(self, code: int) -> None:
        """Drop the live trajectories emitter ``code`` reported last (they are not ended:
        nothing is remembered of them)."""
        n = self._hwm
        cols = self.cols
        mine = np.flatnonzero((cols["state"][:n] != FREE) & (cols["emitter"][:n] == code))
        del cols
        if not len(mine):
            return
        wanted = set(mine.tolist())
        for trajectory, slot in [(t, s) for t, s in self._slots.items() if s in wanted]:
            self._release(trajectory, slot, ended=False)

    def _load_weight_update(self, update: ev.SnapshotWeightUpdate | None) -> None:
        """The trainer's word on an update under way replaces ours; none means none."""
        wu = self._weight_update
        if update is None:
            if wu.pending:
                self._weight_update = WeightUpdate(
                    version=wu.version, started_at=wu.started_at, last_seconds=wu.last_seconds
                )
            return
        self._announced_updates = True
        self._weight_update = WeightUpdate(
            pending=True,
            version=update.version,
            started_at=update.started_at,
            expected_seconds=update.expected_seconds,
            last_seconds=wu.last_seconds,
        )

    def evict_older_than(self, cutoff: float) -> int:
        """Drop trajectories that have sat in one state since before ``cutoff``."""
        n = self._hwm
        cols = self.cols
        live = cols["state"][:n] != FREE
        old = np.flatnonzero(live & (cols["since"][:n] < cutoff)).tolist()
        del cols, live
        if not old:
            return 0
        by_slot = {slot: t for t, slot in self._slots.items()}
        for slot in old:
            self._release(by_slot[slot], slot)
        self.anomalies["evicted"] += len(old)
        return len(old)

    def state_counts(self) -> dict[str, int]:
        return {STATE_NAMES[i]: self.counts[i] for i in range(1, len(STATE_NAMES))}

    def slot_of(self, trajectory: str) -> int | None:
        return self._slots.get(trajectory)
