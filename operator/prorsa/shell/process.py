"""The ``prorsa operator`` process: probes and metrics from its start, leader election, and
kopf while it leads (docs/operations.md#high-availability).

The chart runs two replicas. Both serve the liveness and readiness probes and ``/metrics``
from the start. The one that holds the Lease (:mod:`prorsa.k8s.leader`) runs kopf: the
control loops, the switch executor, the trainer webhook. Once its webhook serves, it labels
its pod ``prorsa.io/leader=true`` (and takes the label off any other operator pod): the
webhook Service selects that label, so trainers reach the replica that holds the clusters'
state, and only it. The other replica stands by, ready (a rollout waits on both), with
nothing to serve.

When the leader stops cleanly it releases the Lease and the standby takes over at its next
try; when it dies, after the Lease expires. The new leader starts kopf afresh: it finishes
or rolls back each switch whose intent a pod carries, reloads the learned statistics from
their ConfigMap, and its webhook (a new epoch) asks trainers to resync. A leader that cannot
renew the Lease within the renew deadline stops kopf and exits before another replica may
take over: two replicas never act at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import secrets
import socket
import weakref
from collections.abc import Collection, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import kopf
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from prorsa.k8s import objects as obj
from prorsa.k8s.kube import Kube
from prorsa.k8s.leader import LeaderElector, LeadershipLost
from prorsa.shell.handlers import OperatorSettings, OperatorState, build_registry, load_credentials
from prorsa_contract.serving_tls import ServingCert

log = logging.getLogger("prorsa.operator")

Role = Literal["starting", "standby", "leader", "stopping"]
# How long a leader that lost the Lease gives kopf to stop before it gives up waiting.
STOP_TIMEOUT = 60.0


# The tasks of the kopf run that the current task belongs to (None: outside any).
_KOPF_TASKS: contextvars.ContextVar[weakref.WeakSet[asyncio.Task[Any]] | None] = (
    contextvars.ContextVar("prorsa_kopf_tasks", default=None)
)


def _tracking_factory(previous: Any) -> Any:
    """A task factory that records each task created inside a kopf run in that run's set
    (``previous``: the loop's factory until then, which still makes the task)."""

    def factory(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Future[Any]:
        task: asyncio.Future[Any]
        if previous is not None:
            task = previous(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        owner = _KOPF_TASKS.get()
        if owner is not None and isinstance(task, asyncio.Task):
            owner.add(task)
        return task

    factory.prorsa_tracking = True  # type: ignore[attr-defined]
    return factory


class _NotSpawnedBy(Collection[asyncio.Task[Any]]):
    """kopf's ``ignored``: every task that the kopf run did not spawn (tested with ``in``)."""

    def __init__(self, spawned: weakref.WeakSet[asyncio.Task[Any]]) -> None:
        self._spawned = spawned

    def __contains__(self, task: object) -> bool:
        return task not in self._spawned

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(())

    def __len__(self) -> int:
        return 0


async def run_kopf(**kwargs: Any) -> None:
    """``kopf.operator(**kwargs)``, except that its end cancels only the tasks kopf spawned.

    When kopf stops, it waits 5 s for every task created in the event loop since it
    started, then cancels them ("hung" tasks, ``kopf.run_tasks``): it cannot tell its own
    from the loop's other users'. In the operator's own process that is harmless, but the
    lab runs the operator in the loop of the emulated cluster (``prorsa demo``, the
    end-to-end tests): an operator stopped there cancelled the scheduler loops of every
    engine double and the health monitors and switches of every agent started while it ran,
    so after an operator restart no such engine generated again, and the next switch on
    one failed its verification and had its instance (a whole multi-node group) replaced.
    Here the tasks created inside this run are recorded (a task factory, and a context
    variable every task spawned from this one inherits); the others are kopf's
    ``ignored``.
    """
    loop = asyncio.get_running_loop()
    factory = loop.get_task_factory()
    if not getattr(factory, "prorsa_tracking", False):
        loop.set_task_factory(_tracking_factory(factory))
    spawned: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
    _KOPF_TASKS.set(spawned)  # this task's context only: what it spawns inherits it
    tasks = await kopf.spawn_tasks(**kwargs)
    await kopf.run_tasks(tasks, ignored=_NotSpawnedBy(spawned))


def metrics_app(registry: CollectorRegistry) -> web.Application:
    """``GET /metrics`` of ``registry``, alone on its listener (the NetworkPolicy limits
    who reaches it; the webhook's port, which trainers reach, does not serve it)."""

    async def metrics(request: web.Request) -> web.Response:
        del request
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


async def serve(
    app: web.Application, *, host: str, port: int, tls: ServingCert | None = None
) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=tls.context if tls else None).start()
    return runner


async def serve_metrics(
    registry: CollectorRegistry, *, host: str, port: int, tls: ServingCert | None
) -> web.AppRunner:
    """Start the metrics listener (HTTPS with the webhook's certificate when it has one)."""
    runner = await serve(metrics_app(registry), host=host, port=port, tls=tls)
    bound = runner.addresses[0][1] if runner.addresses else port
    log.info("metrics on %s://%s:%d/metrics", "https" if tls else "http", host, bound)
    return runner


def identity(pod_name: str | None) -> str:
    """This process in the Lease: its pod (or host) and a suffix of its own, so a restarted
    container is a new candidate (client-go: hostname + UUID)."""
    return f"{pod_name or socket.gethostname()}_{secrets.token_hex(4)}"


@dataclass(kw_only=True)
class OperatorProcess:
    """One ``prorsa operator`` process, leading or standing by."""

    config: OperatorSettings
    prom: CollectorRegistry = field(default_factory=CollectorRegistry)
    role: Role = "starting"
    context: OperatorState | None = None  # while it leads and its webhook serves
    identity: str = ""
    serving: asyncio.Event = field(default_factory=asyncio.Event)  # leads, webhook up
    standing_by: asyncio.Event = field(default_factory=asyncio.Event)
    _kube: Kube | None = None
    _kopf: asyncio.Task[None] | None = None
    _runners: list[web.AppRunner] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.identity = self.identity or identity(self.config.pod_name)
        self._leader = Gauge(
            "prorsa_operator_leader",
            "1 on the replica that leads (holds the Lease and runs the control loops), "
            "0 on a standby.",
            registry=self.prom,
        )

    # -- probes ---------------------------------------------------------------------------

    def _probes(self, live_path: str) -> web.Application:
        async def live(request: web.Request) -> web.Response:
            del request
            alive = self._kopf is None or not self._kopf.done()
            body = {"role": self.role, "identity": self.identity, "clusters": self._clusters()}
            return web.json_response(body, status=200 if alive else 503)

        async def ready(request: web.Request) -> web.Response:
            del request
            # A standby is ready: a rollout needs both replicas ready, and it takes over
            # at once. A leader is ready once its webhook serves.
            ok = self.role == "standby" or (self.role == "leader" and self.serving.is_set())
            body = {"role": self.role, "identity": self.identity}
            return web.json_response(body, status=200 if ok else 503)

        app = web.Application()
        app.router.add_get(live_path, live)
        app.router.add_get("/readyz", ready)
        return app

    def _clusters(self) -> int:
        return len(self.context.runtimes) if self.context is not None else 0

    async def _start_listeners(self) -> None:
        config = self.config
        tls = None
        if config.webhook_tls_dir:
            tls = ServingCert(
                cert_file=Path(config.webhook_tls_dir, "tls.crt"),
                key_file=Path(config.webhook_tls_dir, "tls.key"),
            )
        if config.metrics_port is not None:
            self._runners.append(
                await serve_metrics(
                    self.prom, host=config.metrics_host, port=config.metrics_port, tls=tls
                )
            )
        if config.liveness:
            url = urlsplit(config.liveness)
            host, port = url.hostname or "0.0.0.0", url.port or 8080
            self._runners.append(
                await serve(self._probes(url.path or "/healthz"), host=host, port=port)
            )
            log.info("probes on http://%s:%d (%s, /readyz)", host, port, url.path or "/healthz")

    # -- the leader's pod label ---------------------------------------------------------------

    async def _label(self, *, leading: bool) -> None:
        """Put the leader label on this pod (and take it off the others), or take it off."""
        namespace, pod = self.config.operator_namespace, self.config.pod_name
        if self._kube is None or not namespace or not pod:
            return
        try:
            if leading:
                selector = f"{obj.LEADER_LABEL}=true"
                for other in await self._kube.list_pods(namespace, selector):
                    name = other["metadata"]["name"]
                    if name != pod:
                        unlabel = {"metadata": {"labels": {obj.LEADER_LABEL: None}}}
                        await self._kube.patch_pod(namespace, name, unlabel)
            value = "true" if leading else None
            await self._kube.patch_pod(
                namespace, pod, {"metadata": {"labels": {obj.LEADER_LABEL: value}}}
            )
        except Exception:
            log.warning("could not %s the leader label of pod %s", "set" if leading else
                        "clear", pod, exc_info=True)  # fmt: skip

    async def _on_serving(self, ctx: OperatorState) -> None:
        self.context = ctx
        await self._label(leading=True)  # trainers' requests come here from now on
        self.serving.set()

    # -- the run ------------------------------------------------------------------------------

    async def run(self, *, stop: asyncio.Event | None = None) -> None:
        """Serve probes and metrics, stand by until this process leads, then run kopf until
        ``stop`` (or kopf ends). Raises :class:`LeadershipLost` when the Lease is lost."""
        config = self.config
        stop = stop or asyncio.Event()
        elector = None
        holding: asyncio.Task[None] | None = None
        try:
            await self._start_listeners()
            load_credentials(config)
            self._kube = Kube()
            # A restarted leader's pod keeps the label until told otherwise.
            await self._label(leading=False)
            if config.leader_election is not None:
                if not config.operator_namespace:
                    raise ValueError("leader election needs --operator-namespace (the Lease's)")
                elector = LeaderElector(
                    kube=self._kube,
                    election=config.leader_election,
                    namespace=config.operator_namespace,
                    identity=self.identity,
                )
                self.role = "standby"
                self._leader.set(0)
                self.standing_by.set()
                if not await elector.acquire(stop):
                    return
                self.standing_by.clear()
            self.role = "leader"
            self._leader.set(1)
            kopf_stop = asyncio.Event()
            self._kopf = asyncio.create_task(
                run_kopf(
                    registry=build_registry(config, prom=self.prom, on_serving=self._on_serving),
                    clusterwide=not config.namespaced,
                    namespaces=list(config.namespaces),
                    standalone=True,
                    stop_flag=kopf_stop,
                ),
                name="kopf",
            )
            waiting: set[asyncio.Future[Any]] = {
                self._kopf,
                asyncio.ensure_future(stop.wait()),
            }
            if elector is not None:
                holding = asyncio.create_task(elector.hold(), name="lease")
                waiting.add(holding)
            done, pending = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                if task is not self._kopf and task is not holding:
                    task.cancel()
            lost = holding is not None and holding in done
            self.role = "stopping"
            self.serving.clear()
            kopf_stop.set()
            if lost:
                log.error("stopping: this replica no longer leads (%s)", _why(holding))
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._kopf), STOP_TIMEOUT)
            if lost:
                assert holding is not None
                holding.result()  # raises LeadershipLost
        finally:
            self.role = "stopping"
            self.serving.clear()
            self._leader.set(0)
            if holding is not None and not holding.done():
                holding.cancel()
                with contextlib.suppress(asyncio.CancelledError, LeadershipLost):
                    await holding
            if elector is not None and elector.leading:
                await self._label(leading=False)
                await elector.release()
            for runner in self._runners:
                await runner.cleanup()
            self._runners.clear()
            if self._kube is not None:
                self._kube.api.close()


def _why(task: asyncio.Task[None] | None) -> str:
    if task is None or not task.done() or task.cancelled():
        return "unknown"
    exc = task.exception()
    return str(exc) if exc else "unknown"


def pod_name_from_env() -> str | None:
    """The pod this process runs in (the chart sets POD_NAME from the downward API)."""
    return os.environ.get("POD_NAME") or None


def run_operator(config: OperatorSettings) -> int:
    """``prorsa operator``: the process until SIGTERM (0), or until it lost the Lease (1: the
    container restarts and stands by)."""
    import signal

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # kopf installs its own handlers once it runs (it stops itself on these signals).
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        try:
            await OperatorProcess(config=config).run(stop=stop)
        except LeadershipLost as exc:
            log.error("exiting: the Lease is lost (%s)", exc)
            return 1
        return 0

    return asyncio.run(main())
