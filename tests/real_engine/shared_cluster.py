"""The one cluster of real engines the agent and operator tests share.

Three one-CPU instances of the real SGLang 0.5.23 behind the real smg (Kubernetes
discovery), each pod the real agent launching its engine from the pod's ``PRORSA_*``
environment, the API emulator and the operator: what ``prorsa demo --engine sglang`` runs.
An engine takes two to four minutes to start on a loaded 2-core machine and about 3.5 GB,
so the session starts these three once (every engine launched as decode, one flipped to
prefill by the operator) and the modules that need real engines take turns on them, in the
order ``conftest.py`` sets: the agent's checks first (read-only, on the 1P:2D the cluster
comes up in), then the operator's switches and failure cases. The cluster is stopped
before anything else starts engines (the demo), never more than three at once.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import httpx

from prorsa_contract.labels import DRAINING
from prorsa_lab.doubles.stack import Stack, cluster_manifest, stack
from prorsa_lab.sglang_cpu.environment import CpuEngineEnv
from prorsa_lab.sglang_cpu.sglang_pod import CPU_TIMEOUTS, SglangPod

SERVED = "tiny"
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
START = 1800.0
"""Seconds for engines to load and the cluster to converge (three at once took 210-517 s on
a loaded 2-core machine; one reload after a kill more than 600 s at a load average near
30): the engine pods' startupProbe bound (``START_TIMEOUT``)."""
INSTANCES = 3


def manifest(env: CpuEngineEnv) -> dict[str, Any]:
    return cluster_manifest(
        model={"path": str(env.model), "servedName": SERVED},
        engine={
            "image": "prorsa/engine:0.5.23",
            "gpusPerInstance": 1,
            "tensorParallelSize": 1,
            "gpuResourceName": "",
            # SGLang's HiCache host tier needs CUDA (docs/testing.md).
            "env": [{"name": "PRORSA_DISABLE_HICACHE", "value": "1"}],
        },
        gpuBudget=INSTANCES,
        roles={"prefill": {"min": 1, "initial": 1}, "decode": {"min": 1}},
        router={"enabled": True, "policy": "round_robin"},
        switching={"drainTimeoutSeconds": 2, "cooldownSeconds": 0},
    )


async def split(env: Stack, prefill: int, decode: int) -> bool:
    counts = await env.count_roles()
    return counts.get("prefill", 0) == prefill and counts.get("decode", 0) == decode


async def smg_agrees(env: Stack) -> bool:
    """smg lists every engine pod with its role label's type (and nothing draining)."""
    router = env.kubelet.router
    if router is None:
        return False
    want = {}
    for pod in await env.pods():
        ip = (pod.get("status") or {}).get("podIP")
        role = pod["metadata"]["labels"].get("prorsa.io/role")
        if not ip or role == DRAINING:
            return False
        want[ip] = role
    async with httpx.AsyncClient(trust_env=False) as client:
        workers = await router.workers(client)
    got = {
        str(w.get("url", "")).split("://", 1)[-1].rsplit(":", 1)[0]: w.get("worker_type")
        for w in workers or []
        if w.get("is_healthy")
    }
    return len(want) == INSTANCES and got == want


def engine_pods(env: Stack) -> dict[str, SglangPod]:
    """The running engine pods by name (their agents, engine URLs, admin key)."""
    return {
        name: runtime.pod
        for name, runtime in env.kubelet.pods.items()
        if isinstance(runtime.pod, SglangPod)
    }


async def pods_by_role(env: Stack) -> dict[str, list[SglangPod]]:
    """The engine pods under each role label."""
    pods = engine_pods(env)
    out: dict[str, list[SglangPod]] = {}
    for name, role in sorted((await env.roles()).items()):
        if name in pods:
            out.setdefault(role, []).append(pods[name])
    return out


class SharedCluster:
    """Started on first use; :meth:`close` stops it (and it stays stopped)."""

    def __init__(self, *, engine_env: CpuEngineEnv, log_dir: Path) -> None:
        self.engine_env = engine_env
        self.log_dir = log_dir
        self.up_seconds: float | None = None
        self._stack: Stack | None = None
        self._exit = contextlib.AsyncExitStack()
        self._closed = False

    async def get(self) -> Stack:
        if self._closed:
            raise RuntimeError("the shared cluster was stopped (the demo's engines run now)")
        if self._stack is None:
            started = time.monotonic()
            env = await self._exit.enter_async_context(
                stack(
                    real_engines=self.engine_env,
                    agent_timeouts=CPU_TIMEOUTS,
                    run_router=True,
                    log_dir=self.log_dir,
                    tick_seconds=1.0,
                    router_settle_timeout=60.0,
                )
            )
            self._exit.callback(self._print_logs, env)
            await env.create_cluster(manifest(self.engine_env))
            await env.wait_for(lambda: split(env, 1, 2), timeout=START, what="1P:2D")
            await env.wait_for(lambda: smg_agrees(env), timeout=120, what="smg's workers")
            self.up_seconds = time.monotonic() - started
            self._stack = env
        return self._stack

    async def close(self) -> None:
        self._closed = True
        self._stack = None
        await self._exit.aclose()

    @staticmethod
    def _print_logs(env: Stack) -> None:
        for name, pod in engine_pods(env).items():
            print(f"--- {name} engine log (tail) ---\n{pod.log_tail(12)}")
