"""The numbers of one refresh of the demo's view, and how they are written as text.

Both views (the rich live panel and the plain lines) and their tests build on the same
:class:`Frame`, so what a user reads in one is what the other prints.
"""

from __future__ import annotations

import re
import textwrap
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prorsa_lab.demo.monitor import Monitor
from prorsa_lab.demo.smg_client import SmgClient
from prorsa_lab.demo.trainer import DemoTrainer

__all__ = [
    "LEGEND",
    "PHASE_TEXT",
    "Frame",
    "bar",
    "clock",
    "explain",
    "fit",
    "frame",
    "tokens",
    "wape",
    "wrap_lines",
]

PHASE_TEXT = {"tools": "tools (prefill-heavy)", "reasoning": "reasoning (decode-heavy)"}
LEAN_TEXT = {"tools": "prefill-heavy", "reasoning": "decode-heavy"}

# What the symbols of the forecast line mean (the paper's Eq. 1 and Eq. 13-15).
LEGEND = (
    "W_P: prefill tokens forecast for the next horizon S",
    "K_D+K̂_D: decode KV tokens in use + forecast to be admitted within S",
    "θ_P: prefill tokens/s of one instance",
    "C_KV: KV tokens one decode instance holds",
)


def tokens(tokens: float | int | None) -> str:
    if tokens is None:
        return "-"
    if abs(tokens) >= 1e6:
        return f"{tokens / 1e6:.2f}M"
    if abs(tokens) >= 1e3:
        return f"{tokens / 1e3:.1f}k"
    return f"{tokens:.0f}"


def bar(value: float, *, scale: float, width: int = 24) -> str:
    """A horizontal bar of ``value`` on a 0..``scale`` axis, in eighths of a cell."""
    if scale <= 0:
        return ""
    cells = max(0.0, min(value / scale, 1.0)) * width
    full, part = int(cells), int((cells - int(cells)) * 8)
    tail = " ▏▎▍▌▋▊▉"[part] if part else ""
    return ("█" * full + tail).ljust(width)[:width] + ("▶" if value > scale else " ")


@dataclass(frozen=True, slots=True)
class Frame:
    """The numbers of one refresh, shared by both views."""

    elapsed: float
    duration: float
    phase: str
    mode: str
    labels: dict[str, int]
    target: tuple[int, int] | None
    demand: tuple[float, float] | None
    forecast: dict[str, Any]
    capacity: dict[str, Any]
    margin: float | None
    reason: str
    wape: tuple[float | None, float | None]
    sent: int
    completed: int
    in_flight: int
    resumed: int
    resumes: int
    lost: int
    live: int
    events_per_second: float
    best: tuple[int, int] | None = None  # Eq. 1's best split, before holds and pricing
    run_label: str = ""  # "static 2P:2D" for the baseline run


def frame(
    *,
    options: Any,
    monitor: Monitor,
    trainer: DemoTrainer,
    router: SmgClient,
    run_label: str = "",
) -> Frame:
    d = monitor.decision or {}
    target = (d["target"]["prefill"], d["target"]["decode"]) if d.get("target") else None
    acc = monitor.status.get("accuracy") or {}
    stats = trainer.stats
    live = sum(
        int(v)
        for labels, v in monitor.metrics.get("prorsa_live_trajectories", [])
        if labels.get("cluster") == monitor.cluster
    )
    return Frame(
        elapsed=max(0.0, time.time() - trainer.t0),
        duration=options.duration,
        phase=(f"over, in flight: {stats.in_flight}" if trainer.stopping else _phase_text(trainer)),
        mode=str(d.get("mode") or "waiting for the first tick"),
        labels=monitor.directory.counts(),
        target=target,
        demand=monitor.demand(),
        forecast=d.get("forecast") or {},
        capacity=d.get("capacity") or {},
        margin=d.get("safetyMargin"),
        reason=str(d.get("reason") or ""),
        wape=(acc.get("prefillWape"), acc.get("decodeWape")),
        sent=len(stats.requests),
        completed=stats.completed,
        in_flight=stats.in_flight,
        resumed=stats.resumed,
        resumes=stats.resumes,
        lost=stats.tokens_lost,
        live=live,
        events_per_second=monitor.event_rate,
        best=monitor.best(),
        run_label=run_label,
    )


def _phase_text(trainer: DemoTrainer) -> str:
    """``tools (prefill-heavy)``, or for a multi-task job ``general (prefill-heavy)``."""
    elapsed = time.time() - trainer.t0
    job = trainer.schedule.job_task(elapsed)
    if job is None:
        return PHASE_TEXT[trainer.phase_now()]
    return f"{job.task.name} ({LEAN_TEXT[job.lean]})"


def clock(seconds: float) -> str:
    return f"{int(seconds) // 60:02d}:{int(seconds) % 60:02d}"


def wape(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


_LABEL = re.compile(r"^( *\S+(?: \S+)? {2,}| *)")


def wrap_lines(lines: Iterable[str], width: int | None) -> Iterator[str]:
    """``lines`` folded at spaces to ``width`` columns (None: as they are).

    A terminal folds a long line at its last column, mid-word. A folded line continues
    under the text after its label (``  requests      ...``), so the labels stay a column.
    """
    for line in lines:
        if width is None or len(line) <= width:
            yield line
            continue
        label = _LABEL.match(line)
        indent = " " * (len(label.group(1)) if label else 0)
        yield from textwrap.wrap(
            line,
            width=width,
            subsequent_indent=indent if len(indent) < width // 2 else "    ",
            break_long_words=False,
            break_on_hyphens=False,
        )


# -- the Decision's reason, said in the width there is ----------------------------------------

_BEST = re.compile(r"best margin at (\d+)P:(\d+)D")
_MOVE = re.compile(
    r"^(?P<pod>\S+) (?P<src>prefill|decode)->(?P<dst>prefill|decode): gains (?P<gain>-?\d+)s "
    r"over the payoff horizon, costs (?P<cost>-?\d+)s \((?P<lost>[^)]*)\)$"
)
_HYSTERESIS = re.compile(
    r"^holding \S+: best split gains (?P<gain>[^ ]+) headroom \(< (?P<h>[^ ]+)"
)
_MARGIN = re.compile(r"^holding \S+: it covers demand with margin (?P<m>[\d.]+)")


def _clauses(reason: str) -> list[str]:
    """The reason's clauses; a move listed after ``switching:`` or ``holding:`` stays
    with it."""
    out: list[str] = []
    for part in reason.split("; "):
        if out and _MOVE.match(part) and out[-1].startswith(("switching: ", "holding: ")):
            out[-1] += "; " + part
        else:
            out.append(part)
    return out


def _seconds(m: re.Match[str]) -> str:
    """Gains and cost in whole seconds: the reason's "-0s" (a loss rounded away) reads "0 s"."""
    return f"gains {int(m['gain'])} s, costs {int(m['cost'])} s"


def _numbers(text: str) -> str:
    m = _MOVE.match(text)
    return _seconds(m) if m else text


def _move(text: str, *, short: bool) -> str:
    m = _MOVE.match(text)
    if not m:
        return text
    pod = m["pod"].rsplit("-", 2)
    name = "-".join(pod[-2:]) if short and len(pod) >= 2 else m["pod"]
    said = f"{name} {m['src']}→{m['dst']} {_seconds(m)}"
    return said if short else f"{said} ({m['lost']})"


@dataclass(frozen=True, slots=True)
class Explanation:
    """The Decision's reason, point first: ``forms`` say where the split goes and why, from
    the longest to the shortest; ``details`` are the other clauses in order of use."""

    forms: tuple[str, ...]
    details: tuple[str, ...] = ()


def explain(reason: str, *, target: tuple[int, int] | None) -> Explanation:
    """Whether the target is Eq. 1's best split and, when it is not, why: a move priced
    that did not pay, hysteresis, the hold margin, role minimums."""
    if not reason:
        return Explanation(("no Decision yet",))
    clauses = _clauses(reason)
    found = _BEST.search(reason)
    best = (int(found[1]), int(found[2])) if found else None
    want = "-" if target is None else f"{target[0]}P:{target[1]}D"
    eq1 = "-" if best is None else f"{best[0]}P:{best[1]}D"
    held = next((c for c in clauses if c.startswith("holding")), None)
    moving = next((c for c in clauses if c.startswith("switching: ")), None)
    forms: list[str]
    if best is not None and target is not None and best != target:
        head = f"target {want}, not Eq. 1's best {eq1}"
        if held and held.startswith("holding: "):
            move = held.removeprefix("holding: ").split("; ")[0]
            forms = [
                f"{head}: the move was priced and did not pay ({_move(move, short=False)})",
                f"{head}: the move was priced and did not pay ({_move(move, short=True)})",
                f"{want}, not Eq. 1's {eq1}: the move was priced and did not pay "
                f"({_move(move, short=True)})",
                f"{want}, not Eq. 1's {eq1}: priced, did not pay ({_numbers(move)})",
                f"{want}, not Eq. 1's {eq1}: the move did not pay",
            ]
        elif held and (h := _HYSTERESIS.match(held)):
            forms = [
                f"{head}: hysteresis, it gains {h['gain']} headroom (< {h['h']})",
                f"{want}, not Eq. 1's {eq1}: hysteresis ({h['gain']} < {h['h']})",
            ]
        elif held and (m := _MARGIN.match(held)):
            forms = [
                f"{head}: {want} covers demand with margin {m['m']} (holdMargin)",
                f"{want}, not Eq. 1's {eq1}: holdMargin",
            ]
        elif held:
            forms = [f"{head}: {held}", f"{want}, not Eq. 1's {eq1}: {held}"]
        else:
            forms = [head, f"{want}, not Eq. 1's {eq1}"]
        if moving:  # part of the way made: the next move did not pay
            made = _move(moving.removeprefix("switching: ").split("; ")[0], short=True)
            forms.insert(0, f"{forms[0]}; switching {made}")
    elif moving:
        moves = moving.removeprefix("switching: ").split("; ")
        forms = [
            f"to Eq. 1's best {eq1}: " + ", ".join(_move(x, short=False) for x in moves),
            f"to Eq. 1's best {eq1}: " + ", ".join(_move(x, short=True) for x in moves),
            f"switching to Eq. 1's best {eq1}",
        ]
    elif held:
        forms = [f"at {want}, Eq. 1's best {eq1}: {held}", f"at {want}, Eq. 1's best {eq1}"]
    else:
        forms = [f"at Eq. 1's best {eq1}"]
    details = tuple(c for c in clauses if c is not held and c is not moving and not _BEST.match(c))
    return Explanation(tuple(forms), details)


def fit(explanation: Explanation, *, width: int, lines: int) -> list[str]:
    """The explanation in at most ``lines`` lines of ``width`` columns.

    The first line is the longest form of the point that fits (the shortest, cut with an
    ellipsis, when none does); the other lines take whole details, in order, as many as
    fit; a detail longer than a line is cut with an ellipsis.
    """
    if width <= 1 or lines <= 0:
        return []
    forms = explanation.forms
    first = next((f for f in forms if len(f) <= width), None)
    out = [first if first is not None else forms[-1][: width - 1] + "…"]
    current = ""
    for part in explanation.details:
        if len(out) >= lines:
            break
        part = part if len(part) <= width else part[: width - 1] + "…"
        candidate = f"{current}; {part}" if current else part
        if len(candidate) <= width:
            current = candidate
            continue
        out.append(current)
        current = part
    if current and len(out) < lines:
        out.append(current)
    return out[:lines]
