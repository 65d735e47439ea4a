"""Process-wide settings for the long-running servers (operator, ``prorsa ingest``).

Validating a webhook batch allocates a few objects per event, all short-lived; with
CPython's default thresholds that triggers a young-generation collection every 700
allocations and, every so often, a full collection that walks every tracked object in the
process (the controller's tables, kopf's caches): measured as ~20% of the event path's
time and as the longest pauses of the webhook's event loop. Raising the thresholds trades
a little memory for fewer, still bounded collections.
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (50_000, 50, 100)


def tune_gc() -> None:
    gc.set_threshold(*GC_THRESHOLDS)
