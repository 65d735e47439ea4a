"""How fast the split follows the workload: phase lag and prefill backlog per phase.

The demo's workload swings between a prefill-heavy and a decode-heavy phase at known
times, so these questions have exact answers after a run:

* **Eq. 1's target of a phase**: the split Eq. 1 found best for the planned demand
  (``prorsa_best_split_instances``, before the hold rules and switch pricing) at most of
  the phase's ticks, as the demo's monitor read it once a second.
* **Phase lag**: after each phase change, how long until the prefill:decode split reached
  that target. The split is read from the pods' ``prorsa.io/role`` labels, which is what
  routes traffic (smg sends no new work to a pod labelled ``draining``). The lag is the
  first moment in the phase at which the labels show the target with no pod draining
  (0 when the phase starts there); ``None`` when the split never reached it in the phase.
* **Settled**: the split held at the end of the phase, from the last moment within the
  phase at which it changed (``settled_seconds`` after the change; 0 when it never
  changed). A phase that ends with a pod still ``draining`` did not settle (``None``).
* **Following**: the split followed the phases when the split settled in each tools
  (prefill-heavy) phase has more prefill instances than the split settled in the
  reasoning (decode-heavy) phases on either side of it.
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

from prorsa_lab.demo.lag_parts import LagParts, SwitchSpan, lag_parts
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
    # Eq. 1's target of the phase ("2P:2D"; None: no Decision was read in the phase), and
    # the seconds until the labels reached it (None: they never did in the phase).
    target: str | None = None
    lag_seconds: float | None = None
    # Seconds until the split last changed in the phase (None: a switch was still under
    # way when the phase ended).
    settled_seconds: float | None = None
    # The lag cut into detection, decision, router, drain and flip (None: no lag);
    # prorsa_lab.demo.lag_parts.
    lag_parts: LagParts | None = None
    task: str | None = None  # a multi-task job's task of the phase


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


def phase_target(
    best: Sequence[tuple[float, tuple[int, int]]], start: float, end: float
) -> tuple[int, int] | None:
    """Eq. 1's best split at most of the readings in ``[start, end)`` (wall clock); on a
    tie, the one read last. None without a reading."""
    counts: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], float] = {}
    for at, split in best:
        if start <= at < end:
            counts[split] = counts.get(split, 0) + 1
            last[split] = at
    if not counts:
        return None
    return max(counts, key=lambda s: (counts[s], last[s]))


def phase_changes(
    timeline: Sequence[tuple[float, Split]],
    spans: Sequence[tuple[float, float, PhaseName]],
    *,
    t0: float,
    best: Sequence[tuple[float, tuple[int, int]]] = (),
    switches: Sequence[SwitchSpan] = (),
) -> list[PhaseChange]:
    """One :class:`PhaseChange` per span after the first; spans are relative to ``t0``,
    ``best`` holds (wall clock, Eq. 1's best split) readings, ``switches`` the switches
    the lag is cut by."""
    out: list[PhaseChange] = []
    for start, end, phase in spans[1:]:
        before = _split_at(timeline, t0 + start)
        inside = [(at, s) for at, s in timeline if t0 + start < at < t0 + end]
        held = inside[-1][1] if inside else before
        if held.draining:
            settled: float | None = None
        else:
            settled = round(inside[-1][0] - (t0 + start), 2) if inside else 0.0
        target = phase_target(best, t0 + start, t0 + end)
        lag: float | None = None
        if target is not None:
            want = Split(prefill=target[0], decode=target[1])
            reached = [at for at, s in [(t0 + start, before), *inside] if s == want]
            lag = round(reached[0] - (t0 + start), 2) if reached else None
        parts = lag_parts(
            at=t0 + start,
            lag=lag,
            before=(before.prefill, before.decode),
            target=target,
            best=best,
            spans=switches,
        )
        out.append(
            PhaseChange(
                at=start,
                phase=phase,
                split_before=str(before),
                split_settled=str(held),
                target=None if target is None else f"{target[0]}P:{target[1]}D",
                lag_seconds=lag,
                settled_seconds=settled,
                lag_parts=parts,
            )
        )
    return out


def prefill_of(split: str) -> int | None:
    """The prefill count of a settled split ("3P:1D" -> 3); None while one drains."""
    if "draining" in split:
        return None
    head, _, _ = split.partition("P:")
    return int(head) if head.isdigit() else None


def follows_phases(changes: Sequence[PhaseChange]) -> bool | None:
    """Whether every tools phase settled with more prefill instances than the reasoning
    phases recorded on either side of it; None when no tools phase has one."""
    verdicts: list[bool] = []
    for i, change in enumerate(changes):
        if change.phase != "tools":
            continue
        around = [
            changes[j]
            for j in (i - 1, i + 1)
            if 0 <= j < len(changes) and changes[j].phase == "reasoning"
        ]
        if not around:
            continue
        tools = prefill_of(change.split_settled)
        others = [prefill_of(c.split_settled) for c in around]
        verdicts.append(tools is not None and all(p is not None and tools > p for p in others))
    return all(verdicts) if verdicts else None


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
        f"{c.lag_seconds:.1f}" if c.lag_seconds is not None else "never" for c in changes
    )
    backlog = ", ".join(f"{b.requests} req/{b.prompt_tokens / 1e3:.0f}k" for b in backlogs)
    return (
        f"  phase lag     {lags or 'no phase change'} s after each phase change, to Eq. 1's "
        f"target; prefill backlog at phase ends {backlog or '-'}"
    )


def phases_line(changes: Sequence[PhaseChange]) -> str:
    """The splits each phase settled on, against Eq. 1's targets, and the verdict."""
    parts = [f"{c.task or c.phase} {c.split_settled} (Eq. 1: {c.target or '-'})" for c in changes]
    verdict = follows_phases(changes)
    said = {
        True: "the split followed the phases both ways",
        False: "the split did not follow the phases",
        None: "too few phases to tell",
    }[verdict]
    if verdict is None and changes and len({c.phase for c in changes}) == 1:
        held = sorted({c.split_settled for c in changes})
        said = f"steady phases, settled on {', '.join(held)}"
    return f"  phases        {'; '.join(parts) or 'no phase change'}: {said}"
