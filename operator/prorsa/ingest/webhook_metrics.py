"""Prometheus metrics of the trainer webhook.

Each :class:`WebhookMetrics` owns its own :class:`~prometheus_client.CollectorRegistry`
(unless given one), so several servers in one process, tests above all, never collide on
the process-wide default registry. The operator passes its shared registry instead.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from prorsa_contract.events import EVENT_TYPES

REJECT_REASONS: tuple[str, ...] = (
    "unreadable",  # 400: not JSON / NDJSON, not UTF-8, a bad header
    "invalid",  # 422: events that do not validate
    "unauthorized",  # 401
    "unknown_cluster",  # 404
    "too_large",  # 413
    "queue_full",  # 429: the cluster's Controller is behind
    "busy",  # 429: too many request bodies in flight on this server
    "timeout",  # 408: the body did not arrive within the body deadline
    "trajectory_limit",  # 429/422: new trajectories past the cluster's maxLiveTrajectories
)

# Loopback batches of 500 take ~2-10 ms; the tail buckets show a stalled Controller.
BATCH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class WebhookMetrics:
    """``prorsa_webhook_*``: events by type, rejects by reason, batch latency, replays."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.events = Counter(
            "prorsa_webhook_events",
            "Lifecycle events accepted (validated, not refused) by event type.",
            ["type"],
            registry=r,
        )
        self.rejects = Counter(
            "prorsa_webhook_rejects",
            "Requests refused whole, by reason.",
            ["reason"],
            registry=r,
        )
        self.batch_seconds = Histogram(
            "prorsa_webhook_batch_seconds",
            "Time from a batch's arrival to its reply (accepted batches).",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.duplicates = Counter(
            "prorsa_webhook_duplicates",
            "Events whose id was already applied (replays); counted, not applied again.",
            registry=r,
        )
        self.superseded = Counter(
            "prorsa_webhook_superseded",
            "Events older than the last resync snapshot; the snapshot already holds them.",
            registry=r,
        )
        self.pending = Gauge(
            "prorsa_webhook_pending_events",
            "Validated events waiting for their Controller, all clusters.",
            registry=r,
        )
        # Create every labelled child up front: series exist (at 0) before the first event,
        # and the hot path skips the label lookup's lock for known types.
        self._by_type = {t: self.events.labels(type=t) for t in EVENT_TYPES}
        self._by_reason = {r_: self.rejects.labels(reason=r_) for r_ in REJECT_REASONS}

    def count_events(self, types: Iterable[str]) -> None:
        for kind, n in Tally(types).items():
            self._by_type[kind].inc(n)

    def reject(self, reason: str) -> None:
        self._by_reason[reason].inc()
