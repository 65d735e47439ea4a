"""The steps of one switch as a state machine: what comes next is decided here, with no I/O.

Appendix C's steps 2–6 on one engine pod branch on what each step saw: whether the router
dropped the pod, whether its agent could be reached, what the agent answered to the flip,
which role the engine reports. :func:`next_step` holds every one of those decisions, so
each can be tested alone (tests/test_switch_steps.py); the executor
(:mod:`prorsa.switching.executor`) performs a step's calls, reports what it saw as an
observation, and asks for the next step until the switch has ended.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Literal

from prorsa_contract.agent_api import Role, RoleResult
from prorsa_contract.labels import DRAINING, RoleLabel

SwitchResult = Literal["succeeded", "restored", "replaced", "lost"]
"""How a switch ended: ``result`` in ``status.switchHistory``, the ``result`` label of
``prorsa_switches_total`` (docs/metrics.md) and the ``Switch<Result>`` Event. Succeeded:
flipped; restored: labelled the role the engine reports (or never left); replaced: the pod
deleted to be recreated; lost: out of the router with its role unknown (the label
reconcile labels it once the agent answers)."""
SWITCH_RESULTS: tuple[SwitchResult, ...] = ("succeeded", "restored", "replaced", "lost")


class Step(Enum):
    """A step of a switch; each performs its calls, then :func:`next_step` picks the next."""

    LEAVE_ROUTER = "leave-router"
    """Step 2: the intent annotation (phase ``draining``) and the ``draining`` label, the
    group's workers too."""
    AWAIT_ROUTER = "await-router"
    """Step 2: until the router no longer lists the pod (no wait without a router)."""
    FIND_AGENT = "find-agent"
    """The agent's address; the pod is read again when the view had no IP."""
    FLIP = "flip"
    """Steps 3–4: the intent's phase turns ``switching``, then ``POST /v1/role``: the agent
    drains, aborts what is left, flips and verifies."""
    READ_ROLE = "read-role"
    """The role the engine reports (``GET /v1/state``), when it may not be the one asked."""
    RELABEL = "relabel"
    """Step 5 or 6: the role label (workers first), the intent cleared."""
    REPLACE = "replace"
    """Step 6 on an engine not safe to restore: delete the pod (and a bare group's workers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchState:
    """A switch between two steps: the step to perform next and what it needs."""

    step: Step
    origin: Role
    to: Role
    resume: bool
    """Finishing a switch a previous operator process left (its intent on the pod)."""
    flip: RoleResult | None = None
    """The agent's answer to ``POST /v1/role``, once asked."""
    label: RoleLabel | None = None
    """RELABEL: the role label it writes."""
    result: SwitchResult | None = None
    """RELABEL, REPLACE: how the switch ends once the step is done."""
    message: str = ""
    aborted_requests: int = 0


def begin(*, origin: Role, to: Role, resume: bool) -> SwitchState:
    """A switch's first step; a resumed one starts over (every step is idempotent)."""
    return SwitchState(step=Step.LEAVE_ROUTER, origin=origin, to=to, resume=resume)


@dataclass(frozen=True, slots=True, kw_only=True)
class Ended:
    """How a switch ended."""

    result: SwitchResult
    message: str
    aborted_requests: int = 0
    """Requests the agent aborted at the flip (0 when the pod was replaced)."""


# What a step saw, reported to next_step.
@dataclass(frozen=True, slots=True)
class Done:
    """The step's calls returned (LEAVE_ROUTER, RELABEL, REPLACE)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettled:
    """AWAIT_ROUTER: whether the router dropped the pod within its timeout."""

    dropped: bool
    ip: str | None
    timeout: float


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentFound:
    """FIND_AGENT: whether the pod has an address (an IP) for its agent."""

    found: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Flipped:
    """FLIP: the agent's answer."""

    result: RoleResult


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleRead:
    """READ_ROLE: the role the engine reports; None when its agent did not answer."""

    role: Role | None


Observation = Done | RouterSettled | AgentFound | Flipped | RoleRead


def _relabel(
    state: SwitchState,
    label: RoleLabel,
    result: SwitchResult,
    message: str,
    *,
    aborted: int = 0,
) -> SwitchState:
    return replace(
        state,
        step=Step.RELABEL,
        label=label,
        result=result,
        message=message,
        aborted_requests=aborted,
    )


def next_step(state: SwitchState, seen: Observation) -> SwitchState | Ended:
    """The step after ``state.step``, given what it saw; Ended once the switch is over.

    Raises ValueError when ``seen`` is not what that step reports.
    """
    match state.step, seen:
        case Step.LEAVE_ROUTER, Done():
            return replace(state, step=Step.AWAIT_ROUTER)
        case Step.AWAIT_ROUTER, RouterSettled(dropped=True):
            return replace(state, step=Step.FIND_AGENT)
        case Step.AWAIT_ROUTER, RouterSettled(ip=ip, timeout=timeout):
            # A flip now could leave the router sending the old role's requests to the new
            # role (decode requests answered with a prefill engine's single token). Undo
            # step 2 instead; the Controller asks again. A resumed switch may have flipped
            # already: its label follows what the agent reports.
            message = f"router did not confirm it dropped {ip} within {timeout:.0f}s; not switched"
            if state.resume:
                return replace(state, step=Step.READ_ROLE, message=message)
            return _relabel(state, state.origin, "restored", message)
        case Step.FIND_AGENT, AgentFound(found=True):
            return replace(state, step=Step.FLIP)
        case Step.FIND_AGENT, AgentFound():
            # Never reached: unchanged.
            return _relabel(state, state.origin, "restored", "pod has no IP")
        case Step.FLIP, Flipped(result=answer):
            flipped = replace(state, flip=answer)
            if answer.ok:
                message = answer.message or f"{state.origin} -> {state.to}"
                return _relabel(
                    flipped, state.to, "succeeded", message, aborted=answer.aborted_requests
                )
            if answer.safe_to_restore:
                # Label the role the engine is actually in: a switch can fail after the
                # flip (verification) or be refused once it already happened.
                return replace(flipped, step=Step.READ_ROLE, message=answer.message)
            # A multi-node group is replaced whole: its other ranks cannot join a new rank 0.
            message = answer.message or "engine unhealthy after a failed switch"
            return replace(
                flipped, step=Step.REPLACE, result="replaced", message=message, aborted_requests=0
            )
        case Step.READ_ROLE, RoleRead(role=role):
            aborted = state.flip.aborted_requests if state.flip is not None else 0
            if role is not None:
                return _relabel(state, role, "restored", state.message, aborted=aborted)
            # An agent that does not answer leaves the role unknown; a guess would route
            # requests to the wrong side, so the pod stays out of the router until the
            # reconcile sees its role.
            message = state.message
            if state.flip is not None:
                message = f"engine role unknown: {state.flip.message}"
            return _relabel(state, DRAINING, "lost", message, aborted=aborted)
        case ((Step.RELABEL | Step.REPLACE), Done()) if state.result is not None:
            return Ended(
                result=state.result,
                message=state.message,
                aborted_requests=state.aborted_requests,
            )
    raise ValueError(f"switch step {state.step.value} cannot follow from {seen!r}")
