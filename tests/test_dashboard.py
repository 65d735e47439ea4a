"""The Grafana dashboard and the alert rules read only what the operator exports.

Every PromQL expression in ``charts/prorsa/dashboards/prorsa.json`` (panels, annotations,
template variables) and in the alert rules is parsed (PyPI ``promql-parser``); each metric it
selects must be a sample name of ``prorsa.control.metrics.OperatorMetrics`` or
``prorsa.ingest.webhook_metrics.WebhookMetrics`` (collected from their registries, not listed here),
and each label it matches on must be one that metric carries. Then a real Prometheus (Debian's
binary via ``scripts/ci_tools.py``) scrapes a registry filled through the operator's own
metric objects on loopback, and every dashboard query must return data, the template
variables must list the clusters, and every alert rule must evaluate without error.
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics import MetricWrapperBase

from prorsa.control.metrics import OperatorMetrics
from prorsa.core.decision import Capacity, Components, Decision, Forecast, Target
from prorsa.core.diagnostics import Diagnostics
from prorsa.core.switch_cost import Move
from prorsa.ingest.webhook_metrics import WebhookMetrics

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "charts" / "prorsa" / "dashboards" / "prorsa.json"
RULES = ROOT / "charts" / "prorsa" / "files" / "prorsa-rules.yaml"
RULE_TESTS = ROOT / "charts" / "prorsa" / "ci" / "prorsa-rules.test.yaml"
GENERATOR = ROOT / "scripts" / "gen_dashboard.py"
# Labels Prometheus attaches to every scraped series (the ServiceMonitor's target labels).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "endpoint", "container"}
# What Grafana substitutes for its built-in interval variables (any valid duration parses).
GRAFANA_INTERVALS = {"$__rate_interval": "4s", "$__interval": "1s", "$__range": "1m"}


def _load_script(name: str) -> ModuleType:
    key = f"prorsa_scripts_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


# -- what the operator exports -------------------------------------------------------------------


def _wrappers(owner: object) -> list[MetricWrapperBase]:
    return [v for v in vars(owner).values() if isinstance(v, MetricWrapperBase)]


def exported_samples() -> dict[str, frozenset[str]]:
    """Sample name -> label names, for every series the operator's two registries can export.

    Labelled metrics have no samples until a child exists, so one child of each is created
    first; the sample names (``_total``, ``_bucket``, ...) then come from prometheus_client.
    """
    out: dict[str, frozenset[str]] = {}
    for owner in (OperatorMetrics(), WebhookMetrics()):
        for metric in _wrappers(owner):
            names = metric._labelnames  # type: ignore[attr-defined]
            if names:
                metric.labels(*["x"] * len(names))
        for family in owner.registry.collect():
            for sample in family.samples:
                out[sample.name] = frozenset(sample.labels)
    return out


@pytest.fixture(scope="module")
def exported() -> dict[str, frozenset[str]]:
    samples = exported_samples()
    assert "prorsa_switches_total" in samples
    assert "prorsa_webhook_batch_duration_seconds_bucket" in samples
    return samples


# -- PromQL in the dashboard and the rules ------------------------------------------------------


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep their panels inside


def grafana_to_promql(expr: str) -> str:
    for variable, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(variable, value)
    return expr


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def dashboard_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target, annotation and query variable."""
    found = []
    for panel in panels(board):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for annotation in board.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            found.append((f"annotation {annotation['name']!r}", annotation["expr"]))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            match = _LABEL_VALUES.match(variable["query"])
            assert match, f"variable {variable['name']}: not label_values(selector, label)"
            found.append((f"variable {variable['name']!r}", match["selector"]))
    return [(where, grafana_to_promql(expr)) for where, expr in found]


def rule_queries() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(f"alert {r['alert']}", r["expr"]) for g in groups for r in g["rules"]]


# promql_parser.MatchOp members are not hashable: compare by name.
_MATCH_OPS = {"Equal": "=", "NotEqual": "!=", "Re": "=~", "NotRe": "!~"}


def selectors(expr: str) -> list[tuple[str | None, dict[str, tuple[str, str]]]]:
    """(metric name, {label: (op, value)}) of every vector selector in ``expr``."""
    found: list[tuple[str | None, dict[str, tuple[str, str]]]] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = {
                m.name: (_MATCH_OPS[str(m.op).rpartition(".")[2]], m.value)
                for m in node.matchers.matchers
                if m.name != "__name__"
            }
            found.append((node.name, matchers))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def check_names(queries: list[tuple[str, str]], exported: dict[str, frozenset[str]]) -> None:
    problems = []
    for where, expr in queries:
        found = selectors(expr)
        if not found:
            problems.append(f"{where}: selects no metric: {expr}")
        for name, matchers in found:
            if name is None:
                problems.append(f"{where}: a selector without a fixed metric name: {expr}")
            elif name not in exported:
                problems.append(f"{where}: {name} is not exported by the operator")
            else:
                unknown = set(matchers) - exported[name] - TARGET_LABELS
                if unknown:
                    problems.append(f"{where}: {name} has no label(s) {sorted(unknown)}")
    assert not problems, "\n".join(problems)


def test_dashboard_queries_name_only_exported_metrics_and_labels(exported):
    queries = dashboard_queries(dashboard())
    assert len(queries) >= 30
    check_names(queries, exported)


def test_alert_rules_name_only_exported_metrics_and_labels(exported):
    check_names(rule_queries(), exported)


def test_the_check_catches_a_metric_the_operator_does_not_export(exported):
    with pytest.raises(AssertionError, match="prorsa_instance_count is not exported"):
        check_names([("t", 'prorsa_instance_count{role="prefill"}')], exported)
    with pytest.raises(AssertionError, match=r"has no label\(s\) \['state'\]"):
        check_names([("t", 'rate(prorsa_switches_total{state="x"}[5m])')], exported)
    with pytest.raises(AssertionError, match="without a fixed metric name"):
        check_names([("t", '{__name__=~"prorsa_.*"}')], exported)


def test_per_cluster_queries_follow_the_namespace_and_cluster_variables(exported):
    for where, expr in dashboard_queries(dashboard()):
        for name, matchers in selectors(expr):
            if where.startswith("variable") or not {"namespace", "cluster"} <= exported[name]:
                continue  # the variables themselves; the webhook's operator-wide series
            assert matchers.get("namespace") == ("=~", "$namespace"), (where, name)
            assert matchers.get("cluster") == ("=~", "$cluster"), (where, name)


def test_dashboard_shows_what_operators_need(exported):
    board = dashboard()
    used = {name for _, expr in dashboard_queries(board) for name, _ in selectors(expr)}
    wanted = {
        "prorsa_instances", "prorsa_target_instances",  # instances vs target
        "prorsa_forecast_prefill_tokens", "prorsa_forecast_prefill_demand_tokens",  # sources
        "prorsa_demand_instances", "prorsa_safety_margin_ratio",  # ratios
        "prorsa_decode_kv_tokens", "prorsa_forecast_wape_ratio",  # KV, accuracy
        "prorsa_switches_total", "prorsa_switch_duration_seconds_bucket",  # switches
        "prorsa_switch_part_duration_seconds_bucket",  # where a switch's time goes
        "prorsa_webhook_events_total", "prorsa_webhook_rejects_total",  # webhook
        "prorsa_live_trajectories",  # trajectories by state
        "prorsa_event_anomalies_total",  # a counter since the renames
    }  # fmt: skip
    assert wanted - used == set()
    assert {v["name"] for v in board["templating"]["list"]} >= {"namespace", "cluster"}
    # The overview's WAPE shows both forecasts, not the prefill one alone.
    overview_wape = next(p for p in panels(board) if p["title"] == "Forecast WAPE")
    assert "forecast=" not in overview_wape["targets"][0]["expr"]


def _row(board: dict[str, Any], title: str) -> list[dict[str, Any]]:
    """The panels under the row ``title``, in order (up to the next row)."""
    out: list[dict[str, Any]] = []
    inside = False
    for panel in board["panels"]:
        if panel["type"] == "row":
            inside = panel["title"] == title
            out.extend(panel.get("panels", []) if inside else [])
        elif inside:
            out.append(panel)
    return out


def test_a_row_answers_whether_switching_pays(exported):
    """Expected gain against cost, both forecasts' WAPE, queue waits, tokens per second and
    the split against Eq. 1's target, right under the overview."""
    board = dashboard()
    titles = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert titles[:2] == ["Overview", "Is switching paying?"]
    row = _row(board, "Is switching paying?")
    used = {
        name
        for panel in row
        for target in panel["targets"]
        for name, _ in selectors(grafana_to_promql(target["expr"]))
    }
    assert {
        "prorsa_switch_expected_gain_seconds_total", "prorsa_switch_expected_cost_seconds_total",
        "prorsa_forecast_wape_ratio", "prorsa_prefill_oldest_wait_seconds",
        "prorsa_prefill_waiting_prompts", "prorsa_decode_waiting_requests",
        "prorsa_generated_tokens_total", "prorsa_recomputed_prefill_tokens_total",
        "prorsa_instances", "prorsa_best_split_instances", "prorsa_target_instances",
    } <= used  # fmt: skip
    # Gain and cost are summed over the dashboard's range: cumulative, and reset-safe.
    net = next(p for p in row if p["title"].startswith("Expected net saving"))
    assert "[$__range]" in net["targets"][0]["expr"] and " - " in net["targets"][0]["expr"]
    wape = next(p for p in row if "WAPE" in p["title"])
    assert "forecast=" not in wape["targets"][0]["expr"]
    stacked = [
        p["title"]
        for p in panels(board)
        if p["type"] != "row"
        and p["fieldConfig"]["defaults"].get("custom", {}).get("stacking", {}).get("mode")
        == "normal"
        and any("prorsa_forecast_prefill_tokens" in t["expr"] for t in p.get("targets", []))
    ]
    assert stacked, "forecast components are not stacked"


# -- counters across restarts -----------------------------------------------------------------

# Functions that read a counter's increase and treat a drop to a lower value as a reset.
RESET_SAFE = frozenset({"rate", "irate", "increase", "resets"})


def monotonic_samples() -> frozenset[str]:
    """Sample names of the operator's counters and histograms: they restart at 0 with it."""
    names = set()
    for owner in (OperatorMetrics(), WebhookMetrics()):
        for metric in _wrappers(owner):
            labels = metric._labelnames  # type: ignore[attr-defined]
            if labels:
                metric.labels(*["x"] * len(labels))
        for family in owner.registry.collect():
            if family.type in ("counter", "histogram", "summary"):
                names |= {s.name for s in family.samples if not s.name.endswith("_created")}
    return frozenset(names)


def _matrix_ranges(node: Any, name: str) -> list[Any]:
    """The ranges of every ``name[...]`` under ``node``."""
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.range] if node.vector_selector.name == name else []
    children = list(getattr(node, "args", None) or [])
    children += [getattr(node, a, None) for a in ("lhs", "rhs", "expr", "param")]
    return [r for c in children if c is not None for r in _matrix_ranges(c, name)]


def _born_within(node: Any) -> str | None:
    """``f(x[w]) unless x offset W`` with every range w <= W: the counter ``x`` read on the
    left, by value, only in series that did not exist W ago (a new operator pod), which
    have not been reset since they started. Returns that counter's name."""
    rhs = node.rhs
    if str(node.op) != "unless" or not isinstance(rhs, promql_parser.VectorSelector):
        return None
    ranges = _matrix_ranges(node.lhs, rhs.name)
    if rhs.offset is None or not ranges or max(ranges) > rhs.offset:
        return None
    return str(rhs.name)


def raw_counter_reads(expr: str, counters: frozenset[str]) -> list[str]:
    """Counters ``expr`` reads by value (not through rate/increase), which a reset breaks."""
    found: list[str] = []

    def visit(node: Any, safe: bool | str) -> None:
        # ``safe``: True under a reset-safe function; a name: only that counter is safe.
        if isinstance(node, promql_parser.VectorSelector):
            if node.name in counters and safe is not True and safe != node.name:
                found.append(node.name)
            return
        if isinstance(node, promql_parser.Call):
            for arg in node.args:
                visit(arg, safe or node.func.name in RESET_SAFE)
            return
        if isinstance(node, promql_parser.BinaryExpr) and str(node.op) in ("and", "unless"):
            # The right side only filters the left by label set: no value of it is read.
            visit(node.lhs, safe or _born_within(node) or False)
            return
        for attr in ("lhs", "rhs", "expr", "param", "vector_selector"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, str | int | float):
                visit(child, safe)

    visit(promql_parser.parse(expr), False)
    return found


def test_counters_are_read_only_through_reset_safe_functions():
    """An operator restart drops every counter to 0; `x - x offset 15m` then goes negative and
    hides what happened after the restart. rate() and increase() count across resets."""
    counters = monotonic_samples()
    assert {"prorsa_switches_total", "prorsa_webhook_batch_duration_seconds_count"} <= counters
    queries = [*dashboard_queries(dashboard()), *rule_queries()]
    raw = {where: names for where, expr in queries if (names := raw_counter_reads(expr, counters))}
    assert raw == {}
    # The check itself sees the pattern the old ProrsaSwitchFailures rule used.
    old = "x_total - (x_total offset 15m or x_total * 0)"
    assert raw_counter_reads(old, frozenset({"x_total"})) == ["x_total"] * 3
    assert raw_counter_reads("sum(increase(x_total[15m])) > 0", frozenset({"x_total"})) == []
    # A series' first value counts only where the series did not exist a window ago.
    young = "min_over_time(x_total[15m]) unless x_total offset {}"
    assert raw_counter_reads(young.format("15m"), frozenset({"x_total"})) == []
    assert raw_counter_reads(young.format("5m"), frozenset({"x_total"})) == ["x_total"]
    assert raw_counter_reads("x_total unless y_total", frozenset({"x_total"})) == ["x_total"]


def expand_series(values: str) -> list[float | None]:
    """promtool's expanding notation (``a+bxn``, ``axn``, ``_xn``, ``stale``) as samples."""
    out: list[float | None] = []
    for token in values.split():
        if token in ("_", "stale"):
            out.append(None)
            continue
        head, x, count = token.partition("x")
        if head == "_":
            out.extend([None] * int(count))
            continue
        match = re.fullmatch(r"(-?[0-9.e]+)(?:([+-])([0-9.e]+))?", head)
        assert match, token
        start = float(match[1])
        step = float(match[3] or 0) * (-1 if match[2] == "-" else 1)
        out.extend(start + i * step for i in range(int(count) + 1 if x else 1))
    return out


def _minutes(duration: str) -> float:
    match = re.fullmatch(r"([0-9]+)(s|m|h)", duration)
    assert match, duration
    return int(match[1]) * {"s": 1 / 60, "m": 1, "h": 60}[match[2]]


def reset_at(values: str) -> int | None:
    """The sample index where a counter series first drops (a reset), if it does."""
    last = None
    for i, value in enumerate(expand_series(values)):
        if value is None:
            continue
        if last is not None and value < last:
            return i
        last = value
    return None


def test_every_counter_alert_has_a_unit_test_that_fires_after_a_counter_reset():
    counters = monotonic_samples()
    rules = {where.removeprefix("alert "): expr for where, expr in rule_queries()}
    counting = {
        alert: {name for name, _ in selectors(expr) if name in counters}
        for alert, expr in rules.items()
    }
    counting = {alert: names for alert, names in counting.items() if names}
    assert "ProrsaSwitchFailures" in counting and "ProrsaWebhookRejectsRising" in counting
    covered = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        interval = _minutes(case.get("interval", "1m"))
        for test in case["alert_rule_test"]:
            names = counting.get(test["alertname"], set())
            resets = [
                reset_at(s["values"]) * interval
                for s in case["input_series"]
                if s["series"].partition("{")[0] in names and reset_at(s["values"]) is not None
            ]
            if resets and test["exp_alerts"] and _minutes(test["eval_time"]) > min(resets):
                covered.add(test["alertname"])
    assert set(counting) - covered == set()
    assert expand_series("5x2 0 _x2 1+1x2 stale") == [5, 5, 5, 0, None, None, 1, 2, 3, None]
    assert reset_at("5x19 0 0 1x10") == 20 and reset_at("0+1x60") is None


def test_dashboard_layout_is_well_formed():
    board = dashboard()
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)) and 0 not in ids
    occupied: set[tuple[int, int]] = set()
    for panel in panels(board):
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        cells = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & occupied, f"{panel['title']!r} overlaps another panel"
        occupied |= cells
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)) and all(refs), panel["title"]
    assert board["uid"] and len(board["uid"]) <= 40


# -- the committed file is the generator's output -----------------------------------------


def test_committed_dashboard_is_a_fresh_generation():
    pytest.importorskip(
        "grafana_foundation_sdk", reason="the generator needs it: pip install -e '.[test]'"
    )
    generator = _load_script("gen_dashboard")
    assert DASHBOARD.read_text() == generator.render(), (
        "charts/prorsa/dashboards/prorsa.json is stale: run scripts/gen_dashboard.py"
    )


def test_generator_check_mode_reports_a_stale_file(tmp_path):
    pytest.importorskip(
        "grafana_foundation_sdk", reason="the generator needs it: pip install -e '.[test]'"
    )
    stale = tmp_path / "prorsa.json"
    stale.write_text("{}\n")
    cmd = [sys.executable, str(GENERATOR), "--check", "--out"]
    result = subprocess.run([*cmd, str(stale)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "out of date" in result.stderr
    fresh = subprocess.run([*cmd, str(DASHBOARD)], capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 0, fresh.stderr


# -- against a real Prometheus -------------------------------------------------------------------

CLUSTERS = (("rl", "qwen"), ("rl", "llama"))


def fill(operator: OperatorMetrics, webhook: WebhookMetrics) -> None:
    """Series shaped as the running operator writes them (StatusWriter.write and friends)."""
    for ns, name in CLUSTERS:
        decision = Decision(
            at=1000.0,
            mode="predictive" if name == "qwen" else "reactive",
            target=Target(prefill=3, decode=5),
            safetyMargin=0.25,
            forecast=Forecast(
                prefillTokens=120_000,
                decodeAdmissionTokens=90_000,
                decodeKvTokens=1_100_000,
                components=Components(sampler=5_000, startup=8_000, ready=80_000, inflight=27_000),
            ),
            capacity=Capacity(prefillTokensPerSecond=20_000, decodeKvTokens=1_300_000),
            reason="test",
        )
        operator.record_decision(
            ns,
            name,
            decision,
            demand_prefill=0.6,
            demand_decode=4.2,
            kv_now=900_000,
            planned=(0.8, 3.9),
            cache_hit_ratio=0.9,
            cache_floor=0.6,
        )
        for role, count in {"prefill": 3, "decode": 4, "switching": 1, "unavailable": 0}.items():
            operator.instances.labels(ns, name, role).set(count)
        for kind, value in (("prefill", 0.08), ("decode", 0.05)):
            operator.wape.labels(ns, name, kind).set(value)
        for state, count in {"starting": 4, "ready": 2, "decode": 30, "tool": 12}.items():
            operator.trajectories.labels(ns, name, state).set(count)
        operator.record_outcomes(ns, name, _diagnostics(generated=1000, anomalies=1))
        operator.forecast_age.labels(ns, name).set(2.0)
    webhook.count_events(["sample_dispatched", "request_queued", "prefill_started"])
    webhook.reject("invalid")


def _diagnostics(*, generated: int, anomalies: int) -> Diagnostics:
    """What a tick of the Controller hands the operator's metrics, at these totals."""
    return Diagnostics(
        demand=(0.6, 4.2), planned=(0.8, 3.9), cache_floor=0.6, decode_share=0.7,
        kv_now=900_000, miss_ratio=0.1, calibration=None, moves=(), made=(), best=(2, 6),
        forecast=None, prefill_wape=0.08, decode_wape=0.05, trajectories={},
        anomalies={"stale": anomalies}, last_event_ts=999.0, generated_tokens=generated,
        prefill_waiting=12, prefill_oldest_wait=3.5, decode_waiting=4,
        recomputed_tokens=generated / 10,
    )  # fmt: skip


_TOTALS = {"ticks": 1}


def tick(operator: OperatorMetrics, webhook: WebhookMetrics) -> None:
    """Counters and histograms move between scrapes, as they do under load."""
    _TOTALS["ticks"] += 1
    n = _TOTALS["ticks"]
    move = Move(instance="e-1", src="decode", dst="prefill", gain=30.0, cost=12.0, lost_tokens=0)
    for ns, name in CLUSTERS:
        operator.switches.labels(ns, name, "decode", "prefill", "succeeded").inc()
        operator.switch_seconds.labels(ns, name, "decode", "prefill").observe(12.0)
        operator.switch_decision.labels(ns, name).observe(4.0)
        for part, seconds in (("router", 6.0), ("engine", 1.5)):
            operator.switch_parts.labels(ns, name, part).observe(seconds)
        operator.record_priced(ns, name, [move], switching_mode="Auto")
        operator.record_outcomes(ns, name, _diagnostics(generated=1000 * n, anomalies=n))
        operator.tick_seconds.labels(ns, name).observe(0.004)
        operator.agent_errors.labels(ns, name).inc()
    webhook.count_events(["request_queued"] * 50)
    webhook.reject("queue_full")
    webhook.duplicates.inc()
    webhook.superseded.inc()
    webhook.batch_seconds.observe(0.003)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory) -> Iterator[httpx.Client]:
    """A Prometheus scraping the filled registry every second, with the alert rules loaded."""
    tools = _load_script("ci_tools")
    try:
        binary = tools.prometheus()
    except tools.ToolUnavailable as exc:
        pytest.skip(f"prometheus could not be obtained here ({exc}); see scripts/ci_tools.py")
    registry = CollectorRegistry()
    operator, webhook = OperatorMetrics(registry), WebhookMetrics(registry)
    fill(operator, webhook)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    work = tmp_path_factory.mktemp("prometheus")
    port = _free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "prorsa",
                # As the chart's ServiceMonitor (honorLabels: true): the series' own namespace
                # label beats the target's, which is the operator's namespace.
                "honor_labels": True,
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{server.server_port}"],
                        "labels": {"namespace": "prorsa-system", "pod": "prorsa-0"},
                    }
                ],
            }
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            str(binary),
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)
    try:
        deadline = time.monotonic() + 30
        scrapes = 0.0
        while scrapes < 5:  # five scrapes: rate() over 4s windows has points to work with
            assert proc.poll() is None, (work / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "Prometheus did not scrape the registry in 30 s"
            tick(operator, webhook)
            time.sleep(0.5)
            try:
                answer = client.get("/api/v1/query", params={"query": "count_over_time(up[1m])"})
            except httpx.TransportError:
                continue
            result = answer.json()["data"]["result"] if answer.status_code == 200 else []
            scrapes = float(result[0]["value"][1]) if result else 0.0
        tick(operator, webhook)
        time.sleep(1.2)
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        server.shutdown()
        server.server_close()


def query(client: httpx.Client, expr: str) -> list[dict[str, Any]]:
    answer = client.get("/api/v1/query", params={"query": expr})
    body = answer.json()
    assert answer.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]  # type: ignore[no-any-return]


def grafana_all(expr: str) -> str:
    """The query as Grafana sends it with every namespace and cluster selected (allValue .*)."""
    return expr.replace("$namespace", ".*").replace("$cluster", ".*")


def test_every_dashboard_query_returns_data_from_prometheus(prometheus):
    empty = [
        where
        for where, expr in dashboard_queries(dashboard())
        if not query(prometheus, grafana_all(expr))
    ]
    assert not empty, f"queries with no data: {empty}"


def test_queries_split_by_cluster_and_keep_the_clusters_namespace(prometheus):
    board = dashboard()
    target = next(p for p in panels(board) if p["title"] == "Prefill instances vs target")
    series = query(prometheus, grafana_all(target["targets"][0]["expr"]))
    assert {(s["metric"]["namespace"], s["metric"]["cluster"]) for s in series} == set(CLUSTERS)
    one_cluster = target["targets"][0]["expr"].replace("$namespace", "rl")
    series = query(prometheus, one_cluster.replace("$cluster", "qwen"))
    assert [float(s["value"][1]) for s in series] == [3.0]


def test_template_variables_list_namespaces_and_clusters(prometheus):
    by_name = {v["name"]: v for v in dashboard()["templating"]["list"]}
    for name, expected in (("namespace", {"rl"}), ("cluster", {"qwen", "llama"})):
        match = _LABEL_VALUES.match(by_name[name]["query"])
        assert match is not None
        answer = prometheus.get(
            f"/api/v1/label/{match['label']}/values",
            params={"match[]": grafana_all(match["selector"])},
        )
        assert set(answer.json()["data"]) == expected


def test_alert_rules_evaluate_cleanly_in_prometheus(prometheus):
    deadline = time.monotonic() + 10
    while True:
        groups = prometheus.get("/api/v1/rules").json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules):
            break
        assert time.monotonic() < deadline, "rules were not evaluated"
        time.sleep(0.5)
    assert {r["name"] for r in rules} == {q[0].removeprefix("alert ") for q in rule_queries()}
    bad = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not bad
    # The filled registry has a reactive cluster: the stale-forecast alert is pending for it.
    stale = next(r for r in rules if r["name"] == "ProrsaForecastStale")
    assert [a["labels"]["cluster"] for a in stale["alerts"]] == ["llama"]
