"""What the operator sends an agent to switch a role: the contract's ``RoleRequest``, byte for
byte the body docs/agent-api.md shows, carried from the Decision's ``Switch.to`` or a
restarted operator's intent annotation to the agent's ``POST /v1/role``."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from prorsa.core.decision import Switch
from prorsa.engines.agents import AgentClient, agent_address
from prorsa.shell.handlers import parse_spec
from prorsa.switching.executor import ExecutorSettings, SwitchExecutor, SwitchOutcome
from prorsa.switching.pod_view import PodView
from prorsa_contract.agent_api import EngineState, Role, RoleRequest, RoleResult
from prorsa_contract.labels import ROLE_LABEL, SWITCH_ANNOTATION
from prorsa_lab.doubles.stack import cluster_manifest

ROOT = Path(__file__).resolve().parent.parent
POD = "c-engine-3"
TOKEN = "agent-token"


class Agent:
    """A loopback agent that records every role request it is sent."""

    def __init__(self) -> None:
        self.role: Role = "decode"
        self.bodies: list[bytes] = []
        self.auth: list[str | None] = []

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(EngineState(instance=POD, role=self.role).wire())

    async def switch(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.read())
        self.auth.append(request.headers.get("Authorization"))
        wanted = RoleRequest.model_validate_json(self.bodies[-1])
        old, self.role = self.role, wanted.role
        result = RoleResult(ok=True, old_role=old, new_role=wanted.role)
        return web.json_response(result.wire())


@pytest.fixture
async def agent() -> AsyncIterator[tuple[Agent, int]]:
    double = Agent()
    app = web.Application()
    app.router.add_get("/v1/state", double.state)
    app.router.add_post("/v1/role", double.switch)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield double, port
    finally:
        await runner.cleanup()


def pod(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": POD, "namespace": "rl", "annotations": annotations or {}},
        "status": {"podIP": "127.0.0.1"},
    }


async def test_the_role_request_body_is_the_documented_one(agent: tuple[Agent, int]) -> None:
    double, port = agent
    address = agent_address(pod(), port=port, ca=None)
    assert address is not None
    agents = AgentClient()
    try:
        request = RoleRequest(role="prefill", drain_timeout_seconds=12.5)
        result = await agents.set_role(address, request=request, token=TOKEN)
    finally:
        await agents.aclose()
    assert result.ok and result.old_role == "decode" and result.new_role == "prefill"
    assert json.loads(double.bodies[0]) == {"role": "prefill", "drainTimeoutSeconds": 12.5}
    assert double.auth == [f"Bearer {TOKEN}"]
    # The same keys as the request docs/agent-api.md shows users.
    doc = (ROOT / "docs" / "agent-api.md").read_text()
    shown = re.search(r"POST /v1/role\nAuthorization: Bearer <token>\n(\{.*\})\n", doc)
    assert shown is not None, "docs/agent-api.md no longer shows the role request body"
    assert re.findall(r'"(\w+)":', shown.group(1)) == list(json.loads(double.bodies[0]))


class Kube:
    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []

    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.patches.append(patch)

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return pod()


def executor(port: int, kube: Kube, done: list[SwitchOutcome]) -> SwitchExecutor:
    async def on_done(outcome: SwitchOutcome) -> None:
        done.append(outcome)

    return SwitchExecutor(
        kube=kube,  # type: ignore[arg-type]
        agents=AgentClient(),
        router=None,
        namespace="rl",
        token=lambda: TOKEN,
        settings=ExecutorSettings(agent_port=port, drain_timeout=7.5),
        on_done=on_done,
    )


async def test_a_switch_sends_its_target_role_and_the_spec_drain_timeout(
    agent: tuple[Agent, int],
) -> None:
    double, port = agent
    kube, done = Kube(), []
    switches = executor(port, kube, done)
    try:
        assert switches.start(
            Switch(instance=POD, **{"from": "decode"}, to="prefill"),
            pod=PodView.from_manifest(pod()),
        )
        await next(iter(switches.active.values()))
    finally:
        await switches.agents.aclose()
    assert [json.loads(b) for b in double.bodies] == [
        {"role": "prefill", "drainTimeoutSeconds": 7.5}
    ]
    assert [(o.origin, o.to, o.result) for o in done] == [("decode", "prefill", "succeeded")]
    assert kube.patches[-1]["metadata"]["labels"] == {ROLE_LABEL: "prefill"}


async def test_a_resumed_switch_without_its_origin_still_flips_to_its_target(
    agent: tuple[Agent, int],
) -> None:
    """An intent written before ``from`` was recorded, or with a ``from`` that is no role:
    the target is known, so the switch finishes, leaving the other role."""
    double, port = agent
    kube, done = Kube(), []
    switches = executor(port, kube, done)
    intent = json.dumps({"to": "prefill", "from": "sideways", "phase": "switching"})
    try:
        assert switches.resume(PodView.from_manifest(pod({SWITCH_ANNOTATION: intent})))
        await next(iter(switches.active.values()))
    finally:
        await switches.agents.aclose()
    assert [json.loads(b)["role"] for b in double.bodies] == ["prefill"]
    assert [(o.origin, o.to, o.result) for o in done] == [("decode", "prefill", "succeeded")]


def test_the_spec_refuses_a_drain_the_agent_would_refuse() -> None:
    """A drain timeout past the agent's limit would fail every switch at the agent (422):
    admission refuses it, naming the field."""
    spec = cluster_manifest()["spec"]
    parse_spec({**spec, "switching": {"drainTimeoutSeconds": 3600}})
    with pytest.raises(ValueError, match=r"spec\.switching\.drainTimeoutSeconds"):
        parse_spec({**spec, "switching": {"drainTimeoutSeconds": 7200}})
