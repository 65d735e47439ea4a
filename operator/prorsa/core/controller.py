"""The sans-I/O Controller: lifecycle events + engine states + now -> Decision.

It never reads a clock, a socket or the Kubernetes API. The operator drives it in wall-clock
time, the simulator and ``prorsa plan`` in virtual time, so every figure they produce
measures the code that ships. All times are in the trainer's clock (the webhook corrects
the trainer's offset before calling in).

The Controller is a state machine: it holds what a tick learns from (the trajectory table,
the forecaster, θ_P, smoothed demand, switch costs, cooldowns) and runs the ten steps of a
tick (docs/architecture.md, "What a tick does") on one frozen :class:`TickInput` that its
caller builds. The stages are modules of their own, each with a frozen input:
:mod:`prorsa.core.measure` (what the engines and the table say), :mod:`prorsa.core.demand`
(the demand of the next horizon), :mod:`prorsa.core.sizing` (Eq. 1) and
:mod:`prorsa.core.switch_plan` (hold rules and the priced switch plan), with the values that
cross between them in :mod:`prorsa.core.types`. A stage that learns returns what it learned
(the smoothers, the plan's memory) and the Controller keeps it: reading never changes state.

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
from prorsa.core.bootstrap import (
    BootstrapView,
    bootstrap_issued,
    cycle_start,
    flip_ended,
    follow_bootstrap,
    holding_plan,
    is_flip,
)
from prorsa.core.decision import Decision, Switch
from prorsa.core.demand import ForecastDemand
from prorsa.core.estimators import DemandSmoother
from prorsa.core.explain import explain
from prorsa.core.forecast.config import ForecastConfig
from prorsa.core.forecast.model import Forecaster
from prorsa.core.forecast.persist import export_state, restore_state
from prorsa.core.forecast.table import ApplyResult, TrajectoryTable
from prorsa.core.prefill_speed import PrefillReading, PrefillSpeedMeter
from prorsa.core.sizing import size
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
    DecisionInputs,
    Demand,
    DemandInputs,
    DemandSource,
    Plan,
    PlanInputs,
    RoleCounts,
    Sizing,
    SizingInputs,
    TickInput,
)
from prorsa_contract.agent_api import EngineState, Role
from prorsa_contract.events import DecodeFinished, Event, Snapshot

HIT_WINDOW_HORIZONS = 6  # the prefix-cache hit ratio is measured over this many horizons


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
        self.prefill_speed = PrefillSpeedMeter(
            profiled=profiled, hit_window=HIT_WINDOW_HORIZONS * self.horizon
        )
        # θ_P and the prefix-cache hit ratio as step 2 of the latest tick read them.
        self._prefill = PrefillReading(
            theta=profiled, miss_ratio=None, calibration=None, recomputed=0.0
        )
        self.smoother = DemandSmoother(seconds=spec.switching.smoothing_seconds)
        self.share_smoother = DemandSmoother(seconds=spec.switching.payoff_seconds)
        self.ttl = ttl_seconds if ttl_seconds is not None else max(3600.0, 100 * self.horizon)
        self._engines: dict[str, EngineState] = {}
        self._issued: dict[str, Role] = {}
        self._cooldown_until: dict[str, float] = {}
        self._assumed_prefill = spec.initial_prefill()
        self.switch_costs = SwitchCosts()
        self.regret = Regret()
        self.persistence = Persistence(seconds=spec.switching.payoff_seconds)
        self.cycle = CycleProfile()
        self._payoff_prior = spec.switching.payoff_seconds
        # The latest Decision: one reference to a frozen object, safe to read from any task.
        self.last_decision: Decision | None = None
        self.ticks = 0
        # Since when Eq. 1's best split has leaned away from the split in use, and which
        # way ("prefill": more prefill instances); whether a switch that way was made since.
        self._lean: tuple[Role, float, bool] | None = None
        # The operator's bootstrap of a fresh cluster, as followed (prorsa.core.bootstrap).
        self.bootstrap = BootstrapView()

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
        self.prefill_speed.follow(profiled=profiled, hit_window=HIT_WINDOW_HORIZONS * self.horizon)
        self.smoother = replace(self.smoother, seconds=spec.switching.smoothing_seconds)
        ttl = self._ttl_override
        self.ttl = ttl if ttl is not None else max(3600.0, 100 * self.horizon)
        payoff = spec.switching.payoff_seconds
        self.share_smoother = replace(self.share_smoother, seconds=payoff)
        if self.persistence.seconds == self._payoff_prior:  # no run of demand measured yet
            self.persistence = replace(self.persistence, seconds=payoff)
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
            flipped = old is not None and old.role != s.role and not s.switching
            if flipped and not is_flip(self.bootstrap, name):
                self._cooldown_until[name] = max(
                    self._cooldown_until.get(name, -math.inf), self._now_hint()
                )
            self.prefill_speed.observe_engine(s)
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

    def resume_switch(self, instance: str, *, to: Role) -> None:
        """A switch a previous operator process started (its intent is on the pod) goes on.

        Counted as its destination until it ends, like one this Controller issued: counted
        as unavailable instead, it would leave a role short (below its minimum when the
        switch restores one) and start a second switch toward the same split.
        """
        self._issued[instance] = to

    def record_switch(self, instance: str, *, at: float) -> None:
        """The executor finished (or gave up on) a switch: start the instance's cooldown
        (a bootstrap flip, :mod:`prorsa.core.bootstrap`, starts none and is not measured)."""
        self.bootstrap, flip = flip_ended(self.bootstrap, instance)
        if flip and instance not in self._issued:
            return
        self._issued.pop(instance, None)
        self.switch_costs.finished(instance, at=at)
        cooldown = self.spec.switching.cooldown_seconds
        self._cooldown_until[instance] = at + cooldown

    # -- outputs -----------------------------------------------------------------------------

    def learned_state(self) -> dict[str, object]:
        """Learned statistics as JSON-able data (persisted by the operator, e.g. ConfigMap):
        the forecaster's, θ_P's busy intervals, and what switching measured (durations,
        aborts, how long demand leans one way, the step-cycle profile)."""
        data = export_state(
            table=self.table, forecaster=self.forecaster, theta=self.prefill_speed.events
        )
        data["switching"] = export_switching(
            costs=self.switch_costs, persistence=self.persistence, cycle=self.cycle
        )
        return data

    def restore_learned(self, data: dict[str, object]) -> None:
        """Load :meth:`learned_state` output; raises ValueError on an unknown format or a
        malformed field (named in the message)."""
        restore_state(
            data, table=self.table, forecaster=self.forecaster, theta=self.prefill_speed.events
        )
        switching = data.get("switching")
        if switching is not None and not isinstance(switching, dict):
            raise ValueError("learned state: switching must be an object")
        self.persistence = restore_switching(
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

    def tick(self, tick: TickInput) -> Decision:
        """Decide the prefill:decode split for [now, now + S) and the switches toward it.

        The Decision's switches are the tick's effects: the caller carries them out and
        reports each end (:meth:`record_switch`). Trajectories silent for longer than the
        TTL at ``tick.evict_now`` (default ``tick.now``) are evicted.
        """
        now = tick.now
        if not math.isfinite(now):
            raise ValueError(f"tick time must be finite, got {now}")
        if tick.engines is not None:
            self.observe_engines(tick.engines)
        if self._engines:  # the operator's bootstrap of a fresh cluster, followed
            self.bootstrap = follow_bootstrap(
                self.bootstrap, now=now, spec=self.spec, engines=self.engines(), issued=self._issued
            )
        self.ticks += 1
        # 1. Trajectory table: evict the silent; what prefill engines let go decodes.
        self._update_table(now, tick.evict_now)
        # 2. Duration statistics and accuracy: score the windows closed; time prefills.
        self._learn(now)
        # 3. Capacity: the instances usable by role, θ_P, C_KV and K_D.
        roles = self._roles()
        inputs = self._demand_inputs(now, roles)
        # 4-6. The demand of the next horizon: prefill work (Eq. 15) and decode admissions
        # (Eq. 13-14) forecast, or engine queues while the trainer is silent.
        demand = self.demand_source(inputs)
        # 7. Eq. 1: the best split for the demand expected to persist.
        sized = size(
            self._sizing_inputs(now, roles, demand),
            smoother=self.smoother,
            share_smoother=self.share_smoother,
        )
        self.smoother, self.share_smoother = sized.smoother, sized.share_smoother
        sizing = sized.sizing
        # The step-scale target (switching.stepCycle) learns from the trainer's events.
        step_cycle = self.spec.switching.step_cycle and demand.mode == "predictive"
        if self.bootstrap.running:  # 8-9. A fresh cluster: held at its start split, learns nothing
            self.cycle.begin(*cycle_start(self.bootstrap, self.spec, now=now))
            plan = holding_plan(self.spec, persistence=self.persistence, regret=self.regret)
            self.last_decision = explain(self._decision_inputs(now, inputs, sizing, plan, None))
            return self.last_decision
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
        self.persistence, self.regret = plan.persistence, plan.regret
        self._start(plan.switches, at=now)
        if not self._engines:  # no engine has answered: the split assumed next tick
            self._assumed_prefill = plan.target.prefill
        # 10. The Decision: where the split goes, why, and what this tick saw.
        self._lean, waited = decision_wait(
            self._lean, now, best=sizing.best.prefill, current=roles.prefill, plan=plan
        )
        decision = explain(self._decision_inputs(now, inputs, sizing, plan, waited))
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
            seconds_per_token=1.0 / max(self.prefill_speed.busy.value, 1e-9),
        )

    def _learn(self, now: float) -> None:
        """Step 2: score the forecast windows closed by ``now`` (the WAPE and the forecast's
        bias factor), add the prefills the table timed to θ_P's busy intervals, and count
        the prefills since the last tick toward the prefix-cache hit ratio."""
        forecaster = self.forecaster
        forecaster.accuracy.close_until(now)
        intervals, forecaster.intervals = forecaster.intervals, []
        for tokens, seconds in intervals:
            self.prefill_speed.events.add_interval(tokens=tokens, seconds=seconds)
        self._prefill = self.prefill_speed.fold(
            now, prefilled=forecaster.prefilled_tokens, expected=forecaster.prefilled_computed
        )

    def _roles(self) -> RoleCounts:
        """Step 3: usable instances by role; a switching one counts as its destination
        (a bootstrap flip's is prefill)."""
        return measure.role_counts(
            self.engines(),
            issued=bootstrap_issued(self.bootstrap, self._issued),
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
            theta=self._prefill.theta,
            kv_capacity=measure.kv_capacity(engines, configured=capacity.decode_kv_tokens),
            kv_now=measure.decode_kv(engines, self.table),
            prefill_names=roles.names,
            engines=engines,
            calibration=self._prefill.calibration,
            capacity=capacity,
            ranks=self.spec.engine.attention_dp_size,
        )

    def _sizing_inputs(self, now: float, roles: RoleCounts, demand: Demand) -> SizingInputs:
        """Step 7: what Eq. 1 sizes from (:mod:`prorsa.core.sizing`)."""
        spec = self.spec
        weight_update = self.table.weight_update.in_progress(now)
        cache = demand.cache
        if cache is None and not weight_update:  # (a weight update floors it at 0)
            cache = measure.cache_floor(
                self.engines(),
                self.table,
                cache_tokens=spec.capacity.prefill_cache_tokens,
                cache_scale=spec.engine.prefix_cache_scale,
            )
        return SizingInputs(
            now=now,
            horizon=self.horizon,
            demand=demand,
            counts=roles,
            cache_floor=cache or 0.0,
            weight_update=weight_update,
            decode_share=measure.decode_share(self.table),
            spec=spec,
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
            cooldown_until=MappingProxyType(dict(self._cooldown_until)),
            contexts=MappingProxyType(self.table.live_contexts_by_instance()),
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

    def _decision_inputs(
        self, now: float, measured: DemandInputs, sizing: Sizing, plan: Plan, waited: float | None
    ) -> DecisionInputs:
        """Step 10: what the Decision is explained from."""
        acc, table = self.forecaster.accuracy, self.table
        return DecisionInputs(
            now=now,
            measured=measured,
            sizing=sizing,
            plan=plan,
            waited=waited,
            smoothing_seconds=self.smoother.seconds,
            miss_ratio=self._prefill.miss_ratio,
            calibration=self._prefill.calibration,
            recomputed_tokens=self._prefill.recomputed,
            wape=(acc.prefill_wape, acc.decode_wape),
            trajectories=MappingProxyType(table.state_counts()),
            anomalies=MappingProxyType(dict(table.anomalies)),
            last_event_ts=table.last_event_ts,
            generated_tokens=table.generated_tokens,
            prefill_waiting=table.prefill_waiting(now),
        )

    def engines(self) -> tuple[EngineState, ...]:
        """The latest state of every engine that answered, in the order given."""
        return tuple(self._engines.values())


Lean = tuple[Role, float, bool]


def decision_wait(
    lean: Lean | None, now: float, *, best: int, current: int, plan: Plan
) -> tuple[Lean | None, float | None]:
    """Seconds from Eq. 1's best split leaning away from the split in use to the first
    switch made toward it (None: no such switch at this tick), and the lean to keep.

    ``lean`` is since when the best split (``best`` prefill instances) has leaned away from
    the one in use (``current``), which way ("prefill": more prefill instances), and whether
    a switch that way was made since. The wait is part of how late the split follows a
    change of demand: what the hold rules, the pricing and cooldowns add once the forecast
    has crossed (``Diagnostics.decision_seconds``, ``prorsa_switch_decision_seconds``); the
    switch's own drain, router and flip follow (``prorsa_switch_duration_seconds``).
    """
    way: Role | None = "prefill" if best > current else "decode" if best < current else None
    if way is None:
        return None, None
    if lean is None or lean[0] != way:
        lean = (way, now, False)
    if lean[2] or not any(sw.to == way for sw in plan.switches):
        return lean, None
    return (way, lean[1], True), now - lean[1]
