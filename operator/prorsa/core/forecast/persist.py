"""Learned statistics as JSON, so an operator restart does not forget what it learned.

Inside a process, conditioning classes hold small integer codes for labels (tasks, tools,
images, node classes); the codes depend on the order labels were first seen. The saved form
therefore uses the label names, and loading maps them back to this process's codes.
"""

from __future__ import annotations

from typing import Any

from prorsa.core.estimators import PrefillSpeed
from prorsa.core.forecast.interner import Interner
from prorsa.core.forecast.model import Forecaster
from prorsa.core.forecast.stats import ClassedDistributions
from prorsa.core.forecast.survival import ClassedSurvival
from prorsa.core.forecast.table import TrajectoryTable

FORMAT = 1

# How each statistic's class key is laid out: which positions are interned labels.
_LAYOUT: dict[str, tuple[str | None, ...]] = {
    "reward": ("tasks",),
    "decode": ("tasks", None),
    "startup": (None, "images", "nodes"),
    "tool": ("tasks", "tools", None, None),
    "growth": ("tasks", "tools"),
    "template": ("tasks", "tools"),
}


def _interner(table: TrajectoryTable, kind: str) -> Interner:
    return getattr(table, kind)  # type: ignore[no-any-return]


def _names(
    table: TrajectoryTable, key: tuple[Any, ...], layout: tuple[str | None, ...]
) -> list[Any]:
    if key and key[0] == "dispatch":
        return list(key)
    out: list[Any] = []
    for part, kind in zip(key, layout, strict=False):
        if kind is None or not isinstance(part, int):
            out.append(part)
        else:
            out.append(_interner(table, kind).name(part))
    return out


def _codes(
    table: TrajectoryTable, names: list[Any], layout: tuple[str | None, ...]
) -> tuple[Any, ...]:
    if names and names[0] == "dispatch":
        return tuple(names)
    out: list[Any] = []
    for part, kind in zip(names, layout, strict=False):
        out.append(part if kind is None else _interner(table, kind).code(part))
    return tuple(out)


def export_state(
    *, table: TrajectoryTable, forecaster: Forecaster, theta: PrefillSpeed
) -> dict[str, Any]:
    f = forecaster
    stats: dict[str, ClassedDistributions | ClassedSurvival] = {
        "reward": f.reward,
        "startup": f.startup,
        "decode": f.decode_time,
    }
    emas = {"tool": f.tool, "growth": f.growth, "template": f.template}
    tasks = table.tasks
    return {
        "format": FORMAT,
        "distributions": {
            name: [[_names(table, k, _LAYOUT[name]), v] for k, v in dist.export()]
            for name, dist in stats.items()
        },
        "ema": {
            name: [[_names(table, k, _LAYOUT[name]), tau, n] for k, tau, n in ema.export()]
            for name, ema in emas.items()
        },
        "admitRate": f.admit_rate.export(),
        "dispatchDelay": f.dispatch_delay.export(),
        "firstPrompt": [
            [None if code == -2 else tasks.name(code), mean.export()]
            for code, mean in f.first_prompt.items()
        ],
        "prefillIntervals": theta.export(),
    }


def restore_state(
    data: dict[str, Any], *, table: TrajectoryTable, forecaster: Forecaster, theta: PrefillSpeed
) -> None:
    """Load what :func:`export_state` wrote; unknown formats are ignored, not guessed at."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"unsupported learned-state format {data.get('format')!r}")
    f = forecaster
    for name, dist in (("reward", f.reward), ("startup", f.startup), ("decode", f.decode_time)):
        items = data.get("distributions", {}).get(name, [])
        dist.restore([(_codes(table, k, _LAYOUT[name]), v) for k, v in items])
    for name, ema in (("tool", f.tool), ("growth", f.growth), ("template", f.template)):
        items = data.get("ema", {}).get(name, [])
        ema.restore([(_codes(table, k, _LAYOUT[name]), tau, n) for k, tau, n in items])
    f.admit_rate.restore(data.get("admitRate", []))
    f.dispatch_delay.restore(data.get("dispatchDelay", []))
    for task, values in data.get("firstPrompt", []):
        code = -2 if task is None else table.tasks.code(task)
        mean = f.first_prompt_for(code)
        if mean is not None:
            mean.restore(values)
    theta.restore([tuple(x) for x in data.get("prefillIntervals", [])])
