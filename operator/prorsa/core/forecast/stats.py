"""Duration statistics of Appendix B: empirical distributions, the tool EMA, p̂ and d̂.

Everything keeps a sliding window so memory stays bounded however long a job runs, and
every conditioned statistic falls back to a coarser class when its own has too few samples
(a new sandbox image should borrow from its startup mode, not start from nothing).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

# A class key is a tuple, finest first; ``coarsen`` drops trailing parts one by one.
Key = tuple[Hashable, ...]
T = TypeVar("T")


def coarsen(key: Key) -> list[Key]:
    """``(a, b, c)`` -> ``[(a, b, c), (a, b), (a,), ()]``: the fallback chain."""
    return [key[:i] for i in range(len(key), -1, -1)]


class EmpiricalDistribution:
    """A sliding window of observed durations, queried as a conditional distribution.

    The sorted copy and prefix sums are rebuilt lazily, once per tick at most, so adding a
    sample stays O(1) on the event path.
    """

    __slots__ = ("_cum", "_dirty", "_samples", "_sorted")

    def __init__(self, *, window: int) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self._sorted = np.empty(0)
        self._cum = np.zeros(1)
        self._dirty = False

    def add(self, value: float) -> None:
        if 0.0 <= value < math.inf:
            self._samples.append(value)
            self._dirty = True

    def __len__(self) -> int:
        return len(self._samples)

    def _refresh(self) -> None:
        if self._dirty:
            self._sorted = np.sort(np.fromiter(self._samples, float, len(self._samples)))
            self._cum = np.concatenate(([0.0], np.cumsum(self._sorted)))
            self._dirty = False

    def mean(self) -> float:
        return float(np.mean(self._samples)) if self._samples else math.nan

    def conditional(self, elapsed: np.ndarray, horizon: float) -> tuple[np.ndarray, np.ndarray]:
        """For each elapsed e: q = P(T < e + S | T > e) and E[T - e | e < T < e + S].

        This is Eq. 2 (reward) and Eq. 6 (sandbox startup). Past the longest observed
        duration the window says nothing; a memoryless tail with the window's mean stands
        in, so an overdue trajectory keeps a sensible, non-zero chance of finishing.
        """
        self._refresh()
        s, cum, n = self._sorted, self._cum, len(self._sorted)
        e = np.asarray(elapsed, dtype=float)
        if n == 0 or horizon <= 0:
            return np.zeros_like(e), np.full_like(e, horizon / 2)
        lo = np.searchsorted(s, e, side="right")  # samples <= e have already ended
        hi = np.searchsorted(s, e + horizon, side="left")  # samples < e + S
        alive = n - lo
        done = hi - lo
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(alive > 0, done / np.maximum(alive, 1), 0.0)
            mean_end = np.where(done > 0, (cum[hi] - cum[lo]) / np.maximum(done, 1), e)
        residual = np.clip(mean_end - e, 0.0, horizon)
        tail = alive == 0
        if tail.any():
            mu = max(float(cum[-1]) / n, 1e-9)
            q = np.where(tail, 1.0 - math.exp(-horizon / mu), q)
            # Mean of an exponential truncated to [0, S).
            r = mu - horizon * math.exp(-horizon / mu) / max(1.0 - math.exp(-horizon / mu), 1e-12)
            residual = np.where(tail, min(max(r, 0.0), horizon), residual)
        residual = np.where((done == 0) & ~tail, horizon / 2, residual)
        return q, residual


@dataclass(frozen=True, slots=True)
class Prior:
    """What to assume before any sample: an exponential duration with this mean."""

    mean_seconds: float


class ClassChains(Generic[T]):
    """Statistics per conditioning class, and the fallback chain each key feeds.

    A sample of a key feeds its class and every coarser one, so the fallback chain always
    holds data. The number of classes is capped: past the cap a new fine class is not
    created (the coarsest, ``()``, always is), which bounds memory against unbounded label
    values. Adding a sample is on the event path, so each key's chain is resolved once.
    """

    __slots__ = ("_feeds", "_make", "_max", "by_key")

    def __init__(self, make: Callable[[], T], *, max_classes: int) -> None:
        self._make = make
        self._max = max_classes
        self.by_key: dict[Key, T] = {}
        self._feeds: dict[Key, list[T]] = {}

    def get_or_create(self, key: Key) -> T | None:
        """The class of ``key``, created while under the cap; None past it."""
        stat = self.by_key.get(key)
        if stat is None:
            if len(self.by_key) >= self._max and key:
                return None
            stat = self.by_key[key] = self._make()
        return stat

    def feeds(self, key: Key) -> list[T]:
        """The classes a sample of ``key`` feeds, finest first."""
        chain = self._feeds.get(key)
        if chain is None:
            chain = [s for k in coarsen(key) if (s := self.get_or_create(k)) is not None]
            if len(self._feeds) < self._max:
                self._feeds[key] = chain
        return chain

    def chain(self, key: Key) -> list[T]:
        """The existing classes of ``key``'s fallback chain, finest first (none created)."""
        return [s for k in coarsen(key) if (s := self.by_key.get(k)) is not None]

    def lookup(
        self, key: Key, *, trusted: Callable[[T], bool], usable: Callable[[T], bool]
    ) -> T | None:
        """The finest class of ``key``'s chain that is ``trusted``, else the coarsest
        ``usable`` one (every sample also feeds the coarser classes, so that one holds the
        most data), else None."""
        best: T | None = None
        for stat in self.chain(key):
            if not usable(stat):
                continue
            if trusted(stat):
                return stat
            best = stat
        return best

    def __len__(self) -> int:
        return len(self.by_key)


class ClassedDistributions:
    """Empirical distributions per conditioning class, with fallback to coarser classes.

    Every sample feeds its class and all coarser ones, so the fallback chain always holds
    data. The number of classes is capped: past the cap a new fine class is not created and
    lookups fall back, which bounds memory against unbounded label values.
    """

    def __init__(
        self, *, window: int, min_samples: int, prior: Prior, max_classes: int = 4096
    ) -> None:
        self._min = min_samples
        self._prior = prior
        self._classes: ClassChains[EmpiricalDistribution] = ClassChains(
            lambda: EmpiricalDistribution(window=window), max_classes=max_classes
        )

    def add(self, key: Key, value: float) -> None:
        if not 0.0 <= value < math.inf:
            return
        for dist in self._classes.feeds(key):
            dist._samples.append(value)
            dist._dirty = True

    def lookup(self, key: Key) -> EmpiricalDistribution | None:
        """The finest class with enough samples, else the coarsest with any (every sample
        also feeds the coarser classes, so that one holds the most data), else None."""
        return self._classes.lookup(
            key, trusted=lambda d: len(d) >= self._min, usable=lambda d: len(d) > 0
        )

    def conditional(
        self, key: Key, elapsed: np.ndarray, horizon: float
    ) -> tuple[np.ndarray, np.ndarray]:
        dist = self.lookup(key)
        if dist is not None:
            return dist.conditional(elapsed, horizon)
        e = np.asarray(elapsed, dtype=float)
        mu = max(self._prior.mean_seconds, 1e-9)
        q = 1.0 - math.exp(-horizon / mu) if horizon > 0 else 0.0
        return np.full_like(e, q), np.full_like(e, min(mu, horizon / 2))

    def mean(self, key: Key) -> float:
        dist = self.lookup(key)
        return dist.mean() if dist is not None else self._prior.mean_seconds

    def classes(self) -> int:
        return len(self._classes)

    def export(self) -> list[tuple[Key, list[float]]]:
        """Samples by class, for persistence across operator restarts."""
        return [(k, list(d._samples)) for k, d in self._classes.by_key.items()]

    def restore(self, items: list[tuple[Key, list[float]]]) -> None:
        for key, samples in items:
            dist = self._classes.get_or_create(key)
            if dist is None:
                continue
            for v in samples:
                dist.add(float(v))


class EmaTable:
    """Eq. 9–10: τ ← (1 − α)·τ + α·τ̂ per conditioning class, with fallback.

    A class is trusted once it has ``min_samples`` updates; before that the next coarser
    trusted class answers. The first sample of a class seeds τ directly (an EMA seeded at
    zero would under-predict for ~1/α samples). Updates sit on the event path, so each class
    keeps one mutable ``[τ, count]`` entry, each key's fallback chain is computed once, and
    once every class of a chain exists, an update walks the chain's entries directly.
    """

    def __init__(self, *, alpha: float, min_samples: int, prior: float, max_classes: int = 4096):
        self.alpha = alpha
        self._min = min_samples
        self._prior = prior
        self._max = max_classes
        self._entries: dict[Key, list[float]] = {}
        self._chains: dict[Key, list[Key]] = {}
        # key -> the entries of its whole chain, cached once they all exist (only restore()
        # replaces entries, and it clears this).
        self._feeds: dict[Key, list[list[float]]] = {}

    def _chain(self, key: Key) -> list[Key]:
        chain = self._chains.get(key)
        if chain is None:
            chain = coarsen(key)
            if len(self._chains) < self._max:
                self._chains[key] = chain
        return chain

    def update(self, key: Key, observed: float) -> None:
        if not 0 <= observed < math.inf:  # also refuses NaN
            return
        a = self.alpha
        cached = self._feeds.get(key)
        if cached is not None:
            for fed in cached:
                fed[0] += a * (observed - fed[0])
                fed[1] += 1
            return
        entries = self._entries
        feeds = []
        for k in self._chain(key):
            entry = entries.get(k)
            if entry is None:
                if len(entries) >= self._max and k:
                    continue
                entries[k] = [observed, 1]
            else:
                entry[0] += a * (observed - entry[0])
                entry[1] += 1
                feeds.append(entry)
        if len(feeds) == len(self._chain(key)) and len(self._feeds) < self._max:
            self._feeds[key] = feeds

    def get(self, key: Key) -> float:
        fallback: float | None = None
        for k in self._chain(key):
            entry = self._entries.get(k)
            if entry is None:
                continue
            if entry[1] >= self._min:
                return entry[0]
            if fallback is None:
                fallback = entry[0]
        return self._prior if fallback is None else fallback

    def classes(self) -> int:
        return len(self._entries)

    def export(self) -> list[tuple[Key, float, int]]:
        return [(k, e[0], int(e[1])) for k, e in self._entries.items()]

    def restore(self, items: list[tuple[Key, float, int]]) -> None:
        self._feeds.clear()  # restored entries replace the cached ones
        for key, tau, count in items:
            if math.isfinite(tau) and count > 0 and len(self._entries) < self._max:
                self._entries[key] = [float(tau), int(count)]


class WindowMean:
    """Mean of the last ``window`` observations, O(1) per update (p̂, d̂, prompt sizes)."""

    __slots__ = ("_sum", "_values", "default")

    def __init__(self, *, window: int, default: float) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self.default = default

    def add(self, value: float) -> None:
        if not -math.inf < value < math.inf:
            return  # NaN or infinite
        values = self._values
        if len(values) == values.maxlen:
            self._sum -= values[0]
        values.append(value)
        self._sum += value

    def __len__(self) -> int:
        return len(self._values)

    @property
    def value(self) -> float:
        return self._sum / len(self._values) if self._values else self.default

    def export(self) -> list[float]:
        return list(self._values)

    def restore(self, values: list[float]) -> None:
        for v in values:
            self.add(float(v))
