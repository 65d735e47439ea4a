"""Eq. 1 and θ_P (§4.2): hand-computed cases and properties checked by brute force."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prorsa.core.allocate import MAX_MARGIN, headroom, keep_split, solve
from prorsa.core.estimators import DemandSmoother, PrefillSpeed, PrefixCacheHits


def test_eq1_hand_computed() -> None:
    # a = 2.5, b = 4.2 instances, G = 8: n_P -> min(n_P/2.5, (8-n_P)/4.2):
    # 1: .40, 2: .80, 3: min(1.20, 1.19) = 1.190, 4: min(1.6, .952) = .952 -> 3P:5D, δ = .1905
    alloc = solve(2.5, 4.2, budget=8, min_prefill=1, min_decode=1)
    assert (alloc.prefill, alloc.decode) == (3, 5)
    assert alloc.margin == pytest.approx(5 / 4.2 - 1)
    # Eq. 1 holds at that δ: ⌈2.5·1.1905⌉ = 3, ⌈4.2·1.1905⌉ = 5 (with float slack).
    d = alloc.margin - 1e-9
    assert math.ceil(2.5 * (1 + d)) == 3 and math.ceil(4.2 * (1 + d)) == 5


def test_eq1_infeasible_minimises_the_larger_ratio() -> None:
    # a = b = 6 on 8 instances: 4P:4D gives max(6/4, 6/4) = 1.5, the least possible.
    alloc = solve(6.0, 6.0, budget=8, min_prefill=1, min_decode=1)
    assert (alloc.prefill, alloc.decode) == (4, 4)
    assert alloc.margin == pytest.approx(4 / 6 - 1)  # negative: over budget


def test_eq1_different_instance_sizes() -> None:
    # m_P = 2, m_D = 1, G = 10, a = 2, b = 3: n_P=1 (n_D=8): .5; 2 (6): 1; 3 (4): 1.333;
    # 4 (2): .667 -> 3P:4D using all 10 GPUs, δ = 1/3.
    alloc = solve(2.0, 3.0, budget=10, m_prefill=2, m_decode=1, min_prefill=1, min_decode=1)
    assert (alloc.prefill, alloc.decode, round(alloc.margin, 6)) == (3, 4, round(1 / 3, 6))


def test_zero_demand_on_one_or_both_sides() -> None:
    only_decode = solve(0.0, 3.0, budget=8, min_prefill=1, min_decode=1)
    assert (only_decode.prefill, only_decode.decode) == (1, 7)
    only_prefill = solve(3.0, 0.0, budget=8, min_prefill=1, min_decode=2)
    assert (only_prefill.prefill, only_prefill.decode) == (6, 2)
    both = solve(0.0, 0.0, budget=8, min_prefill=1, min_decode=1, current_prefill=5)
    assert (both.prefill, both.margin) == (5, MAX_MARGIN)


def test_minimums_that_do_not_fit_are_an_error() -> None:
    with pytest.raises(ValueError, match="budget"):
        solve(1, 1, budget=4, m_prefill=2, m_decode=2, min_prefill=2, min_decode=1)


demand = st.floats(min_value=0, max_value=40, allow_nan=False)


@st.composite
def problems(draw):
    m_p = draw(st.integers(1, 3))
    m_d = draw(st.integers(1, 3))
    min_p = draw(st.integers(0, 3))
    min_d = draw(st.integers(0, 3))
    budget = draw(st.integers(m_p * min_p + m_d * min_d, 24))
    cur = draw(st.none() | st.integers(0, 12))
    return dict(
        budget=budget,
        m_prefill=m_p,
        m_decode=m_d,
        min_prefill=min_p,
        min_decode=min_d,
        current_prefill=cur,
    )


@settings(max_examples=300, deadline=None)
@given(a=demand, b=demand, p=problems())
def test_budget_and_minimums_always_hold(a, b, p) -> None:
    alloc = solve(a, b, **p)
    assert p["m_prefill"] * alloc.prefill + p["m_decode"] * alloc.decode <= p["budget"]
    assert alloc.prefill >= p["min_prefill"] and alloc.decode >= p["min_decode"]


@settings(max_examples=300, deadline=None)
@given(a=demand, b=demand, p=problems())
def test_margin_is_the_true_maximum(a, b, p) -> None:
    alloc = solve(a, b, **p)
    best = max(
        headroom(n_p, n_d, a, b)
        for n_p in range(p["min_prefill"], p["budget"] + 1)
        for n_d in range(p["min_decode"], p["budget"] + 1)
        if p["m_prefill"] * n_p + p["m_decode"] * n_d <= p["budget"]
    )
    got = headroom(alloc.prefill, alloc.decode, a, b)
    assert got == best or math.isclose(got, best, rel_tol=1e-9)
    if math.isfinite(best):
        assert alloc.margin == pytest.approx(min(best - 1, MAX_MARGIN))


@settings(max_examples=300, deadline=None)
@given(a=demand, extra=st.floats(0, 20), b=demand, p=problems())
def test_more_prefill_demand_never_lowers_prefill(a, extra, b, p) -> None:
    assert solve(a + extra, b, **p).prefill >= solve(a, b, **p).prefill


def test_prefill_speed_busy_intervals() -> None:
    theta = PrefillSpeed(profiled=20_000.0)
    assert theta.value == 20_000.0 and not theta.measured
    assert theta.add_interval(tokens=30_000, seconds=2.0)
    assert theta.add_interval(tokens=10_000, seconds=2.0)
    assert theta.value == pytest.approx(40_000 / 4.0)  # ratio of sums, not mean of ratios
    assert not theta.add_interval(tokens=0, seconds=5.0)  # idle: not zero speed
    assert not theta.add_interval(tokens=35, seconds=1.0)  # a probe: overheads, not speed
    assert theta.value == pytest.approx(10_000.0)


# -- planning: demand smoothing, keeping a split, the prefix-cache hit ratio ------------------


def test_demand_smoother_averages_with_exponential_weights() -> None:
    s, first = DemandSmoother(seconds=10.0).fold(0.0, 4.0, 2.0)
    assert first == (4.0, 2.0)  # the first tick is its own average
    # 10 s later the first tick weighs e^-1 = 0.3679 against 1 for the new one:
    # a = (0.3679·4 + 0) / (0.3679 + 1) = 1.0758, b = half of that.
    s, (a, b) = s.fold(10.0, 0.0, 0.0)
    assert a == pytest.approx(1.0758, abs=1e-4) and b == pytest.approx(0.5379, abs=1e-4)
    # A demand held long enough becomes the average.
    for t in range(20, 400, 10):
        s, (a, b) = s.fold(float(t), 3.0, 1.0)
    assert a == pytest.approx(3.0, abs=1e-6) and b == pytest.approx(1.0, abs=1e-6)


def test_demand_smoother_off_passes_each_tick_through() -> None:
    s = DemandSmoother(seconds=0.0)
    assert s.fold(0.0, 4.0, 2.0)[1] == (4.0, 2.0)
    assert s.fold(10.0, 0.5, 7.0)[1] == (0.5, 7.0)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="smoothing seconds"):
            DemandSmoother(seconds=bad)


def test_keep_split_holds_for_margin_or_small_gain_and_moves_otherwise() -> None:
    # a = 2, b = 2 on 8 instances: best 4P:4D, headroom 2 (margin 1).
    best = solve(2.0, 2.0, budget=8)
    assert (best.prefill, best.decode) == (4, 4)
    # 3P:5D covers both with headroom min(1.5, 2.5) = 1.5: margin 0.5 >= holdMargin 0.25.
    why = keep_split(best, (3, 5), 2.0, 2.0, hysteresis=0.5, hold_margin=0.25)
    assert "holdMargin" in why
    # Without the hold margin, best gains 2/1.5 - 1 = 33% < 50% hysteresis: still held.
    why = keep_split(best, (3, 5), 2.0, 2.0, hysteresis=0.5, hold_margin=0.0)
    assert "33%" in why and "hysteresis" in why
    # 1P:7D has headroom 0.5: the best split doubles it, worth a switch.
    assert keep_split(best, (1, 7), 2.0, 2.0, hysteresis=0.5, hold_margin=0.25) == ""


def test_prefix_cache_hits_compares_full_and_computed_tokens_over_a_window() -> None:
    hits = PrefixCacheHits(window=60.0)
    assert hits.miss_ratio(0.0) is None  # nothing seen yet
    hits.add_full(0.0, 10_000)
    assert hits.miss_ratio(0.0) is None  # the engines have not reported yet
    hits.add_computed(0.0, 1_000)
    assert hits.miss_ratio(0.0) == pytest.approx(0.1)  # 90% of prompt tokens were cached
    hits.add_full(50.0, 30_000)
    hits.add_computed(50.0, 30_000)  # a cache flush: these were computed whole
    assert hits.miss_ratio(50.0) == pytest.approx(31_000 / 40_000)
    # At 70 s the samples of time 0 have left the 60 s window.
    assert hits.miss_ratio(70.0) == pytest.approx(1.0)
    assert hits.miss_ratio(200.0) is None
