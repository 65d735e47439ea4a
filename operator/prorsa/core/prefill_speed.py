"""θ_P as a tick uses it (§4.2): full-prompt tokens per instance-second, and where it comes from.

§4.2 counts W_P and θ_P in full prompt tokens, cached prefixes included. The best reading
is the profiled speed of computed tokens over the measured prefix-cache miss ratio
(θ_P = θ_uncached / (1 − h), :class:`PrefixCacheHits`), whenever both the trainer and the
agents report prefills. Without agents that count computed tokens, the busy intervals of
§4.2 stand in: from the trainer's events when any was measured (they count full prompts),
else from the agents' busy-time counters (they count only what the cache did not serve).
Before any, the profiled speed.

The meter learns at two points only: from each engine reading the Controller observes
(:meth:`PrefillSpeedMeter.observe_engine`), and once per tick when the prefills counted
since the last one are folded into the hit-ratio window (:meth:`PrefillSpeedMeter.fold`),
which returns the tick's :class:`PrefillReading`. Reading that value changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from prorsa.core.estimators import PrefillSpeed, PrefixCacheHits
from prorsa_contract.agent_api import EngineState

MIN_MISS_RATIO = 0.02  # θ_P is never read as more than 50× the uncached speed


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillReading:
    """θ_P at one tick and what it was read from."""

    theta: float  # full-prompt tokens per instance-second
    miss_ratio: float | None  # the prefix-cache miss ratio behind it; None: not measured
    # Eq. 13's per-request g over the profiled speed of computed tokens, from the same
    # window; None until the agents count computed tokens.
    calibration: float | None
    recomputed: float  # see Diagnostics.recomputed_tokens


class PrefillSpeedMeter:
    """θ_P's estimators and the prefill counters they are fed from, between ticks."""

    def __init__(self, *, profiled: float, hit_window: float) -> None:
        # θ_P from trainer events counts full prompts, as §4.2 asks; the agents' counters
        # count only tokens not served from the prefix cache, so they are the fallback.
        self.events = PrefillSpeed(profiled=profiled)
        self.engines = PrefillSpeed(profiled=profiled)
        self.cache_hits = PrefixCacheHits(window=hit_window)
        self._busy: dict[str, tuple[float, int]] = {}  # instance -> (busy s, tokens)
        self._computed: dict[str, int] = {}  # instance -> agent's uncached-token counter
        self._computed_new = 0
        self._computed_total = 0.0  # every uncached token the agents counted
        self._recomputed = 0.0
        self._prefilled_seen = 0.0
        self._expected_seen = 0.0

    def follow(self, *, profiled: float, hit_window: float) -> None:
        """An edited spec's profiled speed and hit-ratio window; what was measured stays."""
        self.events.profiled = self.engines.profiled = profiled
        self.cache_hits.window = hit_window

    @property
    def busy(self) -> PrefillSpeed:
        """θ_P from completed busy intervals: from events when any was measured, else engines."""
        return self.events if self.events.measured else self.engines

    def observe_engine(self, s: EngineState) -> None:
        """One agent's cumulative counters: a busy interval when two readings bound one
        (§4.2), and the uncached tokens it computed since its last reading."""
        prev = self._busy.get(s.instance)
        cur = (s.prefill_busy_seconds, s.prefill_tokens)
        if prev is None or cur[0] < prev[0] or cur[1] < prev[1]:
            self._busy[s.instance] = cur  # first reading, or the engine restarted
        else:
            busy, tokens = cur[0] - prev[0], cur[1] - prev[1]
            if busy >= 1.0 and s.waiting_requests == 0:
                self.engines.add_interval(tokens=tokens, seconds=busy)
                self._busy[s.instance] = cur
        last = self._computed.get(s.instance)
        self._computed[s.instance] = s.prefill_tokens
        if last is not None and s.prefill_tokens >= last:  # a smaller one: agent restarted
            self._computed_new += s.prefill_tokens - last

    def fold(self, now: float, *, prefilled: float, expected: float) -> PrefillReading:
        """Fold the prefills counted since the last tick into the hit-ratio window and read
        θ_P. ``prefilled``: the full-prompt tokens whose prefill the trainer reported so
        far; ``expected``: the trajectory table's estimate of the tokens computed for them
        (both cumulative, from the forecaster)."""
        hits = self.cache_hits
        hits.add_full(now, prefilled - self._prefilled_seen)
        self._prefilled_seen = prefilled
        hits.add_computed(now, self._computed_new)
        self._computed_total += self._computed_new
        self._computed_new = 0
        # Never less than before: agents and trainer events report the same prefill at
        # slightly different times, and a counter must not go back.
        self._recomputed = max(self._recomputed, self._computed_total - expected)
        hits.add_expected(now, expected - self._expected_seen)
        self._expected_seen = expected
        calibration = hits.calibration(now)
        miss = hits.miss_ratio(now)
        if miss is not None:
            theta = self.events.profiled / max(miss, MIN_MISS_RATIO)
        else:
            theta = self.busy.value
        return PrefillReading(
            theta=theta, miss_ratio=miss, calibration=calibration, recomputed=self._recomputed
        )
