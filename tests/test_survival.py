"""The decode-duration survival estimate: censoring, truncation, marks, fallback, edges."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prorsa.core.forecast.config import ForecastConfig
from prorsa.core.forecast.model import Forecaster, PrefillSite
from prorsa.core.forecast.stats import EmpiricalDistribution, Prior
from prorsa.core.forecast.survival import ClassedSurvival, SurvivalWindow
from prorsa.core.forecast.table import TrajectoryTable

MEDIAN = 100.0  # seconds: the true median of every synthetic lognormal here
KEY = (0, 1)


def lognormal(rng: np.random.Generator, n: int, sigma: float = 0.6) -> np.ndarray:
    return MEDIAN * np.exp(rng.normal(0.0, sigma, n))


def replay(
    est: ClassedSurvival, starts: np.ndarray, durations: np.ndarray, *, until: float, tick: float
) -> EmpiricalDistribution:
    """Feed a stream of decodes tick by tick, as the Forecaster does: at each tick the
    running ones (censored), between ticks the completions. Returns the completed-only
    empirical distribution over the same window, for comparison."""
    done = EmpiricalDistribution(window=est._window)
    ends = starts + durations
    order = np.argsort(ends)
    j = 0
    for now in np.arange(0.0, until + tick, tick):
        while j < len(order) and ends[order[j]] <= now:
            est.add(KEY, float(durations[order[j]]))
            done.add(float(durations[order[j]]))
            j += 1
        running = (starts <= now) & (ends > now)
        est.observe_running(float(now), {KEY: now - starts[running]})
    return done


def test_censoring_corrects_the_short_bias_of_a_step_that_has_just_begun() -> None:
    # A rollout step: 2000 decodes start within the first 20 s; at 120 s about 40% of
    # them are still running, the longest of the lognormal.
    rng = np.random.default_rng(1)
    starts = rng.uniform(0.0, 20.0, 2000)
    est = ClassedSurvival(window=4096, min_samples=16, prior=Prior(20.0))
    done = replay(est, starts, lognormal(rng, 2000), until=120.0, tick=10.0)
    done._refresh()
    completed_median = float(np.median(done._sorted))
    assert completed_median < 0.8 * MEDIAN  # completed-only: biased short by > 20%
    assert est.median(KEY) == pytest.approx(MEDIAN, rel=0.10)


def test_steady_stream_with_a_full_window_is_not_biased_by_the_running_ones() -> None:
    # Decodes start steadily for 3000 s; the window keeps the last 512 completions only,
    # while ~300 run at any time. Left truncation at the window's oldest completion keeps
    # the running ones from pulling the estimate long (or evicted ones from biasing it).
    rng = np.random.default_rng(2)
    starts = np.sort(rng.uniform(0.0, 3000.0, 9000))
    est = ClassedSurvival(window=512, min_samples=16, prior=Prior(20.0))
    replay(est, starts, lognormal(rng, 9000), until=3000.0, tick=10.0)
    assert len(est.lookup(KEY)) == 512
    assert est.lookup(KEY).running > 200
    assert est.median(KEY) == pytest.approx(MEDIAN, rel=0.10)


def test_conditional_probability_is_lower_for_a_long_running_decode() -> None:
    # Completed-only data would say a decode running 150 s is almost surely ending soon;
    # with the long ones still running counted, it is not.
    rng = np.random.default_rng(3)
    starts = rng.uniform(0.0, 20.0, 2000)
    est = ClassedSurvival(window=4096, min_samples=16, prior=Prior(20.0))
    done = replay(est, starts, lognormal(rng, 2000), until=160.0, tick=10.0)
    e = np.array([150.0])
    q_km, _ = est.conditional(KEY, e, 10.0)
    q_emp, _ = done.conditional(e, 10.0)
    # True hazard of a lognormal(100 s, 0.6) over [150, 160): about 0.12.
    d = math.log(MEDIAN)
    cdf = [0.5 * math.erfc(-(math.log(t) - d) / (0.6 * math.sqrt(2))) for t in (150.0, 160.0)]
    truth = (cdf[1] - cdf[0]) / (1 - cdf[0])
    assert q_km[0] == pytest.approx(truth, abs=0.04)
    assert q_emp[0] > 2 * truth


def test_marked_incidence_follows_elapsed_time() -> None:
    # Short decodes end in tool calls, long ones in final answers: a decode running 120 s
    # may well end soon, but not in a tool call; of those running 2 s, all that end within
    # the window (35 of 100) end in one.
    est = ClassedSurvival(window=4096, min_samples=4, prior=Prior(20.0))
    for d in np.linspace(5.0, 15.0, 50):
        est.add(KEY, float(d), marked=True)
    for d in np.linspace(100.0, 200.0, 50):
        est.add(KEY, float(d), marked=False)
    est.observe_running(1000.0, {})
    q_tool, res = est.conditional(KEY, np.array([2.0, 120.0]), 10.0, marked=True)
    q_any, _ = est.conditional(KEY, np.array([2.0, 120.0]), 10.0)
    assert q_tool[0] == pytest.approx(0.35, abs=0.02) == q_any[0]
    assert q_tool[1] == pytest.approx(0.0, abs=1e-9) and q_any[1] > 0.1
    assert 3.0 < res[0] < 10.0  # the tool calls end between 5 and 12 s


def test_fallback_to_coarser_class_until_the_fine_one_has_enough_completions() -> None:
    est = ClassedSurvival(window=1024, min_samples=16, prior=Prior(20.0))
    for _ in range(40):
        est.add((0, 1), 10.0)  # a fast class feeds (0,) and () too
    for _ in range(5):
        est.add((0, 2), 300.0)
    est.observe_running(0.0, {})
    assert est.median((0, 2)) == pytest.approx(10.0)  # 5 < 16: the parent answers
    for _ in range(20):
        est.add((0, 2), 300.0)
    assert est.median((0, 2)) == pytest.approx(300.0)
    assert est.median((7, 1)) == pytest.approx(10.0)  # unknown task: the root answers


def test_no_data_answers_with_the_prior() -> None:
    est = ClassedSurvival(window=64, min_samples=4, prior=Prior(20.0), prior_mark_share=0.5)
    q, res = est.conditional(KEY, np.array([0.0, 50.0]), 10.0)
    assert q == pytest.approx(1 - math.exp(-0.5))
    assert res == pytest.approx(5.0)
    q_tool, _ = est.conditional(KEY, np.array([0.0]), 10.0, marked=True)
    assert q_tool == pytest.approx(0.5 * (1 - math.exp(-0.5)))


def test_all_censored_gives_a_small_finite_chance_that_falls_as_they_keep_running() -> None:
    est = ClassedSurvival(window=64, min_samples=4, prior=Prior(20.0))
    prior_q = 1 - math.exp(-0.5)
    est.observe_running(30.0, {KEY: np.full(100, 30.0)})
    q30, _ = est.conditional(KEY, np.array([30.0]), 10.0)
    est.observe_running(90.0, {KEY: np.full(100, 90.0)})
    q90, _ = est.conditional(KEY, np.array([90.0]), 10.0)
    assert 0.0 < q90[0] < q30[0] < prior_q


def test_overdue_decode_past_every_completion_keeps_a_nonzero_chance() -> None:
    w = SurvivalWindow(window=64, prior=Prior(20.0))
    for d in (10.0, 20.0, 30.0):
        w.add(d)
    q, res = w.conditional(np.array([45.0]), 10.0)
    assert 0.0 < q[0] < 1.0 and 0.0 < res[0] < 10.0


def test_running_decodes_beyond_the_window_are_thinned_with_weights() -> None:
    w = SurvivalWindow(window=100, prior=Prior(20.0))
    for d in range(1, 51):
        w.add(float(d))
    ages = np.linspace(0.0, 80.0, 10_000)
    w.set_running(ages, now=0.0)
    assert w.running <= 100
    full = SurvivalWindow(window=20_000, prior=Prior(20.0))
    for d in range(1, 51):
        full.add(float(d))
    full.set_running(ages, now=0.0)
    assert w.median() == pytest.approx(full.median(), rel=0.05)


def test_export_and_restore_round_trip_marks_and_accept_plain_durations() -> None:
    a = ClassedSurvival(window=64, min_samples=1, prior=Prior(20.0))
    a.add(KEY, 5.0, marked=True)
    a.add(KEY, 50.0)
    b = ClassedSurvival(window=64, min_samples=1, prior=Prior(20.0))
    b.restore([(k, [list(v) for v in vs]) for k, vs in a.export()])
    b.restore([((1,), [7.0, 8.0])])  # the format ClassedDistributions wrote
    assert b.median(KEY) == a.median(KEY)
    q, _ = b.conditional(KEY, np.array([0.0]), 10.0, marked=True)
    assert q == pytest.approx(0.5)
    assert len(b.lookup((1,))) == 2
    ring = SurvivalWindow(window=3, prior=Prior(20.0))
    for d in (1.0, 2.0, 3.0, 4.0, 5.0):
        ring.add(d)
    assert ring.export() == [[3.0, 0.0], [4.0, 0.0], [5.0, 0.0]]  # the last 3, oldest first


def test_forecaster_counts_its_decoding_trajectories_as_censored(log) -> None:
    f = Forecaster(ForecastConfig(horizon=10.0, min_samples=1, tool_min_samples=1))
    table = TrajectoryTable(observer=f)
    for i in range(3):
        log("request_queued", f"live{i}", 0.0, prompt_tokens=1000, turn=0)
        log("prefill_finished", f"live{i}", 1.0)
    table.apply(log.take())
    f.forecast(table, now=61.0, site=PrefillSite(names=("p0",), seconds_per_token=1e-3))
    dist = f.decode_time.lookup((table.tasks.code(""), 0))
    assert dist is not None and dist.running == 3 and len(dist) == 0
