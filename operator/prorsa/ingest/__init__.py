"""The trainer webhook (the CONTRACT of docs/webhook-events.md), for one or many clusters.

>>> registry = ClusterRegistry()
>>> handle = registry.add(namespace="rl", name="c", token="t", controller=Controller(spec))
>>> app = WebhookServer(registry).make_app()      # or .add_routes(operator_app)

Clusters can be added and removed while the server runs; ``handle.tick()`` runs a control
tick at the trainer's (estimated) present and keeps the Decision for ``GET .../forecast``.
"""

from prorsa.dedupe import DedupeWindow
from prorsa.ingest.app import Refusal, RunningServer, WebhookServer
from prorsa.ingest.clock import ClockOffset
from prorsa.ingest.metrics import WebhookMetrics
from prorsa.ingest.openapi import openapi_document
from prorsa.ingest.registry import (
    BatchOutcome,
    ClusterHandle,
    ClusterRegistry,
    IngestLimits,
    QueueFull,
)

__all__ = [
    "BatchOutcome",
    "ClockOffset",
    "ClusterHandle",
    "ClusterRegistry",
    "DedupeWindow",
    "IngestLimits",
    "QueueFull",
    "Refusal",
    "RunningServer",
    "WebhookMetrics",
    "WebhookServer",
    "openapi_document",
]
