"""The Controller end to end: events + engine states + now -> Decision."""

from __future__ import annotations

import json
import re

import pytest
from conftest import EventLog, make_spec
from hypothesis import given, settings
from hypothesis import strategies as st

from prorsa.core.allocate import Allocation
from prorsa.core.controller import Controller
from prorsa.core.decision import Decision, Forecast, Target
from prorsa.core.demand import forecast_demand
from prorsa.core.diagnostics import Diagnostics
from prorsa.core.forecast.config import ForecastConfig
from prorsa.core.forecast.model import Forecaster
from prorsa.core.forecast.table import TrajectoryTable
from prorsa.core.forecast.view import DecodeBacklog
from prorsa.core.measure import decode_backlog
from prorsa.core.switch_cost import Persistence, Regret
from prorsa.core.switch_plan import lost_tokens, plan_switches
from prorsa.core.types import Demand, DemandInputs, PlanInputs, Sizing, TickInput
from prorsa_contract.agent_api import EngineState


def seen(c: Controller) -> Diagnostics:
    """The diagnostics the last tick handed out with its Decision."""
    d = c.last_decision
    assert d is not None and d.diagnostics is not None
    return d.diagnostics


DECISION_KEYS = {
    "at",
    "mode",
    "target",
    "safetyMargin",
    "forecast",
    "capacity",
    "switches",
    "reason",
}
FORECAST_KEYS = {"prefillTokens", "decodeAdmissionTokens", "decodeKvTokens", "components"}
COMPONENT_KEYS = {"sampler", "startup", "ready", "tool", "inflight"}


def engines(prefill: int, decode: int, **overrides) -> list[EngineState]:
    out = []
    for i in range(prefill + decode):
        name = f"c-engine-{i}"
        body = {
            "instance": name,
            "role": "prefill" if i < prefill else "decode",
            "kvCapacityTokens": 1_000_000,
            "kvUsedTokens": 100_000,
            "runningRequests": 10 + i,
        } | overrides.get(name, {})
        out.append(EngineState.model_validate(body))
    return out


# These tests check the rule of each horizon: no demand smoothing, and the light
# hysteresis the arithmetic in them assumes (the defaults are tested on their own below).
PER_HORIZON = {"smoothingSeconds": 0, "hysteresis": 0.1, "stepCycle": False}


def spec8(**switching):
    return make_spec(
        engine={"gpusPerInstance": 8},
        capacity={"prefillTokensPerSecond": 10_000, "decodeKvTokens": 1_000_000},
        switching=PER_HORIZON | {"cooldownSeconds": 30, "maxConcurrent": 1} | switching,
    )


def queue(log: EventLog, n: int, tokens: int, ts: float, prefix: str = "t") -> None:
    for i in range(n):
        log("request_queued", f"{prefix}{i}", ts, prompt_tokens=tokens, turn=0)


def test_decision_has_exactly_the_contract_keys(log) -> None:
    c = Controller(spec8())
    queue(log, 3, 1000, 1.0)
    c.observe(log.take())
    wire = c.tick(TickInput(now=2.0)).wire()
    assert set(wire) == DECISION_KEYS
    assert set(wire["forecast"]) == FORECAST_KEYS
    assert set(wire["forecast"]["components"]) == COMPONENT_KEYS
    assert set(wire["capacity"]) == {"prefillTokensPerSecond", "decodeKvTokens"}
    json.dumps(wire)


def test_prefill_heavy_demand_flips_the_least_loaded_decode_instance(log) -> None:
    c = Controller(spec8())
    # 600k tokens queued that no prefill engine holds yet (a router-side queue, which forms
    # only when prefill cannot keep up): 600k / (10 s · 10k tok/s) = 6 instances of demand.
    queue(log, 60, 10_000, 1.0)
    c.observe(log.take())
    busy = {f"c-engine-{i}": {"runningRequests": 50} for i in range(2, 8)}
    busy["c-engine-6"] = {"runningRequests": 1}
    c.observe_engines(engines(2, 6, **busy))
    d = c.tick(TickInput(now=2.0))
    assert d.mode == "predictive"
    assert d.target.prefill > 2
    assert [(s.instance, s.from_, s.to) for s in d.switches] == [
        ("c-engine-6", "decode", "prefill")
    ]  # maxConcurrent = 1: one at a time, the least loaded first
    assert "best margin" in d.reason


def test_prompts_waiting_for_decode_room_ask_for_decode_not_prefill(log) -> None:
    """A streaming trainer behind a PD router sees a request's first token only once decode
    has admitted it. With the decode side full, the prompts decode holds for KV room stay
    in the trainer's prefill set horizon after horizon: decode demand, not prefill."""
    c = Controller(spec8())
    for i in range(40):  # 40 prompts of 20k sent 19 s ago, no first token yet
        log("request_queued", f"w{i}", 1.0, prompt_tokens=20_000, turn=0)
        log("prefill_started", f"w{i}", 1.0)
    c.observe(log.take())
    # Each decode engine full, with 10 of the prompts (200k tokens) waiting for KV room.
    full = {"kvUsedTokens": 1_000_000, "waitingRequests": 10, "waitingTokens": 200_000}
    c.observe_engines(engines(4, 4, **{f"c-engine-{i}": full for i in range(4, 8)}))
    d = c.tick(TickInput(now=20.0))
    # All 40 wait at decode: no prefill demand left, and K_D counts their 800k tokens.
    assert d.forecast.components.inflight == 0
    assert d.forecast.decode_kv_tokens == 4 * 1_000_000 + 40 * 20_000
    assert d.target.decode > 4
    assert [(s.from_, s.to) for s in d.switches] == [("prefill", "decode")]


def test_prompts_waiting_for_their_prefill_stay_prefill_demand(log) -> None:
    """Decode engines also count the requests whose KV has not come from prefill yet
    (SGLang's transfer queue); those wait for prefill, and stay its demand."""
    c = Controller(spec8())
    queue(log, 40, 20_000, 1.0)
    for i in range(40):
        log("prefill_started", f"t{i}", 1.0)
    c.observe(log.take())
    room = {"waitingRequests": 10, "waitingTokens": 0}  # no prompt waits for KV room
    c.observe_engines(engines(4, 4, **{f"c-engine-{i}": room for i in range(4, 8)}))
    d = c.tick(TickInput(now=20.0))
    assert d.forecast.components.inflight == 40 * 20_000
    assert d.target.prefill >= 4


def test_only_a_trainer_blind_to_prefill_ends_has_prompts_waiting_in_prefill(log) -> None:
    """Decode holds 6 requests, 4 of them waiting. A trainer that reports each prefill's
    end already counts all 6 as decoding; one that sees first tokens only has seen 2
    start and still counts the 4 waiting among its prompts in prefill."""
    decode = [
        EngineState(
            instance="d", role="decode", runningRequests=2, waitingRequests=4, waitingTokens=400
        )
    ]
    for reports_ends, expected in ((True, 0), (False, 4)):
        table = TrajectoryTable(observer=Forecaster(ForecastConfig()))
        for i in range(8):
            log("request_queued", f"r{i}", 1.0, prompt_tokens=100, turn=0)
            log("prefill_started", f"r{i}", 1.0)
            if i < (6 if reports_ends else 2):
                log("prefill_finished", f"r{i}", 2.0)
        table.apply(log.take())
        assert decode_backlog(decode, table) == DecodeBacklog(requests=expected, tokens=400)


def test_switch_in_progress_is_not_planned_twice_and_limits_concurrency(log) -> None:
    c = Controller(spec8())
    queue(log, 60, 10_000, 1.0)
    c.observe(log.take())
    c.observe_engines(engines(2, 6))
    first = c.tick(TickInput(now=2.0)).switches[0].instance
    # The executor reports the switch as started (intent written).
    states = engines(2, 6, **{first: {"switching": True}})
    c.observe_engines(states)
    d = c.tick(TickInput(now=3.0))
    assert d.switches == ()  # maxConcurrent = 1 is taken by the running switch
    c.observe_engines(engines(2, 6, **{first: {"role": "prefill"}}))
    c.record_switch(first, at=8.0)
    nxt = c.tick(TickInput(now=9.0)).switches
    assert nxt and nxt[0].instance != first  # cooldown keeps the fresh one out


def test_a_switch_resumed_after_an_operator_restart_counts_as_its_destination(log) -> None:
    # A fresh Controller (the operator restarted) finds c-engine-0 mid-switch to prefill,
    # the only prefill instance to be. Counted as unavailable, prefill would be below its
    # minimum and a second decode instance would be switched to prefill as well.
    spec = spec8(maxConcurrent=2)
    states = engines(0, 4, **{"c-engine-0": {"switching": True}})
    fresh = Controller(spec)
    fresh.observe_engines(states)
    assert [s.to for s in fresh.tick(TickInput(now=2.0)).switches] == ["prefill"]  # what went wrong

    c = Controller(spec)
    c.resume_switch("c-engine-0", to="prefill")
    c.observe_engines(states)
    d = c.tick(TickInput(now=2.0))
    assert d.switches == () and d.target.prefill == 1, d.reason


def test_a_missed_state_read_does_not_end_a_resumed_switch(log) -> None:
    # Right after an operator restart the agent of the resumed switch is the busiest one
    # (draining, flipping, verifying) and may miss a /v1/state read. A missed read says
    # nothing about the switch: the instance still counts as its destination, that tick
    # and the next, and no second decode instance is switched toward prefill.
    spec = spec8(maxConcurrent=2)
    states = engines(0, 4, **{"c-engine-0": {"switching": True}})
    c = Controller(spec)
    c.resume_switch("c-engine-0", to="prefill")
    c.observe_engines(states[1:])  # c-engine-0's agent did not answer this tick
    d = c.tick(TickInput(now=2.0))
    assert d.switches == () and d.target.prefill == 1, d.reason
    c.observe_engines(states)  # it answers again, still switching
    d = c.tick(TickInput(now=3.0))
    assert d.switches == () and d.target.prefill == 1, d.reason
    # Once the switch has ended, a missed read is an unavailable instance again.
    c.observe_engines(engines(1, 3))
    c.record_switch("c-engine-0", at=4.0)
    c.observe_engines(engines(1, 3)[1:])
    d = c.tick(TickInput(now=5.0))
    assert d.target.prefill + d.target.decode == 3, d.reason


def test_a_missed_state_read_does_not_end_a_switch_this_controller_started(log) -> None:
    c = Controller(spec8())
    queue(log, 60, 10_000, 1.0)
    c.observe(log.take())
    c.observe_engines(engines(2, 6))
    first = c.tick(TickInput(now=2.0)).switches[0].instance
    # The switching instance's agent misses a read: maxConcurrent = 1 is still taken.
    c.observe_engines([s for s in engines(2, 6) if s.instance != first])
    assert c.tick(TickInput(now=3.0)).switches == ()
    c.observe_engines(engines(2, 6, **{first: {"switching": True}}))
    assert c.tick(TickInput(now=4.0)).switches == ()


def test_cooldown_excludes_recently_switched_instances(log) -> None:
    c = Controller(spec8(cooldownSeconds=100))
    queue(log, 60, 10_000, 1.0)
    c.observe(log.take())
    c.observe_engines(engines(7, 1))
    # Demand now wants decode; the only flippable prefill instances all just switched.
    for i in range(7):
        c.record_switch(f"c-engine-{i}", at=1.0)
    c2_states = engines(1, 7, **{f"c-engine-{i}": {"kvUsedTokens": 990_000} for i in range(1, 8)})
    c.observe_engines(c2_states)
    assert all(s.instance != "c-engine-0" for s in c.tick(TickInput(now=50.0)).switches)


def test_role_minimums_are_never_violated(log) -> None:
    spec = make_spec(
        engine={"gpusPerInstance": 8},
        roles={"prefill": {"min": 1}, "decode": {"min": 3}},
        capacity={"prefillTokensPerSecond": 1000, "decodeKvTokens": 1_000_000},
        switching=PER_HORIZON | {"maxConcurrent": 8},
    )
    c = Controller(spec)
    queue(log, 100, 100_000, 1.0)  # enormous prefill demand
    c.observe(log.take())
    c.observe_engines(engines(4, 4))
    d = c.tick(TickInput(now=2.0))
    assert (d.target.prefill, d.target.decode) == (5, 3)
    assert len(d.switches) == 1 and d.safety_margin < 0
    assert "over budget" in d.reason


@pytest.mark.parametrize(("hysteresis", "expected"), [(0.5, (3, 5)), (0.0, (2, 6))])
def test_hysteresis_holds_the_split_under_small_changes(log, hysteresis, expected) -> None:
    c = Controller(spec8(hysteresis=hysteresis, maxConcurrent=8))
    # a = 50k / (10 s · 10k tok/s) = 0.5; b = (5 · 1.2M used + 50k admitted) / 1M = 6.05.
    # 3P:5D: min(3/0.5, 5/6.05) = 0.83; Eq. 1's best, 1P:7D: min(1/0.5, 7/6.05) = 1.16,
    # 40% more headroom. Without hysteresis the pricing makes the first move (the decode
    # side is 21% over its KV) and holds the second: one prefill instance half busy would
    # queue every turn's prompt (M/D/1), and the table sees only prefill (decode share 0).
    # (Until issue 34 the pricing counted no queueing below capacity, and this test moved
    # a = 2 onto two prefill instances, 100% busy, as a 4% gain.)
    queue(log, 5, 10_000, 1.0)
    c.observe(log.take())
    full = {f"c-engine-{i}": {"kvUsedTokens": 1_200_000} for i in range(3, 8)}
    c.observe_engines(engines(3, 5, **full))
    d = c.tick(TickInput(now=2.0))
    assert d.forecast.decode_kv_tokens == 6_050_000
    assert (d.target.prefill, d.target.decode) == expected
    assert len(d.switches) == 3 - expected[0]
    if hysteresis:
        assert "hysteresis" in d.reason


def test_reactive_mode_without_trainer_events() -> None:
    c = Controller(spec8())
    states = engines(
        2, 6, **{"c-engine-0": {"waitingTokens": 500_000}, "c-engine-1": {"waitingTokens": 500_000}}
    )
    c.observe_engines(states)
    d = c.tick(TickInput(now=100.0))
    assert d.mode == "reactive" and "no trainer events" in d.reason
    assert d.forecast.components.ready == 1_000_000
    assert d.target.prefill > 2 and d.switches


def test_stale_trainer_falls_back_to_reactive(log) -> None:
    c = Controller(spec8())
    queue(log, 5, 1000, 1.0)
    c.observe(log.take())
    c.observe_engines(engines(2, 6))
    assert c.tick(TickInput(now=25.0)).mode == "predictive"  # 24 s < 3 horizons
    d = c.tick(TickInput(now=40.0))
    assert d.mode == "reactive" and "silent for 39s" in d.reason


def test_no_inputs_at_all_holds_the_initial_split() -> None:
    c = Controller(spec8())
    d = c.tick(TickInput(now=0.0))
    assert d.mode == "reactive" and d.switches == ()
    assert (d.target.prefill, d.target.decode) == (2, 6)  # a quarter of 8 instances


def test_unhealthy_and_missing_engines_are_unavailable(log) -> None:
    c = Controller(spec8(maxConcurrent=8))
    queue(log, 60, 10_000, 1.0)
    c.observe(log.take())
    states = engines(2, 6, **{"c-engine-5": {"healthy": False}})[:-1]  # engine-7 missing
    c.observe_engines(states)
    d = c.tick(TickInput(now=2.0))
    assert d.target.prefill + d.target.decode == 6
    assert all(s.instance not in ("c-engine-5", "c-engine-7") for s in d.switches)


def test_prefill_speed_learned_from_engine_counters(log) -> None:
    c = Controller(spec8())
    c.observe_engines(
        engines(2, 6, **{"c-engine-0": {"prefillBusySeconds": 10.0, "prefillTokens": 100_000}})
    )
    c.observe_engines(
        engines(2, 6, **{"c-engine-0": {"prefillBusySeconds": 14.0, "prefillTokens": 200_000}})
    )
    assert c.tick(TickInput(now=1.0)).capacity.prefill_tokens_per_second == pytest.approx(25_000)


def test_prefill_speed_learned_from_events_when_engines_say_nothing(log) -> None:
    c = Controller(spec8())
    for i in range(2):
        log("request_queued", f"a{i}", 0.0, prompt_tokens=30_000, turn=0)
        log("prefill_started", f"a{i}", 1.0, instance="c-engine-0")
    log("prefill_finished", "a0", 2.0)
    log("prefill_finished", "a1", 3.0)  # one busy interval: 60k tokens over 2 s
    c.observe(log.take())
    assert c.tick(TickInput(now=4.0)).capacity.prefill_tokens_per_second == pytest.approx(30_000)


def script(seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    log = EventLog()
    for i in range(40):
        t = f"t{i}"
        ts = rng.uniform(0, 5)
        log("sample_dispatched", t, ts, task=rng.choice(["a", "b"]), group=f"g{i % 4}")
        log("sandbox_started", t, ts + 0.5, mode=rng.choice(["prewarm", "cold"]))
        log("request_queued", t, ts + 2, prompt_tokens=rng.randint(100, 9000), turn=0)
        if rng.random() < 0.7:
            log("prefill_started", t, ts + 3, instance=f"c-engine-{rng.randint(0, 1)}")
            log("prefill_finished", t, ts + 4)
            log(
                "decode_finished",
                t,
                ts + 9,
                output_tokens=rng.randint(1, 900),
                finish=rng.choice(["tool", "stop"]),
            )
    return log.raw


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), at=st.floats(10, 60))
def test_replaying_the_same_events_gives_the_same_decision(seed: int, at: float) -> None:
    from prorsa_contract.events import parse_events

    raw = script(seed)
    wires = []
    for _ in range(2):
        c = Controller(spec8())
        c.observe(parse_events(raw))
        c.observe_engines(engines(2, 6))
        wires.append(json.dumps(c.tick(TickInput(now=at)).wire(), sort_keys=True))
    assert wires[0] == wires[1]


@settings(max_examples=50, deadline=None)
@given(prefill=st.integers(1, 7), tokens=st.integers(0, 2_000_000), kv=st.integers(0, 1_000_000))
def test_any_engine_mix_keeps_budget_and_minimums(prefill, tokens, kv) -> None:
    c = Controller(spec8(maxConcurrent=8))
    states = engines(
        prefill,
        8 - prefill,
        **{f"c-engine-{i}": {"waitingTokens": tokens, "kvUsedTokens": kv} for i in range(8)},
    )
    c.observe_engines(states)
    d = c.tick(TickInput(now=1.0))
    assert d.target.prefill + d.target.decode == 8
    assert d.target.prefill >= 1 and d.target.decode >= 1
    moved = sum(1 if s.to == "prefill" else -1 for s in d.switches)
    assert prefill + moved == d.target.prefill or len(d.switches) == 8


def test_learned_statistics_survive_a_restart(log) -> None:
    spec = spec8()
    first = Controller(spec)
    for i in range(30):
        t = f"t{i}"
        log("sample_dispatched", t, 0.0, task="swe")
        log("sandbox_started", t, 0.0, mode="cold", image="py311")
        log("request_queued", t, 20.0 + i % 3, prompt_tokens=3000 + i, turn=0)
        log("decode_finished", t, 25.0, output_tokens=100, finish="tool")
        log("tool_started", t, 25.0, tool="bash")
        log("tool_finished", t, 31.0, result_tokens=40)
        log("request_queued", t, 31.5, prompt_tokens=3200 + i, turn=1)
        log("decode_finished", t, 35.0, output_tokens=10, finish="stop")
        log("reward_started", t, 35.0)
        log("reward_finished", t, 35.0 + 10 + i % 5, accepted=i % 4 != 0)
    first.observe(log.take())
    saved = json.loads(json.dumps(first.learned_state()))

    second = Controller(spec)
    log("request_queued", "warmup", 0.0, prompt_tokens=1, turn=0)  # codes differ by order
    log("sample_dispatched", "other", 0.0, task="other-task")
    second.observe(log.take())
    second.restore_learned(saved)
    f1, f2 = first.forecaster, second.forecaster
    assert f2.admit_rate.value == pytest.approx(f1.admit_rate.value) == pytest.approx(22 / 30)
    t1 = first.table.tasks.get("swe")
    t2 = second.table.tasks.get("swe")
    assert f2.reward.mean((t2,)) == pytest.approx(f1.reward.mean((t1,)))
    b1, b2 = first.table.tools.get("bash"), second.table.tools.get("bash")
    assert f2.tool.get((t2, b2, 1, 0)) == pytest.approx(f1.tool.get((t1, b1, 1, 0))) == 6.0
    i1, i2 = first.table.images.get("py311"), second.table.images.get("py311")
    assert f2.startup.mean((2, i2, -1)) == pytest.approx(f1.startup.mean((2, i1, -1)))
    assert f2.first_prompt_tokens(t2) == pytest.approx(f1.first_prompt_tokens(t1))
    with pytest.raises(ValueError, match="format"):
        second.restore_learned({"format": 99})


def test_no_instance_available_is_reported_not_a_crash(log) -> None:
    c = Controller(spec8())
    queue(log, 5, 10_000, 1.0)
    c.observe(log.take())
    c.observe_engines(engines(1, 1, **{f"c-engine-{i}": {"healthy": False} for i in range(2)}))
    d = c.tick(TickInput(now=2.0))
    assert (d.target.prefill, d.target.decode) == (0, 0)
    assert "no instance is available" in d.reason and d.switches == ()


def test_hold_margin_keeps_a_split_that_covers_demand(log) -> None:
    c = Controller(spec8(maxConcurrent=8, holdMargin=0.25))
    # a = 50k / (10 s · 10k) = 0.5 on 2 prefill; b = 6 · 100k / 1M = 0.6 on 6 decode:
    # 2P:6D has headroom min(4, 10) = 4 (margin 3 >= 0.25): no switch, though 1P:7D or
    # others might score higher.
    queue(log, 5, 10_000, 1.0)
    c.observe(log.take())
    c.observe_engines(engines(2, 6))
    d = c.tick(TickInput(now=2.0))
    assert (d.target.prefill, d.target.decode) == (2, 6) and d.switches == ()
    assert "holdMargin" in d.reason


def test_decode_concurrency_sizes_decode_by_request_count(log) -> None:
    spec = make_spec(
        engine={"gpusPerInstance": 8},
        capacity={
            "prefillTokensPerSecond": 10_000,
            "decodeKvTokens": 10_000_000,
            "decodeConcurrency": 50,
        },
        switching=PER_HORIZON | {"maxConcurrent": 8, "holdMargin": 0.0},
    )
    c = Controller(spec)
    queue(log, 10, 10_000, 1.0)  # a = 1
    c.observe(log.take())
    # 300 requests decoding on 6 decode engines: KV says 0.03 instances, concurrency 6.
    busy = {f"c-engine-{i}": {"runningRequests": 50, "kvUsedTokens": 50_000} for i in range(2, 8)}
    c.observe_engines(engines(2, 6, **busy))
    d = c.tick(TickInput(now=2.0))
    assert d.target.decode >= 6
    kv_only = Controller(
        make_spec(
            engine={"gpusPerInstance": 8},
            capacity={"prefillTokensPerSecond": 10_000, "decodeKvTokens": 10_000_000},
            switching=PER_HORIZON | {"maxConcurrent": 8, "holdMargin": 0.0},
        )
    )
    queue(log, 10, 10_000, 1.0)
    kv_only.observe(log.take())
    kv_only.observe_engines(engines(2, 6, **busy))
    # Eq. 1 on KV alone would hand decode to prefill (its best margin has fewer decode).
    why = kv_only.tick(TickInput(now=2.0)).reason
    best_decode = int(re.search(r"best margin at \d+P:(\d+)D", why).group(1))
    assert best_decode < 6, why


def prefill_round(log: EventLog, n: int, tokens: int, ts: float, instance: str) -> None:
    """n requests of ``tokens`` full-prompt tokens, prefilled on ``instance`` within 1 s."""
    for i in range(n):
        traj = f"r{ts:g}-{i}"
        log("request_queued", traj, ts, prompt_tokens=tokens, turn=0)
        log("prefill_started", traj, ts + 0.2, instance=instance)
        log("prefill_finished", traj, ts + 0.8, instance=instance)


def test_theta_p_carries_the_measured_prefix_cache_hit_ratio(log) -> None:
    c = Controller(spec8())  # profiled: 10k computed tokens per instance-second
    c.observe_engines(engines(2, 6, **{"c-engine-0": {"prefillTokens": 5_000}}))
    c.tick(TickInput(now=1.0))
    # 10 prompts of 10k tokens prefilled; the engine computed only 10k of those 100k: the
    # rest came from its prefix cache (h = 90%), so a full-prompt token costs a tenth.
    prefill_round(log, 10, 10_000, 2.0, "c-engine-0")
    c.observe(log.take())
    c.observe_engines(engines(2, 6, **{"c-engine-0": {"prefillTokens": 15_000}}))
    d = c.tick(TickInput(now=11.0))
    assert d.capacity.prefill_tokens_per_second == pytest.approx(100_000)
    assert "hit ratio 90%" in d.reason


def test_theta_p_falls_back_to_busy_intervals_without_engine_counters(log) -> None:
    c = Controller(spec8())
    c.observe_engines(engines(2, 6))  # agents that count no computed tokens
    prefill_round(log, 10, 10_000, 2.0, "c-engine-0")
    c.observe(log.take())
    c.observe_engines(engines(2, 6))
    d = c.tick(TickInput(now=11.0))
    # The events make ten busy intervals on c-engine-0, each one 10k-token prompt from 2.2 s
    # to 2.8 s (each request drains the instance before the next one starts).
    assert d.capacity.prefill_tokens_per_second == pytest.approx(10_000 / 0.6, rel=1e-6)
    assert "hit ratio" not in d.reason


def test_a_one_horizon_spike_is_ridden_out_but_a_sustained_shift_is_followed(log) -> None:
    def run(switching: dict[str, float | bool], burst: int = 30) -> tuple[list[int], list[int]]:
        """Ticks (s) at which the Controller asked for more prefill, for a spike and a shift."""
        spec = make_spec(
            engine={"gpusPerInstance": 8},
            capacity={"prefillTokensPerSecond": 10_000, "decodeKvTokens": 4_000_000},
            switching={"maxConcurrent": 8, "cooldownSeconds": 0} | switching,
        )
        c = Controller(spec)
        # Decode is busy: 12M tokens on 6 instances of 4M (b = 3, load 0.5); whatever it
        # aborts on a switch (a quarter of 2M per instance) is prefilled again.
        decode = {f"c-engine-{i}": {"kvUsedTokens": 2_000_000} for i in range(2, 8)}
        spike, shift = [], []
        for k in range(1, 151):
            now = 10.0 * k
            # The trainer stays live: each horizon the 5 steady prompts are new ones.
            for i in range(5):
                if k > 1:
                    log("trajectory_dropped", f"steady{k - 1}-{i}", now - 6)
                log("request_queued", f"steady{k}-{i}", now - 6, prompt_tokens=10_000, turn=0)
            if k == 60:  # one horizon of 30 more prompts (a = 3.5), gone by the next
                queue(log, burst, 10_000, now - 5, prefix="spike")
            if k == 61:
                for i in range(burst):
                    log("trajectory_dropped", f"spike{i}", now - 5)
            if k >= 90:  # from here on, 200 more new prompts every horizon (a = 20.5)
                if k > 90:
                    for i in range(200):
                        log("trajectory_dropped", f"shift{k - 1}-{i}", now - 6)
                queue(log, 200, 10_000, now - 5, prefix=f"shift{k}-")
            c.observe(log.take())
            c.observe_engines(engines(2, 6, **decode))
            d = c.tick(TickInput(now=now))
            if any(s.to == "prefill" for s in d.switches):
                (spike if k < 90 else shift).append(int(now))
        return spike, shift

    # Eq. 1's rule of each horizon, priced, on a minute of smoothing (the defaults but the
    # step-scale target, which test_step_cycle.py covers).
    spike, shift = run({"stepCycle": False})
    assert spike == [], "the spike does not pay for the decode work a switch aborts"
    assert shift and shift[0] <= 900 + 30, "a sustained shift is followed within a few ticks"
    # A burst of prompts is work done once: 30 prompts are 30 instance-seconds, which two
    # prefill instances drain in 15 s. Three thousand are not drained within the payoff
    # horizon, and that burst flips roles at once.
    spike, _ = run({"stepCycle": False}, burst=3_000)
    assert spike[:1] == [600], "a burst that outlasts the payoff horizon flips roles"


def test_a_prefill_instance_is_priced_with_the_contexts_it_caches(log) -> None:
    """Flipping a prefill instance flushes the contexts cache-aware routing keeps there."""
    spec = make_spec(
        engine={"gpusPerInstance": 8},
        capacity={"prefillTokensPerSecond": 10_000, "decodeKvTokens": 1_000_000},
    )
    c = Controller(spec)
    for i in range(10):
        traj, inst = f"ctx{i}", f"c-engine-{i % 2}"
        log("request_queued", traj, 1.0, prompt_tokens=30_000, turn=0)
        log("prefill_started", traj, 1.1, instance=inst)
        log("prefill_finished", traj, 1.2, instance=inst)
        log("decode_finished", traj, 1.3, output_tokens=10, finish="tool")
        log("tool_started", traj, 1.4)
    events = log.take()
    c.observe(events)
    states = {s.instance: s for s in engines(3, 5)}

    def lost(c: Controller, state: EngineState) -> float:
        return lost_tokens(
            state,
            contexts=c.table.live_contexts_by_instance(),
            abort_share=c.switch_costs.abort_share,
            cache_tokens=c.spec.capacity.prefill_cache_tokens,
            cache_scale=c.spec.engine.prefix_cache_scale,
        )

    assert c.table.live_context_on("c-engine-0") == 5 * 30_010
    assert lost(c, states["c-engine-0"]) == 5 * 30_010
    assert lost(c, states["c-engine-2"]) == 0  # it served none of them
    # What a cache can hold bounds what it loses (80% of a 1M-token KV pool here).
    # No prefix cache at all (engines without a radix cache): a switch flushes nothing.
    nocache = Controller(
        make_spec(
            engine={"gpusPerInstance": 8},
            capacity={"prefillTokensPerSecond": 10_000, "prefillCacheTokens": 0},
        )
    )
    nocache.observe(events)
    assert nocache.table.live_context_on("c-engine-0") == 5 * 30_010
    assert lost(nocache, states["c-engine-0"]) == 0.0
    # The HiCache host tier holds twice the 50k-token GPU pool, a copy of what the GPU
    # caches included (write-through): 80% of 100k.
    small = states["c-engine-0"].model_copy(update={"kv_capacity_tokens": 50_000})
    assert lost(c, small) == 80_000


def test_switch_durations_and_aborts_are_measured(log) -> None:
    c = Controller(spec8(maxConcurrent=1))
    queue(log, 60, 10_000, 1.0)
    c.observe(log.take())
    c.observe_engines(engines(2, 6))
    (sw,) = c.tick(TickInput(now=2.0)).switches
    assert c.switch_costs.in_progress
    c.record_switch(sw.instance, at=2.0 + 12.0)
    assert not c.switch_costs.in_progress
    assert c.switch_costs.measured == 1
    assert 12.0 < c.switch_costs.seconds < 25.0  # pulled from the 25 s prior toward 12 s


def test_eq13_cost_is_calibrated_against_what_the_engines_computed(log) -> None:
    c = Controller(spec8())
    c.observe_engines(engines(2, 6, **{"c-engine-0": {"prefillTokens": 0}}))
    c.tick(TickInput(now=1.0))
    assert seen(c).calibration is None  # nothing prefilled yet: g is the paper's x / θ_P
    # Ten new trajectories: the table expects every prompt token computed (100k), and the
    # engines computed 100k: calibration 1.
    prefill_round(log, 10, 10_000, 2.0, "c-engine-0")
    c.observe(log.take())
    c.observe_engines(engines(2, 6, **{"c-engine-0": {"prefillTokens": 100_000}}))
    c.tick(TickInput(now=11.0))
    assert seen(c).calibration == pytest.approx(1.0)
    # Next horizon the engines computed 300k for another 100k expected: over the window,
    # 400k computed against 200k expected (a cache the table did not know was flushed).
    prefill_round(log, 10, 10_000, 12.0, "c-engine-0")
    c.observe(log.take())
    c.observe_engines(engines(2, 6, **{"c-engine-0": {"prefillTokens": 400_000}}))
    c.tick(TickInput(now=21.0))
    assert seen(c).calibration == pytest.approx(2.0)


def test_long_contexts_cost_more_prefill_with_a_profiled_doubling(log) -> None:
    # The same 600k prompt tokens queued as ten 60k contexts to recompute: with
    # prefillCostDoublingTokens = 40k each token costs 1 + p/40k, 1.75x on average here.
    def demand(capacity: dict[str, int]) -> float:
        spec = make_spec(
            engine={"gpusPerInstance": 8},
            capacity={"prefillTokensPerSecond": 10_000, "decodeKvTokens": 1_000_000} | capacity,
            switching=PER_HORIZON,
        )
        c = Controller(spec)
        c.observe_engines(engines(2, 6, **{"c-engine-0": {"prefillTokens": 0}}))
        c.tick(TickInput(now=1.0))
        prefill_round(log, 10, 10_000, 2.0, "c-engine-0")  # calibrates g: computed/expected
        queue(log, 10, 60_000, 5.0, prefix="long")
        c.observe(log.take())
        c.observe_engines(engines(2, 6, **{"c-engine-0": {"prefillTokens": 100_000}}))
        c.tick(TickInput(now=11.0))
        return seen(c).demand[0]

    flat = demand({})
    assert flat > 0
    assert demand({"prefillCostDoublingTokens": 40_000}) == pytest.approx(1.75 * flat, rel=0.02)


def decoding_long_contexts(log: EventLog) -> None:
    """24 trajectories decoding on 100k-token contexts, all prefilled on c-engine-0."""
    for i in range(24):
        log("request_queued", f"long{i}", 1.0, prompt_tokens=100_000, turn=0)
        log("prefill_started", f"long{i}", 1.0, instance="c-engine-0")
        log("prefill_finished", f"long{i}", 2.0, instance="c-engine-0")


def test_prefill_is_never_sized_below_what_the_live_contexts_need_cached(log) -> None:
    # 24 trajectories of 100k-token contexts are decoding and will come back with them as
    # prefixes: 2.4M tokens over 0.8 of a 1M-token prefill cache is 3 instances. Decode is
    # busy (5.4 of 6 instances) and prefill idle, so Eq. 1 alone would leave one prefill
    # instance and every returning turn would recompute its whole context.
    def target(capacity: dict[str, int]) -> tuple[int, str]:
        spec = make_spec(
            # GPU-only prefix caches (no HiCache host tier): 1M tokens each.
            engine={
                "gpusPerInstance": 8,
                "env": [{"name": "PRORSA_DISABLE_HICACHE", "value": "1"}],
            },
            capacity={"prefillTokensPerSecond": 10_000, "decodeKvTokens": 1_000_000} | capacity,
            switching=PER_HORIZON | {"maxConcurrent": 8, "holdMargin": 0.0},
        )
        c = Controller(spec)
        decoding_long_contexts(log)
        c.observe(log.take())
        busy = {f"c-engine-{i}": {"kvUsedTokens": 900_000} for i in range(2, 8)}
        c.observe_engines(engines(2, 6, **busy))
        d = c.tick(TickInput(now=20.0))
        return d.target.prefill, d.reason

    floor, why = target({})
    assert floor == 3 and "prefix caches of 3.00 prefill instances" in why
    # The floor switched off: a busy decode side (0.9 of its knee) takes the spare instance.
    assert target({"prefillCacheTokens": 0})[0] == 1
    assert target({"prefillCacheTokens": 6_000_000})[0] == 1  # a cache tier that holds them


def test_a_weight_update_lifts_the_prefix_cache_floor_while_it_runs(log) -> None:
    spec = make_spec(
        engine={"gpusPerInstance": 8},
        capacity={"prefillTokensPerSecond": 10_000, "decodeKvTokens": 1_000_000},
        switching=PER_HORIZON,
    )
    c = Controller(spec)
    decoding_long_contexts(log)
    c.observe(log.take())
    c.observe_engines(engines(2, 6))
    c.tick(TickInput(now=10.0))
    # 2.4M tokens in 0.8 x 2M: the host tier (twice the GPU pool) holds the GPU's copy too.
    assert seen(c).cache_floor == pytest.approx(1.5)
    log.cluster("weight_update_started", 15.0, version=1, expected_seconds=30.0)
    c.observe(log.take())
    c.tick(TickInput(now=20.0))
    assert seen(c).cache_floor == 0.0, "the new weights flush every cache anyway"


def test_each_decision_carries_what_its_tick_saw_and_the_wire_form_does_not(log) -> None:
    c = Controller(spec8())
    c.observe_engines(engines(2, 6))
    queue(log, 40, 10_000, 1.0)
    c.observe(log.take())
    first = c.tick(TickInput(now=2.0))
    c.tick(TickInput(now=12.0))  # a later tick does not rewrite what the first one explained
    diag = first.diagnostics
    assert diag is not None and c.last_decision is not first
    assert diag.demand[0] > 0 and diag.trajectories["ready"] == 40
    assert diag.forecast is not None and diag.forecast.ready > 0
    with pytest.raises(AttributeError):
        diag.demand = (0.0, 0.0)  # type: ignore[misc]
    assert "diagnostics" not in first.wire()
    assert Decision.model_validate(first.wire()).diagnostics is None


def test_diagnostics_account_for_the_rollouts_outcome(log) -> None:
    """What the operator exports as outcome metrics: tokens generated, prompts waiting for
    prefill and the oldest wait since each was queued, requests waiting for decode room,
    and the prefill tokens engines computed again beyond each prompt's cached prefix."""
    c = Controller(spec8())
    waiting = {"c-engine-6": {"waitingRequests": 3}, "c-engine-0": {"waitingRequests": 9}}
    c.observe_engines(engines(2, 6, **waiting))
    queue(log, 2, 1_000, 1.0)  # t0, t1
    log("prefill_started", "t0", 4.0)  # prefilling: still waiting, since 1.0
    log("request_queued", "late", 5.0, prompt_tokens=500, turn=0)
    log("request_queued", "done", 1.0, prompt_tokens=2_000, turn=0)
    log("prefill_finished", "done", 2.0)
    log("decode_finished", "done", 3.0, output_tokens=120, finish="tool")
    c.observe(log.take())
    diag = seen_after(c, 6.0)
    assert diag.generated_tokens == 120
    assert (diag.prefill_waiting, diag.prefill_oldest_wait) == (3, pytest.approx(5.0))
    assert diag.decode_waiting == 3  # the decode engine's queue, not the prefill one's
    assert sum(diag.best) == 8  # Eq. 1's best split, whatever the target
    # The second turn of "done": a 3,000-token prompt whose first 2,000 tokens its first
    # prefill cached. The agents then count 5,000 computed tokens.
    log("tool_finished", "done", 7.0, result_tokens=880)
    log("request_queued", "done", 7.0, prompt_tokens=3_000, turn=1)
    log("prefill_finished", "done", 8.0)
    c.observe(log.take())
    c.observe_engines(engines(2, 6, **{"c-engine-0": {"prefillTokens": 0}}))
    c.tick(TickInput(now=8.5))
    c.observe_engines(engines(2, 6, **{"c-engine-0": {"prefillTokens": 5_000}}))
    diag = seen_after(c, 9.0)
    # Expected: 2,000 for the first prefill (nothing cached) + 1,000 for the second
    # (3,000 - 2,000 cached): 3,000. Computed since the agents were first read: 5,000.
    assert diag.recomputed_tokens == pytest.approx(2_000)
    # A counter: a later tick with nothing new computed never lowers it.
    assert seen_after(c, 10.0).recomputed_tokens == pytest.approx(2_000)


def seen_after(c: Controller, now: float) -> Diagnostics:
    c.tick(TickInput(now=now))
    return seen(c)


def test_the_moves_made_carry_their_priced_gain_and_cost(log) -> None:
    c = Controller(spec8())
    c.observe_engines(engines(2, 6))
    queue(log, 200, 10_000, 1.0)
    c.observe(log.take())
    d = c.tick(TickInput(now=2.0))
    diag = d.diagnostics
    assert diag is not None and d.switches
    assert [m.instance for m in diag.made] == [s.instance for s in d.switches]
    assert all(m.gain > m.cost for m in diag.made)  # each one made because it paid
    assert diag.best[0] > 2 and diag.best[0] + diag.best[1] == 8


# -- the stages of a tick on their own inputs ----------------------------------------------


def test_a_demand_source_gets_what_the_tick_measured_and_its_demand_sizes_the_split() -> None:
    """A demand source is a function of DemandInputs alone (the simulator's oracle is one)."""
    seen: list[DemandInputs] = []

    def source(inputs: DemandInputs) -> Demand:
        seen.append(inputs)
        return Demand(mode="predictive", a=6.0, b=2.0, forecast=Forecast(prefill_tokens=600_000))

    c = Controller(spec8(), demand_source=source)
    states = engines(2, 6, **{"c-engine-5": {"runningRequests": 0}})
    c.observe_engines(states)
    d = c.tick(TickInput(now=5.0))
    (inputs,) = seen
    assert (inputs.now, inputs.horizon) == (5.0, 10.0)
    assert inputs.engines == tuple(states)
    assert inputs.prefill_names == ("c-engine-0", "c-engine-1")
    assert inputs.theta == 10_000  # the profiled θ_P: nothing measured yet
    assert inputs.kv_capacity == 1_000_000 and inputs.kv_now == 6 * 100_000  # C_KV, K_D
    assert d.target == Target(prefill=6, decode=2)
    assert [(s.instance, s.to) for s in d.switches] == [("c-engine-5", "prefill")]
    assert d.forecast.prefill_tokens == 600_000
    assert d.diagnostics is not None and d.diagnostics.forecast is None  # the source's own


def test_the_demand_stage_needs_only_its_inputs_and_the_forecast_state() -> None:
    forecaster = Forecaster(ForecastConfig())
    table = TrajectoryTable(observer=forecaster)
    spec = spec8()
    inputs = DemandInputs(
        now=50.0,
        horizon=10.0,
        kv_now=400_000,
        theta=10_000,
        kv_capacity=1_000_000,
        prefill_names=("c-engine-0",),
        engines=tuple(engines(1, 1, **{"c-engine-0": {"waitingTokens": 200_000}})),
        calibration=None,
        capacity=spec.capacity,
        ranks=1,
    )
    d = forecast_demand(inputs, table=table, forecaster=forecaster)
    # No trainer events: the engines' queued prefill tokens over S·θ_P, and K_D over C_KV.
    assert (d.mode, d.a, d.b) == ("reactive", 2.0, 0.4)
    assert d.note == "reactive: no trainer events"


def plan_inputs(current: tuple[int, int] = (2, 6), **override) -> PlanInputs:
    spec = spec8()
    prefill, decode = current
    fields = {
        "now": 100.0,
        "horizon": 10.0,
        "current": current,
        "sizing": Sizing(
            demand=Demand(mode="predictive", a=6.0, b=2.0, forecast=Forecast()),
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
            best=Allocation(6, 2, 0.0),
        ),
        "engines": tuple(engines(prefill, decode, **{"c-engine-5": {"runningRequests": 0}})),
        "in_progress": 0,
        "cooldown_until": {},
        "contexts": {},
        "switch_seconds": 13.0,
        "abort_share": 0.1,
        "calibration": None,
        "switching": spec.switching,
        "capacity": spec.capacity,
        "cache_scale": spec.engine.prefix_cache_scale,
    }
    return PlanInputs(**(fields | override))


def test_the_switch_plan_needs_only_its_inputs() -> None:
    """The plan stage prices moves from PlanInputs: no Controller, no trajectory table."""

    def plan(inputs: PlanInputs):
        return plan_switches(inputs, persistence=Persistence(seconds=300.0), regret=Regret())

    made = plan(plan_inputs())
    assert made.target == Target(prefill=6, decode=2) and made.held == ""
    # maxConcurrent = 1: one move, the least loaded decode instance.
    assert [(s.instance, s.from_, s.to) for s in made.switches] == [
        ("c-engine-5", "decode", "prefill")
    ]
    assert len(made.moves) == 1 and made.notes[0].startswith("switching: c-engine-5")
    cooling = plan(plan_inputs(cooldown_until={"c-engine-5": 160.0}))
    assert [s.instance for s in cooling.switches] == ["c-engine-2"]
    # A switch that takes longer than the payoff horizon never pays: the split holds.
    slow = plan(plan_inputs(switch_seconds=1_000.0))
    assert slow.switches == () and slow.target == Target(prefill=2, decode=6)
    assert slow.notes[0].startswith("holding: c-engine-5")
    # Restoring a role minimum is never priced.
    restore = plan(plan_inputs(current=(0, 8), switch_seconds=1_000.0))
    assert [s.to for s in restore.switches] == ["prefill"]
    assert restore.held == "restoring role minimums"
