"""Trainer SDK: emit lifecycle events to the Prorsa webhook without ever blocking training.

``emit()`` encodes the event as JSON and appends it to a bounded in-memory buffer (a few
microseconds, never I/O, never a wait); a background sender (a thread for
:class:`EventEmitter`, a task for :class:`AsyncEventEmitter`) ships batches when
``batch_size`` events are buffered or ``flush_interval`` has passed, one request at a time
so the server applies events in the order they were emitted.

Delivery, both flavours (the policy is written once, in
:meth:`prorsa_sdk.emitter_core.EmitterCore.deliver`, as a generator of actions that the
thread and the task each execute):

* 429, 5xx, connection errors and timeouts are retried with exponential backoff and full
  jitter, honouring Retry-After, until the emitter is closed. Event ids make retries
  idempotent: the server counts a replayed id instead of applying it twice. A 429 for the
  cluster's live-trajectory limit (``reason: trajectory_limit``: the batch applied but for
  the events that start new trajectories) sets the batch aside until Retry-After and sends
  the newer events meanwhile: their ends of trajectories are what makes room.
* 422: the server names the bad events; they are dropped (counted, logged with the
  reason) and the rest of the batch is sent again. 413: the batch is split in halves.
* 401 / 404 (a token being rotated, a cluster the operator is still registering) are
  retried for ``give_up_after`` seconds, then the batch is dropped, counted and logged.
  With ``token_file=`` (a mounted Secret) every request carries the file's token as it is
  then: a rotated Secret reaches the emitter when the kubelet refreshes the file.
* When the buffer is full the *oldest* events are dropped, counted in
  ``stats.dropped_overflow`` and logged (rate-limited); if a snapshot source is
  available the emitter then posts a snapshot, which repairs the server's view.
* A reply with ``resync: true`` (the server restarted and lost its state) makes the
  emitter post ``POST .../snapshot`` built by the ``snapshot`` callback (or by the
  built-in tracker with ``track=True``) before sending more events.
* ``emitter_id=`` names the emitter (``X-Prorsa-Emitter``) for trainers that run one per
  worker: its snapshots then replace only the trajectories it reported, so each worker
  resyncs on its own (and, with a snapshot source, once when it starts, which clears what
  a previous process of the same id left). Without it a snapshot replaces every trajectory.
* ``close()`` flushes what is buffered, within a timeout; whatever could not be delivered
  by then is counted as dropped and logged, never silently lost.

Recording: with ``record="events.ndjson"`` every event the webhook accepted is also
appended to that file, one JSON object per line, in the order the webhook applied it (a
batch is written once its 2xx reply arrives; events the webhook refused are left out), so
``prorsa plan --events`` replays the job as the operator saw it. The sender writes it (the
asyncio flavour from a thread), never ``emit()``.

TLS: an ``https://`` webhook's certificate is verified against ``verify``: a CA bundle
path (the webhook Secret's ``ca.crt``, a cert-manager issuer's CA), an ``ssl.SSLContext``,
or, by default, the system trust store. A certificate that does not verify is a
connection error like any other: retried, never sent around.

The modules: :mod:`prorsa_sdk.emitter_core` (the sans-I/O buffer and delivery policy),
:mod:`prorsa_sdk.sync_emitter` and :mod:`prorsa_sdk.async_emitter` (the two drivers),
:mod:`prorsa_sdk.emitter_base` (what they share: options, TLS, token and recording),
:mod:`prorsa_sdk.event_helpers` (one typed method per event). This module names what a
trainer imports, as it always has.
"""

from __future__ import annotations

from prorsa_sdk.async_emitter import AsyncEventEmitter
from prorsa_sdk.emitter_base import (
    SENT_AT_HEADER,
    AsyncSnapshotSource,
    EmitterOptions,
    SnapshotSource,
    TlsVerify,
    tls_context,
)
from prorsa_sdk.emitter_core import (
    REPAIR_INTERVAL,
    Delivery,
    EmitterStats,
    RetryBackoff,
    SnapshotRows,
)
from prorsa_sdk.sync_emitter import EventEmitter

__all__ = [
    "REPAIR_INTERVAL",
    "SENT_AT_HEADER",
    "AsyncEventEmitter",
    "AsyncSnapshotSource",
    "Delivery",
    "EmitterOptions",
    "EmitterStats",
    "EventEmitter",
    "RetryBackoff",
    "SnapshotRows",
    "SnapshotSource",
    "TlsVerify",
    "tls_context",
]
