"""The outcome metrics as Prometheus scrapes them: counters that never go back, and the
Controller's own account of what its switches were expected to save and cost."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prorsa.control.metrics import OperatorMetrics
from prorsa.core.switch_cost import Move


def _diag(*, generated: int, recomputed: float, stale: int, waiting: int = 2) -> Any:
    return SimpleNamespace(
        best=(3, 1), prefill_waiting=waiting, prefill_oldest_wait=4.5, decode_waiting=7,
        generated_tokens=generated, recomputed_tokens=recomputed,
        anomalies={"stale": stale, "unknown_trajectory": 0},
    )  # fmt: skip


def _scrape(metrics: OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in _KEY))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("cluster") == "qwen"
    }


_KEY = ("namespace", "cluster")


def test_outcomes_export_as_counters_that_survive_a_controller_restart() -> None:
    m = OperatorMetrics()
    m.start_cluster("rl", "qwen")
    m.record_outcomes("rl", "qwen", _diag(generated=1_000, recomputed=500.0, stale=2))
    m.record_outcomes("rl", "qwen", _diag(generated=1_600, recomputed=500.0, stale=3))
    seen = _scrape(m)
    assert seen[("prorsa_generated_tokens_total", ())] == 1_600
    assert seen[("prorsa_recomputed_prefill_tokens_total", ())] == 500
    assert seen[("prorsa_event_anomalies_total", (("kind", "stale"),))] == 3
    assert seen[("prorsa_prefill_waiting_prompts", ())] == 2
    assert seen[("prorsa_prefill_oldest_wait_seconds", ())] == 4.5
    assert seen[("prorsa_decode_waiting_requests", ())] == 7
    assert seen[("prorsa_best_split_instances", (("role", "prefill"),))] == 3
    # A new Controller (a leader change, a spec update) counts from zero again: the
    # counters add its counts on top, they never go back.
    m.record_outcomes("rl", "qwen", _diag(generated=200, recomputed=0.0, stale=1, waiting=0))
    seen = _scrape(m)
    assert seen[("prorsa_generated_tokens_total", ())] == 1_800
    assert seen[("prorsa_event_anomalies_total", (("kind", "stale"),))] == 4
    assert seen[("prorsa_prefill_waiting_prompts", ())] == 0


def test_priced_switches_count_their_expected_gain_and_cost_by_direction_and_mode() -> None:
    m = OperatorMetrics()
    m.start_cluster("rl", "qwen")
    made = Move(instance="e1", src="decode", dst="prefill", gain=12.0, cost=4.5, lost_tokens=0)
    advised = Move(instance="e2", src="prefill", dst="decode", gain=3.0, cost=1.0, lost_tokens=0)
    m.record_priced("rl", "qwen", [made, made], switching_mode="Auto")
    m.record_priced("rl", "qwen", [advised], switching_mode="Recommend")
    seen = _scrape(m)

    def labels(src: str, dst: str, mode: str) -> tuple[tuple[str, str], ...]:
        return (("from_role", src), ("switching_mode", mode), ("to_role", dst))

    gain, cost = (
        "prorsa_switch_expected_gain_seconds_total",
        "prorsa_switch_expected_cost_seconds_total",
    )
    assert seen[(gain, labels("decode", "prefill", "Auto"))] == 24.0
    assert seen[(cost, labels("decode", "prefill", "Auto"))] == 9.0
    assert seen[(gain, labels("prefill", "decode", "Recommend"))] == 3.0
    assert seen[(gain, labels("prefill", "decode", "Auto"))] == 0.0  # made at 0 from start
    # Restoring a role minimum out of an empty role has no finite price: not counted.
    empty = Move(
        instance="e3", src="decode", dst="prefill", gain=math.inf, cost=math.inf, lost_tokens=0
    )
    m.record_priced("rl", "qwen", [empty], switching_mode="Auto")
    assert _scrape(m)[(gain, labels("decode", "prefill", "Auto"))] == 24.0
    # Gone with the cluster.
    m.forget("rl", "qwen")
    assert not _scrape(m)
