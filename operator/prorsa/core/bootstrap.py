"""What the Controller knows of the operator's bootstrap: a fresh cluster is at its start split.

Every engine pod starts as decode, and the bootstrap (:mod:`prorsa.core.actions`) flips
``roles.prefill.initial`` of them to prefill once all answer healthy. Those flips are the
deployment's, not the Controller's, and the first ticks of a fresh cluster see 0 prefill
instances while they run. Read as the workload's split, that start misleads everything the
Controller learns from its first ticks:

- the step-scale target's cap before the first weight update, "at most one instance over
  the start split" (:attr:`CycleProfile.first_split`), would sit at 1P instead of
  ``initial + 1``;
- a split with no prefill instance is below ``roles.prefill.min``, so the plan would
  "restore" it with switches of its own, which the bootstrap supersedes, priced, opened
  as switch measurements that the bootstrap's flips then end, and counted in the memory
  of how long demand leans one way;
- prompts queue with no prefill engine to serve them, a backlog the cycle profile would
  keep as the run's largest burst to drain;
- each bootstrap flip would start a cooldown, so the start split could not be left for
  ``switching.cooldownSeconds``, and be measured as one of the Controller's switches
  (its duration, its aborted decodes: it has none).

So while the bootstrap runs the Controller follows it with the same rule as
:func:`prorsa.core.actions.decide_actions` (all engines healthy and none prefill: a fresh
cluster; any prefill engine at first sight: a running one, after an operator restart),
counts its flips as prefill, holds at ``roles.prefill.initial`` and learns no cycle from
those ticks. The view is a value: :func:`follow_bootstrap` returns the next one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from prorsa.core.decision import Target
from prorsa.core.spec import RolloutClusterSpec
from prorsa.core.switch_cost import Persistence, Regret
from prorsa.core.types import Plan
from prorsa_contract.agent_api import EngineState, Role

# "waiting": not every engine has answered healthy yet, so the bootstrap has not begun
# (and the Controller acts as before it); "running": the bootstrap is bringing a fresh
# cluster to roles.prefill.initial; "done": it has, or the cluster was already running.
BootstrapPhase = Literal["waiting", "running", "done"]


@dataclass(frozen=True, kw_only=True)
class BootstrapReading:
    """What the bootstrap reads from the engines' states: the one rule the actions stage
    (which flips) and the Controller (which follows) both apply."""

    ready: bool  # every engine answers healthy: the bootstrap may begin
    have: int  # healthy prefill engines
    want: int  # roles.prefill.initial

    def settled(self, *, started: bool) -> bool:
        """Nothing left to bring up, or, before the bootstrap began, a prefill engine at
        first sight: a running cluster (an operator restart) keeps its split."""
        return self.have >= self.want or (self.have > 0 and not started)


def read_bootstrap(spec: RolloutClusterSpec, engines: Sequence[EngineState]) -> BootstrapReading:
    """The bootstrap's reading of this tick's engine states."""
    healthy = [s for s in engines if s.healthy]
    return BootstrapReading(
        ready=len(healthy) >= spec.instances,
        have=sum(1 for s in healthy if s.role == "prefill"),
        want=spec.initial_prefill(),
    )


@dataclass(frozen=True, kw_only=True)
class BootstrapView:
    """The bootstrap as the Controller follows it."""

    phase: BootstrapPhase = "waiting"
    # Instances the bootstrap flipped whose end the executor has not reported yet: their
    # end starts no cooldown and measures no switch of the Controller's.
    flips: frozenset[str] = frozenset()
    started_at: float | None = None  # the tick at which the bootstrap began

    @property
    def running(self) -> bool:
        return self.phase == "running"


def follow_bootstrap(
    view: BootstrapView,
    *,
    now: float,
    spec: RolloutClusterSpec,
    engines: Sequence[EngineState],
    issued: Mapping[str, Role],
) -> BootstrapView:
    """The view after this tick's engine states (``issued``: the switches the Controller
    started or resumed, which are its own, not the bootstrap's)."""
    if view.phase == "done":
        return view
    reading = read_bootstrap(spec, engines)
    if view.phase == "waiting":
        if not reading.ready:
            return view
        if reading.settled(started=False):
            return replace(view, phase="done")
        view = replace(view, phase="running", started_at=now)
    flips = view.flips | {s.instance for s in engines if s.switching and s.instance not in issued}
    if reading.ready and reading.settled(started=True):
        return replace(view, phase="done", flips=flips)
    return replace(view, flips=flips)


def bootstrap_issued(view: BootstrapView, issued: Mapping[str, Role]) -> Mapping[str, Role]:
    """``issued`` with the bootstrap's flips under way counted toward prefill: the split a
    fresh cluster is being brought to, not one with instances missing."""
    if not view.flips:
        return issued
    out: dict[str, Role] = {name: "prefill" for name in view.flips}
    out.update(issued)
    return out


def cycle_start(
    view: BootstrapView, spec: RolloutClusterSpec, *, now: float
) -> tuple[float, tuple[int, int]]:
    """When the run's first training step starts and its first split, for the step-cycle
    profile (:meth:`CycleProfile.begin`): the bootstrap's first tick (the first prompts
    prefill from empty caches, as after a weight update), at ``roles.prefill.initial``
    (its cap before the first weight update is one instance over it)."""
    want = spec.initial_prefill()
    start = view.started_at if view.started_at is not None else now
    return start, (want, spec.instances - want)


def holding_plan(spec: RolloutClusterSpec, *, persistence: Persistence, regret: Regret) -> Plan:
    """Steps 8-9 while the bootstrap runs: hold at the split it brings the cluster to,
    with no switch of the Controller's and the plan's memory as it was."""
    want = spec.initial_prefill()
    split = f"{want}P:{spec.instances - want}D"
    return Plan(
        target=Target(prefill=want, decode=spec.instances - want),
        switches=(),
        moves=(),
        held=f"bootstrapping: bringing the fresh engines to roles.prefill.initial ({split})",
        notes=(),
        persistence=persistence,
        regret=regret,
    )


def is_flip(view: BootstrapView, instance: str) -> bool:
    """Whether a switch of ``instance`` is the bootstrap's: one seen under way, or any
    while it runs (the Controller makes none then; a flip shorter than a tick is never
    seen switching)."""
    return view.running or instance in view.flips


def flip_ended(view: BootstrapView, instance: str) -> tuple[BootstrapView, bool]:
    """(the view once ``instance``'s switch ended, whether that switch was a bootstrap flip)."""
    if not is_flip(view, instance):
        return view, False
    return replace(view, flips=view.flips - {instance}), True
