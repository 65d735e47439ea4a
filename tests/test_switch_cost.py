"""Switch pricing: what a role switch buys and costs, in seconds of rollout time."""

from __future__ import annotations

import math

import pytest

from prorsa.core.switch_cost import (
    Load,
    Persistence,
    Regret,
    SwitchCosts,
    load_of,
    price_move,
    slowdown,
    window_demand,
)


def price(
    current,
    now,
    ahead=None,
    *,
    lost=0.0,
    back=0.0,
    src="decode",
    switch=20.0,
    backlog=0.0,
    queued=0.0,
    knees=0.0,
    share=0.5,
):
    demand = window_demand(
        backlog=backlog,
        queued=queued,
        prefill_instances=current[0],
        now=now,
        ahead=ahead or now,
        horizon=10.0,
        seconds=300.0,
        knees=knees,
        decode_share=share,
    )
    return price_move(
        instance="e",
        src=src,
        current=current,
        demand=demand,
        payoff_seconds=300.0,
        switch_seconds=switch,
        lost_tokens=lost,
        return_tokens=back,
        prefill_seconds_per_token=1e-4,
    )


def test_a_split_that_serves_its_demand_gains_little_from_a_switch() -> None:
    assert load_of(4, 4, 2.0, 1.0) < 1.0
    # Two knees of requests on four decode instances: every token takes 1.5 lone steps,
    # and half of a turn is decoding.
    assert slowdown(4, 4, Load(a=2.0, b=1.0, knees=2.0, decode_share=0.5)) == 1.25
    move = price((4, 4), (2.0, 1.0), src="decode", lost=1_000_000, knees=2.0)
    assert move.gain < 0 and not move.worth_it  # prefill has spare room, decode does not


def test_moving_toward_the_short_side_saves_the_wall_time_its_load_says() -> None:
    # Decode KV short: b = 6 on 4 (load 1.5); 3P:5D serves it at load 1.2. With no knee
    # profiled, the KV footprint stands in for the batch: every token takes 1 + 6/4 lone
    # steps on four decode instances, 1 + 6/5 on five, over half of each turn. The other
    # half, prefill, queues longer on three instances 2/3 busy than on four half busy: an
    # M/D/1 turn of 1 + u/(2(1 - u)) prefill times, 2 against 1.5.
    move = price((4, 4), (2.0, 6.0), src="prefill")
    before, after = 1.5 * (0.5 + 0.5 * 2.5), 1.2 * (0.5 * 2.0 / 1.5 + 0.5 * 2.2)
    # The instance serves decode once its 20 s switch is done: 280 s of the 300.
    assert math.isclose(move.gain, 280.0 * (1.0 - after / before))
    assert move.worth_it
    # The other way makes decode shorter still.
    assert price((4, 4), (2.0, 6.0), src="decode").gain < 0


def test_decode_step_speed_counts_by_the_share_of_a_turn_spent_decoding() -> None:
    # Prefill a little over capacity (2.2 on 2), 12 knees of requests on 6 decode
    # instances. Long reasoning decodes (share 0.95) lose more from a slower decode step
    # than they gain from prefill; agentic turns that mostly prefill (share 0.3) gain.
    reasoning = price((2, 6), (2.2, 1.0), knees=12.0, share=0.95, src="decode")
    agentic = price((2, 6), (2.2, 1.0), knees=12.0, share=0.3, src="decode")
    assert reasoning.gain < 0 < agentic.gain


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


def test_a_burst_is_drained_once_not_counted_as_a_rate() -> None:
    # 400 prefill instance-seconds of re-prefills about to be sent (40 horizons of work at
    # once) with arrivals of 0.5 instance: two prefill instances drain it within the
    # 300 s payoff horizon, so taking a decode instance away buys nothing.
    load = window_demand(backlog=400.0, now=(0.5, 4.0), ahead=(0.5, 4.0), horizon=10, seconds=300)
    assert math.isclose(load.a, 0.5 + 400.0 / 300.0) and load.b == 4.0
    assert not price((2, 6), (0.5, 4.0), backlog=400.0, src="decode").worth_it
    # Counted as a rate (a = 40.5 every horizon) the same burst looked like a 20x overload.
    assert price((2, 6), (40.5, 4.0), src="decode").worth_it
    # A burst the prefill side cannot drain within the horizon still pays for a move.
    assert price((2, 6), (0.5, 1.0), backlog=1_500.0, src="decode").worth_it


def test_prompts_already_queued_at_prefill_engines_do_not_follow_a_new_instance() -> None:
    # The same 1,500 instance-seconds, but already sent to the two prefill engines: the
    # router will not move them, so a third prefill instance only takes new arrivals.
    routed = price((2, 6), (0.5, 1.0), queued=1_500.0, src="decode")
    unrouted = price((2, 6), (0.5, 1.0), backlog=1_500.0, src="decode")
    assert routed.gain < unrouted.gain / 3
    # With no new arrivals to take, the move buys nothing at all.
    idle = price((2, 6), (0.0, 1.0), queued=1_500.0, src="decode")
    assert idle.gain <= 0 and not idle.worth_it


def test_regret_builds_up_under_a_sustained_lean_and_not_under_noise() -> None:
    steady, noisy = Regret(), Regret()
    for k in range(30):
        now = 10.0 * k
        steady = steady.after(now, toward="prefill", rate=0.1)
        noisy = noisy.after(now, toward="prefill" if k % 2 else "decode", rate=0.1)
    assert math.isclose(steady.seconds, 29 * 10.0 * 0.1)
    assert noisy.seconds <= 1.0
    steady = steady.after(300.0, toward=None, rate=0.0)
    assert steady.seconds == 0.0


def test_persistence_measures_how_long_demand_leans_one_way() -> None:
    p = Persistence(seconds=300.0)
    assert p.seconds == 300.0
    t = 0.0
    for k in range(40):  # the lean turns every 60 s
        for _ in range(6):
            p = p.after(t, toward="prefill" if k % 2 else "decode")
            t += 10.0
    assert math.isclose(p.seconds, 60.0, rel_tol=0.05)


def test_a_lean_the_split_follows_does_not_shorten_the_payoff_horizon() -> None:
    # Demand leans to prefill for 8 s; the Controller then moves an instance (2P -> 3P)
    # and the lean, read against the split in use, is gone. The demand did not turn: the
    # 8 s are a lower bound on how long it leans, not a run that ended (issue 34: counted
    # as one, four such moves took the demo's payoff horizon from 30 s to 13 s).
    p = Persistence(seconds=30.0)
    for t in range(9):
        p = p.after(float(t), toward="prefill", prefill=2)
    p = p.after(9.0, toward=None, prefill=3)
    assert p.seconds == 30.0
    # A run followed after longer than the estimate raises it.
    short = Persistence(seconds=5.0)
    for t in range(21):
        short = short.after(float(t), toward="prefill", prefill=2)
    short = short.after(21.0, toward=None, prefill=3)
    assert math.isclose(short.seconds, 5.0 + 0.3 * (21.0 - 5.0))


def test_a_lean_that_flickers_at_a_split_boundary_is_one_run_but_a_burst_ends() -> None:
    # Smoothed demand near the 2P:2D / 3P:1D boundary: Eq. 1 leans to prefill with a
    # one-tick gap every 8 s. Within the 5 s grace each gap is the same run.
    flicker = Persistence(seconds=30.0)
    for t in range(60):
        lean = None if t % 8 == 7 else "prefill"
        flicker = flicker.after(float(t), toward=lean, prefill=2, grace=5.0)
    assert flicker.seconds == 30.0
    # A burst that leans to prefill for 4 s and is then gone for longer than the grace is
    # a run of 4 s, however long the split it did not move stays put afterwards.
    burst = Persistence(seconds=30.0)
    for t in range(30):
        burst = burst.after(
            float(t), toward="prefill" if 10 <= t < 14 else None, prefill=1, grace=5.0
        )
    assert math.isclose(burst.seconds, 30.0 + 0.3 * (4.0 - 30.0))


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


def test_a_busy_prefill_side_buys_a_move_from_short_decodes() -> None:
    # A tools phase on 1P:3D: the prefill instance 90% busy with the agents' turns, and
    # decode holding 0.8 instances of KV for decodes of a few tokens. A prefill instance
    # that "keeps up" at 90% still queues each prompt for 4.5 prefill times (M/D/1); on two
    # instances 45% busy, for 0.4. Half of each turn is prefill: the move pays at once.
    busy = price((1, 3), (0.9, 0.8), src="decode", lost=50_000)
    assert busy.worth_it and busy.gain > 10 * busy.cost
    # The same decode side with the prefill instance 20% busy: nothing queues, and the move
    # only slows decode.
    idle = price((1, 3), (0.2, 0.8), src="decode", lost=50_000)
    assert not idle.worth_it
    # The other way round, a move that leaves the one prefill instance 90% busy loses.
    assert not price((2, 2), (0.9, 0.8), src="prefill").worth_it


def test_a_one_off_burst_of_prompts_does_not_buy_a_move_by_its_queue() -> None:
    # The same 1P:3D with the prefill instance 20% busy, and a burst of prompts about to be
    # sent that the instance drains in 180 s, within the payoff horizon. The burst is work
    # done once: spread over the horizon it keeps the instance 80% busy on average, but
    # once drained it is gone, so the split is priced on the 20% that stays.
    burst = price((1, 3), (0.2, 0.8), backlog=180.0, src="decode", lost=50_000)
    assert not burst.worth_it
    # Arriving as a rate instead (0.2 + 180/300 = 0.8 of an instance every horizon), the
    # same work keeps the instance 80% busy for good, and the move pays.
    rate = price((1, 3), (0.8, 0.8), src="decode", lost=50_000)
    assert rate.worth_it


def test_queueing_below_capacity_is_counted_against_the_split_the_share_was_measured_at() -> None:
    # The decode share is measured from the trajectories at the split in use, so that
    # split's prefill part is as measured; another split's is scaled by the ratio of M/D/1
    # turn times, 1 + u/(2(1 - u)): at u = 0.9 on one instance, 5.5; at 0.45 on two, 1.41.
    load = window_demand(backlog=0.0, now=(0.9, 0.8), ahead=(0.9, 0.8), horizon=10, seconds=300)
    assert load.recurring == pytest.approx(0.9) and load.measured_prefill == 1
    here = slowdown(1, 3, load)
    assert here == pytest.approx(0.5 + 0.5 * (1 + 0.8 / 3))
    there = slowdown(2, 2, load)
    wait = (1 + 0.45 / (2 * 0.55)) / (1 + 0.9 / (2 * 0.1))
    assert there == pytest.approx(0.5 * wait + 0.5 * (1 + 0.8 / 2))
    # A Load without recurring arrivals (the step-cycle profile's) counts no queueing.
    assert slowdown(2, 2, Load(a=0.9, b=0.8)) == pytest.approx(0.5 + 0.5 * 1.4)
