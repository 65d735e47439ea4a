"""A trainer that cannot see prefills: request_queued, then decode_finished, nothing between.

Behind a PD router a blocking client learns neither which engine prefilled its request nor
when that ended. The table must take such a trajectory through its turns without counting
anomalies, and the Controller must not read every request decoding as prefill demand: the
prefill engines' ``/v1/state`` says how many requests are still waiting for or in prefill.
"""

from __future__ import annotations

import pytest
from conftest import make_spec

from prorsa.core.controller import Controller
from prorsa.core.forecast.config import ForecastConfig
from prorsa.core.forecast.model import Forecaster
from prorsa.core.forecast.slots import READY
from prorsa.core.forecast.table import TrajectoryTable
from prorsa.core.types import TickInput
from prorsa_contract.agent_api import EngineState
from prorsa_lab.sim.policies import baseline
from prorsa_lab.sim.simulator import Scenario, simulate


def blind_turn(log, tid: str, ts: float, *, prompt: int, output: int, finish: str) -> None:
    log("request_queued", tid, ts, prompt_tokens=prompt, turn=0)
    log("decode_finished", tid, ts + 5.0, output_tokens=output, finish=finish)


def table() -> TrajectoryTable:
    return TrajectoryTable(observer=Forecaster(ForecastConfig()))


def states(*, prefill_held: int) -> list[EngineState]:
    body = {"kvCapacityTokens": 1_000_000, "kvUsedTokens": 100_000}
    return [
        EngineState.model_validate(
            body | {"instance": "c-engine-0", "role": "prefill", "runningRequests": prefill_held}
        ),
        *(
            EngineState.model_validate(body | {"instance": f"c-engine-{i}", "role": "decode"})
            for i in range(1, 8)
        ),
    ]


def test_queued_straight_to_decode_finished_is_a_turn_not_an_anomaly(log) -> None:
    t = table()
    log("sample_dispatched", "a", 0.0, task="swe")
    blind_turn(log, "a", 1.0, prompt=1000, output=50, finish="tool")
    log("tool_started", "a", 6.0)
    log("tool_finished", "a", 8.0, result_tokens=100)
    log("request_queued", "a", 8.5, prompt_tokens=1160, turn=1)
    log("decode_finished", "a", 12.0, output_tokens=20, finish="stop")
    log("reward_started", "a", 12.0)
    log("reward_finished", "a", 13.0, accepted=True)
    t.apply(log.take())
    assert sum(t.anomalies.values()) == 0
    assert t.prefill_blind
    f = t._obs
    assert isinstance(f, Forecaster)
    # Both decodes taught the statistics, timed from request_queued; both prompts count
    # as prefilled (the prefix-cache hit ratio is measured against them).
    assert f.decode_outcome[-2][1] == 2  # decodes seen, every task together
    assert f.prefilled_tokens == 2160


def test_a_streaming_trainer_is_not_blind(log) -> None:
    t = table()
    for i in range(4):
        log("request_queued", f"s{i}", 1.0, prompt_tokens=1000, turn=0)
        log("prefill_finished", f"s{i}", 2.0)  # the first token
        log("decode_finished", f"s{i}", 6.0, output_tokens=40, finish="stop")
    log("request_queued", "late", 7.0, prompt_tokens=1000, turn=0)
    t.apply(log.take())
    assert not t.prefill_blind
    assert t.infer_admitted(100.0, in_prefill=0, seconds_per_token=1e-4) == 0
    assert t.state_counts()["ready"] == 1


def test_requests_the_prefill_engines_no_longer_hold_are_decoding(log) -> None:
    t = table()
    blind_turn(log, "done", 0.0, prompt=10, output=1, finish="stop")  # says: blind trainer
    for i in range(10):
        log("request_queued", f"r{i}", 10.0 + i, prompt_tokens=2000, turn=0)
    t.apply(log.take())
    # The prefill engines hold 3 requests: the 3 queued last. The 7 before are decoding.
    assert t.infer_admitted(25.0, in_prefill=3, seconds_per_token=1e-4) == 7
    counts = t.state_counts()
    assert (counts["ready"], counts["decode"]) == (3, 7)
    live = {name for name in (f"r{i}" for i in range(10)) if t.slot_of(name) is not None}
    ready = {n for n in live if t.cols["state"][t.slot_of(n)] == READY}
    assert ready == {"r7", "r8", "r9"}
    # Their decode ends as any decode does: no anomaly, and the turn goes to reward.
    log("decode_finished", "r0", 30.0, output_tokens=10, finish="stop")
    t.apply(log.take())
    assert t.anomalies["unexpected_transition"] == 0 and t.state_counts()["reward"] == 2


def test_without_engine_states_a_request_decodes_once_its_prompt_had_time(log) -> None:
    t = table()
    blind_turn(log, "done", 0.0, prompt=10, output=1, finish="stop")
    log("request_queued", "short", 10.0, prompt_tokens=1_000, turn=0)  # 0.1 s at 10k tok/s
    log("request_queued", "long", 10.0, prompt_tokens=100_000, turn=0)  # 10 s
    t.apply(log.take())
    assert t.infer_admitted(12.0, in_prefill=None, seconds_per_token=1e-4) == 1
    assert t.cols["state"][t.slot_of("long")] == READY


def test_blind_trainer_demand_is_what_the_engines_still_prefill(log) -> None:
    """Eighty requests decoding for minutes must not read as eighty prompts to prefill."""
    spec = make_spec(capacity={"prefillTokensPerSecond": 10_000, "decodeKvTokens": 4_000_000})
    c = Controller(spec)
    blind_turn(log, "done", 0.0, prompt=10, output=1, finish="stop")
    for i in range(80):
        log("request_queued", f"r{i}", 10.0, prompt_tokens=10_000, turn=0)
    log("request_queued", "new", 49.0, prompt_tokens=10_000, turn=0)
    c.observe(log.take())
    c.observe_engines(states(prefill_held=1))
    d = c.tick(TickInput(now=50.0))
    assert c.table.state_counts()["decode"] == 80
    assert d.forecast.components.ready == 10_000  # the one prompt still in prefill
    assert d.forecast.prefill_tokens < 80 * 10_000 / 4


@pytest.mark.parametrize("prefill_events", ["first-token", "none"])
def test_simulated_trainer_sends_only_the_observable_prefill_events(prefill_events) -> None:
    from prorsa_lab.sim.simulator import Simulation

    sc = Scenario(
        model="qwen3-235b", task="math", steps=1, groups_per_step=1, prefill_events=prefill_events
    )
    sim = Simulation(sc, baseline("static-4"), emit_events=True)
    sim.run()
    sent = sim.trainer.drain_outbox()
    kinds = {e.type for e in sent}
    assert "prefill_started" not in kinds
    finished = [e for e in sent if e.type == "prefill_finished"]
    if prefill_events == "none":
        assert not finished
    else:
        assert finished and all(e.instance is None for e in finished)
    t = table()
    t.apply(sent)
    assert sum(t.anomalies.values()) == 0
    assert t.prefill_blind is (prefill_events == "none")


def test_forecast_from_observable_events_stays_close_to_the_full_set() -> None:
    """WAPE in the simulator with each event set: the gap the engine states must close."""
    wape = {}
    for prefill_events in ("full", "none"):
        sc = Scenario(
            model="qwen3-235b",
            task="coding",
            staleness=2,
            steps=1,
            groups_per_step=1,
            prefill_events=prefill_events,
        )
        r = simulate(sc, baseline("prorsa"))
        assert r.wape_prefill is not None and r.wape_decode is not None
        wape[prefill_events] = (r.wape_prefill, r.wape_decode)
    (full_p, full_d), (none_p, none_d) = wape["full"], wape["none"]
    assert none_p <= full_p + 0.05, wape
    assert none_d <= full_d + 0.05, wape


def test_prorsa_bench_events_prints_wape_for_each_event_set(capsys) -> None:
    import json

    from prorsa.cli import main

    assert main(["bench", "events", "--quick", "--tasks", "math", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["prefillEvents"] for r in rows] == ["full", "first-token", "none"]
    assert all(r["wapePrefill"] is not None and r["wapeDecode"] is not None for r in rows)
    # Fewer events for the same rollout: the observable sets leave prefill events out.
    assert rows[0]["events"] > rows[1]["events"] > rows[2]["events"]
    assert main(["bench", "events", "--tasks", "cooking"]) == 2
