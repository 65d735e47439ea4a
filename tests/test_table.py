"""The trajectory table follows Figure 4 and survives whatever a trainer sends."""

from __future__ import annotations

import tracemalloc

import numpy as np

from prorsa.core.forecast.config import ForecastConfig
from prorsa.core.forecast.model import Forecaster
from prorsa.core.forecast.table import TrajectoryTable
from prorsa_contract import events as ev


def table() -> TrajectoryTable:
    return TrajectoryTable(observer=Forecaster(ForecastConfig()))


def test_full_lifecycle_moves_through_every_state(log) -> None:
    t = table()
    steps = [
        ("sample_dispatched", {"task": "swe", "group": "g"}, "starting"),
        ("sandbox_started", {"mode": "prewarm"}, "starting"),
        ("request_queued", {"prompt_tokens": 1000, "turn": 0}, "ready"),
        ("prefill_started", {"instance": "p0"}, "prefill"),
        ("prefill_finished", {}, "decode"),
        ("decode_finished", {"output_tokens": 50, "finish": "tool"}, "tool"),
        ("tool_started", {"tool": "bash"}, "tool"),
        ("tool_finished", {"result_tokens": 200}, "tool"),
        ("request_queued", {"prompt_tokens": 1300, "turn": 1}, "ready"),
        ("prefill_started", {}, "prefill"),
        ("prefill_finished", {}, "decode"),
        ("decode_finished", {"output_tokens": 20, "finish": "stop"}, "reward"),
        ("reward_started", {}, "reward"),
    ]
    for i, (kind, fields, state) in enumerate(steps):
        log(kind, "a", float(i), **fields)
        t.apply(log.take())
        assert t.state_counts()[state] == 1, kind
    log("reward_finished", "a", 20.0, accepted=True)
    t.apply(log.take())
    assert len(t) == 0 and sum(t.state_counts().values()) == 0
    assert sum(t.anomalies.values()) == 0


def test_duplicate_ids_are_ignored(log) -> None:
    t = table()
    log("request_queued", "a", 1.0, prompt_tokens=10, turn=0)
    batch = log.take()
    assert t.apply(batch).applied == 1
    again = t.apply(batch)
    assert (again.applied, again.duplicates) == (0, 1)
    assert t.anomalies["duplicate"] == 1


def test_stale_event_does_not_rewind_state(log) -> None:
    t = table()
    log("request_queued", "a", 10.0, prompt_tokens=10, turn=0)
    log("prefill_started", "a", 11.0)
    log("request_queued", "a", 5.0, prompt_tokens=99, turn=0)  # late retry of an old event
    t.apply(log.take())
    assert t.state_counts()["prefill"] == 1
    assert t.anomalies["stale"] == 1


def test_unknown_and_finished_trajectories_are_counted_not_fatal(log) -> None:
    t = table()
    log("tool_finished", "ghost", 1.0)  # first heard of mid-life: created in Tool
    log("reward_finished", "nobody", 1.0, accepted=True)
    log("request_queued", "b", 1.0, prompt_tokens=5, turn=0)
    log("trajectory_dropped", "b", 2.0)
    log("prefill_started", "b", 3.0)  # after it left: ignored, not resurrected
    t.apply(log.take())
    assert t.state_counts()["tool"] == 1 and len(t) == 1
    assert t.anomalies["unknown_trajectory"] == 3  # ghost, nobody, and b (no dispatch)
    assert t.anomalies["finished_trajectory"] == 1


def test_a_drop_heard_first_leaves_no_ghost_when_earlier_events_follow(log) -> None:
    """Events of one trajectory can arrive out of order (two emitters, a retried batch): a
    drop (or a reward's end) heard before anything else of its trajectory is remembered,
    so the earlier events that follow do not bring it back as a live, ready ghost."""
    t = table()
    log("trajectory_dropped", "a", 10.0, reason="sandbox died")
    log("reward_finished", "b", 10.0, accepted=False)
    t.apply(log.take())
    log("request_queued", "a", 5.0, prompt_tokens=70_000, turn=0)
    log("prefill_started", "a", 6.0)
    log("sample_dispatched", "b", 1.0)
    log("request_queued", "b", 2.0, prompt_tokens=70_000, turn=0)
    t.apply(log.take())
    assert len(t) == 0 and t.state_counts()["ready"] == 0
    assert t.anomalies["finished_trajectory"] == 4


def test_tombstones_are_bounded(log) -> None:
    t = TrajectoryTable(observer=Forecaster(ForecastConfig()), finished_window=100)
    for i in range(1000):
        log("trajectory_dropped", f"gone-{i}", 1.0)
    t.apply(log.take())
    log("request_queued", "gone-0", 0.5, prompt_tokens=5, turn=0)  # forgotten: let in
    log("request_queued", "gone-999", 0.5, prompt_tokens=5, turn=0)  # remembered
    t.apply(log.take())
    assert t.slot_of("gone-0") is not None and t.slot_of("gone-999") is None


def test_unexpected_transition_is_applied_and_counted(log) -> None:
    t = table()
    log("request_queued", "a", 1.0, prompt_tokens=5, turn=0)
    log("tool_started", "a", 2.0, tool="bash")  # the decode events were lost
    t.apply(log.take())
    assert t.state_counts()["tool"] == 1
    assert t.anomalies["unexpected_transition"] == 1


def test_abort_sends_prompt_plus_partial_output_back_to_ready(log) -> None:
    t = table()
    log("request_queued", "a", 1.0, prompt_tokens=100, turn=0)
    log("prefill_started", "a", 2.0)
    log("prefill_finished", "a", 3.0)
    log("decode_finished", "a", 4.0, output_tokens=40, finish="abort")
    t.apply(log.take())
    slot = t.slot_of("a")
    assert t.state_counts()["ready"] == 1
    assert t.cols["x"][slot] == 140


def test_groups_are_released_with_their_last_member(log) -> None:
    t = table()
    for name in ("a", "b"):
        log("sample_dispatched", name, 1.0, group="g1")
    t.apply(log.take())
    assert list(t.group_live_counts()) == [2]
    log("trajectory_dropped", "a", 2.0)
    log("trajectory_dropped", "b", 2.0)
    t.apply(log.take())
    assert t.groups == {}


def test_eviction_of_silent_trajectories(log) -> None:
    t = table()
    log("request_queued", "old", 1.0, prompt_tokens=5, turn=0)
    log("request_queued", "new", 100.0, prompt_tokens=5, turn=0)
    t.apply(log.take())
    assert t.evict_older_than(50.0) == 1
    assert t.slot_of("old") is None and t.slot_of("new") is not None


def test_slots_are_reused_so_memory_follows_live_count(log) -> None:
    t = table()
    for wave in range(3):
        for i in range(500):
            log("request_queued", f"w{wave}-{i}", float(wave), prompt_tokens=5, turn=0)
        t.apply(log.take())
        for i in range(500):
            log("trajectory_dropped", f"w{wave}-{i}", float(wave) + 0.5)
        t.apply(log.take())
    assert t.hwm == 500


def test_memory_per_live_trajectory_is_under_1kb(log) -> None:
    n = 20_000
    events = []
    for i in range(n):
        log("sample_dispatched", f"traj-{i:08d}", 1.0, task="swe", group=f"g{i // 32}")
        log("request_queued", f"traj-{i:08d}", 2.0, prompt_tokens=4000, turn=0)
        events += log.take()
    t = TrajectoryTable(observer=Forecaster(ForecastConfig()), dedupe_window=0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    t.apply(events)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per = (after - before) / n
    assert per < 1024, f"{per:.0f} bytes per trajectory"
    assert int(np.sum(t.cols["state"] > 0)) == n


def test_each_prefill_is_charged_its_prompt_minus_the_previous_turns(log) -> None:
    f = Forecaster(ForecastConfig())
    t = TrajectoryTable(observer=f)

    def turn(prompt: int, ts: float) -> float:
        before = f.prefilled_computed
        log("request_queued", "a", ts, prompt_tokens=prompt, turn=0)
        log("prefill_started", "a", ts + 0.1, instance="p0")
        log("prefill_finished", "a", ts + 0.2, instance="p0")
        t.apply(log.take())
        return f.prefilled_computed - before

    assert turn(1_000, 0.0) == 1_000  # nothing cached yet
    log("decode_finished", "a", 1.0, output_tokens=50, finish="tool")
    log("tool_finished", "a", 2.0, result_tokens=200)
    t.apply(log.take())
    # The engines still hold the 1,000-token prompt: output, result and template are new.
    assert turn(1_300, 3.0) == 300
    log("decode_finished", "a", 4.0, output_tokens=40, finish="abort")
    t.apply(log.take())
    # A resend after an abort (a weight update flushed the caches) computes everything.
    assert turn(1_340, 5.0) == 1_340
    assert f.prefilled_tokens == 1_000 + 1_300 + 1_340


def test_a_burst_of_aborts_reads_as_a_weight_update_and_forgets_every_cache(log) -> None:
    f = Forecaster(ForecastConfig())
    t = TrajectoryTable(observer=f)
    names = [f"t{i}" for i in range(12)]
    for name in names:  # one turn each: 1,000 prompt tokens now cached
        log("request_queued", name, 0.0, prompt_tokens=1_000, turn=0)
        log("prefill_started", name, 0.1, instance="p0")
        log("prefill_finished", name, 0.2, instance="p0")
    # Two go to tools; ten keep decoding, and one of those is aborted alone (a role switch).
    for name in names[:2]:
        log("decode_finished", name, 1.0, output_tokens=50, finish="tool")
    log("decode_finished", names[2], 1.0, output_tokens=10, finish="abort")
    t.apply(log.take())
    assert t.cache_flushes == 0
    # Then all nine still decoding are aborted within a second: a weight update.
    for name in names[3:]:
        log("decode_finished", name, 2.0, output_tokens=10, finish="abort")
    t.apply(log.take())
    assert t.cache_flushes == 1
    # A trajectory that was running a tool comes back: its cache went with the update.
    before = f.prefilled_computed
    log("tool_finished", names[0], 3.0, result_tokens=100)
    log("request_queued", names[0], 3.0, prompt_tokens=1_200, turn=1)
    log("prefill_started", names[0], 3.1, instance="p0")
    log("prefill_finished", names[0], 3.2, instance="p0")
    t.apply(log.take())
    assert f.prefilled_computed - before == 1_200


# -- weight updates (cluster events) ----------------------------------------------------------


def _cached_turns(log, t: TrajectoryTable, names: list[str]) -> None:
    """One completed 1,000-token prefill each: that prompt is now a cached prefix."""
    for name in names:
        log("request_queued", name, 0.0, prompt_tokens=1_000, turn=0)
        log("prefill_started", name, 0.1, instance="p0")
        log("prefill_finished", name, 0.2, instance="p0")
    t.apply(log.take())


def test_weight_update_started_forgets_every_cache_before_any_abort_arrives(log) -> None:
    f = Forecaster(ForecastConfig())
    t = TrajectoryTable(observer=f)
    _cached_turns(log, t, ["a", "b"])
    log("decode_finished", "a", 1.0, output_tokens=50, finish="tool")
    log.cluster("weight_update_started", 2.0, version=1, expected_seconds=8.0)
    result = t.apply(log.take())
    assert result.anomalies == 0 and t.cache_flushes == 1
    wu = t.weight_update
    assert (wu.pending, wu.version, wu.started_at, wu.expected_seconds) == (True, 1, 2.0, 8.0)
    assert wu.expected_end(now=3.0) == 10.0
    # "a" was running a tool: its next turn computes everything, its cache went with the weights.
    before = f.prefilled_computed
    log("tool_finished", "a", 3.0, result_tokens=100)
    log("request_queued", "a", 3.0, prompt_tokens=1_200, turn=1)
    log("prefill_finished", "a", 3.2, instance="p0")
    t.apply(log.take())
    assert f.prefilled_computed - before == 1_200
    # A prefill that completes on the old weights while the update loads is not cached.
    log("tool_started", "a", 3.5)
    log("tool_finished", "a", 3.6, result_tokens=10)
    log("request_queued", "a", 4.0, prompt_tokens=1_300, turn=2)
    log("prefill_finished", "a", 4.1, instance="p0")
    log.cluster("weight_update_finished", 10.0, version=1, reprefill_trajectories=2)
    log("decode_finished", "a", 11.0, output_tokens=10, finish="tool")
    log("tool_finished", "a", 12.0, result_tokens=10)
    log("request_queued", "a", 12.0, prompt_tokens=1_400, turn=3)
    log("prefill_finished", "a", 12.1, instance="p0")
    before = f.prefilled_computed
    t.apply(log.take())
    assert f.prefilled_computed - before == 1_300 + 1_400
    wu = t.weight_update
    assert (wu.pending, wu.finished_at, wu.reprefill_trajectories) == (False, 10.0, 2)
    assert wu.last_seconds == 8.0 and t.cache_flushes == 1


def test_announced_updates_are_not_flushed_again_by_their_abort_burst(log) -> None:
    t = TrajectoryTable(observer=Forecaster(ForecastConfig()))
    names = [f"t{i}" for i in range(12)]
    _cached_turns(log, t, names)
    log.cluster("weight_update_started", 100.0, version=1)
    for name in names:
        log("decode_finished", name, 100.0, output_tokens=10, finish="abort")
    log.cluster("weight_update_finished", 100.5, version=1, reprefill_trajectories=12)
    t.apply(log.take())
    assert t.cache_flushes == 1
    # Long after the refractory period, a burst of aborts (role switches) is not an update
    # once the trainer announces its updates itself.
    for name in names:
        log("request_queued", name, 200.0, prompt_tokens=1_010, turn=0)
        log("prefill_finished", name, 200.1, instance="p0")
        log("decode_finished", name, 201.0, output_tokens=10, finish="abort")
    t.apply(log.take())
    assert t.cache_flushes == 1


def test_weight_update_events_are_idempotent_and_ignore_older_versions(log) -> None:
    t = TrajectoryTable(observer=Forecaster(ForecastConfig()))
    log.cluster("weight_update_started", 10.0, version=2)
    log.cluster("weight_update_finished", 12.0, version=2, reprefill_trajectories=5)
    batch = log.take()
    t.apply(batch)
    first = t.weight_update
    replay = t.apply(batch)  # a lost reply: the trainer sends the same ids again
    assert replay.duplicates == 2 and t.weight_update == first and t.cache_flushes == 1
    # Late news of an older or finished update (new ids) changes nothing, and is counted.
    log.cluster("weight_update_finished", 13.0, version=1, reprefill_trajectories=9)
    log.cluster("weight_update_started", 13.0, version=2)
    assert t.apply(log.take()).anomalies == 2
    assert t.anomalies["stale"] == 2 and t.weight_update == first and t.cache_flushes == 1
    # A finish whose start was never heard (operator restart) still means new weights.
    log.cluster("weight_update_finished", 20.0, version=3, reprefill_trajectories=4)
    t.apply(log.take())
    wu = t.weight_update
    assert (wu.version, wu.pending, wu.started_at, wu.last_seconds) == (3, False, None, 2.0)
    assert t.cache_flushes == 2


def test_reprefill_tokens_count_every_context_that_comes_back(log) -> None:
    t = TrajectoryTable(observer=Forecaster(ForecastConfig()))
    log("sample_dispatched", "starting", 0.0)  # no context yet
    log("request_queued", "ready", 0.0, prompt_tokens=1_000, turn=0)
    log("request_queued", "prefill", 0.0, prompt_tokens=2_000, turn=0)
    log("prefill_started", "prefill", 0.1)
    log("request_queued", "decode", 0.0, prompt_tokens=4_000, turn=0)
    log("prefill_finished", "decode", 0.2)
    log("request_queued", "tool", 0.0, prompt_tokens=8_000, turn=0)
    log("decode_finished", "tool", 1.0, output_tokens=100, finish="tool")
    log("request_queued", "reward", 0.0, prompt_tokens=16_000, turn=0)
    log("decode_finished", "reward", 1.0, output_tokens=100, finish="stop")  # done generating
    t.apply(log.take())
    assert t.reprefill_tokens() == 1_000 + 2_000 + 4_000 + 8_100


def test_snapshot_carries_an_update_under_way(log) -> None:
    t = TrajectoryTable(observer=Forecaster(ForecastConfig()))
    snap = ev.Snapshot(
        ts=50.0,
        trajectories=[],
        weight_update=ev.SnapshotWeightUpdate(version=4, started_at=45.0, expected_seconds=10.0),
    )
    t.load_snapshot(snap)
    wu = t.weight_update
    assert (wu.pending, wu.version, wu.expected_end(now=50.0)) == (True, 4, 55.0)
    t.load_snapshot(ev.Snapshot(ts=60.0, trajectories=[]))
    assert t.weight_update.pending is False


# -- emitters: snapshots scoped to the worker that sends them -------------------------------


def _row(trajectory: str, state: str = "ready", since: float = 10.0) -> ev.SnapshotTrajectory:
    return ev.SnapshotTrajectory(
        trajectory=trajectory, state=state, since=since, context_tokens=1000
    )


def test_a_named_emitters_snapshot_replaces_its_trajectories_alone(log) -> None:
    """Two workers, one emitter each: worker a resyncs; worker b's trajectories stay."""
    t = table()
    for worker in ("a", "b"):
        for i in range(3):
            log("request_queued", f"{worker}{i}", 1.0, prompt_tokens=500, turn=0)
        with t.emitting(worker):
            t.apply(log.take())
    with t.emitting("a"):  # a still holds a0 (now in a tool) and a new a9; a1, a2 ended
        t.load_snapshot(ev.Snapshot(ts=20.0, trajectories=[_row("a0", "tool"), _row("a9")]))
    assert sorted(t._slots) == ["a0", "a9", "b0", "b1", "b2"]
    assert t.emitter_counts() == {"a": 2, "b": 3}
    assert t.state_counts()["tool"] == 1 and t.state_counts()["ready"] == 4


def test_a_trajectory_belongs_to_the_emitter_that_reported_it_last(log) -> None:
    t = table()
    log("sample_dispatched", "x", 1.0)
    with t.emitting("driver"):
        t.apply(log.take())
    log("request_queued", "x", 2.0, prompt_tokens=500, turn=0)
    with t.emitting("worker-3"):
        t.apply(log.take())
    with t.emitting("driver"):  # the driver's view no longer holds x: it is not the driver's
        t.load_snapshot(ev.Snapshot(ts=3.0, trajectories=[]))
    assert t.slot_of("x") is not None and t.emitter_counts() == {"worker-3": 1}
    with t.emitting("worker-3"):
        t.load_snapshot(ev.Snapshot(ts=4.0, trajectories=[]))
    assert len(t) == 0


def test_a_snapshot_without_an_emitter_still_replaces_everything(log) -> None:
    """Old trainers, unchanged: a snapshot that names no emitter is the whole truth."""
    t = table()
    log("request_queued", "a0", 1.0, prompt_tokens=500, turn=0)
    with t.emitting("a"):
        t.apply(log.take())
    log("request_queued", "u0", 1.0, prompt_tokens=500, turn=0)
    t.apply(log.take())
    t.load_snapshot(ev.Snapshot(ts=5.0, trajectories=[_row("n0")]))
    assert list(t._slots) == ["n0"] and t.emitter_counts() == {"": 1}


def test_a_named_snapshot_leaves_a_weight_update_it_does_not_mention(log) -> None:
    t = table()
    log.cluster("weight_update_started", 1.0, version=3)
    with t.emitting("trainer"):
        t.apply(log.take())
    with t.emitting("worker-0"):
        t.load_snapshot(ev.Snapshot(ts=2.0, trajectories=[_row("w0")]))
    assert t.weight_update.pending and t.weight_update.version == 3
    t.load_snapshot(ev.Snapshot(ts=3.0, trajectories=[]))  # every trajectory: none under way
    assert not t.weight_update.pending


def test_emitter_ids_are_bounded() -> None:
    from prorsa.core.forecast.emitters import MAX_EMITTERS, TooManyEmitters

    t = table()
    for i in range(MAX_EMITTERS):
        with t.emitting(f"w{i}"):
            pass
    with t.emitting("w0"):  # a known one is fine
        pass
    try:
        with t.emitting("one-too-many"):
            raise AssertionError("entered")
    except TooManyEmitters as exc:
        assert "stable" in str(exc)
    else:
        raise AssertionError("no TooManyEmitters")
