"""Follows the events a trainer emits and builds the resync snapshot from them.

A trainer that emits every event of its trajectories through one emitter already tells
the emitter everything a snapshot needs: each live trajectory's state, when it entered
it, its context length, group, task and turn. ``EventEmitter(track=True)`` feeds this
tracker and answers a server's resync with :meth:`TrajectoryTracker.snapshot`, no user
code needed.

Do not use it when several emitters (processes, Ray actors) share one RolloutCluster: a
snapshot replaces *all* of the server's trajectories, so each emitter's partial view would
erase the others'. Build the snapshot from the trainer's global state instead.

States follow the webhook CONTRACT table (and the Controller's reading of it): an aborted
decode goes back to ``ready`` (cancel-and-resend); ``tool_finished`` keeps ``tool`` until
the next ``request_queued``; context in ``tool``/``reward`` is prompt plus output. A weight
update started and not yet finished goes into the snapshot too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prorsa_contract.events import EVENT_TYPES, Snapshot, SnapshotTrajectory, SnapshotWeightUpdate

log = logging.getLogger("prorsa_sdk")

_TERMINAL = frozenset({"reward_finished", "trajectory_dropped"})
_KNOWN = frozenset(EVENT_TYPES)
_UPDATES = frozenset({"weight_update_started", "weight_update_finished"})


class _Live:
    __slots__ = ("context", "group", "instance", "mode", "since", "state", "task", "tool", "turn")

    def __init__(self, state: str, since: float) -> None:
        self.state = state
        self.since = since
        self.context = 0
        self.group: str | None = None
        self.task: str | None = None
        self.turn = 0
        self.instance: str | None = None
        self.mode: str | None = None
        self.tool: str | None = None


class TrajectoryTracker:
    """Live trajectories by id, from wire-form event dicts; bounded to ``max_trajectories``."""

    def __init__(self, *, max_trajectories: int = 1_000_000) -> None:
        self._live: dict[str, _Live] = {}
        self._max = max_trajectories
        self.evicted = 0
        self._update: SnapshotWeightUpdate | None = None  # started, not finished

    def __len__(self) -> int:
        return len(self._live)

    def apply(self, event: Mapping[str, Any]) -> None:
        """Advance one trajectory by one event (dict with the wire field names).

        Malformed events (the server will refuse them with 422) are ignored here.
        """
        kind = event.get("type")
        key = event.get("trajectory")
        ts = event.get("ts")
        if kind in _UPDATES:
            self._weight_update(kind, event)
            return
        if kind not in _KNOWN or not isinstance(key, str) or not isinstance(ts, int | float):
            return
        ts = float(ts)
        if kind in _TERMINAL:
            self._live.pop(key, None)
            return
        t = self._live.get(key)
        if t is None:
            if len(self._live) >= self._max:
                # Dicts keep insertion order: the oldest trajectory goes, loudly counted.
                self._live.pop(next(iter(self._live)))
                self.evicted += 1
                if self.evicted == 1 or self.evicted % 10_000 == 0:
                    log.warning(
                        "trajectory tracker is full (%d); %d evicted so far: are "
                        "reward_finished / trajectory_dropped events emitted?",
                        self._max,
                        self.evicted,
                    )
            t = self._live[key] = _Live("starting", ts)
        if kind == "sample_dispatched":
            t.state, t.since = "starting", ts
            t.group = event.get("group", t.group)
            t.task = event.get("task", t.task)
            t.context = event.get("prompt_tokens") or t.context
        elif kind == "sandbox_started":
            t.state, t.since = "starting", ts
            t.mode = event.get("mode", t.mode)
        elif kind == "request_queued":
            t.state, t.since = "ready", ts
            t.context = event.get("prompt_tokens", t.context)
            t.turn = event.get("turn", t.turn)
            t.instance = None
        elif kind == "prefill_started":
            t.state, t.since = "prefill", ts
            t.instance = event.get("instance", t.instance)
        elif kind == "prefill_finished":
            t.state, t.since = "decode", ts
        elif kind == "decode_finished":
            t.context += event.get("output_tokens") or 0
            finish = event.get("finish")
            t.state = "tool" if finish == "tool" else "ready" if finish == "abort" else "reward"
            t.since = ts
        elif kind == "tool_started":
            t.state, t.since = "tool", ts
            t.tool = event.get("tool", t.tool)
        elif kind == "tool_finished":
            if t.state != "tool":
                t.state, t.since = "tool", ts
        elif kind == "reward_started":
            t.state, t.since = "reward", ts

    def _weight_update(self, kind: str, event: Mapping[str, Any]) -> None:
        version, ts = event.get("version"), event.get("ts")
        if not isinstance(version, int) or not isinstance(ts, int | float):
            return
        pending = self._update
        if kind == "weight_update_started":
            if pending is not None and version <= pending.version:
                return  # the same update reported again (several reporters): keep the first
            expected = event.get("expected_seconds")
            try:
                self._update = SnapshotWeightUpdate(
                    version=version, started_at=ts, expected_seconds=expected
                )
            except ValueError:  # the server will refuse the event with 422
                return
        elif pending is not None and version >= pending.version:
            self._update = None

    def snapshot(self, *, ts: float) -> Snapshot:
        """Every live trajectory as of ``ts`` (trainer clock)."""
        rows = [
            SnapshotTrajectory(
                trajectory=key,
                state=t.state,  # type: ignore[arg-type]
                since=t.since,
                context_tokens=t.context,
                group=t.group,
                task=t.task,
                turn=t.turn,
                instance=t.instance,
                mode=t.mode,  # type: ignore[arg-type]
                tool=t.tool,
            )
            for key, t in self._live.items()
        ]
        return Snapshot(ts=ts, trajectories=rows, weight_update=self._update)
