"""The switch executor: Appendix C as six crash-safe steps on one engine pod.

1. (Controller) pick the instance; 2. write the intent annotation and relabel the pod
``draining`` (it then matches neither router selector), wait until the router has dropped
it; 3–4. ask the agent to drain, abort, flip and verify (``POST /v1/role``); 5. relabel the
pod with its new role and clear the intent; 6. on failure, label the role the engine reports when it
says restoring is safe, else delete the pod so that it is recreated. When its agent cannot
be reached at all, the role is unknown: the pod keeps ``draining`` (out of the router) and
loses its intent, and the runtime's label reconcile labels it once the agent answers.

The intent annotation makes every step resumable: an operator that restarts mid-switch
finds it on the pod and finishes the switch (the agent's role call is idempotent) or rolls
it back, so no pod is left ``draining``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prorsa.core.decision import Switch
from prorsa.k8s import groups, lws
from prorsa.k8s.agents import AgentClient, RouterClient, agent_address
from prorsa.k8s.kube import Kube
from prorsa_contract.agent_api import Role, RoleRequest, RoleResult
from prorsa_contract.labels import (
    DRAINING,
    GROUP_LABEL,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
    RoleLabel,
    parse_intent,
    switch_intent,
)

log = logging.getLogger("prorsa.executor")


def utcnow() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchOutcome:
    pod: str
    origin: Role
    to: Role
    started: str
    seconds: float
    result: str  # "succeeded" | "restored" | "replaced" | "lost"
    message: str = ""
    aborted_requests: int = 0

    def record(self) -> dict[str, Any]:
        return {
            "pod": self.pod,
            "from": self.origin,
            "to": self.to,
            "started": self.started,
            "seconds": round(self.seconds, 3),
            "result": self.result,
        }


@dataclass(kw_only=True)
class ExecutorSettings:
    agent_port: int = 8080
    drain_timeout: float = 30.0
    router_url: str | None = None  # None: no router to wait for
    router_settle_timeout: float = 30.0
    poll_interval: float = 0.5


@dataclass(kw_only=True)
class SwitchExecutor:
    """Runs the switches of one RolloutCluster, each as its own asyncio task."""

    kube: Kube
    agents: AgentClient
    router: RouterClient | None
    namespace: str
    token: Callable[[], str]
    settings: ExecutorSettings
    ca: Callable[[], str | None] = lambda: None
    """PEM of the CA the cluster's agents' certificate comes from (agent_tls.py)."""
    on_done: Callable[[SwitchOutcome], Awaitable[None]]
    active: dict[str, asyncio.Task[SwitchOutcome]] = field(default_factory=dict)
    history: deque[SwitchOutcome] = field(default_factory=lambda: deque(maxlen=5))

    closed: bool = False

    def busy(self) -> set[str]:
        return set(self.active)

    def start(self, switch: Switch, *, pod: dict[str, Any]) -> bool:
        """Begin a switch unless that pod is already switching or the executor is closed."""
        name = pod["metadata"]["name"]
        if name in self.active or self.closed:
            return False
        task = asyncio.create_task(self._run(pod, switch.from_, switch.to, resume=False))
        self._track(name, task)
        return True

    def resume(self, pod: dict[str, Any]) -> bool:
        """Finish a switch whose intent a previous operator process left on the pod."""
        name = pod["metadata"]["name"]
        intent = parse_intent((pod["metadata"].get("annotations") or {}).get(SWITCH_ANNOTATION))
        if intent is None or name in self.active or self.closed:
            return False
        to = intent["to"]
        origin: Role = intent.get("from") or ("decode" if to == "prefill" else "prefill")
        task = asyncio.create_task(
            self._run(pod, origin, to, resume=True, started=intent.get("started"))
        )
        self._track(name, task)
        return True

    def _track(self, name: str, task: asyncio.Task[SwitchOutcome]) -> None:
        self.active[name] = task

        def done(t: asyncio.Task[SwitchOutcome]) -> None:
            self.active.pop(name, None)
            if not t.cancelled() and t.exception() is not None:
                log.error("switch of %s crashed: %r", name, t.exception())

        task.add_done_callback(done)

    async def cancel_all(self) -> None:
        """Stop watching switches (operator shutdown); intents stay for the next process.

        Closes the executor first: a tick still running cannot start a switch that would
        outlive this call and talk to an agent through a client about to be closed.
        """
        self.closed = True
        while self.active:
            tasks = list(self.active.values())
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for name in [n for n, t in self.active.items() if t.done()]:
                self.active.pop(name, None)

    async def _run(
        self,
        pod: dict[str, Any],
        origin: Role,
        to: Role,
        *,
        resume: bool,
        started: str | None = None,
    ) -> SwitchOutcome:
        name = pod["metadata"]["name"]
        started = started or utcnow()
        t0 = time.monotonic()
        ns = self.namespace
        s = self.settings

        def outcome(result: str, message: str, res: RoleResult | None = None) -> SwitchOutcome:
            return SwitchOutcome(
                pod=name,
                origin=origin,
                to=to,
                started=started,
                seconds=time.monotonic() - t0,
                result=result,
                message=message,
                aborted_requests=res.aborted_requests if res else 0,
            )

        # Step 2: intent first, so a crash from here on is recoverable; then leave the router.
        intent = switch_intent(to=to, phase="draining", started=started, origin=origin)
        await self.kube.patch_pod(
            ns,
            name,
            {
                "metadata": {
                    "labels": {ROLE_LABEL: DRAINING},
                    "annotations": {SWITCH_ANNOTATION: intent},
                }
            },
        )
        # A multi-node group drains as one (its workers are no router workers, but every pod
        # of an instance shows the instance's role).
        grouped = GROUP_LABEL in (pod["metadata"].get("labels") or {})
        if grouped:
            await groups.label_workers(self.kube, ns, name, DRAINING)
        ip = (pod.get("status") or {}).get("podIP")
        if self.router is not None and s.router_url and ip:
            await self._wait_router_drop(ip)

        # Steps 3–4: the agent drains, aborts what is left, flips and verifies.
        address = agent_address(pod, port=s.agent_port, ca=self.ca())
        if address is None:
            fresh = await self.kube.get_pod(ns, name)
            address = agent_address(fresh, port=s.agent_port, ca=self.ca()) if fresh else None
        if address is None:
            result = RoleResult(ok=False, safe_to_restore=True, message="pod has no IP")
        else:
            phase = switch_intent(to=to, phase="switching", started=started, origin=origin)
            await self.kube.patch_pod(
                ns, name, {"metadata": {"annotations": {SWITCH_ANNOTATION: phase}}}
            )
            request = RoleRequest(role=to, drain_timeout_seconds=s.drain_timeout)
            result = await self.agents.set_role(address, request=request, token=self.token())

        # Steps 5–6.
        if result.ok:
            await self._relabel(name, to, grouped=grouped)
            done = outcome("succeeded", result.message or f"{origin} -> {to}", result)
        elif result.safe_to_restore:
            # Label the role the engine is actually in: a switch can fail after the flip
            # (verification) or be refused once it already happened. An agent that does not
            # answer leaves the role unknown; a guess would route requests to the wrong
            # side, so the pod stays out of the router until the reconcile sees its role.
            state = await self.agents.state(address) if address else None
            if state is not None:
                await self._relabel(name, state.role, grouped=grouped)
                done = outcome("restored", result.message, result)
            elif address is None:
                # Never reached: unchanged.
                await self._relabel(name, result.old_role or origin, grouped=grouped)
                done = outcome("restored", result.message, result)
            else:
                await self._relabel(name, DRAINING, grouped=grouped)
                done = outcome("lost", f"engine role unknown: {result.message}", result)
        else:
            # A multi-node group is replaced whole: its other ranks cannot join a new rank 0.
            # A LeaderWorkerSet's controller recreates the group once its leader goes (the
            # workers are the leader's dependents); deleting them too would restart the
            # group it recreates.
            await self.kube.delete_pod(ns, name)
            if grouped and not lws.owned(pod):
                await groups.delete_workers(self.kube, ns, name)
            done = outcome("replaced", result.message or "engine unhealthy after a failed switch")
        self.history.append(done)
        await self.on_done(done)
        return done

    async def _relabel(self, name: str, role: RoleLabel, *, grouped: bool) -> None:
        # Workers first: the leader's label and intent go last, so a crash in between
        # leaves the intent, and the next operator finishes the whole group.
        if grouped:
            await groups.label_workers(self.kube, self.namespace, name, role)
        await self.kube.patch_pod(
            self.namespace,
            name,
            {"metadata": {"labels": {ROLE_LABEL: role}, "annotations": {SWITCH_ANNOTATION: None}}},
        )

    async def _wait_router_drop(self, ip: str) -> None:
        assert self.router is not None and self.settings.router_url
        deadline = time.monotonic() + self.settings.router_settle_timeout
        while time.monotonic() < deadline:
            listed = await self.router.lists(self.settings.router_url, ip)
            if listed is False:
                return
            await asyncio.sleep(self.settings.poll_interval)
        log.warning(
            "router still lists %s after %.0fs; switching anyway",
            ip,
            self.settings.router_settle_timeout,
        )
