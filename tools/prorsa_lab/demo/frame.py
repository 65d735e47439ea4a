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

__all__ = ["PHASE_TEXT", "Frame", "bar", "clock", "frame", "tokens", "wape", "wrap_lines"]

PHASE_TEXT = {"tools": "tools (prefill-heavy)", "reasoning": "reasoning (decode-heavy)"}


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


def frame(*, options: Any, monitor: Monitor, trainer: DemoTrainer, router: SmgClient) -> Frame:
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
        phase=(
            f"over, in flight: {stats.in_flight}"
            if trainer.stopping
            else PHASE_TEXT[trainer.phase_now()]
        ),
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
    )


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
