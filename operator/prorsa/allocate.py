"""§4.2: the Eq. 1 allocation and the prefill speed estimate θ_P.

Eq. 1:  n_P = ⌈ W_P / (S·θ_P) · (1+δ) ⌉,  n_D = ⌈ (K_D + K̂_D) / C_KV · (1+δ) ⌉,
maximise δ ≥ 0 subject to m_P·n_P + m_D·n_D ≤ G and the role minimums.

Write a = W_P/(S·θ_P) and b = (K_D+K̂_D)/C_KV, the demands in instances. A pair (n_P, n_D)
supports every δ up to min(n_P/a, n_D/b) − 1, so the best δ is the best such value over the
budget-feasible integer pairs. When that best value is below zero, δ = 0 does not fit, and
the same pair is exactly the fallback the paper asks for: it minimises
max(a/n_P, b/n_D), the larger demand/capacity ratio. One enumeration answers both cases.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# The margin reported when neither role has any demand (δ is unbounded).
MAX_MARGIN = 100.0


@dataclass(frozen=True, slots=True)
class Allocation:
    prefill: int
    decode: int
    margin: float  # δ; negative when even δ = 0 does not fit the budget


def headroom(n_prefill: int, n_decode: int, a: float, b: float) -> float:
    """min(n_P/a, n_D/b): capacity over demand on the tighter side (∞ when no demand)."""
    p = math.inf if a <= 0 else n_prefill / a
    d = math.inf if b <= 0 else n_decode / b
    return min(p, d)


def margin_of(n_prefill: int, n_decode: int, a: float, b: float) -> float:
    h = headroom(n_prefill, n_decode, a, b)
    return MAX_MARGIN if h == math.inf else min(h - 1.0, MAX_MARGIN)


def solve(
    prefill_demand: float,
    decode_demand: float,
    *,
    budget: int,
    m_prefill: int = 1,
    m_decode: int = 1,
    min_prefill: int = 0,
    min_decode: int = 0,
    current_prefill: int | None = None,
) -> Allocation:
    """Eq. 1 and its infeasible fallback; demands in instances (a and b above).

    Among pairs with the same best headroom, the one nearest ``current_prefill`` wins (no
    switch for nothing), else the fewest prefill instances. Decode takes what prefill
    leaves, so the budget is used whole. Raises ValueError when the minimums do not fit.
    """
    a, b = max(prefill_demand, 0.0), max(decode_demand, 0.0)
    if min(m_prefill, m_decode) <= 0:
        raise ValueError("GPUs per instance must be positive")
    top = (budget - m_decode * min_decode) // m_prefill
    if top < min_prefill:
        raise ValueError(
            f"role minimums need {m_prefill * min_prefill + m_decode * min_decode} GPUs, "
            f"budget is {budget}"
        )
    best = -math.inf
    ties: list[int] = []
    for n_p in range(min_prefill, top + 1):
        n_d = (budget - m_prefill * n_p) // m_decode
        h = headroom(n_p, n_d, a, b)
        if ties and math.isclose(h, best, rel_tol=1e-9):
            ties.append(n_p)
        elif h > best:
            best, ties = h, [n_p]
    if current_prefill is not None:
        n_p = min(ties, key=lambda p: (abs(p - current_prefill), p))
    else:
        n_p = ties[0]
    n_d = (budget - m_prefill * n_p) // m_decode
    return Allocation(n_p, n_d, margin_of(n_p, n_d, a, b))


class PrefillSpeed:
    """θ_P: full-prompt tokens per busy instance-second over completed busy intervals (§4.2).

    A busy interval runs from the start of service on an idle instance until its prefill
    work drains; tokens and seconds then cover the same requests. The estimate is the
    ratio of sums over the last ``window`` intervals. With none yet it keeps the last valid
    value, and before any, the profiled one: idle time is never read as zero speed.
    """

    def __init__(self, *, profiled: float, window: int = 64, min_seconds: float = 0.05) -> None:
        self.profiled = profiled
        self._intervals: deque[tuple[float, float]] = deque(maxlen=window)
        self._min_seconds = min_seconds
        self._last_valid: float | None = None

    def add_interval(self, *, tokens: float, seconds: float) -> bool:
        """Record one completed busy interval; returns whether it was usable."""
        if not (seconds >= self._min_seconds and tokens > 0 and math.isfinite(tokens)):
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
