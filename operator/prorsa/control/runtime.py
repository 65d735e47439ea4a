"""One RolloutCluster at run time: the loop that composes its parts.

The loop runs every ``forecast.horizonSeconds``: make the objects match the spec
(:class:`~prorsa.control.reconcile.Reconciler`), poll every agent concurrently
(:class:`~prorsa.control.polling.AgentPoller`), relabel what drifted, feed the Controller
through the webhook's handle (which serialises access and runs ticks off the event loop),
carry out what the core's actions stage (:mod:`prorsa.core.actions`: the bootstrap and
the ``switching.mode`` gate) returns through the switch executor, and write status,
metrics and Events (:class:`~prorsa.control.status.StatusWriter`). What is left here is
the lifecycle: set-up, the loop, spec changes, closing and persisting what was learned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prorsa.clusters import WebhookCluster
from prorsa.control.credentials import AgentCredentials
from prorsa.control.events import EventPoster
from prorsa.control.learned import LearnedStore
from prorsa.control.metrics import OperatorMetrics
from prorsa.control.polling import AgentPoller
from prorsa.control.reconcile import Reconciler
from prorsa.control.status import StatusWriter
from prorsa.core.actions import ActionState, decide_actions
from prorsa.core.decision import Decision, Switch
from prorsa.core.spec import RolloutClusterSpec
from prorsa.engines.agents import AgentClient, RouterClient
from prorsa.k8s import groups
from prorsa.k8s import objects as obj
from prorsa.k8s.kube import Kube
from prorsa.switching.executor import ExecutorSettings, SwitchExecutor, SwitchOutcome
from prorsa.switching.pod_view import PodView
from prorsa_contract.labels import AGENT_PORT, SWITCH_ANNOTATION, parse_intent

log = logging.getLogger("prorsa.runtime")

PERSIST_EVERY_TICKS = 6
# How long closing waits for a tick in progress to end before it cancels the loop.
LOOP_STOP_TIMEOUT = 30.0
__all__ = ["ClusterLoopSettings", "ClusterRuntime", "EventPoster"]


@dataclass(kw_only=True)
class ClusterLoopSettings:
    """What every cluster's control loop is given: where agents and routers listen, the
    tick, persistence (from ``prorsa operator``'s flags, part of :class:`OperatorSettings`)."""

    agent_port: int = AGENT_PORT
    router_url_template: str = "http://{name}-router.{namespace}.svc:{port}"
    router_settle_timeout: float = 30.0
    tick_seconds: float | None = None  # None: each cluster's forecast.horizonSeconds
    persist: bool = True


@dataclass(kw_only=True)
class ClusterRuntime:
    namespace: str
    name: str
    spec: RolloutClusterSpec
    uid: str
    handle: WebhookCluster
    kube: Kube
    agents: AgentClient
    metrics: OperatorMetrics
    options: ClusterLoopSettings
    post_event: EventPoster
    generation: int = 0
    executor: SwitchExecutor | None = None
    actions: ActionState = field(default_factory=ActionState)  # the bootstrap and the gate's
    ticks: int = 0
    group_manager: str = groups.OPERATOR_MANAGED
    # The parts it composes (made from the fields above).
    credentials: AgentCredentials = field(init=False)
    learned: LearnedStore = field(init=False)
    reconciler: Reconciler = field(init=False)
    poller: AgentPoller = field(init=False)
    status: StatusWriter = field(init=False)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _loop: asyncio.Task[None] | None = None
    _shutdown: asyncio.Future[None] | None = None
    _closing: asyncio.Future[None] | None = None

    def __post_init__(self) -> None:
        self.handle.on_weight_update = self.wake
        ns, name = self.namespace, self.name
        self.credentials = AgentCredentials(namespace=ns, name=name, uid=self.uid, kube=self.kube)
        self.learned = LearnedStore(
            namespace=ns,
            name=name,
            kube=self.kube,
            handle=self.handle,
            enabled=self.options.persist,
        )
        self.reconciler = Reconciler(
            namespace=ns,
            name=name,
            kube=self.kube,
            metrics=self.metrics,
            post_event=self.post_event,
            owned=self._owned,
            busy=self._busy,
            ensure_agent_tls=self.credentials.ensure_tls,
            group_manager=self.group_manager,
        )
        self.poller = AgentPoller(
            namespace=ns,
            name=name,
            agents=self.agents,
            metrics=self.metrics,
            ca=lambda: self.credentials.ca,
            busy=self._busy,
            agent_port=self.options.agent_port,
        )
        self.status = StatusWriter(
            namespace=ns,
            name=name,
            kube=self.kube,
            metrics=self.metrics,
            handle=self.handle,
            post_event=self.post_event,
        )

    def _busy(self) -> set[str]:
        """Pods with a switch of this process in flight (the executor is made at set-up)."""
        return self.executor.busy() if self.executor else set()

    # -- set-up --------------------------------------------------------------------------------

    def _owned(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return obj.owned(manifest, cluster=self.name, uid=self.uid)

    def router_url(self) -> str | None:
        if not self.spec.router.enabled:
            return None
        return self.options.router_url_template.format(
            name=self.name, namespace=self.namespace, port=obj.ROUTER_PORT
        )

    async def setup(self) -> None:
        """Secret, services, router; the executor; switches a previous process left."""
        ns, name = self.namespace, self.name
        self.metrics.start_cluster(ns, name)
        await self.credentials.ensure()
        await self.kube.ensure(self._owned(obj.engines_service(cluster=name, namespace=ns)))
        if self.spec.router.enabled:
            for manifest in obj.router_objects(cluster=name, namespace=ns, spec=self.spec):
                await self.kube.ensure(self._owned(manifest))
        router_url = self.router_url()
        self.executor = SwitchExecutor(
            kube=self.kube,
            agents=self.agents,
            router=RouterClient(client=self.agents._client) if router_url else None,
            namespace=ns,
            token=lambda: self.credentials.token,
            ca=lambda: self.credentials.ca,
            settings=ExecutorSettings(
                agent_port=self.options.agent_port,
                drain_timeout=self.spec.switching.drain_timeout_seconds,
                router_url=router_url,
                router_settle_timeout=self.options.router_settle_timeout,
            ),
            on_done=self._switch_done,
        )
        await self.learned.restore()
        for pod in await self.kube.list_pods(ns, self.reconciler.selector):
            if self.executor.resume(PodView.from_manifest(pod)):
                pod_name = pod["metadata"]["name"]
                log.info("%s/%s: resuming the switch of %s", ns, name, pod_name)
                annotations = pod["metadata"].get("annotations") or {}
                intent = parse_intent(annotations.get(SWITCH_ANNOTATION))
                if intent is not None:
                    async with self.handle.exclusive() as controller:
                        controller.resume_switch(pod_name, to=intent["to"])

    async def update_spec(self, spec: RolloutClusterSpec) -> None:
        """A spec change, applied whole between two Controller calls.

        Under the handle's lock, so no tick or batch sees half the old spec and half the
        new; the Controller keeps what it learned (see :meth:`Controller.apply_spec`).
        """
        async with self.handle.exclusive() as controller:
            controller.apply_spec(spec)
            self.spec = spec
            if self.executor is not None:
                self.executor.settings.drain_timeout = spec.switching.drain_timeout_seconds
                self.executor.settings.router_url = self.router_url()

    # -- the loop ------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def start(self) -> asyncio.Task[None]:
        """Run the control loop as a task this runtime keeps, so closing can await it."""
        if self._loop is None:
            self._loop = asyncio.create_task(self.run(), name=f"prorsa-{self.name}")
        return self._loop

    def close(self) -> asyncio.Future[None]:
        """Stop the loop, wait for it, then cancel switches and persist; once, for every caller.

        The operator closes the shared agent client only after this: a switch started by
        the last tick must not outlive the client it calls agents through.
        """
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        return self._closing

    async def _close(self) -> None:
        self.stop()
        # Switches first: from here on their intents are for the next process to finish,
        # and a tick still running can start none.
        if self.executor is not None:
            await self.executor.cancel_all()
        loop = self._loop
        if loop is None:
            # Set-up never finished: nothing was restored, so nothing may be persisted over
            # what the last process saved.
            return
        if not loop.done():
            done, _ = await asyncio.wait({loop}, timeout=LOOP_STOP_TIMEOUT)
            if not done:
                loop.cancel()
                await asyncio.wait({loop})
        await self.shutdown()

    def wake(self) -> None:
        """Tick now instead of at the end of the period (a pod failed or was deleted, or
        the trainer announced a weight update)."""
        self._wake.set()

    @property
    def awaiting_engines(self) -> bool:
        """The bootstrap has not begun: it starts at the first tick that finds every engine
        answering, so an engine turning Ready is worth a tick now."""
        return not (self.actions.bootstrapped or self.actions.bootstrap_started)

    def on_pod_event(self, *, kind: str | None, pod: Mapping[str, Any]) -> bool:
        """Wake the loop for an engine pod's event that should not wait for the period:
        deleted or failed (replace it, move the split), or turned Ready before the
        bootstrap began (the trainer waits for Ready, and the bootstrap is what brings it;
        a period's wait is up to ``forecast.horizonSeconds`` added to every cluster's
        start). Returns whether it woke."""
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or ()
        )
        if (
            kind == "DELETED"
            or status.get("phase") == "Failed"
            or (ready and self.awaiting_engines)
        ):
            self.wake()
            return True
        return False

    async def run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    await self.tick_once()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # keep controlling; report
                    log.exception("%s/%s: tick failed", self.namespace, self.name)
                    await self.status.report_failure(exc)
                period = self.options.tick_seconds or self.spec.forecast.horizon_seconds
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=period)
                self._wake.clear()
        finally:
            # Also on cancellation (operator exit): what was learned survives the restart,
            # and switches in flight keep their intents for the next process to finish.
            await asyncio.shield(self.shutdown())

    async def shutdown(self) -> None:
        """Cancel switches in flight (their intents stay) and persist; once, however called."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._shut_down())
        await asyncio.shield(self._shutdown)

    async def _shut_down(self) -> None:
        if self.executor is not None:
            await self.executor.cancel_all()
        await self.learned.save()

    async def tick_once(self) -> Decision:
        self.ticks += 1
        pods = await self.reconciler.pods(self.spec)
        states = await self.poller.poll(pods)
        await self.reconciler.labels(pods, states)
        await self.handle.observe_engines(list(states.values()))
        start = time.perf_counter()
        decision = await self.handle.tick()
        self.metrics.tick_seconds.labels(self.namespace, self.name).observe(
            time.perf_counter() - start
        )
        mode = self.spec.switching.mode
        actions = decide_actions(
            decision=decision,
            mode=mode,
            spec=self.spec,
            states=states.values(),
            state=self.actions,
        )
        self.actions = actions.state
        started = await self._start_switches([o.switch for o in actions.execute], pods)
        if actions.decided:
            names = {s.instance for s in started}
            moves = [
                o.move for o in actions.execute if o.switch.instance in names and o.move is not None
            ]
            if moves:
                self.metrics.record_priced(self.namespace, self.name, moves, switching_mode=mode)
            if started and decision.diagnostics is not None:
                self.metrics.record_decision_wait(self.namespace, self.name, decision.diagnostics)
        if actions.announce:
            text = ", ".join(
                f"{o.switch.instance}: {o.switch.from_} -> {o.switch.to}" for o in actions.announce
            )
            await self.post_event("Normal", "SwitchRecommended", text)
            moves = [o.move for o in actions.announce if o.move is not None]
            self.metrics.record_priced(self.namespace, self.name, moves, switching_mode=mode)
        await self.status.trajectory_limit(self.spec)
        await self.status.write(
            decision,
            pods,
            states,
            unanswered=self.poller.unanswered,
            spec=self.spec,
            generation=self.generation,
            history=[o.record() for o in (self.executor.history if self.executor else [])],
            groups=self.reconciler.groups(self.spec),
        )
        if self.options.persist and self.ticks % PERSIST_EVERY_TICKS == 0:
            await self.learned.save()
        return decision

    async def _start_switches(
        self, switches: Iterable[Switch], pods: list[dict[str, Any]]
    ) -> list[Switch]:
        """Hand ``switches`` to the executor; returns those it started."""
        by_name = {p["metadata"]["name"]: PodView.from_manifest(p) for p in pods}
        started: list[Switch] = []
        for switch in switches:
            pod = by_name.get(switch.instance)
            if pod is not None and self.executor and self.executor.start(switch, pod=pod):
                started.append(switch)
                await self.post_event(
                    "Normal", "SwitchStarted", f"{switch.instance}: {switch.from_} -> {switch.to}"
                )
        return started

    async def _switch_done(self, outcome: SwitchOutcome) -> None:
        """A switch ended: counted, its instance's cooldown started, and an Event."""
        self.metrics.record_switch(self.namespace, self.name, outcome)
        ok = outcome.result == "succeeded"
        async with self.handle.exclusive() as controller:
            controller.record_switch(outcome.pod, at=self.handle.trainer_now())
        message = (
            f"{outcome.pod}: {outcome.origin} -> {outcome.to} {outcome.result} "
            f"in {outcome.seconds:.1f}s"
        )
        if outcome.message and not ok:
            message += f" ({outcome.message})"
        await self.post_event(
            "Normal" if ok else "Warning", f"Switch{outcome.result.title()}", message
        )
