"""The step-scale target (switching.stepCycle): the split the training step favours.

An RL step is a cycle: each weight update flushes every prefix cache and the live
trajectories re-prefill their contexts in a burst, then the caches refill and decode carries
the step. With the step-scale target the Controller steers toward the split that would have
served the last steps best, instead of moving instances into each burst and back.
"""

from __future__ import annotations

from test_controller import plan_inputs

from prorsa.core.allocate import Allocation
from prorsa.core.decision import Target
from prorsa.core.switch_cost import (
    OPEN_CYCLE_SECONDS,
    CycleProfile,
    Load,
    Persistence,
    Regret,
)
from prorsa.core.switch_plan import plan_switches
from prorsa.core.types import PlanInputs
from prorsa_lab.sim.policies import Prorsa
from prorsa_lab.sim.simulator import Scenario, Simulation, simulate

SPLITS = [(p, 8 - p) for p in range(1, 8)]
# The calm of a step: prefill demand under one instance (caches hit), decode carrying it.
CALM = Load(a=0.9, b=2.2, knees=3.4, decode_share=0.9)


def two_steps(split: tuple[int, int], burst: float, *, calm: Load = CALM) -> CycleProfile:
    """Ticks of 10 s at ``split`` over two steps; weight updates at 400 s and 650 s, each
    followed by a re-prefill burst of ``burst`` instance-seconds."""
    cycle = CycleProfile()
    t, started = 10.0, None
    for update in (400.0, 650.0):
        while t < update:
            cycle.record(t, calm, split, drain=calm.a * 10, update_started=started, max_gap=30)
            t += 10
        started = update
        rush = Load(a=burst / 10, b=0.1, knees=3.0, decode_share=0.8)
        cycle.record(update, rush, split, drain=burst, update_started=started, max_gap=30)
        t = update + 10
    return cycle


def best_split(cycle: CycleProfile, now: float) -> int:
    window = cycle.window(now, least=120)
    assert window is not None
    totals = cycle.totals(SPLITS, window)
    return SPLITS[min(range(len(SPLITS)), key=totals.__getitem__)][0]


def plan(inputs: PlanInputs, cycle: CycleProfile | None):
    return plan_switches(
        inputs, persistence=Persistence(seconds=300.0), regret=Regret(), cycle=cycle
    )


def test_the_larger_the_re_prefill_burst_the_more_prefill_the_step_favours() -> None:
    favoured = [best_split(two_steps((3, 5), burst), 655.0) for burst in (0, 200, 1_000, 4_000)]
    assert favoured == sorted(favoured) and favoured[0] < favoured[-1]
    # A step of calm decode alone favours decode: the split is not sized for the burst.
    assert favoured[0] <= 2


def test_after_a_weight_update_the_split_the_step_favours_holds_through_the_burst() -> None:
    """Eq. 1 on the next minutes asks for 6 prefill instances in the burst; the step as a
    whole favours the 3 in use, so nothing moves (and nothing has to move back)."""
    cycle = two_steps((3, 5), burst=200)
    assert best_split(cycle, 655.0) == 3
    burst = plan_inputs(current=(3, 5), now=655.0)
    assert burst.sizing.best == Allocation(6, 2, 0.0)
    held = plan(burst, cycle)
    assert held.switches == () and held.target == Target(prefill=3, decode=5)
    assert "favours" in held.held
    # Without the step-scale target the same tick moves an instance into the burst.
    chased = plan(burst, None)
    assert [s.to for s in chased.switches] == ["prefill"]


def test_a_step_short_of_prefill_moves_one_instance_when_it_pays() -> None:
    cycle = two_steps((2, 6), burst=1_000)
    assert best_split(cycle, 655.0) >= 3
    moved = plan(plan_inputs(current=(2, 6), now=655.0), cycle)
    assert [(s.from_, s.to) for s in moved.switches] == [("decode", "prefill")]
    assert any("favours" in n for n in moved.notes)
    assert moved.moves[0].gain > moved.moves[0].cost


def test_prefill_is_not_given_up_before_a_step_after_a_weight_update_was_seen() -> None:
    """The first step's calm favours decode, but it holds no re-prefill burst yet: the
    Controller adds prefill instances on it, never takes them away."""
    cycle = CycleProfile()
    for k in range(1, 40):  # 390 s of calm, then the first weight update
        cycle.record(10.0 * k, CALM, (3, 5), drain=9.0, update_started=None, max_gap=30)
    cycle.record(400.0, CALM, (3, 5), drain=9.0, update_started=400.0, max_gap=30)
    assert best_split(cycle, 400.0) < 3 and not cycle.after_update
    held = plan(plan_inputs(current=(3, 5), now=400.0), cycle)
    assert held.switches == () and held.target == Target(prefill=3, decode=5)
    # Once a step that began at a weight update has closed, the calm may take one back.
    assert two_steps((3, 5), burst=0).after_update


def test_before_a_whole_step_is_seen_at_most_one_instance_is_added_to_the_start() -> None:
    """The first minutes of a run ask for far more prefill (every prompt is new): one
    instance moves, not the four the window alone would ask for."""
    rush = Load(a=6.0, b=1.5, knees=3.0, decode_share=0.5)
    cycle = CycleProfile()
    for k in range(1, 14):
        cycle.record(10.0 * k, rush, (2, 6), drain=60.0, update_started=None, max_gap=30)
    assert best_split(cycle, 130.0) > 3 and cycle.first_split == (2, 6)
    moved = plan(plan_inputs(current=(2, 6), now=130.0), cycle)
    assert moved.target == Target(prefill=3, decode=5)
    assert [s.to for s in moved.switches] == ["prefill"]
    held = plan(plan_inputs(current=(3, 5), now=140.0), cycle)
    assert held.switches == () and held.target == Target(prefill=3, decode=5)


def test_once_an_update_closes_the_first_step_the_split_it_favours_is_the_start() -> None:
    """The run's first step, closed by the first weight update, favours more prefill than
    one instance over the start split (general tasks at staleness 2 and 8 start at 2P and
    are best served at 3-4P): the split goes there, not to the start + 1 it held before
    (seed 1 deepseek-v3-dp8 general at staleness 8 reached 4P only after the second
    update, 0.96x the best static split)."""
    rush = Load(a=6.0, b=1.5, knees=3.0, decode_share=0.5)
    cycle = CycleProfile()
    for k in range(1, 40):
        cycle.record(10.0 * k, rush, (3, 5), drain=60.0, update_started=None, max_gap=30)
    before = plan(plan_inputs(current=(3, 5), now=390.0), cycle)
    assert cycle.first_split == (3, 5) and before.target == Target(prefill=4, decode=4)
    cycle.record(400.0, rush, (3, 5), drain=60.0, update_started=400.0, max_gap=30)
    assert cycle.closed and not cycle.after_update and best_split(cycle, 400.0) > 4
    after = plan(plan_inputs(current=(4, 4), now=400.0), cycle)
    assert after.target.prefill > 4 and [s.to for s in after.switches] == ["prefill"]


def test_a_step_that_outlasts_the_closed_ones_is_read_and_the_split_follows_it() -> None:
    """A step whose prefill side falls behind for good (its prefix caches thrash, every
    turn recomputes its context) runs many times longer than the step before it. Once it
    has outlasted that step it is read, and the split moves toward prefill instead of
    holding what a calm first step favoured (deepseek-v3-tp16 coding held 3P for nine
    hours of a run the best static split, 4P, finished in ten)."""
    cycle = CycleProfile()
    for k in range(1, 40):  # the first step: calm at 3P:5D, weight update at 400 s
        cycle.record(10.0 * k, CALM, (3, 5), drain=9.0, update_started=None, max_gap=30)
    behind = Load(a=20.0, b=2.0, knees=3.0, decode_share=0.5)
    t = 400.0
    while t <= 700.0:  # the next step: prefill far behind, 300 s in (< the 390 s closed)
        cycle.record(t, behind, (3, 5), drain=120.0, update_started=400.0, max_gap=30)
        t += 10
    assert not cycle.overdue and cycle.window(700.0, least=120) == (10.0, 400.0)
    held = plan(plan_inputs(current=(3, 5), now=700.0), cycle)
    assert held.switches == () and held.target == Target(prefill=3, decode=5)
    while t <= 1_200.0:  # ... and on, twice the closed step's length
        cycle.record(t, behind, (3, 5), drain=120.0, update_started=400.0, max_gap=30)
        t += 10
    assert cycle.overdue and cycle.after_update
    assert cycle.window(1_200.0, least=120) == (10.0, 1_200.0)
    assert best_split(cycle, 1_200.0) > 4  # past the one-instance bound of an unseen step
    moved = plan(plan_inputs(current=(3, 5), now=1_200.0), cycle)
    assert [s.to for s in moved.switches][:1] == ["prefill"] and moved.target.prefill > 3
    # A weight update closes it: the closed steps are read again, the new one is not.
    cycle.record(1_210.0, CALM, (4, 4), drain=9.0, update_started=1_210.0, max_gap=30)
    assert not cycle.overdue and cycle.window(1_210.0, least=120) == (10.0, 1_210.0)


def test_the_first_minutes_of_a_run_hold_the_start_split_while_the_step_is_learned() -> None:
    cycle = CycleProfile()
    for k in range(1, 6):  # 50 s of trainer events: not yet a step to size for
        cycle.record(10.0 * k, CALM, (2, 6), drain=9.0, update_started=None, max_gap=30)
    held = plan(plan_inputs(current=(2, 6), now=50.0), cycle)
    assert held.switches == () and "learning the step's cycle" in held.held
    # A role below its minimum is restored at once, learning or not.
    restore = plan(plan_inputs(current=(0, 8), now=50.0), cycle)
    assert [s.to for s in restore.switches] == ["prefill"]


def test_without_weight_updates_only_the_last_minutes_are_read() -> None:
    """A trainer that never updates its weights: the cycle under way is read over its last
    OPEN_CYCLE_SECONDS, so a lasting shift of demand is followed within minutes."""
    cycle = CycleProfile()
    for k in range(1, 301):
        cycle.record(10.0 * k, CALM, (2, 6), drain=9.0, update_started=None, max_gap=30)
    now = 3_000.0
    assert cycle.window(now, least=120) == (now - OPEN_CYCLE_SECONDS, now)
    assert all(t > now - OPEN_CYCLE_SECONDS for t, *_ in cycle.ticks)


class _Logged(Prorsa):
    """The shipped Controller in the simulator, its switches and weight updates logged."""

    def __init__(self, *, step_cycle: bool) -> None:
        self.step_cycle = step_cycle
        self.log: list[tuple[float, str]] = []

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        switching = sim.spec.switching.model_copy(update={"step_cycle": self.step_cycle})
        self.controller.apply_spec(sim.spec.model_copy(update={"switching": switching}))
        sim.trainer.on_new_weights.append(lambda now: self.log.append((now, "weights")))

    def tick(self, now: float, *, scheduled: bool = True) -> None:
        super().tick(now, scheduled=scheduled)
        actions = self.last_actions
        assert actions is not None
        # The Controller's switches the operator makes (Auto), not the bootstrap's flips nor
        # the Controller's advice at a tick the bootstrap supersedes.
        if actions.decided:
            self.log.extend((now, o.switch.to) for o in actions.execute)


def reversals(log: list[tuple[float, str]]) -> list[float]:
    """Times of switches that undo the previous one within the same step."""
    out, last = [], None
    for at, what in log:
        if what == "weights":
            last = None
            continue
        if last is not None and what != last:
            out.append(at)
        last = what
    return out


def test_in_the_simulator_no_move_is_undone_after_a_weight_update_burst() -> None:
    """qwen3-dp4 general at staleness 8 (the setting where Eq. 1's rule lost most on
    seed 1): with the step-scale target the Controller moves once and never back; with
    Eq. 1 on the next minutes it moves into each re-prefill burst and back in the step."""
    scenario = Scenario(model="qwen3-dp4", task="general", staleness=8, steps=3, seed=1)
    step = _Logged(step_cycle=True)
    simulate(scenario, step)
    moves = [at for at, what in step.log if what != "weights"]
    assert 1 <= len(moves) <= 2 and reversals(step.log) == []
    minute = _Logged(step_cycle=False)
    simulate(scenario, minute)
    assert reversals(minute.log), "Eq. 1's rule chases the burst and comes back"
