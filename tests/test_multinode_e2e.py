"""Two-pod engine instances end to end: the operator (kopf) against the API emulator, each
instance a leader (engine double + real agent) and a worker rank (the double's worker
mode) run by the fake kubelet."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from test_operator_e2e import prefill_heavy

from prorsa_contract.labels import (
    DRAINING,
    GROUP_LABEL,
    NODE_RANK_LABEL,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
)
from prorsa_lab.doubles.sglang_double import EngineConfig, TimingModel
from prorsa_lab.doubles.stack import NAMESPACE, Stack, cluster_manifest, stack


def two_node(**spec: Any) -> dict[str, Any]:
    engine = {"nodesPerInstance": 2, **spec.pop("engine", {})}
    return cluster_manifest(engine=engine, **spec)


def decoding(env: Stack, prefill_pod: str, n: int = 6, tokens: int = 10_000) -> list[dict]:
    """n trajectories past prefill, decoding: n·tokens of KV (b = 3 instances of the 20k
    C_KV) and no prefill work left, so a = 0 whatever prefill speed has been measured."""
    out = []
    for i in range(n):
        t = f"d{env._ids}-{i}"
        out.append(env.event("request_queued", t, prompt_tokens=tokens, turn=0))
        out.append(env.event("prefill_started", t, instance=prefill_pod))
        out.append(env.event("prefill_finished", t, instance=prefill_pod))
    return out


def leader(pod: dict[str, Any]) -> bool:
    return pod["metadata"]["labels"].get(NODE_RANK_LABEL) == "0"


async def groups(env: Stack) -> dict[str, list[dict[str, Any]]]:
    """The engine pods by group (leader name), leader first."""
    out: dict[str, list[dict[str, Any]]] = {}
    for pod in sorted(await env.pods(), key=lambda p: p["metadata"]["name"]):
        out.setdefault(pod["metadata"]["labels"][GROUP_LABEL], []).append(pod)
    return out


async def split(env: Stack, prefill: int, decode: int) -> bool:
    """Leaders at that split, every worker labelled as its leader, nothing mid-switch."""
    found = await groups(env)
    if len(found) != prefill + decode:
        return False
    roles = []
    for members in found.values():
        labels = {p["metadata"]["labels"][ROLE_LABEL] for p in members}
        intents = [p for p in members if SWITCH_ANNOTATION in p["metadata"].get("annotations", {})]
        if len(members) != 2 or len(labels) != 1 or intents:
            return False
        roles.append(labels.pop())
    return roles.count("prefill") == prefill and roles.count("decode") == decode


async def someone_draining(env: Stack) -> str | None:
    for pod in await env.pods():
        if leader(pod) and pod["metadata"]["labels"][ROLE_LABEL] == DRAINING:
            return str(pod["metadata"]["name"])
    return None


async def test_two_node_instances_come_up_and_follow_demand_both_ways() -> None:
    async with stack() as env:
        await env.create_cluster(two_node())
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="1P:3D of 4 groups")
        found = await groups(env)
        assert sorted(found) == [f"demo-engine-{i}" for i in range(4)]
        for name, (head, worker) in found.items():
            assert head["metadata"]["name"] == name
            assert worker["metadata"]["name"] == f"{name}-node-1"
            for rank, pod in enumerate((head, worker)):
                (container,) = pod["spec"]["containers"]
                env_vars = {e["name"]: e.get("value") for e in container["env"]}
                assert env_vars["PRORSA_NNODES"] == "2"
                assert env_vars["PRORSA_NODE_RANK"] == str(rank)
                assert env_vars["PRORSA_DIST_INIT_ADDR"] == f"{name}.demo-engines.rl.svc:5000"
                # Eq. 1's m = 8 GPUs per instance, spread over its two nodes.
                assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
            assert worker["spec"]["containers"][0]["command"] == ["prorsa-agent", "--worker"]
            assert "sglang.ai/bootstrap-port" not in worker["metadata"].get("annotations", {})

        # Only leaders run an agent; workers are the double's worker ranks.
        async def all_running() -> bool:
            return len(env.kubelet.pods) == 4 and len(env.kubelet.workers) == 4

        await env.wait_for(all_running, what="4 leaders and 4 worker ranks running")
        assert sorted(env.kubelet.pods) == sorted(found)
        assert sorted(env.kubelet.workers) == sorted(f"{n}-node-1" for n in found)

        phase_a = prefill_heavy(env)
        assert (await env.post(phase_a)).status_code == 200
        await env.wait_for(lambda: split(env, 2, 2), timeout=60, what="a flip to 2P:2D")
        history = env.label_history
        flipped = [n for n, h in history.items() if DRAINING in h and not n.endswith("node-1")]
        assert flipped, history
        for name in flipped:  # the worker hopped through draining with its leader
            assert history[f"{name}-node-1"] == history[name], history

        roles = {
            p["metadata"]["name"]: p["metadata"]["labels"][ROLE_LABEL] for p in await env.pods()
        }
        prefill_pod = next(n for n, r in roles.items() if r == "prefill" and n.count("-") == 2)
        gone = [env.event("trajectory_dropped", e["trajectory"]) for e in phase_a]
        assert (await env.post(gone)).status_code == 200
        assert (await env.post(decoding(env, prefill_pod))).status_code == 200
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="a flip back to 1P:3D")

        async def settled() -> dict | None:
            status = (await env.get_cluster()).get("status") or {}
            serving = status.get("instances", {})
            return status if serving.get("prefill", 0) + serving.get("decode", 0) == 4 else None

        status = await env.wait_for(settled, what="a status with all 4 instances serving")
        assert status["groups"]["nodesPerInstance"] == 2
        assert status["groups"]["pods"] == 8
        assert status["groups"]["managedBy"].startswith("Operator")
        # No group was restarted on the way: every switch went to a leader's agent.
        reasons = [e.get("reason") for e in await env.events()]
        assert "GroupRestarted" not in reasons and "SwitchSucceeded" in reasons


async def test_a_worker_killed_mid_switch_restarts_its_whole_group() -> None:
    slow = TimingModel(switch_seconds=3.0)
    async with stack(engine_config=lambda _n: EngineConfig(timing=slow)) as env:
        await env.create_cluster(two_node())
        name = await env.wait_for(lambda: someone_draining(env), timeout=60, what="a drain")
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await env.pods()}
        await env.kubelet.fail(f"{name}-node-1")  # the worker's node dies mid-switch

        async def recreated() -> bool:
            now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await env.pods()}
            return all(n in now and now[n] != before[n] for n in (name, f"{name}-node-1"))

        await env.wait_for(recreated, timeout=60, what="the whole group recreated")
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="1P:3D again")
        events = {
            (e.get("reason"), (e.get("message") or "").split(":")[0]) for e in await env.events()
        }
        # The rank-0 switch failed unsafe (the lost rank) or the reconcile saw the dead
        # worker first: either way the group went as a whole.
        assert {("GroupRestarted", name), ("SwitchReplaced", name)} & events, events
        # The other groups were left alone.
        now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await env.pods()}
        untouched = [n for n in before if not n.startswith(f"{name}-") and n != name]
        assert untouched and all(now[n] == before[n] for n in untouched)


async def test_a_dead_leader_takes_its_workers_and_the_group_is_recreated() -> None:
    async with stack() as env:
        await env.create_cluster(two_node())
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="1P:3D")
        worker = env.kubelet.workers["demo-engine-2-node-1"].rank
        uid = next(
            p["metadata"]["uid"]
            for p in await env.pods()
            if p["metadata"]["name"] == "demo-engine-2"
        )
        await env.kubelet.fail("demo-engine-2")
        await asyncio.wait_for(worker.exited.wait(), 10)  # the worker rank follows its leader

        async def recreated() -> bool:
            pods = {p["metadata"]["name"]: p for p in await env.pods()}
            head = pods.get("demo-engine-2")
            return head is not None and head["metadata"]["uid"] != uid

        await env.wait_for(recreated, timeout=60, what="the group recreated")
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="1P:3D again")


async def test_operator_restarted_mid_switch_converges_for_the_whole_group() -> None:
    slow = TimingModel(switch_seconds=3.0)
    async with stack(engine_config=lambda _n: EngineConfig(timing=slow)) as env:
        await env.create_cluster(two_node())
        name = await env.wait_for(lambda: someone_draining(env), timeout=60, what="a drain")
        pods = {p["metadata"]["name"]: p for p in await env.pods()}
        intent = json.loads(pods[name]["metadata"]["annotations"][SWITCH_ANNOTATION])
        assert intent["to"] == "prefill"
        # The intent lives on the leader alone; the worker shows the group's role.
        assert SWITCH_ANNOTATION not in pods[f"{name}-node-1"]["metadata"].get("annotations", {})
        await env.wait_for(
            lambda: _role(env, f"{name}-node-1", DRAINING), timeout=10, what="the worker draining"
        )
        await env.stop_operator()
        assert await _role(env, name, DRAINING)
        await env.start_operator()
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="convergence after restart")
        reasons = [e.get("reason") for e in await env.events()]
        assert "GroupRestarted" not in reasons


async def _role(env: Stack, name: str, role: str) -> bool:
    pod = await env.kube.get_pod(NAMESPACE, name)
    return pod is not None and pod["metadata"]["labels"].get(ROLE_LABEL) == role


async def test_gpu_budget_change_scales_whole_groups() -> None:
    async with stack() as env:
        await env.create_cluster(two_node())
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="4 groups at 1P:3D")
        await env.patch_cluster("demo", {"spec": {"gpuBudget": 48}})

        async def count(n: int) -> bool:
            found = await groups(env)
            return len(found) == n and all(len(m) == 2 for m in found.values())

        await env.wait_for(lambda: count(6), timeout=60, what="6 groups of 2 pods")
        await env.patch_cluster("demo", {"spec": {"gpuBudget": 24}})
        await env.wait_for(lambda: count(3), timeout=60, what="3 groups of 2 pods")
        assert len(await env.pods()) == 6
