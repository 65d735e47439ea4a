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

Which step follows which is decided by :func:`prorsa.switching.steps.next_step`, with no
I/O; this module performs each step's calls on the pod (read once as a
:class:`~prorsa.switching.pod_view.PodView`), its router and its agent.
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
from prorsa.engines.agents import AgentAddress, AgentClient, RouterClient
from prorsa.k8s import groups
from prorsa.k8s.kube import Kube
from prorsa.switching.pod_view import PodView
from prorsa.switching.steps import (
    AgentFound,
    Done,
    Ended,
    Flipped,
    Observation,
    RoleRead,
    RouterSettled,
    Step,
    SwitchResult,
    SwitchState,
    begin,
    next_step,
)
from prorsa_contract.agent_api import Role, RoleRequest
from prorsa_contract.labels import (
    CLUSTER_LABEL,
    DRAINING,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
    RoleLabel,
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
    result: SwitchResult
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
class _Run:
    """What one switch's steps learn as they go (the I/O side; :class:`SwitchState` holds
    the decisions)."""

    pod: PodView
    started: str
    t0: float
    address: AgentAddress | None = None
    """The agent the flip was sent to (FIND_AGENT)."""
    router_seconds: float | None = None
    engine_seconds: float | None = None


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

    def start(self, switch: Switch, *, pod: PodView) -> bool:
        """Begin a switch unless that pod is already switching or the executor is closed."""
        if pod.name in self.active or self.closed:
            return False
        task = asyncio.create_task(self._run(pod, switch.from_, switch.to, resume=False))
        self._track(pod.name, task)
        return True

    def resume(self, pod: PodView) -> bool:
        """Finish a switch whose intent a previous operator process left on the pod."""
        intent = pod.intent
        if intent is None or pod.name in self.active or self.closed:
            return False
        to = intent["to"]
        origin: Role = intent.get("from") or ("decode" if to == "prefill" else "prefill")
        task = asyncio.create_task(
            self._run(pod, origin, to, resume=True, started=intent.get("started"))
        )
        self._track(pod.name, task)
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
        pod: PodView,
        origin: Role,
        to: Role,
        *,
        resume: bool,
        started: str | None = None,
    ) -> SwitchOutcome:
        """Perform each step's calls and ask :func:`next_step` for the next, until it ends."""
        run = _Run(pod=pod, started=started or utcnow(), t0=time.monotonic())
        state: SwitchState | Ended = begin(origin=origin, to=to, resume=resume)
        while isinstance(state, SwitchState):
            state = next_step(state, await self._perform(state, run))
        done = SwitchOutcome(
            pod=pod.name,
            origin=origin,
            to=to,
            started=run.started,
            seconds=time.monotonic() - run.t0,
            result=state.result,
            message=state.message,
            aborted_requests=state.aborted_requests,
            router_seconds=run.router_seconds,
            engine_seconds=run.engine_seconds,
        )
        self.history.append(done)
        await self.on_done(done)
        return done

    async def _perform(self, state: SwitchState, run: _Run) -> Observation:
        """The calls of ``state.step``, and what they saw."""
        pod, ns, s = run.pod, self.namespace, self.settings
        match state.step:
            case Step.LEAVE_ROUTER:
                # Intent first, so a crash from here on is recoverable; then leave the router.
                intent = switch_intent(
                    to=state.to, phase="draining", started=run.started, origin=state.origin
                )
                labels = {ROLE_LABEL: DRAINING}
                await self.kube.patch_pod(
                    ns,
                    pod.name,
                    {"metadata": {"labels": labels, "annotations": {SWITCH_ANNOTATION: intent}}},
                )
                # A multi-node group drains as one (its workers are no router workers, but
                # every pod of an instance shows the instance's role).
                if pod.grouped:
                    await groups.label_workers(self.kube, ns, pod.name, DRAINING)
                return Done()
            case Step.AWAIT_ROUTER:
                waits = self.router is not None and bool(s.router_url)
                dropped = not (waits and pod.ip) or await self._wait_router_drop(pod)
                run.router_seconds = time.monotonic() - run.t0
                return RouterSettled(dropped=dropped, ip=pod.ip, timeout=s.router_settle_timeout)
            case Step.FIND_AGENT:
                run.address = pod.agent_address(port=s.agent_port, ca=self.ca())
                if run.address is None:
                    fresh = await self.kube.get_pod(ns, pod.name)
                    if fresh is not None:
                        view = PodView.from_manifest(fresh)
                        run.address = view.agent_address(port=s.agent_port, ca=self.ca())
                return AgentFound(found=run.address is not None)
            case Step.FLIP:
                assert run.address is not None  # FIND_AGENT found it
                phase = switch_intent(
                    to=state.to, phase="switching", started=run.started, origin=state.origin
                )
                await self.kube.patch_pod(
                    ns, pod.name, {"metadata": {"annotations": {SWITCH_ANNOTATION: phase}}}
                )
                request = RoleRequest(role=state.to, drain_timeout_seconds=s.drain_timeout)
                called = time.monotonic()
                result = await self.agents.set_role(
                    run.address, request=request, token=self.token()
                )
                run.engine_seconds = time.monotonic() - called
                return Flipped(result=result)
            case Step.READ_ROLE:
                # After a refused flip, the agent it was sent to; on a resumed switch the
                # router kept, the pod's.
                address = run.address or pod.agent_address(port=s.agent_port, ca=self.ca())
                engine = await self.agents.state(address) if address else None
                return RoleRead(role=engine.role if engine is not None else None)
            case Step.RELABEL:
                assert state.label is not None  # next_step names the label with the step
                await self._relabel(pod.name, state.label, grouped=pod.grouped)
                return Done()
            case Step.REPLACE:
                # A LeaderWorkerSet's controller recreates the group once its leader goes
                # (the workers are the leader's dependents); deleting them too would restart
                # the group it recreates.
                await self.kube.delete_pod(ns, pod.name)
                if pod.grouped and not pod.lws_owned:
                    await groups.delete_workers(self.kube, ns, pod.name)
                return Done()

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

    async def _wait_router_drop(self, pod: PodView) -> bool:
        """Whether the router has settled without the pod (False: not within the timeout).

        Its absence from ``GET /workers`` counts only while the router lists every other
        pod it should route to, twice in a row. A router that has just restarted lists
        nothing until its registrations finish (seconds, each one a background job), and a
        registration that started before the ``draining`` label still ends by adding the
        pod under its old role; an empty list then means "not known yet", not "dropped".
        smg's ``/readiness`` cannot tell: in PD mode it answers 503 while either role has
        no worker, which is the case whenever the last worker of a role is switched.
        """
        assert self.router is not None and self.settings.router_url and pod.ip
        ip = pod.ip
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

    async def _routable_ips(self, pod: PodView) -> set[str]:
        """The addresses the router's selectors match now, the switching pod's excluded:
        its cluster's pods labelled prefill or decode, Running and Ready, leaders only
        (objects.router_args)."""
        if pod.cluster is None:
            return set()
        listed = await self.kube.list_pods(self.namespace, f"{CLUSTER_LABEL}={pod.cluster}")
        others = (PodView.from_manifest(other) for other in listed)
        return {o.ip for o in others if o.name != pod.name and o.routable() and o.ip}
