"""How fast the split follows the workload: phase lag and prefill backlog per phase.

The demo's workload swings between a prefill-heavy and a decode-heavy phase at known
times, so two questions have exact answers after a run:

* **Phase lag**: after each phase change, how long until the prefill:decode split
  *settled*. The split is read from the pods' ``prorsa.io/role`` labels, which is what
  routes traffic (smg sends no new work to a pod labelled ``draining``). The split
  settled at the last moment within the phase at which it changed, i.e. when it reached
  the value it then held until the next phase change (or the end of the rollout); a
  phase in which the split never changed has lag 0 (it kept the split it came in with).
  A phase that ends with a pod still ``draining`` did not settle: its lag is ``None``.
* **Prefill backlog at each phase end**: the prompts in the prefill stage at that moment,
  from the trainer's own record (sent through smg, first token not back yet: waiting or
  being prefilled), and the engines' prefill wait queues as their agents last reported
  them (``/v1/state``, polled about once a second).

Both are computed from records the demo keeps anyway, with no clock of their own, so
they can be checked on hand-made inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prorsa_lab.demo.monitor import Sample
from prorsa_lab.demo.pod_directory import LabelChange
from prorsa_lab.demo.smg_client import PrefillJob
from prorsa_lab.demo.workload import PhaseName

ROLES = ("prefill", "decode", "draining")


@dataclass(frozen=True, slots=True, kw_only=True)
class Split:
    """Engine pods by role label; a pod switching roles is ``draining``."""

    prefill: int
    decode: int
    draining: int = 0

    def __str__(self) -> str:
        moving = f"+{self.draining} draining" if self.draining else ""
        return f"{self.prefill}P:{self.decode}D{moving}"


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseChange:
    """One phase change and how the split answered it (times since the rollout start)."""

    at: float
    phase: PhaseName  # the phase that starts here
    split_before: str
    split_settled: str  # the split held at the end of the phase ("2P:2D+1 draining": none)
    lag_seconds: float | None  # None: a switch was still under way when the phase ended


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseBacklog:
    """The prefill backlog when a phase ended (the last one ends when dispatching stops)."""

    phase: PhaseName
    end: float  # seconds since the rollout start
    prompt_tokens: int  # trainer: prompts sent whose first token had not come back
    requests: int
    engine_waiting_tokens: int | None  # agents: prefill wait queues; None before any poll
    engine_waiting_requests: int | None


def split_timeline(changes: Iterable[LabelChange]) -> list[tuple[float, Split]]:
    """The split after every label change, in time order (pods appearing included).

    Changes seen in one directory refresh share a timestamp and count as one step, so
    pods appearing one by one at start-up do not read as a string of splits.
    """
    roles: dict[str, str] = {}
    out: list[tuple[float, Split]] = []
    ordered = sorted(changes, key=lambda c: c.at)
    for i, change in enumerate(ordered):
        if change.new is None:
            roles.pop(change.pod, None)
        else:
            roles[change.pod] = change.new
        if i + 1 < len(ordered) and ordered[i + 1].at == change.at:
            continue
        split = Split(**{role: sum(1 for r in roles.values() if r == role) for role in ROLES})
        if not out or out[-1][1] != split:
            out.append((change.at, split))
    return out


def _split_at(timeline: Sequence[tuple[float, Split]], t: float) -> Split:
    """The split in force at ``t`` (changes stamped exactly at ``t`` included)."""
    current = Split(prefill=0, decode=0)
    for at, split in timeline:
        if at > t:
            break
        current = split
    return current


def phase_changes(
    timeline: Sequence[tuple[float, Split]],
    spans: Sequence[tuple[float, float, PhaseName]],
    *,
    t0: float,
) -> list[PhaseChange]:
    """One :class:`PhaseChange` per span after the first; spans are relative to ``t0``."""
    out: list[PhaseChange] = []
    for start, end, phase in spans[1:]:
        before = _split_at(timeline, t0 + start)
        inside = [(at, s) for at, s in timeline if t0 + start < at < t0 + end]
        held = inside[-1][1] if inside else before
        if held.draining:
            lag: float | None = None
        else:
            lag = round(inside[-1][0] - (t0 + start), 2) if inside else 0.0
        out.append(
            PhaseChange(
                at=start,
                phase=phase,
                split_before=str(before),
                split_settled=str(held),
                lag_seconds=lag,
            )
        )
    return out


def prefill_backlogs(
    jobs: Sequence[PrefillJob],
    samples: Sequence[Sample],
    spans: Sequence[tuple[float, float, PhaseName]],
    *,
    t0: float,
) -> list[PhaseBacklog]:
    """The prefill backlog at the end of every span (relative to ``t0``)."""
    out: list[PhaseBacklog] = []
    for _, end, phase in spans:
        t = t0 + end
        live = [j for j in jobs if j.queued <= t and (j.done is None or j.done > t)]
        seen = [s for s in samples if s.t <= t]
        last = seen[-1] if seen else None
        out.append(
            PhaseBacklog(
                phase=phase,
                end=round(end, 2),
                prompt_tokens=sum(j.tokens for j in live),
                requests=len(live),
                engine_waiting_tokens=last.waiting_prefill_tokens if last else None,
                engine_waiting_requests=last.waiting_prefill_requests if last else None,
            )
        )
    return out


def summary_line(changes: Sequence[PhaseChange], backlogs: Sequence[PhaseBacklog]) -> str:
    """Both measures on one line of the printed summary."""
    lags = ", ".join(
        f"{c.lag_seconds:.1f}" if c.lag_seconds is not None else "unsettled" for c in changes
    )
    backlog = ", ".join(f"{b.requests} req/{b.prompt_tokens / 1e3:.0f}k" for b in backlogs)
    return (
        f"  phase lag     {lags or 'no phase change'} s after each phase change; "
        f"prefill backlog at phase ends {backlog or '-'}"
    )
