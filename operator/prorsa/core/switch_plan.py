"""The switch plan of a tick: hold rules, then Appendix C step 1, priced.

Eq. 1 says which split fits the demand best; this says which switches toward it are worth
making now. The hold rules keep the current split while it is good enough; each move
toward the target is then one instance, priced in seconds of wall time against what it
saves over the payoff horizon (:mod:`prorsa.core.switch_cost`), and made while it pays.
The plan's memory, how long demand keeps leaning one way (:class:`Persistence`) and what
holding has cost so far (:class:`Regret`), is passed in as values, and the plan returns
the memory after this tick for the Controller to keep.

With ``switching.stepCycle`` (the default) and the trainer's events flowing, the target
is the step's instead (:class:`CycleProfile`): the split that would have served the last
training steps best, re-prefill bursts and calm alike, so that the Controller does not
move instances into each burst after a weight update and back once caches refill.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace

from prorsa.core.allocate import Allocation, keep_split
from prorsa.core.decision import Switch, Target
from prorsa.core.measure import CACHE_FILL
from prorsa.core.spec import SwitchingSpec
from prorsa.core.switch_cost import (
    CycleProfile,
    Load,
    Move,
    Persistence,
    Regret,
    price_move,
    slowdown,
    window_demand,
)
from prorsa.core.types import Plan, PlanInputs
from prorsa_contract.agent_api import EngineState, Role

# Before a weight update closes the first cycle, the one under way is read once it is this
# many horizons long (two minutes at the default 10 s).
CYCLE_LEAST_HORIZONS = 12
HOLD_WHILE_LEARNING = True
# A move toward the step-scale target must save this many times what it costs: the target
# is read from a window that slides, and a move that barely pays is within its noise.
CYCLE_MARGIN = 2.0


def plan_switches(
    inputs: PlanInputs,
    *,
    persistence: Persistence,
    regret: Regret,
    cycle: CycleProfile | None = None,
) -> Plan:
    """Where the split goes this tick and the switches that take it there.

    Once a weight update has closed a training step, the target is the split that would
    have served the last step's cycle best (:class:`CycleProfile`), not Eq. 1 on the next
    minutes: the re-prefill burst after each update and the calm once caches refill are
    two phases of one cycle, and chasing each pays a switch both ways every step. The
    step-scale plan leaves ``persistence`` and ``regret`` as they were.
    """
    sized = inputs.sizing
    cur_p, cur_d = inputs.current
    forced = cur_p < sized.min_prefill or cur_d < sized.min_decode
    if cycle is not None and not forced:
        plan = _cycle_plan(inputs, cycle, persistence=persistence, regret=regret)
        if plan is not None:
            return plan
        if HOLD_WHILE_LEARNING:
            why = f"holding {cur_p}P:{cur_d}D: learning the step's cycle"
            return Plan(
                target=Target(prefill=cur_p, decode=cur_d),
                switches=(),
                moves=(),
                held=why,
                notes=(),
                persistence=persistence,
                regret=regret,
            )
    target, held = hold(
        sized.best,
        inputs.current,
        sized.a,
        sized.b,
        min_prefill=sized.min_prefill,
        min_decode=sized.min_decode,
        switching=inputs.switching,
    )
    # Which way Eq. 1 leans from the current split, for how long demand keeps a lean.
    best = sized.best
    lean = {1: "prefill", -1: "decode"}.get((best.prefill > cur_p) - (best.prefill < cur_p))
    persistence = persistence.after(
        inputs.now, toward=lean, prefill=cur_p, grace=inputs.switching.smoothing_seconds
    )
    payoff = min(persistence.seconds, inputs.switching.payoff_seconds)
    load = _window_load(inputs, prefill_instances=cur_p, seconds=payoff)
    step = (target.prefill > cur_p) - (target.prefill < cur_p)
    toward = {1: "prefill", -1: "decode"}.get(step)
    rate = 1.0 - slowdown(cur_p + step, cur_d - step, load) / slowdown(cur_p, cur_d, load)
    regret = regret.after(inputs.now, toward=toward, rate=rate if toward else 0.0)
    switches, moves = _priced_moves(
        inputs, target, demand=load, forced=forced, regret=regret.seconds, payoff=payoff
    )
    made = [m for m in moves if m.worth_it or forced]
    notes = []
    if made:
        regret = regret.reset()
        notes.append("switching: " + "; ".join(m.describe() for m in made))
    if len(made) < len(moves):
        # The next move does not pay for itself: aim where the made ones lead.
        notes.append("holding: " + moves[len(made)].describe())
        reached = cur_p + step * len(made)
        target = Target(prefill=reached, decode=cur_p + cur_d - reached)
    return Plan(
        target=target,
        switches=tuple(switches),
        moves=tuple(moves),
        held=held,
        notes=tuple(notes),
        persistence=persistence,
        regret=regret,
    )


def _cycle_plan(
    inputs: PlanInputs, cycle: CycleProfile, *, persistence: Persistence, regret: Regret
) -> Plan | None:
    """The plan toward the split the last step's cycle favours (None: no cycle closed yet).

    Each move toward it is credited with the share of a cycle it saves (one split nearer
    the best) over the payoff horizon, and priced as any other move, without the cost of a
    move back: the target is the step's, not the minute's, so it is not expected to turn.
    """
    sized = inputs.sizing
    cur_p, cur_d = inputs.current
    total = cur_p + cur_d
    window = cycle.window(inputs.now, least=CYCLE_LEAST_HORIZONS * inputs.horizon)
    splits = [(p, total - p) for p in range(sized.min_prefill, total - sized.min_decode + 1)]
    if window is None or (cur_p, cur_d) not in splits:
        return None
    length = window[1] - window[0]
    totals = cycle.totals(splits, window)
    if length <= 0:
        return None
    seconds = dict(zip(splits, totals, strict=True))
    here = seconds[(cur_p, cur_d)]
    best = min(splits, key=lambda sp: (seconds[sp], abs(sp[0] - cur_p)))
    if not seconds[best] < here:
        best = (cur_p, cur_d)
    first = cycle.first_split
    if not cycle.after_update and first is not None:
        # Not yet seen: the re-prefill burst after a weight update. Prefill is not given
        # up on a window that lacks it (a step's calm alone favours decode). Before the
        # first weight update, on so little of the run, at most one instance is added to
        # the start split; once an update has closed the run's first step (which began,
        # like a step after an update, with every prompt prefilled from empty caches), the
        # split that step favours is the start split the workload asks for.
        top = total if cycle.closed else max(cur_p, first[0] + 1)
        p = min(max(best[0], cur_p), top)
        best = (p, total - p)
    target = Target(prefill=best[0], decode=best[1])
    if best == (cur_p, cur_d):
        why = f"holding {cur_p}P:{cur_d}D: the split the last step's cycle ({length:.0f}s) favours"
        return Plan(
            target=target,
            switches=(),
            moves=(),
            held=why,
            notes=(),
            persistence=persistence,
            regret=regret,
        )
    payoff = inputs.switching.payoff_seconds

    def gain_of(before: tuple[int, int], after: tuple[int, int]) -> float:
        if after not in seconds:
            return -math.inf
        return (seconds[before] - seconds[after]) / length * payoff

    load = _window_load(inputs, prefill_instances=cur_p, seconds=payoff, as_profiled=True)
    switches, moves = _priced_moves(
        inputs,
        target,
        demand=load,
        forced=False,
        regret=0.0,
        payoff=payoff,
        gain_of=gain_of,
        margin=CYCLE_MARGIN,
    )
    made = moves[: len(switches)]
    notes = [f"the last step's cycle ({length:.0f}s) favours {best[0]}P:{best[1]}D"]
    if made:
        notes.append("switching: " + "; ".join(m.describe() for m in made))
    if len(made) < len(moves):
        notes.append("holding: " + moves[len(made)].describe())
        step = (best[0] > cur_p) - (best[0] < cur_p)
        reached = cur_p + step * len(made)
        target = Target(prefill=reached, decode=total - reached)
    return Plan(
        target=target,
        switches=tuple(switches),
        moves=tuple(moves),
        held="",
        notes=tuple(notes),
        persistence=persistence,
        regret=regret,
    )


def _window_load(
    inputs: PlanInputs, *, prefill_instances: int, seconds: float, as_profiled: bool = False
) -> Load:
    """The demand a move is priced on over ``seconds``, from the tick's sizing.

    ``as_profiled``: on the load the step-cycle profile records (Eq. 1's b and knees, no
    queueing below capacity in :func:`slowdown`), for a move whose gain that profile gives:
    its gain and its cost then come from one model. The profile counts the prefill queue
    its own way (:func:`~prorsa.core.switch_cost.turn_time`).
    """
    sized = inputs.sizing
    if as_profiled:
        now, ahead, knees = (sized.now_demand[0], sized.demand.b), (sized.ahead[0], sized.b), None
    else:
        now, ahead, knees = sized.now_demand, sized.ahead, sized.priced_knees
    load = window_demand(
        backlog=sized.backlog,
        queued=sized.queued,
        prefill_instances=prefill_instances,
        now=now,
        ahead=ahead,
        horizon=inputs.horizon,
        seconds=seconds,
        knees=sized.knees if knees is None else knees,
        decode_share=sized.decode_share,
    )
    # Queueing below capacity needs arrivals known to recur, which only a forecast tells
    # from work drained once: engine queues alone (reactive mode) are a backlog, not a rate.
    if as_profiled or sized.demand.mode != "predictive":
        return replace(load, recurring=None, measured_prefill=None)
    return load


def hold(
    best: Allocation,
    current: tuple[int, int],
    a: float,
    b: float,
    *,
    min_prefill: int,
    min_decode: int,
    switching: SwitchingSpec,
) -> tuple[Target, str]:
    """Keep the current split unless the best one is clearly better (no flapping).

    Returns the target and why the current split is kept ("" when it is not).
    """
    cur_p, cur_d = current
    if (best.prefill, best.decode) == (cur_p, cur_d):
        return Target(prefill=cur_p, decode=cur_d), ""
    if cur_p < min_prefill or cur_d < min_decode:
        return Target(prefill=best.prefill, decode=best.decode), "restoring role minimums"
    if a <= 0 and b <= 0:
        return Target(prefill=cur_p, decode=cur_d), "no demand: holding the current split"
    why = keep_split(
        best,
        (cur_p, cur_d),
        a,
        b,
        hysteresis=switching.hysteresis,
        hold_margin=switching.hold_margin,
    )
    if why:
        return Target(prefill=cur_p, decode=cur_d), why
    return Target(prefill=best.prefill, decode=best.decode), ""


def _priced_moves(
    inputs: PlanInputs,
    target: Target,
    *,
    demand: Load,
    forced: bool,
    regret: float,
    payoff: float,
    gain_of: Callable[[tuple[int, int], tuple[int, int]], float] | None = None,
    margin: float = 1.0,
) -> tuple[list[Switch], list[Move]]:
    """Appendix C step 1, priced: the cheapest eligible instances, while worth it.

    Each move toward the target is one instance; it is made when what it saves over the
    payoff horizon exceeds what the switch costs (see :mod:`prorsa.core.switch_cost`).
    Restoring a role minimum is never priced.
    """
    current = inputs.current
    need = target.prefill - current[0]
    if not need or not inputs.engines:
        return [], []
    slots = inputs.switching.max_concurrent - inputs.in_progress
    if slots <= 0:
        return [], []
    src: Role = "decode" if need > 0 else "prefill"
    dst: Role = "prefill" if need > 0 else "decode"
    eligible = [
        s
        for s in inputs.engines
        if s.role == src
        and s.healthy
        and not s.switching
        and inputs.cooldown_until.get(s.instance, -math.inf) <= inputs.now
    ]
    contexts = inputs.contexts

    def lost_by(s: EngineState) -> float:
        return lost_tokens(
            s,
            contexts=contexts,
            abort_share=inputs.abort_share,
            cache_tokens=inputs.capacity.prefill_cache_tokens,
            cache_scale=inputs.cache_scale,
        )

    lost = {s.instance: lost_by(s) for s in eligible}
    # A move back later would throw away what a typical instance of the other role holds.
    others = [lost_by(s) for s in inputs.engines if s.role == dst]
    back = sum(others) / len(others) if others else 0.0
    if gain_of is not None:
        back = 0.0  # a step-scale target is not expected to turn back
    if src == "decode":
        eligible.sort(
            key=lambda s: (
                lost[s.instance],
                s.running_requests + s.waiting_requests,
                s.instance,
            )
        )
    else:
        eligible.sort(
            key=lambda s: (
                lost[s.instance],
                s.waiting_tokens,
                s.running_requests + s.waiting_requests,
                s.instance,
            )
        )
    per_token = (inputs.calibration or 1.0) / inputs.capacity.prefill_tokens_per_second
    switches: list[Switch] = []
    moves: list[Move] = []
    split = current
    for s in eligible[: min(abs(need), slots)]:
        move = price_move(
            instance=s.instance,
            src=src,
            current=split,
            demand=demand,
            payoff_seconds=payoff,
            switch_seconds=inputs.switch_seconds,
            lost_tokens=lost[s.instance],
            return_tokens=back,
            prefill_seconds_per_token=per_token,
            regret=regret if not moves else 0.0,
        )
        step = 1 if src == "decode" else -1
        after = (split[0] + step, split[1] - step)
        if gain_of is not None:
            move = replace(move, gain=gain_of(split, after))
        moves.append(move)
        if not (forced or move.gain > margin * move.cost):
            break
        switches.append(Switch(instance=s.instance, from_=src, to=dst))
        split = after
    return switches, moves


def lost_tokens(
    s: EngineState,
    *,
    contexts: Mapping[str, float],
    abort_share: float,
    cache_tokens: int | None,
    cache_scale: float,
) -> float:
    """Prefill tokens a switch of this instance throws away.

    A prefill instance's prefix cache is flushed: the live trajectories whose last
    prefill ran there (``contexts``, by instance) recompute their contexts, up to what its
    cache can hold (``cache_tokens``, ``capacity.prefillCacheTokens``; unset, its KV
    capacity times ``cache_scale``). A decode instance aborts what still runs at the drain
    timeout (``abort_share`` of its KV), and those requests prefill their contexts again.
    """
    if s.role == "decode":
        return s.kv_used_tokens * abort_share
    held = contexts.get(s.instance, 0.0)
    per = cache_tokens
    if per is None:
        per = int(s.kv_capacity_tokens * cache_scale)
    # No prefix cache (0), e.g. engines without a radix cache: nothing to flush.
    return min(held, CACHE_FILL * per) if per > 0 else 0.0
