"""One RolloutCluster at run time: its pods, its control loop, its status.

The loop runs every ``forecast.horizonSeconds``: make the objects match the spec (engine
pods by index, router, services), poll every agent concurrently, feed the Controller
through the webhook's handle (which serialises access and runs ticks off the event loop),
execute the Decision through the switch executor according to ``switching.mode``, and
write status, metrics and Kubernetes Events. Each tick also reconciles role labels with
what the agents report (:meth:`ClusterRuntime._reconcile_labels`): the router routes by
label, so a label that disagrees with its engine sends requests to the wrong side.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from prorsa.clusters import WebhookCluster
from prorsa.control.availability import Availability, DegradedReporter, assess
from prorsa.control.metrics import OperatorMetrics
from prorsa.core.actions import ActionState, decide_actions
from prorsa.core.decision import Decision, Switch
from prorsa.core.spec import RolloutClusterSpec
from prorsa.engines.agent_tls import issue_agent_cert
from prorsa.engines.agents import AgentClient, RouterClient, Unanswered, agent_address
from prorsa.k8s import groups, lws
from prorsa.k8s import objects as obj
from prorsa.k8s.executor import ExecutorSettings, SwitchExecutor, SwitchOutcome, utcnow
from prorsa.k8s.kube import Kube
from prorsa_contract.agent_api import EngineState
from prorsa_contract.labels import (
    AGENT_PORT,
    CLUSTER_LABEL,
    COMPONENT_LABEL,
    INDEX_LABEL,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
    agent_secret_name,
    agent_tls_secret_name,
    parse_intent,
)

log = logging.getLogger("prorsa.runtime")

PERSIST_EVERY_TICKS = 6
# How long closing waits for a tick in progress to end before it cancels the loop.
LOOP_STOP_TIMEOUT = 30.0
EventPoster = Callable[[str, str, str], Awaitable[None]]  # (type, reason, message)


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
    agent_token: str = ""
    agent_ca: str | None = None
    generation: int = 0
    executor: SwitchExecutor | None = None
    actions: ActionState = field(default_factory=ActionState)  # the bootstrap and the gate's
    ticks: int = 0
    last_status: dict[str, Any] = field(default_factory=dict)
    _conditions: dict[str, dict[str, str]] = field(default_factory=dict)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _last_failure: str | None = None  # the failed tick last reported as an Event
    _limit_hits_seen: int = 0  # the handle's refusals at maxLiveTrajectories, as of a tick
    _last_refusal: str | None = None  # the pod refusal last reported as an Event
    _unanswered: dict[str, Unanswered] = field(default_factory=dict)  # this tick's, by pod
    _seen: set[str] = field(default_factory=set)  # uids of pods that answered healthy
    _degraded: DegradedReporter = field(default_factory=DegradedReporter)
    group_manager: str = groups.OPERATOR_MANAGED
    engine_pods: int = 0
    _loop: asyncio.Task[None] | None = None
    _shutdown: asyncio.Future[None] | None = None
    _closing: asyncio.Future[None] | None = None

    def __post_init__(self) -> None:
        self.handle.on_weight_update = self.wake

    # -- set-up --------------------------------------------------------------------------------

    @property
    def uses_lws(self) -> bool:
        """Multi-node instances as LeaderWorkerSets (the API was found at start-up)."""
        return self.group_manager == groups.LWS_MANAGED and self.spec.engine.nodes_per_instance > 1

    @property
    def selector(self) -> str:
        return f"{CLUSTER_LABEL}={self.name},{COMPONENT_LABEL}=engine"

    def owner(self) -> dict[str, Any]:
        return {
            "apiVersion": "prorsa.io/v1alpha1",
            "kind": "RolloutCluster",
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def _owned(self, manifest: dict[str, Any]) -> dict[str, Any]:
        manifest["metadata"]["ownerReferences"] = [self.owner()]
        return manifest

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
        secret_name = agent_secret_name(name)
        token = await self.kube.read_secret_key(ns, secret_name, "token")
        if token is None:
            token = secrets.token_urlsafe(32)
            await self.kube.ensure(
                self._owned(obj.agent_secret(cluster=name, namespace=ns, token=token))
            )
            token = await self.kube.read_secret_key(ns, secret_name, "token") or token
        self.agent_token = token
        # Created once (ensure() leaves an existing one alone), before any engine pod mounts it.
        key = obj.engine_key_secret(cluster=name, namespace=ns, key=secrets.token_urlsafe(32))
        await self.kube.ensure(self._owned(key))
        await self._ensure_agent_tls()
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
            token=lambda: self.agent_token,
            ca=lambda: self.agent_ca,
            settings=ExecutorSettings(
                agent_port=self.options.agent_port,
                drain_timeout=self.spec.switching.drain_timeout_seconds,
                router_url=router_url,
                router_settle_timeout=self.options.router_settle_timeout,
            ),
            on_done=self._switch_done,
        )
        await self._restore_learned()
        for pod in await self.kube.list_pods(ns, self.selector):
            if self.executor.resume(pod):
                pod_name = pod["metadata"]["name"]
                log.info("%s/%s: resuming the switch of %s", ns, name, pod_name)
                annotations = pod["metadata"].get("annotations") or {}
                intent = parse_intent(annotations.get(SWITCH_ANNOTATION))
                if intent is not None:
                    async with self.handle.exclusive() as controller:
                        controller.resume_switch(pod_name, to=intent["to"])

    async def _ensure_agent_tls(self) -> None:
        """The agents' certificate Secret: issued once, then only its CA is read back.

        The Secret may also come from elsewhere (cert-manager, docs/security.md): whatever
        ``ca.crt`` it holds is the one CA trusted for this cluster's agents.
        """
        ns, name = self.namespace, self.name
        secret_name = agent_tls_secret_name(name)
        ca = await self.kube.read_secret_key(ns, secret_name, "ca.crt")
        if ca is None:
            issued = await asyncio.to_thread(issue_agent_cert, cluster=name, namespace=ns)
            manifest = obj.agent_tls_secret(
                cluster=name, namespace=ns, ca=issued.ca, cert=issued.cert, key=issued.key
            )
            await self.kube.ensure(self._owned(manifest))
            ca = await self.kube.read_secret_key(ns, secret_name, "ca.crt")
        if not ca:
            log.error(
                "%s/%s: Secret %s has no ca.crt: agents cannot be verified", ns, name, secret_name
            )
        self.agent_ca = ca or None

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

    async def run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    await self.tick_once()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # keep controlling; report
                    log.exception("%s/%s: tick failed", self.namespace, self.name)
                    await self._report_failure(exc)
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
        await self._persist()

    async def tick_once(self) -> Decision:
        self.ticks += 1
        pods = await self._reconcile_pods()
        states = await self._poll(pods)
        await self._reconcile_labels(pods, states)
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
        await self._trajectory_limit()
        await self._write_status(decision, pods, states)
        if self.options.persist and self.ticks % PERSIST_EVERY_TICKS == 0:
            await self._persist()
        return decision

    async def _start_switches(
        self, switches: Iterable[Switch], pods: list[dict[str, Any]]
    ) -> list[Switch]:
        """Hand ``switches`` to the executor; returns those it started."""
        by_name = {p["metadata"]["name"]: p for p in pods}
        started: list[Switch] = []
        for switch in switches:
            pod = by_name.get(switch.instance)
            if pod is not None and self.executor and self.executor.start(switch, pod=pod):
                started.append(switch)
                await self.post_event(
                    "Normal", "SwitchStarted", f"{switch.instance}: {switch.from_} -> {switch.to}"
                )
        return started

    async def _reconcile_pods(self) -> list[dict[str, Any]]:
        """One engine pod (or group) per index 0..n-1; failed ones are replaced, extra ones
        removed; a multi-node instance is a LeaderWorkerSet when :attr:`uses_lws`."""
        ns = self.namespace
        # Busy before and after the listing: a switch that replaced its group while the
        # list was in flight still owns what the list shows of it.
        busy = self.executor.busy() if self.executor else set()
        pods = await self.kube.list_pods(ns, self.selector)
        if self.executor:
            busy |= self.executor.busy()
        n = self.spec.instances
        by_index: dict[int, dict[str, Any]] = {}
        view = await groups.reconcile_groups(
            kube=self.kube,
            namespace=ns,
            pods=pods,
            nodes=self.spec.engine.nodes_per_instance,
            instances=n,
            busy=busy,
            post_event=self.post_event,
        )
        pods, self.engine_pods = view.leaders, view.pods
        sets: frozenset[int] = frozenset()
        if self.group_manager == groups.LWS_MANAGED:
            # Also with one node per instance: the sets of a former nodesPerInstance go.
            sets = await lws.reconcile_sets(
                kube=self.kube,
                namespace=ns,
                cluster=self.name,
                selector=self.selector,
                instances=n,
                nodes=self.spec.engine.nodes_per_instance,
                busy=busy,
                post_event=self.post_event,
            )
        for pod in pods:
            meta = pod["metadata"]
            try:
                index = int((meta.get("labels") or {}).get(INDEX_LABEL, "-1"))
            except ValueError:
                index = -1
            phase = (pod.get("status") or {}).get("phase")
            if meta.get("deletionTimestamp"):
                continue
            if index < 0 or index >= n:
                if meta["name"] not in busy and not lws.owned(pod):  # sets go with their pods
                    await self.kube.delete_pod(ns, meta["name"])
                    await self.post_event("Normal", "ScaledDown", f"removed {meta['name']}")
                continue
            if phase in ("Failed", "Succeeded"):
                await self.kube.delete_pod(ns, meta["name"])
                await self.post_event(
                    "Warning", "EngineFailed", f"{meta['name']} {phase}: replacing"
                )
                continue
            by_index[index] = pod
        if any(index not in by_index for index in range(n)):
            # New pods mount the certificate Secret: issue it again if it was deleted (a
            # rotation), and trust whatever CA it now holds.
            await self._ensure_agent_tls()
        missing = {
            index: groups.group_pods(
                cluster=self.name, namespace=ns, index=index, role="decode", spec=self.spec
            )
            for index in range(n)
            if index not in by_index and index not in view.hold and index not in sets
        }
        if not await self._within_bounds([p for group in missing.values() for p in group]):
            missing = {}
        for index, pods_of in missing.items():
            created = []
            if self.uses_lws:
                manifest = lws.leader_worker_set(
                    cluster=self.name, namespace=ns, index=index, pods=pods_of
                )
                if await self.kube.create_leader_worker_set(ns, self._owned(manifest)):
                    created.append(f"LeaderWorkerSet {manifest['metadata']['name']}")
            else:
                for manifest in pods_of:
                    if await self.kube.ensure(self._owned(manifest)):
                        created.append(manifest["metadata"]["name"])
            if created:
                await self.post_event("Normal", "EngineCreated", ", ".join(created))
        return [p for _, p in sorted(by_index.items())]

    async def _within_bounds(self, pods: list[dict[str, Any]]) -> bool:
        """The operator's own check of the pods it is about to create (docs/security.md):
        none is created when one is out of bounds; a Warning Event says why, once per cause."""
        problems: dict[str, list[str]] = {}
        for pod in pods:
            for problem in obj.pod_violations(pod, cluster=self.name, spec=self.spec):
                problems.setdefault(problem, []).append(pod["metadata"]["name"])
        if not problems:
            self._last_refusal = None  # a cause that comes back is reported again
            return True
        causes = "; ".join(problems)
        names = sorted({n for found in problems.values() for n in found})
        message = f"{', '.join(names)} not created, out of the pod security bounds: {causes}"
        log.error("%s/%s: %s", self.namespace, self.name, message)
        if causes != self._last_refusal:
            self._last_refusal = causes
            await self.post_event("Warning", "PodRefused", message[:1000])
        return False

    async def _poll(self, pods: list[dict[str, Any]]) -> dict[str, EngineState]:
        """Agent states by instance; a pod mid-switch is reported as switching."""
        addresses = []
        for pod in pods:
            address = agent_address(pod, port=self.options.agent_port, ca=self.agent_ca)
            if address is not None:
                addresses.append(address)
        answers = await self.agents.states(addresses)
        self.metrics.agent_polls.labels(self.namespace, self.name).inc(len(addresses))
        busy = self.executor.busy() if self.executor else set()
        out: dict[str, EngineState] = {}
        self._unanswered = {}
        for pod in pods:
            name = pod["metadata"]["name"]
            state = answers.get(name)
            if isinstance(state, Unanswered):
                self._unanswered[name] = state
                self.metrics.agent_errors.labels(self.namespace, self.name).inc()
                continue
            if state is None:
                continue
            annotations = pod["metadata"].get("annotations") or {}
            if name in busy or SWITCH_ANNOTATION in annotations:
                state = state.model_copy(update={"switching": True})
            out[name] = state
        return out

    async def _reconcile_labels(
        self, pods: list[dict[str, Any]], states: dict[str, EngineState]
    ) -> None:
        """Relabel a pod whose role label disagrees with the role its agent reports.

        Labels drift when a switch ends without knowing the engine's role (its agent was
        unreachable: the pod stays ``draining``), when a previous process died between
        the flip and the relabel, or when someone edits a label by hand. A pod mid-switch
        (intent annotation, or a switch of this executor) is left to its switch; a pod
        whose agent does not answer keeps its label until it does.
        """
        busy = self.executor.busy() if self.executor else set()
        for pod in pods:
            meta = pod["metadata"]
            name = meta["name"]
            state = states.get(name)
            if state is None or state.switching or name in busy:
                continue
            if SWITCH_ANNOTATION in (meta.get("annotations") or {}):
                continue
            label = (meta.get("labels") or {}).get(ROLE_LABEL)
            if label == state.role:
                continue
            await self.kube.patch_pod(
                self.namespace, name, {"metadata": {"labels": {ROLE_LABEL: state.role}}}
            )
            meta.setdefault("labels", {})[ROLE_LABEL] = state.role
            self.metrics.label_corrections.labels(self.namespace, self.name).inc()
            log.warning(
                "%s/%s: %s labelled %s, engine reports %s: relabelled",
                self.namespace, self.name, name, label, state.role,
            )  # fmt: skip
            await self.post_event(
                "Warning",
                "RoleLabelCorrected",
                f"{name}: label {label or '(none)'} -> {state.role}, the role its engine reports",
            )

    async def _switch_done(self, outcome: SwitchOutcome) -> None:
        ns, name = self.namespace, self.name
        self.metrics.switches.labels(ns, name, outcome.origin, outcome.to, outcome.result).inc()
        self.metrics.switch_seconds.labels(ns, name, outcome.origin, outcome.to).observe(
            outcome.seconds
        )
        for part, seconds in (
            ("router", outcome.router_seconds),
            ("engine", outcome.engine_seconds),
        ):
            if seconds is not None:
                self.metrics.switch_parts.labels(ns, name, part).observe(seconds)
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

    # -- status ------------------------------------------------------------------------------

    async def _report_failure(self, exc: Exception) -> None:
        """Put a failed tick where ``kubectl describe`` shows it: the Degraded condition in
        the status and a Warning Event, once per distinct cause.

        A tick that keeps failing (say the API server refuses a call the chart's RBAC does
        not grant) never reaches :meth:`_write_status`, so the status is patched here.
        """
        reason, message = tick_failure(exc)
        self._condition("Degraded", "True", reason, message)
        if message != self._last_failure:
            self._last_failure = message
            with contextlib.suppress(Exception):  # the event is best effort
                await self.post_event("Warning", reason, message)
        try:
            conditions = {"conditions": list(self._conditions.values())}
            await self.kube.patch_status(self.namespace, self.name, conditions)
        except Exception:
            log.warning(
                "%s/%s: could not report the failure in the status",
                self.namespace,
                self.name,
                exc_info=True,
            )

    async def _trajectory_limit(self) -> None:
        """The TrajectoryLimit condition: True when the webhook refused new trajectories
        at ``spec.trainer.maxLiveTrajectories`` since the previous tick; a Warning Event
        when it turns True."""
        hits = self.handle.limit_hits - self._limit_hits_seen
        self._limit_hits_seen = self.handle.limit_hits
        limit = self.spec.trainer.max_live_trajectories
        live = len(self.handle.controller.table)
        if not hits:
            self._condition(
                "TrajectoryLimit", "False", "BelowLimit", f"{live} of {limit} live trajectories"
            )
            return
        was = (self._conditions.get("TrajectoryLimit") or {}).get("status") == "True"
        message = (
            f"{hits} request(s) refused new trajectories since the last tick: {live} live, at "
            f"spec.trainer.maxLiveTrajectories ({limit}); the trainer resends them after "
            "Retry-After, nothing accepted is lost"
        )
        self._condition("TrajectoryLimit", "True", "MaxLiveTrajectories", message)
        if not was:
            await self.post_event("Warning", "TrajectoryLimit", message)

    def _condition(self, kind: str, status: str, reason: str, message: str) -> None:
        old = self._conditions.get(kind)
        changed = old is None or old["status"] != status
        since = utcnow() if old is None or changed else old["lastTransitionTime"]
        self._conditions[kind] = {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
        }

    async def _assess(
        self, pods: list[dict[str, Any]], states: dict[str, EngineState]
    ) -> Availability:
        """This tick's unavailable engines: logged and posted as Events once per change
        (:mod:`prorsa.control.availability`)."""
        found = assess(
            pods,
            states,
            self._unanswered,
            seen=self._seen,
            now=datetime.datetime.now(datetime.UTC),
        )
        for warning, line in self._degraded.log_lines(found):
            (log.warning if warning else log.info)("%s/%s: %s", self.namespace, self.name, line)
        for kind, reason, message in self._degraded.events(found):
            await self.post_event(kind, reason, message)
        return found

    async def _write_status(
        self, decision: Decision, pods: list[dict[str, Any]], states: dict[str, EngineState]
    ) -> None:
        ns, name = self.namespace, self.name
        roles = {"prefill": 0, "decode": 0, "switching": 0, "unavailable": 0}
        for pod in pods:
            state = states.get(pod["metadata"]["name"])
            if state is None or not state.healthy:
                roles["unavailable"] += 1
            elif state.switching:
                roles["switching"] += 1
            else:
                roles[state.role] += 1
        for role, count in roles.items():
            self.metrics.instances.labels(ns, name, role).set(count)
        # Every figure comes from the tick that made ``decision``, not from the Controller,
        # which the next tick may be updating in a worker thread.
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

        expected = self.spec.instances
        fresh = decision.mode == "predictive"
        self._condition(
            "ForecastFresh",
            "True" if fresh else "False",
            "TrainerEvents" if fresh else "NoTrainerEvents",
            "forecasting from trainer lifecycle events"
            if fresh
            else "no recent trainer events: deciding from engine states alone",
        )
        switching = roles["switching"] > 0
        self._condition(
            "Switching",
            "True" if switching else "False",
            "SwitchInProgress" if switching else "Idle",
            f"{roles['switching']} instance(s) switching" if switching else "",
        )
        found = await self._assess(pods, states)
        degraded = bool(found.lost)
        self._condition(
            "Degraded",
            "True" if degraded else "False",
            found.reason if degraded else "AllEnginesAvailable",
            found.message(expected),
        )
        available = roles["prefill"] + roles["decode"] + roles["switching"]
        ready = available == expected
        not_ready = "EnginesUnavailable" if degraded else "EnginesStarting"
        why = "EnginesReady" if ready else not_ready
        starting = f"; starting: {', '.join(found.starting)}" if found.starting else ""
        self._condition(
            "Ready",
            "True" if ready else "False",
            why,
            f"{available}/{expected} engines answering{starting}"[:1000],
        )
        target = decision.target
        phase = "Running" if ready else ("Degraded" if degraded else "Pending")
        status = {
            "phase": phase,
            "observedGeneration": self.generation,
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
            "switchHistory": [o.record() for o in (self.executor.history if self.executor else [])],
            "conditions": list(self._conditions.values()),
            "epoch": str(self.handle.epoch),
            "groups": {
                "nodesPerInstance": self.spec.engine.nodes_per_instance,
                "pods": self.engine_pods,
                "managedBy": groups.LWS_MANAGED if self.uses_lws else groups.OPERATOR_MANAGED,
            },
        }
        self.last_status = status
        await self.kube.patch_status(ns, name, status)
        self._last_failure = None  # a cause that comes back is reported again

    # -- persistence ---------------------------------------------------------------------------

    def _state_name(self) -> str:
        return f"{self.name}-prorsa-state"

    async def _persist(self) -> None:
        if not self.options.persist:
            return
        async with self.handle.exclusive() as controller:
            data = controller.learned_state()
        text = await asyncio.to_thread(json.dumps, data, separators=(",", ":"))
        try:
            await self.kube.write_config_map(
                self.namespace,
                self._state_name(),
                {"learned.json": text},
                labels=obj.labels(self.name, "state"),
            )
        except Exception:
            log.exception("%s/%s: could not persist learned statistics", self.namespace, self.name)

    async def _restore_learned(self) -> None:
        if not self.options.persist:
            return
        data = await self.kube.read_config_map(self.namespace, self._state_name())
        if not data or "learned.json" not in data:
            return
        try:
            learned = json.loads(data["learned.json"])
            async with self.handle.exclusive() as controller:
                controller.restore_learned(learned)
            log.info("%s/%s: restored learned statistics", self.namespace, self.name)
        except (ValueError, TypeError) as exc:
            log.warning(
                "%s/%s: ignoring unreadable learned statistics: %s", self.namespace, self.name, exc
            )


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
