"""A switch flips the engine only once the router has settled without it.

The router here answers ``GET /workers`` over loopback HTTP as smg 1.13.0 does (shape read
from the real binary): a worker is listed only once its registration job has finished,
so a freshly (re)started smg lists none. Restarted mid-switch (chaos suite,
restart-router round), smg first listed nothing, which the executor took for "dropped";
it flipped the engine to prefill while smg's registration of the pod, started from the
pod's labels before ``draining``, finished and routed decode requests to it, answered
with a prefill engine's single token.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from prorsa.core.decision import Switch
from prorsa.engines.agents import AgentClient, RouterClient
from prorsa.switching.executor import ExecutorSettings, SwitchExecutor, SwitchOutcome
from prorsa.switching.pod_view import PodView
from prorsa_contract.agent_api import EngineState, Role, RoleRequest, RoleResult
from prorsa_contract.labels import CLUSTER_LABEL, ROLE_LABEL

POD, IP = "c-engine-0", "127.0.0.1"
OTHERS = {"c-engine-1": ("127.0.0.2", "decode"), "c-engine-2": ("127.0.0.3", "prefill")}


class Router:
    """smg's ``/workers`` in one of three states the test sets."""

    def __init__(self) -> None:
        self.state = "restarted"  # -> "registered" (the pod too, old role) -> "dropped"

    async def workers(self, request: web.Request) -> web.Response:
        hosts = {"restarted": [], "dropped": [ip for ip, _ in OTHERS.values()]}
        listed = hosts.get(self.state, [IP, *hosts["dropped"]])
        workers = [{"url": f"http://{ip}:30000", "is_healthy": True} for ip in listed]
        return web.json_response({"workers": workers, "total": len(workers), "stats": {}})


class Agent:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.role: Role = "decode"
        self.flipped_while: list[str] = []  # the router's state at each flip

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(EngineState(instance=POD, role=self.role).wire())

    async def switch(self, request: web.Request) -> web.Response:
        wanted = RoleRequest.model_validate_json(await request.read())
        self.flipped_while.append(self.router.state)
        old, self.role = self.role, wanted.role
        return web.json_response(RoleResult(ok=True, old_role=old, new_role=wanted.role).wire())


def pod(name: str, ip: str, role: str) -> dict[str, Any]:
    ready = [{"type": "Ready", "status": "True"}]
    return {
        "metadata": {"name": name, "labels": {CLUSTER_LABEL: "c", ROLE_LABEL: role}},
        "status": {"phase": "Running", "podIP": ip, "conditions": ready},
    }


class Kube:
    def __init__(self) -> None:
        self.labels: list[str] = []  # the switching pod's role labels, in order

    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        if role := (patch["metadata"].get("labels") or {}).get(ROLE_LABEL):
            self.labels.append(role)

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        assert selector == f"{CLUSTER_LABEL}=c"
        mine = pod(POD, IP, self.labels[-1] if self.labels else "decode")
        return [mine, *(pod(n, ip, role) for n, (ip, role) in OTHERS.items())]


class Running:
    def __init__(self, router: Router, agent: Agent, port: int) -> None:
        self.router, self.agent, self.port = router, agent, port
        self.kube = Kube()
        self.done: list[SwitchOutcome] = []
        self.http = httpx.AsyncClient(trust_env=False)

    def executor(
        self, *, settle_timeout: float = 30.0, router_url: str | None = None
    ) -> SwitchExecutor:
        async def on_done(outcome: SwitchOutcome) -> None:
            self.done.append(outcome)

        agents = AgentClient()
        return SwitchExecutor(
            kube=self.kube,  # type: ignore[arg-type]
            agents=agents,
            router=RouterClient(client=self.http),
            namespace="rl",
            token=lambda: "t",
            settings=ExecutorSettings(
                agent_port=self.port,
                router_url=router_url or f"http://127.0.0.1:{self.port}",
                router_settle_timeout=settle_timeout,
                poll_interval=0.05,
            ),
            on_done=on_done,
        )


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    router = Router()
    agent = Agent(router)
    app = web.Application()
    app.router.add_get("/workers", router.workers)
    app.router.add_get("/v1/state", agent.state)
    app.router.add_post("/v1/role", agent.switch)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    running = Running(router, agent, runner.addresses[0][1])
    try:
        yield running
    finally:
        await running.http.aclose()
        await runner.cleanup()


SWITCH = Switch(instance=POD, **{"from": "decode"}, to="prefill")


async def test_a_restarted_router_listing_nothing_is_not_a_drop(running: Running) -> None:
    switches = running.executor()
    mine = pod(POD, IP, "decode")
    try:
        assert switches.start(SWITCH, pod=PodView.from_manifest(mine))
        task = next(iter(switches.active.values()))
        await asyncio.sleep(0.5)  # ten polls of a router that lists nothing yet
        assert running.agent.flipped_while == []
        running.router.state = "registered"  # its registration of the pod finished
        await asyncio.sleep(0.5)
        assert running.agent.flipped_while == []
        running.router.state = "dropped"
        outcome = await asyncio.wait_for(task, 10)
    finally:
        await switches.agents.aclose()
    assert outcome.result == "succeeded"
    assert running.agent.flipped_while == ["dropped"]
    assert running.kube.labels == ["draining", "prefill"]
    # Where the time went: over a second waiting for the router, then the agent's call.
    assert outcome.router_seconds is not None and outcome.router_seconds >= 1.0
    assert outcome.engine_seconds is not None
    assert outcome.router_seconds + outcome.engine_seconds <= outcome.seconds


async def test_a_router_that_never_settles_leaves_the_engine_as_it_was(
    running: Running,
) -> None:
    """Still registering (lists nothing) at the settle timeout: no flip, label restored."""
    switches = running.executor(settle_timeout=0.6)
    try:
        assert switches.start(SWITCH, pod=PodView.from_manifest(pod(POD, IP, "decode")))
        outcome = await asyncio.wait_for(next(iter(switches.active.values())), 10)
    finally:
        await switches.agents.aclose()
    assert outcome.result == "restored", outcome
    assert "not switched" in outcome.message
    assert running.agent.flipped_while == [] and running.agent.role == "decode"
    assert running.kube.labels == ["draining", "decode"]
    assert outcome.router_seconds is not None and outcome.engine_seconds is None  # no flip
    assert json.dumps(outcome.record())  # what the status and events carry


async def test_a_router_that_does_not_answer_at_all_does_not_block_the_switch(
    running: Running,
) -> None:
    """No router process answers (down, or not deployed yet): one that starts later reads
    the ``draining`` label, so only the settle timeout is waited out."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    switches = running.executor(settle_timeout=0.3, router_url=f"http://127.0.0.1:{closed}")
    try:
        assert switches.start(SWITCH, pod=PodView.from_manifest(pod(POD, IP, "decode")))
        outcome = await asyncio.wait_for(next(iter(switches.active.values())), 10)
    finally:
        await switches.agents.aclose()
    assert outcome.result == "succeeded", outcome
    assert running.kube.labels == ["draining", "prefill"]
