"""The webhook's parts that need no socket: dedupe window, clock estimate, auth, CLI helpers."""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass

import pytest
from conftest import make_spec
from hypothesis import given
from hypothesis import strategies as st

from prorsa.clusters import ClockOffset, ClusterRegistry
from prorsa.clusters.auth import normalize_token, token_matches
from prorsa.commands.ingest import format_decision, parse_listen
from prorsa.core.controller import Controller
from prorsa.core.dedupe import DedupeWindow
from prorsa_contract.bearer import bearer_token
from prorsa_contract.events import parse_events


def test_dedupe_window_counts_replays_and_forgets_the_oldest() -> None:
    w = DedupeWindow(capacity=3)
    assert [w.add(i) for i in ("a", "b", "a", "c")] == [True, True, False, True]
    w.add("d")  # evicts "a"
    assert len(w) == 3 and "a" not in w and "d" in w
    assert w.add("a") is True


@given(st.lists(st.text(min_size=1, max_size=300), max_size=400), st.integers(1, 50))
def test_dedupe_window_matches_a_reference_and_stays_bounded(ids: list[str], cap: int) -> None:
    w = DedupeWindow(capacity=cap)
    reference: deque[str] = deque(maxlen=cap)  # the last `cap` ids that were new
    for i in ids:
        new = i not in reference
        assert w.add(i) is new
        if new:
            reference.append(i)
        assert len(w) <= cap


@dataclass(frozen=True)
class Ev:
    id: str
    ts: float


def test_admit_splits_a_batch_into_new_replayed_and_superseded() -> None:
    w = DedupeWindow(capacity=4)
    batch = [Ev("a", 1), Ev("b", 2), Ev("a", 3), Ev("c", 0.5), Ev("d", 4)]
    fresh, replays, superseded = w.admit(batch, before=1.0)
    assert [e.id for e in fresh] == ["a", "b", "d"] and (replays, superseded) == (1, 1)
    fresh, replays, _ = w.admit([Ev(str(i), 5) for i in range(10)] + [Ev("d", 5)])
    assert len(fresh) == 10 and replays == 1  # "d" was still remembered mid-batch
    assert len(w) == 4  # trimmed back to capacity at the end of the batch


@given(st.lists(st.lists(st.sampled_from("abcdefghij"), max_size=8), max_size=30))
def test_admit_matches_a_reference_that_trims_at_batch_end(batches: list[list[str]]) -> None:
    w = DedupeWindow(capacity=5)
    remembered: list[str] = []
    for batch in batches:
        expected = []
        for i in batch:
            if i not in remembered:
                remembered.append(i)
                expected.append(i)
        remembered = remembered[-5:]
        fresh, replays, _ = w.admit([Ev(i, 0.0) for i in batch])
        assert [e.id for e in fresh] == expected
        assert replays == len(batch) - len(expected)
        assert len(w) <= 5


def test_forget_lets_a_failed_batch_apply_on_retry() -> None:
    w = DedupeWindow(capacity=10)
    assert w.add("x") and not w.add("x")
    w.forget(["x"])
    assert w.add("x")


def _clock(start: float = 1000.0) -> tuple[ClockOffset, list[float]]:
    now = [start]
    return ClockOffset(monotonic=lambda: now[0], wall=lambda: now[0] + 5e8), now


def test_clock_falls_back_to_the_server_wall_clock_before_any_batch() -> None:
    clock, _ = _clock()
    assert clock.offset is None and clock.skew() is None
    assert clock.trainer_now() == 1000.0 + 5e8


def test_clock_offset_is_the_least_delayed_batch_and_ignores_a_few_outliers() -> None:
    clock, now = _clock()
    trainer_minus_mono = 7e8  # the trainer's clock reads mono + 7e8
    rng = random.Random(1)
    for i in range(64):
        now[0] = 1000.0 + i
        delay = rng.uniform(0.0, 0.2) if i != 30 else 0.01  # buffering/network delays
        sent = now[0] - delay + trainer_minus_mono
        if i in (10, 40):
            sent += 3600.0  # a batch with bogus future timestamps
        clock.observe(received=now[0], trainer_sent=sent)
    now[0] = 2000.0
    assert clock.trainer_now() == pytest.approx(2000.0 + trainer_minus_mono, abs=0.05)
    assert clock.skew() == pytest.approx(trainer_minus_mono - 5e8, abs=0.05)


def test_clock_follows_a_trainer_clock_step_within_the_window() -> None:
    clock, now = _clock()
    for i in range(20):
        now[0] = 1000.0 + i
        clock.observe(received=now[0], trainer_sent=now[0])
    for i in range(80):  # the trainer's clock is stepped back by 30 s
        now[0] = 1020.0 + i
        clock.observe(received=now[0], trainer_sent=now[0] - 30.0)
    assert clock.trainer_now() == pytest.approx(now[0] - 30.0, abs=1e-6)


def test_bearer_parsing_and_constant_time_compare() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc  ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None
    assert bearer_token(None) is None
    token = normalize_token("abc\n")
    assert token == b"abc"
    assert token_matches("abc", token)
    assert not token_matches("abd", token)
    assert not token_matches("\ud800", token)  # not encodable: never equal
    assert not token_matches(None, token)
    with pytest.raises(ValueError):
        normalize_token("  \n")
    with pytest.raises(ValueError):
        normalize_token("two words")


def test_registry_epochs_strictly_increase() -> None:
    registry = ClusterRegistry()
    epochs = [
        registry.add(
            namespace="n", name=f"c{i}", token="t", controller=Controller(make_spec())
        ).epoch
        for i in range(5)
    ]
    assert epochs == sorted(set(epochs))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8787", ("127.0.0.1", 8787)),
        (":9000", ("127.0.0.1", 9000)),
        ("[::1]:0", ("::1", 0)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
    ],
)
def test_parse_listen(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize("text", ["8787", "host:port", "h:70000"])
def test_parse_listen_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_listen(text)


async def test_decision_line_shows_target_demand_and_live_trajectories() -> None:
    registry = ClusterRegistry()
    handle = registry.add(namespace="rl", name="c", token="t", controller=Controller(make_spec()))
    ids = itertools.count()
    events = parse_events(
        [
            {
                "id": f"e{next(ids)}",
                "ts": 100.0,
                "trajectory": f"t{i}",
                "type": "request_queued",
                "prompt_tokens": 20_000,
                "turn": 0,
            }
            for i in range(3)
        ]
    )
    await handle.apply(events, received=handle.clock.monotonic(), sent_at=100.0)
    decision = await handle.tick(101.0)
    line = format_decision(decision, handle)
    assert f"target {decision.target.prefill}P:{decision.target.decode}D" in line
    assert "prefill 60.0k tok (ready 60.0k)" in line
    assert "live 3: ready 3" in line
    assert "awaiting snapshot" in line
    assert decision.reason in line


def test_clock_ignores_a_minority_of_future_samples_as_it_does_late_ones() -> None:
    """Batches stamped an hour ahead (a broken clock) or an hour late (a stuck buffer),
    a few of each among honest ones: neither moves the estimate."""
    clock, now = _clock()
    truth = 7e8  # the trainer's clock reads mono + 7e8
    rng = random.Random(2)
    for i in range(40):
        now[0] = 1000.0 + i
        sent = now[0] - rng.uniform(0.0, 0.2) + truth
        if i % 8 == 3:
            sent += 3600.0
        elif i % 8 == 5:
            sent -= 3600.0
        clock.observe(received=now[0], trainer_sent=sent)
        if i >= 4:  # trusted from the fifth sample on
            assert clock.trainer_now() == pytest.approx(now[0] + truth, abs=0.25), i
    assert clock.trainer_now() == pytest.approx(now[0] + truth, abs=0.25)


def test_clock_is_trusted_only_from_its_fifth_sample() -> None:
    """One or two batches far ahead, first in the window: the present stays the server's
    own until five samples are in, and then the honest majority decides."""
    clock, now = _clock()
    wall = 5e8  # _clock's wall clock reads mono + 5e8
    for i in range(5):
        now[0] = 1000.0 + i
        ahead = 3500.0 if i < 2 else 0.0
        clock.observe(received=now[0], trainer_sent=now[0] + wall + ahead)
        if i < 4:
            assert not clock.trusted and clock.skew() is None
            assert clock.trainer_now() == now[0] + wall
    assert clock.trusted and clock.skew() == pytest.approx(0.0, abs=1e-6)


def test_a_window_emptied_by_silence_keeps_the_trusted_estimate_until_it_refills() -> None:
    clock, now = _clock()
    for i in range(10):
        now[0] = 1000.0 + i
        clock.observe(received=now[0], trainer_sent=now[0] + 7e8)
    now[0] += 600.0  # ten minutes of silence: every sample has aged out of the window
    for _ in range(4):
        now[0] += 1.0
        clock.observe(received=now[0], trainer_sent=now[0] + 7e8 + 3500.0)
        assert clock.trainer_now() == pytest.approx(now[0] + 7e8, abs=1e-6)


def test_clock_follows_a_forward_step_once_most_samples_agree() -> None:
    clock, now = _clock()
    for i in range(20):
        now[0] = 1000.0 + i
        clock.observe(received=now[0], trainer_sent=now[0])
    for i in range(25):  # the trainer's clock is stepped forward by 30 s
        now[0] = 1020.0 + i
        clock.observe(received=now[0], trainer_sent=now[0] + 30.0)
    assert clock.trainer_now() == pytest.approx(now[0] + 30.0, abs=1e-6)


async def test_decision_line_survives_a_time_no_clock_can_show() -> None:
    registry = ClusterRegistry()
    handle = registry.add(namespace="rl", name="c", token="t", controller=Controller(make_spec()))
    for at in (1e300, 1e18):  # OverflowError, OSError from time.localtime
        decision = await handle.tick(now=at)
        line = format_decision(decision, handle)
        assert line.startswith(f"at {at:g} "), line
