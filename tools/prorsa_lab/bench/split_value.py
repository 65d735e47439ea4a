"""What a fixed prefill:decode split risks, against what Prorsa gives: the value table.

A user who deploys PD disaggregation must pick the split before the workload is known. The
grid holds, for every setting, the makespan of every static split, so the risk of any one
choice can be stated in hindsight: its makespan over the setting's best static split (the
split the user would have picked knowing the workload), as the worst and the geometric
mean over the settings. The paper's static baseline (§5.4: one split per task, kept across
models and staleness), Prorsa's Controller and PD colocation are put on the same footing.
A ratio above 1 is slower than the hindsight best split; Prorsa can go below 1, since it
moves the split during the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prorsa_lab.sim.runner import SettingRow

TASK_SPLIT = "task split"
# The policies set beside the fixed splits (SettingRow.makespan keys).
COMPARED = ("prorsa", "colocation")
ALL = "all"


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueLine:
    """One choice (a fixed split, the per-task split, a policy) over a set of settings."""

    choice: str
    settings: int  # settings it was measured on
    worst: float  # largest makespan / best static makespan (inf: a run did not finish)
    worst_at: str  # the setting of that worst ratio
    geomean: float  # geometric mean of the ratios (inf if one is)
    best_in: int | None = None  # fixed splits: settings where it is the best static split

    def as_json(self) -> dict[str, Any]:
        def num(v: float) -> float | None:
            return round(v, 4) if math.isfinite(v) else None

        return {
            "choice": self.choice,
            "settings": self.settings,
            "worst": num(self.worst),
            "worstAt": self.worst_at,
            "geomean": num(self.geomean),
            "bestIn": self.best_in,
        }


def _label(row: SettingRow) -> str:
    stale = "on-policy" if row.staleness == 0 else str(row.staleness)
    return f"{row.model}/{row.task}/{stale}"


def _line(
    choice: str, ratios: Sequence[tuple[str, float]], best_in: int | None = None
) -> ValueLine:
    worst_at, worst = max(ratios, key=lambda x: x[1])
    logs = [math.log(r) if math.isfinite(r) else math.inf for _, r in ratios]
    return ValueLine(
        choice=choice,
        settings=len(ratios),
        worst=worst,
        worst_at=worst_at,
        geomean=math.exp(sum(logs) / len(logs)),
        best_in=best_in,
    )


def split_name(prefill: int, instances: int) -> str:
    return f"{prefill}P:{instances - prefill}D"


def value_lines(rows: Iterable[SettingRow]) -> list[ValueLine]:
    """Each fixed split, the per-task split, Prorsa and colocation over ``rows``.

    Only settings SGLang can role-switch count (the others cannot run Prorsa), and only
    those whose best static split finished (a ratio to a run that never ends says
    nothing). A fixed split is reported when every such setting ran it.
    """
    picked = [
        r
        for r in rows
        if r.role_switch_capable
        and r.statics
        and math.isfinite(r.makespan.get("best-static", math.inf))
    ]
    if not picked:
        return []
    out: list[ValueLine] = []
    shapes = {r.instances for r in picked}
    common = set.intersection(*(set(r.statics) for r in picked))
    for n_p in sorted(common):
        ratios = [(_label(r), r.statics[n_p] / r.makespan["best-static"]) for r in picked]
        best_in = sum(1 for r in picked if r.best_static == n_p)
        name = split_name(n_p, picked[0].instances) if len(shapes) == 1 else f"{n_p}P"
        out.append(_line(name, ratios, best_in))
    for choice, key in ((TASK_SPLIT, "task-static"), *((p, p) for p in COMPARED)):
        ratios = [
            (_label(r), r.makespan[key] / r.makespan["best-static"])
            for r in picked
            if key in r.makespan
        ]
        if ratios:
            out.append(_line(choice, ratios))
    return out


def value_scopes(rows: Sequence[SettingRow]) -> dict[str, list[ValueLine]]:
    """The value lines over every role-switch-capable setting, then per deployment."""
    scopes = {ALL: value_lines(rows)}
    for model in dict.fromkeys(r.model for r in rows):
        lines = value_lines(r for r in rows if r.model == model)
        if lines:
            scopes[model] = lines
    return scopes if scopes[ALL] else {}


def task_splits(rows: Iterable[SettingRow]) -> dict[str, str]:
    """The per-task split each task got (paper §5.4), for the table's legend."""
    return {
        r.task: split_name(r.task_static, r.instances)
        for r in rows
        if r.role_switch_capable and r.task_static
    }


def value_json(rows: Sequence[SettingRow]) -> dict[str, Any]:
    scopes = value_scopes(rows)
    return {
        "ratio": "makespan / the setting's best static makespan (hindsight)",
        "taskSplits": task_splits(rows),
        "scopes": {
            name: {
                "settings": max((x.settings for x in lines), default=0),
                "lines": [x.as_json() for x in lines],
            }
            for name, lines in scopes.items()
        },
    }


def _cell(line: ValueLine | None) -> str:
    if line is None:
        return "-"

    def num(v: float) -> str:
        return f"{v:.2f}" if math.isfinite(v) else "DNF"

    return f"{num(line.worst)} / {num(line.geomean)}"


def value_table(rows: Sequence[SettingRow]) -> str:
    """The text table: one line per choice, one column (worst / geomean) per scope."""
    scopes = value_scopes(rows)
    if not scopes:
        return "value: no role-switch-capable setting with its static sweep"
    names = list(scopes)
    choices = list(dict.fromkeys(x.choice for lines in scopes.values() for x in lines))
    counts = {n: max(x.settings for x in scopes[n]) for n in names}
    labels = [f"{n} ({counts[n]})" for n in names]
    width = max(17, *(len(label) + 2 for label in labels))
    head = f"{'choice':<12}{'best in':>8}" + "".join(f"{label:>{width}}" for label in labels)
    splits = ", ".join(f"{t} {s}" for t, s in sorted(task_splits(rows).items()))
    lines = [
        "value: makespan over the hindsight best static split, worst / geometric mean "
        "(role-switch-capable settings; in brackets, how many)",
        head,
        "-" * len(head),
    ]
    for choice in choices:
        found = {n: next((x for x in scopes[n] if x.choice == choice), None) for n in names}
        mine = found[ALL]
        best_in = "" if mine is None or mine.best_in is None else str(mine.best_in)
        lines.append(
            f"{choice:<12}{best_in:>8}" + "".join(f"{_cell(found[n]):>{width}}" for n in names)
        )
    fixed = [x for x in scopes[ALL] if x.best_in is not None]
    if fixed:
        safest = min(fixed, key=lambda x: (x.worst, x.geomean))
        lines.append(
            f"safest fixed split: {safest.choice}, worst {_cell(safest).split(' / ')[0]} "
            f"at {safest.worst_at}"
        )
    for x in scopes[ALL]:
        if x.best_in is None:
            lines.append(f"worst {x.choice}: {_cell(x).split(' / ')[0]} at {x.worst_at}")
    if splits:
        lines.append(f"task split (paper §5.4, best geometric mean per task): {splits}")
    return "\n".join(lines)
