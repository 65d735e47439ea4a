"""A whole Prorsa deployment on loopback: the Kubernetes API emulator, the operator (kopf,
real webhook, real metrics), and engine pods run by a fake kubelet (engine double + agent).

Shared by the operator's end-to-end tests; ``make demo`` builds the same thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import kopf
import kubernetes

from prorsa.k8s import objects as obj
from prorsa.k8s.handlers import OperatorConfig, build_registry
from prorsa.k8s.kube import Kube
from prorsa.k8s.runtime import OperatorOptions
from prorsa.spec import GROUP, PLURAL, VERSION
from prorsa.testing.engine import EngineConfig
from prorsa.testing.kube import KubeEmulatorServer
from prorsa.testing.kubelet import FakeKubelet, free_port

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "rl"
TOKEN = "trainer-secret-token"


def cluster_manifest(name: str = "demo", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"path": "/models/double"},
        "engine": {
            "image": "prorsa/engine-double:test",
            "gpusPerInstance": 8,
            "tensorParallelSize": 8,
        },
        "gpuBudget": 32,
        "roles": {"prefill": {"min": 1, "initial": 1}, "decode": {"min": 1}},
        "capacity": {"prefillTokensPerSecond": 10_000, "decodeKvTokens": 20_000},
        "switching": {
            "mode": "Auto",
            "cooldownSeconds": 0,
            "maxConcurrent": 1,
            "drainTimeoutSeconds": 1,
            "hysteresis": 0.05,
        },
        "router": {"enabled": False},
        "trainer": {"tokenSecretRef": {"name": "trainer-token", "key": "token"}},
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RolloutCluster",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": body,
    }


@dataclass
class Deployment:
    kube: Kube
    server: KubeEmulatorServer
    kubelet: FakeKubelet
    webhook_port: int
    kubeconfig: str
    operator_task: asyncio.Task[None] | None = None
    stop_flag: asyncio.Event | None = None
    label_history: dict[str, list[str]] = field(default_factory=dict)
    _ids: int = 0

    # -- the operator -------------------------------------------------------------------------

    async def start_operator(self) -> None:
        config = OperatorConfig(
            listen_host="127.0.0.1",
            listen_port=self.webhook_port,
            login_kubeconfig=self.kubeconfig,
            watch_timeout=2.0,
            options=OperatorOptions(agent_port=self.kubelet.agent_port, tick_seconds=0.3),
        )
        self.stop_flag = asyncio.Event()
        ready = asyncio.Event()
        self.operator_task = asyncio.create_task(
            kopf.operator(
                registry=build_registry(config),
                clusterwide=True,
                standalone=True,
                stop_flag=self.stop_flag,
                ready_flag=ready,
            )
        )
        await asyncio.wait_for(ready.wait(), 30)
        await self.wait_for(self._webhook_up, timeout=15, what="the webhook listener")

    async def stop_operator(self) -> None:
        if self.operator_task is None or self.stop_flag is None:
            return
        self.stop_flag.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self.operator_task, 60)
        self.operator_task = None

    async def _webhook_up(self) -> bool:
        try:
            async with httpx.AsyncClient() as client:
                reply = await client.get(f"{self.webhook}/healthz", timeout=1)
            return reply.status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def webhook(self) -> str:
        return f"http://127.0.0.1:{self.webhook_port}"

    # -- the API -----------------------------------------------------------------------------

    async def create_cluster(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return await self.kube._call(
            self.kube.custom.create_namespaced_custom_object,
            GROUP, VERSION, NAMESPACE, PLURAL, copy.deepcopy(manifest),
        )  # fmt: skip

    async def get_cluster(self, name: str = "demo") -> dict[str, Any]:
        return await self.kube._call(
            self.kube.custom.get_namespaced_custom_object, GROUP, VERSION, NAMESPACE, PLURAL, name
        )

    async def patch_cluster(self, name: str, patch: dict[str, Any]) -> None:
        await self.kube._call(
            self.kube.custom.patch_namespaced_custom_object,
            GROUP, VERSION, NAMESPACE, PLURAL, name, patch,
        )  # fmt: skip

    async def pods(self, cluster: str = "demo") -> list[dict[str, Any]]:
        selector = f"{obj.CLUSTER_LABEL}={cluster},{obj.COMPONENT_LABEL}=engine"
        return await self.kube.list_pods(NAMESPACE, selector)

    async def roles(self, cluster: str = "demo") -> dict[str, str]:
        out = {}
        for pod in await self.pods(cluster):
            name = pod["metadata"]["name"]
            role = pod["metadata"]["labels"].get(obj.ROLE_LABEL, "")
            out[name] = role
            history = self.label_history.setdefault(name, [])
            if not history or history[-1] != role:
                history.append(role)
        return out

    async def events(self) -> list[dict[str, Any]]:
        result = await self.kube._call(self.kube.core.list_namespaced_event, NAMESPACE)
        return [self.kube._plain(e) for e in result.items]

    async def wait_for(
        self, check: Callable[[], Any], *, timeout: float = 30, what: str = "condition"
    ) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = await check()
            if last:
                return last
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")

    async def count_roles(self, cluster: str = "demo") -> dict[str, int]:
        counts: dict[str, int] = {}
        for role in (await self.roles(cluster)).values():
            counts[role] = counts.get(role, 0) + 1
        return counts

    # -- the trainer ------------------------------------------------------------------------------

    def event(self, kind: str, trajectory: str, **fields: Any) -> dict[str, Any]:
        self._ids += 1
        return {
            "id": f"ev-{self._ids}",
            "ts": time.time(),
            "trajectory": trajectory,
            "type": kind,
        } | fields

    async def post(self, events: list[dict[str, Any]], cluster: str = "demo") -> httpx.Response:
        async with httpx.AsyncClient() as client:
            return await client.post(
                f"{self.webhook}/v1/namespaces/{NAMESPACE}/rolloutclusters/{cluster}/events",
                json={"events": events},
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=10,
            )

    async def metrics(self) -> str:
        async with httpx.AsyncClient() as client:
            return (await client.get(f"{self.webhook}/metrics", timeout=5)).text


@contextlib.asynccontextmanager
async def deployment(
    engine_config: Callable[[str], EngineConfig] | None = None,
) -> AsyncIterator[Deployment]:
    with KubeEmulatorServer(crds=[ROOT / "crds" / "rolloutcluster.yaml"]) as server:
        assert server.kubeconfig_path is not None
        kubeconfig = str(server.kubeconfig_path)
        api = kubernetes.config.new_client_from_config(config_file=kubeconfig)
        kube = Kube(api)
        await kube._call(
            kube.core.create_namespace, {"apiVersion": "v1", "kind": "Namespace",
                                         "metadata": {"name": NAMESPACE}}
        )  # fmt: skip
        await kube._call(
            kube.core.create_namespaced_secret,
            NAMESPACE,
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "trainer-token"},
             "stringData": {"token": TOKEN}},
        )  # fmt: skip
        kubelet = FakeKubelet(
            kube=kube,
            namespace=NAMESPACE,
            engine_config=engine_config or (lambda _name: EngineConfig()),
        )
        async with kubelet:
            env = Deployment(
                kube=kube,
                server=server,
                kubelet=kubelet,
                webhook_port=free_port(),
                kubeconfig=kubeconfig,
            )
            await env.start_operator()
            try:
                yield env
            finally:
                await env.stop_operator()
