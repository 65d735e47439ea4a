"""A stand-in kubelet: runs the engine pods of a Kubernetes API (real or emulated) as an
SGLang engine double plus a real in-pod agent each, on loopback.

Each pod gets its own loopback address (127.0.0.N), so every agent listens on the same
port as in a real cluster and the operator reaches it at ``http://<podIP>:<agent port>``.
When the pod is deleted its engine and agent stop; a failed pod can be simulated by
:meth:`FakeKubelet.fail`. Used by the operator's end-to-end tests and by ``make demo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prorsa.k8s.kube import Kube
from prorsa_agent.config import Timeouts
from prorsa_contract.labels import COMPONENT_LABEL, MANAGED_BY
from prorsa_lab.doubles.engine_pod import FAST_TIMEOUTS, EnginePod
from prorsa_lab.doubles.pod_status import kubelet_pod_status
from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble

log = logging.getLogger("prorsa.kubelet")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class PodRuntime:
    """What runs for one pod: its address and its engine double + agent."""

    name: str
    uid: str
    ip: str
    pod: EnginePod

    @property
    def engine(self) -> EngineDouble:
        return self.pod.double


@dataclass(kw_only=True)
class FakeKubelet:
    kube: Kube
    namespace: str
    agent_port: int = field(default_factory=free_port)
    engine_config: Callable[[str], EngineConfig] = lambda _name: EngineConfig()
    poll_interval: float = 0.2
    timeouts: Timeouts = FAST_TIMEOUTS
    pods: dict[str, PodRuntime] = field(default_factory=dict)
    _next_ip: int = 10
    _free_ips: list[str] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeKubelet:
        self._task = asyncio.create_task(self._loop(), name="fake-kubelet")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for name in list(self.pods):
            await self._stop(name)

    async def wait_running(self, count: int, *, timeout: float = 30.0) -> None:
        """Until ``count`` engine pods run with a healthy engine."""
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if len(self.pods) >= count:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{len(self.pods)} of {count} engine pods running after {timeout}s")

    async def fail(self, name: str) -> None:
        """The pod's container dies for good: phase Failed (the operator must replace it)."""
        await self._stop(name)
        pod = await self.kube.get_pod(self.namespace, name)
        if pod is None:
            return
        status = kubelet_pod_status(
            pod,
            phase="Failed",
            now=_now(),
            reason="Error",
            message="the engine exited",
        )
        await self._write_status(name, status)

    async def _loop(self) -> None:
        selector = f"{MANAGED_BY}=prorsa,{COMPONENT_LABEL}=engine"
        while True:
            try:
                listed = await self.kube.list_pods(self.namespace, selector)
                seen = set()
                for pod in listed:
                    meta = pod["metadata"]
                    name, uid = meta["name"], meta.get("uid", "")
                    phase = (pod.get("status") or {}).get("phase")
                    seen.add(name)
                    current = self.pods.get(name)
                    if current is not None and current.uid != uid:
                        await self._stop(name)  # deleted and recreated under the same name
                        current = None
                    if current is None and phase not in ("Failed", "Succeeded"):
                        await self._start(pod)
                for name in list(self.pods):
                    if name not in seen:
                        await self._stop(name)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("fake kubelet loop")
            await asyncio.sleep(self.poll_interval)

    def _ip(self) -> str:
        if self._free_ips:
            return self._free_ips.pop()
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        return ip

    async def _start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        name, uid = meta["name"], meta.get("uid", "")
        token = await self._mounted(pod, "PRORSA_AGENT_TOKEN_FILE")
        key = await self._mounted(pod, "PRORSA_ENGINE_API_KEY_FILE")
        if token is None or key is None:
            return  # the operator creates the Secrets before the pods; try again next loop
        ip = self._ip()
        # Only the agent talks to its engine, so any free port will do for the engine.
        config = dataclasses.replace(self.engine_config(name), host=ip, port=0)
        runtime = EnginePod(
            instance=name,
            token=token,
            engine=config,
            timeouts=self.timeouts,
            agent_host=ip,
            agent_port=self.agent_port,
            engine_api_key=key or None,
        )
        await runtime.start()
        self.pods[name] = PodRuntime(name=name, uid=uid, ip=ip, pod=runtime)
        await self._write_status(name, kubelet_pod_status(pod, phase="Running", now=_now(), ip=ip))
        log.info("pod %s running at %s", name, ip)

    async def _write_status(self, name: str, status: dict[str, Any]) -> None:
        """Replace the whole status, as a kubelet's status manager does: a merge patch would
        keep the list entries of an earlier status."""
        await self.kube._call(
            self.kube.core.patch_namespaced_pod_status,
            name,
            self.namespace,
            [{"op": "replace", "path": "/status", "value": status}],
        )

    async def _mounted(self, pod: dict[str, Any], variable: str) -> str | None:
        """What the file that env ``variable`` names holds in the pod, as a kubelet would
        project it from the Secret volume mounted there: "" when the pod sets no such
        variable, None when the Secret (or its key) does not exist yet."""
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env") or []}
        path = env.get(variable)
        if not path:
            return ""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        for mount in container.get("volumeMounts") or []:
            prefix = mount["mountPath"].rstrip("/") + "/"
            secret = (volumes.get(mount["name"]) or {}).get("secret")
            if secret and path.startswith(prefix):
                return await self.kube.read_secret_key(
                    self.namespace, secret["secretName"], path.removeprefix(prefix)
                )
        raise ValueError(f"{variable}={path} is on no Secret volume the pod mounts")

    async def _stop(self, name: str) -> None:
        pod = self.pods.pop(name, None)
        if pod is None:
            return
        with contextlib.suppress(Exception):
            await pod.pod.stop()
        self._free_ips.append(pod.ip)
