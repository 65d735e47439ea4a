"""Multi-node engine instances: the spec, the group's pods and the engine double's worker
ranks (the operator end to end is in tests/test_multinode_e2e.py)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from prorsa.core.spec import SpecError, parse_cluster


def manifest(**engine: Any) -> dict[str, Any]:
    return {
        "apiVersion": "prorsa.io/v1alpha1",
        "kind": "RolloutCluster",
        "metadata": {"name": "big", "namespace": "rl"},
        "spec": {
            "model": {"path": "/models/kimi"},
            "engine": {"gpusPerInstance": 16, "tensorParallelSize": 16, **engine},
            "gpuBudget": 64,
        },
    }


def test_one_node_per_instance_unless_asked() -> None:
    spec = parse_cluster(manifest()).spec
    assert spec.engine.nodes_per_instance == 1
    assert spec.engine.gpus_per_node("decode") == 16


def test_the_budget_stays_per_instance_across_nodes() -> None:
    spec = parse_cluster(manifest(nodesPerInstance=2)).spec
    # Eq. 1 counts instances of m GPUs, whatever number of nodes each spans.
    assert spec.instances == 4
    assert spec.engine.m_decode == 16 and spec.engine.m_prefill == 16
    assert spec.engine.gpus_per_node("decode") == 8
    assert spec.engine.gpus_per_node("prefill") == 8


@pytest.mark.parametrize(
    ("engine", "field"),
    [
        ({"nodesPerInstance": 3}, "engine.gpusPerInstance"),
        ({"nodesPerInstance": 2, "prefillGpusPerInstance": 9}, "engine.prefillGpusPerInstance"),
        ({"nodesPerInstance": 0}, "engine.nodesPerInstance"),
    ],
)
def test_inconsistent_nodes_are_refused_naming_the_field(
    engine: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as info:
        parse_cluster(manifest(**engine))
    assert "nodesPerInstance" in str(info.value)
    assert field in str(info.value)


# -- the group's pods -----------------------------------------------------------------------


def two_node_pods(role: str = "decode") -> list[dict[str, Any]]:
    from prorsa.k8s.groups import group_pods

    spec = parse_cluster(manifest(nodesPerInstance=2)).spec
    return group_pods(cluster="big", namespace="rl", index=3, role=role, spec=spec)


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_a_two_node_instance_is_a_leader_and_a_worker_rank() -> None:
    head, worker = two_node_pods()
    assert head["metadata"]["name"] == "big-engine-3"
    assert worker["metadata"]["name"] == "big-engine-3-node-1"
    for rank, pod in enumerate((head, worker)):
        labels = pod["metadata"]["labels"]
        assert labels["prorsa.io/group"] == "big-engine-3"
        assert labels["prorsa.io/node-rank"] == str(rank)
        assert labels["prorsa.io/role"] == "decode" and labels["prorsa.io/index"] == "3"
        env = env_of(pod)
        assert env["PRORSA_NNODES"] == "2" and env["PRORSA_NODE_RANK"] == str(rank)
        assert env["PRORSA_DIST_INIT_ADDR"] == "big-engine-3.big-engines.rl.svc:5000"
        assert pod["spec"]["subdomain"] == "big-engines"
        assert pod["spec"]["hostname"] == pod["metadata"]["name"]
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"  # 16 over 2 nodes
    (worker_container,) = worker["spec"]["containers"]
    assert worker_container["command"] == ["prorsa-agent", "--worker"]
    # The worker's SGLang answers only /health on the engine port: no agent probes there.
    assert worker_container["livenessProbe"]["httpGet"] == {"path": "/health", "port": 30000}
    assert "readinessProbe" not in worker_container
    assert "sglang.ai/bootstrap-port" not in worker["metadata"]["annotations"]
    assert head["metadata"]["annotations"]["sglang.ai/bootstrap-port"] == "8998"


def test_one_node_instances_keep_the_plain_engine_pod() -> None:
    from prorsa.k8s.groups import group_pods
    from prorsa.k8s.objects import engine_pod

    spec = parse_cluster(manifest()).spec
    pods = group_pods(cluster="big", namespace="rl", index=0, role="decode", spec=spec)
    assert pods == [engine_pod(cluster="big", namespace="rl", index=0, role="decode", spec=spec)]


def test_only_leaders_are_router_workers() -> None:
    from prorsa.k8s.objects import router_args

    def selectors(args: list[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        flag = ""
        for arg in args:
            if arg.startswith("--"):
                flag = arg
            elif flag.endswith("-selector"):
                out.setdefault(flag, []).append(arg)
        return out

    two = parse_cluster(manifest(nodesPerInstance=2)).spec
    for terms in selectors(router_args(cluster="big", namespace="rl", spec=two)).values():
        assert "prorsa.io/node-rank=0" in terms
    one = parse_cluster(manifest()).spec
    for terms in selectors(router_args(cluster="big", namespace="rl", spec=one)).values():
        assert not any(t.startswith("prorsa.io/node-rank") for t in terms)


def test_a_worker_rank_runs_the_leaders_flags_with_its_rank() -> None:
    import argparse

    from prorsa_agent.agent_cli import configure, worker_argv
    from prorsa_agent.config import ConfigError

    head, worker = two_node_pods()
    parser = argparse.ArgumentParser()
    configure(parser)
    for pod in (head, worker):
        env = env_of(pod) | {"PRORSA_AGENT_TOKEN_FILE": "/dev/null"}
        env.pop("PRORSA_ENGINE_API_KEY_FILE")
        args = parser.parse_args(["--token-file", "/dev/null", "--instance", "x"])
        if pod is head:
            with pytest.raises(ConfigError, match="PRORSA_NODE_RANK >= 1"):
                worker_argv(args, env)
            continue
        argv = worker_argv(args, env)
        flags = dict(itertools.pairwise(argv))
        assert flags["--nnodes"] == "2" and flags["--node-rank"] == "1"
        assert flags["--dist-init-addr"] == "big-engine-3.big-engines.rl.svc:5000"
        assert flags["--tp-size"] == "16" and flags["--host"] == "0.0.0.0"
        # The same disaggregation flags as rank 0: every rank must agree on them.
        assert "--enable-pd-role-switch" in argv and flags["--disaggregation-mode"] == "decode"


# -- keeping groups whole -------------------------------------------------------------------


class FakeKube:
    def __init__(self) -> None:
        self.deleted: list[str] = []
        self.patched: dict[str, dict[str, Any]] = {}

    async def delete_pod(self, namespace: str, name: str) -> None:
        self.deleted.append(name)

    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.patched[name] = patch


def running(pod: dict[str, Any], phase: str = "Running") -> dict[str, Any]:
    return pod | {"status": {"phase": phase, "podIP": "10.0.0.1"}}


async def reconcile(
    pods: list[dict[str, Any]], kube: FakeKube, busy: frozenset[str] = frozenset()
) -> Any:
    from prorsa.k8s.groups import reconcile_groups

    events: list[tuple[str, str, str]] = []

    async def post(kind: str, reason: str, message: str) -> None:
        events.append((kind, reason, message))

    view = await reconcile_groups(
        kube=kube, namespace="rl", pods=pods, nodes=2, instances=4, busy=set(busy), post_event=post
    )
    return view, events


async def test_a_whole_group_is_one_instance() -> None:
    head, worker = (running(p) for p in two_node_pods())
    kube = FakeKube()
    view, events = await reconcile([head, worker], kube)
    assert [p["metadata"]["name"] for p in view.leaders] == ["big-engine-3"]
    assert view.pods == 2 and not view.hold and not kube.deleted and not events


@pytest.mark.parametrize("case", ["worker failed", "worker missing", "leader missing"])
async def test_a_broken_group_is_torn_down_whole(case: str) -> None:
    head, worker = (running(p) for p in two_node_pods())
    pods = {
        "worker failed": [head, running(worker, "Failed")],
        "worker missing": [head],
        "leader missing": [worker],
    }[case]
    kube = FakeKube()
    view, events = await reconcile(pods, kube)
    assert view.leaders == [] and view.hold == {3}  # not recreated until every pod is gone
    assert sorted(kube.deleted) == sorted(p["metadata"]["name"] for p in pods)
    assert events[0][1] == "GroupRestarted" and events[0][2].startswith("big-engine-3:")


async def test_a_group_the_executor_is_replacing_is_not_restarted_between_its_deletions() -> None:
    # The executor deletes a failed switch's leader, then its workers; an API with no grace
    # period shows a tick in between the worker alone. That is one replacement, not a
    # GroupRestarted on top of the SwitchReplaced.
    _, worker = (running(p) for p in two_node_pods())
    kube = FakeKube()
    view, events = await reconcile([worker], kube, busy=frozenset({"big-engine-3"}))
    assert view.leaders == [] and view.hold == {3}  # nor recreated while a pod is left
    assert not kube.deleted and not events


async def test_a_worker_lagging_its_leaders_role_is_brought_in_line() -> None:
    head, worker = (running(p) for p in two_node_pods())
    head["metadata"]["labels"]["prorsa.io/role"] = "prefill"
    kube = FakeKube()
    await reconcile([head, worker], kube)
    assert kube.patched == {
        "big-engine-3-node-1": {"metadata": {"labels": {"prorsa.io/role": "prefill"}}}
    }
    # Not while a switch runs: the executor labels the group itself.
    kube = FakeKube()
    await reconcile([head, worker], kube, busy=frozenset({"big-engine-3"}))
    assert kube.patched == {}


# -- the engine double's worker mode ---------------------------------------------------------


async def test_worker_ranks_follow_their_leader() -> None:
    import asyncio

    from prorsa_lab.doubles.sglang_double import EngineDouble, NodeGroup, WorkerRank

    async with EngineDouble() as leader:
        group = NodeGroup(name="g", nnodes=2)
        group.join_leader(leader)
        assert leader.core is not None and leader.core.starting  # waiting for rank 1
        worker = await WorkerRank(instance="g-node-1", rank=1, group=group).start()
        assert not leader.core.starting and not leader.unhealthy  # the world formed
        await worker.stop()  # rank 1 lost: rank 0 needs a restart
        assert leader.unhealthy and leader.core.starting

        group = NodeGroup(name="g2", nnodes=2)
        exits: list[str] = []

        async def exited(w: WorkerRank) -> None:
            exits.append(w.instance)

        worker = await WorkerRank(instance="g2-node-1", rank=1, group=group, on_exit=exited).start()
        group.join_leader(leader)
        await asyncio.sleep(0.1)
        assert not worker.exited.is_set()
        group.leave_leader()  # the leader's pod is gone: the worker's collectives fail
        await asyncio.wait_for(worker.exited.wait(), 2)
        assert exits == ["g2-node-1"]
