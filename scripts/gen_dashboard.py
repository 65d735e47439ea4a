#!/usr/bin/env python3
"""Generate the Prorsa Grafana dashboard (``charts/prorsa/dashboards/prorsa.json``).

The dashboard is built with Grafana's own Python SDK (PyPI ``grafana-foundation-sdk``, pinned
in the ``test`` extra) rather than edited as JSON by hand: panels are laid out by the SDK's
grid builder, every query goes through :func:`q`, and the file is regenerated, never patched.
The generated JSON is committed so that the chart (which ships it in a ConfigMap for Grafana's
dashboard sidecar) needs no Python at install time; ``tests/test_dashboard.py`` checks that
the committed file equals a fresh generation and that each query names only metrics the
operator exports.

Run::

    .venv/bin/pip install 'grafana-foundation-sdk==1769699998!10.1.0'   # in .[test] already
    .venv/bin/python scripts/gen_dashboard.py            # writes the dashboard
    .venv/bin/python scripts/gen_dashboard.py --check    # exit 1 if the committed file differs

Every panel is templated by ``$namespace`` and ``$cluster`` (the RolloutCluster's namespace
and name, the labels every ``prorsa_*`` series of a cluster carries) except the trainer
webhook's, whose series are operator-wide.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "charts" / "prorsa" / "dashboards" / "prorsa.json"

UID = "prorsa-operator"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'namespace=~"$namespace", cluster=~"$cluster"'
RATE = "$__rate_interval"


def q(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    """One Prometheus range query; ``legend`` uses Grafana's ``{{label}}`` templating."""
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range()


def quantiles(metric: str, by: str, *, selector: str = "") -> list[prometheus.Dataquery]:
    """p50/p90/p99 of a histogram, one series per ``by`` value."""
    labels = f"{{{selector}}}" if selector else ""
    group = f"{by}, le" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return [
        q(
            f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{labels}[{RATE}])))",
            f"{prefix}p{round(p * 100)}",
            ref,
        )
        for p, ref in ((0.5, "A"), (0.9, "B"), (0.99, "C"))
    ]


def legend() -> common.VizLegendOptions:
    return (
        common.VizLegendOptions()
        .display_mode(cm.LegendDisplayMode.TABLE)
        .placement(cm.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["lastNotNull", "max"])
    )


def series(
    title: str,
    description: str,
    targets: list[prometheus.Dataquery],
    *,
    unit: str = "short",
    span: int = 12,
    stacked: bool = False,
    bars: bool = False,
    minimum: float | None = 0,
    dashed: str | None = None,
    unstacked: str | None = None,
    threshold: float | None = None,
) -> timeseries.Panel:
    """A time-series panel.

    ``dashed`` is a regex of series names drawn dashed (targets, totals); ``unstacked`` one of
    series kept out of a stack (a total drawn over its parts); ``threshold`` draws a red line
    (a ratio of 1, a margin of 0).
    """
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(span)
        .height(8)
        .legend(legend())
        .tooltip(
            common.VizTooltipOptions()
            .mode(cm.TooltipDisplayMode.MULTI)
            .sort(cm.SortOrder.DESCENDING)
        )
        .line_width(2)
        .fill_opacity(35 if stacked else 8)
        .span_nulls(True)
    )
    if minimum is not None:
        panel = panel.min(minimum)
    if stacked:
        panel = panel.stacking(common.StackingConfig().mode(cm.StackingMode.NORMAL))
    if bars:
        panel = panel.draw_style(cm.GraphDrawStyle.BARS)
    overrides: dict[str, list[dm.DynamicConfigValue]] = {}
    if dashed:
        overrides.setdefault(dashed, []).append(
            dm.DynamicConfigValue(
                id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}
            )
        )
    if unstacked:
        overrides.setdefault(unstacked, []).extend(
            [
                dm.DynamicConfigValue(
                    id_val="custom.stacking", value={"mode": "none", "group": "A"}
                ),
                dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
            ]
        )
    for regexp, props in overrides.items():
        panel = panel.override_by_regexp(regexp, props)
    if threshold is not None:
        panel = panel.thresholds(
            dashboard.ThresholdsConfig()
            .mode(dm.ThresholdsMode.ABSOLUTE)
            .steps([dm.Threshold(value=None, color="green"), dm.Threshold(threshold, "red")])
        ).thresholds_style(
            common.GraphThresholdsStyleConfig().mode(cm.GraphTresholdsStyleMode.LINE)
        )
    for target in targets:
        panel = panel.with_target(target)
    return panel


def single(
    title: str,
    description: str,
    expr: str,
    legend_: str,
    *,
    unit: str = "short",
    steps: list[dm.Threshold] | None = None,
) -> stat.Panel:
    """A stat panel showing the latest value of each cluster's series."""
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(4)
        .height(4)
        .graph_mode(cm.BigValueGraphMode.AREA)
        .color_mode(cm.BigValueColorMode.VALUE)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(
            dashboard.ThresholdsConfig()
            .mode(dm.ThresholdsMode.ABSOLUTE)
            .steps(steps or [dm.Threshold(value=None, color="blue")])
        )
        .with_target(q(expr, legend_, "A"))
    )


def variables() -> list[Any]:
    def label_variable(name: str, query: str, label: str) -> dashboard.QueryVariable:
        return (
            dashboard.QueryVariable(name)
            .label(label)
            .datasource(DS)
            .query(query)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )

    return [
        dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        label_variable("namespace", "label_values(prorsa_instances, namespace)", "Namespace"),
        label_variable(
            "cluster",
            'label_values(prorsa_instances{namespace=~"$namespace"}, cluster)',
            "RolloutCluster",
        ),
    ]


def paying() -> list[Any]:
    """The row that answers a user's first question: is switching helping this job?"""
    by_cluster = "{{namespace}}/{{cluster}}"
    by_mode = f"{by_cluster} {{{{switching_mode}}}}"

    def over_range(metric: str) -> str:
        return (
            f"sum by (namespace, cluster, switching_mode) (increase({metric}{{{SEL}}}[$__range]))"
        )

    gain = "prorsa_switch_expected_gain_seconds_total"
    cost = "prorsa_switch_expected_cost_seconds_total"
    net_steps = [dm.Threshold(value=None, color="red"), dm.Threshold(0, "green")]
    return [
        single(
            "Expected gain of switches (range)",
            "Rollout seconds the Controller expected its switches to save over the payoff "
            "horizon, summed over the dashboard's time range (Auto: switches made; "
            "Recommend: the switches it would have made).",
            over_range(gain),
            by_mode,
            unit="s",
        ),
        single(
            "Expected cost of switches (range)",
            "Rollout seconds the Controller expected the same switches to cost (their "
            "duration, the prefill work they throw away), summed over the time range.",
            over_range(cost),
            by_mode,
            unit="s",
        ),
        single(
            "Expected net saving (range)",
            "Expected gain minus expected cost over the time range. The Controller makes a "
            "switch only when its gain beats its cost, so this is its own account; the "
            "queues and tokens per second below are what the rollout got.",
            f"{over_range(gain)} - {over_range(cost)}",
            by_mode,
            unit="s",
            steps=net_steps,
        ),
        series(
            "Expected gain vs cost of switches, cumulative per hour",
            "Seconds the switches of the last hour were expected to save (solid) and to cost "
            "(dashed), at each point.",
            [
                q(
                    f"sum by (namespace, cluster, switching_mode) (increase({gain}{{{SEL}}}[1h]))",
                    f"{by_mode} gain",
                    "A",
                ),
                q(
                    f"sum by (namespace, cluster, switching_mode) (increase({cost}{{{SEL}}}[1h]))",
                    f"{by_mode} cost",
                    "B",
                ),
            ],
            unit="s",
            dashed=".* cost$",
        ),
        series(
            "Prefill split against Eq. 1's target",
            "Prefill instances serving (solid), Eq. 1's best split for the planned demand "
            "(dotted: before the hold rules and switch pricing) and the Controller's target "
            "(dashed: where it is moving). The target stays off Eq. 1's best while a move "
            "does not pay for itself.",
            [
                q(f'prorsa_instances{{role="prefill", {SEL}}}', f"{by_cluster} instances", "A"),
                q(
                    f'prorsa_best_split_instances{{role="prefill", {SEL}}}',
                    f"{by_cluster} Eq. 1 best",
                    "B",
                ),
                q(f'prorsa_target_instances{{role="prefill", {SEL}}}', f"{by_cluster} target", "C"),
            ],
            dashed=".* (target|Eq. 1 best)$",
        ),
        series(
            "Forecast WAPE, prefill and decode",
            "Weighted absolute percentage error of each forecast over recent windows; the "
            "ProrsaForecastInaccurate alert fires above 0.5 for 15 minutes.",
            [q(f"prorsa_forecast_wape_ratio{{{SEL}}}", f"{by_cluster} {{{{forecast}}}}", "A")],
            unit="percentunit",
            threshold=0.5,
        ),
        series(
            "Queue waits",
            "How long the oldest prompt waiting for its prefill has waited since the trainer "
            "queued it.",
            [q(f"prorsa_prefill_oldest_wait_seconds{{{SEL}}}", f"{by_cluster} oldest", "A")],
            unit="s",
            span=8,
        ),
        series(
            "Queued prompts and requests",
            "Prompts waiting for (or in) prefill, from the trainer's events, and requests "
            "waiting on decode engines for KV room, from the agents.",
            [
                q(f"prorsa_prefill_waiting_prompts{{{SEL}}}", f"{by_cluster} prefill", "A"),
                q(f"prorsa_decode_waiting_requests{{{SEL}}}", f"{by_cluster} decode", "B"),
            ],
            span=8,
        ),
        series(
            "Tokens per second",
            "Generated tokens per second (the trainer's decode_finished events) and prefill "
            "tokens computed again per second (beyond each prompt's cached prefix: a flushed "
            "or missing prefix cache, a switch, an abort).",
            [
                q(
                    "sum by (namespace, cluster) "
                    f"(rate(prorsa_generated_tokens_total{{{SEL}}}[{RATE}]))",
                    f"{by_cluster} generated",
                    "A",
                ),
                q(
                    "sum by (namespace, cluster) "
                    f"(rate(prorsa_recomputed_prefill_tokens_total{{{SEL}}}[{RATE}]))",
                    f"{by_cluster} recomputed prefill",
                    "B",
                ),
            ],
            unit="short",
            span=8,
        ),
    ]


def rows() -> list[tuple[str, list[Any]]]:
    """(row title, panels) in display order."""
    by_cluster = "{{namespace}}/{{cluster}}"
    green_red_at_zero = [dm.Threshold(value=None, color="red"), dm.Threshold(0, "green")]
    overview = [
        single(
            "Prefill instances",
            "Engine instances serving prefill now (healthy, not switching).",
            f'prorsa_instances{{role="prefill", {SEL}}}',
            by_cluster,
        ),
        single(
            "Decode instances",
            "Engine instances serving decode now (healthy, not switching).",
            f'prorsa_instances{{role="decode", {SEL}}}',
            by_cluster,
        ),
        single(
            "Unavailable instances",
            "Instances whose agent is unreachable or whose engine is unhealthy.",
            f'prorsa_instances{{role="unavailable", {SEL}}}',
            by_cluster,
            steps=[dm.Threshold(value=None, color="green"), dm.Threshold(1, "red")],
        ),
        single(
            "Safety margin δ",
            "The shared safety margin of Eq. 1 at the current target; negative means the "
            "forecast demand exceeds the GPU budget.",
            f"prorsa_safety_margin_ratio{{{SEL}}}",
            by_cluster,
            unit="percentunit",
            steps=green_red_at_zero,
        ),
        single(
            "Forecast mode",
            "1 while the Controller runs reactive (no fresh trainer events), 0 predictive.",
            f'prorsa_forecast_mode{{mode="reactive", {SEL}}}',
            by_cluster,
            steps=[dm.Threshold(value=None, color="green"), dm.Threshold(1, "orange")],
        ),
        single(
            "Forecast WAPE",
            "Weighted absolute percentage error of the prefill and decode forecasts over "
            "recent windows.",
            f"prorsa_forecast_wape_ratio{{{SEL}}}",
            f"{by_cluster} {{{{forecast}}}}",
            unit="percentunit",
            steps=[dm.Threshold(value=None, color="green"), dm.Threshold(0.25, "orange")],
        ),
    ]
    capacity = [
        series(
            "Prefill instances vs target",
            "Serving prefill instances (solid) against the Controller's target (dashed).",
            [
                q(f'prorsa_instances{{role="prefill", {SEL}}}', f"{by_cluster} instances", "A"),
                q(f'prorsa_target_instances{{role="prefill", {SEL}}}', f"{by_cluster} target", "B"),
            ],
            dashed=".* target$",
        ),
        series(
            "Decode instances vs target",
            "Serving decode instances (solid) against the Controller's target (dashed).",
            [
                q(f'prorsa_instances{{role="decode", {SEL}}}', f"{by_cluster} instances", "A"),
                q(f'prorsa_target_instances{{role="decode", {SEL}}}', f"{by_cluster} target", "B"),
            ],
            dashed=".* target$",
        ),
        series(
            "Switching and unavailable instances",
            "Instances in the middle of a role switch (draining, flipping, verifying) and "
            "instances that serve nothing because their agent or engine is down.",
            [
                q(
                    f'prorsa_instances{{role=~"switching|unavailable", {SEL}}}',
                    f"{by_cluster} {{{{role}}}}",
                    "A",
                )
            ],
            bars=True,
        ),
        series(
            "Safety margin δ",
            "Eq. 1's shared margin at the chosen split: capacity over forecast demand, minus "
            "one. Below zero (red line) the demand does not fit the GPU budget.",
            [q(f"prorsa_safety_margin_ratio{{{SEL}}}", by_cluster, "A")],
            unit="percentunit",
            minimum=None,
            threshold=0,
        ),
    ]
    demand = [
        series(
            "Forecast prefill demand by source",
            "W_P over the horizon by source (Eq. 15, stacked: sampler, startup, ready, tool, "
            "inflight) and the bias-corrected total (dashed), in full-prompt tokens.",
            [
                q(
                    f"prorsa_forecast_prefill_tokens{{{SEL}}}",
                    f"{by_cluster} {{{{component}}}}",
                    "A",
                ),
                q(f"prorsa_forecast_prefill_demand_tokens{{{SEL}}}", f"{by_cluster} W_P", "B"),
            ],
            stacked=True,
            dashed=".* W_P$",
            unstacked=".* W_P$",
        ),
        series(
            "Demand vs capacity, in instances",
            "Demand by role in instances (prefill W_P/(S·θ_P), decode (K_D+K̂_D)/C_KV), "
            "the same averaged over switching.smoothingSeconds (planned: what the split is "
            "sized for; prefill never below the prefix-cache floor, the instances whose "
            "caches hold every live context), against the instances serving that role.",
            [
                q(f"prorsa_demand_instances{{{SEL}}}", f"{by_cluster} {{{{role}}}} demand", "A"),
                q(
                    f'prorsa_instances{{role=~"prefill|decode", {SEL}}}',
                    f"{by_cluster} {{{{role}}}} capacity",
                    "B",
                ),
                q(
                    f"prorsa_planned_demand_instances{{{SEL}}}",
                    f"{by_cluster} {{{{role}}}} planned",
                    "C",
                ),
                q(
                    f"prorsa_prefix_cache_floor_instances{{{SEL}}}",
                    f"{by_cluster} prefill prefix-cache floor",
                    "D",
                ),
            ],
            dashed=".* capacity$",
        ),
        series(
            "Demand / capacity ratio",
            "Demand over serving instances per role. Above 1 (red line) the role is short "
            "of capacity; the Controller moves instances toward the higher ratio.",
            [
                q(
                    f"prorsa_demand_instances{{{SEL}}} / "
                    f'prorsa_instances{{role=~"prefill|decode", {SEL}}}',
                    f"{by_cluster} {{{{role}}}}",
                    "A",
                )
            ],
            unit="percentunit",
            threshold=1,
        ),
        series(
            "Decode KV tokens",
            "Current decode KV use, current plus predicted admissions over the horizon "
            "(K_D+K̂_D), and the KV capacity of all decode instances (dashed).",
            [
                q(
                    f'prorsa_decode_kv_tokens{{kind=~"current|predicted", {SEL}}}',
                    f"{by_cluster} {{{{kind}}}}",
                    "A",
                ),
                q(
                    f'prorsa_decode_kv_tokens{{kind="capacity", {SEL}}} '
                    "* on (namespace, cluster) group_left () "
                    f'prorsa_instances{{role="decode", {SEL}}}',
                    f"{by_cluster} capacity",
                    "B",
                ),
            ],
            dashed=".* capacity$",
        ),
        series(
            "Prefill speed θ_P",
            "Prefill speed per instance in full-prompt tokens per second: the profiled speed "
            "of computed tokens over (1 − prefix-cache hit ratio).",
            [q(f"prorsa_prefill_tokens_per_second{{{SEL}}}", by_cluster, "A")],
        ),
        series(
            "Prefix-cache hit ratio",
            "Share of prefilled prompt tokens served from the engines' prefix caches over the "
            "last 6 horizons. A drop means re-prefills: a weight update, a role switch.",
            [q(f"prorsa_prefix_cache_hit_ratio{{{SEL}}}", by_cluster, "A")],
            unit="percentunit",
        ),
        series(
            "Forecast decode admissions",
            "Prompt tokens predicted to enter decode within the horizon (Eq. 14).",
            [q(f"prorsa_forecast_decode_admission_tokens{{{SEL}}}", by_cluster, "A")],
        ),
    ]
    accuracy = [
        series(
            "Forecast WAPE",
            "Weighted absolute percentage error of the prefill and decode forecasts against "
            "what was observed, over recent windows.",
            [q(f"prorsa_forecast_wape_ratio{{{SEL}}}", f"{by_cluster} {{{{forecast}}}}", "A")],
            unit="percentunit",
            span=8,
        ),
        series(
            "Reactive mode",
            "1 while the Controller runs from engine states alone (no fresh trainer events).",
            [q(f'prorsa_forecast_mode{{mode="reactive", {SEL}}}', by_cluster, "A")],
            span=8,
        ),
        series(
            "Trainer silence",
            "Seconds since the last trainer event (trainer clock).",
            [q(f"prorsa_trainer_silence_seconds{{{SEL}}}", by_cluster, "A")],
            unit="s",
            span=8,
        ),
    ]
    switches = [
        series(
            "Switches per minute by result",
            "Finished role switches: succeeded, restored (old role back), replaced (pod "
            "recreated) or lost.",
            [
                q(
                    "sum by (namespace, cluster, result) "
                    f"(rate(prorsa_switches_total{{{SEL}}}[{RATE}])) * 60",
                    f"{by_cluster} {{{{result}}}}",
                    "A",
                )
            ],
            span=8,
            bars=True,
            stacked=True,
        ),
        series(
            "Switches per minute by direction",
            "Finished role switches by origin and destination role.",
            [
                q(
                    "sum by (namespace, cluster, from_role, to_role) "
                    f"(rate(prorsa_switches_total{{{SEL}}}[{RATE}])) * 60",
                    f"{by_cluster} {{{{from_role}}}} → {{{{to_role}}}}",
                    "A",
                )
            ],
            span=8,
            bars=True,
            stacked=True,
        ),
        series(
            "Switch duration by direction",
            "Wall time of a role switch from intent to relabel (drain, flip, verify), by "
            "direction.",
            [
                q(
                    f"histogram_quantile({p}, sum by (cluster, from_role, to_role, le) "
                    f"(rate(prorsa_switch_duration_seconds_bucket{{{SEL}}}[{RATE}])))",
                    f"{{{{cluster}}}} {{{{from_role}}}} → {{{{to_role}}}} p{round(p * 100)}",
                    ref,
                )
                for p, ref in ((0.5, "A"), (0.9, "B"))
            ],
            unit="s",
            span=8,
        ),
        series(
            "Where a switch's time goes",
            "Median seconds per move by part: decision (Eq. 1's best split leaned away until "
            "the first switch toward it: hold rules, pricing, cooldowns), router (draining "
            "label until the router dropped the pod), engine (the agent's drain, flip and "
            "verification).",
            [
                q(
                    "histogram_quantile(0.5, sum by (cluster, le) "
                    f"(rate(prorsa_switch_decision_seconds_bucket{{{SEL}}}[{RATE}])))",
                    "{{cluster}} decision p50",
                    "A",
                ),
                q(
                    "histogram_quantile(0.5, sum by (cluster, part, le) "
                    f"(rate(prorsa_switch_part_duration_seconds_bucket{{{SEL}}}[{RATE}])))",
                    "{{cluster}} {{part}} p50",
                    "B",
                ),
            ],
            unit="s",
            span=8,
        ),
    ]
    webhook = [
        series(
            "Webhook events per second by type",
            "Lifecycle events accepted from trainers, all clusters.",
            [
                q(
                    f"sum by (type) (rate(prorsa_webhook_events_total[{RATE}]))",
                    "{{type}}",
                    "A",
                )
            ],
            unit="ops",
            span=6,
            stacked=True,
        ),
        series(
            "Webhook rejects per second by reason",
            "Requests refused whole: unreadable (400), invalid (422), unauthorized (401), "
            "unknown_cluster (404), timeout (408), too_large (413), queue_full, busy and "
            "trajectory_limit (429).",
            [
                q(
                    f"sum by (reason) (rate(prorsa_webhook_rejects_total[{RATE}]))",
                    "{{reason}}",
                    "A",
                )
            ],
            unit="reqps",
            span=6,
            stacked=True,
        ),
        series(
            "Webhook batch latency",
            "From a batch's arrival to its reply (accepted batches).",
            quantiles("prorsa_webhook_batch_duration_seconds", ""),
            unit="s",
            span=6,
        ),
        series(
            "Replays, superseded and pending events",
            "Replayed event ids (counted, not applied twice) and events older than the last "
            "resync snapshot, per second; validated events waiting for their Controller.",
            [
                q(f"rate(prorsa_webhook_duplicates_total[{RATE}])", "replayed /s", "A"),
                q(f"rate(prorsa_webhook_superseded_total[{RATE}])", "superseded /s", "B"),
                q("prorsa_webhook_pending_events", "pending", "C"),
            ],
            span=6,
        ),
    ]
    trajectories = [
        series(
            "Live trajectories by state",
            "Trajectories the Controller tracks, by lifecycle state (stacked).",
            [
                q(
                    f"prorsa_live_trajectories{{{SEL}}}",
                    f"{by_cluster} {{{{state}}}}",
                    "A",
                )
            ],
            stacked=True,
        ),
        series(
            "Event anomalies per second by kind",
            "Events that did not fit the trajectory state machine: a trainer integration bug "
            "or lost events.",
            [
                q(
                    "sum by (namespace, cluster, kind) "
                    f"(rate(prorsa_event_anomalies_total{{{SEL}}}[{RATE}]))",
                    f"{by_cluster} {{{{kind}}}}",
                    "A",
                )
            ],
            unit="ops",
        ),
        series(
            "Control tick duration",
            "Time of one control tick (forecast, allocation, status), agent polls excluded.",
            quantiles("prorsa_tick_duration_seconds", "cluster", selector=SEL),
            unit="s",
        ),
        series(
            "Agent poll errors per second",
            "Failed polls of engine agents' /v1/state; a polled-out agent counts its "
            "instance unavailable.",
            [
                q(
                    "sum by (namespace, cluster) "
                    f"(rate(prorsa_agent_poll_errors_total{{{SEL}}}[{RATE}]))",
                    by_cluster,
                    "A",
                )
            ],
            unit="ops",
        ),
    ]
    return [
        ("Overview", overview),
        ("Is switching paying?", paying()),
        ("Capacity vs target", capacity),
        ("Demand and capacity", demand),
        ("Forecast accuracy", accuracy),
        ("Role switches", switches),
        ("Trainer webhook (all clusters)", webhook),
        ("Trajectories and operator health", trajectories),
    ]


def build() -> dict[str, Any]:
    """The dashboard as plain JSON data (dicts and lists)."""
    board = (
        dashboard.Dashboard("Prorsa: prefill/decode rollout")
        .uid(UID)
        .description(
            "Prorsa operator: instances vs target, forecast demand by source, demand/capacity "
            "and safety margin, forecast accuracy, role switches, the trainer webhook and "
            "live trajectories. Metrics: prorsa_* (see docs/metrics.md)."
        )
        .tags(["prorsa", "rl", "sglang"])
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .variables(variables())
        .annotation(
            dashboard.AnnotationQuery()
            .name("Reactive mode")
            .datasource(DS)
            .enable(True)
            .icon_color("orange")
            .expr(f'prorsa_forecast_mode{{mode="reactive", {SEL}}} == 1')
        )
    )
    ids = iter(range(1, 1000))
    for title, panels in rows():
        board = board.with_row(dashboard.Row(title).id(next(ids)))
        for panel in panels:
            board = board.with_panel(panel.id(next(ids)))
    data: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    # Variables get no id of their own in Grafana's JSON; the SDK's all-zero UUIDs would
    # only make every generated dashboard look edited.
    for variable in data["templating"]["list"]:
        variable.pop("id", None)
    return data


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write (default {OUT})")
    parser.add_argument(
        "--check", action="store_true", help="do not write; exit 1 if the file is out of date"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run scripts/gen_dashboard.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
