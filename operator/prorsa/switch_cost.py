"""What a role switch costs and what it buys, in seconds of rollout time.

Eq. 1 says which split fits the forecast demand best; it does not say whether getting
there is worth it. A switch takes an instance away from its role while it drains, flips
(about 5 s, Appendix C) and is re-registered by the router, and it throws work away: a
prefill instance's prefix cache is flushed, so the trajectories it served recompute their
contexts, and decodes still running at the drain timeout are aborted and re-prefilled.
Fixed smoothing and hysteresis guard against that cost blindly, and what suits one
deployment (a prefix cache worth minutes of prefill) is far too slow for another (a
KV-bound decode side that needs the instance now). So the Controller prices each move.

Both sides are measured in seconds of rollout time. A split (n_P, n_D) serves demand
(a, b) (instances, Eq. 1) at load ρ = max(a/n_P, b/n_D): demand arriving over L seconds
takes L·max(ρ, 1) seconds to serve. Moving one instance gains L·(max(ρ, 1) − max(ρ', 1))
over the payoff horizon L, and costs the switch's own duration at the load of the split
without that instance plus the prefill work it throws away, spread over the prefill side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Before any switch was measured: the drain of a busy instance (half the default 30 s
# timeout), SGLang's flip (~5 s, Appendix C) and smg's fixed 5 s drain of a worker.
PRIOR_SWITCH_SECONDS = 25.0
# Before any decode -> prefill switch was measured: the share of the instance's running
# decode KV that is still running at the drain timeout and must be re-prefilled.
PRIOR_ABORT_SHARE = 0.25
EMA_WEIGHT = 0.3  # of a new measurement: a handful of switches sets the estimate


def load(n_prefill: int, n_decode: int, a: float, b: float) -> float:
    """ρ = max(a/n_P, b/n_D): demand over capacity on the tighter side (∞ if a role is empty)."""
    p = 0.0 if a <= 0 else (math.inf if n_prefill <= 0 else a / n_prefill)
    d = 0.0 if b <= 0 else (math.inf if n_decode <= 0 else b / n_decode)
    return max(p, d)


def serve_seconds(n_prefill: int, n_decode: int, a: float, b: float, *, seconds: float) -> float:
    """Wall seconds to serve the demand of ``seconds`` at this split (never below it)."""
    rho = load(n_prefill, n_decode, a, b)
    return math.inf if math.isinf(rho) else seconds * max(rho, 1.0)


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


def price_move(
    *,
    instance: str,
    src: str,
    current: tuple[int, int],
    now_demand: tuple[float, float],
    ahead_demand: tuple[float, float],
    horizon: float,
    payoff_seconds: float,
    switch_seconds: float,
    lost_tokens: float,
    prefill_seconds_per_token: float,
) -> Move:
    """Gain and cost of moving ``instance`` out of ``src`` (one instance, Eq. 1 units).

    The first horizon is served at this tick's forecast (``now_demand``); the rest of the
    payoff horizon at the demand expected to persist (``ahead_demand``, smoothed). The
    switch costs its duration at the split without the instance, and the recomputed tokens
    as prefill instance-seconds shared by the prefill side after the move, in proportion
    to how busy that side is (spare prefill capacity absorbs them).
    """
    p, d = current
    dst = "prefill" if src == "decode" else "decode"
    new = (p + 1, d - 1) if src == "decode" else (p - 1, d + 1)
    during = (p, d - 1) if src == "decode" else (p - 1, d)
    a0, b0 = now_demand
    a1, b1 = ahead_demand
    first = min(horizon, payoff_seconds)
    rest = max(payoff_seconds - first, 0.0)

    def span(split: tuple[int, int]) -> float:
        return serve_seconds(*split, a0, b0, seconds=first) + serve_seconds(
            *split, a1, b1, seconds=rest
        )

    before, after = span(current), span(new)
    gain = before - after if math.isfinite(before) else math.inf
    if not math.isfinite(after):
        gain = -math.inf
    a_worst, b_worst = max(a0, a1), max(b0, b1)
    held = serve_seconds(*during, a_worst, b_worst, seconds=switch_seconds)
    base = serve_seconds(*current, a_worst, b_worst, seconds=switch_seconds)
    cost = (held - base) if math.isfinite(held) else math.inf
    n_p = new[0]
    if lost_tokens > 0 and n_p > 0:
        busy = min(a_worst / n_p, 1.0)
        cost += lost_tokens * prefill_seconds_per_token / n_p * busy
    return Move(instance=instance, src=src, dst=dst, gain=gain, cost=cost, lost_tokens=lost_tokens)
