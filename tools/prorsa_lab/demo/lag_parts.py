"""Where a phase lag goes: detection, decision, router, drain and flip, in seconds.

A phase lag (:mod:`prorsa_lab.demo.phases`) runs from a phase change until the pods'
labels show Eq. 1's target of the phase. It is cut into five parts that add up to it, each
taken from what the system itself records:

* ``detection``: until Eq. 1's best split (``prorsa_best_split_instances``, the monitor's
  reading once a second) first stood on the target's side of the split held at the change:
  the workload turning over and the forecast following it (``smoothingSeconds``).
* ``router``: within each switch, from the pod's ``draining`` label until the executor's
  intent annotation turned to ``switching``, which it writes once smg no longer lists the
  pod (operator/prorsa/switching/executor.py, step 2). smg learns the label through its
  Kubernetes discovery.
* ``drain``: the agent's own drain seconds for that switch (the difference of its
  ``prorsa_agent_drain_duration_seconds_sum`` across the switch): in-flight requests
  finishing, then the abort at the drain deadline.
* ``flip``: the rest of the agent's role call and the relabel: the engine's flip, its
  verification, the label written (``switching`` annotation until the new role label).
* ``decision``: the rest of the lag after detection, when no switch ran: the Controller's
  pricing, hysteresis and cooldown between switches, and the tick.

The pod directory lists the pods every 0.1 s and the monitor reads the best split once a
second, so a part is good to about 0.1 s, ``detection`` to about 1 s. A switch that began
before the forecast crossed counts in ``detection`` up to the crossing. When the change
found a pod draining and the target's prefill count already held, the forecast crossed
once it stood at that count. When an agent's drain could not be read, ``drain`` is None
and its seconds are in ``flip``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prorsa_lab.demo.monitor import DrainMark
from prorsa_lab.demo.pod_directory import IntentChange, LabelChange

PARTS = ("detection", "decision", "router", "drain", "flip")


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchSpan:
    """One switch as the labels, the intent annotation and the agent recorded it (wall
    clock): ``draining`` label, router dropped the pod, agent's drain ended, new label."""

    pod: str
    draining: float
    dropped: float
    drained: float | None  # None: the agent's drain seconds could not be read
    relabelled: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LagParts:
    """One phase lag cut into its parts (seconds; they add up to the lag)."""

    detection: float
    decision: float
    router: float
    drain: float | None
    flip: float
    switches: int  # switches that ran within the lag

    def total(self) -> float:
        return self.detection + self.decision + self.router + (self.drain or 0.0) + self.flip


def switch_spans(
    changes: Sequence[LabelChange],
    intents: Sequence[IntentChange],
    drains: Sequence[DrainMark] = (),
) -> list[SwitchSpan]:
    """Every finished switch: a pod labelled ``draining`` and then a role again."""
    out: list[SwitchSpan] = []
    began: dict[str, float] = {}
    for change in sorted(changes, key=lambda c: c.at):
        if change.new == "draining":
            began[change.pod] = change.at
            continue
        start = began.pop(change.pod, None)
        if start is None or change.new is None:
            continue
        end = change.at
        marks = [i.at for i in intents if i.pod == change.pod and i.phase == "switching"]
        # No ``switching`` mark: the agent was never called (the router did not drop the
        # pod in time and the executor restored its label): all of it was the router's.
        dropped = min((t for t in marks if start <= t <= end), default=end)
        before = [m.total for m in drains if m.pod == change.pod and m.t <= start]
        after = [m.total for m in drains if m.pod == change.pod and m.t >= end]
        drained: float | None = None
        if before and after:
            drain = min(max(after[0] - before[-1], 0.0), end - dropped)
            drained = dropped + drain
        out.append(
            SwitchSpan(
                pod=change.pod, draining=start, dropped=dropped, drained=drained, relabelled=end
            )
        )
    return out


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def lag_parts(
    *,
    at: float,
    lag: float | None,
    before: tuple[int, int],
    target: tuple[int, int] | None,
    best: Sequence[tuple[float, tuple[int, int]]],
    spans: Sequence[SwitchSpan],
) -> LagParts | None:
    """The parts of the lag of the phase change at wall time ``at``, the split ``before``
    it; None when the split never reached the target in the phase."""
    if lag is None or target is None:
        return None
    end = at + lag
    direction = target[0] - before[0]

    def on_target_side(split: tuple[int, int]) -> bool:
        if direction == 0:  # the change found a pod draining: the prefill count is right
            return split[0] == target[0]
        return (split[0] - before[0]) * direction > 0

    crossed = [t for t, split in best if at <= t <= end and on_target_side(split)]
    detection = min(crossed[0] - at, lag) if crossed else lag
    lo = at + detection
    router = drain = flip = 0.0
    measured = True
    count = 0
    for s in spans:
        if _overlap(s.draining, s.relabelled, at, end) <= 0:
            continue
        count += 1
        router += _overlap(s.draining, s.dropped, lo, end)
        if s.drained is None:
            measured = False
            flip += _overlap(s.dropped, s.relabelled, lo, end)
        else:
            drain += _overlap(s.dropped, s.drained, lo, end)
            flip += _overlap(s.drained, s.relabelled, lo, end)
    if not measured:  # one drain unread: every switch's drain stays in flip
        flip, drain = flip + drain, 0.0
    decision = max(0.0, lag - detection - router - drain - flip)
    return LagParts(
        detection=round(detection, 2),
        decision=round(decision, 2),
        router=round(router, 2),
        drain=round(drain, 2) if measured else None,
        flip=round(flip, 2),
        switches=count,
    )


def parts_line(parts: Sequence[LagParts | None]) -> str:
    """The printed summary's line: each lag's parts, in order."""

    def one(p: LagParts | None) -> str:
        if p is None:
            return "never"
        drain = "?" if p.drain is None else f"{p.drain:.1f}"
        return (
            f"{p.detection:.1f} detect + {p.decision:.1f} decide + {p.router:.1f} router + "
            f"{drain} drain + {p.flip:.1f} flip"
        )

    text = "; ".join(one(p) for p in parts) or "no phase change"
    return f"  lag parts     {text} (s)"
