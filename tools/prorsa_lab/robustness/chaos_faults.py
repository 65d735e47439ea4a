"""The faults of ``prorsa bench chaos``, each injected into a running deployment at a
random moment, most of them while a switch is in flight.

Everything is the real thing where the lab has it: the operator replicas are ``prorsa
operator`` processes (killed with SIGKILL, then started again as a container would be),
the router is the real smg process, the agents are real agents. What the lab stands in for
is said per fault: an engine crash is the engine double's (its in-pod supervisor, which
``prorsa-agent --launch`` is in an engine pod, is the fake kubelet's), and a hung agent is
one whose engine stops answering ``/v1/loads`` (a scheduler stuck in a collective), so its
``/v1/state`` outlasts the operator's poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prorsa_contract.labels import SWITCH_ANNOTATION, parse_intent
from prorsa_lab.doubles.kubelet import free_port
from prorsa_lab.doubles.stack import TOKEN_SECRET, Stack

OPERATOR_NS = "prorsa-system"


@dataclass
class Replica:
    """One operator replica: a ``prorsa operator --leader-elect`` process for a pod."""

    pod: str
    env: Stack
    log_dir: Path
    process: asyncio.subprocess.Process | None = None
    starts: int = 0
    stopped: bool = False  # stopped for good (the suite ends): not restarted
    restart_at: float | None = None  # loop time at which the supervisor starts it again

    async def start(self) -> None:
        if self.alive:
            return
        argv = self.env.operator_argv(
            pod_name=self.pod, metrics_port=free_port(), liveness_port=free_port()
        )
        self.starts += 1
        with (self.log_dir / f"{self.pod}.log").open("a") as log:
            log.write(f"--- start #{self.starts}\n")
            log.flush()
            self.process = await asyncio.create_subprocess_exec(
                *argv,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def kill(self) -> None:
        """SIGKILL: no clean-up, the Lease is not released (a node crash, an OOM kill)."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
            await self.process.wait()

    async def stop(self) -> None:
        """SIGTERM, as a pod deletion: the replica hands the Lease over."""
        self.stopped = True
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 60)
            except TimeoutError:
                await self.kill()


async def supervise(replicas: list[Replica], *, delay: float = 1.0) -> None:
    """Start again a replica whose process ended, as the kubelet restarts a pod's
    container: a replica that loses the Lease exits on purpose (``prorsa operator
    --leader-elect``), and a killed one comes back. ``delay`` after the exit, unless a
    fault set its own ``restart_at``. Runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        now = loop.time()
        for replica in replicas:
            if replica.stopped or replica.alive or replica.process is None:
                continue
            if replica.restart_at is None:
                replica.restart_at = now + delay
            elif now >= replica.restart_at:
                replica.restart_at = None
                await replica.start()
        await asyncio.sleep(0.25)


@dataclass
class ChaosContext:
    """What the faults act on."""

    env: Stack
    cluster: str
    replicas: list[Replica]
    token_file: Path
    rng: random.Random
    switch_wait: float = 30.0
    """How long a mid-switch fault waits for a switch to be in flight."""
    background: list[asyncio.Task[None]] = field(default_factory=list)

    async def lease_holder(self) -> Replica | None:
        lease = await self.env.kube.read_lease(OPERATOR_NS, "prorsa-operator")
        holder = str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")
        pod = holder.rsplit("_", 1)[0]
        return next((r for r in self.replicas if r.pod == pod and r.alive), None)

    async def switching_pod(self) -> tuple[str, dict[str, Any]] | None:
        """A pod whose switch is in flight (its intent annotation), with the intent."""
        for pod in await self.env.pods(self.cluster):
            meta = pod["metadata"]
            intent = parse_intent((meta.get("annotations") or {}).get(SWITCH_ANNOTATION))
            if intent is not None:
                return str(meta["name"]), dict(intent)
        return None

    async def mid_switch(self) -> tuple[str, dict[str, Any]] | None:
        """Wait (up to ``switch_wait``) for a switch in flight, a random part of it in."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.switch_wait
        while loop.time() < deadline:
            found = await self.switching_pod()
            if found is not None:
                # Somewhere in the switch: draining, waiting for the router, flipping.
                await asyncio.sleep(self.rng.uniform(0.0, 2.0))
                return await self.switching_pod() or found
            await asyncio.sleep(0.1)
        return None

    async def victim(self) -> tuple[str, dict[str, Any] | None]:
        """The pod mid-switch if one is within ``switch_wait``, else any engine pod."""
        found = await self.mid_switch()
        if found is not None:
            return found
        names = sorted(self.env.kubelet.pods)
        return self.rng.choice(names), None

    def later(self, seconds: float, action: Callable[[], Awaitable[Any]]) -> None:
        async def run() -> None:
            await asyncio.sleep(seconds)
            await action()

        self.background.append(asyncio.create_task(run()))

    async def settle_background(self) -> None:
        tasks, self.background = self.background, []
        for task in tasks:
            with contextlib.suppress(Exception):
                await task


Fault = Callable[[ChaosContext], Awaitable[dict[str, Any]]]


def _intent(intent: dict[str, Any] | None) -> dict[str, Any]:
    if intent is None:
        return {"midSwitch": False}
    return {"midSwitch": True, "to": intent.get("to"), "phase": intent.get("phase")}


async def kill_leader(ctx: ChaosContext) -> dict[str, Any]:
    """SIGKILL the replica that leads, mid-switch; its container restarts 1-5 s later
    (and stands by: the other takes over once the Lease expires)."""
    found = await ctx.mid_switch()
    leader = await ctx.lease_holder()
    if leader is None:
        return {"skipped": "no replica leads"}
    back = ctx.rng.uniform(1.0, 5.0)
    leader.restart_at = asyncio.get_running_loop().time() + back  # the supervisor's
    await leader.kill()
    await asyncio.sleep(back + 0.5)
    return (
        {"replica": leader.pod, "restartedAfter": round(back, 1)}
        | _intent(None if found is None else found[1])
        | ({"pod": found[0]} if found else {})
    )


async def kill_engine(ctx: ChaosContext) -> dict[str, Any]:
    """The engine of the pod mid-flip crashes; its supervisor starts it 1-3 s later in
    its launch role (decode)."""
    name, intent = await ctx.victim()
    back = ctx.rng.uniform(1.0, 3.0)
    crashed = await ctx.env.kubelet.crash_engine(name, restart_after=back)
    await asyncio.sleep(back + 0.5)
    return {"pod": name, "crashed": crashed, "restartedAfter": round(back, 1)} | _intent(intent)


async def kill_agent(ctx: ChaosContext) -> dict[str, Any]:
    """The agent of a pod (mid-switch if one is) goes away for 1-6 s, then comes back on
    the same address; the engine keeps its role meanwhile."""
    name, intent = await ctx.victim()
    down = ctx.rng.uniform(1.0, 6.0)
    done = await ctx.env.kubelet.restart_agent(name, down_for=down)
    await asyncio.sleep(down + 0.5)
    return {"pod": name, "killed": done, "downFor": round(down, 1)} | _intent(intent)


async def hang_agent(ctx: ChaosContext) -> dict[str, Any]:
    """A pod's agent hangs for 5-15 s: its engine stops answering ``/v1/loads``, so the
    agent's ``/v1/state`` (and its drain, if it is switching) wait on it."""
    name, intent = await ctx.victim()
    runtime = ctx.env.kubelet.pods.get(name)
    hang = ctx.rng.uniform(5.0, 15.0)
    if runtime is None:
        return {"skipped": f"{name} is not running"}
    faults = runtime.engine.faults
    faults.hang_loads = True
    try:
        await asyncio.sleep(hang)
    finally:
        faults.hang_loads = False
    return {"pod": name, "hungFor": round(hang, 1)} | _intent(intent)


async def delete_pod(ctx: ChaosContext) -> dict[str, Any]:
    """``kubectl delete pod`` of the pod mid-switch (or any engine pod)."""
    name, intent = await ctx.victim()
    await ctx.env.kube.delete_pod(ctx.env.namespace, name)
    return {"pod": name} | _intent(intent)


async def restart_router(ctx: ChaosContext) -> dict[str, Any]:
    """SIGKILL the smg process, mid-switch if one is; the kubelet starts it again."""
    found = await ctx.mid_switch()
    router = ctx.env.kubelet.router
    if router is None or router.process is None:
        return {"skipped": "no router runs"}
    pid = router.process.pid
    router.process.kill()
    return {"pid": pid} | _intent(None if found is None else found[1])


async def drop_watches(ctx: ChaosContext) -> dict[str, Any]:
    """Reset every watch connection of the API server (the operators', smg's), as an API
    server restart does, mid-switch if one is."""
    found = await ctx.mid_switch()
    dropped = ctx.env.server.emulator.drop_watches()
    return {"watches": dropped} | _intent(None if found is None else found[1])


async def rotate_token(ctx: ChaosContext) -> dict[str, Any]:
    """Write a new trainer token into its Secret; the trainer's mounted file follows
    0.5-5 s later (the kubelet's refresh)."""
    token = secrets.token_urlsafe(32)
    await ctx.env.kube.call(
        ctx.env.kube.core.patch_namespaced_secret,
        TOKEN_SECRET,
        ctx.env.namespace,
        {"stringData": {"token": token}},
    )
    ctx.env.token = token
    lag = ctx.rng.uniform(0.5, 5.0)
    await asyncio.sleep(lag)
    ctx.token_file.write_text(token)
    return {"fileLag": round(lag, 1)}


FAULTS: dict[str, Fault] = {
    "kill-leader": kill_leader,
    "kill-engine": kill_engine,
    "kill-agent": kill_agent,
    "hang-agent": hang_agent,
    "delete-pod": delete_pod,
    "restart-router": restart_router,
    "drop-watches": drop_watches,
    "rotate-token": rotate_token,
}
ROUTER_FAULTS = frozenset({"restart-router"})


def describe(detail: dict[str, Any]) -> str:
    return json.dumps(detail, separators=(",", ":"))


__all__ = [
    "FAULTS",
    "OPERATOR_NS",
    "ROUTER_FAULTS",
    "ChaosContext",
    "Fault",
    "Replica",
    "describe",
    "supervise",
]
