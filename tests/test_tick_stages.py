"""The tick on one frozen input, and its stages alone: what a stage saw is what it was given.

A tick takes one :class:`TickInput`; sizing (Eq. 1), θ_P and the Decision's explanation
are stage modules that read frozen values, and the stages that learn (the smoothers, the
switch plan's memory) hand back what they learned instead of changing it in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from conftest import EventLog, make_spec

import prorsa.core.controller as controller_module
from prorsa.core.allocate import Allocation
from prorsa.core.controller import Controller
from prorsa.core.decision import Forecast, Target
from prorsa.core.estimators import DemandSmoother
from prorsa.core.prefill_speed import PrefillSpeedMeter
from prorsa.core.sizing import size
from prorsa.core.switch_cost import Persistence, Regret
from prorsa.core.switch_plan import plan_switches
from prorsa.core.types import Demand, PlanInputs, RoleCounts, Sizing, SizingInputs, TickInput
from prorsa_contract.agent_api import EngineState

PER_HORIZON = {"smoothingSeconds": 0, "hysteresis": 0.1, "stepCycle": False}


def spec8(**switching: Any):
    return make_spec(
        engine={"gpusPerInstance": 8},
        capacity={"prefillTokensPerSecond": 10_000, "decodeKvTokens": 1_000_000},
        switching=PER_HORIZON | {"cooldownSeconds": 30, "maxConcurrent": 1} | switching,
    )


def engines(prefill: int, decode: int, **overrides: dict[str, Any]) -> tuple[EngineState, ...]:
    return tuple(
        EngineState.model_validate(
            {
                "instance": f"c-engine-{i}",
                "role": "prefill" if i < prefill else "decode",
                "kvCapacityTokens": 1_000_000,
                "kvUsedTokens": 100_000,
                "runningRequests": 10 + i,
            }
            | overrides.get(f"c-engine-{i}", {})
        )
        for i in range(prefill + decode)
    )


def queue(log: EventLog, n: int, tokens: int, ts: float, prefix: str = "t") -> None:
    for i in range(n):
        log("request_queued", f"{prefix}{i}", ts, prompt_tokens=tokens, turn=0)


# -- the tick's input ------------------------------------------------------------------------


def test_engine_states_in_the_tick_input_decide_as_observed_ones() -> None:
    """The simulator and ``prorsa plan`` hand the engines' states in the tick's input; the
    operator observes them as they are polled. Both decide the same."""
    decisions = []
    for inline in (True, False):
        log = EventLog()
        c = Controller(spec8())
        queue(log, 60, 10_000, 1.0)
        c.observe(log.take())
        states = engines(2, 6)
        if inline:
            d = c.tick(TickInput(now=2.0, engines=states))
        else:
            c.observe_engines(states)
            d = c.tick(TickInput(now=2.0))
        decisions.append(d)
    inline, observed = decisions
    assert inline.wire() == observed.wire()
    assert [(s.from_, s.to) for s in inline.switches] == [("decode", "prefill")]


def test_a_tick_input_is_frozen_and_a_bad_time_is_named() -> None:
    tick = TickInput(now=2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tick.now = 3.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="tick time must be finite"):
        Controller(spec8()).tick(TickInput(now=float("nan")))


def test_the_switch_plan_is_given_copies_not_views_of_the_controller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plan's contexts and cooldowns are values taken at the tick: what the Controller
    learns afterwards does not change what that tick's plan saw (they were a callable into
    the trajectory table and a view of the Controller's cooldowns)."""
    seen: list[PlanInputs] = []
    real = controller_module.plan_switches

    def spy(inputs: PlanInputs, **kw: Any):
        seen.append(inputs)
        return real(inputs, **kw)

    monkeypatch.setattr(controller_module, "plan_switches", spy)
    log = EventLog()
    c = Controller(spec8())
    for i in range(4):  # four live contexts whose last prefill ran on c-engine-0
        log("request_queued", f"x{i}", 1.0, prompt_tokens=5_000, turn=0)
        log("prefill_started", f"x{i}", 1.1, instance="c-engine-0")
        log("prefill_finished", f"x{i}", 1.2, instance="c-engine-0")
        log("decode_finished", f"x{i}", 1.3, output_tokens=10, finish="tool")
        log("tool_started", f"x{i}", 1.4)
    c.observe(log.take())
    c.record_switch("c-engine-7", at=0.0)  # cooling down until 30 s
    c.tick(TickInput(now=2.0, engines=engines(2, 6)))
    (inputs,) = seen
    contexts, cooldowns = dict(inputs.contexts), dict(inputs.cooldown_until)
    assert not callable(inputs.contexts)
    assert contexts == {"c-engine-0": 4 * 5_010} and cooldowns == {"c-engine-7": 30.0}
    # Later: the contexts end and another switch starts its cooldown.
    for i in range(4):
        log("trajectory_dropped", f"x{i}", 3.0)
    c.observe(log.take())
    c.record_switch("c-engine-6", at=4.0)
    assert c.table.live_contexts_by_instance() == {}
    assert dict(inputs.contexts) == contexts and dict(inputs.cooldown_until) == cooldowns


# -- sizing (Eq. 1) as a stage ---------------------------------------------------------------


def sizing_inputs(**override: Any) -> SizingInputs:
    fields: dict[str, Any] = {
        "now": 10.0,
        "horizon": 10.0,
        "demand": Demand(mode="predictive", a=6.0, b=2.0, forecast=Forecast()),
        "counts": RoleCounts(prefill=2, decode=6, unavailable=0, names=("p0", "p1")),
        "cache_floor": 0.0,
        "weight_update": False,
        "decode_share": 0.5,
        "spec": spec8(),
    }
    return SizingInputs(**(fields | override))


def test_sizing_solves_eq1_from_its_inputs_alone() -> None:
    smoother, share = DemandSmoother(seconds=0.0), DemandSmoother(seconds=300.0)
    sized = size(sizing_inputs(), smoother=smoother, share_smoother=share)
    s = sized.sizing
    assert (s.best.prefill, s.best.decode) == (6, 2)  # 64 GPUs, 8 per instance
    assert (s.a, s.b, s.budget, s.min_prefill, s.min_decode) == (6.0, 2.0, 64, 1, 1)
    # An unavailable instance leaves the budget of the other seven.
    down = RoleCounts(prefill=2, decode=5, unavailable=1, names=("p0", "p1"))
    s7 = size(sizing_inputs(counts=down), smoother=smoother, share_smoother=share).sizing
    assert s7.budget == 56 and s7.best.prefill + s7.best.decode == 7
    # Nothing usable: no split, and the margin says so.
    gone = RoleCounts(prefill=0, decode=0, unavailable=8, names=())
    s0 = size(sizing_inputs(counts=gone), smoother=smoother, share_smoother=share).sizing
    assert (s0.budget, s0.best.prefill, s0.best.decode) == (0, 0, 0)


def test_switches_are_priced_on_the_decode_load_that_stays_and_eq1_sizes_on_its_own() -> None:
    # b = 1.4: 0.8 of KV in use and 0.6 admitted within the horizon, by decodes that stay
    # 4% of it (a tool call's few tokens). Eq. 1 sizes on 1.4 as the paper has it; the
    # pricing sees 0.8 + 0.6 x 0.04. The same for the requests in decode: 40 of the 100
    # are queued for prefill, at 4% too.
    demand = Demand(
        mode="predictive",
        a=0.9,
        b=1.4,
        forecast=Forecast(),
        admitted=0.6,
        pending=40.0,
        resident=0.04,
        decoding=100.0,
    )
    spec = make_spec(
        engine={"gpusPerInstance": 8},
        capacity={
            "prefillTokensPerSecond": 10_000,
            "decodeKvTokens": 1_000_000,
            "decodeConcurrency": 100,
        },
        switching=PER_HORIZON,
    )
    counts = RoleCounts(prefill=1, decode=3, unavailable=4, names=("p0",))
    plain = DemandSmoother(seconds=0.0), DemandSmoother(seconds=300.0)
    s = size(
        sizing_inputs(demand=demand, counts=counts, spec=spec),
        smoother=plain[0],
        share_smoother=plain[1],
    ).sizing
    assert s.b == pytest.approx(1.4) and s.demand.b == pytest.approx(1.4)
    assert s.now_demand[1] == pytest.approx(0.8 + 0.6 * 0.04)
    assert s.ahead[1] == pytest.approx(0.8 + 0.6 * 0.04)
    assert s.knees == pytest.approx(1.0) and s.priced_knees == pytest.approx(0.6 + 0.4 * 0.04)
    # Admissions that decode for the whole horizon are priced as Eq. 1 counts them.
    long = dataclasses.replace(demand, resident=1.0)
    s1 = size(
        sizing_inputs(demand=long, counts=counts, spec=spec),
        smoother=plain[0],
        share_smoother=plain[1],
    ).sizing
    assert s1.now_demand[1] == pytest.approx(1.4) and s1.priced_knees == pytest.approx(1.0)


def test_sizing_returns_the_smoothers_it_learned_and_leaves_the_given_ones() -> None:
    smoother, share = DemandSmoother(seconds=60.0), DemandSmoother(seconds=300.0)
    first = size(sizing_inputs(), smoother=smoother, share_smoother=share)
    assert smoother == DemandSmoother(seconds=60.0)  # a value: the stage did not touch it
    assert first.smoother != smoother and first.smoother.at == 10.0
    # The next tick averages with what the first one returned; from the given smoother
    # again, it would see its demand alone.
    calm = Demand(mode="predictive", a=0.0, b=2.0, forecast=Forecast())
    later = sizing_inputs(now=20.0, demand=calm)
    smoothed = size(later, smoother=first.smoother, share_smoother=first.share_smoother)
    alone = size(later, smoother=smoother, share_smoother=share)
    assert 0.0 < smoothed.sizing.a < 6.0 and alone.sizing.a == 0.0


def test_a_weight_update_drops_the_prefix_cache_floor() -> None:
    smoother, share = DemandSmoother(seconds=0.0), DemandSmoother(seconds=0.0)
    floor = sizing_inputs(cache_floor=7.0)
    kept = size(floor, smoother=smoother, share_smoother=share).sizing
    assert kept.cache == 7.0 and kept.a == 7.0  # the caches need 7 prefill instances
    flushed = size(
        sizing_inputs(cache_floor=7.0, weight_update=True), smoother=smoother, share_smoother=share
    ).sizing
    assert flushed.cache == 0.0 and flushed.a == 6.0


# -- the switch plan hands back its memory ---------------------------------------------------


def plan_inputs(now: float, best: tuple[int, int]) -> PlanInputs:
    spec = spec8()
    demand = Demand(mode="predictive", a=6.0, b=2.0, forecast=Forecast())
    return PlanInputs(
        now=now,
        horizon=10.0,
        current=(2, 6),
        sizing=Sizing(
            demand=demand,
            a=6.0,
            b=2.0,
            cache=0.0,
            decode_share=0.5,
            now_demand=(6.0, 2.0),
            ahead=(6.0, 2.0),
            backlog=0.0,
            queued=0.0,
            knees=0.0,
            budget=64,
            min_prefill=1,
            min_decode=1,
            best=Allocation(*best, 0.0),
        ),
        engines=engines(2, 6),
        in_progress=0,
        cooldown_until={},
        contexts={},
        switch_seconds=13.0,
        abort_share=0.1,
        calibration=None,
        switching=spec.switching,
        capacity=spec.capacity,
        cache_scale=spec.engine.prefix_cache_scale,
    )


def test_a_lean_the_split_followed_leaves_the_payoff_horizon_as_it_was() -> None:
    # Eq. 1 leans to 6P:2D at 2P:6D; 60 s later the split is there (the switches counted
    # as their destination): the lean is gone because the split followed it, not because
    # demand turned, so the payoff horizon stays (issue 34).
    lean = plan_switches(
        plan_inputs(100.0, (6, 2)), persistence=Persistence(seconds=300.0), regret=Regret()
    )
    there = dataclasses.replace(plan_inputs(160.0, (6, 2)), current=(6, 2), engines=engines(6, 2))
    followed = plan_switches(there, persistence=lean.persistence, regret=lean.regret)
    assert followed.persistence.toward is None
    assert followed.persistence.seconds == 300.0


def test_the_switch_plan_returns_its_memory_and_leaves_the_given_one() -> None:
    persistence, regret = Persistence(seconds=300.0), Regret()
    lean = plan_switches(plan_inputs(100.0, (6, 2)), persistence=persistence, regret=regret)
    assert persistence == Persistence(seconds=300.0) and regret == Regret()
    assert lean.persistence.toward == "prefill" and lean.persistence.since == 100.0
    assert lean.target == Target(prefill=6, decode=2) and lean.switches  # it pays
    # The lean turns 60 s later: one run of 60 s measured, from the memory handed back.
    turned = plan_switches(
        plan_inputs(160.0, (1, 7)), persistence=lean.persistence, regret=lean.regret
    )
    assert turned.persistence.seconds == pytest.approx(300.0 + 0.3 * (60.0 - 300.0))
    # The same inputs and memory give the same plan: planning changes nothing it read.
    again = plan_switches(
        plan_inputs(160.0, (1, 7)), persistence=lean.persistence, regret=lean.regret
    )
    assert again == turned


# -- θ_P ---------------------------------------------------------------------------------------


def test_theta_is_read_from_the_fold_and_reading_it_changes_nothing() -> None:
    meter = PrefillSpeedMeter(profiled=10_000.0, hit_window=60.0)
    agent = {"instance": "c-engine-0", "role": "prefill", "kvCapacityTokens": 1_000_000}
    meter.observe_engine(EngineState.model_validate(agent | {"prefillTokens": 0}))
    meter.observe_engine(EngineState.model_validate(agent | {"prefillTokens": 2_500}))
    # The trainer prefilled 10,000 full-prompt tokens; the agent computed 2,500 of them:
    # miss ratio 1/4, θ_P four times the profiled speed of computed tokens.
    reading = meter.fold(10.0, prefilled=10_000.0, expected=2_500.0)
    assert reading.miss_ratio == 0.25 and reading.theta == 40_000.0
    assert reading.calibration == 1.0 and reading.recomputed == 0.0
    # Nothing new since: the next tick reads the same window.
    assert meter.fold(12.0, prefilled=10_000.0, expected=2_500.0) == reading


def test_only_forecast_arrivals_queue_engine_queues_alone_do_not() -> None:
    # 1P:3D, the prefill instance 90% busy, decode holding 0.8 instances: Eq. 1 asks for
    # 2P:2D. From the forecast, the 0.9 are arrivals that recur, and a prompt queues 4.5
    # prefill times behind them (M/D/1): the move pays. Read from engine queues alone
    # (reactive mode) the same 0.9 is a backlog that may not recur, and no queueing is
    # priced: the move only slows decode, and the split holds.
    def plan(mode: str) -> tuple[int, ...]:
        spec = make_spec(
            engine={"gpusPerInstance": 8},
            capacity={"prefillTokensPerSecond": 10_000, "decodeKvTokens": 1_000_000},
            switching=PER_HORIZON | {"cooldownSeconds": 30, "maxConcurrent": 1},
        )
        demand = Demand(mode=mode, a=0.9, b=0.8, forecast=Forecast())  # type: ignore[arg-type]
        inputs = plan_inputs(100.0, (2, 2))
        sizing = dataclasses.replace(
            inputs.sizing,
            demand=demand,
            a=0.9,
            b=0.8,
            now_demand=(0.9, 0.8),
            ahead=(0.9, 0.8),
            budget=32,
        )
        four = dataclasses.replace(
            inputs,
            current=(1, 3),
            sizing=sizing,
            engines=engines(1, 3),
            switching=spec.switching,
            capacity=spec.capacity,
        )
        out = plan_switches(four, persistence=Persistence(seconds=300.0), regret=Regret())
        return (out.target.prefill, len(out.switches))

    assert plan("predictive") == (2, 1)
    assert plan("reactive") == (1, 0)
