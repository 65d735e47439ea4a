"""The sans-I/O Controller: lifecycle events + engine states + now -> Decision.

It never reads a clock, a socket or the Kubernetes API. The operator drives it in wall-clock
time, the simulator and ``prorsa plan`` in virtual time, so every figure they produce
measures the code that ships. All times are in the trainer's clock (the webhook corrects
the trainer's offset before calling in).

Executor contract: feed engine states with ``switching=True`` for every instance whose
switch has started (intent written), even before its agent says so, and call
:meth:`Controller.record_switch` when a switch ends. The Controller then never plans the
same change twice and respects each instance's cooldown.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Literal, Protocol

import numpy as np

from prorsa.core.allocate import Allocation, keep_split, margin_of, solve
from prorsa.core.decision import Capacity, Components, Decision, Forecast, Switch, Target
from prorsa.core.diagnostics import Diagnostics
from prorsa.core.estimators import DemandSmoother, PrefillSpeed, PrefixCacheHits
from prorsa.core.forecast.model import ForecastConfig, Forecaster, ForecastResult, PrefillSite
from prorsa.core.forecast.persist import export_state, restore_state
from prorsa.core.forecast.table import DECODE, PREFILL, READY, TOOL, ApplyResult, TrajectoryTable
from prorsa.core.spec import RolloutClusterSpec
from prorsa.core.switch_cost import (
    PRIOR_DECODE_SHARE,
    Load,
    Move,
    Persistence,
    Regret,
    SwitchCosts,
    price_move,
    slowdown,
    window_demand,
)
from prorsa_contract.agent_api import EngineState, Role
from prorsa_contract.events import DecodeFinished, Event, Snapshot

# C_KV when neither the spec nor any engine says (≈ an 8×H200 Qwen3-235B instance).
DEFAULT_KV_TOKENS = 1_300_000
STALE_HORIZONS = 3  # trainer silent this many horizons: decide from engine states alone
HIT_WINDOW_HORIZONS = 6  # the prefix-cache hit ratio is measured over this many horizons
MIN_MISS_RATIO = 0.02  # θ_P is never read as more than 50× the uncached speed
# The share of a prefill engine's KV its prefix cache can count on: the rest holds prompts
# being prefilled, and cache-aware routing does not spread contexts perfectly evenly.
CACHE_FILL = 0.8
# Horizons of observed prompt arrivals that tell a refilled queue from a one-off backlog.
MEASURED_RATE_WINDOWS = 6


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
    # the decode side's step speed depends on (see Controller.decode_throughput_demand).
    decoding: float = 0.0
    # Prefill instances whose caches hold every live context; None: the Controller's own.
    cache: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DemandInputs:
    """What the Controller measured this tick, for the demand source to build on."""

    now: float
    kv_now: float  # K_D: decode KV in use and waiting for admission
    theta: float  # θ_P in full-prompt tokens per instance-second
    kv_capacity: int  # C_KV
    prefill_names: tuple[str, ...]  # prefill instances serving now (routing targets)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleCounts:
    """Usable instances by role now; a switching instance counts as its destination."""

    prefill: int
    decode: int
    unavailable: int
    names: tuple[str, ...]  # prefill instances serving now (not switching), by name


class DemandSource(Protocol):
    """Where the demand of the next horizon comes from.

    The Controller's own source is the forecast of Appendix B (or engine queues when the
    trainer is silent). The simulator's oracle plugs in the true demand instead, so that
    everything else (smoothing, Eq. 1, switch pricing, instance choice) is the same code.
    """

    def __call__(self, controller: Controller, inputs: DemandInputs) -> Demand: ...


def _forecast_config(spec: RolloutClusterSpec, base: ForecastConfig) -> ForecastConfig:
    """``base`` with the spec's forecast settings (the rest are not part of the spec)."""
    f = spec.forecast
    return replace(
        base,
        horizon=f.horizon_seconds,
        tool_alpha=f.tool_ema_alpha,
        bias_correction=f.bias_correction,
        policy=f.injection.policy,
        group_size=f.injection.group_size,
        rate_per_second=f.injection.rate_per_second,
    )


class Controller:
    """Forecast (Appendix B), allocate (Eq. 1) and plan switches (Appendix C)."""

    def __init__(
        self,
        spec: RolloutClusterSpec,
        *,
        ttl_seconds: float | None = None,
        demand_source: DemandSource | None = None,
    ) -> None:
        self.spec = spec
        self.demand_source: DemandSource = demand_source or forecast_demand
        self.horizon = spec.forecast.horizon_seconds
        self._ttl_override = ttl_seconds
        self.forecaster = Forecaster(_forecast_config(spec, ForecastConfig()))
        self.table = TrajectoryTable(observer=self.forecaster)
        profiled = spec.capacity.prefill_tokens_per_second
        # θ_P from trainer events counts full prompts, as §4.2 asks; the agents' counters
        # count only tokens not served from the prefix cache, so they are the fallback.
        self.theta_events = PrefillSpeed(profiled=profiled)
        self.theta_engines = PrefillSpeed(profiled=profiled)
        # θ_P = θ_uncached / (1 − h): the profiled speed of computed tokens over the measured
        # miss ratio, whenever both the trainer and the agents report prefills.
        self.cache_hits = PrefixCacheHits(window=HIT_WINDOW_HORIZONS * self.horizon)
        self._computed: dict[str, int] = {}  # instance -> agent's uncached-token counter
        self._computed_new = 0
        self._prefilled_seen = 0.0
        self._miss_ratio: float | None = None
        self.smoother = DemandSmoother(seconds=spec.switching.smoothing_seconds)
        self.share_smoother = DemandSmoother(seconds=spec.switching.payoff_seconds)
        self._expected_seen = 0.0
        self._calibration: float | None = None
        self.ttl = ttl_seconds if ttl_seconds is not None else max(3600.0, 100 * self.horizon)
        self._engines: dict[str, EngineState] = {}
        self._counters: dict[str, tuple[float, int]] = {}  # instance -> (busy s, tokens)
        self._issued: dict[str, Role] = {}
        self._cooldown_until: dict[str, float] = {}
        self._assumed_prefill = spec.initial_prefill()
        self.switch_costs = SwitchCosts()
        self.regret = Regret()
        self.persistence = Persistence(prior=spec.switching.payoff_seconds)
        self._payoff_prior = spec.switching.payoff_seconds
        # This tick's priced moves and forecast, for its Diagnostics.
        self._moves: tuple[Move, ...] = ()
        self._forecast: ForecastResult | None = None
        # The latest Decision: one reference to a frozen object, safe to read from any task.
        self.last_decision: Decision | None = None
        self.ticks = 0

    def apply_spec(self, spec: RolloutClusterSpec) -> None:
        """Follow an edited spec without forgetting what was learned.

        Everything ``__init__`` derived from the spec is derived again: the horizon and the
        forecast settings, the profiled θ_P, the hit-ratio window, the smoothing times, the
        payoff prior, the TTL and the split assumed before any engine answers. What was
        measured stays: the trajectory table, duration statistics, busy intervals, cache
        hits, smoothed demand, switch costs and cooldowns. Settings read from ``spec`` at
        each tick (budget, roles, hysteresis, cooldown...) follow by the swap itself.
        """
        self.spec = spec
        self.horizon = spec.forecast.horizon_seconds
        forecaster = self.forecaster
        forecaster.config = _forecast_config(spec, forecaster.config)
        for ema in (forecaster.tool, forecaster.growth, forecaster.template):
            ema.alpha = spec.forecast.tool_ema_alpha
        profiled = spec.capacity.prefill_tokens_per_second
        self.theta_events.profiled = self.theta_engines.profiled = profiled
        self.cache_hits.window = HIT_WINDOW_HORIZONS * self.horizon
        self.smoother.seconds = spec.switching.smoothing_seconds
        ttl = self._ttl_override
        self.ttl = ttl if ttl is not None else max(3600.0, 100 * self.horizon)
        payoff = spec.switching.payoff_seconds
        self.share_smoother.seconds = payoff
        if self.persistence.seconds == self._payoff_prior:  # no run of demand measured yet
            self.persistence.seconds = payoff
        self._payoff_prior = payoff
        if self.last_decision is None and not self._engines:
            self._assumed_prefill = spec.initial_prefill()

    # -- inputs ------------------------------------------------------------------------------

    def observe(self, events: Iterable[Event]) -> ApplyResult:
        """Apply a validated batch of lifecycle events (idempotent per event id)."""
        if not self.switch_costs.in_progress:
            return self.table.apply(events)
        batch = events if isinstance(events, list) else list(events)
        # Decodes aborted while a switch drains: their contexts are prefilled again, which
        # is part of what that switch cost (read before the table forgets their context).
        aborted = sum(
            self.table.context_of(e.trajectory) or 0.0
            for e in batch
            if isinstance(e, DecodeFinished) and e.finish == "abort"
        )
        if aborted:
            self.switch_costs.aborted(aborted)
        return self.table.apply(batch)

    def observe_snapshot(self, snapshot: Snapshot) -> None:
        """Replace the trajectory table with the trainer's resync snapshot."""
        self.table.load_snapshot(snapshot)

    def observe_engines(self, states: Iterable[EngineState]) -> None:
        """The latest ``/v1/state`` of every engine; an absent instance is unavailable."""
        fresh = {s.instance: s for s in states}
        for name, s in fresh.items():
            old = self._engines.get(name)
            if old is not None and old.role != s.role and not s.switching:
                self._cooldown_until[name] = max(
                    self._cooldown_until.get(name, -math.inf), self._now_hint()
                )
            self._engine_interval(s)
            self._count_computed(s)
        self._engines = fresh
        for name in list(self._issued):
            now_state = fresh.get(name)
            if now_state is None or not now_state.switching:
                del self._issued[name]

    def _now_hint(self) -> float:
        """Best guess of the present for cooldowns noticed between ticks."""
        last = self.last_decision.at if self.last_decision else -math.inf
        return max(last, self.table.last_event_ts or -math.inf)

    def _engine_interval(self, s: EngineState) -> None:
        """θ_P from the agent's cumulative busy-time counters (two readings, §4.2)."""
        prev = self._counters.get(s.instance)
        cur = (s.prefill_busy_seconds, s.prefill_tokens)
        if prev is None or cur[0] < prev[0] or cur[1] < prev[1]:
            self._counters[s.instance] = cur  # first reading, or the engine restarted
            return
        busy, tokens = cur[0] - prev[0], cur[1] - prev[1]
        if busy >= 1.0 and s.waiting_requests == 0:
            self.theta_engines.add_interval(tokens=tokens, seconds=busy)
            self._counters[s.instance] = cur

    def _count_computed(self, s: EngineState) -> None:
        prev = self._computed.get(s.instance)
        self._computed[s.instance] = s.prefill_tokens
        if prev is not None and s.prefill_tokens >= prev:  # a smaller one: agent restarted
            self._computed_new += s.prefill_tokens - prev

    def resume_switch(self, instance: str, *, to: Role) -> None:
        """A switch a previous operator process started (its intent is on the pod) goes on.

        Counted as its destination until it ends, like one this Controller issued: counted
        as unavailable instead, it would leave a role short (below its minimum when the
        switch restores one) and start a second switch toward the same split.
        """
        self._issued[instance] = to

    def record_switch(self, instance: str, *, at: float) -> None:
        """The executor finished (or gave up on) a switch: start the instance's cooldown."""
        self._issued.pop(instance, None)
        self.switch_costs.finished(instance, at=at)
        cooldown = self.spec.switching.cooldown_seconds
        self._cooldown_until[instance] = at + cooldown

    # -- outputs -----------------------------------------------------------------------------

    @property
    def theta(self) -> PrefillSpeed:
        """θ_P from completed busy intervals: from events when any was measured, else engines."""
        return self.theta_events if self.theta_events.measured else self.theta_engines

    def _theta_now(self, now: float) -> float:
        """The θ_P in use, full-prompt tokens per instance-second (§4.2).

        First choice: the profiled speed of computed tokens over the measured miss ratio
        (see :class:`PrefixCacheHits`). Without agents that count computed tokens, the busy
        intervals of §4.2; before any, the profiled speed. The same window gives the
        calibration of Eq. 13's per-request g (``last_calibration``).
        """
        full = self.forecaster.prefilled_tokens
        self.cache_hits.add_full(now, full - self._prefilled_seen)
        self._prefilled_seen = full
        self.cache_hits.add_computed(now, self._computed_new)
        self._computed_new = 0
        expected = self.forecaster.prefilled_computed
        self.cache_hits.add_expected(now, expected - self._expected_seen)
        self._expected_seen = expected
        self._calibration = self.cache_hits.calibration(now)
        miss = self._miss_ratio = self.cache_hits.miss_ratio(now)
        if miss is not None:
            return self.spec.capacity.prefill_tokens_per_second / max(miss, MIN_MISS_RATIO)
        return self.theta.value

    def learned_state(self) -> dict[str, object]:
        """Learned statistics as JSON-able data (persisted by the operator, e.g. ConfigMap)."""
        return export_state(table=self.table, forecaster=self.forecaster, theta=self.theta_events)

    def restore_learned(self, data: dict[str, object]) -> None:
        """Load :meth:`learned_state` output; raises ValueError on an unknown format."""
        restore_state(data, table=self.table, forecaster=self.forecaster, theta=self.theta_events)

    def accuracy(self) -> dict[str, float | None]:
        acc = self.forecaster.accuracy
        return {"prefillWape": acc.prefill_wape, "decodeWape": acc.decode_wape}

    def live_trajectories(self) -> dict[str, int]:
        return self.table.state_counts()

    def tick(self, now: float, *, evict_now: float | None = None) -> Decision:
        """Decide the prefill:decode split for [now, now + S) and the switches toward it.

        Trajectories silent for longer than the TTL at ``evict_now`` (default ``now``) are
        evicted. The webhook passes a present that runs no faster than real time, so that
        an estimate of the trainer's clock that jumps ahead evicts nothing by itself.
        """
        if not math.isfinite(now):
            raise ValueError(f"tick time must be finite, got {now}")
        self.ticks += 1
        self._moves, self._forecast = (), None
        evict = now if evict_now is None else min(now, evict_now)
        self.table.evict_older_than(evict - self.ttl)
        self._infer_admissions(now)
        acc = self.forecaster.accuracy
        acc.close_until(now)
        intervals, self.forecaster.intervals = self.forecaster.intervals, []
        for tokens, seconds in intervals:
            self.theta_events.add_interval(tokens=tokens, seconds=seconds)

        spec = self.spec
        m_p, m_d = spec.engine.m_prefill, spec.engine.m_decode
        roles = self._current_roles()
        cur_p, cur_d = roles.prefill, roles.decode
        budget = spec.gpu_budget - m_d * roles.unavailable
        theta = self._theta_now(now)
        c_kv = self._kv_capacity()
        capacity = Capacity(prefill_tokens_per_second=round(theta, 3), decode_kv_tokens=c_kv)
        k_d = self._decode_kv_now()
        inputs = DemandInputs(
            now=now, kv_now=k_d, theta=theta, kv_capacity=c_kv, prefill_names=roles.names
        )
        demand = self.demand_source(self, inputs)
        demand = replace(
            demand, b=max(demand.b, self.decode_throughput_demand(demand.decoding, cur_d))
        )
        cache_now = demand.cache if demand.cache is not None else self._cache_demand()
        if self.table.weight_update.in_progress(now):
            # New weights flush every prefix cache: nothing cached is worth protecting.
            cache_now = 0.0
        # The split is sized for the demand expected to persist (smoothed); switches are
        # priced on this tick's demand for the coming horizon and the smoothed one beyond.
        # The prefix-cache floor is averaged the same way: a burst of new trajectories that
        # is gone a minute later does not flip roles either.
        work = demand.a * self.horizon
        queued = min(max(demand.queued, 0.0), work)
        backlog = min(max(demand.burst, 0.0), work - queued)
        rate_now = (work - queued - backlog) / self.horizon
        conc = self.spec.capacity.decode_concurrency
        knees_now = demand.decoding / conc if conc else 0.0
        a, b, cache, rate, knees = self.smoother.update(
            now, demand.a, demand.b, cache_now, rate_now, knees_now
        )
        # The share of a turn spent decoding describes the workload, not this minute: it
        # is averaged over the payoff horizon, so a burst of queued prompts does not turn
        # long reasoning decodes into prefill-bound turns just when a move is priced.
        (share,) = self.share_smoother.update(now, self._decode_share_now())
        a = max(a, cache)
        # Switches are priced on arrivals (rates) plus the backlog drained once.
        now_demand = (max(rate_now, cache), demand.b)
        ahead = (max(rate, cache), b)

        min_p = min(spec.roles.prefill.min, max(budget, 0) // m_p)
        min_d = min(spec.roles.decode.min, max(budget - m_p * min_p, 0) // m_d)
        notes = [demand.note] if demand.note else []
        if budget <= 0:
            best = Allocation(0, 0, margin_of(0, 0, a, b))
            notes.append("no instance is available")
        else:
            best = solve(
                a,
                b,
                budget=budget,
                m_prefill=m_p,
                m_decode=m_d,
                min_prefill=min_p,
                min_decode=min_d,
                current_prefill=cur_p,
            )
        target, why = self._hysteresis(best, cur_p, cur_d, a, b, min_p=min_p, min_d=min_d)
        if why:
            notes.append(why)
        if best.margin < 0:
            ratio = 1.0 + best.margin  # capacity over demand on the tighter side
            notes.append(
                f"over budget: the tighter side needs {1 / ratio:.2f}x the capacity"
                if ratio > 0
                else "over budget: a role with demand has no instance"
            )
        target, switches, planned = self._priced_plan(
            target,
            best,
            (cur_p, cur_d),
            now=now,
            now_demand=now_demand,
            ahead=ahead,
            backlog=backlog,
            forced=cur_p < min_p or cur_d < min_d,
            queued=queued,
            knees=knees,
            decode_share=share,
        )
        notes += planned
        if not self._engines:
            self._assumed_prefill = target.prefill
        margin = margin_of(target.prefill, target.decode, a, b)
        reason = f"prefill demand {demand.a:.2f} inst, decode KV {demand.b:.2f} inst"
        if self.smoother.seconds:
            reason += f" (planned on {a:.2f}/{b:.2f} over {self.smoother.seconds:.0f}s)"
        reason += f"; best margin at {best.prefill}P:{best.decode}D"
        if cache > 0 and cache >= a:
            notes.append(f"live contexts fill the prefix caches of {cache:.2f} prefill instances")
        if self._miss_ratio is not None:
            hit = 1.0 - self._miss_ratio
            notes.append(f"θ_P {theta:.0f} tok/s at prefix-cache hit ratio {hit:.0%}")
        if notes:
            reason += "; " + "; ".join(notes)
        decision = Decision(
            at=now,
            mode=demand.mode,
            target=target,
            safety_margin=round(margin, 4),
            forecast=demand.forecast,
            capacity=capacity,
            switches=tuple(switches),
            reason=reason,
        ).explained(
            self._diagnostics(
                now,
                demand=(demand.a, demand.b),
                planned=(a, b),
                cache=cache,
                share=share,
                kv_now=k_d,
            )
        )
        self.last_decision = decision
        return decision

    def _diagnostics(
        self,
        now: float,
        *,
        demand: tuple[float, float],
        planned: tuple[float, float],
        cache: float,
        share: float,
        kv_now: float,
    ) -> Diagnostics:
        acc = self.forecaster.accuracy
        return Diagnostics(
            demand=demand,
            planned=planned,
            cache_floor=cache,
            decode_share=share,
            kv_now=kv_now,
            miss_ratio=self._miss_ratio,
            calibration=self._calibration,
            moves=self._moves,
            forecast=self._forecast,
            prefill_wape=acc.prefill_wape,
            decode_wape=acc.decode_wape,
            trajectories=MappingProxyType(self.table.state_counts()),
            anomalies=MappingProxyType(dict(self.table.anomalies)),
            last_event_ts=self.table.last_event_ts,
        )

    # -- internals ---------------------------------------------------------------------------

    def _infer_admissions(self, now: float) -> None:
        """Requests of a trainer that does not report prefill ends, moved to decode once the
        prefill engines no longer hold them (``TrajectoryTable.infer_admitted``): before
        this tick's forecast reads the table and before its accuracy windows close."""
        held: int | None = None
        if self._engines:
            held = sum(
                s.running_requests + s.waiting_requests
                for s in self._engines.values()
                if s.role == "prefill"
            )
        self.table.infer_admitted(
            now, in_prefill=held, seconds_per_token=1.0 / max(self.theta.value, 1e-9)
        )

    def _current_roles(self) -> RoleCounts:
        """Counts by role of usable instances; a switching one counts as its destination."""
        if not self._engines:
            n = self.spec.instances
            p = min(self._assumed_prefill, n)
            assumed = tuple(f"prefill-{i}" for i in range(p))
            return RoleCounts(prefill=p, decode=n - p, unavailable=0, names=assumed)
        p = d = unavailable = 0
        names: list[str] = []
        for s in sorted(self._engines.values(), key=lambda s: s.instance):
            if not s.healthy:
                unavailable += 1
                continue
            role: Role | None = s.role
            if s.switching:
                role = self._issued.get(s.instance)
                if role is None:
                    unavailable += 1
                    continue
            if role == "prefill":
                p += 1
                if not s.switching:
                    names.append(s.instance)
            else:
                d += 1
        # Instances the spec owns that no agent answered for are unavailable too.
        unavailable += max(0, self.spec.instances - len(self._engines))
        return RoleCounts(prefill=p, decode=d, unavailable=unavailable, names=tuple(names))

    def _kv_capacity(self) -> int:
        if self.spec.capacity.decode_kv_tokens:
            return self.spec.capacity.decode_kv_tokens
        caps = [s.kv_capacity_tokens for s in self._engines.values() if s.kv_capacity_tokens > 0]
        decode = [
            s.kv_capacity_tokens
            for s in self._engines.values()
            if s.kv_capacity_tokens > 0 and s.role == "decode"
        ]
        pick = decode or caps
        return int(sum(pick) / len(pick)) if pick else DEFAULT_KV_TOKENS

    def _decode_kv_now(self) -> float:
        """K_D: the engines' decode KV in use; without engine states, the prompts in decode."""
        decode = [s for s in self._engines.values() if s.role == "decode" and s.healthy]
        if decode:
            # Requests waiting for decode admission already hold their KV elsewhere and
            # need it here next: they are part of the decode footprint.
            return float(sum(s.kv_used_tokens + s.waiting_tokens for s in decode))
        n = self.table.hwm
        state = self.table.cols["state"][:n]
        return float(self.table.cols["x"][:n][state == DECODE].sum())

    def _cache_demand(self) -> float:
        """Prefill instances whose prefix caches hold the context of every live trajectory.

        A trajectory in a tool call or decoding comes back with its context as the prefix of
        its next prompt. When the prefill instances' caches cannot hold those contexts,
        every turn recomputes its whole context instead of its new tokens: prefill work
        grows tenfold and more, and the split falls off a cliff that demand alone does not
        show (Qwen3-235B coding, 512 trajectories of ~30k tokens in 8M-token caches: 2P:6D
        ran 7× slower than 3P:5D in the simulator). Trajectories starting or in reward hold
        no context that returns.
        """
        per = self.spec.capacity.prefill_cache_tokens
        if per is None:
            caps = [
                s.kv_capacity_tokens
                for s in self._engines.values()
                if s.role == "prefill" and s.kv_capacity_tokens > 0
            ]
            per = int(sum(caps) / len(caps) * self.spec.engine.prefix_cache_scale) if caps else 0
        if per <= 0:
            return 0.0
        n = self.table.hwm
        state = self.table.cols["state"][:n]
        live = np.isin(state, (READY, PREFILL, DECODE, TOOL))
        return float(self.table.cols["x"][:n][live].sum()) / (CACHE_FILL * per)

    def _decoding_now(self) -> float:
        """Requests decoding or waiting for decode now (engines; else the trainer's view)."""
        decode = [s for s in self._engines.values() if s.role == "decode" and s.healthy]
        if decode:
            return float(sum(s.running_requests + s.waiting_requests for s in decode))
        return float(self.table.counts[DECODE])

    def decode_throughput_demand(self, requests: float, n_decode: int) -> float:
        """Decode instances' worth of step throughput that ``requests`` in decode use.

        A decode rank's step takes about t₀·(1 + n/k) at batch n, with k the half-saturation
        knee (``capacity.decodeConcurrency``); it emits n/(t₀(1 + n/k)) tokens a second, at
        most k/t₀. Requests in decode are therefore not demand in units of k: r = n/k
        requests per knee on n_D instances use the fraction u = r/(n_D + r) of their
        throughput (Little's law), so the decode side needs u·n_D = n_D·r/(n_D + r)
        instances of throughput, and a split with fewer runs past capacity. Past the knee
        decode is slower per token, not overloaded, which r itself would have said.
        """
        conc = self.spec.capacity.decode_concurrency
        if not conc or requests <= 0:
            return 0.0
        r = requests / conc
        n = max(n_decode, 1)
        return n * r / (n + r)

    def _decode_share_now(self) -> float:
        """The share of the trajectories between tool calls that are decoding (trainer's view).

        By Little's law the trajectories in a state are proportional to the time a turn
        spends in it, so this is the share of a turn's prefill and decode time spent
        decoding: about 1 for long reasoning decodes, lower for agentic turns that
        re-prefill long contexts. It weighs the decode step speed against the prefill
        side when switches are priced. Before any events: the prior.
        """
        counts = self.table.counts
        decoding = counts[DECODE]
        total = decoding + counts[READY] + counts[PREFILL]
        return decoding / total if total else PRIOR_DECODE_SHARE

    def _pinned_share(self, waiting_tokens: float, *, inflight: float) -> float:
        """The share of the prompts waiting for prefill that prefill engines already hold.

        The router sends a request to a prefill engine when it arrives and never moves it,
        so what the engines report queued (plus what they are prefilling) stays there.
        Prompts the trainer counts as queued that no engine holds yet (a router or
        trainer-side queue) go wherever capacity is when they are sent. Without engine
        states nothing says an engine holds them: none is taken as held.
        """
        if waiting_tokens <= 0:
            return 1.0
        if not self._engines:
            return 0.0
        prefill = [s for s in self._engines.values() if s.role == "prefill" and s.healthy]
        held = inflight + sum(s.waiting_tokens for s in prefill)
        return min(held / waiting_tokens, 1.0)

    def _prefilling_now(self) -> float:
        """Requests waiting for or in prefill now (engines; else the trainer's view)."""
        prefill = [s for s in self._engines.values() if s.role == "prefill" and s.healthy]
        if prefill:
            return float(sum(s.running_requests + s.waiting_requests for s in prefill))
        return float(self.table.counts[READY] + self.table.counts[PREFILL])

    def forecast_demand(self, inputs: DemandInputs) -> Demand:
        """The Controller's own demand source: Appendix B's forecast, or engine queues.

        Predictive while the trainer's events are fresh; reactive (engine queues and KV
        only) when it has been silent for ``STALE_HORIZONS`` horizons or never spoke.
        """
        now, k_d, theta, c_kv = inputs.now, inputs.kv_now, inputs.theta, inputs.kv_capacity
        S = self.horizon
        last = self.table.last_event_ts
        if last is not None and now - last <= STALE_HORIZONS * S:
            # g of Eq. 13 per request, once the agents count computed tokens: its expected
            # computed tokens at the profiled speed, calibrated against what the engines
            # really computed; before, its full prompt at θ_P.
            k = self._calibration
            cap = self.spec.capacity
            site = PrefillSite(
                names=inputs.prefill_names,
                seconds_per_token=1.0 / theta if k is None else k / cap.prefill_tokens_per_second,
                per_computed_token=k is not None,
                doubling_tokens=cap.prefill_cost_doubling_tokens,
                ranks=self.spec.engine.attention_dp_size,
            )
            f = self.forecaster.forecast(self.table, now=now, site=site)
            self._forecast = f
            kv = k_d + f.admission_kv
            b = kv / c_kv
            # Requests queued for or in prefill decode next: a prefill burst hands its whole
            # backlog to decode, not only this horizon's admissions.
            pending = max(f.admission_requests, self._prefilling_now())
            decoding = self._decoding_now() + pending
            pinned = self._pinned_share(f.ready + f.inflight, inflight=f.inflight)
            self.forecaster.accuracy.register(
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
            arrived = self.forecaster.accuracy.arrival_rate(MEASURED_RATE_WINDOWS)
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
                decoding=decoding,
            )
        why = "no trainer events" if last is None else f"trainer silent for {now - last:.0f}s"
        if not self._engines:
            note = f"{why} and no engine states"
            return Demand(mode="reactive", a=0.0, b=0.0, forecast=Forecast(), note=note)
        waiting = float(
            sum(s.waiting_tokens for s in self._engines.values() if s.role == "prefill")
        )
        b = k_d / c_kv
        forecast = Forecast(
            prefill_tokens=round(waiting),
            decode_admission_tokens=0,
            decode_kv_tokens=round(k_d),
            components=Components(ready=round(waiting)),
        )
        a = waiting / (S * theta)
        return Demand(
            mode="reactive",
            a=a,
            b=b,
            forecast=forecast,
            note=f"reactive: {why}",
            # No forecast of arrivals: a standing queue is the evidence of a sustained rate.
            decoding=self._decoding_now() + self._prefilling_now(),
        )

    def _hysteresis(
        self,
        best: Allocation,
        cur_p: int,
        cur_d: int,
        a: float,
        b: float,
        *,
        min_p: int,
        min_d: int,
    ) -> tuple[Target, str]:
        """Keep the current split unless the best one is clearly better (no flapping)."""
        if (best.prefill, best.decode) == (cur_p, cur_d):
            return Target(prefill=cur_p, decode=cur_d), ""
        if cur_p < min_p or cur_d < min_d:
            return Target(prefill=best.prefill, decode=best.decode), "restoring role minimums"
        if a <= 0 and b <= 0:
            return Target(prefill=cur_p, decode=cur_d), "no demand: holding the current split"
        sw = self.spec.switching
        why = keep_split(
            best, (cur_p, cur_d), a, b, hysteresis=sw.hysteresis, hold_margin=sw.hold_margin
        )
        if why:
            return Target(prefill=cur_p, decode=cur_d), why
        return Target(prefill=best.prefill, decode=best.decode), ""

    def _priced_plan(
        self,
        target: Target,
        best: Allocation,
        current: tuple[int, int],
        *,
        now: float,
        now_demand: tuple[float, float],
        ahead: tuple[float, float],
        backlog: float,
        forced: bool,
        queued: float,
        knees: float,
        decode_share: float,
    ) -> tuple[Target, list[Switch], list[str]]:
        """The switches worth making toward ``target``, and where they lead.

        Updates the regret of the current lean and how long leans last (see
        :mod:`prorsa.core.switch_cost`), prices the moves, and when a move does not pay for
        itself aims the target where the ones made lead.
        """
        cur_p, cur_d = current
        # Which way Eq. 1 leans from the current split, for how long demand keeps a lean.
        lean = {1: "prefill", -1: "decode"}.get((best.prefill > cur_p) - (best.prefill < cur_p))
        payoff = min(self.persistence.update(now, toward=lean), self.spec.switching.payoff_seconds)
        load = window_demand(
            backlog=backlog,
            queued=queued,
            prefill_instances=cur_p,
            now=now_demand,
            ahead=ahead,
            horizon=self.horizon,
            seconds=payoff,
            knees=knees,
            decode_share=decode_share,
        )
        step = (target.prefill > cur_p) - (target.prefill < cur_p)
        toward = {1: "prefill", -1: "decode"}.get(step)
        rate = 1.0 - slowdown(cur_p + step, cur_d - step, load) / slowdown(cur_p, cur_d, load)
        regret = self.regret.update(now, toward=toward, rate=rate if toward else 0.0)
        switches, moves = self._plan_switches(
            target, current, now=now, demand=load, forced=forced, regret=regret, payoff=payoff
        )
        self._moves = tuple(moves)
        made = [m for m in moves if m.worth_it or forced]
        notes = []
        if made:
            self.regret.reset()
            notes.append("switching: " + "; ".join(m.describe() for m in made))
        if len(made) < len(moves):
            # The next move does not pay for itself: aim where the made ones lead.
            notes.append("holding: " + moves[len(made)].describe())
            reached = cur_p + step * len(made)
            target = Target(prefill=reached, decode=cur_p + cur_d - reached)
        return target, switches, notes

    def _plan_switches(
        self,
        target: Target,
        current: tuple[int, int],
        *,
        now: float,
        demand: Load,
        forced: bool,
        regret: float = 0.0,
        payoff: float | None = None,
    ) -> tuple[list[Switch], list[Move]]:
        """Appendix C step 1, priced: the cheapest eligible instances, while worth it.

        Each move toward the target is one instance; it is made when what it saves over
        ``switching.payoffSeconds`` exceeds what the switch costs (see
        :mod:`prorsa.core.switch_cost`). Restoring a role minimum is never priced.
        """
        need = target.prefill - current[0]
        if not need or not self._engines:
            return [], []
        in_progress = sum(1 for s in self._engines.values() if s.switching)
        slots = self.spec.switching.max_concurrent - in_progress
        if slots <= 0:
            return [], []
        src: Role = "decode" if need > 0 else "prefill"
        dst: Role = "prefill" if need > 0 else "decode"
        eligible = [
            s
            for s in self._engines.values()
            if s.role == src
            and s.healthy
            and not s.switching
            and self._cooldown_until.get(s.instance, -math.inf) <= now
        ]
        held = self.table.live_contexts_by_instance()
        lost = {s.instance: self._lost_tokens(s, held) for s in eligible}
        # A move back later would throw away what a typical instance of the other role holds.
        others = [self._lost_tokens(s, held) for s in self._engines.values() if s.role == dst]
        back = sum(others) / len(others) if others else 0.0
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
        sw = self.spec.switching
        cap = self.spec.capacity
        per_token = (self._calibration or 1.0) / cap.prefill_tokens_per_second
        switches: list[Switch] = []
        moves: list[Move] = []
        split = current
        for s in eligible[: min(abs(need), slots)]:
            move = price_move(
                instance=s.instance,
                src=src,
                current=split,
                demand=demand,
                payoff_seconds=sw.payoff_seconds if payoff is None else payoff,
                switch_seconds=self.switch_costs.seconds,
                lost_tokens=lost[s.instance],
                return_tokens=back,
                prefill_seconds_per_token=per_token,
                regret=regret if not moves else 0.0,
            )
            moves.append(move)
            if not (forced or move.worth_it):
                break
            self._issued[s.instance] = dst
            self.switch_costs.started(s.instance, at=now, src=src, kv_tokens=s.kv_used_tokens)
            switches.append(Switch(instance=s.instance, from_=src, to=dst))
            step = 1 if src == "decode" else -1
            split = (split[0] + step, split[1] - step)
        return switches, moves

    def _lost_tokens(self, s: EngineState, held: dict[str, float] | None = None) -> float:
        """Prefill tokens a switch of this instance throws away.

        A prefill instance's prefix cache is flushed: the live trajectories whose last
        prefill ran there recompute their contexts, up to what its cache can hold. A decode
        instance aborts what still runs at the drain timeout (the measured share of its KV),
        and those requests prefill their contexts again.
        """
        if s.role == "decode":
            return s.kv_used_tokens * self.switch_costs.abort_share
        contexts = (held if held is not None else self.table.live_contexts_by_instance()).get(
            s.instance, 0.0
        )
        per = self.spec.capacity.prefill_cache_tokens
        if per is None:
            per = int(s.kv_capacity_tokens * self.spec.engine.prefix_cache_scale)
        # No prefix cache (0), e.g. engines without a radix cache: nothing to flush.
        return min(contexts, CACHE_FILL * per) if per > 0 else 0.0

    def engines(self) -> Sequence[EngineState]:
        return tuple(self._engines.values())


def forecast_demand(controller: Controller, inputs: DemandInputs) -> Demand:
    """The default :class:`DemandSource`: the Controller's own forecast."""
    return controller.forecast_demand(inputs)
