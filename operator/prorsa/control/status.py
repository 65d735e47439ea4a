"""What a RolloutCluster's status, metrics and Events say after each tick.

The status is written whole from one tick: the instances by role, the Decision that tick
made (target, forecast, capacity, accuracy), the switch history, the conditions (Ready,
Degraded, Switching, ForecastFresh, TrajectoryLimit) and the engine groups. A condition
keeps its ``lastTransitionTime`` until its status changes, and each Event is posted once
per change of cause, not once per tick.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from prorsa.clusters import WebhookCluster
from prorsa.control.availability import Availability, DegradedReporter, assess
from prorsa.control.events import EventPoster
from prorsa.control.metrics import OperatorMetrics
from prorsa.control.reconcile import Groups
from prorsa.core.decision import Decision
from prorsa.core.diagnostics import Diagnostics
from prorsa.core.readiness import readiness, role_counts
from prorsa.core.spec import RolloutClusterSpec
from prorsa.engines.agents import Unanswered
from prorsa.k8s.kube import Kube
from prorsa.switching.executor import utcnow
from prorsa_contract.agent_api import EngineState

log = logging.getLogger("prorsa.runtime")


@dataclass(kw_only=True)
class StatusWriter:
    namespace: str
    name: str
    kube: Kube
    metrics: OperatorMetrics
    handle: WebhookCluster
    post_event: EventPoster
    last_status: dict[str, Any] = field(default_factory=dict)
    conditions: dict[str, dict[str, str]] = field(default_factory=dict)
    _last_failure: str | None = None  # the failed tick last reported as an Event
    _limit_hits_seen: int = 0  # the handle's refusals at maxLiveTrajectories, as of a tick
    _seen: set[str] = field(default_factory=set)  # uids of pods that answered healthy
    _degraded: DegradedReporter = field(default_factory=DegradedReporter)
    _served: bool = False  # Ready once since this process began (core/readiness.py)

    def condition(self, kind: str, status: str, reason: str, message: str) -> None:
        old = self.conditions.get(kind)
        changed = old is None or old["status"] != status
        since = utcnow() if old is None or changed else old["lastTransitionTime"]
        self.conditions[kind] = {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
        }

    async def report_failure(self, exc: Exception) -> None:
        """Put a failed tick where ``kubectl describe`` shows it: the Degraded condition in
        the status and a Warning Event, once per distinct cause.

        A tick that keeps failing (say the API server refuses a call the chart's RBAC does
        not grant) never reaches :meth:`write`, so the status is patched here.
        """
        reason, message = tick_failure(exc)
        self.condition("Degraded", "True", reason, message)
        if message != self._last_failure:
            self._last_failure = message
            with contextlib.suppress(Exception):  # the event is best effort
                await self.post_event("Warning", reason, message)
        try:
            conditions = {"conditions": list(self.conditions.values())}
            await self.kube.patch_status(self.namespace, self.name, conditions)
        except Exception:
            log.warning(
                "%s/%s: could not report the failure in the status",
                self.namespace,
                self.name,
                exc_info=True,
            )

    async def trajectory_limit(self, spec: RolloutClusterSpec) -> None:
        """The TrajectoryLimit condition: True when the webhook refused new trajectories
        at ``spec.trainer.maxLiveTrajectories`` since the previous tick; a Warning Event
        when it turns True."""
        hits = self.handle.limit_hits - self._limit_hits_seen
        self._limit_hits_seen = self.handle.limit_hits
        limit = spec.trainer.max_live_trajectories
        live = len(self.handle.controller.table)
        if not hits:
            self.condition(
                "TrajectoryLimit", "False", "BelowLimit", f"{live} of {limit} live trajectories"
            )
            return
        was = (self.conditions.get("TrajectoryLimit") or {}).get("status") == "True"
        message = (
            f"{hits} request(s) refused new trajectories since the last tick: {live} live, at "
            f"spec.trainer.maxLiveTrajectories ({limit}); the trainer resends them after "
            "Retry-After, nothing accepted is lost"
        )
        self.condition("TrajectoryLimit", "True", "MaxLiveTrajectories", message)
        if not was:
            await self.post_event("Warning", "TrajectoryLimit", message)

    async def _assess(
        self,
        pods: list[dict[str, Any]],
        states: dict[str, EngineState],
        unanswered: dict[str, Unanswered],
    ) -> Availability:
        """This tick's unavailable engines: logged and posted as Events once per change
        (:mod:`prorsa.control.availability`)."""
        found = assess(
            pods, states, unanswered, seen=self._seen, now=datetime.datetime.now(datetime.UTC)
        )
        for warning, line in self._degraded.log_lines(found):
            (log.warning if warning else log.info)("%s/%s: %s", self.namespace, self.name, line)
        for kind, reason, message in self._degraded.events(found):
            await self.post_event(kind, reason, message)
        return found

    def _record(self, decision: Decision, roles: dict[str, int]) -> Diagnostics:
        """The tick's figures as metrics; each from the tick that made ``decision``, not
        from the Controller, which the next tick may be updating in a worker thread."""
        ns, name = self.namespace, self.name
        for role, count in roles.items():
            self.metrics.instances.labels(ns, name, role).set(count)
        diag = decision.diagnostics
        if diag is None:
            raise ValueError("a Decision from the Controller carries its diagnostics")
        a, b = diag.demand
        self.metrics.record_decision(
            ns,
            name,
            decision,
            demand_prefill=a,
            demand_decode=b,
            kv_now=diag.kv_now,
            planned=diag.planned,
            cache_hit_ratio=diag.cache_hit_ratio,
            cache_floor=diag.cache_floor,
        )
        for kind, value in (("prefill", diag.prefill_wape), ("decode", diag.decode_wape)):
            if value is not None:
                self.metrics.wape.labels(ns, name, kind).set(value)
        for state_name, count in diag.trajectories.items():
            self.metrics.trajectories.labels(ns, name, state_name).set(count)
        self.metrics.record_outcomes(ns, name, diag)
        last = diag.last_event_ts
        silence = math.inf if last is None else max(0.0, decision.at - last)
        if math.isfinite(silence):
            self.metrics.forecast_age.labels(ns, name).set(silence)
        return diag

    async def write(
        self,
        decision: Decision,
        pods: list[dict[str, Any]],
        states: dict[str, EngineState],
        *,
        unanswered: dict[str, Unanswered],
        spec: RolloutClusterSpec,
        generation: int,
        history: list[dict[str, Any]],
        groups: Groups,
    ) -> None:
        roles = role_counts(states.get(pod["metadata"]["name"]) for pod in pods)
        diag = self._record(decision, roles)
        expected = spec.instances
        fresh = decision.mode == "predictive"
        self.condition(
            "ForecastFresh",
            "True" if fresh else "False",
            "TrainerEvents" if fresh else "NoTrainerEvents",
            "forecasting from trainer lifecycle events"
            if fresh
            else "no recent trainer events: deciding from engine states alone",
        )
        switching = roles["switching"] > 0
        self.condition(
            "Switching",
            "True" if switching else "False",
            "SwitchInProgress" if switching else "Idle",
            f"{roles['switching']} instance(s) switching" if switching else "",
        )
        found = await self._assess(pods, states, unanswered)
        degraded = bool(found.lost)
        self.condition(
            "Degraded",
            "True" if degraded else "False",
            found.reason if degraded else "AllEnginesAvailable",
            found.message(expected),
        )
        verdict = readiness(
            expected=expected,
            prefill=roles["prefill"],
            decode=roles["decode"],
            switching=roles["switching"],
            degraded=degraded,
            served_before=self._served,
        )
        ready = verdict.ready
        self._served = self._served or ready
        starting = f"; starting: {', '.join(found.starting)}" if found.starting else ""
        self.condition(
            "Ready",
            "True" if ready else "False",
            verdict.reason,
            f"{verdict.message}{starting}"[:1000],
        )
        target = decision.target
        phase = "Running" if ready else ("Degraded" if degraded else "Pending")
        status = {
            "phase": phase,
            "observedGeneration": generation,
            "instances": roles,
            "target": {
                "prefill": target.prefill,
                "decode": target.decode,
                "split": f"{target.prefill}P:{target.decode}D",
                "safetyMargin": decision.safety_margin,
                "reason": decision.reason,
                "at": utcnow(),
                "mode": decision.mode,
            },
            "forecast": decision.forecast.model_dump(by_alias=True),
            "capacity": decision.capacity.model_dump(by_alias=True),
            "accuracy": {"prefillWape": diag.prefill_wape, "decodeWape": diag.decode_wape},
            "switchHistory": history,
            "conditions": list(self.conditions.values()),
            "epoch": str(self.handle.epoch),
            "groups": {
                "nodesPerInstance": groups.nodes_per_instance,
                "pods": groups.pods,
                "managedBy": groups.managed_by,
            },
        }
        self.last_status = status
        await self.kube.patch_status(self.namespace, self.name, status)
        self._last_failure = None  # a cause that comes back is reported again


def tick_failure(exc: Exception) -> tuple[str, str]:
    """The Degraded reason and message for a failed tick.

    An API server refusal carries the server's own sentence (which verb on which resource,
    for whom); a 403 also says how to fix it, since the usual cause is RBAC the chart did
    not grant, such as LeaderWorkerSets installed after the chart.
    """
    if not isinstance(exc, ApiException):
        return "TickFailed", repr(exc)[:300]
    detail = exc.reason or ""
    try:
        body = json.loads(exc.body or "")
        detail = str(body.get("message") or detail) if isinstance(body, dict) else detail
    except ValueError:
        pass
    if exc.status == 403:
        return "Forbidden", (
            f"the API server refused a call: {detail}. Grant the operator that permission "
            "(helm upgrade with the chart; rbac.leaderWorkerSets=true for LeaderWorkerSets)"
        )[:600]
    return "APIError", f"the API server answered {exc.status}: {detail}"[:600]
