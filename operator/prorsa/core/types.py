"""What crosses between the Controller and the stages of its tick.

A tick takes one :class:`TickInput` from its caller, measures the engines
(:mod:`prorsa.core.measure`), asks a demand source for the next horizon's demand
(:mod:`prorsa.core.demand`), sizes the split with Eq. 1 (:mod:`prorsa.core.sizing`) and plans
the switches toward it (:mod:`prorsa.core.switch_plan`). Each stage takes one of these frozen
values and returns another, never the Controller itself: a stage can be read and tested
alone, and replaced, as the simulator's oracle replaces the demand source with the true
demand. They hold values only, no callable and no view of the Controller's tables, so what
a stage saw is what it was given. What a stage learns (smoothed demand, how long demand
leans one way, what holding has cost) comes back in its result, for the Controller to keep.
The Decision that a tick returns is the wire contract of :mod:`prorsa.core.decision`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from prorsa.core.allocate import Allocation
from prorsa.core.decision import Forecast, Switch, Target
from prorsa.core.forecast.model import ForecastResult
from prorsa.core.spec import CapacitySpec, RolloutClusterSpec, SwitchingSpec
from prorsa.core.switch_cost import Move, Persistence, Regret
from prorsa_contract.agent_api import EngineState


@dataclass(frozen=True, slots=True, kw_only=True)
class TickInput:
    """One tick's input from its caller: when, and what the engines said.

    The operator, ``prorsa plan`` and the simulator build it. The trainer's lifecycle
    events are not part of it: they arrive between ticks (``Controller.observe``), and the
    trajectory table they feed is state the Controller holds and learns from.
    """

    now: float  # the trainer's clock: the tick decides for [now, now + S)
    # The present for evicting silent trajectories (None: ``now``; the earlier of the two
    # counts). The webhook passes one that runs no faster than real time.
    evict_now: float | None = None
    # The engines' /v1/state read for this tick, observed before it runs (an absent
    # instance is unavailable); None: the states ``Controller.observe_engines`` gave last.
    engines: tuple[EngineState, ...] | None = None


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
    # Of ``b`` and ``decoding``, what this horizon's admissions add (K̂_D / C_KV, and the
    # requests queued for prefill), and the share of the horizon such a request is expected
    # to stay in decode (``forecast.sources.decode_residence``): switch pricing counts them
    # at that share. The defaults leave the pricing on Eq. 1's b.
    admitted: float = 0.0
    pending: float = 0.0
    resident: float = 1.0
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
class SizingInputs:
    """What Eq. 1 sizes the split from at one tick (:func:`prorsa.core.sizing.size`)."""

    now: float
    horizon: float
    demand: Demand  # this horizon's, from the demand source
    counts: RoleCounts  # usable instances by role now
    # Prefill instances whose caches hold every live context now: the demand source's
    # figure, else the Controller's (measure.cache_floor).
    cache_floor: float
    weight_update: bool  # a weight update is under way: new weights flush every cache
    decode_share: float  # this tick's share of a turn spent decoding (measure.decode_share)
    spec: RolloutClusterSpec  # budget, instance sizes, role minimums, decode concurrency


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
    # The same over the horizon, admissions at their resident share, for switch pricing;
    # None: ``knees``.
    priced_knees: float | None = None
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
    cooldown_until: Mapping[str, float]  # instance -> end of its cooldown (a copy)
    # Live context tokens by the instance their last prefill ran on: what each prefix cache
    # is worth (a copy, taken from the trajectory table this tick).
    contexts: Mapping[str, float]
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
    # The plan's memory after this tick, for the Controller to keep for the next one.
    persistence: Persistence
    regret: Regret


@dataclass(frozen=True, slots=True, kw_only=True)
class DecisionInputs:
    """What step 10 explains the Decision from (:func:`prorsa.core.explain.explain`): the
    stages' results and what the Controller's own state says at this tick."""

    now: float
    measured: DemandInputs
    sizing: Sizing
    plan: Plan
    # Seconds from Eq. 1's best split leaning away to the first switch toward it (None:
    # no such switch at this tick).
    waited: float | None
    smoothing_seconds: float  # switching.smoothingSeconds (0: demand not smoothed)
    miss_ratio: float | None  # the prefix-cache miss ratio behind θ_P, when measured
    calibration: float | None  # as in DemandInputs
    recomputed_tokens: float  # see Diagnostics.recomputed_tokens
    wape: tuple[float | None, float | None]  # the forecast's (prefill, decode) WAPE
    trajectories: Mapping[str, int]  # live trajectories per lifecycle state (a copy)
    anomalies: Mapping[str, int]  # trainer-event anomalies per kind (a copy)
    last_event_ts: float | None
    generated_tokens: int
    prefill_waiting: tuple[int, float]  # prompts whose prefill has not ended, oldest wait
