"""A stand-in for the Deployment and ReplicaSet controllers and the kubelet, for the operator's
own Deployment (the chart's ``prorsa``): each replica is a Pod object in the API and a
``prorsa operator`` process on loopback, started with the container's args as the chart
renders them, plus the flags that put it on this machine (kubeconfig, listen addresses, the
agent port the fake kubelet's engine pods use, its pod name). ``argparse`` keeps the last of
a repeated flag, so the chart's own values for those are overridden and every other arg
(namespaces, leader election terms, tick) is the chart's.

:meth:`OperatorDeployment.sync` rolls the pods to the Deployment's current template as the
RollingUpdate strategy does with ``maxSurge: 1, maxUnavailable: 0`` (the chart's, with
leader election): one new pod is started, and once it is ready (its ``/readyz``, the chart's
readiness probe) one old pod gets SIGTERM and its grace period; repeated until every pod
runs the new template. The image tag only names the template (both run this checkout).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from prorsa_lab.doubles.kubelet import free_port
from prorsa_lab.doubles.processes import terminate
from prorsa_lab.doubles.stack import Stack

TEMPLATE_HASH_LABEL = "pod-template-hash"
GRACE_SECONDS = 30.0  # the chart's terminationGracePeriodSeconds default


@dataclass
class OperatorPod:
    name: str
    template: str  # the template hash it runs
    image: str
    process: asyncio.subprocess.Process
    liveness_port: int
    metrics_port: int
    log_path: Path
    _log: IO[str] | None = field(default=None, repr=False)

    async def ready(self) -> bool:
        """The chart's readinessProbe: ``GET /readyz`` on the liveness port."""
        if self.process.returncode is not None:
            return False
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                reply = await client.get(f"http://127.0.0.1:{self.liveness_port}/readyz")
            return reply.status_code == 200
        except httpx.HTTPError:
            return False

    async def terminate(self, grace: float = GRACE_SECONDS) -> int | None:
        """SIGTERM, then SIGKILL after the grace period, as the kubelet stops a pod."""
        await terminate(self.process, grace=grace)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode


@dataclass(kw_only=True)
class OperatorDeployment:
    env: Stack
    name: str
    namespace: str
    log_dir: Path
    pods: list[OperatorPod] = field(default_factory=list)
    retired: list[OperatorPod] = field(default_factory=list)
    _serial: int = 0

    async def read(self) -> dict[str, Any]:
        kube = self.env.kube
        return await kube.call(kube.apps.read_namespaced_deployment, self.name, self.namespace)

    @staticmethod
    def template_hash(deployment: dict[str, Any]) -> str:
        template = deployment["spec"]["template"]
        text = json.dumps(template, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    async def sync(self, *, timeout: float = 300.0) -> None:
        """Run the Deployment's replicas on its current template (a rolling update when
        pods of an older template run)."""
        deployment = await self.read()
        want = self.template_hash(deployment)
        replicas = int(deployment["spec"].get("replicas") or 1)
        deadline = time.monotonic() + timeout
        while True:
            old = [p for p in self.pods if p.template != want]
            new = [p for p in self.pods if p.template == want]
            if not old and len(new) >= replicas:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the rollout of {self.name} did not finish in {timeout}s")
            # maxSurge 1: one pod above the replica count at most.
            if len(self.pods) < replicas + (1 if old else 0):
                pod = await self._start(deployment, want)
                await self._wait_ready(pod, deadline)
                continue
            # maxUnavailable 0: an old pod goes only once the new ones are ready.
            victim = old[0]
            await self._stop(victim)

    async def _wait_ready(self, pod: OperatorPod, deadline: float) -> None:
        while not await pod.ready():
            if pod.process.returncode is not None:
                raise RuntimeError(f"{pod.name} exited ({pod.log_path})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pod.name} never became ready ({pod.log_path})")
            await asyncio.sleep(0.2)

    async def _start(self, deployment: dict[str, Any], template_hash: str) -> OperatorPod:
        template = deployment["spec"]["template"]
        container = template["spec"]["containers"][0]
        self._serial += 1
        name = f"{self.name}-{template_hash}-{self._serial}"
        labels = dict(template["metadata"].get("labels") or {})
        labels[TEMPLATE_HASH_LABEL] = template_hash
        kube = self.env.kube
        await kube.call(
            kube.core.create_namespaced_pod,
            self.namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "labels": labels},
                "spec": {"containers": [{"name": container["name"], "image": container["image"]}]},
            },
        )
        config = self.env.operator_config(pod_name=name)
        liveness, metrics = free_port(), free_port()
        argv = [sys.executable, "-m", "prorsa.cli", *container.get("args", [])]
        argv += [
            f"--kubeconfig={config.login_kubeconfig}",
            f"--listen=127.0.0.1:{config.listen_port}",
            f"--metrics-listen=127.0.0.1:{metrics}",
            f"--liveness=http://127.0.0.1:{liveness}/healthz",
            f"--agent-port={config.options.agent_port}",
            f"--pod-name={name}",
        ]
        log_path = self.log_dir / f"{name}.log"
        log = log_path.open("w")
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "POD_NAME": name,
                "POD_NAMESPACE": self.namespace,
            },
        )
        pod = OperatorPod(
            name=name,
            template=template_hash,
            image=str(container["image"]),
            process=process,
            liveness_port=liveness,
            metrics_port=metrics,
            log_path=log_path,
            _log=log,
        )
        self.pods.append(pod)
        return pod

    async def _stop(self, pod: OperatorPod) -> None:
        await pod.terminate()
        self.pods.remove(pod)
        self.retired.append(pod)
        kube = self.env.kube
        with contextlib.suppress(Exception):  # gone already: fine
            await kube.call(kube.core.delete_namespaced_pod, pod.name, self.namespace)

    async def close(self) -> None:
        for pod in list(self.pods):
            await self._stop(pod)
