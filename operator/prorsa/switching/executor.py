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
    CLUSTER_LABEL,
    DRAINING,
    GROUP_LABEL,
    NODE_RANK_LABEL,
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
    # Where the seconds went (prorsa_switch_part_duration_seconds): from the ``draining``
    # label until the router confirmed it dropped the pod, and the agent's role call
    # (drain, abort, flip, verify; the agent's own histograms split it). None: the switch
    # never reached that step.
    router_seconds: float | None = None
    engine_seconds: float | None = None

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

        marks: dict[str, float] = {}

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
                router_seconds=marks.get("router"),
                engine_seconds=marks.get("engine"),
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
        waits = self.router is not None and bool(s.router_url)
        dropped = not (waits and ip) or await self._wait_router_drop(pod, ip)
        marks["router"] = time.monotonic() - t0
        if not dropped:
            # A flip now could leave the router sending the old role's requests to the new
            # role (decode requests answered with a prefill engine's single token). Undo
            # step 2 instead; the Controller asks again. A resumed switch may have flipped
            # already: its label follows what the agent reports.
            message = (
                f"router did not confirm it dropped {ip} within "
                f"{s.router_settle_timeout:.0f}s; not switched"
            )
            role: RoleLabel = origin
            if resume:
                address = agent_address(pod, port=s.agent_port, ca=self.ca())
                state = await self.agents.state(address) if address else None
                role = state.role if state is not None else DRAINING
            await self._relabel(name, role, grouped=grouped)
            done = outcome("restored" if role != DRAINING else "lost", message)
            self.history.append(done)
            await self.on_done(done)
            return done

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
            called = time.monotonic()
            result = await self.agents.set_role(address, request=request, token=self.token())
            marks["engine"] = time.monotonic() - called

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

    async def _wait_router_drop(self, pod: dict[str, Any], ip: str) -> bool:
        """Whether the router has settled without the pod (False: not within the timeout).

        Its absence from ``GET /workers`` counts only while the router lists every other
        pod it should route to, twice in a row. A router that has just restarted lists
        nothing until its registrations finish (seconds, each one a background job), and a
        registration that started before the ``draining`` label still ends by adding the
        pod under its old role; an empty list then means "not known yet", not "dropped".
        smg's ``/readiness`` cannot tell: in PD mode it answers 503 while either role has
        no worker, which is the case whenever the last worker of a role is switched.
        """
        assert self.router is not None and self.settings.router_url
        deadline = time.monotonic() + self.settings.router_settle_timeout
        settled = 0
        answered = False
        while time.monotonic() < deadline:
            view = await self.router.view(self.settings.router_url)
            answered = answered or view is not None
            if view is not None and not view.lists(ip):
                missing = [o for o in await self._routable_ips(pod) if not view.lists(o)]
                settled = 0 if missing else settled + 1
                if settled >= 2:
                    return True
            else:
                settled = 0
            await asyncio.sleep(self.settings.poll_interval)
        if not answered:
            # No router process answered at all (down, or not deployed yet): one that
            # starts from now on reads the pod's ``draining`` label and never registers
            # it. Only a router that answers can hold a stale registration.
            log.warning(
                "router at %s did not answer for %.0fs; switching %s",
                self.settings.router_url,
                self.settings.router_settle_timeout,
                ip,
            )
            return True
        log.warning(
            "router has not settled without %s after %.0fs; not switching",
            ip,
            self.settings.router_settle_timeout,
        )
        return False

    async def _routable_ips(self, pod: dict[str, Any]) -> set[str]:
        """The addresses the router's selectors match now, the switching pod's excluded:
        its cluster's pods labelled prefill or decode, Running and Ready, leaders only
        (objects.router_args)."""
        labels = pod["metadata"].get("labels") or {}
        cluster = labels.get(CLUSTER_LABEL)
        if cluster is None:
            return set()
        ips = set()
        for other in await self.kube.list_pods(self.namespace, f"{CLUSTER_LABEL}={cluster}"):
            meta = other["metadata"]
            if meta["name"] == pod["metadata"]["name"] or meta.get("deletionTimestamp"):
                continue
            other_labels = meta.get("labels") or {}
            if other_labels.get(ROLE_LABEL) not in ("prefill", "decode"):
                continue
            if other_labels.get(NODE_RANK_LABEL, "0") != "0":
                continue
            status = other.get("status") or {}
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or []
            )
            if status.get("phase") == "Running" and ready and status.get("podIP"):
                ips.add(status["podIP"])
        return ips
