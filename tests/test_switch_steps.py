"""The switch's state machine (prorsa.switching.steps), one transition at a time.

Each test names a step, what that step saw, and the step (or end) that must follow: the
decisions the executor used to take inline in one long coroutine, and which the operator's
end-to-end tests reach only a few of.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from prorsa.control.metrics import SWITCH_RESULTS as METRIC_RESULTS
from prorsa.switching.steps import (
    SWITCH_RESULTS,
    AgentFound,
    Done,
    Ended,
    Flipped,
    Observation,
    RoleRead,
    RouterSettled,
    Step,
    SwitchResult,
    SwitchState,
    begin,
    next_step,
)
from prorsa_contract.agent_api import RoleResult
from prorsa_contract.labels import RoleLabel

ROOT = Path(__file__).resolve().parent.parent


def at(
    step: Step,
    *,
    resume: bool = False,
    flip: RoleResult | None = None,
    label: RoleLabel | None = None,
    result: SwitchResult | None = None,
    message: str = "",
    aborted_requests: int = 0,
) -> SwitchState:
    """A decode -> prefill switch about to perform ``step``."""
    return SwitchState(
        step=step,
        origin="decode",
        to="prefill",
        resume=resume,
        flip=flip,
        label=label,
        result=result,
        message=message,
        aborted_requests=aborted_requests,
    )


def moved(state: SwitchState | Ended) -> SwitchState:
    assert isinstance(state, SwitchState), state
    return state


def test_a_switch_starts_by_leaving_the_router() -> None:
    first = begin(origin="decode", to="prefill", resume=True)
    assert first == at(Step.LEAVE_ROUTER, resume=True)


def test_once_labelled_draining_it_waits_for_the_router() -> None:
    assert moved(next_step(at(Step.LEAVE_ROUTER), Done())).step is Step.AWAIT_ROUTER


def test_a_router_that_dropped_the_pod_lets_it_find_its_agent() -> None:
    seen = RouterSettled(dropped=True, ip="10.0.0.7", timeout=30.0)
    assert moved(next_step(at(Step.AWAIT_ROUTER), seen)).step is Step.FIND_AGENT


def test_a_router_that_kept_the_pod_puts_a_new_switch_back_in_its_old_role() -> None:
    seen = RouterSettled(dropped=False, ip="10.0.0.7", timeout=30.0)
    after = moved(next_step(at(Step.AWAIT_ROUTER), seen))
    assert (after.step, after.label, after.result) == (Step.RELABEL, "decode", "restored")
    assert after.message == "router did not confirm it dropped 10.0.0.7 within 30s; not switched"


def test_a_router_that_kept_a_resumed_switch_asks_the_engine_its_role() -> None:
    # A previous operator may have flipped it already: the label follows the engine.
    seen = RouterSettled(dropped=False, ip="10.0.0.7", timeout=30.0)
    after = moved(next_step(at(Step.AWAIT_ROUTER, resume=True), seen))
    assert after.step is Step.READ_ROLE and after.result is None
    assert after.message.startswith("router did not confirm it dropped 10.0.0.7")


def test_a_resumed_switch_the_router_kept_is_labelled_the_role_its_engine_reports() -> None:
    kept = at(Step.READ_ROLE, resume=True, message="router did not confirm")
    after = moved(next_step(kept, RoleRead(role="prefill")))
    assert (after.step, after.label, after.result) == (Step.RELABEL, "prefill", "restored")
    assert (after.message, after.aborted_requests) == ("router did not confirm", 0)


def test_a_resumed_switch_the_router_kept_with_no_agent_is_lost_draining() -> None:
    kept = at(Step.READ_ROLE, resume=True, message="router did not confirm")
    after = moved(next_step(kept, RoleRead(role=None)))
    assert (after.step, after.label, after.result) == (Step.RELABEL, "draining", "lost")
    assert after.message == "router did not confirm"


def test_a_pod_with_an_agent_address_is_flipped() -> None:
    assert moved(next_step(at(Step.FIND_AGENT), AgentFound(found=True))).step is Step.FLIP


def test_a_pod_with_no_ip_goes_back_unchanged() -> None:
    after = moved(next_step(at(Step.FIND_AGENT), AgentFound(found=False)))
    assert (after.step, after.label, after.result) == (Step.RELABEL, "decode", "restored")
    assert after.message == "pod has no IP"


def test_a_flip_the_agent_confirms_is_labelled_the_new_role() -> None:
    answer = RoleResult(ok=True, old_role="decode", new_role="prefill", aborted_requests=3)
    after = moved(next_step(at(Step.FLIP), Flipped(result=answer)))
    assert (after.step, after.label, after.result) == (Step.RELABEL, "prefill", "succeeded")
    # No message from the agent: the direction.
    assert (after.message, after.aborted_requests) == ("decode -> prefill", 3)
    said = RoleResult(ok=True, message="flipped in 1.2 s")
    assert moved(next_step(at(Step.FLIP), Flipped(result=said))).message == "flipped in 1.2 s"


def test_a_flip_refused_safely_asks_the_engine_its_role() -> None:
    # It may have failed after the flip (verification), or been refused once it happened.
    answer = RoleResult(ok=False, safe_to_restore=True, aborted_requests=2, message="busy")
    after = moved(next_step(at(Step.FLIP), Flipped(result=answer)))
    assert (after.step, after.flip, after.result) == (Step.READ_ROLE, answer, None)


def test_after_a_refused_flip_the_pod_gets_the_role_its_engine_reports() -> None:
    answer = RoleResult(ok=False, safe_to_restore=True, aborted_requests=2, message="busy")
    refused = at(Step.READ_ROLE, flip=answer, message="busy")
    after = moved(next_step(refused, RoleRead(role="decode")))
    assert (after.step, after.label, after.result) == (Step.RELABEL, "decode", "restored")
    assert (after.message, after.aborted_requests) == ("busy", 2)


def test_after_a_refused_flip_an_agent_gone_silent_leaves_the_pod_draining() -> None:
    # A guess would route requests to the wrong side; the label reconcile labels it later.
    answer = RoleResult(ok=False, safe_to_restore=True, aborted_requests=2, message="busy")
    refused = at(Step.READ_ROLE, flip=answer, message="busy")
    after = moved(next_step(refused, RoleRead(role=None)))
    assert (after.step, after.label, after.result) == (Step.RELABEL, "draining", "lost")
    assert (after.message, after.aborted_requests) == ("engine role unknown: busy", 2)


def test_a_flip_not_safe_to_restore_replaces_the_pod() -> None:
    answer = RoleResult(ok=False, safe_to_restore=False, aborted_requests=4)
    after = moved(next_step(at(Step.FLIP), Flipped(result=answer)))
    assert (after.step, after.result) == (Step.REPLACE, "replaced")
    # The outcome reports no aborted requests for a replaced pod (as before the machine).
    assert (after.message, after.aborted_requests) == ("engine unhealthy after a failed switch", 0)
    said = RoleResult(ok=False, safe_to_restore=False, message="restart required")
    assert moved(next_step(at(Step.FLIP), Flipped(result=said))).message == "restart required"


@pytest.mark.parametrize("step", [Step.RELABEL, Step.REPLACE])
def test_the_last_step_done_ends_the_switch_as_it_decided(step: Step) -> None:
    last = at(step, label="prefill", result="succeeded", message="m", aborted_requests=5)
    assert next_step(last, Done()) == Ended(result="succeeded", message="m", aborted_requests=5)


def test_an_observation_a_step_does_not_make_is_refused_naming_the_step() -> None:
    with pytest.raises(ValueError, match="switch step flip cannot follow from RoleRead"):
        next_step(at(Step.FLIP), RoleRead(role="prefill"))
    with pytest.raises(ValueError, match="switch step relabel"):
        next_step(at(Step.RELABEL), Done())  # no end decided


# One observation of each kind and outcome, to walk every path of the machine.
OBSERVATIONS: list[Observation] = [
    Done(),
    RouterSettled(dropped=True, ip="10.0.0.7", timeout=30.0),
    RouterSettled(dropped=False, ip="10.0.0.7", timeout=30.0),
    AgentFound(found=True),
    AgentFound(found=False),
    Flipped(result=RoleResult(ok=True)),
    Flipped(result=RoleResult(ok=False, safe_to_restore=True)),
    Flipped(result=RoleResult(ok=False, safe_to_restore=False)),
    RoleRead(role="prefill"),
    RoleRead(role=None),
]


def test_every_path_ends_within_six_steps_and_every_step_and_result_is_reached() -> None:
    steps: set[Step] = set()
    results: set[str] = set()
    frontier = [begin(origin="decode", to="prefill", resume=r) for r in (False, True)]
    for _ in range(6):
        following: list[SwitchState] = []
        for state, seen in itertools.product(frontier, OBSERVATIONS):
            steps.add(state.step)
            try:
                after = next_step(state, seen)
            except ValueError:
                continue
            if isinstance(after, Ended):
                results.add(after.result)
            elif after not in following:
                following.append(after)
        frontier = following
    assert not frontier, f"still switching after six steps: {frontier}"
    assert steps == set(Step)
    assert results == set(SWITCH_RESULTS)


def test_the_results_are_the_switch_metric_labels() -> None:
    # docs/metrics.md: prorsa_switches_total's result label; a new result is a new series.
    assert set(SWITCH_RESULTS) == set(METRIC_RESULTS)


def test_mypy_refuses_a_misspelt_result_or_phase(tmp_path: Path) -> None:
    """Results and intent phases are Literals: a typo is a type error, not a new value on
    the wire (a status entry or a metric label no dashboard knows)."""
    checked = tmp_path / "misspelt.py"
    checked.write_text(
        "from prorsa.switching.steps import Ended\n"
        "from prorsa_contract.labels import switch_intent\n"
        'Ended(result="succeded", message="")\n'
        'switch_intent(to="prefill", phase="drainning", started="t", origin="decode")\n'
        'def ok(e: Ended) -> bool:\n    return e.result == "suceeded"\n'
    )
    config = ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path)]
    run = subprocess.run(
        [sys.executable, "-m", "mypy", *config, str(checked)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert '"result" to "Ended" has incompatible type "Literal[\'succeded\']"' in run.stdout
    assert '"phase" to "switch_intent" has incompatible type "Literal[\'drainning\']"' in run.stdout
    assert "Non-overlapping equality check" in run.stdout
