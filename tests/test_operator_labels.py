"""Role labels against the engines' roles (issue 13 item 9), end to end on the emulator:
the router routes by label, so the operator corrects a label that disagrees with the role
the pod's agent reports, with an Event on the RolloutCluster, and never guesses a role it
does not know."""

from __future__ import annotations

import asyncio
import json

import pytest

from prorsa_contract.labels import DRAINING, ROLE_LABEL, SWITCH_ANNOTATION
from prorsa_lab.doubles.sglang_double import EngineConfig, TimingModel
from prorsa_lab.doubles.stack import NAMESPACE, PATIENCE, Stack, cluster_manifest, stack

# The stack's pods and their labels: left out by `make test-fast`.
pytestmark = pytest.mark.slow


async def ready_split(env: Stack, prefill: int, decode: int) -> bool:
    counts = await env.count_roles()
    return counts.get("prefill", 0) == prefill and counts.get("decode", 0) == decode


async def corrections(env: Stack, pod: str) -> list[dict]:
    return [
        e
        for e in await env.events()
        if e.get("reason") == "RoleLabelCorrected" and pod in (e.get("message") or "")
    ]


async def test_a_label_edited_by_hand_is_corrected_with_an_event() -> None:
    async with stack() as env:
        await env.create_cluster(cluster_manifest())
        await env.kubelet.wait_running(4)
        await env.wait_for(lambda: ready_split(env, 1, 3), timeout=2 * PATIENCE, what="1P:3D")
        roles = await env.roles()
        victim = sorted(n for n, r in roles.items() if r == "decode")[0]
        assert env.kubelet.pods[victim].engine.role == "decode"
        await env.kube.patch_pod(
            NAMESPACE, victim, {"metadata": {"labels": {ROLE_LABEL: "prefill"}}}
        )

        async def corrected() -> list[dict]:
            back = (await env.roles())[victim] == "decode"
            return await corrections(env, victim) if back else []

        events = await env.wait_for(corrected, timeout=2 * PATIENCE, what="the label corrected")
        event = events[0]
        assert event["type"] == "Warning"
        assert event["involvedObject"]["kind"] == "RolloutCluster"
        assert event["involvedObject"]["name"] == "demo"
        assert "prefill -> decode" in event["message"]
        assert await ready_split(env, 1, 3)  # nothing was switched to "fix" it
        assert env.label_history[victim][-3:] == ["decode", "prefill", "decode"]


async def test_an_agent_lost_mid_switch_leaves_the_pod_unrouted_until_it_answers() -> None:
    """The agent goes away during a switch: the executor cannot learn the engine's role,
    so the pod keeps ``draining`` (no router selects it) instead of a guessed role; once
    the agent answers again, the label follows the engine's actual role."""
    slow = TimingModel(switch_seconds=3.0)
    async with stack(engine_config=lambda _n: EngineConfig(timing=slow)) as env:
        await env.create_cluster(cluster_manifest())

        async def someone_switching() -> str | None:
            for pod in await env.pods():
                meta = pod["metadata"]
                intent = (meta.get("annotations") or {}).get(SWITCH_ANNOTATION)
                if intent and json.loads(intent)["phase"] == "switching":
                    return str(meta["name"])
            return None

        # The bootstrap flip to 1P:3D takes 3 s: the agent goes away while it runs.
        name = await env.wait_for(someone_switching, timeout=2 * PATIENCE, what="a pod switching")
        engine_pod = env.kubelet.pods[name].pod
        await engine_pod.stop_agent()

        async def given_up() -> bool:
            pod = next(p for p in await env.pods() if p["metadata"]["name"] == name)
            meta = pod["metadata"]
            return SWITCH_ANNOTATION not in (meta.get("annotations") or {})

        # Three failed tries later the switch ends: role unknown, still out of the router.
        await env.wait_for(given_up, timeout=2 * PATIENCE, what="the executor to give up")
        assert (await env.roles())[name] == DRAINING
        await env.wait_for_event("SwitchLost", timeout=2 * PATIENCE)
        await asyncio.sleep(1.0)  # several ticks: no guess while the agent is away
        assert (await env.roles())[name] == DRAINING
        assert not await corrections(env, name)

        await engine_pod.start_agent()
        actual = env.kubelet.pods[name].engine.role

        async def reconciled() -> list[dict]:
            labelled = (await env.roles())[name]
            return await corrections(env, name) if labelled != DRAINING else []

        events = await env.wait_for(reconciled, timeout=2 * PATIENCE, what="the label reconciled")
        assert f"{DRAINING} -> {actual}" in events[0]["message"]
        await env.wait_for(lambda: ready_split(env, 1, 3), timeout=2 * PATIENCE, what="1P:3D again")
