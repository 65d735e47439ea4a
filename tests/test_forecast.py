"""Appendix B, equation by equation, against arithmetic done by hand in each test."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prorsa.core.forecast.admission import predict_admissions
from prorsa.core.forecast.config import ForecastConfig
from prorsa.core.forecast.model import Forecaster, PrefillSite
from prorsa.core.forecast.stats import ClassedDistributions, EmaTable, EmpiricalDistribution, Prior
from prorsa.core.forecast.table import TrajectoryTable
from prorsa.core.forecast.view import DecodeBacklog, prefill_work

SITE = PrefillSite(names=("p0",), seconds_per_token=1e-3)  # θ_P = 1000 tokens/s


def setup(**config) -> tuple[Forecaster, TrajectoryTable]:
    f = Forecaster(ForecastConfig(**config))
    return f, TrajectoryTable(observer=f)


def rewards(log, table, durations, *, task="swe", accepted=None, start=0.0) -> None:
    """Complete one trajectory's reward per duration (reward_started -> _finished)."""
    for i, d in enumerate(durations):
        name = f"done-{task}-{i}-{start}"
        ok = True if accepted is None else accepted[i]
        log("sample_dispatched", name, start, task=task)
        log("reward_started", name, start)
        log("reward_finished", name, start + d, accepted=ok)
    table.apply(log.take())


# -- Eq. 2 and Eq. 6: the conditional completion probability ---------------------------------


def test_eq2_conditional_probability_and_residual() -> None:
    d = EmpiricalDistribution(window=100)
    for v in (10, 20, 30, 40):
        d.add(v)
    q, res = d.conditional(np.array([15.0, 25.0, 12.0]), 10.0)
    # e=15: alive {20,30,40}; ending in (15,25): {20}      -> q = 1/3, residual 20-15 = 5
    # e=25: alive {30,40};    ending in (25,35): {30}      -> q = 1/2, residual 5
    # e=12: alive {20,30,40}; ending in (12,22): {20}      -> q = 1/3, residual 8
    assert q == pytest.approx([1 / 3, 1 / 2, 1 / 3])
    assert res == pytest.approx([5.0, 5.0, 8.0])


def test_eq2_overdue_trajectory_uses_memoryless_tail() -> None:
    d = EmpiricalDistribution(window=100)
    for v in (10, 20, 30):
        d.add(v)  # mean 20
    q, _ = d.conditional(np.array([100.0]), 10.0)
    assert q[0] == pytest.approx(1 - math.exp(-10 / 20))


def test_classed_fallback_to_coarser_class() -> None:
    c = ClassedDistributions(window=100, min_samples=3, prior=Prior(50.0))
    for v in (1.0, 1.0, 1.0):
        c.add((1, "img-a", "gpu"), v)  # prewarm, image a: 3 samples, trusted
    c.add((1, "img-b", "gpu"), 9.0)  # image b: one sample only -> falls back
    assert c.mean((1, "img-a", "gpu")) == 1.0
    assert c.mean((1, "img-b", "gpu")) == pytest.approx((1 + 1 + 1 + 9) / 4)  # class (1,)
    assert c.mean((2, "img-a", "gpu")) == pytest.approx(3.0)  # nothing cold: global ()
    empty = ClassedDistributions(window=10, min_samples=3, prior=Prior(50.0))
    q, _ = empty.conditional((), np.array([0.0]), 10.0)
    assert q[0] == pytest.approx(1 - math.exp(-10 / 50))


def test_windows_bound_memory() -> None:
    d = EmpiricalDistribution(window=3)
    for v in (100, 1, 2, 3):
        d.add(v)
    assert len(d) == 3 and d.mean() == 2.0


# -- Eq. 9–10: the tool EMA -----------------------------------------------------------------


def test_eq10_tool_ema_update() -> None:
    ema = EmaTable(alpha=0.1, min_samples=1, prior=5.0)
    key = (0, 1, 1, 0)
    ema.update(key, 10.0)  # first sample seeds τ = 10
    ema.update(key, 20.0)  # τ = 0.9·10 + 0.1·20 = 11
    ema.update(key, 0.0)  # τ = 0.9·11 + 0 = 9.9
    assert ema.get(key) == pytest.approx(9.9)
    assert ema.get((0, 2, 1, 0)) == pytest.approx(9.9)  # unseen tool -> class (0,) has it
    assert EmaTable(alpha=0.1, min_samples=1, prior=5.0).get(key) == 5.0


# -- Eq. 3–5: the data sampler ---------------------------------------------------------------


def test_eq3_to_5_replace_on_reward(log) -> None:
    f, t = setup(horizon=10.0, policy="replaceOnReward", min_samples=1)
    rewards(log, t, [10, 20, 30, 40], accepted=[True, True, True, False])  # p̂ = 3/4
    # First prompts: 2000 tokens (one sample) -> x̂ = 2000.
    log("request_queued", "x", 0.0, prompt_tokens=2000, turn=0)
    log("trajectory_dropped", "x", 0.0)
    log("sample_dispatched", "r1", 0.0, task="swe")
    log("reward_started", "r1", 100.0)
    t.apply(log.take())
    out = f.forecast(t, now=115.0, site=SITE)  # e = 15 -> q = 1/3 (see Eq. 2 test)
    # d̂ = 0 (no dispatch delays seen) -> S_pw = 10; N_pass = 0.75·(1/3) = 0.25
    # W_samp = N_samp·x̂ = 0.25 · 2000 = 500
    assert out.launch_horizon == 10.0
    assert out.sampler_launches == pytest.approx(0.25)
    assert out.sampler == pytest.approx(500.0)


def test_eq5_shortened_launch_horizon(log) -> None:
    f, t = setup(horizon=10.0, min_samples=1)
    rewards(log, t, [10, 20, 30, 40])
    # One dispatch-to-first-request delay of 4 s -> d̂ = 4, S_pw = 6.
    log("sample_dispatched", "d", 0.0, task="swe")
    log("request_queued", "d", 4.0, prompt_tokens=2000, turn=0)
    log("trajectory_dropped", "d", 5.0)
    log("sample_dispatched", "r1", 0.0, task="swe")
    log("reward_started", "r1", 100.0)
    t.apply(log.take())
    out = f.forecast(t, now=112.0, site=SITE)
    # e = 12 over S_pw = 6: ending in (12, 18): none of {20,30,40} -> 0
    assert out.launch_horizon == 6.0
    assert out.sampler == 0.0
    # Over the full horizon it would have been 1/3 · 2000 (checked with d̂ = 0 above).
    f2, t2 = setup(horizon=4.0)
    log("sample_dispatched", "d", 0.0)
    log("request_queued", "d", 4.0, prompt_tokens=1, turn=0)
    t2.apply(log.take())
    assert f2.forecast(t2, now=10.0, site=SITE).launch_horizon == 0.0  # S_pw = max(0, 4-4)


def test_eq4_fixed_rate(log) -> None:
    f, t = setup(horizon=10.0, policy="fixedRate", rate_per_second=0.5)
    log("request_queued", "x", 0.0, prompt_tokens=3000, turn=0)
    log("trajectory_dropped", "x", 0.0)
    t.apply(log.take())
    out = f.forecast(t, now=1.0, site=SITE)
    # N_samp = 0.5/s · 10 s = 5 launches of x̂ = 3000 tokens
    assert out.sampler_launches == pytest.approx(5.0)
    assert out.sampler == pytest.approx(15000.0)


def test_eq4_group_replenish(log) -> None:
    f, t = setup(horizon=10.0, policy="groupReplenish", group_size=4, min_samples=1)
    rewards(log, t, [10, 20, 30, 40])
    log("request_queued", "x", 0.0, prompt_tokens=1000, turn=0)
    log("trajectory_dropped", "x", 0.0)
    # Group A: both live members in reward, e = 15 and 25 -> q = 1/3 and 1/2.
    # Group B: one member in reward, one still starting -> cannot complete (one-step).
    for name, group in (("a1", "A"), ("a2", "A"), ("b1", "B"), ("b2", "B")):
        log("sample_dispatched", name, 0.0, task="swe", group=group)
    log("reward_started", "a1", 100.0)
    log("reward_started", "a2", 90.0)
    log("reward_started", "b1", 100.0)
    t.apply(log.take())
    out = f.forecast(t, now=115.0, site=SITE)
    # P(group A completes) = 1/3 · 1/2 = 1/6 -> N_samp = 4 · 1/6; W = N_samp · 1000
    assert out.sampler_launches == pytest.approx(4 / 6)
    assert out.sampler == pytest.approx(4000 / 6)


# -- Eq. 6–7, 8, 11, 12 -------------------------------------------------------------------


def test_eq7_sandbox_startup(log) -> None:
    f, t = setup(horizon=10.0, min_samples=1)
    # Prewarm startups observed: 2, 4, 30 s (launch -> first request).
    for i, d in enumerate((2.0, 4.0, 30.0)):
        log("sandbox_started", f"s{i}", 0.0, mode="prewarm")
        log("request_queued", f"s{i}", d, prompt_tokens=100, turn=0)
        log("trajectory_dropped", f"s{i}", d)
    # Now starting: k1 elapsed 3 s (alive {4, 30}; in (3, 13): {4} -> q = 1/2), 5000 tokens.
    log("sample_dispatched", "k1", 50.0, prompt_tokens=5000)
    log("sandbox_started", "k1", 50.0, mode="prewarm")
    t.apply(log.take())
    out = f.forecast(t, now=53.0, site=SITE)
    assert out.startup == pytest.approx(0.5 * 5000)


def test_eq8_eq12_ready_and_inflight_are_observed_volumes(log) -> None:
    f, t = setup()
    log("request_queued", "a", 1.0, prompt_tokens=1000, turn=0)
    log("request_queued", "b", 1.0, prompt_tokens=3000, turn=0)
    log("request_queued", "c", 1.0, prompt_tokens=7000, turn=0)
    log("prefill_started", "c", 2.0, instance="p0")
    t.apply(log.take())
    out = f.forecast(t, now=2.0, site=SITE)
    assert (out.ready, out.inflight) == (4000.0, 7000.0)


def test_eq12_prompts_waiting_for_decode_room_are_decode_demand(log) -> None:
    """A streaming trainer behind a PD router keeps a request in prefill until its first
    token: with decode full, the prompts decode holds for KV room are the ones that have
    waited longest, as many as its waiting tokens cover; they leave W_P and Eq. 13-14."""
    f, t = setup()
    for name, sent, tokens in (("old", 1.0, 5000), ("older", 0.5, 3000), ("new", 9.0, 700)):
        log("request_queued", name, sent, prompt_tokens=tokens, turn=0)
        log("prefill_started", name, sent)
    t.apply(log.take())
    every = f.forecast(t, now=10.0, site=SITE)
    out = f.forecast(t, now=10.0, site=SITE, backlog=DecodeBacklog(requests=3, tokens=8000))
    assert every.inflight == 8700.0 and every.awaiting_decode == 0.0
    assert (out.inflight, out.awaiting_decode) == (700.0, 8000.0)
    assert out.prefill == pytest.approx(every.prefill - 8000.0)
    assert out.raw_admission == pytest.approx(700.0)
    # No more requests than decode holds, and none its waiting tokens do not cover.
    one = f.forecast(t, now=10.0, site=SITE, backlog=DecodeBacklog(requests=1, tokens=9e9))
    assert one.awaiting_decode == 3000.0
    part = f.forecast(t, now=10.0, site=SITE, backlog=DecodeBacklog(requests=3, tokens=7999))
    assert part.awaiting_decode == 3000.0


def test_eq11_tool_arrivals_within_horizon(log) -> None:
    f, t = setup(horizon=10.0, tool_min_samples=1)
    # Teach τ for bash: one observation of 12 s seeds the EMA at 12.
    log("request_queued", "teach", 0.0, prompt_tokens=100, turn=0)
    log("decode_finished", "teach", 0.0, output_tokens=0, finish="tool")
    log("tool_started", "teach", 0.0, tool="bash")
    log("tool_finished", "teach", 12.0)
    log("request_queued", "teach", 12.0, prompt_tokens=150, turn=1)  # growth 50
    log("trajectory_dropped", "teach", 13.0)
    # u1 in bash for 1 s: r = 12-1 = 11 >= 10: excluded. u2 for 5 s: r = 7 < 10: counted.
    # u3 finished its tool (r = 0) with a known 300-token result.
    for name, started in (("u1", 99.0), ("u2", 95.0), ("u3", 95.0)):
        log("request_queued", name, 90.0, prompt_tokens=1000, turn=0)
        log("decode_finished", name, 91.0, output_tokens=200, finish="tool")
        log("tool_started", name, started, tool="bash")
    log("tool_finished", "u3", 99.0, result_tokens=300)
    t.apply(log.take())
    out = f.forecast(t, now=100.0, site=SITE)
    # x̂(u2) = context 1200 + growth EMA 50 = 1250;
    # x̂(u3) = 1200 + 300 result + template overhead (none learned yet: 0) = 1500
    assert out.tool == pytest.approx(1250 + 1500)


# -- Eq. 13–14: decode admissions --------------------------------------------------------------


def one_idle_instance(**overrides: object) -> dict[str, object]:
    """Eq. 13 inputs: one idle instance at 1 ms per token, S = 10, no arrivals."""
    return {
        "now": 0.0,
        "horizon": 10.0,
        "instances": 1,
        "inflight_instance": np.empty(0, dtype=int),
        "inflight_finish": np.empty(0),
        "inflight_x": np.empty(0),
        "arrival_u": np.empty(0),
        "arrival_x": np.empty(0),
        "arrival_w": np.empty(0),
        "seconds_per_token": 1e-3,
    } | overrides


def test_eq13_serial_recurrence_by_hand() -> None:
    # θ = 1000 tok/s so g(x) = x/1000 s; two instances; now = 0; S = 10.
    # In flight: 2000 tokens on instance 0, finishing at 3 -> v = [3, 0]; counted (3 < 10).
    # Queue 4000 -> inst 1: b = 0+4 = 4 (v=[3,4]); 6000 -> inst 0: b = 3+6 = 9 (v=[9,4]);
    # 3000 -> inst 1: b = 4+3 = 7 (v=[9,7]). Arrivals by u: (u=1, 1000, w=.5) -> inst 1:
    # b = max(1,7) + .5 = 7.5, counts .5·1000; (u=8, 3000) -> inst 1: b = 8+3 = 11 >= 10.
    out = predict_admissions(
        now=0.0,
        horizon=10.0,
        instances=2,
        inflight_instance=np.array([0]),
        inflight_finish=np.array([3.0]),
        inflight_x=np.array([2000.0]),
        queued_x=np.array([4000.0, 6000.0, 3000.0]),
        arrival_u=np.array([8.0, 1.0]),
        arrival_x=np.array([3000.0, 1000.0]),
        arrival_w=np.array([1.0, 0.5]),
        seconds_per_token=1e-3,
    )
    assert out.tokens == pytest.approx(2000 + 4000 + 6000 + 3000 + 500)


def test_eq13_charges_each_request_its_computed_tokens_when_given() -> None:
    # One instance, 1 ms per token, S = 10. Queue: a 12k-token turn whose first 11k tokens
    # are cached (computes 1k: b = 1 s, admitted), then a 20k-token resend that computes
    # everything (b = 21 s, not). Charged full prompts (x / θ_P), the turn alone would take
    # 12 s and nothing would be admitted within the horizon.
    common = one_idle_instance()
    cached_turn_first = predict_admissions(
        queued_x=np.array([12_000.0, 20_000.0]),
        queued_work=np.array([1_000.0, 20_000.0]),
        arrival_work=np.empty(0),
        **common,  # type: ignore[arg-type]
    )
    assert (cached_turn_first.tokens, cached_turn_first.requests) == (12_000.0, 1.0)
    full_prompts = predict_admissions(queued_x=np.array([12_000.0, 20_000.0]), **common)  # type: ignore[arg-type]
    assert full_prompts.tokens == 0.0


def test_eq13_future_request_never_starts_before_it_arrives() -> None:
    out = predict_admissions(
        now=0.0,
        horizon=10.0,
        instances=1,
        inflight_instance=np.empty(0, dtype=int),
        inflight_finish=np.empty(0),
        inflight_x=np.empty(0),
        queued_x=np.empty(0),
        arrival_u=np.array([9.5]),
        arrival_x=np.array([1000.0]),  # g = 1 s: b = 10.5, outside
        arrival_w=np.array([1.0]),
        seconds_per_token=1e-3,
    )
    assert out.tokens == 0.0


def test_eq14_through_the_forecaster_routes_to_least_loaded(log) -> None:
    f, t = setup(horizon=10.0)
    log("request_queued", "a", 0.0, prompt_tokens=8000, turn=0)
    log("prefill_started", "a", 0.0, instance="p0")  # p0 busy until 8
    log("request_queued", "b", 0.0, prompt_tokens=5000, turn=0)  # -> p1 (idle): 0+5
    log("request_queued", "c", 0.0, prompt_tokens=6000, turn=0)  # -> p1 again: 5+6 = 11
    t.apply(log.take())
    site = PrefillSite(names=("p0", "p1"), seconds_per_token=1e-3)
    out = f.forecast(t, now=0.0, site=site)
    assert out.admission == pytest.approx(8000 + 5000)


# -- online correction and WAPE -----------------------------------------------------------------


def test_bias_correction_and_wape_from_observed_windows(log) -> None:
    f, t = setup(horizon=10.0, policy="fixedRate", rate_per_second=1.0)
    log("request_queued", "seed", 0.0, prompt_tokens=1000, turn=0)  # x̂ = 1000
    log("trajectory_dropped", "seed", 0.0)
    t.apply(log.take())
    # Each window predicts 10 launches of 1000 tokens = 10,000; actually 5 arrive (5,000).
    for w in range(4):
        start = 10.0 * w + 1
        out = f.forecast(t, now=start, site=SITE)
        f.accuracy.register(
            start=start,
            horizon=10.0,
            backlog=0.0,
            predicted_arrivals=out.raw_arrivals,
            predicted_prefill=out.prefill,
            predicted_admission_raw=0.0,
            predicted_admission=0.0,
        )
        for k in range(5):
            log("request_queued", f"w{w}-{k}", start + k, prompt_tokens=1000, turn=1)
            log("trajectory_dropped", f"w{w}-{k}", start + k)
        t.apply(log.take())
        f.accuracy.close_until(start + 10.0 + f.accuracy.grace_seconds)
    # Windows 1-3 are uncorrected: |10000 - 5000| each. Three scored windows give the factor
    # 5000/10000 = 0.5, so window 4 predicts 5000: error 0. WAPE = 15000 / 20000 = 0.75.
    assert f.accuracy.prefill_wape == pytest.approx(0.75)
    assert f.accuracy.arrival_factor == pytest.approx(0.5)
    corrected = f.forecast(t, now=100.0, site=SITE)
    assert corrected.sampler == pytest.approx(5000.0)  # 0.5 · 10,000


def test_decoding_trajectories_that_will_call_a_tool_count_as_arrivals(log) -> None:
    f, t = setup(horizon=10.0, min_samples=1, tool_min_samples=1)
    # History: decodes of 4 s ending in a tool call with 100 output tokens; tools of 2 s;
    # the next prompt grew by 50 tokens over the context.
    for i in range(3):
        name = f"h{i}"
        log("request_queued", name, 0.0, prompt_tokens=1000, turn=0)
        log("prefill_finished", name, 1.0)
        log("decode_finished", name, 5.0, output_tokens=100, finish="tool")
        log("tool_started", name, 5.0, tool="bash")
        log("tool_finished", name, 7.0)
        log("request_queued", name, 7.0, prompt_tokens=1150, turn=1)
        log("trajectory_dropped", name, 7.5)
    # Now: one trajectory decoding for 1 s (turn 0): it ends in 3 s, its tool takes 2 s:
    # back at +5 s < 10 s with P(tool) = 1 -> x̂ = 2000 + 100 output + 50 growth.
    log("request_queued", "live", 100.0, prompt_tokens=2000, turn=0)
    log("prefill_finished", "live", 101.0)
    t.apply(log.take())
    out = f.forecast(t, now=102.0, site=SITE)
    assert out.tool == pytest.approx(2150.0)
    off = Forecaster(ForecastConfig(horizon=10.0, decode_chain=False))
    assert off.config.decode_chain is False


def test_prefill_work_charges_attention_over_the_whole_prefix() -> None:
    # L = 40k: a token at position p costs 1 + p/40k. Recomputing a 60k context costs
    # 60k·(1 + 60k/80k) = 105k; a 1k turn on its cached 59k prefix 1k·(1 + 119k/80k).
    x = np.array([60_000.0, 60_000.0, 2_000.0])
    cached = np.array([0.0, 59_000.0, 0.0])
    work = prefill_work(x, cached, 40_000.0)
    assert work.tolist() == pytest.approx([105_000.0, 1_000 * (1 + 119 / 80), 2_050.0])
    assert prefill_work(x, cached, None).tolist() == [60_000.0, 1_000.0, 2_000.0]


def test_eq13_with_attention_dp_each_request_runs_on_one_rank() -> None:
    # One instance of 4 DP ranks at 1 ms per token for the instance: a rank takes 4 ms per
    # token. Four 2k prompts run side by side and end at 8 s (inside S = 10); a 4k prompt
    # queued behind them would end at 24 s. On one fast server they would end at 2, 4, 6
    # and 8 s, and the 4k one at 12 s.
    common = one_idle_instance(queued_x=np.array([2_000.0] * 4 + [4_000.0]))
    ranks = predict_admissions(ranks=4, **common)  # type: ignore[arg-type]
    assert (ranks.tokens, ranks.requests) == (8_000.0, 4.0)
    one = predict_admissions(**common)  # type: ignore[arg-type]
    assert (one.tokens, one.requests) == (8_000.0, 4.0)
    # An 8k prompt alone: 8 s on the whole instance, 32 s on the one rank it really gets.
    long = common | {"queued_x": np.array([8_000.0])}
    assert predict_admissions(**long).requests == 1.0  # type: ignore[arg-type]
    assert predict_admissions(ranks=4, **long).requests == 0.0  # type: ignore[arg-type]
    # A long in-flight prompt holds one rank of its instance; the others stay free.
    held = predict_admissions(
        ranks=4,
        **common
        | {
            "inflight_instance": np.array([0]),
            "inflight_finish": np.array([30.0]),
            "inflight_x": np.array([7_500.0]),
        },  # type: ignore[arg-type]
    )
    assert held.requests == 3.0  # three 2k prompts on the three free ranks; the rest wait


# -- a pending weight update (beyond the paper; §3.1's carried-over re-prefill) ---------------


def _decoding_and_ready(log, t: TrajectoryTable, *, ready_tokens: float) -> None:
    """Trajectory d decodes a 4,000-token context (prefilled: cached); r waits to prefill."""
    log("request_queued", "d", 0.0, prompt_tokens=4_000, turn=0)
    log("prefill_started", "d", 0.0, instance="p0")
    log("prefill_finished", "d", 1.0, instance="p0")
    log("request_queued", "r", 2.0, prompt_tokens=ready_tokens, turn=0)
    t.apply(log.take())


def test_pending_weight_update_forecasts_the_reprefill_of_live_contexts(log) -> None:
    f, t = setup(horizon=10.0)
    _decoding_and_ready(log, t, ready_tokens=1_000)
    log.cluster("weight_update_started", 2.0, version=1, expected_seconds=2.0)
    t.apply(log.take())
    site = PrefillSite(names=("p0",), seconds_per_token=1e-3, per_computed_token=True)
    out = f.forecast(t, now=2.0, site=site)
    # The update ends at 4: "d" is interrupted and re-prefills all 4,000 tokens (no cached
    # prefix survives the weights). Nothing prefills before 4: "r" runs 4 -> 5, "d" 5 -> 9,
    # both inside [2, 12), so both enter decode.
    assert out.reprefill == 4_000.0
    assert out.prefill == 1_000.0 + 4_000.0
    assert out.prefill_seconds == pytest.approx(5.0)
    assert out.admission == pytest.approx(5_000.0)
    # Once it finished the decoder is decoding again on the new weights: no re-prefill.
    log.cluster("weight_update_finished", 4.0, version=1, reprefill_trajectories=1)
    t.apply(log.take())
    assert f.forecast(t, now=4.0, site=site).reprefill == 0.0


def test_pending_weight_update_holds_the_ready_queue_until_it_ends(log) -> None:
    f, t = setup(horizon=10.0, decode_chain=False)
    _decoding_and_ready(log, t, ready_tokens=7_000)
    # Without an update the 7,000-token prompt prefills 2 -> 9: admitted within [2, 12).
    assert f.forecast(t, now=2.0, site=SITE).admission == pytest.approx(7_000.0)
    log.cluster("weight_update_started", 2.0, version=1, expected_seconds=4.0)
    t.apply(log.take())
    out = f.forecast(t, now=2.0, site=SITE)
    # The engines load weights until 6: the prompt prefills 6 -> 13, past the horizon.
    assert out.admission == 0.0 and out.reprefill == 4_000.0


def test_an_update_ending_past_the_horizon_brings_no_reprefill_into_it(log) -> None:
    f, t = setup(horizon=10.0)
    _decoding_and_ready(log, t, ready_tokens=1_000)
    log.cluster("weight_update_started", 2.0, version=1, expected_seconds=30.0)
    t.apply(log.take())
    out = f.forecast(t, now=2.0, site=SITE)
    assert out.reprefill == 0.0 and out.admission == 0.0


def test_an_unannounced_update_duration_is_taken_from_the_last_update(log) -> None:
    f, t = setup(horizon=10.0)
    log.cluster("weight_update_started", 0.0, version=1)
    log.cluster("weight_update_finished", 9.0, version=1, reprefill_trajectories=0)
    _decoding_and_ready(log, t, ready_tokens=1_000)
    log.cluster("weight_update_started", 20.0, version=2)
    t.apply(log.take())
    assert t.weight_update.expected_end(now=21.0) == 29.0
    # Ends at 29 (>= 21 + 10 - g): "r" prefills 29 -> 30 and "d" 30 -> 34, both in the
    # horizon [21, 31) for prefill demand, only "r" admitted.
    out = f.forecast(t, now=21.0, site=SITE)
    assert out.reprefill == 4_000.0
    assert out.admission == pytest.approx(1_000.0)


def test_an_update_never_finished_is_given_up_on(log) -> None:
    f, t = setup(horizon=10.0)
    _decoding_and_ready(log, t, ready_tokens=1_000)
    log.cluster("weight_update_started", 2.0, version=1, expected_seconds=5.0)
    t.apply(log.take())
    assert f.forecast(t, now=500.0, site=SITE).reprefill == 4_000.0  # overdue: any moment
    # Ten minutes on (the trainer crashed mid-update), the forecast stops waiting.
    late = f.forecast(t, now=700.0, site=SITE)
    assert late.reprefill == 0.0 and t.weight_update.pending


@pytest.mark.parametrize(("decode_seconds", "share"), [(0.4, 0.04), (4.0, 0.4), (30.0, 1.0)])
def test_admissions_hold_decode_kv_for_the_share_of_the_horizon_they_decode(
    log, decode_seconds: float, share: float
) -> None:
    # Eq. 13-14 count every prompt admitted within the 10 s horizon as decode KV for the
    # whole of it. A tool call's decode of a few tokens holds it for its decode time:
    # prompts that decode next are counted at E[min(T_dec, S)] / S of the horizon.
    f, t = setup(horizon=10.0, min_samples=1)
    for i in range(4):  # the history: decodes of ``decode_seconds`` ending in a tool call
        name = f"h{i}"
        log("request_queued", name, 0.0, prompt_tokens=1000, turn=0)
        log("prefill_finished", name, 1.0)
        log("decode_finished", name, 1.0 + decode_seconds, output_tokens=10, finish="tool")
        log("trajectory_dropped", name, 50.0)
    log("request_queued", "next", 99.0, prompt_tokens=2000, turn=0)  # it decodes next
    t.apply(log.take())
    out = f.forecast(t, now=100.0, site=SITE)
    assert out.decode_residence == pytest.approx(share)
    assert out.admission_kv > 0  # Eq. 14's K̂_D itself is as the paper has it
