"""Step 10 of a tick: the Decision, the reason a user reads, and the tick's Diagnostics.

The reason says in one line what the split was sized for and why it holds or moves: the
demand of Eq. 1 before and after smoothing, the best split, the hold rule or the first move
that did not pay, and what bounds it (over budget, prefix-cache floor, θ_P's hit ratio).
The Diagnostics carry every figure behind it, frozen with the Decision, for the metrics
and ``GET .../status`` to read from another task (:mod:`prorsa.core.diagnostics`).
"""

from __future__ import annotations

from prorsa.core import measure
from prorsa.core.allocate import margin_of
from prorsa.core.decision import Capacity, Decision
from prorsa.core.diagnostics import Diagnostics
from prorsa.core.types import DecisionInputs


def explain(inputs: DecisionInputs) -> Decision:
    """The Decision of a tick, its reason, and the Diagnostics of what the tick saw."""
    now, measured, sizing, plan = inputs.now, inputs.measured, inputs.sizing, inputs.plan
    demand, best, target = sizing.demand, sizing.best, plan.target
    a, b, cache = sizing.a, sizing.b, sizing.cache
    notes = [demand.note] if demand.note else []
    if sizing.budget <= 0:
        notes.append("no instance is available")
    if plan.held:
        notes.append(plan.held)
    if best.margin < 0:
        ratio = 1.0 + best.margin  # capacity over demand on the tighter side
        notes.append(
            f"over budget: the tighter side needs {1 / ratio:.2f}x the capacity"
            if ratio > 0
            else "over budget: a role with demand has no instance"
        )
    notes += plan.notes
    reason = f"prefill demand {demand.a:.2f} inst, decode KV {demand.b:.2f} inst"
    if inputs.smoothing_seconds:
        reason += f" (planned on {a:.2f}/{b:.2f} over {inputs.smoothing_seconds:.0f}s)"
    reason += f"; best margin at {best.prefill}P:{best.decode}D"
    if cache > 0 and cache >= a:
        notes.append(f"live contexts fill the prefix caches of {cache:.2f} prefill instances")
    if inputs.miss_ratio is not None:
        hit = 1.0 - inputs.miss_ratio
        notes.append(f"θ_P {measured.theta:.0f} tok/s at prefix-cache hit ratio {hit:.0%}")
    if notes:
        reason += "; " + "; ".join(notes)
    waiting, oldest = inputs.prefill_waiting
    diagnostics = Diagnostics(
        demand=(demand.a, demand.b),
        planned=(a, b),
        cache_floor=cache,
        decode_share=sizing.decode_share,
        kv_now=measured.kv_now,
        miss_ratio=inputs.miss_ratio,
        calibration=inputs.calibration,
        moves=plan.moves,
        made=plan.moves[: len(plan.switches)],
        best=(best.prefill, best.decode),
        forecast=demand.forecast_result,
        prefill_wape=inputs.wape[0],
        decode_wape=inputs.wape[1],
        trajectories=inputs.trajectories,
        anomalies=inputs.anomalies,
        last_event_ts=inputs.last_event_ts,
        generated_tokens=inputs.generated_tokens,
        prefill_waiting=waiting,
        prefill_oldest_wait=oldest,
        decode_waiting=measure.decode_waiting(measured.engines),
        recomputed_tokens=inputs.recomputed_tokens,
        decision_seconds=inputs.waited,
    )
    return Decision(
        at=now,
        mode=demand.mode,
        target=target,
        safety_margin=round(margin_of(target.prefill, target.decode, a, b), 4),
        forecast=demand.forecast,
        capacity=Capacity(
            prefill_tokens_per_second=round(measured.theta, 3),
            decode_kv_tokens=measured.kv_capacity,
        ),
        switches=plan.switches,
        reason=reason,
    ).explained(diagnostics)
