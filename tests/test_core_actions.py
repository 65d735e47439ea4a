"""The bootstrap and the switching-mode gate (prorsa.core.actions), transition by transition:
what the operator, ``prorsa plan`` and the simulator all carry out of a Decision."""

from __future__ import annotations

import dataclasses
from typing import Any

from conftest import make_spec

from prorsa.core.actions import Actions, ActionState, SwitchingMode, decide_actions
from prorsa.core.decision import Capacity, Decision, Forecast, Switch, Target
from prorsa.core.diagnostics import Diagnostics
from prorsa.core.switch_cost import Move
from prorsa_contract.agent_api import EngineState

# 8 instances of 8 GPUs, 2 to prefill at start, 2 switches at a time.
SPEC = make_spec(
    engine={"gpusPerInstance": 8},
    roles={"prefill": {"initial": 2}},
    switching={"maxConcurrent": 2},
)


def engines(prefill: int = 0, *, n: int = 8, **changes: dict[str, Any]) -> list[EngineState]:
    """``n`` healthy engines, the first ``prefill`` of them prefilling; ``changes`` by name."""
    out = []
    for i in range(n):
        name = f"e{i}"
        body: dict[str, Any] = {
            "instance": name,
            "role": "prefill" if i < prefill else "decode",
            **changes.get(name, {}),
        }
        out.append(EngineState.model_validate(body))
    return out


def decision(*switches: tuple[str, str, str], priced: bool = True) -> Decision:
    made = tuple(
        Move(instance=i, src=a, dst=b, gain=10.0, cost=2.0, lost_tokens=0.0) for i, a, b in switches
    )
    d = Decision(
        at=100.0,
        mode="predictive",
        target=Target(prefill=2, decode=6),
        safetyMargin=0.1,
        forecast=Forecast(),
        capacity=Capacity(prefillTokensPerSecond=1000.0, decodeKvTokens=100_000),
        switches=tuple(
            Switch.model_validate({"instance": i, "from": a, "to": b}) for i, a, b in switches
        ),
        reason="test",
    )
    if not priced:
        return d
    diag = Diagnostics(
        demand=(1.0, 1.0),
        planned=(1.0, 1.0),
        cache_floor=0.0,
        decode_share=0.5,
        kv_now=0.0,
        miss_ratio=None,
        calibration=None,
        moves=made,
        made=made,
        best=(2, 6),
        forecast=None,
        prefill_wape=None,
        decode_wape=None,
        trajectories={},
        anomalies={},
        last_event_ts=None,
    )
    return d.explained(diag)


def act(
    states: list[EngineState],
    state: ActionState,
    *,
    mode: SwitchingMode = "Auto",
    made: Decision | None = None,
) -> Actions:
    return decide_actions(
        decision=made or decision(), mode=mode, spec=SPEC, states=states, state=state
    )


def flips(actions: Actions) -> list[tuple[str, str, str]]:
    return [(o.switch.instance, o.switch.from_, o.switch.to) for o in actions.execute]


def test_fresh_engines_are_flipped_to_the_initial_split_least_name_first() -> None:
    out = act(engines(), ActionState())
    assert flips(out) == [("e0", "decode", "prefill"), ("e1", "decode", "prefill")]
    assert out.bootstrap and not out.decided
    assert all(o.move is None for o in out.execute)  # a bootstrap switch is not priced
    assert out.state == ActionState(bootstrap_started=True)


def test_the_bootstrap_waits_until_every_engine_answers_healthy() -> None:
    unhealthy = engines(**{"e3": {"healthy": False}})
    for states in (engines(n=7), unhealthy):
        out = act(states, ActionState())
        assert out.execute == () and out.state == ActionState()
    # Meanwhile the Controller's switches are the mode's to carry out, as before.
    controller = decision(("e5", "decode", "prefill"))
    out = act(engines(n=7), ActionState(), made=controller)
    assert flips(out) == [("e5", "decode", "prefill")] and out.decided


def test_the_bootstrap_flips_every_initial_engine_at_once_whatever_max_concurrent() -> None:
    # maxConcurrent bounds the capacity a switch takes out of service; a fresh cluster with
    # no prefill engine serves nothing, so all the initial engines flip together (one at a
    # time, the first one up takes the whole start burst and keeps its prefixes).
    spec = make_spec(
        engine={"gpusPerInstance": 8},
        roles={"prefill": {"initial": 3}},
        switching={"maxConcurrent": 1},
    )

    def boot(states: list[EngineState], state: ActionState) -> Actions:
        return decide_actions(
            decision=decision(), mode="Auto", spec=spec, states=states, state=state
        )

    out = boot(engines(), ActionState())
    assert flips(out) == [(f"e{i}", "decode", "prefill") for i in range(3)]
    # One flip still under way from the previous tick: only the missing ones start.
    busy = engines(**{"e0": {"switching": True}})
    out = boot(busy, ActionState(bootstrap_started=True))
    assert flips(out) == [("e1", "decode", "prefill"), ("e2", "decode", "prefill")]
    # All under way: nothing more; the bootstrap is still running.
    full = engines(**{f"e{i}": {"switching": True} for i in range(3)})
    out = boot(full, ActionState(bootstrap_started=True))
    assert out.execute == () and out.state == ActionState(bootstrap_started=True)
    # All done: the bootstrap is over, at the initial split.
    out = boot(engines(3), ActionState(bootstrap_started=True))
    assert out.state == ActionState(bootstrapped=True, bootstrap_started=True)
    assert boot(engines(3), out.state).execute == ()


def test_an_operator_restart_that_finds_a_prefill_engine_keeps_the_split() -> None:
    # A new process (fresh state) sees one prefill engine of the two initial: the cluster
    # is running, its split is the Controller's, not reset to roles.prefill.initial.
    out = act(engines(1), ActionState())
    assert out.execute == ()
    assert out.state.bootstrapped and not out.state.bootstrap_started
    # The same split seen by the process that began the bootstrap: it goes on to initial.
    out = act(engines(1), ActionState(bootstrap_started=True))
    assert flips(out) == [("e1", "decode", "prefill")]


def test_the_given_state_is_never_changed() -> None:
    state = ActionState()
    act(engines(), state)
    assert state == ActionState()
    assert dataclasses.is_dataclass(state) and type(state).__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_auto_executes_the_controllers_switches_with_their_prices() -> None:
    done = ActionState(bootstrapped=True)
    out = act(engines(2), done, made=decision(("e4", "decode", "prefill")))
    assert flips(out) == [("e4", "decode", "prefill")] and out.decided
    (order,) = out.execute
    assert order.move is not None and (order.move.gain, order.move.cost) == (10.0, 2.0)
    assert out.announce == ()


def test_recommend_announces_once_per_change_of_advice_and_executes_nothing() -> None:
    state = ActionState(bootstrapped=True)
    one = decision(("e4", "decode", "prefill"))
    out = act(engines(2), state, mode="Recommend", made=one)
    assert out.execute == ()
    assert [o.switch.instance for o in out.announce] == ["e4"]
    assert out.announce[0].move is not None  # counted as Auto counts the ones it makes
    # The same advice again: nothing new to say.
    out = act(engines(2), out.state, mode="Recommend", made=one)
    assert out.announce == ()
    # No advice, then the same one again: a change each time, so it is said again.
    out = act(engines(2), out.state, mode="Recommend", made=decision())
    assert out.announce == () and out.state.last_advice == ()
    out = act(engines(2), out.state, mode="Recommend", made=one)
    assert [o.switch.instance for o in out.announce] == ["e4"]
    other = decision(("e5", "decode", "prefill"))
    out = act(engines(2), out.state, mode="Recommend", made=other)
    assert [o.switch.instance for o in out.announce] == ["e5"]


def test_recommend_bootstraps_and_says_nothing_while_it_does() -> None:
    advice = decision(("e4", "decode", "prefill"))
    out = act(engines(), ActionState(), mode="Recommend", made=advice)
    assert flips(out) == [("e0", "decode", "prefill"), ("e1", "decode", "prefill")]
    assert out.announce == () and out.state.last_advice == ()
    # Once at the initial split, the Controller's advice is announced.
    out = act(engines(2), out.state, mode="Recommend", made=advice)
    assert out.execute == () and [o.switch.instance for o in out.announce] == ["e4"]


def test_off_executes_and_announces_nothing_but_still_bootstraps() -> None:
    advice = decision(("e4", "decode", "prefill"))
    out = act(engines(), ActionState(), mode="Off", made=advice)
    assert flips(out) == [("e0", "decode", "prefill"), ("e1", "decode", "prefill")]
    out = act(engines(2), out.state, mode="Off", made=advice)
    assert out.execute == () and out.announce == () and out.state.bootstrapped


def test_a_decision_without_diagnostics_is_carried_out_unpriced() -> None:
    out = act(
        engines(2),
        ActionState(bootstrapped=True),
        made=decision(("e4", "decode", "prefill"), priced=False),
    )
    assert flips(out) == [("e4", "decode", "prefill")] and out.execute[0].move is None
