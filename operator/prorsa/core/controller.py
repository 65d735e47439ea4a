"""The sans-I/O Controller: lifecycle events + engine states + now -> Decision.

It never reads a clock, a socket or the Kubernetes API. The operator drives it in wall-clock
time, the simulator and ``prorsa plan`` in virtual time, so every figure they produce
measures the code that ships. All times are in the trainer's clock (the webhook corrects
the trainer's offset before calling in).

The Controller holds what a tick learns from (the trajectory table, the forecaster, θ_P,
smoothed demand, switch costs, cooldowns) and runs the ten steps of a tick
(docs/architecture.md, "What a tick does"); the stages are modules of their own, each
with a typed input: :mod:`prorsa.core.measure` (what the engines and the table say),
:mod:`prorsa.core.demand` (the demand of the next horizon) and :mod:`prorsa.core.switch_plan`
(hold rules and the priced switch plan), with the values that cross between them in
:mod:`prorsa.core.types`.

Executor contract: feed engine states with ``switching=True`` for every instance whose
switch has started (intent written), even before its agent says so, and call
:meth:`Controller.record_switch` when a switch ends. The Controller then never plans the
same change twice and respects each instance's cooldown.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from types import MappingProxyType

from prorsa.core import measure
from prorsa.core.allocate import Allocation, margin_of, solve
from prorsa.core.decision import Capacity, Decision, Switch
from prorsa.core.demand import ForecastDemand
from prorsa.core.diagnostics import Diagnostics
from prorsa.core.estimators import DemandSmoother, PrefillSpeed, PrefixCacheHits
from prorsa.core.forecast.config import ForecastConfig
from prorsa.core.forecast.model import Forecaster
from prorsa.core.forecast.persist import export_state, restore_state
from prorsa.core.forecast.table import ApplyResult, TrajectoryTable
from prorsa.core.spec import RolloutClusterSpec
from prorsa.core.switch_cost import (
    CycleProfile,
    Load,
    Persistence,
    Regret,
    SwitchCosts,
    export_switching,
    restore_switching,
)
from prorsa.core.switch_plan import plan_switches
from prorsa.core.types import (
    Demand,
    DemandInputs,
    DemandSource,
    Plan,
    PlanInputs,
    RoleCounts,
    Sizing,
)
from prorsa_contract.agent_api import EngineState, Role
from prorsa_contract.events import DecodeFinished, Event, Snapshot

HIT_WINDOW_HORIZONS = 6  # the prefix-cache hit ratio is measured over this many horizons
MIN_MISS_RATIO = 0.02  # θ_P is never read as more than 50× the uncached speed


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
        self.horizon = spec.forecast.horizon_seconds
        self._ttl_override = ttl_seconds
        self.forecaster = Forecaster(_forecast_config(spec, ForecastConfig()))
        self.table = TrajectoryTable(observer=self.forecaster)
        self.demand_source: DemandSource = demand_source or ForecastDemand(
            table=self.table, forecaster=self.forecaster
        )
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
        self._computed_total = 0.0  # every uncached token the agents counted
        self._recomputed = 0.0  # see Diagnostics.recomputed_tokens
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
        self.cycle = CycleProfile()
        self._payoff_prior = spec.switching.payoff_seconds
        # The latest Decision: one reference to a frozen object, safe to read from any task.
        self.last_decision: Decision | None = None
        self.ticks = 0
        # Since when Eq. 1's best split has leaned away from the split in use, and which
        # way ("prefill": more prefill instances); whether a switch that way was made since.
        self._lean: tuple[Role, float, bool] | None = None

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
        """The latest ``/v1/state`` of every engine; an absent instance is unavailable,
        unless a switch is under way on it (see :func:`measure.role_counts`)."""
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
        # A switch ends when its instance's state says it is not switching, or at
        # record_switch; a state that is missing (a read the agent missed) ends nothing.
        for name in list(self._issued):
            now_state = fresh.get(name)
            if now_state is not None and not now_state.switching:
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
        self._computed_total += self._computed_new
        self._computed_new = 0
        expected = self.forecaster.prefilled_computed
        # Never less than before: agents and trainer events report the same prefill at
        # slightly different times, and a counter must not go back.
        self._recomputed = max(self._recomputed, self._computed_total - expected)
        self.cache_hits.add_expected(now, expected - self._expected_seen)
        self._expected_seen = expected
        self._calibration = self.cache_hits.calibration(now)
        miss = self._miss_ratio = self.cache_hits.miss_ratio(now)
        if miss is not None:
            return self.spec.capacity.prefill_tokens_per_second / max(miss, MIN_MISS_RATIO)
        return self.theta.value

    def learned_state(self) -> dict[str, object]:
        """Learned statistics as JSON-able data (persisted by the operator, e.g. ConfigMap):
        the forecaster's, θ_P's busy intervals, and what switching measured (durations,
        aborts, how long demand leans one way, the step-cycle profile)."""
        data = export_state(table=self.table, forecaster=self.forecaster, theta=self.theta_events)
        data["switching"] = export_switching(
            costs=self.switch_costs, persistence=self.persistence, cycle=self.cycle
        )
        return data

    def restore_learned(self, data: dict[str, object]) -> None:
        """Load :meth:`learned_state` output; raises ValueError on an unknown format or a
        malformed field (named in the message)."""
        restore_state(data, table=self.table, forecaster=self.forecaster, theta=self.theta_events)
        switching = data.get("switching")
        if switching is not None and not isinstance(switching, dict):
            raise ValueError("learned state: switching must be an object")
        restore_switching(
            switching or {},
            costs=self.switch_costs,
            persistence=self.persistence,
            cycle=self.cycle,
        )

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
        # 1. Trajectory table: evict the silent; what prefill engines let go decodes.
        self._update_table(now, evict_now)
        # 2. Duration statistics and accuracy: score the windows closed; time prefills.
        self._learn(now)
        # 3. Capacity: the instances usable by role, θ_P, C_KV and K_D.
        roles = self._roles()
        inputs = self._demand_inputs(now, roles)
        # 4-6. The demand of the next horizon: prefill work (Eq. 15) and decode admissions
        # (Eq. 13-14) forecast, or engine queues while the trainer is silent.
        demand = self.demand_source(inputs)
        # 7. Eq. 1: the best split for the demand expected to persist.
        sizing = self._size(now, demand, roles)
        # The step-scale target (switching.stepCycle) learns from the trainer's events.
        step_cycle = self.spec.switching.step_cycle and demand.mode == "predictive"
        if step_cycle:
            self._record_cycle(now, sizing, roles)
        # 8-9. Hold rules, then the switch plan, priced: the moves toward it that pay (once
        # a weight update has closed a step: toward the split the last step favours).
        plan = plan_switches(
            self._plan_inputs(now, roles, sizing, inputs.calibration),
            persistence=self.persistence,
            regret=self.regret,
            cycle=self.cycle if step_cycle else None,
        )
        self._start(plan.switches, at=now)
        if not self._engines:  # no engine has answered: the split assumed next tick
            self._assumed_prefill = plan.target.prefill
        # 10. The Decision: where the split goes, why, and what this tick saw.
        waited = self._decision_wait(now, sizing, roles, plan)
        decision = self._decision(now, inputs, sizing, plan, waited)
        self.last_decision = decision
        return decision

    # -- the steps of a tick ------------------------------------------------------------------

    def _update_table(self, now: float, evict_now: float | None) -> None:
        """Step 1: evict the trajectories silent past the TTL, and move to decode the
        requests of a trainer that does not report prefill ends once the prefill engines
        no longer hold them (``TrajectoryTable.infer_admitted``): before this tick's
        forecast reads the table and before its accuracy windows close."""
        evict = now if evict_now is None else min(now, evict_now)
        self.table.evict_older_than(evict - self.ttl)
        self.table.infer_admitted(
            now,
            in_prefill=measure.in_prefill(self.engines()),
            seconds_per_token=1.0 / max(self.theta.value, 1e-9),
        )

    def _learn(self, now: float) -> None:
        """Step 2: score the forecast windows closed by ``now`` (the WAPE and the forecast's
        bias factor), and add the prefills the table timed to θ_P's busy intervals."""
        self.forecaster.accuracy.close_until(now)
        intervals, self.forecaster.intervals = self.forecaster.intervals, []
        for tokens, seconds in intervals:
            self.theta_events.add_interval(tokens=tokens, seconds=seconds)

    def _roles(self) -> RoleCounts:
        """Step 3: usable instances by role; a switching one counts as its destination."""
        return measure.role_counts(
            self.engines(),
            issued=self._issued,
            instances=self.spec.instances,
            assumed_prefill=self._assumed_prefill,
        )

    def _demand_inputs(self, now: float, roles: RoleCounts) -> DemandInputs:
        """Step 3: θ_P, C_KV and K_D: what a demand source builds on."""
        engines = self.engines()
        capacity = self.spec.capacity
        return DemandInputs(
            now=now,
            horizon=self.horizon,
            theta=self._theta_now(now),
            kv_capacity=measure.kv_capacity(engines, configured=capacity.decode_kv_tokens),
            kv_now=measure.decode_kv(engines, self.table),
            prefill_names=roles.names,
            engines=engines,
            calibration=self._calibration,
            capacity=capacity,
            ranks=self.spec.engine.attention_dp_size,
        )

    def _size(self, now: float, demand: Demand, roles: RoleCounts) -> Sizing:
        """Step 7: Eq. 1 on the demand expected to persist, with its floors, in budget.

        The split is sized for the demand smoothed over ``switching.smoothingSeconds``;
        switches are priced on this tick's demand for the coming horizon and the smoothed
        one beyond. The prefix-cache floor is averaged the same way: a burst of new
        trajectories that is gone a minute later does not flip roles either.
        """
        spec, S = self.spec, self.horizon
        conc = spec.capacity.decode_concurrency
        throughput = measure.decode_throughput_demand(
            demand.decoding, roles.decode, concurrency=conc
        )
        demand = replace(demand, b=max(demand.b, throughput))
        cache_now = demand.cache
        if cache_now is None:
            cache_now = measure.cache_floor(
                self.engines(),
                self.table,
                cache_tokens=spec.capacity.prefill_cache_tokens,
                cache_scale=spec.engine.prefix_cache_scale,
            )
        if self.table.weight_update.in_progress(now):
            # New weights flush every prefix cache: nothing cached is worth protecting.
            cache_now = 0.0
        work = demand.a * S
        queued = min(max(demand.queued, 0.0), work)
        backlog = min(max(demand.burst, 0.0), work - queued)
        rate_now = (work - queued - backlog) / S
        knees_now = demand.decoding / conc if conc else 0.0
        a, b, cache, rate, knees = self.smoother.update(
            now, demand.a, demand.b, cache_now, rate_now, knees_now
        )
        # The share of a turn spent decoding describes the workload, not this minute: it
        # is averaged over the payoff horizon, so a burst of queued prompts does not turn
        # long reasoning decodes into prefill-bound turns just when a move is priced.
        (share,) = self.share_smoother.update(now, measure.decode_share(self.table))
        a = max(a, cache)

        m_p, m_d = spec.engine.m_prefill, spec.engine.m_decode
        budget = spec.gpu_budget - m_d * roles.unavailable
        min_p = min(spec.roles.prefill.min, max(budget, 0) // m_p)
        min_d = min(spec.roles.decode.min, max(budget - m_p * min_p, 0) // m_d)
        if budget <= 0:
            best = Allocation(0, 0, margin_of(0, 0, a, b))
        else:
            best = solve(
                a,
                b,
                budget=budget,
                m_prefill=m_p,
                m_decode=m_d,
                min_prefill=min_p,
                min_decode=min_d,
                current_prefill=roles.prefill,
            )
        return Sizing(
            demand=demand,
            a=a,
            b=b,
            cache=cache,
            decode_share=share,
            # Switches are priced on arrivals (rates) plus the backlog drained once.
            now_demand=(max(rate_now, cache), demand.b),
            ahead=(max(rate, cache), b),
            backlog=backlog,
            queued=queued,
            knees=knees,
            budget=budget,
            min_prefill=min_p,
            min_decode=min_d,
            best=best,
        )

    def _record_cycle(self, now: float, sizing: Sizing, roles: RoleCounts) -> None:
        """Step 7: this tick's load at the split in use, for :class:`CycleProfile`."""
        load = Load(
            a=sizing.now_demand[0],
            b=sizing.demand.b,
            knees=sizing.knees,
            decode_share=sizing.decode_share,
        )
        self.cycle.record(
            now,
            load,
            (roles.prefill, roles.decode),
            drain=sizing.demand.a * self.horizon,
            update_started=self.table.weight_update.started_at,
            max_gap=3 * self.horizon,
        )

    def _plan_inputs(
        self, now: float, roles: RoleCounts, sizing: Sizing, calibration: float | None
    ) -> PlanInputs:
        """Steps 8-9: what the switch plan works from."""
        spec = self.spec
        return PlanInputs(
            now=now,
            horizon=self.horizon,
            current=(roles.prefill, roles.decode),
            sizing=sizing,
            engines=self.engines(),
            in_progress=roles.switching,
            cooldown_until=MappingProxyType(self._cooldown_until),
            contexts=self.table.live_contexts_by_instance,
            switch_seconds=self.switch_costs.seconds,
            abort_share=self.switch_costs.abort_share,
            calibration=calibration,
            switching=spec.switching,
            capacity=spec.capacity,
            cache_scale=spec.engine.prefix_cache_scale,
        )

    def _start(self, switches: Sequence[Switch], *, at: float) -> None:
        """The switches of this tick's Decision start: each counts as its destination
        until ``record_switch``, which measures its duration from now."""
        for sw in switches:
            self._issued[sw.instance] = sw.to
            kv = self._engines[sw.instance].kv_used_tokens
            self.switch_costs.started(sw.instance, at=at, src=sw.from_, kv_tokens=kv)

    def _decision_wait(
        self, now: float, sizing: Sizing, roles: RoleCounts, plan: Plan
    ) -> float | None:
        """Seconds from Eq. 1's best split leaning away from the split in use to the first
        switch made toward it (None: no such switch at this tick).

        Part of how late the split follows a change of demand: what the hold rules, the
        pricing and cooldowns add once the forecast has crossed (``Diagnostics.decision_seconds``,
        ``prorsa_switch_decision_seconds``); the switch's own drain, router and flip follow
        (``prorsa_switch_duration_seconds``).
        """
        best, cur = sizing.best.prefill, roles.prefill
        lean: Role | None = "prefill" if best > cur else "decode" if best < cur else None
        if lean is None:
            self._lean = None
        elif self._lean is None or self._lean[0] != lean:
            self._lean = (lean, now, False)
        toward = [sw for sw in plan.switches if self._lean and sw.to == self._lean[0]]
        if not toward or self._lean is None or self._lean[2]:
            return None
        way, since, _ = self._lean
        self._lean = (way, since, True)
        return now - since

    def _decision(
        self,
        now: float,
        inputs: DemandInputs,
        sizing: Sizing,
        plan: Plan,
        waited: float | None = None,
    ) -> Decision:
        """Step 10: the Decision, its reason, and the Diagnostics of what this tick saw."""
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
        if self.smoother.seconds:
            reason += f" (planned on {a:.2f}/{b:.2f} over {self.smoother.seconds:.0f}s)"
        reason += f"; best margin at {best.prefill}P:{best.decode}D"
        if cache > 0 and cache >= a:
            notes.append(f"live contexts fill the prefix caches of {cache:.2f} prefill instances")
        if self._miss_ratio is not None:
            hit = 1.0 - self._miss_ratio
            notes.append(f"θ_P {inputs.theta:.0f} tok/s at prefix-cache hit ratio {hit:.0%}")
        if notes:
            reason += "; " + "; ".join(notes)
        acc = self.forecaster.accuracy
        waiting, oldest = self.table.prefill_waiting(now)
        diagnostics = Diagnostics(
            demand=(demand.a, demand.b),
            planned=(a, b),
            cache_floor=cache,
            decode_share=sizing.decode_share,
            kv_now=inputs.kv_now,
            miss_ratio=self._miss_ratio,
            calibration=self._calibration,
            moves=plan.moves,
            made=plan.moves[: len(plan.switches)],
            best=(best.prefill, best.decode),
            forecast=demand.forecast_result,
            prefill_wape=acc.prefill_wape,
            decode_wape=acc.decode_wape,
            trajectories=MappingProxyType(self.table.state_counts()),
            anomalies=MappingProxyType(dict(self.table.anomalies)),
            last_event_ts=self.table.last_event_ts,
            generated_tokens=self.table.generated_tokens,
            prefill_waiting=waiting,
            prefill_oldest_wait=oldest,
            decode_waiting=measure.decode_waiting(inputs.engines),
            recomputed_tokens=self._recomputed,
            decision_seconds=waited,
        )
        return Decision(
            at=now,
            mode=demand.mode,
            target=target,
            safety_margin=round(margin_of(target.prefill, target.decode, a, b), 4),
            forecast=demand.forecast,
            capacity=Capacity(
                prefill_tokens_per_second=round(inputs.theta, 3),
                decode_kv_tokens=inputs.kv_capacity,
            ),
            switches=plan.switches,
            reason=reason,
        ).explained(diagnostics)

    def engines(self) -> tuple[EngineState, ...]:
        """The latest state of every engine that answered, in the order given."""
        return tuple(self._engines.values())
