"""Shutdown order (issue 13 item 11): the operator closes the agents' shared HTTP client
only after every cluster's control loop and switches have stopped, so no switch calls an
agent through a closed client (``RuntimeError: Cannot send a request, as the client has
been closed``), not even one that the last tick started while shutdown was under way."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
from conftest import cluster_runtime, make_spec

from prorsa.core.decision import Switch
from prorsa.shell.process import run_kopf
from prorsa.switching.executor import ExecutorSettings, SwitchExecutor, SwitchOutcome
from prorsa.switching.pod_view import PodView
from prorsa_contract.agent_api import RoleResult

POD = {"metadata": {"name": "c-engine-1"}, "status": {"podIP": "127.0.0.9"}}


class Kube:
    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        return None


class Agents:
    """An agent client that fails as httpx does once closed."""

    def __init__(self) -> None:
        self.closed = False
        self.calls: list[str] = []

    async def set_role(self, address: Any, **_: Any) -> RoleResult:
        if self.closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        self.calls.append(address.instance)
        await asyncio.sleep(3600)  # a long drain: still running at shutdown
        raise AssertionError("unreachable")


async def test_closing_stops_the_loop_and_its_switches_before_the_client_closes() -> None:
    agents, kube = Agents(), Kube()
    done: list[SwitchOutcome] = []

    async def on_done(outcome: SwitchOutcome) -> None:
        done.append(outcome)

    runtime = cluster_runtime(make_spec(), kube=kube, agents=agents)
    executor = runtime.executor = SwitchExecutor(
        kube=kube,  # type: ignore[arg-type]
        agents=agents,  # type: ignore[arg-type]
        router=None,
        namespace="rl",
        token=lambda: "t",
        settings=ExecutorSettings(),
        on_done=on_done,
    )
    in_tick, finish_tick = asyncio.Event(), asyncio.Event()
    switch = Switch(instance="c-engine-0", **{"from": "decode"}, to="prefill")
    late = Switch(instance="c-engine-1", **{"from": "decode"}, to="prefill")

    async def tick_once() -> None:
        # The tick's decision: one switch now, one more after shutdown has begun.
        executor.start(
            switch, pod=PodView.from_manifest({**POD, "metadata": {"name": "c-engine-0"}})
        )
        in_tick.set()
        await finish_tick.wait()
        executor.start(late, pod=PodView.from_manifest(POD))

    runtime.tick_once = tick_once  # type: ignore[method-assign]
    runtime.start()
    await asyncio.wait_for(in_tick.wait(), 5)
    await asyncio.sleep(0.05)
    assert agents.calls == ["c-engine-0"]  # a switch is draining
    closing = runtime.close()
    await asyncio.sleep(0.05)
    finish_tick.set()
    await asyncio.wait_for(closing, 10)
    assert not executor.active  # nothing left to talk to an agent
    agents.closed = True  # what the operator's cleanup does next
    await asyncio.sleep(0.1)
    assert agents.calls == ["c-engine-0"] and not done  # the late switch never started
    assert runtime.close() is closing  # cleanup and the daemon share one close


async def test_a_stopping_kopf_cancels_its_own_tasks_not_the_loops_other_users() -> None:
    # The lab runs the operator in the loop of the emulated cluster: an engine double's
    # scheduler loop or an agent's switch started while the operator ran is not the
    # operator's, and must outlive its restart (kopf.operator cancelled both).
    registry = kopf.OperatorRegistry()
    spawned: list[asyncio.Task[None]] = []

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server="http://127.0.0.1:9", insecure=True)

    @kopf.on.startup(registry=registry)
    async def startup(**_: Any) -> None:
        spawned.append(asyncio.create_task(asyncio.sleep(3600)))  # left behind by a handler

    stop = asyncio.Event()
    running = asyncio.create_task(
        run_kopf(registry=registry, clusterwide=True, standalone=True, stop_flag=stop)
    )
    while not spawned:
        await asyncio.sleep(0.05)
    neighbour = asyncio.create_task(asyncio.sleep(3600))  # created after kopf started
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(running, 60)
    assert not neighbour.done()
    assert spawned[0].cancelled()  # kopf still sweeps what it spawned itself
    neighbour.cancel()
