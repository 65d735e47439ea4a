"""What the Controller saw at one tick, handed out with the Decision it explains.

The operator's metrics and ``GET .../status`` read these figures from another task than
the one that ticks. A frozen snapshot taken at the end of the tick, carried by the frozen
Decision, keeps every figure consistent with the decision it explains, with no lock and
no attributes of the Controller read halfway through the next tick. The idea follows
NVIDIA Dynamo's planner, whose effects carry their diagnostics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prorsa.core.forecast.model import ForecastResult
from prorsa.core.switch_cost import Move


@dataclass(frozen=True, kw_only=True)
class Diagnostics:
    # a and b of Eq. 1 at this tick, in instances, before and after smoothing.
    demand: tuple[float, float]
    planned: tuple[float, float]
    cache_floor: float  # prefill instances the live contexts need cached
    decode_share: float  # of a turn's prefill and decode time, averaged over the payoff
    kv_now: float  # K_D: decode KV tokens in use
    miss_ratio: float | None  # prefix-cache miss ratio behind θ_P, when measured
    calibration: float | None  # Eq. 13's per-request g over the profiled speed
    moves: tuple[Move, ...]  # every move priced, made or not
    # The moves of this Decision's switches, in their order: what each was expected to
    # save and to cost (the operator counts them when it makes, or recommends, them).
    made: tuple[Move, ...]
    best: tuple[int, int]  # Eq. 1's best split (prefill, decode), before holds and pricing
    forecast: ForecastResult | None  # None in reactive mode
    prefill_wape: float | None
    decode_wape: float | None
    trajectories: Mapping[str, int]  # live trajectories per lifecycle state
    anomalies: Mapping[str, int]  # trainer-event anomalies per kind, since start
    last_event_ts: float | None  # trainer clock of the newest event applied
    # Outcomes, for the operator's metrics. Cumulative figures count since the
    # Controller was made; the operator exports them as counters.
    generated_tokens: int = 0  # output tokens of every decode_finished applied
    prefill_waiting: int = 0  # prompts queued whose prefill has not ended
    prefill_oldest_wait: float = 0.0  # seconds the oldest of them has waited
    decode_waiting: int = 0  # requests queued on decode engines (waiting for KV room)
    # Prefill tokens the engines computed beyond what each prompt needed past its cached
    # prefix (its previous turn's context): contexts computed again.
    recomputed_tokens: float = 0.0
    # Seconds from Eq. 1's best split leaning away from the split in use to the first
    # switch toward it, at the tick that made that switch (None at every other tick).
    decision_seconds: float | None = None

    @property
    def cache_hit_ratio(self) -> float | None:
        return None if self.miss_ratio is None else 1.0 - self.miss_ratio
