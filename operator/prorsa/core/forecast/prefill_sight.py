"""Prefills that no event reports: whether the trainer sees them end, and if not, which
of its ready requests have left prefill all the same."""

from __future__ import annotations

from collections import deque

import numpy as np

from prorsa.core.forecast.slots import READY, SlotStore

# How many of the latest decodes tell whether the trainer reports prefills at all.
BLIND_DECODES = 64


class PrefillSight:
    """What the table knows of when prefills end.

    A trainer that neither streams nor sees the prefill engine leaves out when prefills
    end: its requests stay ``ready`` from request_queued to decode_finished, through
    prefill and decode alike. The table's transitions record, for each decode that
    finishes, whether an event said its prefill ended (:attr:`recent`), and date an
    admission no event and no tick saw at :attr:`seconds_per_token`.
    """

    def __init__(self) -> None:
        # The latest decodes, True for one whose prefill no event reported.
        self.recent: deque[bool] = deque(maxlen=BLIND_DECODES)
        # Seconds per prompt token of the last inference: dates an admission no event and
        # no tick saw (a request queued and finished between two ticks).
        self.seconds_per_token = 0.0
        self.inferred_admissions = 0

    @property
    def blind(self) -> bool:
        """Most of the latest decodes finished with no prefill event before them. Until a
        first decode finishes nothing tells, and a ready request is taken as waiting for
        prefill."""
        recent = self.recent
        return len(recent) > 0 and 2 * sum(recent) > len(recent)

    def left_prefill(self, store: SlotStore, *, now: float, in_prefill: int | None) -> np.ndarray:
        """The slots of the ready requests that have left prefill, as of ``now``.

        ``in_prefill``: the requests the prefill engines hold, running or waiting (their
        ``/v1/state``). Prefill engines serve in arrival order, so those are the most
        recently queued; every older ready request is decoding. Without engine states, a
        request is taken as decoding once it has waited as long as its prompt takes at
        :attr:`seconds_per_token`.
        """
        n = store.hwm
        cols = store.views()
        ready = np.flatnonzero(cols["state"][:n] == READY)
        since = cols["since"][:n][ready]
        x = cols["x"][:n][ready]
        del cols
        if in_prefill is not None:
            order = np.argsort(since, kind="stable")
            moved: np.ndarray = ready[order[: max(len(ready) - max(in_prefill, 0), 0)]]
            return moved
        moved = ready[now - since >= x * self.seconds_per_token]
        return moved
