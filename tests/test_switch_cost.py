"""Switch pricing: what a role switch buys and costs, in seconds of rollout time."""

from __future__ import annotations

import math

from prorsa.core.switch_cost import Persistence, Regret, SwitchCosts, load, price_move, slowdown


def price(current, now, ahead=None, *, lost=0.0, back=0.0, src="decode", switch=20.0):
    return price_move(
        instance="e",
        src=src,
        current=current,
        now_demand=now,
        ahead_demand=ahead or now,
        horizon=10.0,
        payoff_seconds=300.0,
        switch_seconds=switch,
        lost_tokens=lost,
        return_tokens=back,
        prefill_seconds_per_token=1e-4,
    )


def test_a_split_that_serves_its_demand_gains_little_from_a_switch() -> None:
    assert load(4, 4, 2.0, 1.0) < 1.0
    assert slowdown(4, 4, 2.0, 1.0) == 1.0 + 0.5 * 0.25  # decode steps at a quarter load
    move = price((4, 4), (2.0, 1.0), src="decode", lost=1_000_000)
    assert move.gain < 0 and not move.worth_it  # prefill has spare room, decode does not


def test_moving_toward_the_short_side_saves_the_wall_time_its_load_says() -> None:
    # Decode short: b = 6 on 4 (slowdown 1.5 + 0.5); 3P:5D serves it at 1.2 + 0.5.
    move = price((4, 4), (2.0, 6.0), src="prefill")
    # The instance serves decode once its 20 s switch is done: 280 s of the 300.
    assert math.isclose(move.gain, 280.0 * (1.0 - 1.7 / 2.0))
    assert move.worth_it
    # The other way makes decode shorter still.
    assert price((4, 4), (2.0, 6.0), src="decode").gain < 0


def test_flushed_cache_and_a_move_back_can_outweigh_the_gain() -> None:
    cheap = price((4, 4), (3.5, 5.0), src="prefill")
    dear = price((4, 4), (3.5, 5.0), src="prefill", lost=20_000_000)
    round_trip = price((4, 4), (3.5, 5.0), src="prefill", back=20_000_000)
    assert cheap.worth_it
    assert dear.cost > cheap.cost and not dear.worth_it
    assert not round_trip.worth_it, "what a move back would flush counts too"
    # Prefill that would run at full load after the move pays for every lost token.
    busy = price((4, 4), (3.0, 5.0), src="prefill", lost=1_000_000)
    assert math.isclose(busy.cost - price((4, 4), (3.0, 5.0), src="prefill").cost, 100.0 / 3)


def test_a_spike_pays_only_for_the_horizon_it_lasts() -> None:
    spike = price((2, 6), (4.0, 1.0), ahead=(1.0, 1.0), lost=2_000_000, switch=5.0)
    sustained = price((2, 6), (4.0, 1.0), ahead=(4.0, 1.0), lost=2_000_000, switch=5.0)
    assert not spike.worth_it and sustained.worth_it


def test_regret_builds_up_under_a_sustained_lean_and_not_under_noise() -> None:
    steady, noisy = Regret(), Regret()
    for k in range(30):
        now = 10.0 * k
        steady.update(now, toward="prefill", rate=0.1)
        noisy.update(now, toward="prefill" if k % 2 else "decode", rate=0.1)
    assert math.isclose(steady.seconds, 29 * 10.0 * 0.1)
    assert noisy.seconds <= 1.0
    steady.update(300.0, toward=None, rate=0.0)
    assert steady.seconds == 0.0


def test_persistence_measures_how_long_demand_leans_one_way() -> None:
    p = Persistence(prior=300.0)
    assert p.seconds == 300.0
    t = 0.0
    for k in range(40):  # the lean turns every 60 s
        for _ in range(6):
            p.update(t, toward="prefill" if k % 2 else "decode")
            t += 10.0
    assert math.isclose(p.seconds, 60.0, rel_tol=0.05)


def test_measured_switches_replace_the_prior() -> None:
    costs = SwitchCosts(prior_seconds=25.0)
    for k in range(10):
        costs.started(f"e{k}", at=100.0 * k, src="decode", kv_tokens=1_000_000)
        costs.aborted(500_000)
        costs.finished(f"e{k}", at=100.0 * k + 8.0)
    assert costs.measured == 10
    assert math.isclose(costs.seconds, 8.0, rel_tol=0.1)
    assert math.isclose(costs.abort_share, 0.5, rel_tol=0.05)
    # A switch the executor never started is not a measurement.
    costs.finished("unknown", at=5.0)
    assert costs.measured == 10
