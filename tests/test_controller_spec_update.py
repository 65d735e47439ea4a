"""Editing a RolloutCluster's spec: every setting the Controller derives from it follows,
and nothing it learned is forgotten (Controller.apply_spec, issue 13 item 10)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import EventLog, make_spec

from prorsa.core.controller import Controller
from prorsa.core.diagnostics import Diagnostics
from prorsa.core.types import TickInput
from prorsa_contract.agent_api import EngineState


def seen(c: Controller) -> Diagnostics:
    """The diagnostics the last tick handed out with its Decision."""
    d = c.last_decision
    assert d is not None and d.diagnostics is not None
    return d.diagnostics


BASE: dict[str, Any] = {
    "gpuBudget": 64,
    "engine": {"gpusPerInstance": 8},
    "capacity": {"prefillTokensPerSecond": 10_000, "decodeKvTokens": 1_000_000},
    "switching": {"smoothingSeconds": 60, "payoffSeconds": 300, "cooldownSeconds": 30},
}


def edited(path: str, value: Any) -> dict[str, Any]:
    """BASE with one field (dotted camelCase path) set."""
    body = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    *parents, leaf = path.split(".")
    node = body
    for key in parents:
        node[key] = dict(node.get(key) or {})
        node = node[key]
    node[leaf] = value
    return body


def derived(c: Controller) -> dict[str, Any]:
    """What the Controller takes from its spec when it is built."""
    f = c.forecaster
    return {
        "spec": c.spec,
        "horizon": c.horizon,
        "forecast config": f.config,
        "tool EMA alpha": (f.tool.alpha, f.growth.alpha, f.template.alpha),
        "profiled theta": (c.prefill_speed.events.profiled, c.prefill_speed.engines.profiled),
        "hit-ratio window": c.prefill_speed.cache_hits.window,
        "smoothing": c.smoother.seconds,
        "ttl": c.ttl,
        "payoff prior": c.persistence.seconds,
        "decode share smoothing": c.share_smoother.seconds,
        "assumed prefill": c._assumed_prefill,
    }


# Each field of the spec that the Controller copies when built, the new value, and what
# it drives. Fields the Controller reads from ``spec`` at every tick follow by the swap.
FIELDS = [
    ("forecast.horizonSeconds", 60.0, {"horizon", "forecast config", "hit-ratio window", "ttl"}),
    ("forecast.toolEmaAlpha", 0.5, {"forecast config", "tool EMA alpha"}),
    ("forecast.biasCorrection", False, {"forecast config"}),
    ("forecast.injection", {"policy": "fixedRate", "ratePerSecond": 2.5}, {"forecast config"}),
    ("forecast.injection", {"policy": "groupReplenish", "groupSize": 8}, {"forecast config"}),
    ("forecast.injection", {"policy": "none"}, {"forecast config"}),
    ("capacity.prefillTokensPerSecond", 25_000, {"profiled theta"}),
    ("switching.smoothingSeconds", 0, {"smoothing"}),
    ("switching.smoothingSeconds", 600, {"smoothing"}),
    ("switching.payoffSeconds", 900, {"payoff prior", "decode share smoothing"}),
    ("roles.prefill", {"min": 1, "initial": 5}, {"assumed prefill"}),
    ("gpuBudget", 128, {"assumed prefill"}),
]


@pytest.mark.parametrize(("path", "value", "drives"), FIELDS, ids=[f[0] for f in FIELDS])
def test_every_copied_field_takes_effect(log: EventLog, path, value, drives) -> None:
    old, new = make_spec(**BASE), make_spec(**edited(path, value))
    c = Controller(old)
    log("request_queued", "t0", 1.0, prompt_tokens=1000, turn=0)
    c.observe(log.take())
    c.apply_spec(new)
    after, fresh, before = derived(c), derived(Controller(new)), derived(Controller(old))
    assert after == fresh  # as if built from the new spec
    changed = {k for k in after if k != "spec" and after[k] != before[k]}
    assert changed == drives  # and the field made a difference


def test_ttl_given_to_the_controller_outlives_spec_edits() -> None:
    c = Controller(make_spec(**BASE), ttl_seconds=600)
    c.apply_spec(make_spec(**edited("forecast.horizonSeconds", 60.0)))
    assert c.ttl == 600


def engines(prefill: int, decode: int) -> list[EngineState]:
    return [
        EngineState.model_validate(
            {
                "instance": f"c-engine-{i}",
                "role": "prefill" if i < prefill else "decode",
                "kvCapacityTokens": 1_000_000,
                "kvUsedTokens": 100_000,
                "runningRequests": 10,
                "prefillBusySeconds": 2.0 * i,
                "prefillTokens": 20_000 * i,
            }
        )
        for i in range(prefill + decode)
    ]


def test_a_spec_edit_keeps_what_was_learned(log: EventLog) -> None:
    c = Controller(make_spec(**BASE))
    for i in range(30):  # finished trajectories: duration statistics to keep
        t = f"done{i}"
        log("sample_dispatched", t, 0.0, task="swe")
        log("request_queued", t, 20.0 + i % 3, prompt_tokens=3000 + i, turn=0)
        log("decode_finished", t, 25.0, output_tokens=100, finish="tool")
        log("tool_started", t, 25.0, tool="bash")
        log("tool_finished", t, 31.0, result_tokens=40)
        log("request_queued", t, 31.5, prompt_tokens=3200 + i, turn=1)
        log("decode_finished", t, 35.0, output_tokens=10, finish="stop")
        log("reward_started", t, 35.0)
        log("reward_finished", t, 45.0 + i % 5, accepted=True)
    for i in range(5):
        log("request_queued", f"live{i}", 80.0, prompt_tokens=4000, turn=0)
    c.observe(log.take())
    c.observe_engines(engines(2, 6))
    c.tick(TickInput(now=90.0))
    c.record_switch("c-engine-3", at=90.0)
    live, learned = c.live_trajectories(), c.learned_state()
    cooldowns, assumed = dict(c._cooldown_until), c._assumed_prefill
    decisions = c.last_decision

    c.apply_spec(make_spec(**edited("forecast.horizonSeconds", 30.0)))
    assert c.live_trajectories() == live and sum(live.values()) == 5
    assert c.learned_state() == learned  # the statistics a restart would persist
    assert c._cooldown_until == cooldowns  # the switch's cooldown still runs
    assert c._assumed_prefill == assumed and c.last_decision is decisions
    later = c.tick(TickInput(now=100.0))
    assert later.forecast.components  # the forecast now covers 30 s
    assert c.forecaster.config.horizon == 30.0


def test_smoothing_switched_off_plans_on_each_horizon(log: EventLog) -> None:
    """A user who sets smoothingSeconds to 0 sees the next split sized on that tick's
    demand, not on the average built up before the edit."""
    c = Controller(make_spec(**BASE))
    c.observe_engines(engines(2, 6))
    for i in range(6):
        c.tick(TickInput(now=10.0 * i))
    for i in range(400):
        log("request_queued", f"q{i}", 60.0, prompt_tokens=10_000, turn=0)
    c.observe(log.take())
    c.tick(TickInput(now=61.0))
    assert seen(c).planned[0] < seen(c).demand[0]  # smoothed: the old calm weighs in
    c.apply_spec(make_spec(**edited("switching.smoothingSeconds", 0)))
    c.tick(TickInput(now=62.0))
    assert seen(c).planned[0] == pytest.approx(seen(c).demand[0])
