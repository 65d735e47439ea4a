"""Policies under test: the real Controller behind the executor, the oracle, the baselines."""

from __future__ import annotations

import contextlib
import math
import typing

import pytest

from prorsa.core.controller import Controller
from prorsa.core.types import TickInput
from prorsa_contract import events as ev
from prorsa_contract.agent_api import EngineState
from prorsa_lab.sim.engine import COLOCATED, DECODE, PREFILL, SimRequest
from prorsa_lab.sim.loop import SimulationError
from prorsa_lab.sim.policies import (
    Colocation,
    Oracle,
    Prorsa,
    Reactive,
    Static,
    Throughput,
    baseline,
)
from prorsa_lab.sim.simulator import Scenario, Simulation, simulate

EVENT_CLASSES = typing.get_args(typing.get_args(ev.Event)[0])


def scenario(**kw: object) -> Scenario:
    base: dict[str, object] = {
        "model": "qwen3-235b",
        "task": "general",
        "staleness": 2,
        "steps": 2,
        "groups_per_step": 1,
    }
    base.update(kw)
    return Scenario(**base)  # type: ignore[arg-type]


class _PerHorizon(Prorsa):
    """The Controller with ``switching.stepCycle`` off: Eq. 1 on each horizon's demand."""

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        switching = sim.spec.switching.model_copy(update={"step_cycle": False})
        self.controller.apply_spec(sim.spec.model_copy(update={"switching": switching}))


def test_prorsa_runs_the_real_controller_on_contract_bodies_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, int] = {"events": 0, "states": 0, "ticks": 0, "recorded": 0}
    real_observe, real_engines = Controller.observe, Controller.observe_engines
    real_tick, real_record = Controller.tick, Controller.record_switch

    def observe(self: Controller, events: typing.Any) -> typing.Any:
        events = list(events)
        assert all(isinstance(e, EVENT_CLASSES) for e in events)
        seen["events"] += len(events)
        return real_observe(self, events)

    def observe_engines(self: Controller, states: typing.Any) -> None:
        states = list(states)
        assert states and all(type(s) is EngineState for s in states)
        assert {s.instance for s in states} == {f"sim-engine-{i}" for i in range(8)}
        seen["states"] += 1
        real_engines(self, states)

    def tick(self: Controller, tick: TickInput) -> typing.Any:
        seen["ticks"] += 1
        return real_tick(self, tick)

    def record_switch(self: Controller, instance: str, **kw: typing.Any) -> None:
        assert instance.startswith("sim-engine-") and set(kw) == {"at"}
        seen["recorded"] += 1
        real_record(self, instance, **kw)

    monkeypatch.setattr(Controller, "observe", observe)
    monkeypatch.setattr(Controller, "observe_engines", observe_engines)
    monkeypatch.setattr(Controller, "tick", tick)
    monkeypatch.setattr(Controller, "record_switch", record_switch)
    # Per-horizon planning (Eq. 1's rule, not the step-scale target), so that this short
    # run switches and the wiring is exercised.
    busy = scenario(staleness=8, groups_per_step=2, smoothing=0.0, hysteresis=0.1)
    sim = Simulation(busy, _PerHorizon(), emit_events=True)
    result = sim.run()
    # Every emitted event reached the Controller, except those after its last tick.
    assert seen["events"] + len(sim.trainer.outbox) == result.events
    assert len(sim.trainer.outbox) < 3 * result.events / seen["ticks"]  # about one horizon's
    assert seen["ticks"] == seen["states"] == result.extra["ticks"]
    assert seen["ticks"] >= result.makespan // 10 - 1  # one tick per horizon S = 10 s
    assert seen["recorded"] == result.switches > 0  # each executed switch was reported
    assert result.extra["anomalies"] == 0
    assert result.wape_prefill is not None and result.controller_accuracy is not None


def test_oracle_is_the_controller_fed_the_true_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    import prorsa.core.controller as controller
    import prorsa.core.sizing as sizing

    calls: list[tuple[float, float, dict[str, typing.Any]]] = []
    real = sizing.solve

    def solve(a: float, b: float, **kw: typing.Any) -> typing.Any:
        calls.append((a, b, kw))
        return real(a, b, **kw)

    monkeypatch.setattr(sizing, "solve", solve)  # Eq. 1, in the sizing stage
    oracle = Oracle()
    result = simulate(scenario(task="coding", smoothing=0.0, hysteresis=0.1), oracle)
    # The shipped Controller plans it; only the demand source is the simulator's truth.
    assert type(oracle.controller) is controller.Controller
    assert oracle.controller.demand_source == oracle.true_demand
    assert calls and all(a >= 0 and b >= 0 for a, b, _ in calls)
    assert calls[0][2] == {
        "budget": 64,
        "m_prefill": 8,
        "m_decode": 8,
        "min_prefill": 1,
        "min_decode": 1,
        # Every engine starts as decode, as the operator's do: the first tick sees none
        # prefilling and bootstraps the cluster to roles.prefill.initial (2 here).
        "current_prefill": 0,
    }
    assert any(kw["current_prefill"] == 2 for _, _, kw in calls[1:])
    assert math.isfinite(result.makespan)
    assert result.wape_prefill is not None  # its "forecast" is the truth, up to routing


def test_oracle_demand_counts_the_queue_and_known_arrivals() -> None:
    sim = Simulation(scenario(task="coding"), Oracle())
    sim.policy.attach(sim)
    assert sim.policy.demand(0.0)[:3] == (0.0, 0.0, 0.0)  # type: ignore[attr-defined]
    sim.trainer.start()  # 64 sandboxes starting; prewarmed ones come back within S
    a, b, w_p, adm, _waiting, _decoding = sim.policy.demand(0.0)  # type: ignore[attr-defined]
    soon = sum(
        x
        for t in sim.trainer.live.values()
        if t.next_arrival
        for at, x in [t.next_arrival]
        if at < 10.0
    )
    assert w_p == soon > 0 and a > 0 and b > 0 and 0 < adm <= w_p


def test_oracle_counts_queued_prefill_as_work_not_as_requests() -> None:
    # Prompts already queued at a prefill engine stay there (the Controller's pinned load):
    # the oracle reports them in instance-seconds of prefill work, like the forecast does.
    sim = Simulation(scenario(task="coding"), Oracle())
    sim.policy.attach(sim)
    sim.trainer.start()
    queued_requests = tokens = 0
    now = 0.0
    while queued_requests < 4 and now < 600.0:  # until a wave queues at the prefill side
        now += 2.0
        with contextlib.suppress(SimulationError):
            sim.loop.run(until=now)
        ranks = [r for i in sim.cluster.instances if i.role == "prefill" for r in i.ranks]
        queued_requests = sum(1 for r in ranks for q in r.pq if not q.silent)
        tokens = sum(q.prompt - q.done for r in ranks for q in r.pq if not q.silent)
    assert queued_requests >= 4 and tokens > 0
    *_, (queued, _waiting), _decoding = sim.policy.demand(now)  # type: ignore[attr-defined]
    lone = sim.profile.prefill_seconds(sim.profile.chunk, 0) / sim.profile.chunk
    work = tokens * lone / sim.profile.ranks
    assert queued == pytest.approx(work, rel=0.5)
    assert queued != pytest.approx(queued_requests / sim.profile.ranks, rel=0.1)


def test_oracle_knows_when_decoding_trajectories_come_back_from_their_tools() -> None:
    # The oracle reads each decoding turn's script (output left, tool time): the prefill
    # demand it feeds the solver is the demand the next horizon then measures (reading only
    # the tool returns already under way, it measured 40-60% WAPE).
    result = simulate(scenario(groups_per_step=4), Oracle())
    assert result.wape_prefill is not None and result.wape_prefill < 0.15


def test_oracle_keeps_the_controllers_prefix_cache_floor() -> None:
    sim = Simulation(scenario(task="coding"), Oracle())
    sim.policy.attach(sim)
    sim.trainer.start()
    with contextlib.suppress(SimulationError):  # stop the clock two minutes in
        sim.loop.run(until=120.0)
    returning = [t for t in sim.trainer.live.values() if t.state in ("ready", "decode", "tool")]
    assert returning
    need = sum(t.context for t in returning) + sum(
        t.context for t in sim.trainer.live.values() if t.state == "prefill"
    )
    floor = sim.policy.cache_demand()  # type: ignore[attr-defined]
    # The HiCache host tier holds a copy of the GPU cache (write-through): the larger of two.
    per = sim.spec.capacity.prefill_cache_tokens
    assert per == int(sim.profile.kv_capacity * max(1.0, sim.scenario.hicache_ratio))
    assert floor == pytest.approx(need / (0.8 * per))


def test_colocation_and_static_roles() -> None:
    sim = Simulation(scenario(), Colocation())
    assert [i.role for i in sim.cluster.instances] == [COLOCATED] * 8
    sim = Simulation(scenario(), Static(3))
    assert [i.role for i in sim.cluster.instances] == [PREFILL] * 3 + [DECODE] * 5
    with pytest.raises(ValueError):
        Simulation(scenario(), Static(8))
    assert isinstance(baseline("static-5P"), Static) and baseline("static-5P").prefill == 5
    with pytest.raises(ValueError, match="unknown policy"):
        baseline("magic")


class _Quiet:
    def on_prefill_started(self, *_a: object) -> None: ...
    def on_prefill_finished(self, *_a: object) -> None: ...
    def on_decode_finished(self, *_a: object) -> None: ...
    def on_aborted(self, *_a: object) -> None: ...


def test_reactive_moves_one_instance_toward_the_congested_role() -> None:
    sim = Simulation(scenario(), Reactive())
    pol = sim.policy
    pol.attach(sim)
    cl = sim.cluster
    cl.listener = _Quiet()
    # Queued prefill tokens on one engine reach the context length: one decode -> prefill.
    for i in range(12):
        cl.submit(SimRequest(rid=f"r{i}", traj=f"t{i}", turn=0, prompt=30_000, new_tokens=1))
    assert max(i.load_tokens() for i in cl.instances if i.role == PREFILL) >= 131_072
    pol.tick(5.0)  # type: ignore[attr-defined]
    assert cl.role_counts()[2] == 1
    target = next(i for i in cl.instances if i.switch is not None)
    assert target.role == DECODE and target.switch.to == PREFILL  # type: ignore[union-attr]
    pol.tick(10.0)  # type: ignore[attr-defined]
    assert cl.role_counts()[2] == 1  # nothing new while a change is pending


def test_throughput_planner_splits_by_rate_times_length() -> None:
    sim = Simulation(scenario(), Throughput(interval=180.0))
    pol = sim.policy
    pol.attach(sim)
    p = sim.profile
    stats = sim.trainer.stats
    # A prefill-heavy interval: long prompts, short outputs.
    stats.arrivals.extend((t, 40_000) for t in range(0, 180, 1))
    stats.outputs.extend((t, 50) for t in range(0, 180, 1))
    n_p = math.ceil(40_000 / p.prefill_tokens_per_second)
    n_d = math.ceil(50 / p.decode_tokens_per_second(context=40_000))
    expect = min(max(round(8 * n_p / (n_p + n_d)), 1), 7)
    pol.tick(180.0)  # type: ignore[attr-defined]
    p_now, _d, switching = sim.cluster.role_counts()
    assert expect > 2 and switching == expect - 2 and p_now == 2


def test_runs_are_deterministic() -> None:
    a = simulate(scenario(task="coding"), Prorsa())
    b = simulate(scenario(task="coding"), Prorsa())
    assert a.makespan == b.makespan and a.timeline == b.timeline and a.windows == b.windows


class _Zero:
    """Predicts no demand at all: its WAPE must be exactly 100%."""

    name = "zero"

    def initial_roles(self, sim: Simulation) -> list[str]:
        return [PREFILL] * 4 + [DECODE] * 4

    def attach(self, sim: Simulation) -> None:
        sim.loop.every(10.0, lambda now: sim.record_prediction(now, prefill=0, decode=0))


def test_wape_is_measured_against_ground_truth_windows() -> None:
    result = simulate(scenario(), _Zero())  # type: ignore[arg-type]
    assert result.wape_prefill == pytest.approx(1.0) and result.wape_decode == pytest.approx(1.0)
    assert result.windows and all(w[2] >= 0 and w[4] >= 0 for w in result.windows)
    assert sum(w[2] for w in result.windows) > 0


def test_a_run_that_cannot_finish_is_reported_as_such() -> None:
    result = simulate(scenario(task="coding", time_limit=60.0), Static(1))
    assert math.isinf(result.makespan)


def test_prompts_a_paused_trainer_holds_are_prefill_demand_still_to_be_routed() -> None:
    # During a weight update that takes time the trainer holds the interrupted generations
    # until it ends: the measured demand of a window counts them as queued, and the oracle
    # reports them as work the router will send wherever prefill capacity is then.
    sim = Simulation(scenario(task="math", weight_update_seconds=12.0), Oracle())
    seen: list[tuple[float, float, float]] = []

    def mid_update(now: float) -> None:
        def look() -> None:
            held = sum(r.prompt for r in sim.trainer.held)
            sim.record_prediction(now + 1.0, prefill=0.0, decode=0.0)
            *_, (_queued, waiting), _d = sim.policy.demand(now + 1.0)  # type: ignore[attr-defined]
            seen.append((held, sim.predictions[-1].backlog, waiting))

        sim.loop.after(1.0, look)

    sim.trainer.on_update_started.append(mid_update)
    sim.run()
    (held, backlog, waiting), *_ = seen
    assert held > 0 and backlog >= held
    lone = sim.profile.prefill_seconds(sim.profile.chunk, 0) / sim.profile.chunk
    assert waiting >= held * lone / sim.profile.ranks * 0.99


def test_the_trainer_waits_for_ready_so_no_prompt_waits_for_a_prefill_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """smg 1.13.0 refuses every request (503) while it lists no prefill worker
    (tests/test_smg_router_no_prefill.py); the simulated trainer waits for Ready, as users
    are told to, instead of queueing prompts at a router that would hand them all to the
    first prefill engine listed."""
    from prorsa_lab.sim.engine import SimCluster

    unrouted: list[float] = []
    first: list[str] = []  # where the first prompts went
    real_route = SimCluster._route_prefill

    def route(self: SimCluster, req: SimRequest) -> None:
        if not self._prefill_insts:
            unrouted.append(self.loop.now)
        real_route(self, req)
        if len(first) < 20 and req.inst is not None:
            first.append(req.inst.name)

    monkeypatch.setattr(SimCluster, "_route_prefill", route)
    sim = Simulation(scenario(task="coding"), Prorsa(), emit_events=True)
    result = sim.run()
    start = sim.trainer_started_at
    assert start is not None and math.isfinite(result.makespan)
    # Not before the bootstrap's flips are done and listed: from the first tick (at 0 s, the
    # operator woken by the engines turning Ready), smg's drop (6 s), the flip (5 s) and its
    # listing (2 s), seen at the next periodic tick (20 s).
    assert start == 20.0
    assert not unrouted
    # Both initial prefill engines took the first prompts, not the first one listed alone.
    assert len(set(first)) == 2


def test_baselines_serve_from_the_start_and_their_trainer_does_not_wait() -> None:
    sim = Simulation(scenario(task="coding"), Static(prefill=2))
    result = sim.run()
    assert sim.trainer_started_at == 0.0 and math.isfinite(result.makespan)
    colocated = Simulation(scenario(task="coding"), Colocation())
    assert math.isfinite(colocated.run().makespan) and colocated.trainer_started_at == 0.0
