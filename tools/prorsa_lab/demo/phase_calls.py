"""Per phase, how long a model call took under each split the run saw.

The comparison with a static split (:mod:`prorsa_lab.demo.compare`) says whether switching
paid over the whole run; this says where: each phase's calls (by the phase they started
in, from the trainer's own record, ``requests.jsonl``), grouped by the split in force when
they were sent (the pods' role labels, ``"1P:2D+1 draining"`` while a switch ran), with
their mean duration from send to last token. A static run sees one split per phase, so
setting its line beside the switching run's shows what each split gives that phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prorsa_lab.demo.phases import Split
from prorsa_lab.demo.trainer import RequestRecord
from prorsa_lab.demo.workload import PhaseName


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitCalls:
    split: str  # "2P:2D", or "1P:2D+1 draining"
    calls: int  # calls started under it in the phase and answered
    mean_seconds: float  # their mean time from send to last token


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseCalls:
    phase: PhaseName
    start: float  # seconds since the rollout start
    splits: tuple[SplitCalls, ...]  # in order of calls, most first
    task: str | None = None  # a multi-task job's task of the phase


def _split_at(timeline: Sequence[tuple[float, Split]], t: float) -> Split | None:
    current = None
    for at, split in timeline:
        if at > t:
            break
        current = split
    return current


def phase_calls(
    records: Sequence[RequestRecord],
    timeline: Sequence[tuple[float, Split]],
    spans: Sequence[tuple[float, float, PhaseName]],
    *,
    t0: float,
) -> list[PhaseCalls]:
    """One entry per span (relative to ``t0``): its answered calls by the split they were
    sent under; calls still open or failed are left out."""
    out: list[PhaseCalls] = []
    for start, end, phase in spans:
        groups: dict[str, list[float]] = {}
        for r in records:
            if r.finished is None or r.error is not None:
                continue
            if not t0 + start <= r.started < t0 + end:
                continue
            split = _split_at(timeline, r.started)
            key = "-" if split is None else str(split)
            groups.setdefault(key, []).append(r.finished - r.started)
        out.append(
            PhaseCalls(
                phase=phase,
                start=round(start, 2),
                splits=tuple(
                    SplitCalls(split=k, calls=len(v), mean_seconds=round(sum(v) / len(v), 2))
                    for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))
                ),
            )
        )
    return out


def calls_line(phases: Sequence[PhaseCalls], *, label: str = "calls") -> str:
    """``tools 1P:3D 2.5 s ×40, 2P:2D 1.9 s ×80; reasoning ...``: per phase, the mean call
    time under each split it saw."""
    parts = []
    for p in phases:
        splits = ", ".join(f"{s.split} {s.mean_seconds:.1f} s ×{s.calls}" for s in p.splits)
        parts.append(f"{p.task or p.phase} {splits or '-'}")
    return f"  {label:<13} {'; '.join(parts) or '-'}"
