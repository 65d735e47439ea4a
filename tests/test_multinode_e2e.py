"""Two-pod engine instances end to end: the operator (kopf) against the API emulator, each
instance a leader (engine double + real agent) and a worker rank (the double's worker
mode) run by the fake kubelet. Every test runs twice: with groups the operator manages
itself, and with the LeaderWorkerSet API installed (a fake LWS controller creating the
pods of the sets the operator creates)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from test_operator_e2e import prefill_heavy

from prorsa_contract.labels import (
    DRAINING,
    GROUP_LABEL,
    NODE_RANK_LABEL,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
)
from prorsa_lab.doubles.kube import lws_controller as fake_lws
from prorsa_lab.doubles.sglang_double import EngineConfig, TimingModel
from prorsa_lab.doubles.stack import NAMESPACE, OPERATOR_USER, Stack, cluster_manifest, stack

# Two-pod instances end to end, with and without LeaderWorkerSet: left out by `make test-fast`.
pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Layout:
    """How a two-pod instance is laid out, by who keeps its group."""

    lws: bool

    def leader(self, index: int) -> str:
        return f"demo-engine-{index}-0" if self.lws else f"demo-engine-{index}"

    def worker(self, leader: str) -> str:
        return f"{leader}-1" if self.lws else f"{leader}-node-1"

    def rendezvous(self, index: int) -> str:
        """SGLang's --dist-init-addr: the leader's name under the group's headless Service."""
        if self.lws:
            return f"{self.leader(index)}.demo-engine-{index}.{NAMESPACE}:5000"
        return f"{self.leader(index)}.demo-engines.{NAMESPACE}.svc:5000"

    @property
    def managed_by(self) -> str:
        return "LeaderWorkerSet" if self.lws else "Operator"

    @property
    def group_restart(self) -> str:
        """The event that says a group was recreated whole (by LWS, or by the operator)."""
        return "RecreateGroup" if self.lws else "GroupRestarted"

    @asynccontextmanager
    async def stack(self, **kwargs: Any) -> AsyncIterator[Stack]:
        async with stack(leader_worker_set=self.lws, **kwargs) as env:
            yield env


@pytest.fixture(params=[False, True], ids=["operator", "leaderworkerset"])
def layout(request: pytest.FixtureRequest) -> Layout:
    return Layout(lws=request.param)


async def leader_worker_sets(env: Stack) -> dict[str, dict[str, Any]]:
    listed = await env.kube.call(
        env.kube.custom.list_namespaced_custom_object,
        fake_lws.GROUP, fake_lws.VERSION, env.namespace, fake_lws.PLURAL,
    )  # fmt: skip
    return {s["metadata"]["name"]: s for s in listed["items"]}


def operator_writes(env: Stack, resource: str) -> set[str]:
    """The write verbs the operator used on ``resource`` (the emulator's audit log)."""
    calls = env.server.emulator.api_calls(OPERATOR_USER)
    return {c.verb for c in calls if c.resource == resource} & {"create", "patch", "delete"}


def expanded(value: str, env_vars: dict[str, str]) -> str:
    """A container variable as the kubelet passes it: $(NAME) replaced by NAME's value."""
    return re.sub(r"\$\((\w+)\)", lambda m: env_vars.get(m.group(1), m.group(0)), value)


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


def in_step(leader: list[str], worker: list[str]) -> bool:
    """The two pods' role labels went through the same values in the same order. A group's
    pods are relabelled by one API call each, so a snapshot may catch the next change on one
    pod before the other: one history may run one label ahead of the other."""
    short, long = sorted((leader, worker), key=len)
    return long[: len(short)] == short and len(long) - len(short) <= 1


async def test_two_node_instances_come_up_and_follow_demand_both_ways(layout: Layout) -> None:
    async with layout.stack() as env:
        await env.create_cluster(two_node())
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="1P:3D of 4 groups")
        found = await groups(env)
        assert sorted(found) == [layout.leader(i) for i in range(4)]
        for index, (name, (head, worker)) in enumerate(sorted(found.items())):
            assert head["metadata"]["name"] == name
            assert worker["metadata"]["name"] == layout.worker(name)
            for rank, pod in enumerate((head, worker)):
                (container,) = pod["spec"]["containers"]
                env_vars = {e["name"]: e.get("value") or "" for e in container["env"]}
                assert env_vars["PRORSA_NNODES"] == "2"
                assert expanded(env_vars["PRORSA_NODE_RANK"], env_vars) == str(rank)
                assert expanded(env_vars["PRORSA_DIST_INIT_ADDR"], env_vars) == (
                    layout.rendezvous(index)
                )
                # The agent reports the instance by the leader's pod name.
                assert env_vars["PRORSA_INSTANCE"] == name
                # Eq. 1's m = 8 GPUs per instance, spread over its two nodes.
                assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
            assert worker["spec"]["containers"][0]["command"] == ["prorsa-agent", "--worker"]
            assert "sglang.ai/bootstrap-port" not in worker["metadata"].get("annotations", {})
            # Only leaders match the router's selectors (prorsa.io/node-rank=0).
            assert head["metadata"]["labels"][NODE_RANK_LABEL] == "0"
            assert worker["metadata"]["labels"].get(NODE_RANK_LABEL) != "0"
        if layout.lws:
            sets = await leader_worker_sets(env)
            assert sorted(sets) == [f"demo-engine-{i}" for i in range(4)]
            for set_name, lws in sets.items():
                assert lws["spec"]["replicas"] == 1
                template = lws["spec"]["leaderWorkerTemplate"]
                assert template["size"] == 2
                assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
                assert lws["metadata"]["ownerReferences"][0]["kind"] == "RolloutCluster"
                head, worker = found[f"{set_name}-0"]
                for rank, pod in enumerate((head, worker)):
                    labels = pod["metadata"]["labels"]
                    assert labels[fake_lws.NAME_LABEL] == set_name
                    assert labels[fake_lws.WORKER_INDEX_LABEL] == str(rank)
                    assert labels[fake_lws.GROUP_INDEX_LABEL] == "0"
                    key = fake_lws.group_key(NAMESPACE, head["metadata"]["name"])
                    assert labels[fake_lws.GROUP_KEY_LABEL] == key

        # Only leaders run an agent; workers are the double's worker ranks.
        async def all_running() -> bool:
            return len(env.kubelet.pods) == 4 and len(env.kubelet.workers) == 4

        await env.wait_for(all_running, what="4 leaders and 4 worker ranks running")
        assert sorted(env.kubelet.pods) == sorted(found)
        assert sorted(env.kubelet.workers) == sorted(layout.worker(n) for n in found)
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await env.pods()}

        phase_a = prefill_heavy(env)
        assert (await env.post(phase_a)).status_code == 200
        await env.wait_for(lambda: split(env, 2, 2), timeout=60, what="a flip to 2P:2D")
        history = env.label_history
        flipped = [n for n, h in history.items() if DRAINING in h and n in found]
        assert flipped, history
        for name in flipped:  # the worker hopped through draining with its leader
            assert in_step(history[name], history[layout.worker(name)]), history

        roles = {
            p["metadata"]["name"]: p["metadata"]["labels"][ROLE_LABEL] for p in await env.pods()
        }
        prefill_pod = next(n for n, r in roles.items() if r == "prefill" and n in found)
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
        assert status["groups"]["managedBy"] == layout.managed_by
        # No group was restarted on the way: every switch went to a leader's agent, and the
        # relabelled pods are the ones first created (LWS did not roll anything out).
        reasons = await env.wait_for_event("SwitchSucceeded")
        assert not {"GroupRestarted", "RecreateGroup"} & set(reasons)
        assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in await env.pods()} == uids
        if layout.lws:  # the operator created sets, and only relabelled the pods LWS made
            assert operator_writes(env, "pods") == {"patch"}
            assert operator_writes(env, "leaderworkersets") == {"create"}


async def test_a_worker_killed_mid_switch_restarts_its_whole_group(layout: Layout) -> None:
    slow = TimingModel(switch_seconds=3.0)
    async with layout.stack(engine_config=lambda _n: EngineConfig(timing=slow)) as env:
        await env.create_cluster(two_node())
        name = await env.wait_for(lambda: someone_draining(env), timeout=60, what="a drain")
        worker = layout.worker(name)
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await env.pods()}
        await env.kubelet.fail(worker)  # the worker's node dies mid-switch

        async def recreated() -> bool:
            now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await env.pods()}
            return all(n in now and now[n] != before[n] for n in (name, worker))

        await env.wait_for(recreated, timeout=60, what="the whole group recreated")
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="1P:3D again")
        events = {(e.get("reason"), e.get("message") or "") for e in await env.events()}
        # The rank-0 switch failed unsafe (the lost rank) and the leader was replaced, or
        # the group's keeper (the operator's reconcile, or LWS) saw the dead worker first:
        # either way the group went as a whole.
        restarts = {
            reason
            for reason, message in events
            if (reason == "SwitchReplaced" and message.startswith(f"{name}:"))
            or (reason == layout.group_restart and name in message)
        }
        assert restarts, events
        # Nothing is left draining or mid-switch (split() checks every label and intent),
        # and the other groups were left alone.
        now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await env.pods()}
        untouched = [n for n in before if not n.startswith(f"{name}-") and n != name]
        assert untouched and all(now[n] == before[n] for n in untouched)


async def test_a_dead_leader_takes_its_workers_and_the_group_is_recreated(layout: Layout) -> None:
    async with layout.stack() as env:
        await env.create_cluster(two_node())
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="1P:3D")
        head = layout.leader(2)

        # The leaders' labels can settle before the kubelet has started every worker rank.
        async def worker_running() -> bool:
            return layout.worker(head) in env.kubelet.workers

        await env.wait_for(worker_running, what=f"the worker rank of {head} running")
        worker = env.kubelet.workers[layout.worker(head)].rank
        uid = next(p["metadata"]["uid"] for p in await env.pods() if p["metadata"]["name"] == head)
        await env.kubelet.fail(head)
        await asyncio.wait_for(worker.exited.wait(), 10)  # the worker rank follows its leader

        async def recreated() -> bool:
            pods = {p["metadata"]["name"]: p for p in await env.pods()}
            found = pods.get(head)
            return found is not None and found["metadata"]["uid"] != uid

        await env.wait_for(recreated, timeout=60, what="the group recreated")
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="1P:3D again")


async def test_operator_restarted_mid_switch_converges_for_the_whole_group(
    layout: Layout,
) -> None:
    slow = TimingModel(switch_seconds=3.0)
    async with layout.stack(engine_config=lambda _n: EngineConfig(timing=slow)) as env:
        await env.create_cluster(two_node())
        name = await env.wait_for(lambda: someone_draining(env), timeout=60, what="a drain")
        worker = layout.worker(name)
        pods = {p["metadata"]["name"]: p for p in await env.pods()}
        intent = json.loads(pods[name]["metadata"]["annotations"][SWITCH_ANNOTATION])
        assert intent["to"] == "prefill"
        # The intent lives on the leader alone; the worker shows the group's role.
        assert SWITCH_ANNOTATION not in pods[worker]["metadata"].get("annotations", {})
        await env.wait_for(
            lambda: _role(env, worker, DRAINING), timeout=10, what="the worker draining"
        )
        await env.stop_operator()
        assert await _role(env, name, DRAINING)
        await env.start_operator()
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="convergence after restart")
        # The new process finished the switch in place: no group was replaced (a switch that
        # failed unsafely) or restarted. The events' messages say why, should one have been.
        events = [(e.get("reason"), e.get("message")) for e in await env.events()]
        restarts = {"GroupRestarted", "RecreateGroup", "SwitchReplaced"}
        assert not [e for e in events if e[0] in restarts], sorted(map(str, events))

        # The engines serve on across the restart: the next switch, of a group that came up
        # under the first process, flips and verifies in place too.
        async def served() -> bool:
            reply = await env.post(prefill_heavy(env))
            return reply.status_code == 200  # 401/404 until the new webhook has the cluster

        await env.wait_for(served, what="the trainer's events on the new webhook")
        await env.wait_for(lambda: split(env, 2, 2), timeout=60, what="a flip after the restart")
        events = [(e.get("reason"), e.get("message")) for e in await env.events()]
        assert not [e for e in events if e[0] in restarts], sorted(map(str, events))


async def _role(env: Stack, name: str, role: str) -> bool:
    pod = await env.kube.get_pod(NAMESPACE, name)
    return pod is not None and pod["metadata"]["labels"].get(ROLE_LABEL) == role


async def test_gpu_budget_change_scales_whole_groups(layout: Layout) -> None:
    async with layout.stack() as env:
        await env.create_cluster(two_node())
        await env.wait_for(lambda: split(env, 1, 3), timeout=60, what="4 groups at 1P:3D")
        await env.patch_cluster("demo", {"spec": {"gpuBudget": 48}})

        async def count(n: int) -> bool:
            found = await groups(env)
            whole = len(found) == n and all(len(m) == 2 for m in found.values())
            # With LWS the operator adds and removes sets, never pods.
            return whole and (not layout.lws or len(await leader_worker_sets(env)) == n)

        await env.wait_for(lambda: count(6), timeout=60, what="6 groups of 2 pods")
        await env.patch_cluster("demo", {"spec": {"gpuBudget": 24}})
        await env.wait_for(lambda: count(3), timeout=60, what="3 groups of 2 pods")
        assert sorted(await groups(env)) == [layout.leader(i) for i in range(3)]
        assert len(await env.pods()) == 6
        if layout.lws:
            assert operator_writes(env, "leaderworkersets") == {"create", "delete"}
            assert "create" not in operator_writes(env, "pods")
