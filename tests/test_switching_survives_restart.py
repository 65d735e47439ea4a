"""What the switch plan learned survives an operator restart (issue 34 part 3, issue 36).

A restarted operator that forgot the step-cycle profile held the split for two minutes
"learning the step's cycle" again, and priced its first moves with the 13 s prior instead
of the switch durations it had measured.
"""

from __future__ import annotations

import json

import pytest
from test_controller import plan_inputs, spec8
from test_step_cycle import two_steps

from prorsa.core.controller import Controller
from prorsa.core.switch_cost import CycleProfile, Persistence, Regret
from prorsa.core.switch_plan import plan_switches


def learned_controller() -> Controller:
    c = Controller(spec8())
    c.cycle = two_steps((3, 5), burst=200)
    for i, seconds in enumerate((21.0, 25.0, 23.0)):
        name = f"c-engine-{i}"
        c.switch_costs.started(name, at=100.0 * i, src="decode", kv_tokens=1000.0)
        c.switch_costs.finished(name, at=100.0 * i + seconds)
    c.persistence = c.persistence.after(0.0, toward="prefill")
    c.persistence = c.persistence.after(90.0, toward="decode")
    return c


def test_a_restarted_controller_keeps_switch_durations_and_the_step_cycle() -> None:
    first = learned_controller()
    saved = json.loads(json.dumps(first.learned_state()))
    second = Controller(spec8())
    second.restore_learned(saved)
    assert second.switch_costs.seconds == pytest.approx(first.switch_costs.seconds)
    assert second.switch_costs.seconds > 16.0  # measured ~21-25 s, not the 13 s prior
    assert second.switch_costs.measured == 3
    assert second.persistence.seconds == pytest.approx(first.persistence.seconds)
    # What a user sees: the same tick after the restart holds the split the step favours,
    # where an operator that forgot would hold it "learning the step's cycle".
    burst = plan_inputs(current=(3, 5), now=655.0)
    again = plan_switches(
        burst, persistence=Persistence(seconds=300), regret=Regret(), cycle=second.cycle
    )
    before = plan_switches(
        burst, persistence=Persistence(seconds=300), regret=Regret(), cycle=first.cycle
    )
    assert again.target == before.target and again.held == before.held
    assert "favours" in again.held
    forgot = plan_switches(
        burst, persistence=Persistence(seconds=300), regret=Regret(), cycle=CycleProfile()
    )
    assert "learning" in forgot.held


def test_a_state_saved_before_switching_was_persisted_still_loads() -> None:
    saved = json.loads(json.dumps(learned_controller().learned_state()))
    del saved["switching"]
    c = Controller(spec8())
    c.restore_learned(saved)
    assert c.switch_costs.measured == 0 and c.cycle.window(655.0, least=120) is None


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("switchSeconds",), "slow", "switching.switchSeconds"),
        (("abortShare",), 2.0, "out of range"),
        (("cycle", "ticks"), [[1, 2, 3]], "switching.cycle.ticks[0]"),
        (("cycle", "starts"), [float("nan")], "switching.cycle.start"),
    ],
)
def test_a_malformed_switching_state_is_refused_naming_the_field(
    path: tuple[str, ...], value: object, named: str
) -> None:
    saved = learned_controller().learned_state()
    section = saved["switching"]
    assert isinstance(section, dict)
    for key in path[:-1]:
        section = section[key]
    section[path[-1]] = value
    c = Controller(spec8())
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        c.restore_learned(saved)
    assert c.switch_costs.measured == 0  # nothing half-loaded from the bad section
