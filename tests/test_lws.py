"""Multi-node instances as LeaderWorkerSets: the set the operator writes, how the operator
reads and keeps LWS groups, and the fake LWS controller the emulator runs (the operator end
to end with LWS installed is in tests/test_multinode_e2e.py)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
from typing import Any, cast

import pytest
from test_multinode import FakeKube, env_of, manifest, reconcile, running

from prorsa.core.spec import parse_cluster
from prorsa.k8s import groups, lws
from prorsa.k8s.kube import Kube
from prorsa_lab.doubles import lws_controller as fake
from prorsa_lab.doubles.kube_emulator import KubeEmulatorServer


def group_of(nodes: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Instance 3 of cluster "big": the pods the operator would create, and its set."""
    spec = parse_cluster(manifest(nodesPerInstance=nodes)).spec
    pods = groups.group_pods(cluster="big", namespace="rl", index=3, role="decode", spec=spec)
    body = lws.leader_worker_set(cluster="big", namespace="rl", index=3, pods=pods)
    return pods, body | {"metadata": body["metadata"] | {"uid": "set-uid"}}


def materialized(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The pods LWS makes of the set's one group (the fake controller's rendering)."""
    controller = fake.FakeLwsController(kube=cast(Kube, None), namespace="rl")
    head = controller.pod(body, 0, 0, None)
    head["metadata"]["uid"] = "leader-uid"
    size = body["spec"]["leaderWorkerTemplate"]["size"]
    return [head, *(controller.pod(body, 0, w, head) for w in range(1, size))]


def expanded(env: dict[str, str]) -> dict[str, str]:
    """The container's variables as the kubelet passes them ($(NAME) references expanded)."""
    return {
        k: re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), v)
        for k, v in env.items()
    }


def test_the_set_carries_the_groups_pods_and_lets_lws_place_them() -> None:
    pods, body = group_of(4)
    template = body["spec"]["leaderWorkerTemplate"]
    assert body["spec"]["replicas"] == 1 and template["size"] == 4
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert body["spec"]["startupPolicy"] == "LeaderCreated"
    assert body["metadata"]["name"] == "big-engine-3"
    assert body["metadata"]["labels"]["prorsa.io/index"] == "3"
    made = materialized(body)
    assert [p["metadata"]["name"] for p in made] == [
        "big-engine-3-0", "big-engine-3-0-1", "big-engine-3-0-2", "big-engine-3-0-3",
    ]  # fmt: skip
    for rank, (ours, theirs) in enumerate(zip(pods, made, strict=True)):
        mine, got = ours["metadata"], theirs["metadata"]
        # The operator's labels and annotations, the group named by its leader; the rank of
        # a worker is LWS's worker index (one template serves every worker).
        expected = mine["labels"] | {"prorsa.io/group": "big-engine-3-0"}
        if rank:
            expected.pop("prorsa.io/node-rank")
        assert got["labels"].items() >= expected.items()
        assert groups.node_rank(theirs) == rank
        assert got["annotations"].items() >= mine["annotations"].items()
        (c_ours,) = ours["spec"]["containers"]
        (c_theirs,) = theirs["spec"]["containers"]
        for key in ("command", "image", "ports", "resources", "volumeMounts", "startupProbe"):
            assert c_theirs.get(key) == c_ours.get(key), key
        env = expanded(env_of(theirs))
        assert env["PRORSA_NODE_RANK"] == str(rank)
        assert env["PRORSA_DIST_INIT_ADDR"] == "big-engine-3-0.big-engine-3.rl:5000"
        assert env["PRORSA_INSTANCE"] == "big-engine-3-0"  # the leader, as the agent reports
        changed = {"PRORSA_NODE_RANK", "PRORSA_DIST_INIT_ADDR", "PRORSA_INSTANCE"}
        lws_vars = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}
        assert {k: v for k, v in env.items() if k not in changed | lws_vars} == {
            k: v for k, v in env_of(ours).items() if k not in changed
        }
        # LWS's StatefulSets name the host and put it under the set's headless Service.
        assert theirs["spec"]["hostname"] == got["name"]
        assert theirs["spec"]["subdomain"] == "big-engine-3"
        assert c_theirs["env"][0]["name"] == "LWS_LEADER_ADDRESS"


def test_a_worker_of_a_set_runs_the_leaders_flags_with_its_rank() -> None:
    from prorsa_agent.agent_cli import configure, worker_argv

    *_, last = materialized(group_of(4)[1])
    parser = argparse.ArgumentParser()
    configure(parser)
    env = expanded(env_of(last)) | {"PRORSA_AGENT_TOKEN_FILE": "/dev/null"}
    env.pop("PRORSA_ENGINE_API_KEY_FILE")
    args = parser.parse_args(["--token-file", "/dev/null", "--instance", "x"])
    flags = dict(itertools.pairwise(worker_argv(args, env)))
    assert flags["--nnodes"] == "4" and flags["--node-rank"] == "3"
    assert flags["--dist-init-addr"] == "big-engine-3-0.big-engine-3.rl:5000"


@pytest.mark.parametrize("case", ["worker failed", "worker missing", "leader missing"])
async def test_a_broken_lws_group_is_held_for_lws_to_recreate(case: str) -> None:
    head, worker = (running(p) for p in materialized(group_of(2)[1]))
    pods = {
        "worker failed": [head, running(worker, "Failed")],
        "worker missing": [head],  # also while LWS is still creating the group
        "leader missing": [worker],
    }[case]
    kube = FakeKube()
    view, events = await reconcile(pods, kube)
    # Unavailable (no switch planned for it, nothing created in its place), left to LWS.
    assert view.leaders == [] and view.hold == {3}
    assert kube.deleted == [] and events == []
    whole, _ = await reconcile([head, worker], kube)
    assert [p["metadata"]["name"] for p in whole.leaders] == ["big-engine-3-0"]


class SetsKube:
    def __init__(self, sets: list[dict[str, Any]]) -> None:
        self.sets, self.deleted = sets, []

    async def list_leader_worker_sets(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.sets

    async def delete_leader_worker_set(self, namespace: str, name: str) -> None:
        self.deleted.append(name)


def a_set(index: int, size: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"big-engine-{index}", "labels": {"prorsa.io/index": str(index)}},
        "spec": {"leaderWorkerTemplate": {"size": size}},
    }


async def test_sets_of_removed_or_resized_instances_go_unless_switching() -> None:
    events: list[str] = []

    async def post(kind: str, reason: str, message: str) -> None:
        events.append(reason)

    kube = SetsKube([a_set(0, 2), a_set(1, 4), a_set(2, 2), a_set(3, 2)])
    kept = await lws.reconcile_sets(
        kube=kube, namespace="rl", cluster="big", selector="", instances=3, nodes=2,
        busy={"big-engine-2-0"}, post_event=post,
    )  # fmt: skip
    assert kept == {0, 2}
    assert kube.deleted == ["big-engine-1", "big-engine-3"]
    assert events == ["GroupRestarted", "ScaledDown"]
    # One node per instance: plain pods again, every set goes (once no switch holds it).
    kube = SetsKube([a_set(0, 2), a_set(1, 2)])
    kept = await lws.reconcile_sets(
        kube=kube, namespace="rl", cluster="big", selector="", instances=2, nodes=1,
        busy={"big-engine-1-0"}, post_event=post,
    )  # fmt: skip
    assert kept == {1} and kube.deleted == ["big-engine-0"]


# -- the fake controller on the emulator ------------------------------------------------------


def simple_set(name: str, *, size: int, replicas: int, **spec: Any) -> dict[str, Any]:
    template = {
        "metadata": {"labels": {"app": name}},
        "spec": {
            "containers": [{"name": "c", "image": "x", "env": [{"name": "MINE", "value": "1"}]}]
        },
    }
    return {
        "apiVersion": f"{fake.GROUP}/{fake.VERSION}",
        "kind": fake.KIND,
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "leaderWorkerTemplate": {
            "size": size, "workerTemplate": template}, **spec},
    }  # fmt: skip


async def wait_for(check: Any, what: str, timeout: float = 20.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        found = await check()
        if found:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_the_fake_controller_names_labels_and_recreates_groups_like_lws() -> None:
    server = KubeEmulatorServer()
    server.emulator.add_crd(fake.leader_worker_set_crd())
    with server:
        kube = Kube(server.api_client())
        assert await groups.discover_manager(kube) == groups.LWS_MANAGED
        api = kube.custom
        args = (fake.GROUP, fake.VERSION, "default", fake.PLURAL)
        created = await kube.call(
            api.create_namespaced_custom_object, *args, simple_set("s", size=3, replicas=2)
        )
        # The CRD's defaults are the real one's.
        assert created["spec"]["startupPolicy"] == "LeaderCreated"
        assert created["spec"]["leaderWorkerTemplate"]["restartPolicy"] == (
            "RecreateGroupOnPodRestart"
        )

        async def pods() -> dict[str, dict[str, Any]]:
            found = await kube.list_pods("default", fake.NAME_LABEL)
            return {p["metadata"]["name"]: p for p in found}

        names = ["s-0", "s-0-1", "s-0-2", "s-1", "s-1-1", "s-1-2"]
        async with fake.FakeLwsController(kube=kube, namespace="default", poll_interval=0.05):
            first = await wait_for(lambda: _all(pods, names), "two groups of three")
            for name, pod in first.items():
                group, _, worker = name.removeprefix("s-").partition("-")
                labels = pod["metadata"]["labels"]
                assert labels["app"] == "s" and labels[fake.NAME_LABEL] == "s"
                assert labels[fake.GROUP_INDEX_LABEL] == group
                assert labels[fake.WORKER_INDEX_LABEL] == (worker or "0")
                assert labels[fake.GROUP_KEY_LABEL] == fake.group_key("default", f"s-{group}")
                assert pod["metadata"]["annotations"][fake.SIZE_ANNOTATION] == "3"
                env = [(e["name"], e["value"]) for e in pod["spec"]["containers"][0]["env"]]
                assert env == [
                    ("LWS_LEADER_ADDRESS", f"s-{group}.s.default"), ("LWS_GROUP_SIZE", "3"),
                    ("LWS_WORKER_INDEX", worker or "0"), ("MINE", "1"),
                ]  # fmt: skip
                (owner,) = pod["metadata"]["ownerReferences"]
                assert owner["kind"] == ("Pod" if worker else fake.KIND)

            # A worker deleted: its whole group comes back, the other group is left alone.
            await kube.delete_pod("default", "s-1-2")
            uids = {n: p["metadata"]["uid"] for n, p in first.items()}

            async def group_1_recreated() -> dict[str, Any] | None:
                now = await _all(pods, names)
                fresh = now and all(
                    now[n]["metadata"]["uid"] != uids[n] for n in ("s-1", "s-1-1", "s-1-2")
                )
                return now if fresh else None

            now = await wait_for(group_1_recreated, "group 1 recreated")
            assert all(now[n]["metadata"]["uid"] == uids[n] for n in ("s-0", "s-0-1", "s-0-2"))
            events = await kube.call(kube.core.list_namespaced_event, "default")
            assert [e["reason"] for e in events["items"]] == ["RecreateGroup"]

            # Scaled to one group; then a new template is rolled out to the group left.
            await kube.call(
                api.patch_namespaced_custom_object, *args, "s", {"spec": {"replicas": 1}}
            )
            await wait_for(lambda: _exactly(pods, names[:3]), "one group left")
            before = (await pods())["s-0"]["metadata"]["uid"]
            patch = {"spec": {"leaderWorkerTemplate": {"workerTemplate": {
                "metadata": {"labels": {"app": "s", "new": "yes"}}}}}}  # fmt: skip
            await kube.call(api.patch_namespaced_custom_object, *args, "s", patch)

            async def rolled() -> bool:
                now = await _exactly(pods, names[:3])
                return (
                    bool(now)
                    and now["s-0"]["metadata"]["uid"] != before
                    and all(p["metadata"]["labels"].get("new") == "yes" for p in now.values())
                )

            await wait_for(rolled, "the new revision rolled out")
        kube.api.close()


async def _all(pods: Any, names: list[str]) -> dict[str, Any] | None:
    found = await pods()
    return found if set(names) <= set(found) else None


async def _exactly(pods: Any, names: list[str]) -> dict[str, Any] | None:
    found = await pods()
    return found if set(found) == set(names) else None


async def test_without_the_api_the_operator_keeps_the_groups() -> None:
    with KubeEmulatorServer() as server:
        kube = Kube(server.api_client())
        assert await groups.discover_manager(kube) == groups.OPERATOR_MANAGED
        kube.api.close()
