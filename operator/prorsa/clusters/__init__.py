"""The RolloutClusters this process serves: each Controller behind its own lock and queue.

Both adapters reach a cluster's Controller through here, never through each other: the
webhook (:mod:`prorsa.ingest`) applies the trainer's batches to a :class:`WebhookCluster`,
the Kubernetes side (:mod:`prorsa.k8s`) adds and removes handles and ticks them. The
handle also owns what the two share about a cluster: its trainer token, the epoch and
resync state, and the estimate of the trainer's clock.
"""

from prorsa.clusters.clock import ClockOffset
from prorsa.clusters.limits import BatchOutcome, IngestLimits, QueueFull, TrajectoryLimit
from prorsa.clusters.registry import ClusterRegistry, WebhookCluster

__all__ = [
    "BatchOutcome",
    "ClockOffset",
    "ClusterRegistry",
    "IngestLimits",
    "QueueFull",
    "TrajectoryLimit",
    "WebhookCluster",
]
