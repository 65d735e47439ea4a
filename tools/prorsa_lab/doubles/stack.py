"""A whole Prorsa deployment on loopback: the Kubernetes API emulator, the operator (kopf,
real webhook, real ``/metrics``) and engine pods run by a fake kubelet (engine double + the
real in-pod agent each).

One implementation for the operator's end-to-end tests and for ``prorsa demo``, so what
the demo shows is what the tests check::

    async with stack() as env:
        await env.create_cluster(cluster_manifest(gpuBudget=32))
        await env.wait_for(lambda: env.count_roles(), what="engine pods")
        env.webhook, env.kubeconfig, env.kubelet.pods

The emulator serves from its own thread (so the synchronous ``kubernetes`` client, kopf and
``kubectl`` can all use it); kopf runs in the caller's event loop with a registry of its
own, logging in as a user of its own (:data:`OPERATOR_USER`, whose calls the emulator's
audit log keeps apart). The namespace and the trainer's token Secret exist before the
operator starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ssl
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kubernetes

from prorsa.control.runtime import ClusterLoopSettings
from prorsa.core.spec import GROUP, PLURAL, VERSION
from prorsa.k8s import crd_manifest as crd
from prorsa.k8s.kube import Kube
from prorsa.k8s.leader import LeaderElection, LeadershipLost
from prorsa.shell.handlers import OperatorSettings
from prorsa.shell.process import OperatorProcess
from prorsa_agent.config import Timeouts
from prorsa_contract.labels import CLUSTER_LABEL, COMPONENT_LABEL, ROLE_LABEL
from prorsa_lab.doubles.kube.emulator import KubeEmulatorServer
from prorsa_lab.doubles.kube.lws_controller import FakeLwsController, leader_worker_set_crd
from prorsa_lab.doubles.kube.resources import PODS_KEY
from prorsa_lab.doubles.kubelet import FakeKubelet, free_port
from prorsa_lab.doubles.sglang_double import FAST_TIMEOUTS, EngineConfig
from prorsa_lab.sglang_cpu.environment import CpuEngineEnv

NAMESPACE = "rl"
TOKEN = "trainer-secret-token"
TOKEN_SECRET = "trainer-token"
OPERATOR_USER = "system:serviceaccount:prorsa-system:prorsa"
# Deadlines of the waits below: bounds, not delays (every wait returns once its condition
# holds). Generous, so that a loaded 2-core machine, where starting kopf or one switch can
# take several times as long as idle, fails only what would never happen.
PATIENCE = 90.0
"""Who the operator is to the API emulator (its audit log: ``server.emulator.api_calls``)."""


def cluster_manifest(
    name: str = "demo", *, namespace: str = NAMESPACE, **spec: Any
) -> dict[str, Any]:
    """A RolloutCluster for engine doubles; keyword arguments override spec sections.

    A dict value is merged one level deep into the default section of that name
    (``switching={"mode": "Recommend"}`` keeps the other switching settings).
    """
    body: dict[str, Any] = {
        "model": {"path": "/models/double"},
        "engine": {
            "image": "prorsa/engine-double:test",
            "gpusPerInstance": 8,
            "tensorParallelSize": 8,
        },
        "gpuBudget": 32,
        "roles": {"prefill": {"min": 1, "initial": 1}, "decode": {"min": 1}},
        # The engine double keeps no prefix cache: no prefix-cache floor on prefill.
        "capacity": {
            "prefillTokensPerSecond": 10_000,
            "decodeKvTokens": 20_000,
            "prefillCacheTokens": 0,
        },
        "switching": {
            "mode": "Auto",
            "cooldownSeconds": 0,
            "maxConcurrent": 1,
            "drainTimeoutSeconds": 1,
            "hysteresis": 0.05,
            "smoothingSeconds": 0,  # the tests check each horizon's decision
            # Eq. 1 on each horizon, as the tests expect: the step-scale target sizes the
            # split for whole training steps, and these scenarios run minutes, not steps
            # (tests/test_step_cycle.py covers it in the Controller and the simulator).
            "stepCycle": False,
        },
        "router": {"enabled": False},
        "trainer": {"tokenSecretRef": {"name": TOKEN_SECRET, "key": "token"}},
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RolloutCluster",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


@dataclass
class Stack:
    """A running deployment and the calls a test or the demo makes against it."""

    kube: Kube
    server: KubeEmulatorServer
    kubelet: FakeKubelet
    webhook_port: int
    metrics_port: int
    kubeconfig: str
    operator_kubeconfig: str
    namespace: str = NAMESPACE
    token: str = TOKEN
    tick_seconds: float | None = 0.3
    watch_timeout: float = 2.0
    watch_namespaces: tuple[str, ...] = ()  # empty: every namespace
    operator_namespace: str | None = None
    router_settle_timeout: float = 30.0
    router_url: str | None = None  # the smg the kubelet runs; None: the default template
    webhook_tls_dir: str | None = None
    """tls.crt, tls.key and ca.crt of the webhook's certificate (None: plain HTTP)."""
    leader_election: LeaderElection | None = None
    """Replicas elect a leader on a Lease in ``operator_namespace`` (None: one acts alone)."""
    operator_pod: str | None = None
    """The pod the in-process operator runs as (labelled while it leads)."""
    operator_task: asyncio.Task[None] | None = None
    stop_flag: asyncio.Event | None = None
    process: OperatorProcess | None = None
    _ids: int = 0

    # -- the operator -------------------------------------------------------------------------

    def operator_config(
        self, *, pod_name: str | None = None, metrics_port: int | None = None
    ) -> OperatorSettings:
        """How this stack runs ``prorsa operator`` (in this process, or as a subprocess)."""
        config = OperatorSettings(
            listen_host="127.0.0.1",
            listen_port=self.webhook_port,
            metrics_host="127.0.0.1",
            metrics_port=metrics_port or self.metrics_port,
            webhook_tls_dir=self.webhook_tls_dir,
            login_kubeconfig=self.operator_kubeconfig,
            watch_timeout=self.watch_timeout,
            namespaced=bool(self.watch_namespaces),
            namespaces=self.watch_namespaces,
            operator_namespace=self.operator_namespace,
            leader_election=self.leader_election,
            pod_name=pod_name,
            options=ClusterLoopSettings(
                agent_port=self.kubelet.agent_port,
                tick_seconds=self.tick_seconds,
                router_settle_timeout=self.router_settle_timeout,
            ),
        )
        if self.router_url:
            config.options.router_url_template = self.router_url
        return config

    async def start_operator(
        self, *, pod_name: str | None = None, metrics_port: int | None = None
    ) -> OperatorProcess:
        """Run the operator process in this loop; return once its webhook serves, or once it
        stands by while another replica leads (``leader_election``)."""
        process = OperatorProcess(
            config=self.operator_config(
                pod_name=pod_name or self.operator_pod, metrics_port=metrics_port
            )
        )
        self.process = process
        self.stop_flag = asyncio.Event()
        self.operator_task = asyncio.create_task(process.run(stop=self.stop_flag))
        serving = asyncio.ensure_future(process.serving.wait())
        standing_by = asyncio.ensure_future(process.standing_by.wait())
        waiting = {serving, standing_by, self.operator_task}
        done, _ = await asyncio.wait(waiting, timeout=PATIENCE, return_when=asyncio.FIRST_COMPLETED)
        for task in (serving, standing_by):
            task.cancel()
        if self.operator_task in done:
            self.operator_task.result()  # raises what stopped it
            raise AssertionError("the operator stopped as it started")
        if not done:
            raise AssertionError(f"the operator neither served nor stood by in {PATIENCE}s")
        if process.serving.is_set():
            await self.wait_for(self._webhook_up, what="the webhook listener")
        return process

    async def stop_operator(self) -> None:
        if self.operator_task is None or self.stop_flag is None:
            return
        self.stop_flag.set()
        with contextlib.suppress(asyncio.CancelledError, LeadershipLost):
            await asyncio.wait_for(self.operator_task, 2 * PATIENCE)
        self.operator_task = None

    async def create_operator_pod(self, name: str) -> None:
        """An operator replica's pod as the chart's Deployment makes it (the process labels
        it while it leads); no kubelet runs it here."""
        assert self.operator_namespace is not None
        await self.kube.call(
            self.kube.core.create_namespaced_pod,
            self.operator_namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "labels": {
                        "app.kubernetes.io/name": "prorsa",
                        COMPONENT_LABEL: "operator",
                    },
                },
                "spec": {"containers": [{"name": "operator", "image": "prorsa/operator:test"}]},
            },
        )

    def operator_argv(self, *, pod_name: str, metrics_port: int, liveness_port: int) -> list[str]:
        """``prorsa operator`` with this stack's settings, to run as a process of its own."""
        config = self.operator_config(pod_name=pod_name, metrics_port=metrics_port)
        argv = [sys.executable, "-m", "prorsa.cli", "operator"]
        argv += [f"--namespace={n}" for n in config.namespaces] or ["--all-namespaces"]
        argv += [
            f"--kubeconfig={config.login_kubeconfig}",
            f"--listen=127.0.0.1:{config.listen_port}",
            f"--metrics-listen=127.0.0.1:{metrics_port}",
            f"--liveness=http://127.0.0.1:{liveness_port}/healthz",
            f"--agent-port={config.options.agent_port}",
            f"--pod-name={pod_name}",
        ]
        if config.operator_namespace:
            argv.append(f"--operator-namespace={config.operator_namespace}")
        if config.options.tick_seconds:
            argv.append(f"--tick-seconds={config.options.tick_seconds}")
        if self.router_url:  # the smg the kubelet runs, as in operator_config
            argv.append(f"--router-url-template={self.router_url}")
        if config.webhook_tls_dir:
            argv.append(f"--webhook-tls-dir={config.webhook_tls_dir}")
        election = config.leader_election
        if election is not None:
            argv += [
                "--leader-elect",
                f"--leader-elect-resource-name={election.lease_name}",
                f"--leader-elect-lease-duration={election.lease_duration}",
                f"--leader-elect-renew-deadline={election.renew_deadline}",
                f"--leader-elect-retry-period={election.retry_period}",
            ]
        return argv

    @property
    def webhook_ca(self) -> str | None:
        """The CA bundle a trainer verifies the webhook with (None: plain HTTP)."""
        return f"{self.webhook_tls_dir}/ca.crt" if self.webhook_tls_dir else None

    def http(self, **kwargs: Any) -> httpx.AsyncClient:
        """A client for the webhook that trusts its CA (and nothing else) when it has one."""
        if self.webhook_ca is not None:
            kwargs.setdefault("verify", ssl.create_default_context(cafile=self.webhook_ca))
        return httpx.AsyncClient(**kwargs)

    async def _webhook_up(self) -> bool:
        try:
            async with self.http() as client:
                reply = await client.get(f"{self.webhook}/healthz", timeout=1)
            return reply.status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def webhook(self) -> str:
        scheme = "https" if self.webhook_tls_dir else "http"
        return f"{scheme}://127.0.0.1:{self.webhook_port}"

    @property
    def metrics_url(self) -> str:
        """The operator's /metrics, on its own port (https with the webhook's certificate)."""
        scheme = "https" if self.webhook_tls_dir else "http"
        return f"{scheme}://127.0.0.1:{self.metrics_port}/metrics"

    def cluster_path(self, cluster: str = "demo") -> str:
        """The webhook path prefix of one RolloutCluster (``.../events``, ``/forecast``)."""
        return f"/v1/namespaces/{self.namespace}/rolloutclusters/{cluster}"

    # -- the API -----------------------------------------------------------------------------

    async def create_cluster(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return await self.kube.call(
            self.kube.custom.create_namespaced_custom_object,
            GROUP, VERSION, self.namespace, PLURAL, copy.deepcopy(manifest),
        )  # fmt: skip

    async def get_cluster(self, name: str = "demo") -> dict[str, Any]:
        return await self.kube.call(
            self.kube.custom.get_namespaced_custom_object,
            GROUP, VERSION, self.namespace, PLURAL, name,
        )  # fmt: skip

    async def patch_cluster(self, name: str, patch: dict[str, Any]) -> None:
        await self.kube.call(
            self.kube.custom.patch_namespaced_custom_object,
            GROUP, VERSION, self.namespace, PLURAL, name, patch,
        )  # fmt: skip

    async def pods(self, cluster: str = "demo") -> list[dict[str, Any]]:
        selector = f"{CLUSTER_LABEL}={cluster},{COMPONENT_LABEL}=engine"
        return await self.kube.list_pods(self.namespace, selector)

    async def roles(self, cluster: str = "demo") -> dict[str, str]:
        """Each engine pod's role label now."""
        return {
            pod["metadata"]["name"]: pod["metadata"]["labels"].get(ROLE_LABEL, "")
            for pod in await self.pods(cluster)
        }

    @property
    def label_history(self) -> dict[str, list[str]]:
        """Each engine pod's role labels in the order written, read from the API server's
        write log: a ``draining`` hop of a few milliseconds is there too."""
        out: dict[str, list[str]] = {}
        for e in self.server.emulator.writes(PODS_KEY):
            meta = e.obj["metadata"]
            labels = meta.get("labels") or {}
            if labels.get(COMPONENT_LABEL) != "engine" or e.type == "DELETED":
                continue
            history = out.setdefault(meta["name"], [])
            role = labels.get(ROLE_LABEL, "")
            if not history or history[-1] != role:
                history.append(role)
        return out

    async def count_roles(self, cluster: str = "demo") -> dict[str, int]:
        counts: dict[str, int] = {}
        for role in (await self.roles(cluster)).values():
            counts[role] = counts.get(role, 0) + 1
        return counts

    async def events(self) -> list[dict[str, Any]]:
        listed = await self.kube.call(self.kube.core.list_namespaced_event, self.namespace)
        return list(listed.get("items") or [])

    async def wait_for(
        self,
        check: Callable[[], Awaitable[Any]],
        *,
        timeout: float = PATIENCE,
        what: str = "condition",
    ) -> Any:
        """Poll ``check`` every 0.1 s until it returns something truthy; return that."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = await check()
            if last:
                return last
            await asyncio.sleep(0.1)
        why = await self._last_reason()
        raise AssertionError(
            f"timed out after {timeout}s waiting for {what} (last: {last!r}); {why}"
        )

    async def _last_reason(self) -> str:
        """The operator's last word on the split, for a failure message: a test that times
        out waiting for a switch says why the Controller held."""
        try:
            status = (await self.get_cluster()).get("status") or {}
        except Exception as exc:  # a failure message, never a second failure
            return f"cluster status unreadable: {exc!r}"
        target = status.get("target") or {}
        history = [
            f"{h.get('pod')} {h.get('from')}->{h.get('to')} {h.get('result')}"
            for h in (status.get("switchHistory") or [])[-4:]
        ]
        return (
            f"operator's target {target.get('split')} ({target.get('mode')}): "
            f"{target.get('reason')}; last switches: {history}"
        )

    async def wait_for_event(self, reason: str, *, timeout: float = PATIENCE) -> list[str]:
        """Wait until an Event with ``reason`` is posted; the reasons of every Event then.

        kopf posts Events from a queue of its own, so on a loaded machine an Event comes a
        moment after the change it reports.
        """

        async def posted() -> list[str] | None:
            reasons = [str(e.get("reason")) for e in await self.events()]
            return reasons if reason in reasons else None

        reasons: list[str] = await self.wait_for(posted, timeout=timeout, what=f"a {reason} event")
        return reasons

    # -- the trainer ------------------------------------------------------------------------------

    def event(self, kind: str, trajectory: str, **fields: Any) -> dict[str, Any]:
        """One webhook event (CONTRACT field names) with a fresh id, stamped now."""
        self._ids += 1
        return {
            "id": f"ev-{self._ids}",
            "ts": time.time(),
            "trajectory": trajectory,
            "type": kind,
        } | fields

    async def post(self, events: list[dict[str, Any]], cluster: str = "demo") -> httpx.Response:
        async with self.http() as client:
            return await client.post(
                f"{self.webhook}{self.cluster_path(cluster)}/events",
                json={"events": events},
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=10,
            )

    async def metrics(self) -> str:
        async with self.http() as client:
            return (await client.get(self.metrics_url, timeout=5)).text


def write_webhook_cert(directory: str) -> None:
    """A throwaway CA and a certificate for 127.0.0.1 and localhost, as the webhook Secret
    mounted in the operator would hold them (tls.crt, tls.key, ca.crt)."""
    from prorsa.engines.agent_tls import issue_serving_cert

    issued = issue_serving_cert(
        common_name="prorsa-webhook",
        dns_names=("localhost",),
        ip_addresses=("127.0.0.1",),
        ca_name="prorsa lab webhook CA",
    )
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tls.crt").write_text(issued.cert)
    (path / "tls.key").write_text(issued.key)
    (path / "ca.crt").write_text(issued.ca)


@contextlib.asynccontextmanager
async def stack(
    *,
    namespace: str = NAMESPACE,
    token: str = TOKEN,
    engine_config: Callable[[str], EngineConfig] | None = None,
    tick_seconds: float | None = 0.3,
    watch_timeout: float = 2.0,
    kubeconfig_path: str | Path | None = None,
    webhook_port: int | None = None,
    agent_timeouts: Timeouts | None = None,
    watch_namespaces: tuple[str, ...] = (),
    operator_namespace: str | None = None,
    router_settle_timeout: float = 30.0,
    run_router: bool = False,
    log_dir: Path | None = None,
    webhook_tls: bool = False,
    leader_worker_set: bool = False,
    leader_election: LeaderElection | None = None,
    operator_pod: str | None = None,
    start_operator: bool = True,
    real_engines: CpuEngineEnv | None = None,
) -> AsyncIterator[Stack]:
    """The emulator (CRD loaded, namespace and token Secret created), the fake kubelet and
    the operator, running until the block ends.

    ``tick_seconds`` is the operator's control period (None: each cluster's horizon);
    ``kubeconfig_path`` puts the emulator's kubeconfig where a user can find it;
    ``agent_timeouts`` replaces the agents' test timeouts (a whole switch in tens of ms);
    ``watch_namespaces`` runs the operator for those namespaces only (as ``--namespace``),
    ``operator_namespace`` is where it puts the webhook Service (which must exist);
    ``run_router`` runs a cluster's router Deployment (``router.enabled``) as the real smg
    binary (its log in ``log_dir``) and points the operator's switch executor at it.
    ``webhook_tls`` serves the webhook over HTTPS with a throwaway CA (``env.webhook_ca``).
    ``leader_worker_set`` installs the LeaderWorkerSet CRD before the operator starts (so its
    discovery finds the API) and runs a fake LWS controller (:mod:`.lws_controller`).
    ``leader_election`` makes the operator a replica that elects its leader on a Lease in
    ``operator_namespace``; ``operator_pod`` creates its pod there (the replica labels it
    while it leads); ``start_operator=False`` leaves starting replicas to the caller.
    ``real_engines`` runs the real SGLang on this CPU in every engine pod instead of a double
    (:mod:`prorsa_lab.sglang_cpu`; give ``agent_timeouts`` for it, e.g. ``CPU_TIMEOUTS``).
    The operator logs in as :data:`OPERATOR_USER`, the tests, the demo and the kubelet as
    the emulator's admin, so the emulator's audit log tells the operator's calls apart.
    """
    server = KubeEmulatorServer(kubeconfig_path=kubeconfig_path)
    server.emulator.add_crd(crd.crd())
    if leader_worker_set:
        server.emulator.add_crd(leader_worker_set_crd())
    with server, tempfile.TemporaryDirectory(prefix="prorsa-operator-") as private:
        assert server.kubeconfig_path is not None
        kubeconfig = str(server.kubeconfig_path)
        tls_dir = None
        if webhook_tls:
            tls_dir = str(Path(private) / "webhook-tls")
            write_webhook_cert(tls_dir)
        operator_kubeconfig = str(server.kubeconfig_for(OPERATOR_USER, Path(private) / "config"))
        api = kubernetes.config.new_client_from_config(config_file=kubeconfig)
        kube = Kube(api)
        for name in dict.fromkeys((namespace, *watch_namespaces, operator_namespace)):
            if name is None or name == "default":
                continue
            await kube.call(
                kube.core.create_namespace,
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
            )
        await kube.call(
            kube.core.create_namespaced_secret,
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": TOKEN_SECRET},
                "stringData": {"token": token},
            },
        )
        kubelet = FakeKubelet(
            kube=kube,
            namespace=namespace,
            engine_config=engine_config or (lambda _name: EngineConfig()),
            timeouts=agent_timeouts or FAST_TIMEOUTS,
            run_routers=run_router,
            kubeconfig=kubeconfig,
            log_dir=log_dir,
            real_engines=real_engines,
        )
        lws = FakeLwsController(kube=kube, namespace=namespace) if leader_worker_set else None
        try:
            async with kubelet, lws or contextlib.nullcontext():
                env = Stack(
                    kube=kube,
                    server=server,
                    kubelet=kubelet,
                    webhook_port=webhook_port or free_port(),
                    metrics_port=free_port(),
                    kubeconfig=kubeconfig,
                    operator_kubeconfig=operator_kubeconfig,
                    namespace=namespace,
                    token=token,
                    tick_seconds=tick_seconds,
                    watch_timeout=watch_timeout,
                    watch_namespaces=tuple(watch_namespaces),
                    operator_namespace=operator_namespace,
                    router_settle_timeout=router_settle_timeout,
                    router_url=f"http://127.0.0.1:{kubelet.router_port}" if run_router else None,
                    webhook_tls_dir=tls_dir,
                    leader_election=leader_election,
                    operator_pod=operator_pod,
                )
                if operator_pod is not None:
                    await env.create_operator_pod(operator_pod)
                if start_operator:
                    await env.start_operator()
                try:
                    yield env
                finally:
                    await env.stop_operator()
        finally:
            api.close()
