"""Does switching pay? The demo's switching run against a static split, on one workload.

``prorsa demo`` runs the same seeded trajectories twice, each on a fresh deployment for the
same rollout time: once with the Controller switching roles, once with the split pinned
(the role minimums equal to the split, so nothing can move). Both runs are measured the
same way: the time at which each trajectory got its reward. Over the trajectories both
finished, the first ``n`` of each run, the time to finish them is the comparison: what the
switching run saved (or lost) is the static run's time to its ``n``-th reward minus the
switching run's.

The static split is given (``--baseline 2:2``; by default the even split, what one picks
without knowing the workload's mix), or every split is run and the
fastest one is the baseline (``--baseline best``: one more run per split). Eq. 1 on the
run's average forecast demand is no stand-in for trying: the forecast counts the prompts
queued behind a short prefill side as demand of the next horizon, so a rollout starved of
prefill in its tools phases averages out prefill-heavy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from prorsa_lab.demo.monitor import Sample

_SPLIT = re.compile(r"^\s*(\d+)\s*(?:P\s*)?:\s*(\d+)\s*D?\s*$", re.IGNORECASE)


def parse_split(text: str, *, instances: int) -> tuple[int, int]:
    """``"2:2"`` or ``"2P:2D"`` -> (2, 2); both roles at least 1, summing to ``instances``."""
    match = _SPLIT.match(text)
    if not match:
        raise ValueError(f"a static split is N:M (prefill:decode instances), got {text!r}")
    split = int(match[1]), int(match[2])
    if min(split) < 1 or sum(split) != instances:
        raise ValueError(
            f"a static split needs one instance of each role and {instances} in all "
            f"(--instances), got {split[0]}:{split[1]}"
        )
    return split


def split_text(split: tuple[int, int]) -> str:
    return f"{split[0]}P:{split[1]}D"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """One run for the comparison: ``completed`` trajectories took ``seconds``."""

    split: str  # "2P:2D", or "switching"
    completed: int  # trajectories both runs finished (the first ``completed`` of this one)
    seconds: float | None  # until this run's ``completed``-th reward; None: none finished
    completed_in_run: int  # every trajectory this run finished
    requests: int  # model calls completed in the run


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    switching: RunResult
    static: RunResult

    @property
    def saved_seconds(self) -> float | None:
        if self.switching.seconds is None or self.static.seconds is None:
            return None
        return round(self.static.seconds - self.switching.seconds, 2)

    @property
    def saved_ratio(self) -> float | None:
        saved = self.saved_seconds
        if saved is None or not self.static.seconds:
            return None
        return round(saved / self.static.seconds, 4)

    def line(self) -> str:
        """``switching saved X s (Y%) against static N:M`` (or ``lost``), with its basis."""
        saved, ratio = self.saved_seconds, self.saved_ratio
        static = f"static {self.static.split}"
        if saved is None or ratio is None:
            return f"  switching     not compared against {static}: a run finished no trajectory"
        verb = "saved" if saved >= 0 else "lost"
        n = self.switching.completed
        return (
            f"  switching     {verb} {abs(saved):.1f} s ({abs(ratio):.0%}) against {static}: "
            f"its first {n} trajectories took {self.switching.seconds:.1f} s, "
            f"{self.static.seconds:.1f} s on {static}"
        )


def compare(
    *,
    switching_times: Sequence[float],
    static_times: Sequence[float],
    static_split: str,
    switching_requests: int,
    static_requests: int,
) -> Comparison:
    """Both runs over the trajectories both finished (reward times, seconds from start)."""
    n = min(len(switching_times), len(static_times))

    def result(split: str, times: Sequence[float], requests: int) -> RunResult:
        ordered = sorted(times)
        return RunResult(
            split=split,
            completed=n,
            seconds=round(ordered[n - 1], 2) if n else None,
            completed_in_run=len(ordered),
            requests=requests,
        )

    return Comparison(
        switching=result("switching", switching_times, switching_requests),
        static=result(static_split, static_times, static_requests),
    )


def spread(first: Sequence[float], second: Sequence[float], *, count: int) -> float | None:
    """How far two runs of one static split on one seed ended apart: the difference of
    their times to the ``count``-th reward (fewer when either finished fewer); None when
    either finished none. The machine's other load, not the workload, makes it."""
    n = min(count, len(first), len(second))
    if n < 1:
        return None
    return round(abs(sorted(first)[n - 1] - sorted(second)[n - 1]), 2)


def verdict(saved: float | None, noise: float | None) -> str | None:
    """``saved`` or ``lost``, or ``within noise`` when the difference is no larger than the
    spread between two runs of the static split (None: not compared)."""
    if saved is None:
        return None
    if noise is not None and abs(saved) <= noise:
        return "within noise"
    return "saved" if saved >= 0 else "lost"


def load_average(samples: Sequence[Sample]) -> dict[str, float | None]:
    """The 1-minute load average while a run went: its mean and its maximum."""
    loads = [s.load for s in samples if s.load is not None]
    if not loads:
        return {"mean": None, "max": None}
    return {"mean": round(sum(loads) / len(loads), 2), "max": round(max(loads), 2)}
