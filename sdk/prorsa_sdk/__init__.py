"""Trainer SDK: emit lifecycle events to Prorsa and survive role switches.

* :class:`EventEmitter` (threads) and :class:`AsyncEventEmitter` (asyncio) batch events in
  the background, retry, answer resyncs, and never block the training loop.
* :class:`ResumableGeneration` resumes generations aborted by a role switch and counts
  what the resumes cost in prefill (:class:`ResumePrefill`);
  :func:`weight_version_key` is the ``extra_key`` that scopes SGLang's KV to a weight version.
* :class:`TrajectoryTracker` builds resync snapshots from the events themselves.
* :func:`tls_context` is the check of the webhook's certificate the emitters make
  (``verify=``: a CA bundle path, or the system trust store), for a client of your own.
"""

from prorsa_sdk.emitter import (
    AsyncEventEmitter,
    EmitterStats,
    EventEmitter,
    RetryBackoff,
    tls_context,
)
from prorsa_sdk.resumable import (
    ResumableGeneration,
    ResumeExhausted,
    ResumePrefill,
    weight_version_key,
)
from prorsa_sdk.tracker import TrajectoryTracker

__all__ = [
    "AsyncEventEmitter",
    "EmitterStats",
    "EventEmitter",
    "ResumableGeneration",
    "ResumeExhausted",
    "ResumePrefill",
    "RetryBackoff",
    "TrajectoryTracker",
    "tls_context",
    "weight_version_key",
]
