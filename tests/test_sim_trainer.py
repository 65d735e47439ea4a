"""The simulated trainer: CONTRACT events, GRPO steps, staleness and injection policies."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import pytest

from prorsa.core.controller import Controller
from prorsa_contract import events as ev
from prorsa_lab.sim.policies import Static
from prorsa_lab.sim.simulator import Scenario, Simulation

# Allowed next event types per event type: the lifecycle of the paper's Figure 4.
NEXT = {
    None: {"sample_dispatched"},
    "sample_dispatched": {"sandbox_started"},
    "sandbox_started": {"request_queued", "trajectory_dropped"},
    "request_queued": {"prefill_started", "trajectory_dropped"},
    "prefill_started": {"prefill_finished", "trajectory_dropped"},
    "prefill_finished": {"decode_finished", "trajectory_dropped"},
    "decode_finished": {"tool_started", "reward_started", "request_queued"},
    "tool_started": {"tool_finished", "trajectory_dropped"},
    "tool_finished": {"request_queued"},
    "reward_started": {"reward_finished", "trajectory_dropped"},
    "reward_finished": set(),
    "trajectory_dropped": set(),
}


def run(
    *, task: str = "general", staleness: int = 0, steps: int = 2, groups: int = 1, **kw: Any
) -> tuple[Simulation, list[ev.Event]]:
    sc = Scenario(
        model="qwen3-235b",
        task=task,
        staleness=staleness,
        steps=steps,
        groups_per_step=groups,
        **kw,
    )
    sim = Simulation(sc, Static(4), emit_events=True)
    got: list[ev.Event] = []
    sim.loop.every(7.0, lambda _now: got.extend(sim.trainer.drain_outbox()))
    sim.result = sim.run()  # type: ignore[attr-defined]
    got.extend(sim.trainer.drain_outbox())
    return sim, got


def by_trajectory(events: list[ev.Event]) -> dict[str, list[ev.Event]]:
    out: dict[str, list[ev.Event]] = defaultdict(list)
    for e in events:
        if e.type not in ev.CLUSTER_EVENT_TYPES:
            out[e.trajectory].append(e)  # type: ignore[union-attr]
    return out


def test_events_are_contract_valid_ordered_and_clean_for_the_controller() -> None:
    sim, events = run(staleness=2, steps=3)
    wire = ev.dump_events(events)
    assert ev.parse_events(wire) == events  # exactly the webhook CONTRACT models
    assert len({e.id for e in events}) == len(events)
    for traj, evs in by_trajectory(events).items():
        prev: str | None = None
        for e in evs:
            assert e.type in NEXT[prev], (traj, prev, e.type)
            prev = e.type
        assert [e.ts for e in evs] == sorted(e.ts for e in evs)
    ctl = Controller(sim.spec)
    applied = ctl.observe(events)
    assert applied.anomalies == 0 and applied.duplicates == 0
    assert applied.applied == len(events)


def test_on_policy_dispatches_one_batch_per_step_after_the_last_one_ends() -> None:
    sim, events = run(staleness=0, steps=3, groups=2)
    starts = sorted({e.ts for e in events if e.type == "sample_dispatched"})
    steps = sim.trainer.stats.steps
    assert starts == [0.0, *steps[:-1]]
    per_step = defaultdict(int)
    for e in events:
        if e.type == "sample_dispatched":
            per_step[e.ts] += 1
    assert set(per_step.values()) == {2 * 32}
    groups = defaultdict(int)
    for e in events:
        if isinstance(e, ev.SampleDispatched):
            groups[e.group] += 1
    assert set(groups.values()) == {32}  # GRPO groups of the paper's size
    assert sim.result.makespan == steps[-1]  # type: ignore[attr-defined]


def test_async_rollout_keeps_the_concurrency_and_staleness_bounds() -> None:
    sc = Scenario(model="qwen3-235b", task="general", staleness=1, steps=3, groups_per_step=1)
    sim = Simulation(sc, Static(4))
    tr = sim.trainer

    def watch(_now: float) -> None:
        assert len(tr.live) <= tr.max_concurrent == 2 * tr.batch
        assert tr.stats.dispatched <= (tr.version + tr.staleness + 1) * tr.batch

    sim.loop.every(1.0, watch)
    result = sim.run()
    assert len(result.step_times) == 3 and tr.version == 3


def test_stale_trajectories_are_dropped_and_say_so() -> None:
    sim, events = run(task="general", staleness=1, steps=6, groups=2)
    dropped = [e for e in events if isinstance(e, ev.TrajectoryDropped)]
    assert dropped and all(e.reason == "staleness" for e in dropped)
    assert sim.trainer.stats.dropped == len(dropped)
    per = by_trajectory(events)
    for e in dropped:
        assert per[e.trajectory][-1] is e  # nothing after the drop


def test_carried_over_trajectories_are_interrupted_and_reprefill_on_new_weights() -> None:
    sim, events = run(task="math", staleness=2, steps=2)
    bump = sim.trainer.stats.steps[0]
    per = by_trajectory(events)
    resent = 0
    for evs in per.values():
        for a, b in itertools.pairwise(evs):
            if isinstance(a, ev.DecodeFinished) and a.finish == "abort":
                assert a.ts == bump
                assert isinstance(b, ev.RequestQueued) and b.ts == bump
                prev = next(
                    x for x in reversed(evs[: evs.index(a)]) if isinstance(x, ev.RequestQueued)
                )
                assert b.prompt_tokens == prev.prompt_tokens + a.output_tokens
                assert b.turn == prev.turn
                resent += 1
    assert resent > 0


@pytest.mark.parametrize("policy", ["replaceOnReward", "groupReplenish", "fixedRate"])
def test_injection_policies(policy: str) -> None:
    sim, events = run(task="general", staleness=8, steps=3, groups=2, injection=policy)
    tr = sim.trainer
    bumps = set(tr.stats.steps)
    dispatch = [e for e in events if isinstance(e, ev.SampleDispatched)]
    later = [e for e in dispatch if e.ts > 0 and e.ts not in bumps]
    assert later, "no injection within steps"
    if policy == "replaceOnReward":
        accepted = {e.ts for e in events if isinstance(e, ev.RewardFinished) and e.accepted}
        assert all(e.ts in accepted for e in later)
    elif policy == "groupReplenish":
        at = defaultdict(set)
        for e in later:
            at[e.ts].add(e.group)
        counts = defaultdict(int)
        for e in dispatch:
            counts[e.group] += 1
        assert all(counts[g] == 32 for gs in at.values() for g in gs)  # whole groups
        done = {e.ts for e in events if isinstance(e, (ev.RewardFinished, ev.TrajectoryDropped))}
        assert set(at) <= done
    else:
        period = 1.0 / sim.scenario.fixed_rate()
        for e in later:
            assert (e.ts / period) == pytest.approx(round(e.ts / period), abs=1e-6)
        assert sim.spec.forecast.injection.rate_per_second == pytest.approx(1 / period)
    assert sim.spec.forecast.injection.policy == policy


# State a trajectory is in after each of its events (decode_finished depends on `finish`).
_AFTER = {
    "sample_dispatched": "starting",
    "sandbox_started": "starting",
    "request_queued": "ready",
    "prefill_started": "prefill",
    "prefill_finished": "decode",
    "tool_started": "tool",
    "tool_finished": "tool",
    "reward_started": "reward",
}


def test_each_weight_update_is_announced_around_its_aborts() -> None:
    # An instantaneous update: both events at the step's end (see below for one that lasts).
    sim, events = run(task="math", staleness=2, steps=3, weight_update_seconds=0.0)
    bumps = sim.trainer.stats.steps[:-1]  # the last step ends the run: no new weights
    started = [e for e in events if isinstance(e, ev.WeightUpdateStarted)]
    finished = [e for e in events if isinstance(e, ev.WeightUpdateFinished)]
    assert [e.ts for e in started] == [e.ts for e in finished] == bumps
    assert [e.version for e in started] == [e.version for e in finished] == [1, 2]
    state: dict[str, str] = {}
    for i, e in enumerate(events):
        if isinstance(e, ev.WeightUpdateStarted):
            opened = i
        elif isinstance(e, ev.WeightUpdateFinished):
            # Every abort of the update lies between its two events...
            aborts = [
                x
                for x in events[opened:i]
                if isinstance(x, ev.DecodeFinished) and x.finish == "abort"
            ]
            assert aborts and all(x.ts == e.ts for x in aborts)
            # ...and the count is of the live trajectories holding a context to re-prefill.
            holding = sum(s in ("ready", "prefill", "decode", "tool") for s in state.values())
            assert e.reprefill_trajectories == holding >= len(aborts)
        elif isinstance(e, ev.DecodeFinished):
            finish = e.finish
            state[e.trajectory] = {"tool": "tool", "abort": "ready"}.get(finish, "reward")
        elif isinstance(e, ev.RewardFinished | ev.TrajectoryDropped):
            state.pop(e.trajectory, None)
        else:
            state[e.trajectory] = _AFTER[e.type]  # type: ignore[union-attr]
    # The Controller's table takes them as the updates: one flush each, no guessing.
    ctl = Controller(sim.spec)
    assert ctl.observe(events).anomalies == 0
    assert ctl.table.cache_flushes == 2 and ctl.table.weight_update.version == 2


def test_weight_update_events_can_be_turned_off_for_the_benchmark() -> None:
    on_sim, on = run(task="math", staleness=2, steps=2)
    off_sim, off = run(task="math", staleness=2, steps=2, weight_update_events=False)
    assert not any(e.type in ev.CLUSTER_EVENT_TYPES for e in off)
    assert [e for e in on if e.type not in ev.CLUSTER_EVENT_TYPES] == off  # nothing else moves
    assert on_sim.trainer.stats.events == off_sim.trainer.stats.events + 2
    # Without them the table still reads the burst of aborts as the update.
    ctl = Controller(off_sim.spec)
    ctl.observe(off)
    assert ctl.table.cache_flushes == 1 and ctl.table.weight_update.version is None


def test_a_weight_update_that_takes_time_pauses_the_engines_and_is_announced() -> None:
    sim, events = run(task="math", staleness=2, steps=3, weight_update_seconds=12.0)
    started = [e for e in events if isinstance(e, ev.WeightUpdateStarted)]
    finished = [e for e in events if isinstance(e, ev.WeightUpdateFinished)]
    assert [e.expected_seconds for e in started] == [12.0, 12.0]
    assert [f.ts - s.ts for s, f in zip(started, finished, strict=True)] == [12.0, 12.0]
    for s, f in zip(started, finished, strict=True):
        # The paused client sends nothing: no prefill starts while the weights load...
        during = [e for e in events if isinstance(e, ev.PrefillStarted) and s.ts < e.ts < f.ts]
        assert during == []
        # ...and what it held (the interrupted generations among them) starts right after.
        assert any(isinstance(e, ev.PrefillStarted) and e.ts == f.ts for e in events)
    ctl = Controller(sim.spec)
    assert ctl.observe(events).anomalies == 0
    assert ctl.table.cache_flushes == 2


def test_the_prorsa_policy_decides_when_a_weight_update_starts() -> None:
    from prorsa_lab.sim.policies import Prorsa

    sc = Scenario(
        model="qwen3-tp8",
        task="math",
        staleness=2,
        steps=2,
        groups_per_step=1,
        weight_update_seconds=12.0,
    )
    policy = Prorsa()
    sim = Simulation(sc, policy, emit_events=True)
    decided: list[float] = []
    tick = policy.tick

    def recording(now: float, **kw: Any) -> None:
        decided.append(now)
        tick(now, **kw)

    policy.tick = recording  # type: ignore[method-assign]
    sim.run()
    (update,) = sim.trainer.stats.steps[:-1]
    # Not only every horizon: the update's own start, its lead time for switching.
    assert update in decided and update % sc.horizon != 0
