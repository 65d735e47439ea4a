"""What the switch plan learned, as JSON: the restarted operator goes on from it.

The forecaster's statistics are saved by :mod:`prorsa.core.forecast.persist`; this saves
what the switch plan measured besides (issue 36: "the step-cycle profile and switch
durations do not survive a restart"): how long a switch takes and how much decode work it
aborts (:class:`SwitchCosts`), how long demand keeps leaning one way
(:class:`Persistence`) and the training steps seen so far (:class:`CycleProfile`). A new
leader that restores them prices its first moves with measured durations and reads the
step-scale target at once, instead of holding the split for two minutes to learn it again.

Times are the trainer's clock, which a restart does not reset. What is read back is
checked: a field that is missing, not a number or not finite raises ValueError naming it
(the operator then starts from its priors and says so).
"""

from __future__ import annotations

import math
from typing import Any

from prorsa.core.switch_cost import CycleProfile, Load, Persistence, SwitchCosts

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
) -> None:
    """Load :func:`export_switching` output; a state saved before it existed loads nothing.

    Everything is checked before anything is changed, so a bad section leaves the priors.
    """
    if not data:
        return
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
    persistence.seconds = lasting
    if profile is not None:
        cycle.load(**profile)


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
