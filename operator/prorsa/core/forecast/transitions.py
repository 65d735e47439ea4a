"""Figure 4's transitions: what each lifecycle event of one trajectory does to its slot.

Events that do not fit the current state never raise: each is resolved by a fixed rule and
counted by kind in ``anomalies`` (:data:`ANOMALY_KINDS`), so a trainer bug shows up in
metrics instead of crashing the controller. As facts about durations and sizes become
known, the transitions tell the statistics (:class:`Observer`).

The handlers run for every event the trainer sends; the per-request ones (request,
prefill, decode, tool) inline :meth:`Transitions.move` and keep the columns they write in
attributes of their own, since there a call or a lookup costs about as much as the work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from prorsa.core.forecast.interner import Labels
from prorsa.core.forecast.prefill_sight import PrefillSight
from prorsa.core.forecast.slots import (
    DECODE,
    MODE_CODE,
    MODE_COLD,
    PREFILL,
    READY,
    REWARD,
    STARTING,
    TOOL,
    SlotStore,
)
from prorsa.core.forecast.weight_updates import WeightUpdates
from prorsa_contract import events as ev

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


def turn_bucket(turn: int) -> int:
    """Turns 0, 1, 2–3, 4–7, ...: tool behaviour shifts with depth, but slowly."""
    return min(int(turn).bit_length(), 8)


def load_bucket(n_in_tool: int) -> int:
    """Concurrent tool load in factors of four (sandboxes slow down under load)."""
    return min(int(n_in_tool).bit_length() // 2, 10)


class Transitions:
    """The per-trajectory event handlers, each ``(event, slot or None) -> None``."""

    def __init__(
        self,
        *,
        store: SlotStore,
        labels: Labels,
        observer: Observer,
        updates: WeightUpdates,
        sight: PrefillSight,
        anomalies: dict[str, int],
    ) -> None:
        self._store = store
        self._c = store.c
        self.counts = store.counts
        self._finished = store.finished
        self._labels = labels
        self.instances = labels.instances
        self._obs = observer
        self._updates = updates
        self._sight = sight
        self._blind_decodes = sight.recent
        self.anomalies = anomalies
        # Output tokens of every decode_finished applied (aborted partial outputs too):
        # what the engines generated for this trainer, since the table was made.
        self.generated_tokens = 0
        # Per prefill instance, the busy interval in progress: [in flight, start, tokens].
        self.busy: dict[int, list[float]] = {}

    def handlers(self) -> dict[str, Callable[[Any, int | None], None]]:
        """The handler of each trajectory event type."""
        return {
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

    # -- slots -----------------------------------------------------------------------------

    def _create(self, e: ev.TrajectoryEvent, state: int, *, expected: bool = False) -> int | None:
        """A slot for a trajectory first heard of now, or None if it already finished."""
        if e.trajectory in self._finished:
            self.anomalies["finished_trajectory"] += 1
            return None
        if not expected:
            self.anomalies["unknown_trajectory"] += 1
        return self._store.alloc(e.trajectory, state, e.ts)

    def _gone(self, e: ev.TrajectoryEvent) -> None:
        """An end heard for a trajectory the table does not hold: counted, remembered."""
        kind = "finished_trajectory" if e.trajectory in self._finished else "unknown_trajectory"
        self.anomalies[kind] += 1
        self._store.tombstone(e.trajectory)

    def move(self, slot: int, state: int, ts: float, allowed: frozenset[int]) -> int:
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

    # -- starting ----------------------------------------------------------------------------

    def _sample_dispatched(self, e: ev.SampleDispatched, slot: int | None) -> None:
        if slot is not None:
            self.anomalies["unexpected_transition"] += 1  # dispatched twice: keep the first
            return
        slot = self._create(e, STARTING, expected=True)
        if slot is None:
            return
        self._c.dispatched[slot] = e.ts
        self._c.task[slot] = self._labels.tasks.code(e.task)
        if e.prompt_tokens is not None:
            self._c.first_prompt[slot] = e.prompt_tokens
        self._store.join_group(slot, e.group)

    def _sandbox_started(self, e: ev.SandboxStarted, slot: int | None) -> None:
        if slot is None:
            slot = self._create(e, STARTING)
            if slot is None:
                return
        else:
            self.move(slot, STARTING, e.ts, _FROM_STARTING)
        self._c.launched[slot] = e.ts
        self._c.mode[slot] = MODE_CODE[e.mode]
        self._c.image[slot] = self._labels.images.code(e.image)
        self._c.node[slot] = self._labels.nodes.code(e.node_class)

    # -- a request: queued, prefilled, decoded ------------------------------------------------

    def _request_queued(self, e: ev.RequestQueued, slot: int | None) -> None:
        obs = self._obs
        if slot is None:
            slot = self._create(e, READY)
            if slot is None:
                return
        else:
            old = self._c.state[slot]  # self.move(slot, READY, e.ts, _TO_READY), inline
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
        self._c.queued[slot] = e.ts
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
            old = self._c.state[slot]  # self.move(slot, PREFILL, e.ts, _TO_PREFILL), inline
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
            busy = self.busy.get(m)
            if busy is None or busy[0] <= 0:
                self.busy[m] = [1.0, e.ts, 0.0]
            else:
                busy[0] += 1

    def _prefill_finished(self, e: ev.PrefillFinished, slot: int | None) -> None:
        if slot is None:
            slot = self._create(e, DECODE)
            if slot is None:
                return
        else:
            # Trainers that only see the first token skip prefill_started: ready is fine.
            old = self._c.state[slot]  # self.move(slot, DECODE, e.ts, _TO_DECODE), inline
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
        self.admit(slot, e.ts)
        m = self._c.instance[slot]
        if m < 0 and e.instance is not None:
            m = self.instances.code(e.instance)
        busy = self.busy.get(m)
        if busy is not None and busy[0] > 0:
            busy[0] -= 1
            busy[2] += tokens
            if busy[0] <= 0:
                self._obs.on_prefill_interval(tokens=busy[2], seconds=e.ts - busy[1])

    def admit(self, slot: int, ts: float) -> None:
        """The slot's prompt entered decode at ``ts``: its prefix is cached from now on."""
        tokens = self._c.x[slot]
        computed = max(tokens - self._c.cached[slot], 1.0)
        # A prefill done on the old weights during an update is flushed with them.
        self._c.cached[slot] = 0.0 if self._updates.current.pending else tokens
        self._obs.on_admission(ts, tokens, computed)

    def admit_inferred(self, moved: np.ndarray, now: float) -> None:
        """Move the ready requests at slots ``moved`` to decode: their prefill ended unseen.

        Each keeps its ``since`` (when it was queued), as do the decode durations a blind
        trainer teaches, so the forecast's decode survival and its elapsed times stay on one
        clock (:class:`PrefillSight`).
        """
        counts = self.counts
        per_token = self._sight.seconds_per_token
        for slot in moved.tolist():
            self._c.state[slot] = DECODE
            self._c.inferred[slot] = 1
            counts[READY] -= 1
            counts[DECODE] += 1
            # Admitted before this tick saw it: dated when its prefill should have ended,
            # within the time it could have (the accuracy windows score it there).
            q = self._c.since[slot]
            ts = min(q + self._c.x[slot] * per_token, math.nextafter(now, q))
            self.admit(slot, max(ts, q))

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
            at = self._c.since[slot] + x * self._sight.seconds_per_token
            self.admit(slot, min(at, e.ts))
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
        self.generated_tokens += e.output_tokens
        if e.finish == "tool":
            self._enter_tool(slot, e.ts, _AFTER_DECODE)
        elif e.finish == "abort":
            # Cancel-and-resend: prompt + partial output goes back to the ready queue. The
            # resend computes its whole prompt: an abort comes from a weight update, which
            # flushes the prefix caches, or from a switch, after which it lands elsewhere.
            self._c.cached[slot] = 0.0
            self._c.queued[slot] = e.ts
            self._updates.note_abort(e.ts)
            self.move(slot, READY, e.ts, _AFTER_DECODE)
        else:
            self.move(slot, REWARD, e.ts, _AFTER_DECODE)

    # -- tools and reward ------------------------------------------------------------------

    def _enter_tool(self, slot: int, ts: float, allowed: frozenset[int]) -> None:
        old = self._c.state[slot]  # self.move(slot, TOOL, ts, allowed), inline
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
        self._c.tool[slot] = self._labels.tools.code(e.tool)

    def _tool_finished(self, e: ev.ToolFinished, slot: int | None) -> None:
        if slot is None:
            slot = self._create(e, TOOL)
            if slot is None:
                return
        elif self._c.state[slot] == TOOL and not self._c.tool_done[slot]:
            self._obs.on_tool(self.tool_key(slot), e.ts - self._c.since[slot])
        else:
            self.move(slot, TOOL, e.ts, _FROM_TOOL)
        self._c.tool_done[slot] = 1
        if e.result_tokens is not None:
            self._c.result[slot] = e.result_tokens

    def _reward_started(self, e: ev.RewardStarted, slot: int | None) -> None:
        if slot is None:
            slot = self._create(e, REWARD)
            if slot is None:
                return
        self.move(slot, REWARD, e.ts, _TO_REWARD)

    def _reward_finished(self, e: ev.RewardFinished, slot: int | None) -> None:
        if slot is None:
            self._gone(e)
            return
        if self._c.state[slot] == REWARD and e.ts >= self._c.since[slot]:
            self._obs.on_reward(
                task=self._c.task[slot], seconds=e.ts - self._c.since[slot], accepted=e.accepted
            )
        else:
            self.anomalies["unexpected_transition"] += 1
        self._store.release(e.trajectory, slot)

    def _trajectory_dropped(self, e: ev.TrajectoryDropped, slot: int | None) -> None:
        if slot is None:
            # Heard before any other event of its trajectory (events out of order across
            # emitters or retries): the earlier ones still to come must not create it.
            self._gone(e)
            return
        self._store.release(e.trajectory, slot)
