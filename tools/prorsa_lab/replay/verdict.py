"""The replay's verdict: one row per policy, the best static split, one line of advice.

The rows have the shape of ``prorsa bench rollout --json``'s (``policy``,
``makespanSeconds``, ``speedupVsBestStatic``, ``speedupVsColocation``). The advice compares
Prorsa and colocation with the best static split; a gain under :data:`MIN_GAIN` is
reported as none (a replay is one draw of one job, not a measurement to the percent).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIN_GAIN = 0.01


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyRun:
    """One policy's replay."""

    policy: str
    makespan: float  # seconds; inf: did not finish
    completed_at: tuple[float, ...]  # when each trajectory completed (sorted)
    switches: int
    dropped: int
    cut: int
    ran_out: bool  # stopped when the recording's trajectories ran out, before its last step
    timeline: tuple[tuple[float, int, int, int], ...]  # (t, prefill, decode, switching)

    @classmethod
    def from_summary(cls, r: Mapping[str, Any]) -> PolicyRun:
        extra = r.get("extra") or {}
        return cls(
            policy=r["policy"],
            makespan=float(r["makespan"]),
            completed_at=tuple(sorted(extra.get("completedAt", ()))),
            switches=int(r["switches"]),
            dropped=int(r["dropped"]),
            cut=int(extra.get("cut", 0)),
            ran_out=bool(extra.get("ranOut", False)),
            timeline=tuple(tuple(x) for x in r.get("timeline") or ()),
        )

    def time_to_count(self, n: int) -> float | None:
        """Seconds until ``n`` trajectories completed (None: fewer ever did)."""
        if n <= 0:
            return 0.0
        if n > len(self.completed_at):
            return None
        return self.completed_at[n - 1]


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def speedup(base: float | None, mine: float) -> float | None:
    if base is None or not math.isfinite(base) or not math.isfinite(mine) or mine <= 0:
        return None
    return base / mine


def best_static(runs: Mapping[str, PolicyRun]) -> int | None:
    statics = {
        int(name.removeprefix("static-").removesuffix("P")): run.makespan
        for name, run in runs.items()
        if name.startswith("static-")
    }
    if not statics:
        return None
    return min(statics, key=lambda n: (statics[n], n))


def rows(runs: Mapping[str, PolicyRun], *, instances: int) -> list[dict[str, Any]]:
    """One row per policy: colocation, each static split, best-static, prorsa, reference."""
    n_p = best_static(runs)
    best = runs[f"static-{n_p}P"].makespan if n_p is not None else None
    coloc = runs["colocation"].makespan if "colocation" in runs else None
    order = ["colocation"]
    order += sorted(
        (k for k in runs if k.startswith("static-")),
        key=lambda k: int(k.removeprefix("static-").removesuffix("P")),
    )
    order += ["best-static", "prorsa", "reference"]
    out = []
    for name in order:
        key = f"static-{n_p}P" if name == "best-static" and n_p is not None else name
        run = runs.get(key)
        if run is None:
            continue
        row: dict[str, Any] = {
            "policy": name,
            "makespanSeconds": _finite(run.makespan),
            "speedupVsBestStatic": speedup(best, run.makespan),
            "speedupVsColocation": speedup(coloc, run.makespan),
            "switches": run.switches,
            "completed": len(run.completed_at),
            "dropped": run.dropped,
            "cut": run.cut,
            "ranOutOfRecording": run.ran_out,
        }
        if name.startswith("static-") or name == "best-static":
            p = n_p if name == "best-static" else int(name[7:-1])
            row["split"] = {"prefill": p, "decode": instances - (p or 0)}
        out.append(row)
    return out


def advice(runs: Mapping[str, PolicyRun], *, instances: int) -> str:
    """Switch, hold the best static split, or colocate: the one line a user acts on."""
    n_p = best_static(runs)
    if n_p is None:
        return "no static split ran: nothing to compare with"
    split = f"{n_p}:{instances - n_p}"
    best = runs[f"static-{n_p}P"].makespan
    prorsa = runs["prorsa"].makespan if "prorsa" in runs else math.inf
    coloc = runs["colocation"].makespan if "colocation" in runs else math.inf
    if not math.isfinite(best) and not math.isfinite(prorsa) and not math.isfinite(coloc):
        return "no policy finished the replay: nothing to advise"
    if coloc < min(best, prorsa) * (1 - MIN_GAIN):
        gain = 1 - coloc / best if math.isfinite(best) else math.nan
        return (
            f"colocate: colocation finishes in {coloc:.0f} s, {gain:.0%} sooner than the "
            f"best static split {split} ({best:.0f} s)"
        )
    if prorsa < best * (1 - MIN_GAIN):
        return (
            f"switching saves {1 - prorsa / best:.0%} against the best static split {split} "
            f"({prorsa:.0f} s vs {best:.0f} s)"
        )
    return (
        f"hold {split}: switching saves nothing on this job "
        f"(Prorsa {prorsa:.0f} s vs {best:.0f} s for the best static split)"
    )
