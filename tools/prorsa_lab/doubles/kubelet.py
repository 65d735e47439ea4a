"""A stand-in kubelet: runs the engine pods of a Kubernetes API (real or emulated) as an
SGLang engine double plus a real in-pod agent each, on loopback, and with
``run_routers`` the router Deployment as the real smg binary
(:mod:`prorsa_lab.doubles.smg_router`).

Each pod gets its own loopback address (127.A.B.N, with A.B drawn per kubelet so that two
test processes on one machine do not meet), so every agent listens on the same port, every
engine on one shared port and its bootstrap server on the pod's ``sglang.ai/bootstrap-port``,
as in a real cluster: the operator reaches an agent at ``https://<podIP>:<agent port>``, with
the certificate the pod mounts from its cluster's agent TLS Secret (the kubelet projects the
token, the engine admin key and the certificate files as a real one would), and smg an
engine at ``<podIP>:<engine port>``. When the pod is deleted its engine and agent stop; a
failed pod can be simulated by :meth:`FakeKubelet.fail`. Used by the operator's end-to-end
tests and by ``make demo``.

The pods of a multi-node instance of node rank >= 1 (``prorsa.io/node-rank``, or the worker
index of a LeaderWorkerSet's pod) run the engine double's worker mode
(:mod:`prorsa_lab.doubles.engine.worker`): linked to their leader's double by the group
label, they exit (pod phase Failed) when the leader goes, and the leader serves only while
every rank is there.

A pod runs only if the engine image could run its command: the image's entry point
``prorsa-agent`` (with ``--worker`` on a worker rank). The image installs the light
``prorsa-agent`` distribution, not the ``prorsa`` CLI, so any other command stays Pending
here, as it would fail to start in a cluster.

With ``real_engines`` (the engine environment, :mod:`prorsa_lab.sglang_cpu`) each one-node
engine pod runs the real SGLang 0.5.23 on this CPU instead of a double: the agent launches
it from the pod's ``PRORSA_*`` environment as in the engine image, with the CPU flags
added. The pod stays Pending while the engine loads (1.5-2 minutes) and becomes Running and
Ready once the agent reports it healthy, as a readiness probe on ``/readyz`` would have it;
an engine that cannot start fails its pod. HiCache is left out (its host tier needs CUDA).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from kubernetes.client.exceptions import ApiException

from prorsa.k8s.groups import node_rank
from prorsa.k8s.kube import Kube
from prorsa_agent.config import Timeouts, args_from_env
from prorsa_contract.aio import cancel_and_wait
from prorsa_contract.labels import (
    AGENT_COMMAND,
    BOOTSTRAP_ANNOTATION,
    BOOTSTRAP_PORT,
    COMPONENT_LABEL,
    GROUP_LABEL,
    MANAGED_BY,
    NODES_LABEL,
)
from prorsa_lab.doubles.kube.pod_status import kubelet_pod_status
from prorsa_lab.doubles.sglang_double import (
    FAST_TIMEOUTS,
    EngineConfig,
    EngineDouble,
    EnginePod,
    NodeGroup,
    WorkerRank,
)
from prorsa_lab.doubles.smg_router import SmgRouter, local_args, smg_binary
from prorsa_lab.sglang_cpu.environment import CpuEngineEnv
from prorsa_lab.sglang_cpu.sglang_pod import EngineStartFailed, SglangPod

log = logging.getLogger("prorsa.kubelet")

READINESS_PERIOD = 5.0
READINESS_FAILURES = 2
"""The engine pods' readinessProbe (``prorsa.k8s.objects``: ``/readyz``, 5 s, 2 failures)."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def runs_in_the_engine_image(container: dict[str, Any], *, worker: bool) -> bool:
    """Whether the engine image has the container's command: ``prorsa-agent``, with
    ``--worker`` exactly when the pod is a worker rank (a leader with it would serve no API)."""
    command = [*(container.get("command") or []), *(container.get("args") or [])]
    if not command or Path(command[0]).name != AGENT_COMMAND:
        return False
    return ("--worker" in command[1:]) == worker


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
    pod: EnginePod | SglangPod
    group: NodeGroup | None = None
    """The leader of a multi-node instance: its ranks."""
    starting: asyncio.Task[None] | None = None
    """A real engine's start, then its readiness probe (``real_engines``)."""

    @property
    def engine(self) -> EngineDouble:
        if not isinstance(self.pod, EnginePod):
            raise TypeError(f"pod {self.name} runs the real SGLang, not an engine double")
        return self.pod.double


@dataclass
class WorkerRuntime:
    """A worker rank's pod: its address and its rank of the group."""

    name: str
    uid: str
    ip: str
    rank: WorkerRank


@dataclass(kw_only=True)
class FakeKubelet:
    kube: Kube
    namespace: str
    agent_port: int = field(default_factory=free_port)
    engine_config: Callable[[str], EngineConfig] = lambda _name: EngineConfig()
    poll_interval: float = 0.2
    timeouts: Timeouts = FAST_TIMEOUTS
    engine_port: int = field(default_factory=free_port)
    run_routers: bool = False
    """Run each router Deployment (``app.kubernetes.io/component: router``) as smg."""
    kubeconfig: str | None = None  # what smg's discovery reads
    router_port: int = field(default_factory=free_port)  # the first router's port
    log_dir: Path | None = None  # smg's log goes to <log_dir>/<deployment>.log
    real_engines: CpuEngineEnv | None = None
    """Run the real SGLang on this CPU in each engine pod (module docstring)."""
    pods: dict[str, PodRuntime] = field(default_factory=dict)
    routers: dict[str, tuple[str, SmgRouter]] = field(default_factory=dict)  # name: (uid, smg)
    ip_prefix: str = field(
        default_factory=lambda: f"127.{random.randint(1, 254)}.{random.randint(0, 255)}"
    )
    """The pods that run an engine and its agent (one-node instances and leaders)."""
    workers: dict[str, WorkerRuntime] = field(default_factory=dict)
    """The worker ranks of multi-node instances, by pod name."""
    groups: dict[str, NodeGroup] = field(default_factory=dict)
    _next_ip: int = 10
    _free_ips: list[str] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _warned: bool = False
    _unrunnable: set[str] = field(default_factory=set)  # pods warned about, by uid
    _comebacks: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # by pod name

    async def __aenter__(self) -> FakeKubelet:
        self._task = asyncio.create_task(self._loop(), name="fake-kubelet")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._task)
        for name in [*self.pods, *self.workers]:
            await self._stop(name)
        for name in list(self.routers):
            self._stop_router(name)

    @property
    def router(self) -> SmgRouter | None:
        """The first router running (the one at :attr:`router_port`)."""
        running = [smg for _, smg in self.routers.values() if smg.port == self.router_port]
        return running[0] if running else None

    async def wait_running(self, count: int, *, timeout: float = 90.0) -> None:
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
        await self._failed(name)

    async def crash_engine(self, name: str, *, restart_after: float) -> bool:
        """The pod's engine process dies; the agent's supervisor (``prorsa-agent --launch``
        in an engine pod) starts it again ``restart_after`` seconds later, in its launch
        role. False when no engine of that name runs here."""
        runtime = self.pods.get(name)
        if runtime is None or name in self._comebacks:
            return False
        await runtime.engine.crash()
        self._come_back(name, runtime, restart_after, runtime.engine.restart)
        return True

    async def restart_agent(self, name: str, *, down_for: float) -> bool:
        """The pod's agent goes away (killed, or cut off) and is back ``down_for`` seconds
        later, on the same address; the engine keeps running in its role meanwhile. False
        when no engine pod of that name runs here."""
        runtime = self.pods.get(name)
        # Real SGLang pods run their agent in the engine's process group: the chaos suite
        # restarts the agents of engine doubles only.
        if runtime is None or name in self._comebacks or not isinstance(runtime.pod, EnginePod):
            return False
        await runtime.pod.stop_agent()
        self._come_back(name, runtime, down_for, runtime.pod.start_agent)
        return True

    def _come_back(
        self, name: str, runtime: PodRuntime, after: float, start: Callable[[], Awaitable[object]]
    ) -> None:
        async def later() -> None:
            try:
                await asyncio.sleep(after)
                if self.pods.get(name) is runtime:  # not stopped or replaced meanwhile
                    await start()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("pod %s: restart after a fault", name)
            finally:
                if self._comebacks.get(name) is task:
                    del self._comebacks[name]

        task = asyncio.create_task(later(), name=f"comeback-{name}")
        self._comebacks[name] = task

    async def _failed(self, name: str) -> None:
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
                seen = {pod["metadata"]["name"] for pod in listed}
                # Gone pods first: a recreated group must not meet its predecessor's ranks.
                for name in [*self.pods, *self.workers]:
                    if name not in seen:
                        await self._stop(name)
                for pod in listed:
                    meta = pod["metadata"]
                    name, uid = meta["name"], meta.get("uid", "")
                    phase = (pod.get("status") or {}).get("phase")
                    current = self.pods.get(name) or self.workers.get(name)
                    if current is not None and current.uid != uid:
                        await self._stop(name)  # deleted and recreated under the same name
                        current = None
                    if current is None and phase not in ("Failed", "Succeeded"):
                        await self._start(pod)
                if self.run_routers:
                    await self._sync_routers()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("fake kubelet loop")
            await asyncio.sleep(self.poll_interval)

    def _ip(self) -> str:
        if self._free_ips:
            return self._free_ips.pop()
        ip = f"{self.ip_prefix}.{self._next_ip}"
        self._next_ip += 1
        return ip

    def _group(self, pod: dict[str, Any]) -> NodeGroup | None:
        labels = pod["metadata"].get("labels") or {}
        nodes = int(labels.get(NODES_LABEL, "1") or 1)
        if nodes <= 1 or GROUP_LABEL not in labels:
            return None
        name = labels[GROUP_LABEL]
        # One world per generation: once formed and left by its rank 0, it is dead, and the
        # recreated group's pods start a fresh one.
        group = self.groups.get(name)
        if group is None or (group.formed and group.leader is None) or group.nnodes != nodes:
            group = self.groups[name] = NodeGroup(name=name, nnodes=nodes)
        return group

    async def _start_worker(self, pod: dict[str, Any], group: NodeGroup, ip: str) -> None:
        meta = pod["metadata"]
        name, uid = meta["name"], meta.get("uid", "")
        rank = node_rank(pod)
        worker = WorkerRank(instance=name, rank=rank, group=group, on_exit=self._worker_exited)
        await worker.start()
        self.workers[name] = WorkerRuntime(name=name, uid=uid, ip=ip, rank=worker)
        await self._running(pod, name, ip)
        log.info("worker %s (rank %d of %s) running at %s", name, rank, group.name, ip)

    async def _worker_exited(self, worker: WorkerRank) -> None:
        """The rank's process ended (its rank 0 is gone): the container fails."""
        runtime = self.workers.get(worker.instance)
        if runtime is None or runtime.rank is not worker:
            return
        del self.workers[worker.instance]
        self._free_ips.append(runtime.ip)
        with contextlib.suppress(Exception):
            await self._failed(worker.instance)

    async def _start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        name, uid = meta["name"], meta.get("uid", "")
        group = self._group(pod)
        worker = group is not None and node_rank(pod) != 0
        (container,) = pod["spec"]["containers"]
        if not runs_in_the_engine_image(container, worker=worker):
            if uid not in self._unrunnable:
                self._unrunnable.add(uid)
                command = [*(container.get("command") or []), *(container.get("args") or [])]
                log.warning("pod %s runs %r, not %s: not started", name, command, AGENT_COMMAND)
            return
        if worker and group is not None:
            await self._start_worker(pod, group, self._ip())
            return
        token = await self._mounted(pod, "PRORSA_AGENT_TOKEN_FILE")
        key = await self._mounted(pod, "PRORSA_ENGINE_API_KEY_FILE")
        cert = await self._mounted(pod, "PRORSA_AGENT_TLS_CERT_FILE")
        cert_key = await self._mounted(pod, "PRORSA_AGENT_TLS_KEY_FILE")
        if token is None or key is None or cert is None or cert_key is None:
            return  # the operator creates the Secrets before the pods; try again next loop
        ip = self._ip()
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}
        if self.real_engines is not None:
            if group is not None:
                log.warning("pod %s: multi-node instances run engine doubles only", name)
                self._free_ips.append(ip)
                return
            real = self._real_pod(name, ip=ip, env=env, meta=meta, token=token, key=key)
            real_tls = (cert or None, cert_key or None)
            runtime = PodRuntime(name=name, uid=uid, ip=ip, pod=real)
            runtime.starting = asyncio.create_task(
                self._start_real(pod, runtime, real_tls), name=f"start-{name}"
            )
            self.pods[name] = runtime
            return
        # One engine port for every pod, as in a cluster: the router reaches podIP:port.
        config = self.engine_config(name)
        served = env.get("PRORSA_SERVED_MODEL_NAME") or env.get("PRORSA_MODEL_PATH")
        bootstrap = (meta.get("annotations") or {}).get(BOOTSTRAP_ANNOTATION)
        config = dataclasses.replace(
            config,
            host=ip,
            port=self.engine_port,
            serve_bootstrap=True,
            bootstrap_port=int(bootstrap) if bootstrap else BOOTSTRAP_PORT,
            served_model_name=config.served_model_name or served,
        )
        engine_pod = EnginePod(
            instance=name,
            token=token,
            engine=config,
            timeouts=self.timeouts,
            agent_host=ip,
            agent_port=self.agent_port,
            engine_api_key=key or None,
            tls_cert=cert or None,
            tls_key=cert_key or None,
        )
        await engine_pod.start()
        if group is not None:
            group.join_leader(engine_pod.double)
        self.pods[name] = PodRuntime(name=name, uid=uid, ip=ip, pod=engine_pod, group=group)
        await self._running(pod, name, ip)
        log.info("pod %s running at %s", name, ip)

    def _real_pod(
        self,
        name: str,
        *,
        ip: str,
        env: dict[str, str | None],
        meta: dict[str, Any],
        token: str,
        key: str,
    ) -> SglangPod:
        assert self.real_engines is not None
        flags = {k: v for k, v in env.items() if v is not None and k != "PRORSA_ENGINE_HOST"}
        bootstrap = (meta.get("annotations") or {}).get(BOOTSTRAP_ANNOTATION)
        return SglangPod(
            env=self.real_engines,
            instance=name,
            token=token,
            host=ip,
            engine_port=self.engine_port,
            agent_port=self.agent_port,
            bootstrap_port=int(bootstrap) if bootstrap else BOOTSTRAP_PORT,
            engine_api_key=key or None,
            served_model_name=flags.get("PRORSA_SERVED_MODEL_NAME")
            or flags.get("PRORSA_MODEL_PATH"),
            timeouts=self.timeouts,
            log_dir=self.log_dir,
            env_args=tuple(args_from_env(flags)),
        )

    async def _start_real(
        self, pod: dict[str, Any], runtime: PodRuntime, tls: tuple[str | None, str | None]
    ) -> None:
        """Launch the engine through its agent; Running once it serves, Failed if it
        cannot start."""
        real = runtime.pod
        assert isinstance(real, SglangPod)
        real.set_tls(*tls)
        try:
            await real.start()
            await real.wait_ready()
        except EngineStartFailed as exc:
            log.error("pod %s: %s", runtime.name, exc)
            await real.stop()
            await self._failed(runtime.name)
            return
        await self._running(pod, runtime.name, runtime.ip)
        log.info("pod %s running the real SGLang at %s", runtime.name, runtime.ip)
        await self._probe_readiness(runtime)

    async def _probe_readiness(self, runtime: PodRuntime) -> None:
        """The pod's readinessProbe as the operator renders it (``/readyz`` on the agent
        every 5 s, NotReady after 2 failures, Ready after 1 success), with the engine's
        restarts counted: an engine restarting for minutes leaves smg through it, as in a
        cluster. (The doubles start at once and keep their pods Ready.)"""
        real = runtime.pod
        assert isinstance(real, SglangPod)
        ready, failures = True, 0
        async with httpx.AsyncClient(verify=False, timeout=5, trust_env=False) as client:
            while True:
                await asyncio.sleep(READINESS_PERIOD)
                try:
                    ok = (await client.get(f"{real.agent_url}/readyz")).status_code == 200
                except (httpx.HTTPError, RuntimeError):
                    ok = False
                failures = 0 if ok else failures + 1
                now = ok or (ready and failures < READINESS_FAILURES)
                if now == ready:
                    continue
                ready = now
                pod = await self.kube.get_pod(self.namespace, runtime.name)
                if pod is None:
                    return
                sup = real.agent.supervisor if real.agent is not None else None
                status = kubelet_pod_status(
                    pod,
                    phase="Running",
                    now=_now(),
                    ip=runtime.ip,
                    ready=ready,
                    restarts=sup.restarts if sup is not None else 0,
                )
                await self._write_status(runtime.name, status)
                log.info("pod %s %s", runtime.name, "ready" if ready else "not ready")

    async def _running(self, pod: dict[str, Any], name: str, ip: str) -> None:
        await self._write_status(name, kubelet_pod_status(pod, phase="Running", now=_now(), ip=ip))

    async def _write_status(self, name: str, status: dict[str, Any]) -> None:
        """Replace the whole status, as a kubelet's status manager does: a merge patch would
        keep the list entries of an earlier status. A pod deleted meanwhile (a group's keeper
        recreating it as the engine died) has no status left to write."""
        try:
            await self.kube.call(
                self.kube.core.patch_namespaced_pod_status,
                name,
                self.namespace,
                [{"op": "replace", "path": "/status", "value": status}],
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            log.info("pod %s is gone: its status is not written", name)

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

    async def _sync_routers(self) -> None:
        selector = f"{MANAGED_BY}=prorsa,{COMPONENT_LABEL}=router"
        listed = await self.kube.call(
            self.kube.apps.list_namespaced_deployment, self.namespace, label_selector=selector
        )
        seen = set()
        for d in listed.get("items") or []:
            name, uid = d["metadata"]["name"], d["metadata"].get("uid", "")
            seen.add(name)
            current = self.routers.get(name)
            if current is not None and (current[0] != uid or not current[1].alive()):
                self._stop_router(name)  # replaced, or the process died: start it again
                current = None
            if current is None:
                self._start_router(name, uid, d)
        for name in list(self.routers):
            if name not in seen:
                self._stop_router(name)

    def _start_router(self, name: str, uid: str, deployment: dict[str, Any]) -> None:
        binary = smg_binary()
        if binary is None or self.kubeconfig is None:
            if not self._warned:
                log.warning("router %s not started: no smg binary or no kubeconfig", name)
                self._warned = True
            return
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        command = [*(container.get("command") or []), *(container.get("args") or [])]
        if not command or Path(command[0]).name != "smg":
            log.warning("router %s runs %r, not smg: not started", name, command[:1])
            return
        taken = {smg.port for _, smg in self.routers.values()}
        port = self.router_port if self.router_port not in taken else free_port()
        args = local_args(
            command[1:],
            host="127.0.0.1",
            port=port,
            engine_port=self.engine_port,
            prometheus_port=free_port(),
        )
        smg = SmgRouter(
            binary=binary,
            args=args,
            kubeconfig=self.kubeconfig,
            port=port,
            log_path=self.log_dir / f"{name}.log" if self.log_dir else None,
        )
        smg.start()
        self.routers[name] = (uid, smg)

    def _stop_router(self, name: str) -> None:
        entry = self.routers.pop(name, None)
        if entry is not None:
            entry[1].stop()

    async def _stop(self, name: str) -> None:
        await cancel_and_wait(self._comebacks.pop(name, None))
        worker = self.workers.pop(name, None)
        if worker is not None:
            await worker.rank.stop()
            self._free_ips.append(worker.ip)
            return
        pod = self.pods.pop(name, None)
        if pod is None:
            return
        if pod.group is not None:
            pod.group.leave_leader()  # its workers exit
        await cancel_and_wait(pod.starting)
        # A real engine's stop also ends its process group whatever its supervisor task
        # did (an event loop shutting down may have cancelled that task already).
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await pod.pod.stop()
        self._free_ips.append(pod.ip)
