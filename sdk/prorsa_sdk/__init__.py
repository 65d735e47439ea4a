"""Trainer SDK: emit lifecycle events to Prorsa and survive role switches.

* :class:`EventEmitter` (threads) and :class:`AsyncEventEmitter` (asyncio) batch events in
  the background, retry, answer resyncs, and never block the training loop.
* :class:`ResumableGeneration` resumes generations aborted by a role switch.
* :class:`TrajectoryTracker` builds resync snapshots from the events themselves.
"""

from prorsa_sdk.emitter import AsyncEventEmitter, Backoff, EmitterStats, EventEmitter
from prorsa_sdk.resumable import ResumableGeneration, ResumeExhausted
from prorsa_sdk.tracker import TrajectoryTracker

__all__ = [
    "AsyncEventEmitter",
    "Backoff",
    "EmitterStats",
    "EventEmitter",
    "ResumableGeneration",
    "ResumeExhausted",
    "TrajectoryTracker",
]
