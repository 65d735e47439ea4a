"""The Controller while the operator's bootstrap brings a fresh cluster to its start split.

Every engine starts as decode and the bootstrap (prorsa.core.actions) flips
``roles.prefill.initial`` of them; the Controller's first ticks see 0 prefill instances.
What it learns from them must be the deployment's start split, not 0P:8D.
"""

from __future__ import annotations

from conftest import make_spec

from prorsa.core.controller import Controller
from prorsa.core.switch_cost import PRIOR_SWITCH_SECONDS
from prorsa.core.types import TickInput
from prorsa_contract.agent_api import EngineState
from prorsa_lab.sim.policies import Prorsa
from prorsa_lab.sim.simulator import Scenario, Simulation, simulate

# 8 instances, 2 to prefill at start, one switch at a time.
SPEC = make_spec(
    engine={"gpusPerInstance": 8},
    roles={"prefill": {"initial": 2}},
    switching={"maxConcurrent": 1, "cooldownSeconds": 300},
)


def engines(prefill: int, *, n: int = 8, **changes: dict[str, object]) -> tuple[EngineState, ...]:
    out = []
    for i in range(n):
        name = f"e{i}"
        body = {"instance": name, "role": "prefill" if i < prefill else "decode"}
        out.append(EngineState.model_validate(body | changes.get(name, {})))
    return tuple(out)


def bootstrapped() -> Controller:
    """A Controller that saw a fresh cluster flipped to 2P:6D (both at once, at t=10)."""
    c = Controller(SPEC)
    c.tick(TickInput(now=10.0, engines=engines(0)))
    flipping = engines(0, e0={"switching": True}, e1={"switching": True})
    c.tick(TickInput(now=20.0, engines=flipping))
    c.record_switch("e0", at=24.0)
    c.record_switch("e1", at=25.0)
    c.tick(TickInput(now=30.0, engines=engines(2)))
    return c


def test_a_fresh_cluster_is_held_at_its_initial_split_while_the_bootstrap_runs() -> None:
    c = Controller(SPEC)
    first = c.tick(TickInput(now=10.0, engines=engines(0)))
    # No switch of its own to "restore" the prefill minimum: the bootstrap makes them.
    assert first.switches == () and (first.target.prefill, first.target.decode) == (2, 6)
    assert "bootstrapping" in first.reason
    flipping = engines(0, e0={"switching": True}, e1={"switching": True})
    during = c.tick(TickInput(now=20.0, engines=flipping))
    assert during.switches == () and during.target.prefill == 2, during.reason
    c.record_switch("e0", at=24.0)
    c.record_switch("e1", at=25.0)
    after = c.tick(TickInput(now=30.0, engines=engines(2)))
    assert "bootstrapping" not in after.reason and c.bootstrap.phase == "done"


def test_the_start_split_the_step_cycle_caps_from_is_the_initial_one_not_0p() -> None:
    # Before the first weight update the step-scale target adds at most one instance to
    # the run's first split: read as 0P:8D, a fresh cluster would be capped at 1P.
    c = bootstrapped()
    assert c.cycle.first_split == (2, 6)
    assert c.cycle.starts == (10.0,)  # the run's start is its first cycle's start


def test_bootstrap_flips_start_no_cooldown_and_are_not_measured_as_switches() -> None:
    c = bootstrapped()
    # The start split can be left at once, and the first switch is priced at the prior.
    assert c.switch_costs.measured == 0 and c.switch_costs.seconds == PRIOR_SWITCH_SECONDS
    assert not c.bootstrap.flips
    assert dict(c._cooldown_until) == {}


def test_a_restarted_operator_that_finds_prefill_engines_keeps_the_split() -> None:
    c = Controller(SPEC)
    d = c.tick(TickInput(now=500.0, engines=engines(3)))
    assert c.bootstrap.phase == "done" and "bootstrapping" not in d.reason
    assert (d.target.prefill, d.target.decode) == (3, 5), d.reason


def test_while_an_engine_is_still_starting_the_bootstrap_has_not_begun() -> None:
    # The bootstrap waits for every engine; the Controller's own rules apply meanwhile.
    c = Controller(SPEC)
    d = c.tick(TickInput(now=10.0, engines=engines(0, e7={"healthy": False})))
    assert c.bootstrap.phase == "waiting" and "bootstrapping" not in d.reason
    assert [s.to for s in d.switches] == ["prefill"]  # restoring the prefill minimum


class _Moves(Prorsa):
    """The shipped Controller in the simulator; its switches and the weight updates."""

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        self.moves: list[tuple[float, str]] = []
        self.updates: list[float] = []
        sim.trainer.on_update_started.append(self.updates.append)

    def tick(self, now: float, *, scheduled: bool = True) -> None:
        super().tick(now, scheduled=scheduled)
        actions = self.last_actions
        if actions is not None and actions.decided:
            self.moves.extend((now, o.switch.to) for o in actions.execute)


def test_in_the_simulator_a_fresh_cluster_grows_past_1p_before_the_first_update() -> None:
    """qwen3-dp8 coding at staleness 2, seed 1: the first step asks for more prefill than
    the start split's 2P. Read from a 0P start, the cap before the first weight update
    held it at 2P for the whole step (7,038 s of the run's 9,272 s)."""
    policy = _Moves()
    simulate(Scenario(model="qwen3-dp8", task="coding", staleness=2, steps=2, seed=1), policy)
    assert policy.moves, "the Controller never moved"
    first_at, to = policy.moves[0]
    assert to == "prefill" and policy.updates and first_at < policy.updates[0]
