"""What crosses between the Controller and the stages of its tick.

A tick measures the engines (:mod:`prorsa.core.measure`), asks a demand source for the
next horizon's demand (:mod:`prorsa.core.demand`), sizes the split with Eq. 1 and plans the
switches toward it (:mod:`prorsa.core.switch_plan`). Each stage takes one of these frozen values
and returns another, never the Controller itself: a stage can be read and tested alone,
and replaced, as the simulator's oracle replaces the demand source with the true demand.
The Decision that a tick returns is the wire contract of :mod:`prorsa.core.decision`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from prorsa.core.allocate import Allocation
from prorsa.core.decision import Forecast, Switch, Target
from prorsa.core.forecast.model import ForecastResult
from prorsa.core.spec import CapacitySpec, SwitchingSpec
from prorsa.core.switch_cost import Move
from prorsa_contract.agent_api import EngineState


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleCounts:
    """Usable instances by role now; a switching instance counts as its destination."""

    prefill: int
    decode: int
    unavailable: int
    names: tuple[str, ...]  # prefill instances serving now (not switching), by name
    # Instances mid-switch, whether or not their agent answered this tick: what takes
    # switching.maxConcurrent's slots.
    switching: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class DemandInputs:
    """What the Controller measured this tick, for the demand source to build on."""

    now: float
    horizon: float  # S: the demand is for [now, now + S)
    kv_now: float  # K_D: decode KV in use and waiting for admission
    theta: float  # θ_P in full-prompt tokens per instance-second
    kv_capacity: int  # C_KV
    prefill_names: tuple[str, ...]  # prefill instances serving now (routing targets)
    engines: tuple[EngineState, ...]  # the latest /v1/state of every engine that answered
    # Eq. 13's per-request g over the profiled speed of computed tokens; None until the
    # agents count computed tokens.
    calibration: float | None
    capacity: CapacitySpec  # the spec's profiled figures
    ranks: int  # attention data-parallel ranks per instance


@dataclass(frozen=True, slots=True, kw_only=True)
class Demand:
    """One horizon's demand in instances, the a and b of Eq. 1, from a demand source."""

    mode: Literal["predictive", "reactive"]
    a: float  # prefill demand in instances: W_P / (S·θ_P)
    b: float  # decode KV demand in instances: (K_D + K̂_D) / C_KV
    forecast: Forecast
    note: str = ""
    # Of a·S, prefill instance-seconds that do not recur as arrivals do. ``queued``: prompts
    # already sent to a prefill engine; the router does not move them, so an instance that
    # turns to prefill cannot take any (switches are priced without them). ``burst``: work
    # about to be sent at once (re-prefills after a weight update), drained once, so
    # switches are priced on it spread over their payoff horizon.
    queued: float = 0.0
    burst: float = 0.0
    # Requests decoding, waiting for decode, or queued for prefill (they decode next): what
    # the decode side's step speed depends on (see measure.decode_throughput_demand).
    decoding: float = 0.0
    # Prefill instances whose caches hold every live context; None: the Controller's own.
    cache: float | None = None
    # The forecast behind these figures, for the tick's Diagnostics; None when none was made.
    forecast_result: ForecastResult | None = None


class DemandSource(Protocol):
    """Where the demand of the next horizon comes from.

    The Controller's own source is the forecast of Appendix B, or engine queues when the
    trainer is silent (:class:`prorsa.core.demand.ForecastDemand`). The simulator's oracle
    plugs in the true demand instead, so that everything else (smoothing, Eq. 1, switch
    pricing, instance choice) is the same code.
    """

    def __call__(self, inputs: DemandInputs) -> Demand: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizing:
    """Eq. 1 at one tick: the demand the split is sized for, and the best split."""

    demand: Demand  # this horizon's, b raised to the decode step throughput in use
    a: float  # planned prefill demand: smoothed, never below the prefix-cache floor
    b: float  # planned decode demand: smoothed
    cache: float  # the prefix-cache floor, smoothed
    decode_share: float  # of a turn's prefill and decode time, over the payoff horizon
    # What moves are priced on: this horizon's (a, b) and the smoothed ones beyond, prefill
    # as a rate of arrivals plus ``backlog`` (drained once) and ``queued`` (held by engines).
    now_demand: tuple[float, float]
    ahead: tuple[float, float]
    backlog: float
    queued: float
    knees: float  # requests in decode per half-saturation knee, smoothed
    budget: int  # GPUs of the usable instances (of all but the unavailable ones)
    min_prefill: int  # the role minimums the budget allows
    min_decode: int
    best: Allocation  # Eq. 1's best split


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInputs:
    """What the switch plan works from: the sized split and what is known of each engine."""

    now: float
    horizon: float
    current: tuple[int, int]  # usable (prefill, decode) instances now
    sizing: Sizing
    engines: tuple[EngineState, ...]
    in_progress: int  # switches under way (RoleCounts.switching), answered this tick or not
    cooldown_until: Mapping[str, float]  # instance -> end of its cooldown
    # Live context tokens by the instance their last prefill ran on: what each prefix cache
    # is worth. A pass over the trajectory table, read only when a move is priced.
    contexts: Callable[[], Mapping[str, float]]
    switch_seconds: float  # measured duration of one switch
    abort_share: float  # measured share of a decode instance's KV aborted by a switch
    calibration: float | None  # as in DemandInputs
    switching: SwitchingSpec
    capacity: CapacitySpec
    cache_scale: float  # a prefill cache over its GPU KV pool (EngineSpec.prefix_cache_scale)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The switches worth making now, and where they lead."""

    target: Target
    switches: tuple[Switch, ...]
    moves: tuple[Move, ...]  # every move priced, made or not
    held: str  # why the hold rules keep the current split ("": they do not)
    notes: tuple[str, ...]  # the moves made and the first one that did not pay
