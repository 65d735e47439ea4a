"""Step 7 of a tick: Eq. 1 on the demand expected to persist, with its floors, in budget.

The split is sized for the demand smoothed over ``switching.smoothingSeconds``; switches
are priced on this tick's demand for the coming horizon and the smoothed one beyond. The
prefix-cache floor is averaged the same way: a burst of new trajectories that is gone a
minute later does not flip roles either. The share of a turn spent decoding is averaged
over the payoff horizon.

A stage like the others: it reads one frozen :class:`SizingInputs` and the two smoothers
(values too), and returns the :class:`Sizing` with the smoothers that have this tick folded
in, which the Controller keeps for the next one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from prorsa.core import measure
from prorsa.core.allocate import Allocation, margin_of, solve
from prorsa.core.estimators import DemandSmoother
from prorsa.core.types import Sizing, SizingInputs


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    """What the sizing stage returns: the tick's sizing and the smoothers to keep."""

    sizing: Sizing
    smoother: DemandSmoother  # a, b, cache floor, arrival rate, knees
    share_smoother: DemandSmoother  # the decode share of a turn


def size(
    inputs: SizingInputs, *, smoother: DemandSmoother, share_smoother: DemandSmoother
) -> Sized:
    """Eq. 1's best split for the smoothed demand, with the role minimums the budget allows."""
    spec, S, counts = inputs.spec, inputs.horizon, inputs.counts
    demand = inputs.demand
    conc = spec.capacity.decode_concurrency
    throughput = measure.decode_throughput_demand(demand.decoding, counts.decode, concurrency=conc)
    # Switches are priced on the decode load expected over the horizon, not Eq. 1's: the
    # horizon's admissions count for the share of it they are expected to stay in decode
    # (Demand.resident), as KV and as requests in the decode batch (issue 34).
    leaves = 1.0 - min(max(demand.resident, 0.0), 1.0)
    resident_decoding = max(demand.decoding - max(demand.pending, 0.0) * leaves, 0.0)
    resident_b = max(
        demand.b - max(demand.admitted, 0.0) * leaves,
        measure.decode_throughput_demand(resident_decoding, counts.decode, concurrency=conc),
    )
    demand = replace(demand, b=max(demand.b, throughput))
    # New weights flush every prefix cache: nothing cached is worth protecting.
    cache_now = 0.0 if inputs.weight_update else inputs.cache_floor
    work = demand.a * S
    queued = min(max(demand.queued, 0.0), work)
    backlog = min(max(demand.burst, 0.0), work - queued)
    rate_now = (work - queued - backlog) / S
    knees_now = demand.decoding / conc if conc else 0.0
    resident_knees_now = resident_decoding / conc if conc else 0.0
    smoother, (a, b, cache, rate, knees, priced_b, priced_knees) = smoother.fold(
        inputs.now,
        demand.a,
        demand.b,
        cache_now,
        rate_now,
        knees_now,
        resident_b,
        resident_knees_now,
    )
    # The share of a turn spent decoding describes the workload, not this minute: it is
    # averaged over the payoff horizon, so a burst of queued prompts does not turn long
    # reasoning decodes into prefill-bound turns just when a move is priced.
    share_smoother, (share,) = share_smoother.fold(inputs.now, inputs.decode_share)
    a = max(a, cache)

    m_p, m_d = spec.engine.m_prefill, spec.engine.m_decode
    budget = spec.gpu_budget - m_d * counts.unavailable
    min_p = min(spec.roles.prefill.min, max(budget, 0) // m_p)
    min_d = min(spec.roles.decode.min, max(budget - m_p * min_p, 0) // m_d)
    if budget <= 0:
        best = Allocation(0, 0, margin_of(0, 0, a, b))
    else:
        best = solve(  # Eq. 1
            a,
            b,
            budget=budget,
            m_prefill=m_p,
            m_decode=m_d,
            min_prefill=min_p,
            min_decode=min_d,
            current_prefill=counts.prefill,
        )
    sizing = Sizing(
        demand=demand,
        a=a,
        b=b,
        cache=cache,
        decode_share=share,
        # Switches are priced on arrivals (rates) plus the backlog drained once, and on the
        # decode load resident over the horizon.
        now_demand=(max(rate_now, cache), resident_b),
        ahead=(max(rate, cache), priced_b),
        backlog=backlog,
        queued=queued,
        knees=knees,
        priced_knees=priced_knees,
        budget=budget,
        min_prefill=min_p,
        min_decode=min_d,
        best=best,
    )
    return Sized(sizing=sizing, smoother=smoother, share_smoother=share_smoother)
