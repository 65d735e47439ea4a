"""The forecast's settings: the spec's ``forecast`` section and the statistics' priors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Policy = Literal["replaceOnReward", "fixedRate", "groupReplenish", "none"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ForecastConfig:
    horizon: float = 10.0
    tool_alpha: float = 0.1  # Eq. 10
    bias_correction: bool = True
    policy: Policy = "replaceOnReward"
    group_size: int = 1
    rate_per_second: float = 0.0
    window: int = 2048  # samples kept per duration class
    min_samples: int = 16  # before a finer class is trusted over its parent
    tool_min_samples: int = 4
    prior_reward_seconds: float = 30.0
    prior_startup_seconds: float = 5.0
    prior_tool_seconds: float = 5.0
    prior_decode_seconds: float = 20.0
    prior_first_prompt_tokens: float = 2048.0
    kv_per_token: float = 1.0  # κ_D(x) = kv_per_token · x, in KV token slots
    decode_chain: bool = True  # count decode -> tool -> ready returns within the horizon
