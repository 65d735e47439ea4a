"""Prometheus metrics of the operator (``prorsa_*``), one registry per process.

The names are what the Grafana dashboard and the alert rules read; a test checks that
every metric they name is defined here (or by the webhook's own metrics). They follow
Prometheus's naming rules: base units (seconds, tokens), ``_total`` on counters,
``_duration_seconds`` on histograms of durations, ``_ratio`` on fractions.

The Controller counts some outcomes itself, cumulatively, in each Decision's diagnostics
(tokens generated, contexts recomputed, event anomalies); they are exported as counters,
advanced by what each tick adds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from prorsa.core.decision import Decision
from prorsa.core.diagnostics import Diagnostics
from prorsa.core.switch_cost import Move
from prorsa.switching.executor import SwitchOutcome

_CLUSTER = ("namespace", "cluster")
SWITCH_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
TICK_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
SWITCH_DIRECTIONS = (("decode", "prefill"), ("prefill", "decode"))
SWITCH_RESULTS = ("succeeded", "restored", "replaced", "lost")
# Where a switch's time goes, in order (docs/metrics.md, "Where a move's time goes").
SWITCH_PARTS = ("router", "engine")
# switching.mode of the switches priced: made (Auto) or only recommended (Recommend).
PRICED_MODES = ("Auto", "Recommend")


class OperatorMetrics:
    """Every ``prorsa_*`` series the operator exports, labelled by cluster."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.forecast_tokens = Gauge(
            "prorsa_forecast_prefill_tokens",
            "Forecast prefill demand over the horizon by source (Eq. 15), full-prompt tokens.",
            [*_CLUSTER, "component"],
            registry=r,
        )
        self.forecast_total = Gauge(
            "prorsa_forecast_prefill_demand_tokens",
            "Forecast prefill demand W_P over the horizon (bias-corrected), tokens.",
            _CLUSTER,
            registry=r,
        )
        self.decode_admission = Gauge(
            "prorsa_forecast_decode_admission_tokens",
            "Forecast decode admissions over the horizon (Eq. 14), prompt tokens.",
            _CLUSTER,
            registry=r,
        )
        self.decode_kv = Gauge(
            "prorsa_decode_kv_tokens",
            "Decode KV: current use, current plus predicted admissions, capacity per instance.",
            [*_CLUSTER, "kind"],
            registry=r,
        )
        self.theta = Gauge(
            "prorsa_prefill_tokens_per_second",
            "Prefill speed θ_P per instance, full-prompt tokens per second (cache hits included).",
            _CLUSTER,
            registry=r,
        )
        self.cache_hit = Gauge(
            "prorsa_prefix_cache_hit_ratio",
            "Share of prefilled prompt tokens served from the prefix cache, last 6 horizons "
            "(trainer's full prompts against the engines' computed tokens).",
            _CLUSTER,
            registry=r,
        )
        self.instances = Gauge(
            "prorsa_instances",
            "Engine instances by role (prefill, decode, switching, unavailable).",
            [*_CLUSTER, "role"],
            registry=r,
        )
        self.target = Gauge(
            "prorsa_target_instances", "Target instances by role.", [*_CLUSTER, "role"], registry=r
        )
        self.demand = Gauge(
            "prorsa_demand_instances",
            "Demand in instances by role: W_P/(S·θ_P) and (K_D+K̂_D)/C_KV.",
            [*_CLUSTER, "role"],
            registry=r,
        )
        self.planned = Gauge(
            "prorsa_planned_demand_instances",
            "Demand in instances by role averaged over switching.smoothingSeconds: what the "
            "split is sized for.",
            [*_CLUSTER, "role"],
            registry=r,
        )
        self.cache_floor = Gauge(
            "prorsa_prefix_cache_floor_instances",
            "Prefill instances whose prefix caches hold the contexts of every live "
            "trajectory, averaged over switching.smoothingSeconds: the planned prefill "
            "demand is never below it.",
            _CLUSTER,
            registry=r,
        )
        self.best = Gauge(
            "prorsa_best_split_instances",
            "Eq. 1's best split by role for the planned demand, before the hold rules and "
            "switch pricing (the target differs when a move does not pay).",
            [*_CLUSTER, "role"],
            registry=r,
        )
        self.margin = Gauge(
            "prorsa_safety_margin_ratio",
            "Shared safety margin δ of Eq. 1 (negative: demand over budget).",
            _CLUSTER,
            registry=r,
        )
        self.mode = Gauge(
            "prorsa_forecast_mode",
            "1 for the Controller's current mode (predictive or reactive).",
            [*_CLUSTER, "mode"],
            registry=r,
        )
        self.wape = Gauge(
            "prorsa_forecast_wape_ratio",
            "Forecast WAPE over recent windows (prefill, decode).",
            [*_CLUSTER, "forecast"],
            registry=r,
        )
        self.switches = Counter(
            "prorsa_switches",
            "Role switches by origin, destination and result.",
            [*_CLUSTER, "from_role", "to_role", "result"],
            registry=r,
        )
        self.switch_seconds = Histogram(
            "prorsa_switch_duration_seconds",
            "Wall time of a role switch, from intent to relabel, by direction.",
            [*_CLUSTER, "from_role", "to_role"],
            buckets=SWITCH_BUCKETS,
            registry=r,
        )
        self.switch_decision = Histogram(
            "prorsa_switch_decision_seconds",
            "Seconds from Eq. 1's best split leaning away from the split in use to the first "
            "switch made toward it (hold rules, pricing, cooldowns); the switch's own drain, "
            "router and flip follow, in prorsa_switch_duration_seconds.",
            [*_CLUSTER],
            buckets=SWITCH_BUCKETS,
            registry=r,
        )
        self.switch_parts = Histogram(
            "prorsa_switch_part_duration_seconds",
            "Where a switch's time goes, by part: router (the draining label until the "
            "router no longer lists the pod), engine (the agent's drain, abort, flip and "
            "verification).",
            [*_CLUSTER, "part"],
            buckets=SWITCH_BUCKETS,
            registry=r,
        )
        self.expected_gain = Counter(
            "prorsa_switch_expected_gain_seconds",
            "Rollout seconds the Controller expected each switch to save over the payoff "
            "horizon when it priced it, by direction and switching.mode (Recommend: the "
            "switches it would have made).",
            [*_CLUSTER, "from_role", "to_role", "switching_mode"],
            registry=r,
        )
        self.expected_cost = Counter(
            "prorsa_switch_expected_cost_seconds",
            "Rollout seconds the Controller expected each switch to cost (its duration, the "
            "prefill work it throws away), by direction and switching.mode.",
            [*_CLUSTER, "from_role", "to_role", "switching_mode"],
            registry=r,
        )
        self.tick_seconds = Histogram(
            "prorsa_tick_duration_seconds",
            "Time of one control tick (poll excluded).",
            _CLUSTER,
            buckets=TICK_BUCKETS,
            registry=r,
        )
        self.trajectories = Gauge(
            "prorsa_live_trajectories",
            "Live trajectories by lifecycle state.",
            [*_CLUSTER, "state"],
            registry=r,
        )
        self.anomalies = Counter(
            "prorsa_event_anomalies",
            "Events that did not fit the trajectory state machine, by kind.",
            [*_CLUSTER, "kind"],
            registry=r,
        )
        self.generated = Counter(
            "prorsa_generated_tokens",
            "Output tokens the trainer's decode_finished events report (aborted partial "
            "outputs included): rate() is the rollout's generated tokens per second.",
            _CLUSTER,
            registry=r,
        )
        self.prefill_waiting = Gauge(
            "prorsa_prefill_waiting_prompts",
            "Prompts the trainer queued whose prefill has not ended (waiting or prefilling).",
            _CLUSTER,
            registry=r,
        )
        self.prefill_wait = Gauge(
            "prorsa_prefill_oldest_wait_seconds",
            "How long the oldest prompt waiting for its prefill has waited since it was "
            "queued (0 when none waits).",
            _CLUSTER,
            registry=r,
        )
        self.decode_waiting = Gauge(
            "prorsa_decode_waiting_requests",
            "Requests queued on the decode engines: prefilled prompts waiting for KV room "
            "(the agents' waitingRequests).",
            _CLUSTER,
            registry=r,
        )
        self.recomputed = Counter(
            "prorsa_recomputed_prefill_tokens",
            "Prefill tokens the engines computed beyond each prompt's cached prefix (its "
            "previous turn's context): contexts computed again after a cache flush, a switch "
            "or an abort, or by engines without a prefix cache.",
            _CLUSTER,
            registry=r,
        )
        self.agent_errors = Counter(
            "prorsa_agent_poll_errors",
            "Failed polls of an engine agent's /v1/state.",
            _CLUSTER,
            registry=r,
        )
        self.agent_polls = Counter(
            "prorsa_agent_polls",
            "Polls of engine agents' /v1/state (one per engine pod per tick).",
            _CLUSTER,
            registry=r,
        )
        self.label_corrections = Counter(
            "prorsa_role_label_corrections",
            "Engine pods relabelled because their role label disagreed with their engine.",
            _CLUSTER,
            registry=r,
        )
        self.forecast_age = Gauge(
            "prorsa_trainer_silence_seconds",
            "Seconds since the last trainer event (trainer clock).",
            _CLUSTER,
            registry=r,
        )
        # The cumulative figures of the last Decision, by (namespace, cluster, name): what
        # the counters above have been advanced to.
        self._seen: dict[tuple[str, str, str], float] = {}

    def record_decision(
        self,
        namespace: str,
        cluster: str,
        decision: Decision,
        *,
        demand_prefill: float,
        demand_decode: float,
        kv_now: float,
        planned: tuple[float, float] | None = None,
        cache_hit_ratio: float | None = None,
        cache_floor: float | None = None,
    ) -> None:
        key = (namespace, cluster)
        f = decision.forecast
        for name, value in f.components.model_dump().items():
            self.forecast_tokens.labels(*key, name).set(value)
        self.forecast_total.labels(*key).set(f.prefill_tokens)
        self.decode_admission.labels(*key).set(f.decode_admission_tokens)
        self.decode_kv.labels(*key, "current").set(kv_now)
        self.decode_kv.labels(*key, "predicted").set(f.decode_kv_tokens)
        self.decode_kv.labels(*key, "capacity").set(decision.capacity.decode_kv_tokens)
        self.theta.labels(*key).set(decision.capacity.prefill_tokens_per_second)
        self.target.labels(*key, "prefill").set(decision.target.prefill)
        self.target.labels(*key, "decode").set(decision.target.decode)
        self.demand.labels(*key, "prefill").set(demand_prefill)
        self.demand.labels(*key, "decode").set(demand_decode)
        plan_p, plan_d = planned if planned is not None else (demand_prefill, demand_decode)
        self.planned.labels(*key, "prefill").set(plan_p)
        self.planned.labels(*key, "decode").set(plan_d)
        if cache_hit_ratio is not None:
            self.cache_hit.labels(*key).set(cache_hit_ratio)
        if cache_floor is not None:
            self.cache_floor.labels(*key).set(cache_floor)
        self.margin.labels(*key).set(decision.safety_margin)
        for mode in ("predictive", "reactive"):
            self.mode.labels(*key, mode).set(1.0 if decision.mode == mode else 0.0)

    def record_outcomes(self, namespace: str, cluster: str, diag: Diagnostics) -> None:
        """What one tick saw of the rollout's outcome: Eq. 1's best split, the queues,
        and the counters the Controller keeps cumulatively, advanced by what is new."""
        key = (namespace, cluster)
        self.best.labels(*key, "prefill").set(diag.best[0])
        self.best.labels(*key, "decode").set(diag.best[1])
        self.prefill_waiting.labels(*key).set(diag.prefill_waiting)
        self.prefill_wait.labels(*key).set(diag.prefill_oldest_wait)
        self.decode_waiting.labels(*key).set(diag.decode_waiting)
        self._advance(self.generated.labels(*key), key, "generated", diag.generated_tokens)
        self._advance(self.recomputed.labels(*key), key, "recomputed", diag.recomputed_tokens)
        for kind, count in diag.anomalies.items():
            self._advance(self.anomalies.labels(*key, kind), key, f"anomaly:{kind}", count)

    def record_switch(self, namespace: str, cluster: str, outcome: SwitchOutcome) -> None:
        """A switch ended: its result, its duration and the duration of its parts."""
        key = (namespace, cluster, outcome.origin, outcome.to)
        self.switches.labels(*key, outcome.result).inc()
        self.switch_seconds.labels(*key).observe(outcome.seconds)
        for part, seconds in (
            ("router", outcome.router_seconds),
            ("engine", outcome.engine_seconds),
        ):
            if seconds is not None:
                self.switch_parts.labels(namespace, cluster, part).observe(seconds)

    def record_decision_wait(self, namespace: str, cluster: str, diag: Diagnostics) -> None:
        """The decision part of how late the split followed demand, at a tick whose
        switches started (``Diagnostics.decision_seconds``)."""
        if diag.decision_seconds is not None:
            self.switch_decision.labels(namespace, cluster).observe(diag.decision_seconds)

    def _advance(self, child: Counter, key: tuple[str, str], name: str, total: float) -> None:
        """Advance ``child`` to a cumulative ``total`` (a smaller one: a new count began)."""
        seen = self._seen.get((*key, name), 0.0)
        step = total - seen if total >= seen else total
        if step > 0:
            child.inc(step)
        self._seen[(*key, name)] = total

    def record_priced(
        self, namespace: str, cluster: str, moves: Iterable[Move], *, switching_mode: str
    ) -> None:
        """The seconds each move was expected to save and to cost, when it was made (Auto)
        or recommended (Recommend). A move out of a split with an empty role (restoring a
        role minimum) has no finite price: it is left out, not counted as infinite, which
        would stay in the counter for good."""
        for move in moves:
            if not (math.isfinite(move.gain) and math.isfinite(move.cost)):
                continue
            labels = (namespace, cluster, move.src, move.dst, switching_mode)
            self.expected_gain.labels(*labels).inc(max(move.gain, 0.0))
            self.expected_cost.labels(*labels).inc(max(move.cost, 0.0))

    def start_cluster(self, namespace: str, cluster: str) -> None:
        """Create a cluster's counter children at 0 before anything happens.

        A counter child that first appears at 1 has no earlier sample, so ``increase()``
        (the alerts', which survives counter resets) cannot see that first switch failure;
        one exported at 0 from the start makes it a step it counts. The operator calls this
        for every cluster it runs, again after each restart.
        """
        for origin, to in SWITCH_DIRECTIONS:
            for result in SWITCH_RESULTS:
                self.switches.labels(namespace, cluster, origin, to, result)
            for mode in PRICED_MODES:
                self.expected_gain.labels(namespace, cluster, origin, to, mode)
                self.expected_cost.labels(namespace, cluster, origin, to, mode)
        self.agent_errors.labels(namespace, cluster)
        self.agent_polls.labels(namespace, cluster)
        self.label_corrections.labels(namespace, cluster)
        self.generated.labels(namespace, cluster)
        self.recomputed.labels(namespace, cluster)

    def forget(self, namespace: str, cluster: str) -> None:
        """Drop a deleted cluster's series so dashboards do not show it forever."""
        for metric in (
            self.forecast_tokens, self.forecast_total, self.decode_admission, self.decode_kv,
            self.theta, self.cache_hit, self.instances, self.target, self.demand, self.planned,
            self.cache_floor, self.best, self.margin, self.mode,
            self.wape, self.switches, self.switch_seconds, self.switch_parts, self.expected_gain,
            self.expected_cost, self.tick_seconds, self.trajectories,
            self.anomalies, self.generated, self.prefill_waiting, self.prefill_wait,
            self.decode_waiting, self.recomputed,
            self.agent_errors, self.agent_polls, self.label_corrections, self.forecast_age,
        ):  # fmt: skip
            for labels in list(metric._metrics):
                if labels[:2] == (namespace, cluster):
                    metric.remove(*labels)
        for seen in [k for k in self._seen if k[:2] == (namespace, cluster)]:
            del self._seen[seen]
