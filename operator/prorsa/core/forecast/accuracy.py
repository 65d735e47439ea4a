"""Online correction and scoring of the forecasts (Appendix B, "aggregation and online
correction"; the WAPE of paper Figure 8).

Each tick registers what it predicted for the window [t, t+S). Arrivals and decode
admissions observed inside a window are added to it as their events come in; once the
window has closed (plus a grace period for events still in flight from the trainer), the
window is scored and feeds the multiplicative bias correction.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Window:
    start: float
    end: float
    backlog: float  # ready + in-flight prefill tokens at start: observed, not predicted
    predicted_arrivals: float  # raw (uncorrected) sampler + startup + tool
    predicted_prefill: float  # as reported: backlog + corrected arrivals
    predicted_admission_raw: float
    predicted_admission: float
    arrivals: float = 0.0
    admissions: float = 0.0


@dataclass
class AccuracyTracker:
    """WAPE over the last ``windows`` scored windows, and the bias factors they imply."""

    windows: int = 60
    bias_windows: int = 12
    min_bias_windows: int = 3
    clip: tuple[float, float] = (0.5, 2.0)
    grace_seconds: float = 2.0
    max_pending: int = 64
    _pending: deque[_Window] = field(default_factory=deque)
    _prefill: deque[tuple[float, float]] = field(default_factory=deque)  # (|err|, actual)
    _admission: deque[tuple[float, float]] = field(default_factory=deque)
    _arrival_ratio: deque[tuple[float, float]] = field(default_factory=deque)  # (obs, pred)
    _admission_ratio: deque[tuple[float, float]] = field(default_factory=deque)
    _observed: deque[tuple[float, float]] = field(default_factory=deque)  # (tokens, seconds)
    scored: int = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def on_arrival(self, ts: float, tokens: float) -> None:
        for w in self._pending:
            if w.start <= ts < w.end:
                w.arrivals += tokens

    def on_admission(self, ts: float, tokens: float) -> None:
        for w in self._pending:
            if w.start <= ts < w.end:
                w.admissions += tokens

    def register(
        self,
        *,
        start: float,
        horizon: float,
        backlog: float,
        predicted_arrivals: float,
        predicted_prefill: float,
        predicted_admission_raw: float,
        predicted_admission: float,
    ) -> None:
        if self._pending and start <= self._pending[-1].start:
            return  # a repeated tick at the same time predicts the same window
        self._pending.append(
            _Window(
                start,
                start + horizon,
                backlog,
                predicted_arrivals,
                predicted_prefill,
                predicted_admission_raw,
                predicted_admission,
            )
        )
        while len(self._pending) > self.max_pending:
            self._pending.popleft()

    def close_until(self, now: float) -> int:
        """Score every window that ended at least ``grace_seconds`` before ``now``."""
        closed = 0
        while self._pending and self._pending[0].end + self.grace_seconds <= now:
            w = self._pending.popleft()
            actual_prefill = w.backlog + w.arrivals
            self._push(self._prefill, (abs(w.predicted_prefill - actual_prefill), actual_prefill))
            self._push(self._admission, (abs(w.predicted_admission - w.admissions), w.admissions))
            self._push(self._arrival_ratio, (w.arrivals, w.predicted_arrivals), self.bias_windows)
            self._push(self._observed, (w.arrivals, w.end - w.start), self.bias_windows)
            self._push(
                self._admission_ratio,
                (w.admissions, w.predicted_admission_raw),
                self.bias_windows,
            )
            closed += 1
            self.scored += 1
        return closed

    def _push(self, q: deque[tuple[float, float]], item: tuple[float, float], n: int = 0) -> None:
        q.append(item)
        while len(q) > (n or self.windows):
            q.popleft()

    @staticmethod
    def _wape(q: deque[tuple[float, float]]) -> float | None:
        actual = sum(a for _, a in q)
        if not q or actual <= 0:
            return None
        return sum(e for e, _ in q) / actual

    @property
    def prefill_wape(self) -> float | None:
        return self._wape(self._prefill)

    @property
    def decode_wape(self) -> float | None:
        return self._wape(self._admission)

    def _factor(self, q: deque[tuple[float, float]]) -> float:
        if len(q) < self.min_bias_windows:
            return 1.0
        observed = sum(o for o, _ in q)
        predicted = sum(p for _, p in q)
        if predicted <= 0:
            return 1.0
        lo, hi = self.clip
        return min(max(observed / predicted, lo), hi)

    def arrival_rate(self, windows: int) -> float | None:
        """Prompt tokens that arrived per second, the median over the last ``windows``.

        What the trainer actually sent, whatever the forecast made of it: a queue that
        stays full because it is refilled as fast as it is served shows here as a rate,
        where the ready queue alone looks like work drained once. The median, so that one
        burst (every interrupted trajectory resent after a weight update) is not taken
        for a rate. None before any window.
        """
        recent = [t / s for t, s in list(self._observed)[-windows:] if s > 0]
        if not recent:
            return None
        return float(statistics.median(recent))

    @property
    def arrival_factor(self) -> float:
        """Multiplier for the predicted (not observed) part of the prefill forecast."""
        return self._factor(self._arrival_ratio)

    @property
    def admission_factor(self) -> float:
        return self._factor(self._admission_ratio)
