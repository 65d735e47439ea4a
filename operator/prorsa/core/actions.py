"""What of a Decision is carried out: the bootstrap switches and the switching-mode gate.

The Controller decides a split; deploying the cluster and ``spec.switching.mode`` decide
which switches are made. Both are decisions, so they live here, sans I/O, and the
operator's runtime, ``prorsa plan`` and the simulator run the same stage: what the
simulator measures is what the operator does.

- **Bootstrap.** Every engine starts as decode (PD without a prefill engine serves
  nothing), so fresh engines are brought to ``roles.prefill.initial`` once, in every mode,
  when all of them answer healthy, all at once. ``switching.maxConcurrent`` bounds the
  capacity a switch takes out of service, and a cluster with no prefill engine serves
  nothing, so the bound has nothing to protect there. Flipped one at a time, the first
  engine up alone takes every prompt queued since the start, and smg's cache-aware
  routing keeps sending those trajectories' next turns to the prefix cache it holds,
  while the other prefill engines idle (docs/benchmarks.md, "The operator's bootstrap and
  mode gate in the simulator"). A cluster that already has a prefill engine when the
  stage first sees it is running (an operator restart): its split is the Controller's,
  or the user's in Recommend and Off, not one to reset to ``initial``.
- **The gate.** ``Auto`` executes the Decision's switches; ``Recommend`` executes none and
  announces them (a ``SwitchRecommended`` Event) once per change of advice; ``Off``
  executes and announces nothing. What the Controller expected a switch to save and cost
  is counted when it is made (Auto) or recommended (Recommend); a bootstrap switch is not
  priced.

The stage keeps its state as a value: :func:`decide_actions` returns the next
:class:`ActionState` and never changes the one it is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prorsa.core.bootstrap import read_bootstrap
from prorsa.core.decision import Decision, Switch
from prorsa.core.spec import RolloutClusterSpec
from prorsa.core.switch_cost import Move
from prorsa_contract.agent_api import EngineState

SwitchingMode = Literal["Auto", "Recommend", "Off"]
# (instance, from, to) of each switch recommended: what "a change of advice" compares.
Advice = tuple[tuple[str, str, str], ...]


@dataclass(frozen=True, kw_only=True)
class ActionState:
    """What the stage remembers from one tick to the next (a new one per operator process:
    ``bootstrap_started`` is what tells a fresh cluster from a running one)."""

    bootstrapped: bool = False  # the cluster reached roles.prefill.initial, or was running
    bootstrap_started: bool = False  # this process began bringing engines to initial
    last_advice: Advice = ()  # the last recommendation, announced or not


@dataclass(frozen=True, kw_only=True)
class Order:
    """One switch to make or to recommend, with the Controller's price for it (None for a
    bootstrap switch, or a switch the Controller did not price)."""

    switch: Switch
    move: Move | None = None


@dataclass(frozen=True, kw_only=True)
class Actions:
    """This tick's part of carrying out a Decision."""

    execute: tuple[Order, ...]  # hand to the switch executor now, in this order
    bootstrap: bool  # ``execute`` are bootstrap switches, not the Controller's
    # Recommend, when the advice changed: announce these and count their prices now.
    announce: tuple[Order, ...]
    state: ActionState  # the stage's state for the next tick

    @property
    def decided(self) -> bool:
        """``execute`` holds the Controller's switches (Auto): count the price of each one
        the executor starts, and how late the decision came when any starts."""
        return bool(self.execute) and not self.bootstrap


def decide_actions(
    *,
    decision: Decision,
    mode: SwitchingMode,
    spec: RolloutClusterSpec,
    states: Iterable[EngineState],
    state: ActionState,
) -> Actions:
    """The switches to execute and to announce at this tick, and the stage's next state.

    ``states`` are the engines that answered this tick (switching ones included); an
    engine that did not answer counts as not healthy.
    """
    engines = list(states)
    bootstrapped, started = state.bootstrapped, state.bootstrap_started
    bootstrap: tuple[Switch, ...] = ()
    if not bootstrapped:
        bootstrap, bootstrapped, started = _bootstrap(spec, engines, started=started)
    diag = decision.diagnostics
    priced = {m.instance: m for m in diag.made} if diag is not None else {}
    execute: tuple[Order, ...] = ()
    if bootstrap:
        execute = tuple(Order(switch=s) for s in bootstrap)
    elif mode == "Auto":
        execute = tuple(Order(switch=s, move=priced.get(s.instance)) for s in decision.switches)
    announce: tuple[Order, ...] = ()
    last_advice = state.last_advice
    # While this process bootstraps, the Controller's advice is about a split the
    # bootstrap is still making: nothing is recommended, and the last advice is kept.
    if mode == "Recommend" and (bootstrapped or not started):
        advice: Advice = tuple((s.instance, s.from_, s.to) for s in decision.switches)
        if advice and advice != last_advice:
            announce = tuple(
                Order(switch=s, move=priced.get(s.instance)) for s in decision.switches
            )
        last_advice = advice
    return Actions(
        execute=execute,
        bootstrap=bool(bootstrap),
        announce=announce,
        state=ActionState(
            bootstrapped=bootstrapped, bootstrap_started=started, last_advice=last_advice
        ),
    )


def _bootstrap(
    spec: RolloutClusterSpec, engines: list[EngineState], *, started: bool
) -> tuple[tuple[Switch, ...], bool, bool]:
    """(switches, bootstrapped, started): the decode -> prefill flips still to start toward
    ``roles.prefill.initial``, all at once (not bounded by ``switching.maxConcurrent``:
    see the module's docstring), least instance name first."""
    reading = read_bootstrap(spec, engines)
    if not reading.ready:
        return (), False, started  # wait until every engine is up
    if reading.settled(started=started):
        return (), True, started
    # Flips under way not yet counted in ``have`` (an engine switching from decode).
    flipping = sum(1 for s in engines if s.switching and s.role != "prefill")
    left = reading.want - reading.have - flipping
    if left <= 0:
        return (), False, True
    todo = sorted(
        (s for s in engines if s.healthy and s.role == "decode" and not s.switching),
        key=lambda s: s.instance,
    )[:left]
    return (
        tuple(Switch(instance=s.instance, from_="decode", to="prefill") for s in todo),
        False,
        True,
    )
