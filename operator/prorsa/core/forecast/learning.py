"""What the forecast learns from lifecycle facts: the duration and size statistics.

:class:`LifecycleStats` is the trajectory table's observer (:class:`~prorsa.core.forecast.
transitions.Observer`): the table tells it each fact as it becomes known (a sandbox took
this long to start, a tool call this long, a prompt grew by this much), and the demand
sources of Appendix B (:mod:`~prorsa.core.forecast.sources`) read what it learned.
"""

from __future__ import annotations

import math

from prorsa.core.forecast.accuracy import AccuracyTracker
from prorsa.core.forecast.config import ForecastConfig
from prorsa.core.forecast.stats import ClassedDistributions, EmaTable, Prior, WindowMean
from prorsa.core.forecast.survival import ClassedSurvival

# EMA weight of decode outcomes (share ending in a tool call, their output length): about
# the last 50 decodes of a task.
_OUTCOME_ALPHA = 0.02


class LifecycleStats:
    """Duration statistics (Eq. 2, 6, 9-10), first-prompt sizes, decode outcomes."""

    def __init__(self, config: ForecastConfig) -> None:
        c = self.config = config
        self.reward = ClassedDistributions(
            window=c.window, min_samples=c.min_samples, prior=Prior(c.prior_reward_seconds)
        )
        self.startup = ClassedDistributions(
            window=c.window, min_samples=c.min_samples, prior=Prior(c.prior_startup_seconds)
        )
        self.tool = EmaTable(
            alpha=c.tool_alpha, min_samples=c.tool_min_samples, prior=c.prior_tool_seconds
        )
        self.growth = EmaTable(alpha=c.tool_alpha, min_samples=c.tool_min_samples, prior=0.0)
        self.template = EmaTable(alpha=c.tool_alpha, min_samples=c.tool_min_samples, prior=0.0)
        # Decode durations and outcomes, for trajectories that will decode, call a tool and
        # come back within the horizon (an extension of Eq. 11 one step back). A survival
        # estimate: the decodes still running count as censored durations, else long
        # decodes (math final answers) would be under-represented.
        self.decode_time = ClassedSurvival(
            window=c.window, min_samples=c.min_samples, prior=Prior(c.prior_decode_seconds)
        )
        self.decode_outcome: dict[int, list[float]] = {}
        self.admit_rate = WindowMean(window=1024, default=1.0)  # p̂
        self.dispatch_delay = WindowMean(window=1024, default=0.0)  # d̂
        self.first_prompt: dict[int, WindowMean] = {}
        self.accuracy = AccuracyTracker()
        self.intervals: list[tuple[float, float]] = []  # completed prefill busy intervals
        # Full-prompt tokens whose prefill finished, cumulative: the Controller sets them
        # against the tokens the engines computed to measure the prefix-cache hit ratio.
        self.prefilled_tokens = 0.0
        self.prefilled_computed = 0.0  # the table's estimate of those not served from cache

    # -- Observer: facts from the table ----------------------------------------------------

    def on_startup(self, *, key: tuple[object, ...], seconds: float) -> None:
        self.startup.add(key, seconds)

    def on_dispatch_delay(self, *, seconds: float) -> None:
        self.dispatch_delay.add(seconds)

    def first_prompt_for(self, task: int) -> WindowMean | None:
        """First-prompt sizes of a task (-2: every task together), created on first use."""
        mean = self.first_prompt.get(task)
        if mean is None and len(self.first_prompt) < 4096:
            mean = self.first_prompt[task] = WindowMean(window=256, default=math.nan)
        return mean

    def on_first_prompt(self, *, task: int, tokens: float) -> None:
        for k in (task, -2):
            mean = self.first_prompt_for(k)
            if mean is not None:
                mean.add(tokens)

    def on_growth(self, key: tuple[object, ...], tokens: float, result_known: bool) -> None:
        # With the result size known, only the chat template's overhead is unknown.
        (self.template if result_known else self.growth).update(key, max(tokens, 0.0))

    def on_tool(self, key: tuple[object, ...], seconds: float) -> None:
        self.tool.update(key, seconds)

    def on_decode(self, task: int, turn: int, seconds: float, output: float, tool: bool) -> None:
        self.decode_time.add((task, turn), seconds, marked=tool)
        share = 1.0 if tool else 0.0
        a = _OUTCOME_ALPHA
        for k in (task, -2):  # -2: every task together
            s = self.decode_outcome.get(k) or self._outcome_stats(k)
            if s is None:
                continue
            # [P(tool) EMA, decodes seen, output-tokens EMA of tool calls, tool calls seen]
            s[0] = share if not s[1] else s[0] + a * (share - s[0])
            s[1] += 1
            if tool:
                s[2] = output if not s[3] else s[2] + a * (output - s[2])
                s[3] += 1

    def _outcome_stats(self, key: int) -> list[float] | None:
        if len(self.decode_outcome) >= 4096:
            return None
        stats = self.decode_outcome[key] = [0.5, 0, 0.0, 0]
        return stats

    def on_reward(self, *, task: int, seconds: float, accepted: bool) -> None:
        self.reward.add((task,), seconds)
        self.admit_rate.add(1.0 if accepted else 0.0)

    def on_arrival(self, ts: float, tokens: float) -> None:
        if self.accuracy.pending:
            self.accuracy.on_arrival(ts, tokens)

    def on_admission(self, ts: float, tokens: float, computed: float) -> None:
        self.prefilled_tokens += tokens
        self.prefilled_computed += computed
        if self.accuracy.pending:
            self.accuracy.on_admission(ts, tokens)

    def on_prefill_interval(self, *, tokens: float, seconds: float) -> None:
        self.intervals.append((tokens, seconds))

    # -- what the sources read -------------------------------------------------------------

    def outcome_of(self, task: int) -> tuple[float, float]:
        """P(a decode ends in a tool call) and the mean output tokens of those, for a task."""
        p_tool, out = 0.5, 0.0
        for k in (task, -2):
            s = self.decode_outcome.get(k)
            if s is not None and s[1]:
                p_tool = s[0]
                break
        for k in (task, -2):
            s = self.decode_outcome.get(k)
            if s is not None and s[3]:
                out = s[2]
                break
        return p_tool, out

    def first_prompt_tokens(self, task: int) -> float:
        for k in (task, -2):
            mean = self.first_prompt.get(k)
            if mean is not None and len(mean):
                return mean.value
        return self.config.prior_first_prompt_tokens
