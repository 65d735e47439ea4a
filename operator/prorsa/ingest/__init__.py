"""The trainer webhook (the CONTRACT of docs/webhook-events.md), for one or many clusters.

>>> registry = ClusterRegistry()            # prorsa.clusters
>>> handle = registry.add(namespace="rl", name="c", token="t", controller=Controller(spec))
>>> app = WebhookServer(registry).make_app()      # or .add_routes(operator_app)

Clusters can be added and removed while the server runs; ``handle.tick()`` runs a control
tick at the trainer's (estimated) present and keeps the Decision for ``GET .../forecast``.
"""

from prorsa.ingest.app import Refusal, RunningServer, WebhookServer
from prorsa.ingest.openapi import openapi_document
from prorsa.ingest.webhook_metrics import WebhookMetrics

__all__ = [
    "Refusal",
    "RunningServer",
    "WebhookMetrics",
    "WebhookServer",
    "openapi_document",
]
