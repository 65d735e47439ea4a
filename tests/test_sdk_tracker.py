"""The SDK's trajectory tracker: the snapshot a trainer would post on resync."""

from __future__ import annotations

import logging

import pytest
from conftest import make_spec

from prorsa.core.controller import Controller
from prorsa_contract.events import parse_events
from prorsa_sdk import TrajectoryTracker


def feed(tracker: TrajectoryTracker, *events: tuple) -> None:
    for i, (kind, traj, ts, fields) in enumerate(events):
        tracker.apply({"id": f"e{i}", "type": kind, "trajectory": traj, "ts": ts, **fields})


def test_snapshot_follows_the_contract_state_machine() -> None:
    t = TrajectoryTracker()
    feed(
        t,
        ("sample_dispatched", "a", 1.0, {"group": "g", "task": "swe", "prompt_tokens": 900}),
        ("sandbox_started", "a", 1.5, {"mode": "cold"}),
        ("request_queued", "a", 9.0, {"prompt_tokens": 1000, "turn": 0}),
        ("prefill_started", "a", 9.1, {"instance": "e-3"}),
        ("prefill_finished", "a", 9.4, {}),
        ("decode_finished", "a", 12.0, {"output_tokens": 200, "finish": "tool"}),
        ("tool_started", "a", 12.1, {"tool": "bash"}),
        ("tool_finished", "a", 14.0, {"result_tokens": 50}),
        ("request_queued", "b", 2.0, {"prompt_tokens": 700, "turn": 2}),
        ("prefill_started", "b", 2.5, {}),
        ("prefill_finished", "b", 2.6, {}),
        ("decode_finished", "b", 3.0, {"output_tokens": 30, "finish": "abort"}),  # role switch
        ("request_queued", "c", 1.0, {"prompt_tokens": 10, "turn": 0}),
        ("decode_finished", "c", 2.0, {"output_tokens": 5, "finish": "stop"}),
        ("reward_started", "c", 2.1, {}),
        ("request_queued", "d", 1.0, {"prompt_tokens": 10, "turn": 0}),
        ("reward_finished", "d", 5.0, {"accepted": True}),
    )
    snap = t.snapshot(ts=20.0)
    rows = {r.trajectory: r for r in snap.trajectories}
    assert set(rows) == {"a", "b", "c"}  # d finished
    a, b, c = rows["a"], rows["b"], rows["c"]
    assert (a.state, a.since, a.context_tokens, a.turn) == ("tool", 12.1, 1200, 0)
    assert (a.group, a.task, a.mode, a.tool, a.instance) == ("g", "swe", "cold", "bash", "e-3")
    assert (b.state, b.since, b.context_tokens, b.turn) == ("ready", 3.0, 730, 2)
    assert (c.state, c.context_tokens) == ("reward", 15)
    assert snap.ts == 20.0


def test_malformed_events_are_ignored() -> None:
    t = TrajectoryTracker()
    t.apply({"type": "teleported", "trajectory": "x", "ts": 1.0})
    t.apply({"type": "request_queued", "trajectory": "x", "ts": "noon"})
    t.apply({"type": "request_queued", "ts": 1.0})
    assert len(t) == 0


def test_tracker_is_bounded_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    t = TrajectoryTracker(max_trajectories=3)
    for i in range(5):
        t.apply({"type": "sample_dispatched", "trajectory": f"t{i}", "ts": float(i)})
    assert len(t) == 3 and t.evicted == 2
    assert {r.trajectory for r in t.snapshot(ts=9.0).trajectories} == {"t2", "t3", "t4"}
    assert caplog.records and caplog.records[0].levelno == logging.WARNING


def test_tracker_snapshot_loads_into_the_controller_state_for_state() -> None:
    """What the tracker sees is what the Controller would have from the events."""

    def e(i: str, kind: str, traj: str, ts: float, **f: object) -> dict:
        return {"id": i, "type": kind, "trajectory": traj, "ts": ts, **f}

    raw = [
        e("1", "request_queued", "a", 1.0, prompt_tokens=9, turn=0),
        e("2", "prefill_started", "a", 2.0),
        e("3", "request_queued", "b", 1.0, prompt_tokens=9, turn=0),
        e("4", "decode_finished", "b", 3.0, output_tokens=1, finish="tool"),
    ]
    from_events = Controller(make_spec())
    from_events.observe(parse_events(raw))
    t = TrajectoryTracker()
    for e in raw:
        t.apply(e)
    from_snapshot = Controller(make_spec())
    from_snapshot.observe_snapshot(t.snapshot(ts=4.0))
    assert from_snapshot.live_trajectories() == from_events.live_trajectories()


def test_tracker_snapshot_carries_a_weight_update_under_way() -> None:
    t = TrajectoryTracker()
    feed(t, ("request_queued", "a", 1.0, {"prompt_tokens": 10, "turn": 0}))
    t.apply({"id": "w1", "type": "weight_update_started", "ts": 2.0, "version": 5})
    t.apply({"id": "w1b", "type": "weight_update_started", "ts": 2.2, "version": 5})  # again
    snap = t.snapshot(ts=3.0)
    assert snap.weight_update is not None
    assert (snap.weight_update.version, snap.weight_update.started_at) == (5, 2.0)
    assert [r.trajectory for r in snap.trajectories] == ["a"]  # no trajectory for the update
    t.apply({"id": "w0", "type": "weight_update_finished", "ts": 2.5, "version": 4})  # older
    assert t.snapshot(ts=3.0).weight_update is not None
    t.apply({"id": "w2", "type": "weight_update_finished", "ts": 4.0, "version": 5})
    assert t.snapshot(ts=5.0).weight_update is None
