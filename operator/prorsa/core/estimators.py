"""§4.2's running estimates that size the split: θ_P, the prefix-cache hit ratio, demand.

:mod:`prorsa.core.allocate` solves Eq. 1 for given demands and speeds; the estimators here
turn what the trainer and the agents report into those inputs, one tick at a time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace


class PrefillSpeed:
    """θ_P: full-prompt tokens per busy instance-second over completed busy intervals (§4.2).

    A busy interval runs from the start of service on an idle instance until its prefill
    work drains; tokens and seconds then cover the same requests. The estimate is the
    ratio of sums over the last ``window`` intervals. With none yet it keeps the last valid
    value, and before any, the profiled one: idle time is never read as zero speed.
    Intervals of fewer than ``min_tokens`` (a health probe, a warm-up request) measure a
    request's fixed overheads, not prefill speed, and are left out.
    """

    def __init__(
        self,
        *,
        profiled: float,
        window: int = 64,
        min_seconds: float = 0.05,
        min_tokens: float = 256.0,
    ) -> None:
        self.profiled = profiled
        self._intervals: deque[tuple[float, float]] = deque(maxlen=window)
        self._min_seconds = min_seconds
        self._min_tokens = min_tokens
        self._last_valid: float | None = None

    def add_interval(self, *, tokens: float, seconds: float) -> bool:
        """Record one completed busy interval; returns whether it was usable."""
        if not (
            seconds >= self._min_seconds and tokens >= self._min_tokens and math.isfinite(tokens)
        ):
            return False
        self._intervals.append((tokens, seconds))
        total_s = sum(s for _, s in self._intervals)
        self._last_valid = sum(t for t, _ in self._intervals) / total_s
        return True

    @property
    def value(self) -> float:
        return self._last_valid if self._last_valid is not None else self.profiled

    @property
    def measured(self) -> bool:
        return self._last_valid is not None

    @property
    def intervals(self) -> int:
        return len(self._intervals)

    def export(self) -> list[tuple[float, float]]:
        return list(self._intervals)

    def restore(self, intervals: list[tuple[float, float]]) -> None:
        for tokens, seconds in intervals:
            self.add_interval(tokens=float(tokens), seconds=float(seconds))


@dataclass(frozen=True, slots=True, kw_only=True)
class DemandSmoother:
    """Exponentially weighted means of the demands (a, b, ...): what the split is sized for.

    A role switch costs more than its 5 s: the instance's prefix cache is flushed, so the
    trajectories it served re-prefill their whole context, and decodes still running at the
    drain timeout are aborted. Demand that swings every minute (GRPO groups move through
    prefill, decode and tools in waves; a weight update re-prefills every live trajectory)
    is therefore better served by the split that fits its average over ``seconds`` than by
    chasing each horizon. Each tick's demand weighs exp(−age/seconds); the weights are
    normalised, so the first ticks average what has been seen instead of being pulled
    toward zero. ``seconds`` = 0 passes each tick's demand through unchanged. Every tick
    passes the same number of values, each smoothed on its own with the same weights.

    A value, like the stages' inputs: :meth:`fold` returns the smoother with a tick folded
    in, and the sizing stage hands it back to the Controller to keep.
    """

    seconds: float
    at: float | None = None
    sums: tuple[float, ...] = ()
    weight: float = 0.0

    def __post_init__(self) -> None:
        if not (self.seconds >= 0 and math.isfinite(self.seconds)):
            raise ValueError(f"smoothing seconds must be finite and >= 0, got {self.seconds}")

    def fold(self, now: float, *values: float) -> tuple[DemandSmoother, tuple[float, ...]]:
        """Fold in this tick's demands: the next smoother, and the demands smoothed (in the
        same order). With ``seconds`` = 0 both pass through: nothing is kept."""
        if self.seconds == 0:
            return self, values
        decay = 1.0 if self.at is None else math.exp(-max(now - self.at, 0.0) / self.seconds)
        sums = self.sums or (0.0,) * len(values)
        nxt = replace(
            self,
            at=now,
            sums=tuple(decay * s + v for s, v in zip(sums, values, strict=True)),
            weight=decay * self.weight + 1.0,
        )
        return nxt, nxt.value

    @property
    def value(self) -> tuple[float, ...]:
        """The smoothed demands of the ticks folded in so far."""
        if self.weight == 0:
            return tuple(0.0 for _ in self.sums)
        return tuple(s / self.weight for s in self.sums)


class PrefixCacheHits:
    """The prefix-cache hit ratio h of recent prefills, for θ_P in full-prompt tokens.

    §4.2 counts W_P and θ_P in full prompt tokens, cached prefixes included, so θ_P must
    carry the workload's cache hit ratio. Busy intervals measure it only when an instance
    drains; under continuous load, or with attention-DP ranks (an instance is busy while
    any rank prefills), they rarely complete or under-read. The trainer's events count the
    full prompts prefilled and the agents count the tokens actually computed (SGLang's
    ``total_prefill_uncached_tokens``); over a sliding window the ratio of the two is the
    miss ratio 1 − h, and θ_P = θ_uncached / (1 − h).

    The same window also sets the engines' computed tokens against what the trajectory
    table expected them to compute (each prompt minus its previous turn's): their ratio
    calibrates the per-request cost g of Eq. 13 for what the table cannot see, such as
    a weight update flushing the caches of trajectories that were running tools.
    """

    MIN_CALIBRATION = 0.25
    MAX_CALIBRATION = 64.0

    def __init__(self, *, window: float, min_tokens: float = 1.0) -> None:
        self.window = window
        self._min_tokens = min_tokens
        self._full: deque[tuple[float, float]] = deque()
        self._computed: deque[tuple[float, float]] = deque()
        self._expected: deque[tuple[float, float]] = deque()

    def add_full(self, at: float, tokens: float) -> None:
        """Full-prompt tokens whose prefill finished (trainer events)."""
        if tokens > 0:
            self._full.append((at, tokens))

    def add_computed(self, at: float, tokens: float) -> None:
        """Prompt tokens the engines computed, i.e. not served from cache (agents)."""
        if tokens > 0:
            self._computed.append((at, tokens))

    def add_expected(self, at: float, tokens: float) -> None:
        """The trajectory table's estimate of the computed tokens of the same prefills."""
        if tokens > 0:
            self._expected.append((at, tokens))

    def _sums(self, now: float) -> tuple[float, float, float]:
        start = now - self.window
        sums = []
        for q in (self._full, self._computed, self._expected):
            while q and q[0][0] < start:
                q.popleft()
            sums.append(sum(t for _, t in q))
        return sums[0], sums[1], sums[2]

    def miss_ratio(self, now: float) -> float | None:
        """1 − h over the last ``window`` seconds; None until both sides saw tokens."""
        full, computed, _ = self._sums(now)
        if full < self._min_tokens or computed <= 0:
            return None
        return min(computed / full, 1.0)

    def calibration(self, now: float) -> float | None:
        """Computed over expected-computed tokens (clipped to [0.25, 4]); None until both."""
        _, computed, expected = self._sums(now)
        if expected < self._min_tokens or computed <= 0:
            return None
        return min(max(computed / expected, self.MIN_CALIBRATION), self.MAX_CALIBRATION)
