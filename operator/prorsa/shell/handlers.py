"""kopf handlers of the operator, built into a registry so tests can run several apart.

One process serves every RolloutCluster it watches: one webhook listener (tokens from each
cluster's Secret), one ``/metrics``, one control loop per cluster (a kopf daemon), and a
validating admission handler that refuses bad specs with a message naming the field.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import kopf
from aiohttp import web
from prometheus_client import CollectorRegistry

from prorsa.clusters import ClusterRegistry
from prorsa.control.metrics import OperatorMetrics
from prorsa.control.runtime import ClusterLoopSettings, ClusterRuntime, EventPoster
from prorsa.core.controller import Controller
from prorsa.core.spec import GROUP, PLURAL, VERSION, RolloutClusterSpec, SpecError, validate_spec
from prorsa.engines.agents import AgentClient
from prorsa.ingest import WebhookServer
from prorsa.ingest.webhook_metrics import WebhookMetrics
from prorsa.k8s import groups, trainer_token
from prorsa.k8s import objects as obj
from prorsa.k8s.kube import Kube
from prorsa.k8s.leader import LeaderElection
from prorsa_contract.labels import CLUSTER_LABEL, MANAGED_BY
from prorsa_contract.serving_tls import ServingCert

log = logging.getLogger("prorsa.operator")


@dataclass(kw_only=True)
class OperatorSettings:
    """What ``prorsa operator`` is told on its command line (fixed for the process's life;
    the state it builds from them is :class:`OperatorState`)."""

    listen_host: str = "0.0.0.0"
    listen_port: int = obj.WEBHOOK_PORT
    # /metrics on a port of its own, never the webhook's (None: not served).
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = obj.METRICS_PORT
    # tls.crt + tls.key: the webhook and /metrics serve HTTPS (docs/security.md); None: HTTP.
    webhook_tls_dir: str | None = None
    options: ClusterLoopSettings = field(default_factory=ClusterLoopSettings)
    operator_namespace: str | None = None  # where the shared webhook Service goes
    admission: bool = False
    admission_tls_dir: str | None = None  # tls.crt + tls.key (e.g. from cert-manager)
    # Watching named namespaces (kopf --namespace) rather than all: kopf then neither lists
    # namespaces nor watches CRDs, so the operator needs no cluster-scoped permission.
    namespaced: bool = False
    namespaces: tuple[str, ...] = ()
    # The liveness and readiness probes (prorsa.shell.process), e.g.
    # http://0.0.0.0:8080/healthz (readiness at /readyz); None: not served.
    liveness: str | None = None
    # Two replicas, one leading (a Lease in operator_namespace); None: this one acts alone.
    leader_election: LeaderElection | None = None
    pod_name: str | None = None  # this process's pod: the webhook Service selects the leader's
    login_kubeconfig: str | None = None  # tests: log in from this kubeconfig
    watch_timeout: float | None = None  # tests: short watch timeouts


Serving = Callable[["OperatorState"], Awaitable[None]]


@dataclass
class OperatorState:
    """Process-wide state shared by every handler (kept on kopf's memo): the clients, the
    webhook, the metrics and each cluster's runtime, built from :class:`OperatorSettings`."""

    config: OperatorSettings
    kube: Kube
    agents: AgentClient
    registry: ClusterRegistry
    server: WebhookServer
    metrics: OperatorMetrics
    runner: web.AppRunner | None = None
    port: int = 0
    runtimes: dict[tuple[str, str], ClusterRuntime] = field(default_factory=dict)
    group_manager: str = groups.OPERATOR_MANAGED


def parse_spec(spec: Mapping[str, Any]) -> RolloutClusterSpec:
    """The spec, or ValueError naming every bad field (not only the first)."""
    try:
        return validate_spec(dict(spec))
    except SpecError as exc:
        raise ValueError(str(exc)) from None


def build_registry(
    config: OperatorSettings,
    *,
    prom: CollectorRegistry | None = None,
    on_serving: Serving | None = None,
) -> kopf.OperatorRegistry:
    """The kopf handlers of ``prorsa operator``, registered on a registry of their own.

    ``prom`` is the process's metrics registry (its listener outlives kopf:
    :mod:`prorsa.shell.process`); ``on_serving`` is awaited once the webhook serves.
    """
    registry = kopf.OperatorRegistry()
    _register_lifecycle(registry, config, prom=prom, on_serving=on_serving)
    if config.admission:
        _register_admission(registry)
    _register_clusters(registry)
    _register_pods(registry)
    return registry


_RESOURCE = (GROUP, VERSION, PLURAL)


def _register_lifecycle(
    registry: kopf.OperatorRegistry,
    config: OperatorSettings,
    *,
    prom: CollectorRegistry | None,
    on_serving: Serving | None,
) -> None:
    """Log-in, start-up (settings, webhook listener), clean-up and the liveness probe."""
    if config.login_kubeconfig:

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return connection_from_kubeconfig(config.login_kubeconfig or "")

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        _configure(settings, config)
        load_credentials(config)
        memo.prorsa = ctx = await _start_context(config, prom or CollectorRegistry())
        if on_serving is not None:
            await on_serving(ctx)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        ctx: OperatorState | None = getattr(memo, "prorsa", None)
        if ctx is None:
            return
        # Daemons may still be winding down (or were cancelled before their runtime
        # finished): every switch must be cancelled before the agents' client closes.
        await asyncio.gather(*(runtime.close() for runtime in list(ctx.runtimes.values())))
        if ctx.runner is not None:
            await ctx.runner.cleanup()
        await ctx.agents.aclose()

    @kopf.on.probe(id="clusters", registry=registry)
    def probe(memo: kopf.Memo, **_: Any) -> int:
        ctx: OperatorState = memo.prorsa
        return len(ctx.runtimes)


def _configure(settings: kopf.OperatorSettings, config: OperatorSettings) -> None:
    settings.posting.level = logging.INFO
    settings.persistence.finalizer = "prorsa.io/finalizer"
    if config.namespaced:
        # The namespaces are named exactly (no globs) and the chart installs the CRD
        # before the operator starts: nothing to discover at run time, and the operator's
        # Roles grant nothing cluster-wide (charts/prorsa/templates/rbac.yaml).
        settings.scanning.disabled = True
    if config.watch_timeout:
        settings.watching.server_timeout = config.watch_timeout
        settings.watching.client_timeout = config.watch_timeout + 5
        settings.watching.reconnect_backoff = 0.2
    if config.admission:
        settings.admission.server = _admission_server(config)
        settings.admission.managed = "prorsa.io"


def _admission_server(config: OperatorSettings) -> kopf.WebhookServer:
    """The API server calls the admission webhook through the operator's Service."""
    host = f"prorsa-webhook.{config.operator_namespace}.svc" if config.operator_namespace else None
    tls = config.admission_tls_dir
    return kopf.WebhookServer(
        addr="0.0.0.0",
        port=9443,
        host=host,
        certfile=f"{tls}/tls.crt" if tls else None,
        pkeyfile=f"{tls}/tls.key" if tls else None,
        cafile=f"{tls}/ca.crt" if tls and Path(f"{tls}/ca.crt").exists() else None,
    )


def load_credentials(config: OperatorSettings) -> None:
    """The kubernetes client's credentials, for the Kubernetes adapter's own calls."""
    if config.login_kubeconfig:
        import kubernetes

        kubernetes.config.load_kube_config(config_file=config.login_kubeconfig)
    else:
        _load_kube_config()


async def _start_context(config: OperatorSettings, prom: CollectorRegistry) -> OperatorState:
    """The operator's state while it leads, with the webhook listener already serving."""
    registry_ = ClusterRegistry()
    ctx = OperatorState(
        config=config,
        kube=Kube(),
        agents=AgentClient(),
        registry=registry_,
        server=WebhookServer(registry_, metrics=WebhookMetrics(prom)),
        metrics=OperatorMetrics(prom),
    )
    ctx.group_manager = await groups.discover_manager(ctx.kube)
    tls = None
    if config.webhook_tls_dir:
        tls = ServingCert(
            cert_file=Path(config.webhook_tls_dir, "tls.crt"),
            key_file=Path(config.webhook_tls_dir, "tls.key"),
        )
    # Unauthenticated /metrics names every served cluster: not on the trainers' port.
    ctx.runner = ctx.server.runner(ctx.server.trainer_app())  # with the header deadline
    await ctx.runner.setup()
    site = web.TCPSite(
        ctx.runner,
        config.listen_host,
        config.listen_port,
        ssl_context=tls.context if tls else None,
    )
    await site.start()
    addresses = ctx.runner.addresses
    ctx.port = addresses[0][1] if addresses else config.listen_port
    scheme = "https" if tls else "http"
    log.info("webhook on %s://%s:%d", scheme, config.listen_host, ctx.port)
    if tls is None and config.listen_host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "the webhook serves plain HTTP: trainer tokens cross the network in clear "
            "text (give --webhook-tls-dir; docs/security.md)"
        )
    if config.operator_namespace:
        try:
            service = obj.webhook_service(
                namespace=config.operator_namespace, leader=config.pod_name is not None
            )
            await ctx.kube.ensure(service)
        except Exception:
            log.exception("could not create the shared webhook Service")
    return ctx


def _register_admission(registry: kopf.OperatorRegistry) -> None:
    @kopf.on.validate(*_RESOURCE, registry=registry, id="spec")
    def validate(spec: kopf.Spec, **_: Any) -> None:
        try:
            parse_spec(spec)
        except ValueError as exc:
            raise kopf.AdmissionError(str(exc), code=422) from None


def _register_clusters(registry: kopf.OperatorRegistry) -> None:
    """Per RolloutCluster: the control loop (a daemon), spec updates and deletion."""

    @kopf.daemon(*_RESOURCE, registry=registry, id="control", cancellation_timeout=30.0)
    async def control(
        stopped: kopf.DaemonStopped,
        name: str,
        namespace: str | None,
        spec: kopf.Spec,
        uid: str,
        meta: kopf.Meta,
        body: kopf.Body,
        memo: kopf.Memo,
        patch: kopf.Patch,
        **_: Any,
    ) -> None:
        ctx: OperatorState = memo.prorsa
        namespace = _namespaced(namespace)
        try:
            cluster = parse_spec(spec)
        except ValueError as exc:
            kopf.warn(body, reason="InvalidSpec", message=str(exc))
            raise kopf.PermanentError(str(exc)) from None
        try:
            token = await trainer_token.initial_token(
                ctx.kube, namespace=namespace, name=name, uid=uid, spec=cluster
            )
        except trainer_token.TokenUnavailable as exc:
            raise kopf.TemporaryError(str(exc), delay=30) from None
        handle = ctx.registry.add(
            namespace=namespace, name=name, token=token, controller=Controller(cluster)
        )
        runtime = ClusterRuntime(
            namespace=namespace,
            name=name,
            spec=cluster,
            uid=uid,
            handle=handle,
            kube=ctx.kube,
            agents=ctx.agents,
            metrics=ctx.metrics,
            options=ctx.config.options,
            post_event=_event_poster(namespace=namespace, name=name, uid=uid),
            generation=int(meta.get("generation") or 0),
            group_manager=ctx.group_manager,
        )
        ctx.runtimes[(namespace, name)] = runtime
        # A rotated Secret, or a spec naming another, is in force within a poll.
        tokens = trainer_token.TokenFollower(
            kube=ctx.kube, namespace=namespace, name=name, uid=uid, handle=handle,
            spec=lambda: runtime.spec, token=token, post_event=runtime.post_event,
        )  # fmt: skip
        following = asyncio.create_task(tokens.run(), name=f"prorsa-token-{name}")

        def forget(_: object) -> None:
            # Only once the runtime is closed: until then cleanup must find it to await it.
            if ctx.runtimes.get((namespace, name)) is runtime:
                ctx.runtimes.pop((namespace, name))
            if ctx.registry.get(namespace, name) is handle:
                ctx.registry.remove(namespace=namespace, name=name)

        try:
            await runtime.setup()
            runtime.start()
            await stopped.wait()
        finally:
            following.cancel()
            closing = runtime.close()
            closing.add_done_callback(forget)
            await asyncio.shield(closing)

    @kopf.on.update(*_RESOURCE, registry=registry, field="spec", id="spec-update")
    async def update(
        name: str, namespace: str | None, new: Any, meta: kopf.Meta, memo: kopf.Memo, **_: Any
    ) -> None:
        ctx: OperatorState = memo.prorsa
        runtime = ctx.runtimes.get((_namespaced(namespace), name))
        if runtime is None:
            return
        try:
            cluster = parse_spec(new or {})
        except ValueError as exc:
            raise kopf.PermanentError(str(exc)) from None
        await runtime.update_spec(cluster)
        runtime.generation = int(meta.get("generation") or 0)
        runtime.wake()

    @kopf.on.delete(*_RESOURCE, registry=registry, id="forget")
    async def delete(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
        ctx: OperatorState = memo.prorsa
        namespace = _namespaced(namespace)
        runtime = ctx.runtimes.get((namespace, name))
        if runtime is not None:
            runtime.stop()
        ctx.registry.remove(namespace=namespace, name=name)
        ctx.metrics.forget(namespace, name)


def _event_poster(*, namespace: str, name: str, uid: str) -> EventPoster:
    """Posts Kubernetes Events about one RolloutCluster, best effort."""
    # kopf posts Events for raw bodies too; its annotation names only its Body view.
    ref = cast(
        kopf.Body,
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "RolloutCluster",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
        },
    )

    async def post_event(kind: str, reason: str, message: str) -> None:
        try:
            (kopf.info if kind == "Normal" else kopf.warn)(ref, reason=reason, message=message)
        except Exception:  # events are best effort
            log.debug("event not posted", exc_info=True)

    return post_event


def _register_pods(registry: kopf.OperatorRegistry) -> None:
    """An engine pod deleted or failed, or turned Ready before the bootstrap, wakes its
    cluster's control loop at once (:meth:`ClusterRuntime.on_pod_event`)."""

    @kopf.on.event("", "v1", "pods", registry=registry, labels={MANAGED_BY: "prorsa"})
    async def pod_event(
        event: kopf.RawEvent,
        labels: kopf.Labels,
        namespace: str | None,
        memo: kopf.Memo,
        **_: Any,
    ) -> None:
        ctx: OperatorState | None = getattr(memo, "prorsa", None)
        cluster = labels.get(CLUSTER_LABEL)
        if ctx is None or cluster is None or namespace is None:
            return
        runtime = ctx.runtimes.get((namespace, cluster))
        if runtime is not None:
            runtime.on_pod_event(kind=event.get("type"), pod=event.get("object") or {})


def _namespaced(namespace: str | None) -> str:
    """RolloutClusters and engine pods are namespaced: kopf always names the namespace."""
    if namespace is None:
        raise kopf.PermanentError("a RolloutCluster or engine pod without a namespace")
    return namespace


def connection_from_kubeconfig(path: str) -> kopf.ConnectionInfo:
    """kopf credentials from a kubeconfig file given by path (not $KUBECONFIG)."""
    import kubernetes

    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=path, client_configuration=cfg)
    header = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    scheme, _, token = (header or "").partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


def _load_kube_config() -> None:
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
