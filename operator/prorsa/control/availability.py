"""Which engine pods are unavailable, and why: what the Degraded condition, the Warning
Events and the log lines say about them.

An unavailable engine is never chosen to switch and the Controller plans the split over
the engines that answer, so the target shrinks with them: that must not happen quietly.
A pod that has not yet answered since it was created is *starting* (loading a model takes
minutes) and degrades nothing, unless it is still not up after the engine's start-up
budget; a pod that answered before and no longer does is *lost*, with a cause:

==================  ==========================================================
``PodNotRunning``   the pod has no IP or is not ``Running`` (restarting, evicted)
``AgentTimeout``    its agent's ``/v1/state`` did not answer in time
``AgentUnreachable``  no connection to its agent
``AgentUntrusted``  its agent's certificate does not verify
``AgentError``      an HTTP error, a body that is no state, another instance
``EngineUnhealthy`` its agent answers, and says the engine is unhealthy
``EngineNotStarted``  not up after the start-up budget
==================  ==========================================================

:class:`DegradedReporter` turns each tick's findings into one Warning Event per cause
(naming the pods; again only when a pod joins that cause), a Normal Event when every
engine answers again, and one log line per pod and change, naming the pod.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prorsa.engines.agents import Unanswered
from prorsa_contract.agent_api import EngineState

STARTUP_GRACE_SECONDS = 1800.0
"""How long a new engine pod may take to answer: the engine pod's startup probe allows
180 failures 10 s apart (:func:`prorsa.k8s.objects.engine_pod`)."""

CAUSE_TEXT = {
    "PodNotRunning": "pod not running",
    "AgentTimeout": "agent health check timed out",
    "AgentUnreachable": "agent unreachable",
    "AgentUntrusted": "agent certificate not trusted",
    "AgentError": "agent answers wrongly",
    "EngineUnhealthy": "engine unhealthy",
    "EngineNotStarted": "engine not started",
}


@dataclass(frozen=True, slots=True)
class Unavailable:
    pod: str
    cause: str  # a key of CAUSE_TEXT: the Event's reason
    detail: str


@dataclass(frozen=True, slots=True)
class Availability:
    """One tick's verdict: the pods lost (with causes) and those still starting."""

    lost: tuple[Unavailable, ...] = ()
    starting: tuple[str, ...] = ()

    def message(self, expected: int) -> str:
        """The Degraded condition's message: how many, which, and why."""
        if not self.lost:
            return ""
        pods = "; ".join(f"{u.pod}: {u.detail}" for u in self.lost)
        return (
            f"{len(self.lost)} of {expected} engine(s) unavailable, the split is planned "
            f"over the others: {pods}"
        )[:1000]

    @property
    def reason(self) -> str:
        causes = {u.cause for u in self.lost}
        return causes.pop() if len(causes) == 1 else "EnginesUnavailable"


def _age_seconds(pod: Mapping[str, Any], now: datetime.datetime) -> float:
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    if not isinstance(created, str):
        return 0.0
    try:
        at = datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    return (now - at).total_seconds()


def assess(
    pods: list[dict[str, Any]],
    states: Mapping[str, EngineState],
    unanswered: Mapping[str, Unanswered],
    *,
    seen: set[str],
    now: datetime.datetime,
) -> Availability:
    """Sort the pods that are not available into lost (with a cause) and starting.

    ``seen`` holds the uids of pods that answered healthy before (updated here): a pod
    recreated under the same name starts afresh.
    """
    lost: list[Unavailable] = []
    starting: list[str] = []
    for pod in pods:
        meta = pod["metadata"]
        name, uid = meta["name"], str(meta.get("uid") or meta["name"])
        state = states.get(name)
        if state is not None and state.healthy:
            seen.add(uid)
            continue
        status = pod.get("status") or {}
        if state is not None:
            finding = Unavailable(name, "EngineUnhealthy", "its agent reports the engine unhealthy")
        elif name in unanswered:
            finding = Unavailable(name, unanswered[name].cause, unanswered[name].detail)
        else:
            phase = status.get("phase") or "Pending"
            finding = Unavailable(name, "PodNotRunning", f"the pod is {phase} with no IP")
            if status.get("podIP") and phase == "Running":
                finding = Unavailable(name, "PodNotRunning", "the pod's agent was not polled")
        if uid in seen:
            lost.append(finding)
        elif _age_seconds(pod, now) > STARTUP_GRACE_SECONDS:
            minutes = STARTUP_GRACE_SECONDS / 60
            lost.append(
                Unavailable(
                    name,
                    "EngineNotStarted",
                    f"not answering {minutes:.0f} min after its creation ({finding.detail})",
                )
            )
        else:
            starting.append(name)
    return Availability(lost=tuple(lost), starting=tuple(starting))


@dataclass
class DegradedReporter:
    """What has been said already, so that each cause is reported once, naming its pods."""

    reported: dict[str, frozenset[str]] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)  # pod -> the detail last logged

    def events(self, found: Availability) -> list[tuple[str, str, str]]:
        """(type, reason, message) of the Events this tick's verdict calls for."""
        out: list[tuple[str, str, str]] = []
        by_cause: dict[str, list[Unavailable]] = {}
        for u in found.lost:
            by_cause.setdefault(u.cause, []).append(u)
        for cause, found_pods in sorted(by_cause.items()):
            pods = frozenset(u.pod for u in found_pods)
            if pods - self.reported.get(cause, frozenset()):
                names = ", ".join(sorted(pods))
                details = "; ".join(f"{u.pod}: {u.detail}" for u in found_pods)
                out.append(
                    (
                        "Warning",
                        cause,
                        f"{names} unavailable ({CAUSE_TEXT.get(cause, cause)}): not switched, "
                        f"and the split is planned without them. {details}"[:1000],
                    )
                )
        if by_cause:
            self.reported = {c: frozenset(u.pod for u in us) for c, us in by_cause.items()}
        elif self.reported and not found.starting:
            # Said once every engine answers again (not while replacements still start).
            back = ", ".join(sorted(set().union(*self.reported.values())))
            out.append(("Normal", "EnginesAvailable", f"every engine answers again ({back})"))
            self.reported = {}
        return out

    def log_lines(self, found: Availability) -> list[tuple[bool, str]]:
        """(is a warning, line) for each pod whose availability or cause changed."""
        out: list[tuple[bool, str]] = []
        now = {u.pod: u.detail for u in found.lost}
        for pod, detail in sorted(now.items()):
            if self.details.get(pod) != detail:
                out.append((True, f"{pod} unavailable: {detail}"))
        for pod in sorted(set(self.details) - set(now)):
            again = "replaced, starting" if pod in found.starting else "available again"
            out.append((False, f"{pod} {again}"))
        self.details = now
        return out
