"""The demand of the next horizon, the a and b of Eq. 1: the Controller's own source.

Predictive while the trainer's events are fresh: Appendix B's forecast over the trajectory
table gives the prefill work of the horizon (Eq. 15) and the decode admissions it hands
over (Eq. 13–14). Reactive when the trainer has been silent for ``STALE_HORIZONS``
horizons or never spoke: the engines' queued prefill tokens and decode KV alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prorsa.core.decision import Components, Forecast
from prorsa.core.forecast.model import Forecaster, PrefillSite
from prorsa.core.forecast.table import TrajectoryTable
from prorsa.core.measure import decode_backlog, decoding, prefilling
from prorsa.core.types import Demand, DemandInputs
from prorsa_contract.agent_api import EngineState

STALE_HORIZONS = 3  # trainer silent this many horizons: decide from engine states alone
# Horizons of observed prompt arrivals that tell a refilled queue from a one-off backlog.
MEASURED_RATE_WINDOWS = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class ForecastDemand:
    """The Controller's own :class:`~prorsa.core.types.DemandSource`.

    It forecasts from the Controller's trajectory table and forecaster (the state the
    forecast learns in), and records each horizon's prediction for the accuracy score.
    """

    table: TrajectoryTable
    forecaster: Forecaster

    def __call__(self, inputs: DemandInputs) -> Demand:
        return forecast_demand(inputs, table=self.table, forecaster=self.forecaster)


def forecast_demand(
    inputs: DemandInputs, *, table: TrajectoryTable, forecaster: Forecaster
) -> Demand:
    """Appendix B's forecast for [now, now + S), or engine queues when the trainer is silent."""
    now, S = inputs.now, inputs.horizon
    last = table.last_event_ts
    if last is not None and now - last <= STALE_HORIZONS * S:
        return _predictive(inputs, table=table, forecaster=forecaster)
    why = "no trainer events" if last is None else f"trainer silent for {now - last:.0f}s"
    return _reactive(inputs, table=table, why=why)


def _predictive(inputs: DemandInputs, *, table: TrajectoryTable, forecaster: Forecaster) -> Demand:
    now, S, engines = inputs.now, inputs.horizon, inputs.engines
    # g of Eq. 13 per request, once the agents count computed tokens: its expected
    # computed tokens at the profiled speed, calibrated against what the engines
    # really computed; before, its full prompt at θ_P.
    k = inputs.calibration
    cap = inputs.capacity
    site = PrefillSite(
        names=inputs.prefill_names,
        seconds_per_token=1.0 / inputs.theta if k is None else k / cap.prefill_tokens_per_second,
        per_computed_token=k is not None,
        doubling_tokens=cap.prefill_cost_doubling_tokens,
        ranks=inputs.ranks,
    )
    f = forecaster.forecast(table, now=now, site=site, backlog=decode_backlog(engines, table))
    # K_D (with the prompts waiting for decode's KV room) + K̂_D.
    kv = inputs.kv_now + f.admission_kv
    b = kv / inputs.kv_capacity
    # Requests queued for or in prefill decode next: a prefill burst hands its whole
    # backlog to decode, not only this horizon's admissions.
    pending = max(f.admission_requests, prefilling(engines, table))
    in_decode = decoding(engines, table) + pending
    pinned = _pinned_share(engines, f.ready + f.inflight, inflight=f.inflight)
    forecaster.accuracy.register(
        start=now,
        horizon=S,
        backlog=f.ready + f.inflight,
        predicted_arrivals=f.raw_arrivals,
        predicted_prefill=f.prefill,
        predicted_admission_raw=f.raw_admission,
        predicted_admission=f.admission,
    )
    forecast = Forecast(
        prefill_tokens=round(f.prefill),
        decode_admission_tokens=round(f.admission),
        decode_kv_tokens=round(kv),
        components=Components(
            sampler=round(f.sampler),
            startup=round(f.startup),
            ready=round(f.ready),
            tool=round(f.tool),
            inflight=round(f.inflight),
        ),
    )
    # W_P / θ_P with θ_P of this horizon's prompts: each is charged its own g
    # (the tokens it computes and what attention makes them cost).
    # Prompts queued that no engine holds yet wait in a router or trainer-side
    # queue, which forms only when the engines cannot keep up: a rate.
    queued = f.queued_seconds * pinned
    burst = f.reprefill_seconds
    # Prompts that kept arriving lately as fast as a standing queue suggests are a
    # rate, not work drained once: what the forecast did not predict comes off
    # the one-off parts, the unrouted ones first.
    arrived = forecaster.accuracy.arrival_rate(MEASURED_RATE_WINDOWS)
    if arrived and f.prefill > 0:
        predicted = f.prefill_seconds - queued - burst
        excess = arrived * S * f.prefill_seconds / f.prefill - predicted
        from_burst = min(max(excess, 0.0), burst)
        burst -= from_burst
        queued -= min(max(excess - from_burst, 0.0), queued)
    return Demand(
        mode="predictive",
        a=f.prefill_seconds / S,
        b=b,
        forecast=forecast,
        queued=queued,
        burst=burst,
        decoding=in_decode,
        admitted=f.admission_kv / inputs.kv_capacity,
        pending=pending,
        resident=f.decode_residence,
        forecast_result=f,
    )


def _reactive(inputs: DemandInputs, *, table: TrajectoryTable, why: str) -> Demand:
    engines = inputs.engines
    if not engines:
        note = f"{why} and no engine states"
        return Demand(mode="reactive", a=0.0, b=0.0, forecast=Forecast(), note=note)
    waiting = float(sum(s.waiting_tokens for s in engines if s.role == "prefill"))
    k_d = inputs.kv_now
    forecast = Forecast(
        prefill_tokens=round(waiting),
        decode_admission_tokens=0,
        decode_kv_tokens=round(k_d),
        components=Components(ready=round(waiting)),
    )
    return Demand(
        mode="reactive",
        a=waiting / (inputs.horizon * inputs.theta),
        b=k_d / inputs.kv_capacity,
        forecast=forecast,
        note=f"reactive: {why}",
        # No forecast of arrivals: a standing queue is the evidence of a sustained rate.
        decoding=decoding(engines, table) + prefilling(engines, table),
    )


def _pinned_share(
    engines: Sequence[EngineState], waiting_tokens: float, *, inflight: float
) -> float:
    """The share of the prompts waiting for prefill that prefill engines already hold.

    The router sends a request to a prefill engine when it arrives and never moves it,
    so what the engines report queued (plus what they are prefilling) stays there.
    Prompts the trainer counts as queued that no engine holds yet (a router or
    trainer-side queue) go wherever capacity is when they are sent. Without engine
    states nothing says an engine holds them: none is taken as held.
    """
    if waiting_tokens <= 0:
        return 1.0
    if not engines:
        return 0.0
    prefill = [s for s in engines if s.role == "prefill" and s.healthy]
    held = inflight + sum(s.waiting_tokens for s in prefill)
    return min(held / waiting_tokens, 1.0)
