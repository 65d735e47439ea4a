"""The table as one forecast reads it, and the parts the demand sources hand on.

A forecast reads the table's columns once (:class:`TableView`); each source of Appendix B
adds its future prefill arrivals to :class:`Arrivals` for the recurrence of Eq. 13, and
the observed ones (queued, in flight, re-prefills) come back as values of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prorsa.core.forecast.table import TrajectoryTable


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeBacklog:
    """Prompts the decode engines hold for KV room that the trainer still counts in
    prefill: at most ``requests`` of them, ``tokens`` in all (``measure.decode_backlog``)."""

    requests: int = 0
    tokens: float = 0.0


def prefill_work(x: np.ndarray, cached: np.ndarray | float, doubling: float | None) -> np.ndarray:
    """Computed tokens of each prompt, weighted by what attention makes them cost.

    Token p of a prompt attends to the p before it, so its cost grows about linearly:
    1 + p/L with L = ``doubling``. Computing positions c..x then costs
    (x − c)·(1 + (x + c)/(2L)) start-of-prompt tokens: a resend that recomputes a 60k
    context is ~2.5× its token count, a 1k tool turn on a cached 60k prefix ~2.5× too.
    """
    comp: np.ndarray = np.maximum(x - cached, 1.0)
    if not doubling:
        return comp
    weighted: np.ndarray = comp * (1.0 + (x + np.minimum(cached, x)) / (2.0 * doubling))
    return weighted


@dataclass(frozen=True, slots=True, kw_only=True)
class TableView:
    """The columns one forecast reads, cut to the used slots, and the tick's constants."""

    table: TrajectoryTable
    col: dict[str, np.ndarray]
    n: int
    now: float
    horizon: float  # S
    doubling: float | None
    state: np.ndarray
    since: np.ndarray
    x: np.ndarray
    task: np.ndarray
    cached: np.ndarray

    def at(self, column: str, idx: np.ndarray) -> np.ndarray:
        """The values of ``column`` at the used slots ``idx``."""
        values: np.ndarray = self.col[column][: self.n][idx]
        return values

    def turn_buckets(self, idx: np.ndarray) -> np.ndarray:
        """Vectorised :func:`~prorsa.core.forecast.transitions.turn_bucket` at ``idx``."""
        turns = self.at("turn", idx)
        buckets: np.ndarray = np.minimum(np.floor(np.log2(np.maximum(turns, 1))) + (turns > 0), 8)
        return buckets

    @classmethod
    def of(
        cls, table: TrajectoryTable, *, now: float, horizon: float, doubling: float | None
    ) -> TableView:
        n = table.hwm
        col = table.cols
        return cls(
            table=table,
            col=col,
            n=n,
            now=now,
            horizon=horizon,
            doubling=doubling,
            state=col["state"][:n],
            since=col["since"][:n],
            x=col["x"][:n],
            task=col["task"][:n],
            # Tokens a request computes: its prompt minus the prefix the engines still hold
            # from its previous turn. New samples and resends compute their whole prompt.
            cached=col["cached"][:n],
        )


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Future arrivals for Eq. 13, per source: time, prompt tokens, weight, computed work."""

    u: list[np.ndarray] = field(default_factory=list)
    x: list[np.ndarray] = field(default_factory=list)
    w: list[np.ndarray] = field(default_factory=list)
    work: list[np.ndarray] = field(default_factory=list)

    def add(self, *, u: np.ndarray, x: np.ndarray, w: np.ndarray, work: np.ndarray) -> None:
        self.u.append(u)
        self.x.append(x)
        self.w.append(w)
        self.work.append(work)

    def hold_until(self, t: float) -> None:
        """Nothing arrives at a prefill engine before ``t`` (a weight update ends)."""
        self.u[:] = [np.maximum(u, t) for u in self.u]

    def weights_and_work(self) -> tuple[np.ndarray, np.ndarray]:
        w = np.concatenate(self.w) if self.w else np.empty(0)
        work = np.concatenate(self.work) if self.work else np.empty(0)
        return w, work


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerDemand:
    tokens: float  # W_samp, Eq. 5
    launches: float  # N̂_samp, Eq. 4
    launch_horizon: float  # S_pw


@dataclass(frozen=True, slots=True, kw_only=True)
class Observed:
    """Requests already at a prefill engine (queued or in flight): observed, not predicted."""

    idx: np.ndarray
    tokens: float
    work: np.ndarray

    @classmethod
    def of(cls, v: TableView, idx: np.ndarray) -> Observed:
        return cls(
            idx=idx,
            tokens=float(v.x[idx].sum()),
            work=prefill_work(v.x[idx], v.cached[idx], v.doubling),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Reprefill:
    u: np.ndarray
    x: np.ndarray
    work: np.ndarray

    @property
    def tokens(self) -> float:
        return float(self.x.sum())
