"""What a role switch costs and what it buys, in seconds of rollout time.

Eq. 1 says which split fits the forecast demand best; it does not say whether getting
there is worth it. A switch takes an instance away from its role while it drains, flips
(about 5 s, Appendix C) and is re-registered by the router, and it throws work away: a
prefill instance's prefix cache is flushed, so the trajectories it served recompute their
contexts, and decodes still running at the drain timeout are aborted and re-prefilled.
Fixed smoothing and hysteresis guard against that cost blindly, and what suits one
deployment (a prefix cache worth minutes of prefill) is far too slow for another (a
KV-bound decode side that needs the instance now). So the Controller prices each move.

Both sides are measured in seconds of wall time. A split (n_P, n_D) serves demand (a, b)
(instances, Eq. 1) at load ρ = max(a/n_P, b/n_D), so the rollout runs max(ρ, 1) times
slower than its demand. Moving one instance saves L·(1 − max(ρ', 1)/max(ρ, 1)) over the
payoff horizon L, and costs the switch's own duration at the slowdown of the split
without that instance, plus the prefill work it throws away (and that a move back would
throw away), spread over the prefill side.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

# Before any switch was measured, about 13 s: smg 1.13.0 (measured against the real binary,
# tests/test_smg_router.py) drops a worker relabelled ``draining`` ~6 s after the relabel
# (~1 s to see it, then a fixed 5 s drain) and the executor sees it gone within its 0.5 s
# poll; SGLang's flip takes ~5 s (Appendix C); smg registers the flipped worker ~2 s after
# the relabel back. The instance's own queue drains inside smg's drain: smg sends it no new
# request ~1 s after the relabel.
PRIOR_SWITCH_SECONDS = 13.0
# Before any decode -> prefill switch was measured: the share of the instance's decode KV
# still running at the drain timeout, aborted and prefilled again. Agentic turns of a few
# hundred tokens rarely outlast a 30 s drain (the simulator measures 2-5%); long reasoning
# decodes do, and the measurement replaces this after the first switches.
PRIOR_ABORT_SHARE = 0.1
EMA_WEIGHT = 0.3  # of a new measurement: a handful of switches sets the estimate
# Before the trainer's events say otherwise: the share of a turn's prefill and decode time
# spent decoding (see prorsa.core.measure.decode_share).
PRIOR_DECODE_SHARE = 0.5


def load_of(n_prefill: int, n_decode: int, a: float, b: float) -> float:
    """ρ = max(a/n_P, b/n_D): demand over capacity on the tighter side (∞ if a role is empty)."""
    p = 0.0 if a <= 0 else (math.inf if n_prefill <= 0 else a / n_prefill)
    d = 0.0 if b <= 0 else (math.inf if n_decode <= 0 else b / n_decode)
    return max(p, d)


@dataclass(frozen=True, slots=True, kw_only=True)
class Move:
    """One instance changing role, priced: the gain and cost of making it now."""

    instance: str
    src: str
    dst: str
    gain: float  # rollout seconds saved over the payoff horizon
    cost: float  # rollout seconds lost to the switch itself
    lost_tokens: float  # prefill tokens to recompute (flushed cache, aborted decodes)

    @property
    def worth_it(self) -> bool:
        return self.gain > self.cost

    def describe(self) -> str:
        return (
            f"{self.instance} {self.src}->{self.dst}: gains {self.gain:.0f}s over the "
            f"payoff horizon, costs {self.cost:.0f}s ({self.lost_tokens / 1e3:.0f}k tokens "
            "to recompute)"
        )


class SwitchCosts:
    """The measured cost of a switch: how long one takes and how much decode work it aborts.

    The executor reports when each switch ends (``Controller.record_switch``); the time
    from its Decision to that report is one switch's duration, drain and router included.
    Aborted decodes are read from the trainer's ``decode_finished`` events with
    ``finish: abort`` while a decode -> prefill switch is under way, as a share of the KV
    the instance was decoding when the switch began.
    """

    __slots__ = ("_aborted", "_open", "abort_share", "measured", "seconds")

    def __init__(self, *, prior_seconds: float = PRIOR_SWITCH_SECONDS) -> None:
        self.seconds = prior_seconds
        self.abort_share = PRIOR_ABORT_SHARE
        self.measured = 0
        # instance -> (started at, source role, decode KV at start)
        self._open: dict[str, tuple[float, str, float]] = {}
        self._aborted: dict[str, float] = {}

    def started(self, instance: str, *, at: float, src: str, kv_tokens: float) -> None:
        self._open[instance] = (at, src, kv_tokens)
        self._aborted[instance] = 0.0

    @property
    def in_progress(self) -> bool:
        return bool(self._open)

    def aborted(self, tokens: float) -> None:
        """Decode work aborted while switches run, charged to the decode -> prefill ones."""
        from_decode = [name for name, (_t, src, _kv) in self._open.items() if src == "decode"]
        for name in from_decode:
            self._aborted[name] += tokens / len(from_decode)

    def finished(self, instance: str, *, at: float) -> None:
        opened = self._open.pop(instance, None)
        aborted = self._aborted.pop(instance, 0.0)
        if opened is None:
            return
        start, src, kv = opened
        if at > start:
            self.seconds += EMA_WEIGHT * (at - start - self.seconds)
            self.measured += 1
        if src == "decode" and kv > 0:
            share = min(aborted / kv, 1.0)
            self.abort_share += EMA_WEIGHT * (share - self.abort_share)


@dataclass(frozen=True, slots=True, kw_only=True)
class Persistence:
    """How long a shift of demand lasts: the payoff horizon a move can count on.

    GRPO groups move through prefill, decode and tools in waves; when a wave turns before
    the instances chasing it have switched, every switch is lost twice over. The target
    split of Eq. 1 says which way demand leans; this measures how long it keeps leaning
    one way (an exponential mean of the runs of the same direction), and a move counts
    its gain over that long at most. Before any run has ended it says ``seconds`` (the
    prior). A value: :meth:`after` returns the next one, which the switch plan hands back.

    Two ends of a lean are not demand turning, and are not measured as such (issue 34):

    * The split followed it. The lean is read against the split in use, so a switch toward
      it ends it however long the demand goes on leaning: the run is a lower bound, and it
      only ever raises the estimate. Counted as a whole run, every move would shorten the
      payoff horizon of the next (the demo's fell from 30 s to 13 s within one phase, a
      switch's own duration, after which no move could pay).
    * A flicker. Smoothed demand that sits near the boundary between two splits crosses it
      back for a tick or two; a lean that comes back the same way within ``grace`` seconds
      (the caller passes the smoothing time, over which Eq. 1's demand moves) is the same
      run. A lean that stays away longer ended when it was first gone.
    """

    seconds: float
    toward: str | None = None
    since: float | None = None
    # When the lean of the open run was first seen gone (None: it is still there), and the
    # prefill instances in use at the previous tick (to tell a followed lean).
    gone: float | None = None
    prefill: int | None = None

    def after(
        self,
        now: float,
        *,
        toward: str | None,
        prefill: int | None = None,
        grace: float = 0.0,
    ) -> Persistence:
        """The measure once demand leans ``toward`` at ``now`` (None: it does not lean),
        with ``prefill`` instances in use (counting switches under way)."""
        followed = (
            self.prefill is not None
            and prefill is not None
            and (
                (self.toward == "prefill" and prefill > self.prefill)
                or (self.toward == "decode" and prefill < self.prefill)
            )
        )
        if toward == self.toward:
            return replace(self, gone=None, prefill=prefill)
        open_run = self.toward is not None and self.since is not None
        if open_run and toward is None and not followed:
            gone = now if self.gone is None else self.gone
            if now - gone < grace:  # a flicker, so far: the run stays open
                return replace(self, gone=gone, prefill=prefill)
        seconds = self.seconds
        if open_run and self.since is not None:
            end = now if self.gone is None else self.gone
            run = max(end - self.since, 0.0)
            if not followed or run > seconds:
                seconds += EMA_WEIGHT * (run - seconds)
        return Persistence(seconds=seconds, toward=toward, since=now, prefill=prefill)


@dataclass(frozen=True, slots=True, kw_only=True)
class Regret:
    """Wall seconds the current split has lost so far against one move toward the target.

    The forecast prices a move over the coming horizons; a sustained imbalance too small to
    pay for a switch within them still costs time every horizon it lasts. Each tick adds
    what the move would have saved since the last one (at the smoothed demand); the sum
    counts toward the move's gain, and starts over when the target's direction changes,
    when a move is made, or when the current split is the target. Noise that favours
    each direction in turn therefore never builds up, while a real shift does. A value:
    :meth:`after` returns the next one, which the switch plan hands back.
    """

    toward: str | None = None
    seconds: float = 0.0
    at: float | None = None

    def after(self, now: float, *, toward: str | None, rate: float) -> Regret:
        """Add ``rate`` (seconds saved per second) since the last tick, toward ``toward``."""
        dt = 0.0 if self.at is None else max(now - self.at, 0.0)
        seconds = self.seconds
        if toward != self.toward:
            seconds = 0.0
        if toward is not None and math.isfinite(rate):
            seconds = max(0.0, seconds + rate * dt)
        return Regret(toward=toward, seconds=seconds, at=now)

    def reset(self) -> Regret:
        """Start over (a move was made): nothing lost yet toward the same target."""
        return replace(self, seconds=0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Load:
    """What a split serves over the payoff horizon, in the units of Eq. 1.

    ``a`` and ``b`` are the prefill and decode demands in instances (b: the larger of the
    KV footprint and the decode step throughput in use). ``knees`` is the requests in
    decode per half-saturation knee, which sets how slow each decode step is, and
    ``decode_share`` the share of a turn's prefill and decode time spent decoding.
    """

    a: float
    b: float
    knees: float = 0.0
    decode_share: float = PRIOR_DECODE_SHARE
    # Prefill load no split lowers: prompts already queued at prefill engines stay there.
    pinned: float = 0.0
    # Prefill arrivals that recur (instances: ``a`` without the work drained once), which
    # make prompts queue below capacity, and the prefill instances in use when
    # ``decode_share`` was measured (it counts the queueing of that split); None: no
    # queueing below capacity is counted.
    recurring: float | None = None
    measured_prefill: int | None = None


def slowdown(n_prefill: int, n_decode: int, load: Load) -> float:
    """How much longer than its demand the rollout takes at this split (∞: a role is empty).

    Past capacity the tighter side sets the pace for everyone: max(ρ, 1). Within it, a
    turn is its prefill and its decode, and decode does not run at a fixed speed: a rank's
    step grows with its batch, about t₀·(1 + n/k) with k the half-saturation knee of
    ``capacity.decodeConcurrency``, so with r = n/k requests per knee spread over n_D
    instances every token takes (1 + r/n_D) lone steps. Spare decode instances therefore
    shorten every trajectory by the decode share of its turns, and a split left with one
    decode instance after a burst is seen as slow even though it "keeps up". Likewise a
    prompt queues at a busy prefill instance below capacity (:func:`prefill_wait`), so a
    prefill side 90% busy is slow at every turn.
    """
    rho = max(load_of(n_prefill, n_decode, load.a, load.b), load.pinned)
    # Without a profiled knee, the KV footprint stands in for the batch: a decode side
    # whose KV is full runs its largest, slowest steps.
    knees = load.knees if load.knees > 0 else load.b
    if math.isinf(rho) or (knees > 0 and n_decode <= 0):
        return math.inf
    step = 1.0 + (knees / n_decode if knees > 0 else 0.0)
    share = min(max(load.decode_share, 0.0), 1.0)
    return max(rho, 1.0) * ((1.0 - share) * prefill_wait(n_prefill, load) + share * step)


def _queued_turn(busy: float) -> float:
    """A prompt's time at a prefill instance over its prefill time, at busy share ``busy``.

    The Pollaczek-Khinchine mean wait of an M/D/1 queue, W = u/(2(1 − u)) service times:
    prompts arrive as the trainer's independent trajectories send them (Poisson), and an
    instance prefills a prompt in a time its length sets (deterministic, §4 / θ_P). Busy
    shares past ``MAX_PREFILL_BUSY`` are read as it: there queueing is set by bursts that no
    average describes, and past capacity ρ sets the pace instead.
    """
    u = min(max(busy, 0.0), MAX_PREFILL_BUSY)
    return 1.0 + u / (2.0 * (1.0 - u))


def prefill_wait(n_prefill: int, load: Load) -> float:
    """The prefill part of a turn at ``n_prefill`` instances, relative to the split the
    turn's decode share was measured at (1 without ``load.recurring``).

    The decode share is measured from the trainer's trajectories, so it already holds the
    queueing of the split in use; another split's prefill part is that, times the ratio of
    the M/D/1 turn times (:func:`_queued_turn`) on the recurring arrivals. Work drained
    once (a burst of queued prompts, re-prefills after a weight update) is left out: it
    does not stay, and a split sized for it would be wrong once it has gone.
    """
    if load.recurring is None or n_prefill <= 0:
        return 1.0
    recurring = max(load.recurring, 0.0)
    measured = load.measured_prefill if load.measured_prefill else n_prefill
    return _queued_turn(recurring / n_prefill) / _queued_turn(recurring / measured)


def time_saved(before: float, after: float, *, seconds: float) -> float:
    """Wall seconds saved over ``seconds`` of wall time when the slowdown goes from
    ``before`` to ``after``: the rollout progresses at 1/slowdown of its demand."""
    if math.isinf(after):
        return -math.inf
    if math.isinf(before):
        return math.inf
    return seconds * (1.0 - after / before)


def window_demand(
    *,
    backlog: float,
    queued: float = 0.0,
    prefill_instances: int = 1,
    now: tuple[float, float],
    ahead: tuple[float, float],
    horizon: float,
    seconds: float,
    knees: float = 0.0,
    decode_share: float = PRIOR_DECODE_SHARE,
) -> Load:
    """The demand a split serves on average over the next ``seconds``.

    Prefill work that does not recur is drained once, so it is spread over the window
    rather than counted as a rate: a burst of ten horizons' work keeps a split that drains
    it within the window busy, not overloaded tenfold. Of it, ``backlog`` (instance-
    seconds: re-prefills about to be sent) goes wherever the router sends it, while
    ``queued`` (prompts already sent) stays with the ``prefill_instances`` holding it: an
    instance turning to prefill only takes new arrivals off their hands. Arrivals recur:
    the first horizon at this tick's forecast (``now``, without either), the rest at the
    demand expected to persist (``ahead``, smoothed and also without them).
    """
    span = max(seconds, horizon)
    first = min(horizon, span)
    rest = span - first
    queued = max(queued, 0.0)
    recurring = (now[0] * first + ahead[0] * rest) / span
    a = (queued + max(backlog, 0.0)) / span + recurring
    b = (now[1] * first + ahead[1] * rest) / span
    pinned = queued / (span * max(prefill_instances, 1))
    return Load(
        a=a,
        b=b,
        knees=knees,
        decode_share=decode_share,
        pinned=pinned,
        recurring=recurring,
        measured_prefill=max(prefill_instances, 1),
    )


def price_move(
    *,
    instance: str,
    src: str,
    current: tuple[int, int],
    demand: Load,
    payoff_seconds: float,
    switch_seconds: float,
    lost_tokens: float,
    return_tokens: float,
    prefill_seconds_per_token: float,
    regret: float = 0.0,
) -> Move:
    """Gain and cost of moving ``instance`` out of ``src`` (one instance, Eq. 1 units).

    ``demand`` is what the split serves on average over the payoff horizon
    (:func:`window_demand`). Gain: wall seconds saved over that horizon once the switch is
    done. An overloaded split runs at 1/ρ of its demand, so the move saves the fraction
    1 − ρ'/ρ of the wall time, not ρ − ρ' times it.

    Cost: the switch's duration at the slowdown of the split without the instance, and the
    tokens to recompute as prefill instance-seconds shared by the prefill side after the
    move, in proportion to how busy that side is (spare prefill capacity absorbs them).
    Demand that moves back and forth is paid for twice, so the cost also counts the
    tokens a move back would throw away (``return_tokens``): a move must pay for the
    round trip within the payoff horizon. ``regret`` (see :class:`Regret`) is what not
    making the move has already cost, added to the gain.
    """
    p, d = current
    dst = "prefill" if src == "decode" else "decode"
    new = (p + 1, d - 1) if src == "decode" else (p - 1, d + 1)
    during = (p, d - 1) if src == "decode" else (p - 1, d)
    # The instance serves its new role only once the switch is done.
    accrues = max(payoff_seconds - switch_seconds, 0.0)
    now = slowdown(*current, demand)
    gain = time_saved(now, slowdown(*new, demand), seconds=accrues)
    if math.isnan(gain):
        gain = -math.inf
    gain += regret
    cost = -time_saved(now, slowdown(*during, demand), seconds=switch_seconds)
    n_p = new[0]
    lost = lost_tokens + return_tokens
    if lost > 0 and n_p > 0:
        busy = min(demand.a / n_p, 1.0)
        cost += lost * prefill_seconds_per_token / n_p * busy
    return Move(instance=instance, src=src, dst=dst, gain=gain, cost=cost, lost_tokens=lost)


class CycleProfile:
    """What each split would make of a training step: the step-scale target.

    An RL step is a cycle: each weight update flushes every prefix cache, so the live
    trajectories re-prefill their contexts in a burst that asks for most of the instances
    for a minute, and then the caches refill and prefill demand falls to a fraction of one
    instance while decode carries the step. Eq. 1 on the demand of the next minutes chases
    each phase: it moves instances to prefill into the burst and back once the caches are
    full again, paying a switch (and a flushed cache) each way, every step. The best static
    split is instead the one compromise that serves the whole cycle, and the foresight
    reference (``prorsa bench rollout``) rarely moves away from it.

    So the Controller keeps each tick's recurring load (arrivals, without work drained
    once) and the work drained once (re-prefill bursts, queued prompts), and once a weight
    update has closed a cycle it asks what every split would make of the next one
    (:meth:`totals`): the last cycle's calm ticks, each ``dt`` seconds at the split then in
    use stretched by the ratio of per-turn times (:func:`turn_time`), plus the largest
    burst, drained by the prefill side alone. The ratio form needs no absolute calibration.
    The run's start counts as a cycle start (the first prompts prefill from empty caches,
    as after an update).
    """

    __slots__ = ("_first", "_last", "_last_update", "_starts", "ticks")

    def __init__(self) -> None:
        # (time, seconds since the previous tick, recurring load, split in use, drained once)
        self.ticks: deque[tuple[float, float, Load, tuple[int, int], float]] = deque()
        self._starts: list[float] = []
        self._last: float | None = None
        self._last_update: float | None = None
        self._first: tuple[int, int] | None = None

    def begin(self, now: float, split: tuple[int, int]) -> None:
        """The run starts at ``now`` at ``split``, before any tick is recorded: a fresh
        cluster's first ticks, while the bootstrap brings it to its start split, are no
        part of the workload's cycle, but the run's start is the first cycle's start and
        the split the cluster is deployed at is its first split. No-op once started."""
        if not self._starts:
            self._starts.append(now)
            self._first = split

    def record(
        self,
        now: float,
        load: Load,
        current: tuple[int, int],
        *,
        drain: float,
        update_started: float | None,
        max_gap: float,
    ) -> None:
        """One tick: its recurring ``load`` at the split in use, the prefill work to drain
        once (instance-seconds), and the start of the trainer's latest weight update (a
        new one closes a cycle)."""
        if not self._starts:
            self._starts.append(now)
            self._first = current
        if update_started is not None and update_started != self._last_update:
            self._last_update = update_started
            if update_started > self._starts[-1]:
                self._starts.append(update_started)
        dt = 0.0 if self._last is None else min(max(now - self._last, 0.0), max_gap)
        self._last = now
        if dt > 0:
            self.ticks.append((now, dt, load, current, drain))
        del self._starts[: -(CYCLES + 1)]
        oldest = self._starts[0] if len(self._starts) > 1 else now - OPEN_CYCLE_SECONDS
        while self.ticks and self.ticks[0][0] <= oldest:
            self.ticks.popleft()

    @property
    def starts(self) -> tuple[float, ...]:
        """The cycle starts kept: the run's first tick, then each weight update's start."""
        return tuple(self._starts)

    @property
    def last(self) -> float | None:
        """The time of the latest tick recorded."""
        return self._last

    @property
    def last_update(self) -> float | None:
        """The start of the latest weight update seen."""
        return self._last_update

    def load(
        self,
        *,
        starts: Sequence[float],
        ticks: Sequence[tuple[float, float, Load, tuple[int, int], float]],
        last: float | None,
        last_update: float | None,
        first: tuple[int, int] | None,
    ) -> None:
        """Take over a profile saved by an earlier operator (:func:`restore_switching`)."""
        self._starts = list(starts)[-(CYCLES + 1) :]
        self.ticks = deque(sorted(ticks, key=lambda row: row[0]))
        self._last, self._last_update, self._first = last, last_update, first

    @property
    def first_split(self) -> tuple[int, int] | None:
        """The split in use at the first tick recorded (None: none yet)."""
        return self._first

    @property
    def after_update(self) -> bool:
        """Whether a whole cycle that began at a weight update has been seen: before, the
        ticks read hold no re-prefill burst, the one phase of a step that only more
        prefill instances serve. A step under way that has outlasted the closed ones
        counts: its burst is behind it, and it is read (:meth:`window`)."""
        return len(self._starts) > CYCLES or self.overdue

    @property
    def closed(self) -> bool:
        """Whether a weight update has closed the run's first cycle."""
        return len(self._starts) > 1

    @property
    def overdue(self) -> bool:
        """Whether the step under way has run longer than the closed steps on average.

        The target is read from the closed steps because a step under way is only part of
        a cycle; one that has outlasted them is not like them (a prefill side whose
        prefix caches thrash, say, makes a step many times longer), and holding the
        split they favoured would keep it so.
        """
        if len(self._starts) < 2 or self._last is None:
            return False
        mean = (self._starts[-1] - self._starts[0]) / (len(self._starts) - 1)
        return self._last - self._starts[-1] > mean

    def window(self, now: float, *, least: float) -> tuple[float, float] | None:
        """The ticks :meth:`totals` reads: the last ``CYCLES`` cycles weight updates
        closed (and the one under way once it is :attr:`overdue`), else the one under way
        once it is ``least`` seconds long, at most its last ``OPEN_CYCLE_SECONDS`` (a
        trainer that never updates its weights still sees its split follow a lasting
        shift of demand within minutes); None: neither."""
        if len(self._starts) >= 2:
            return self._starts[0], (now if self.overdue else self._starts[-1])
        if self._starts and now - self._starts[0] >= least:
            return max(self._starts[0], now - OPEN_CYCLE_SECONDS), now
        return None

    def totals(self, splits: Sequence[tuple[int, int]], window: tuple[float, float]) -> list[float]:
        """Seconds a cycle like ``window``'s would take at each split (∞: a split that
        leaves a role with demand empty)."""
        first, end = window
        length = end - first
        if length <= 0:
            return [0.0] * len(splits)
        # The largest burst since the window began (the one a weight update just started
        # included: its re-prefill is forecast at once), spread over the cycle: its
        # contexts come back for their next turns over minutes, not all at once.
        burst = max((drain for t, _dt, _l, _c, drain in self.ticks if t > first), default=0.0)
        # A step under way is taken to last at least OPEN_CYCLE_SECONDS / 2.
        closed = len(self._starts) > 1 and end == self._starts[-1]
        spread = burst / (length if closed else max(length, OPEN_CYCLE_SECONDS / 2))
        out = [0.0] * len(splits)
        for t, dt, load, cur, _drain in self.ticks:
            if not first < t <= end:
                continue
            both = replace(load, a=load.a + spread)
            base = turn_time(*cur, both)
            if not (math.isfinite(base) and base > 0):
                continue
            for i, split in enumerate(splits):
                out[i] += dt * turn_time(*split, both) / base
        return out


# The closed cycles (training steps) the step-scale target is read from: one step's
# calm phase can be short (a fast step) or long (the tail of a slow one).
CYCLES = 2
# Before the first weight update: how much of the cycle under way is read.
OPEN_CYCLE_SECONDS = 600.0
# A prefill side busier than this is read as this busy: queueing is then dominated by
# bursts no average describes.
MAX_PREFILL_BUSY = 0.9


def turn_time(n_prefill: int, n_decode: int, load: Load) -> float:
    """A turn's time at this split relative to its demand (∞: a role with demand is empty).

    :func:`slowdown`, with the prefill part of a turn waiting in its queue: at busy share
    u = a/n_P of the prefill side a prompt spends about 1/(1 − u) of its prefill time
    there (a single-server queue's response time), so a split whose prefill side "keeps
    up" at 90% is still slow at every turn.
    """
    base = slowdown(n_prefill, n_decode, load)
    if math.isinf(base) or n_prefill <= 0:
        return base
    busy = min(max(load.a, 0.0) / n_prefill, MAX_PREFILL_BUSY)
    share = min(max(load.decode_share, 0.0), 1.0)
    return base + base * (1.0 - share) * (1.0 / (1.0 - busy) - 1.0)


# -- the saved form ----------------------------------------------------------------------------
# What the switch plan learned, as JSON, so a restarted operator goes on from it. The
# forecaster's statistics are saved by prorsa.core.forecast.persist; this saves what the
# switch plan measured besides (issue 36: "the step-cycle profile and switch durations do
# not survive a restart"): how long a switch takes and how much decode work it aborts
# (SwitchCosts), how long demand keeps leaning one way (Persistence) and the training steps
# seen so far (CycleProfile). A new leader that restores them prices its first moves with
# measured durations and reads the step-scale target at once, instead of holding the split
# for two minutes to learn it again. Times are the trainer's clock, which a restart does not
# reset. What is read back is checked: a field that is missing, not a number or not finite
# raises ValueError naming it (the operator then starts from its priors and says so).

# The ticks of the cycle profile kept in the saved form, newest last: at a 10 s horizon,
# three training steps of ten minutes are 180 ticks.
MAX_SAVED_TICKS = 2000


def _number(data: dict[str, Any], key: str, where: str, *, optional: bool = False) -> Any:
    value = data.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"learned state: {where}.{key} must be a finite number, got {value!r}")
    return float(value)


def _section(data: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"learned state: {key} must be an object, got {type(value).__name__}")
    return value


def export_switching(
    *, costs: SwitchCosts, persistence: Persistence, cycle: CycleProfile
) -> dict[str, Any]:
    """The ``switching`` section of the learned state."""
    ticks = list(cycle.ticks)[-MAX_SAVED_TICKS:]
    first = cycle.first_split
    return {
        "switchSeconds": costs.seconds,
        "abortShare": costs.abort_share,
        "measuredSwitches": costs.measured,
        "persistenceSeconds": persistence.seconds,
        "cycle": {
            "starts": list(cycle.starts),
            "last": cycle.last,
            "lastUpdate": cycle.last_update,
            "first": list(first) if first is not None else None,
            # [at, dt, a, b, knees, decodeShare, pinned, nPrefill, nDecode, drain]
            "ticks": [
                [t, dt, ld.a, ld.b, ld.knees, ld.decode_share, ld.pinned, cur[0], cur[1], drain]
                for t, dt, ld, cur, drain in ticks
            ],
        },
    }


def restore_switching(
    data: dict[str, Any], *, costs: SwitchCosts, persistence: Persistence, cycle: CycleProfile
) -> Persistence:
    """Load :func:`export_switching` output; a state saved before it existed loads nothing.

    Everything is checked before anything is changed, so a bad section leaves the priors.
    Returns the persistence measure to go on from (``persistence`` when none was saved).
    """
    if not data:
        return persistence
    where = "switching"
    seconds = _number(data, "switchSeconds", where)
    abort = _number(data, "abortShare", where)
    measured = _number(data, "measuredSwitches", where)
    lasting = _number(data, "persistenceSeconds", where)
    if seconds <= 0 or not 0 <= abort <= 1 or measured < 0 or lasting <= 0:
        raise ValueError(
            f"learned state: {where} out of range (switchSeconds {seconds} > 0, abortShare "
            f"{abort} in [0, 1], measuredSwitches {measured} >= 0, persistenceSeconds "
            f"{lasting} > 0)"
        )
    saved = _section(data, "cycle")
    profile = _cycle(saved) if saved is not None else None
    costs.seconds, costs.abort_share, costs.measured = seconds, abort, int(measured)
    if profile is not None:
        cycle.load(**profile)
    return replace(persistence, seconds=lasting)


def _cycle(data: dict[str, Any]) -> dict[str, Any]:
    where = "switching.cycle"
    starts, ticks, first = data.get("starts"), data.get("ticks"), data.get("first")
    if not isinstance(starts, list) or not isinstance(ticks, list):
        raise ValueError(f"learned state: {where}.starts and .ticks must be lists")
    start_times = [_number({"start": s}, "start", where) for s in starts]
    split: tuple[int, int] | None = None
    if first is not None:
        if not (isinstance(first, list) and len(first) == 2):
            raise ValueError(f"learned state: {where}.first must be [prefill, decode]")
        split = (
            int(_number({"p": first[0]}, "p", where)),
            int(_number({"d": first[1]}, "d", where)),
        )
    rows: list[tuple[float, float, Load, tuple[int, int], float]] = []
    for i, row in enumerate(ticks):
        if not (isinstance(row, list) and len(row) == 10):
            raise ValueError(f"learned state: {where}.ticks[{i}] must hold 10 numbers")
        values = [_number({"v": v}, "v", f"{where}.ticks[{i}]") for v in row]
        at, dt, a, b, knees, share, pinned, n_p, n_d, drain = values
        load = Load(a=a, b=b, knees=knees, decode_share=share, pinned=pinned)
        rows.append((at, dt, load, (int(n_p), int(n_d)), drain))
    return {
        "starts": start_times,
        "ticks": rows,
        "last": _number(data, "last", where, optional=True),
        "last_update": _number(data, "lastUpdate", where, optional=True),
        "first": split,
    }
