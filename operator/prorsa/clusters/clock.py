"""The trainer's clock, seen from the server: estimated from batch arrivals, then corrected.

Event timestamps are the trainer's wall clock, and the Controller measures every elapsed
time (tool time, reward time, time in the ready queue) as ``now - event.ts``. If the
server ticked with its own clock, a trainer whose clock runs 5 s fast would look as if
every tool call had run 5 s less, and the forecast would be skewed by exactly that much.

Method. Each batch gives one sample ``d = server_receive - trainer_send``, measured on the
server's *monotonic* clock (immune to NTP steps on the server):

* ``trainer_send`` is the ``X-Prorsa-Sent-At`` header when the client sends it (the SDK
  does: its clock when the request left), else the newest event timestamp of the batch.
* ``d`` = (server clock - trainer clock) + delay, with delay >= 0: network transit, plus,
  without the header, how long the newest event sat in the client's buffer or in retries.

The offset is therefore a *low* quantile of recent samples: the least-delayed batches
carry the truth, retried or long-buffered batches only inflate samples. The other kind of
outlier is a batch from the future: a broken clock that still reads within the webhook's
window of plausible times (:mod:`prorsa.ingest.window`). A low quantile alone would let a
few of those pin the estimate (a plain minimum, just one), and a tick at a present hours
ahead would find every trajectory silent. So samples whose trainer clock reads more than
``tolerance`` (30 s) ahead of the median sample are dropped first, and the estimate is the
10th percentile of the rest, over the last 64 samples (and at most the last five
minutes). Fewer than half of the samples, in either direction, cannot move it by more
than the tolerance. A trainer clock stepped backwards or forwards is followed once the
stepped samples are the majority of the window (or the older ones are five minutes old).
With the header the residual error is the one-way loopback/LAN latency, under a
millisecond; without it, about the smallest buffering delay the client ever achieves (its
flush interval at most).

Few samples prove nothing: with one or two, the majority may be the one broken batch, and
an estimate an hour ahead makes every live trajectory look an hour old. So the estimate
is trusted only once the window holds ``min_samples`` (5) samples, where two bad batches
are a minority whatever their place; until then the previous trusted estimate stands (a
window emptied by a long silence refills before the estimate moves again), and before the
first one the server assumes the clocks agree. The SDK sends a batch at least every 0.2 s
while events flow, so a trainer whose clock really is off is followed within a second.

``trainer_now()`` = server monotonic now - offset; the server's own wall clock until an
estimate is trusted.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable

DEFAULT_WINDOW = 64
DEFAULT_QUANTILE = 0.1
DEFAULT_MAX_AGE = 300.0
DEFAULT_TOLERANCE = 30.0
DEFAULT_MIN_SAMPLES = 5


class ClockOffset:
    """Robust running estimate of (server monotonic clock - trainer clock)."""

    __slots__ = (
        "_max_age",
        "_min_samples",
        "_mono",
        "_offset",
        "_quantile",
        "_samples",
        "_tolerance",
        "_wall",
        "_window",
    )

    def __init__(
        self,
        *,
        window: int = DEFAULT_WINDOW,
        quantile: float = DEFAULT_QUANTILE,
        max_age: float = DEFAULT_MAX_AGE,
        tolerance: float = DEFAULT_TOLERANCE,
        min_samples: int = DEFAULT_MIN_SAMPLES,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if window < 1 or not 0.0 <= quantile < 1.0 or max_age <= 0 or tolerance <= 0:
            raise ValueError(
                "window >= 1, 0 <= quantile < 1, max_age > 0 and tolerance > 0 are required"
            )
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be within 1..window ({window})")
        self._min_samples = min_samples
        self._window = window
        self._quantile = quantile
        self._max_age = max_age
        self._tolerance = tolerance
        self._mono = monotonic
        self._wall = wall
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (received, d)
        self._offset: float | None = None

    def monotonic(self) -> float:
        """The server clock the samples are measured on (for ``received``)."""
        return self._mono()

    def wall(self) -> float:
        """The server's wall clock: the reference of the webhook's timestamp window."""
        return self._wall()

    def observe(self, *, received: float, trainer_sent: float) -> None:
        """Add one batch: ``received`` on :meth:`monotonic`, ``trainer_sent`` on the trainer's."""
        if not (math.isfinite(received) and math.isfinite(trainer_sent)):
            return
        samples = self._samples
        samples.append((received, received - trainer_sent))
        while samples and samples[0][0] < received - self._max_age:
            samples.popleft()
        if len(samples) < self._min_samples:
            return  # too few to outvote a broken batch: the last trusted estimate stands
        ordered = sorted(d for _, d in samples)
        # Ahead-of-the-rest samples have small d: drop those far below the (lower) median.
        floor = ordered[(len(ordered) - 1) // 2] - self._tolerance
        kept = ordered[bisect_left(ordered, floor) :]
        self._offset = kept[int(self._quantile * len(kept))]

    @property
    def offset(self) -> float | None:
        """Server monotonic minus trainer clock, in seconds; None until it is trusted."""
        return self._offset

    @property
    def trusted(self) -> bool:
        """Whether ``trainer_now()`` follows an estimate (else the server's wall clock)."""
        return self._offset is not None

    @property
    def samples(self) -> int:
        return len(self._samples)

    def trainer_now(self) -> float:
        """The present on the trainer's clock."""
        if self._offset is None:
            return self._wall()
        return self._mono() - self._offset

    def skew(self) -> float | None:
        """How far the trainer's clock is ahead of the server's wall clock (s), for display."""
        if self._offset is None:
            return None
        return self.trainer_now() - self._wall()
