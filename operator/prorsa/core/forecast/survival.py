"""Decode durations as a survival problem: Kaplan–Meier over completed and running decodes.

A decode's duration is known only once it ends. Estimating the duration distribution from
completed decodes alone over-represents short ones whenever long ones are still running
(right-censoring): at the start of a math step every decode is running and the first to
complete are the shortest. :class:`SurvivalWindow` therefore counts the decodes still
running as censored observations ("lasted at least this long") in the product-limit
(Kaplan–Meier) estimator, which the Appendix B decode-chain term (Eq. 11 one step back)
queries for P(T < e + S | T > e).

The window is bounded: the last ``window`` completed decodes of a class, plus the decodes
running now. The completions retained cover the period [t0, now], t0 being the oldest one's
completion time; a decode that started before t0 enters the risk set at its age at t0
(left truncation), so decodes that started and ended before t0 (evicted from the window)
do not bias the estimate, and a long-running steady state gives the same answer as a step
that has just begun. Running decodes beyond ``window`` of a class are thinned to an evenly
strided subset, each then standing for several.

Each completion carries a mark (here: "ended in a tool call"), so that the estimator also
gives the cumulative incidence of marked endings (Aalen–Johansen): the chance that a
running decode ends *with a tool call* within the window, which depends on how long it has
run (a math decode running for minutes is a final answer, not a tool call).

Past the longest completed decode the product-limit estimate says nothing; an exponential
tail stands in, with the hazard of the observations beyond the median completed duration
plus one pseudo-event over the prior mean (so that a class with nothing but running
decodes still gives a finite, decreasing hazard as they keep running).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from prorsa.core.forecast.stats import ClassChains, Key, Prior, coarsen

_TINY = 1e-12


@dataclass(frozen=True, slots=True)
class _Fit:
    """One product-limit fit: jump ages, survival before each jump, jump masses, the tail."""

    ages: np.ndarray  # distinct completed durations, ascending
    surv: np.ndarray  # surv[k] = S just before ages[k]; surv[-1] = S after the last jump
    cum_mass: np.ndarray  # prefix sums of the jump masses (all endings)
    cum_age_mass: np.ndarray  # prefix sums of age · mass
    cum_mark: np.ndarray  # prefix sums of the marked part of each jump's mass
    cum_age_mark: np.ndarray
    tail_rate: float  # exponential hazard past ages[-1] (or from 0 with no completions)
    tail_share: float  # share of marked endings in the tail

    @property
    def last(self) -> float:
        return float(self.ages[-1]) if len(self.ages) else 0.0


@dataclass(frozen=True, slots=True)
class _Events:
    """The completions' part of a fit (see :meth:`SurvivalWindow._event_part`)."""

    t0: float  # left-truncation time; -inf while the window holds every completion
    ages: np.ndarray  # distinct durations, ascending
    counts: np.ndarray  # completions at each
    marks: np.ndarray  # marked completions at each
    at_risk: np.ndarray  # completions at risk at each
    cut: float  # median duration: the tail rate is estimated past it
    tail_events: float
    tail_exposure: float
    tail_share: float


def _at_risk(entries: np.ndarray, exits: np.ndarray, ages: np.ndarray) -> np.ndarray:
    """How many observations have entered (entry < a) and not yet left (exit >= a)."""
    return np.searchsorted(entries, ages, side="left") - np.searchsorted(exits, ages, side="left")


def _truncated_exp_mean(rate: float, length: np.ndarray) -> np.ndarray:
    """Mean of an exponential with ``rate`` truncated to [0, length)."""
    x = np.maximum(rate * length, 1e-9)
    return np.where(
        rate * length > 1e-6,
        1.0 / max(rate, 1e-12) - length * np.exp(-x) / -np.expm1(-x),
        length / 2,
    )


class SurvivalWindow:
    """Completed and running decodes of one class, queried as a conditional distribution.

    Adding a completion is O(1) (it sits on the event path); the fit is rebuilt lazily,
    at most once per tick, when a query finds it stale.
    """

    __slots__ = ("_buf", "_ce_age", "_ce_weight", "_ev", "_fit", "_n", "_next", "_now", "_prior")

    def __init__(self, *, window: int, prior: Prior) -> None:
        # A ring of the last ``window`` completions: rows (completion time, duration, mark).
        # The completion time is the last tick's time; -inf before the first tick or for
        # restored samples. An array, not a deque of tuples: a refit reads it whole.
        self._buf = np.empty((3, max(window, 1)))
        self._n = 0
        self._next = 0
        self._ce_age = np.empty(0)
        self._ce_weight = 1.0
        self._now = -math.inf
        self._prior = prior
        self._fit: _Fit | None = None
        self._ev: _Events | None = None

    def __len__(self) -> int:
        """Completed decodes held (running ones are not samples of a duration)."""
        return self._n

    @property
    def running(self) -> int:
        return len(self._ce_age)

    def add(self, duration: float, mark: float = 0.0, stamp: float = -math.inf) -> None:
        if 0.0 <= duration < math.inf:
            i = self._next
            buf = self._buf
            buf[0, i] = stamp
            buf[1, i] = duration
            buf[2, i] = min(max(mark, 0.0), 1.0)
            self._next = (i + 1) % buf.shape[1]
            self._n = min(self._n + 1, buf.shape[1])
            self._fit = self._ev = None

    def set_running(self, ages: np.ndarray, *, now: float) -> None:
        """Replace the censored observations: the ages of the decodes running at ``now``."""
        a = np.asarray(ages, dtype=float)
        a = a[np.isfinite(a) & (a >= 0)]
        cap = self._buf.shape[1]
        if len(a) > cap:
            step = math.ceil(len(a) / cap)
            self._ce_weight = len(a) / len(a[::step])
            a = a[::step]
        else:
            self._ce_weight = 1.0
        self._ce_age = a
        self._now = now
        self._fit = None

    def export(self) -> list[list[float]]:
        """[duration, mark] pairs, oldest first (restoring keeps the eviction order)."""
        order = np.arange(self._next - self._n, self._next) % self._buf.shape[1]
        pairs: list[list[float]] = self._buf[1:, order].T.tolist()
        return pairs

    # -- the fit ---------------------------------------------------------------------------

    def _event_part(self) -> _Events:
        """What depends on the completions only: rebuilt when one is added, not per tick."""
        if self._ev is not None:
            return self._ev
        stamp, dur, mark = self._buf[:, : self._n]
        # Left truncation at t0, the oldest retained completion (see the module docstring).
        t0 = float(stamp.min()) if self._n == self._buf.shape[1] else -math.inf
        if math.isfinite(t0):
            entry = np.minimum(np.maximum(0.0, t0 - (stamp - dur)), dur)
        else:
            entry = np.zeros_like(dur)
        ages, inverse, counts = np.unique(dur, return_inverse=True, return_counts=True)
        # Tail statistics past the median completion: its events, their marks, exposure.
        cut = (
            float(ages[np.searchsorted(np.cumsum(counts), (len(dur) + 1) // 2)])
            if len(dur)
            else 0.0
        )
        beyond = dur > cut if len(dur) > 1 else np.ones(len(dur), dtype=bool)
        n_beyond = int(beyond.sum())
        mark_beyond = mark[beyond] if n_beyond else mark
        self._ev = _Events(
            t0=t0,
            ages=ages,
            counts=counts.astype(float),
            marks=np.bincount(inverse, weights=mark, minlength=len(ages)),
            at_risk=_at_risk(np.sort(entry), np.sort(dur), ages).astype(float),
            cut=cut,
            tail_events=float(n_beyond),
            tail_exposure=float(np.maximum(dur - np.maximum(entry, cut), 0.0).sum()),
            tail_share=float(mark_beyond.mean()) if len(mark_beyond) else 0.5,
        )
        return self._ev

    def _refit(self) -> _Fit:
        if self._fit is not None:
            return self._fit
        e = self._event_part()
        ce = np.sort(self._ce_age)
        # Entry age at t0 grows with the age now, so sorting the ages sorts the entries.
        ce_entry = np.maximum(0.0, ce - (self._now - e.t0)) if math.isfinite(e.t0) else ce * 0
        w = self._ce_weight
        n = np.maximum(e.at_risk + w * _at_risk(ce_entry, ce, e.ages), e.counts)
        hazard = np.divide(e.counts, n, out=np.zeros(len(n)), where=n > 0)
        surv = np.concatenate(([1.0], np.cumprod(1.0 - hazard)))
        mass = surv[:-1] * hazard
        mark_mass = surv[:-1] * np.divide(e.marks, n, out=np.zeros(len(n)), where=n > 0)
        # Exponential tail: events over exposure past the cut, one pseudo-event over the
        # prior mean.
        exposure = e.tail_exposure + w * float(
            np.maximum(ce - np.maximum(ce_entry, e.cut), 0.0).sum()
        )
        rate = (e.tail_events + 1.0) / (exposure + max(self._prior.mean_seconds, 1e-9))

        def cum(x: np.ndarray) -> np.ndarray:
            return np.concatenate(([0.0], np.cumsum(x)))

        self._fit = _Fit(
            ages=e.ages,
            surv=surv,
            cum_mass=cum(mass),
            cum_age_mass=cum(e.ages * mass),
            cum_mark=cum(mark_mass),
            cum_age_mark=cum(e.ages * mark_mass),
            tail_rate=rate,
            tail_share=e.tail_share,
        )
        return self._fit

    # -- queries ---------------------------------------------------------------------------

    def survival(self, t: np.ndarray) -> np.ndarray:
        """S(t) = P(T > t)."""
        f = self._refit()
        t = np.asarray(t, dtype=float)
        s = f.surv[np.searchsorted(f.ages, t, side="right")]
        return s * np.exp(-f.tail_rate * np.maximum(t - f.last, 0.0))

    def median(self) -> float:
        f = self._refit()
        below = np.flatnonzero(f.surv[1:] <= 0.5)
        if len(below):
            return float(f.ages[below[0]])
        s_last = float(f.surv[-1])
        return f.last + math.log(s_last / 0.5) / f.tail_rate

    def conditional(
        self, elapsed: np.ndarray, horizon: float, *, marked: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """For each elapsed e: q = P(T < e + S [and marked] | T > e), and the mean of T − e
        over those endings (the residual), as :meth:`EmpiricalDistribution.conditional`."""
        e = np.asarray(elapsed, dtype=float)
        if horizon <= 0:
            return np.zeros_like(e), np.full_like(e, horizon / 2)
        f = self._refit()
        end = e + horizon
        # Product-limit part: jumps at ages in (e, min(e + S, last)], strictly before e + S.
        lo = np.searchsorted(f.ages, e, side="right")
        hi = np.searchsorted(f.ages, end, side="left")
        cm, ca = (f.cum_mark, f.cum_age_mark) if marked else (f.cum_mass, f.cum_age_mass)
        mass = cm[hi] - cm[lo]
        age_mass = ca[hi] - ca[lo]
        alive = f.surv[lo]  # S(e)
        # Exponential tail past the last completion, over [max(e, last), e + S): only for
        # the decodes whose window reaches past it.
        rate, last = f.tail_rate, f.last
        share = f.tail_share if marked else 1.0
        tail = np.flatnonzero(end > last)
        if len(tail):
            a = np.maximum(e[tail], last)
            length = end[tail] - a
            decay = np.exp(-rate * (a - last))
            alive[tail] *= decay
            t_mass = float(f.surv[-1]) * decay * -np.expm1(-rate * length) * share
            mass[tail] += t_mass
            age_mass[tail] += t_mass * (a + _truncated_exp_mean(rate, length))
        q = np.divide(mass, alive, out=np.zeros_like(e), where=alive > _TINY)
        mean_end = np.divide(age_mass, mass, out=end - horizon / 2, where=mass > _TINY)
        residual = np.clip(mean_end - e, 0.0, horizon)
        # The estimate has reached zero survival before e: an overdue decode. Memoryless.
        gone = alive <= _TINY
        if gone.any():
            q = np.where(gone, -math.expm1(-rate * horizon) * share, q)
            residual = np.where(gone, _truncated_exp_mean(rate, np.array(horizon)), residual)
        return np.clip(q, 0.0, 1.0), residual


class ClassedSurvival:
    """:class:`SurvivalWindow` per conditioning class, with the fallback of
    :class:`~prorsa.core.forecast.stats.ClassedDistributions`.

    Every completion and every running decode feeds its class and all coarser ones. A
    class is trusted once it holds ``min_samples`` completions; otherwise the coarsest
    class holding any observation (completed or running) answers, and with none at all the
    prior (an exponential duration, ``prior_mark_share`` of endings marked) does.
    """

    def __init__(
        self,
        *,
        window: int,
        min_samples: int,
        prior: Prior,
        prior_mark_share: float = 0.5,
        max_classes: int = 4096,
    ) -> None:
        self._window = window
        self._min = min_samples
        self._prior = prior
        self._share = prior_mark_share
        self._classes: ClassChains[SurvivalWindow] = ClassChains(
            lambda: SurvivalWindow(window=window, prior=prior), max_classes=max_classes
        )
        self._clock = -math.inf  # the last tick's time: completion stamps

    def add(self, key: Key, value: float, *, marked: bool = False) -> None:
        """A completed decode of ``value`` seconds (an event)."""
        if not 0.0 <= value < math.inf:
            return
        mark = 1.0 if marked else 0.0
        for dist in self._classes.feeds(key):
            dist.add(value, mark, self._clock)

    def observe_running(self, now: float, running: Mapping[Key, np.ndarray]) -> None:
        """The decodes running at ``now``, their elapsed seconds by class (censored).

        Replaces the previous tick's: a class absent from ``running`` has none running.
        """
        self._clock = now
        parts: dict[Key, list[np.ndarray]] = {}
        for key, ages in running.items():
            for k in coarsen(key):
                parts.setdefault(k, []).append(np.asarray(ages, dtype=float))
            self._classes.feeds(key)
        for k, dist in self._classes.by_key.items():
            chunks = parts.get(k)
            if chunks:
                dist.set_running(np.concatenate(chunks), now=now)
            elif dist.running or dist._now < now:
                dist.set_running(np.empty(0), now=now)

    def lookup(self, key: Key) -> SurvivalWindow | None:
        # A class with only running decodes is usable: they bound its durations from below.
        return self._classes.lookup(
            key,
            trusted=lambda d: len(d) >= self._min,
            usable=lambda d: bool(len(d) or d.running),
        )

    def conditional(
        self, key: Key, elapsed: np.ndarray, horizon: float, *, marked: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        dist = self.lookup(key)
        if dist is not None:
            return dist.conditional(elapsed, horizon, marked=marked)
        e = np.asarray(elapsed, dtype=float)
        mu = max(self._prior.mean_seconds, 1e-9)
        q = -math.expm1(-horizon / mu) if horizon > 0 else 0.0
        q *= self._share if marked else 1.0
        return np.full_like(e, q), np.full_like(e, min(mu, horizon / 2))

    def median(self, key: Key) -> float:
        dist = self.lookup(key)
        return dist.median() if dist is not None else self._prior.mean_seconds * math.log(2)

    def classes(self) -> int:
        return len(self._classes)

    def export(self) -> list[tuple[Key, list[list[float]]]]:
        """Completed decodes by class as [duration, mark] pairs, for persistence."""
        return [(k, d.export()) for k, d in self._classes.by_key.items()]

    def restore(self, items: list[tuple[Key, list[object]]]) -> None:
        """Accepts what :meth:`export` wrote, and plain durations (marked with the prior
        share), as :class:`ClassedDistributions` exported them."""
        for key, samples in items:
            dist = self._classes.get_or_create(key)
            if dist is None:
                continue
            for v in samples:
                if isinstance(v, list | tuple) and len(v) == 2:
                    dist.add(float(v[0]), float(v[1]))
                elif isinstance(v, int | float):
                    dist.add(float(v), self._share)
