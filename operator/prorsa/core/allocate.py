"""§4.2: the Eq. 1 allocation, and when to keep the current split instead.

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


def keep_split(
    best: Allocation,
    current: tuple[int, int],
    a: float,
    b: float,
    *,
    hysteresis: float,
    hold_margin: float,
) -> str:
    """Why the current split should stay ("" when moving to ``best`` is worth a switch).

    A switch drains and aborts requests and flushes the instance's prefix cache, so the
    current split is kept while it covers both demands with ``hold_margin`` to spare, or
    while the best split's headroom beats it by less than ``hysteresis`` (relative).
    """
    cur_p, cur_d = current
    now_h = headroom(cur_p, cur_d, a, b)
    if hold_margin > 0 and now_h >= 1.0 + hold_margin:
        return (
            f"holding {cur_p}P:{cur_d}D: it covers demand with margin "
            f"{min(now_h - 1.0, MAX_MARGIN):.2f} (>= holdMargin {hold_margin:.2f})"
        )
    best_h = headroom(best.prefill, best.decode, a, b)
    if best_h <= now_h * (1.0 + hysteresis):
        gain = (best_h / now_h - 1.0) if now_h > 0 and math.isfinite(best_h) else 0.0
        return (
            f"holding {cur_p}P:{cur_d}D: best split gains {gain:.0%} headroom "
            f"(< {hysteresis:.0%} hysteresis)"
        )
    return ""
