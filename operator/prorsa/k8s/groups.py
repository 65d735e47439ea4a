"""Multi-node engine instances: one instance as a group of pods, kept whole.

An instance of ``engine.nodesPerInstance`` n > 1 nodes is n pods: the leader (node rank 0,
the group's one pod the Controller, the executor and the router see) runs SGLang's HTTP
server and the agent; each worker runs one more rank of the same SGLang server, started
with ``--nnodes``, ``--node-rank`` and ``--dist-init-addr`` pointing at the leader's stable
name under a headless Service. SGLang's rank 0 broadcasts every control request (the role
switch included) to all ranks, so the operator talks to the leader alone.

A group is all-or-nothing: torch.distributed cannot replace one rank of a live server, so
a pod that fails or disappears takes its whole group down, and all of it is recreated.
Who does that is decided once, at start-up (:func:`discover_manager`): a cluster that
serves the LeaderWorkerSet API gets one LeaderWorkerSet per instance (:mod:`prorsa.k8s.lws`),
whose controller recreates the group; otherwise the operator creates and replaces the pods
itself. Either way the operator reads the pods the same way, keeps a broken group away from
the Controller, and switches a group by relabelling its live pods.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prorsa.core.spec import RolloutClusterSpec
from prorsa.k8s import lws
from prorsa.k8s.objects import engine_pod
from prorsa_contract.labels import (
    AGENT_COMMAND,
    BOOTSTRAP_ANNOTATION,
    DIST_INIT_PORT,
    ENGINE_PORT,
    GROUP_LABEL,
    INDEX_LABEL,
    NODE_RANK_LABEL,
    NODES_LABEL,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
    RoleLabel,
    engine_name,
    worker_name,
)

log = logging.getLogger("prorsa.groups")

# Who keeps multi-node groups whole (status.groups.managedBy).
OPERATOR_MANAGED = "Operator"
LWS_MANAGED = "LeaderWorkerSet"
EventPoster = Callable[[str, str, str], Awaitable[None]]


def engines_service_name(cluster: str) -> str:
    return f"{cluster}-engines"


def dist_init_addr(*, cluster: str, namespace: str, index: int) -> str:
    """The leader's rendezvous address: its stable DNS name under the headless Service."""
    host = f"{engine_name(cluster, index)}.{engines_service_name(cluster)}.{namespace}.svc"
    return f"{host}:{DIST_INIT_PORT}"


def group_pods(
    *, cluster: str, namespace: str, index: int, role: str, spec: RolloutClusterSpec
) -> list[dict[str, Any]]:
    """Every pod of instance ``index``: the leader first, then workers by node rank.

    One node per instance gives the plain engine pod, unchanged.
    """
    leader = engine_pod(cluster=cluster, namespace=namespace, index=index, role=role, spec=spec)
    nodes = spec.engine.nodes_per_instance
    if nodes == 1:
        return [leader]
    gpus = str(spec.engine.gpus_per_node(role))
    name = engine_name(cluster, index)
    multi = [
        {"name": "PRORSA_NNODES", "value": str(nodes)},
        {"name": "PRORSA_DIST_INIT_ADDR", "value": dist_init_addr(
            cluster=cluster, namespace=namespace, index=index
        )},
    ]  # fmt: skip
    pods = []
    for rank in range(nodes):
        pod = json.loads(json.dumps(leader))
        meta, pod_spec = pod["metadata"], pod["spec"]
        (container,) = pod_spec["containers"]
        meta["labels"] |= {GROUP_LABEL: name, NODE_RANK_LABEL: str(rank), NODES_LABEL: str(nodes)}
        for kind in ("limits", "requests"):
            if spec.engine.gpu_resource_name in container["resources"].get(kind, {}):
                container["resources"][kind][spec.engine.gpu_resource_name] = gpus
        container["env"] = [*multi, {"name": "PRORSA_NODE_RANK", "value": str(rank)}] + [
            e for e in container["env"] if e["name"] != "PRORSA_NODE_RANK"
        ]
        # <pod>.<cluster>-engines.<ns>.svc resolves to the pod (publishNotReadyAddresses).
        pod_spec["subdomain"] = engines_service_name(cluster)
        pod_spec["hostname"] = name if rank == 0 else worker_name(cluster, index, rank)
        if rank == 0:
            container["ports"].append({"name": "dist-init", "containerPort": DIST_INIT_PORT})
        else:
            meta["name"] = worker_name(cluster, index, rank)
            meta["annotations"].pop(BOOTSTRAP_ANNOTATION, None)
            container["command"] = [AGENT_COMMAND, "--worker"]
            # The worker's SGLang serves only /health (its dummy health server): open it
            # to the kubelet; the agent's probes do not exist here.
            container["env"].append({"name": "PRORSA_ENGINE_HOST", "value": "0.0.0.0"})
            container["ports"] = [{"name": "http", "containerPort": ENGINE_PORT}]
            probe = {"httpGet": {"path": "/health", "port": ENGINE_PORT}, "timeoutSeconds": 5}
            container["startupProbe"] = probe | {"periodSeconds": 10, "failureThreshold": 180}
            container["livenessProbe"] = probe | {"periodSeconds": 10, "failureThreshold": 6}
            container.pop("readinessProbe", None)
        pods.append(pod)
    return pods


def node_rank(pod: dict[str, Any]) -> int:
    """0 for a leader and for a one-node instance's pod.

    A LeaderWorkerSet's workers share one template, so their rank is the worker index LWS
    labels each with.
    """
    labels = pod["metadata"].get("labels") or {}
    value = labels.get(NODE_RANK_LABEL) or labels.get(lws.WORKER_INDEX_LABEL) or "0"
    return int(value) if value.isdigit() else 0


def is_leader(pod: dict[str, Any]) -> bool:
    return node_rank(pod) == 0


def _nodes(pod: dict[str, Any]) -> int:
    value = (pod["metadata"].get("labels") or {}).get(NODES_LABEL, "1")
    return int(value) if value.isdigit() else 1


def _index(pod: dict[str, Any]) -> int:
    value = (pod["metadata"].get("labels") or {}).get(INDEX_LABEL, "-1")
    try:
        return int(value)
    except ValueError:
        return -1


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupView:
    """The engine pods of one tick, seen as instances."""

    leaders: list[dict[str, Any]]
    """One pod per live instance, as the one-node code expects (leaders of whole groups)."""
    hold: frozenset[int]
    """Indices not to create this tick: a group is being torn down."""
    pods: int = 0
    """Engine pods of the cluster, workers included (the status and the demo report it)."""
    restarted: tuple[str, ...] = field(default=())


async def reconcile_groups(
    *,
    kube: Any,
    namespace: str,
    pods: list[dict[str, Any]],
    nodes: int,
    instances: int,
    busy: set[str],
    post_event: EventPoster,
) -> GroupView:
    """Keep every group whole: tear down a group with a failed, missing or surplus pod.

    A one-node cluster passes through (its stray workers, from a former nodesPerInstance,
    are removed). A worker whose role label lags its leader's (an operator that stopped
    between relabelling the two, with no switch left to finish) is brought in line.
    """
    groups: dict[int, list[dict[str, Any]]] = {}
    singles: list[dict[str, Any]] = []
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if GROUP_LABEL in labels or nodes > 1:
            groups.setdefault(_index(pod), []).append(pod)
        else:
            singles.append(pod)
    leaders: list[dict[str, Any]] = list(singles)
    hold: set[int] = set()
    restarted: list[str] = []
    for index, members in sorted(groups.items()):
        # A LeaderWorkerSet's group is recreated by its controller, and removed or resized
        # with its set (lws.reconcile_sets): its pods are never deleted here.
        by_lws = any(lws.owned(p) for p in members)
        if index >= instances or index < 0:
            # Scaled down: the workers go here, the leader where one-node pods go.
            for pod in members:
                if node_rank(pod) == 0:
                    leaders.append(pod)
                elif not pod["metadata"].get("deletionTimestamp") and not by_lws:
                    await kube.delete_pod(namespace, pod["metadata"]["name"])
            continue
        live = [p for p in members if not p["metadata"].get("deletionTimestamp")]
        if len(live) < len(members):
            hold.add(index)  # a teardown in progress: recreate once every pod is gone
            continue
        by_rank = {node_rank(p): p for p in live}
        leader = by_rank.get(0)
        reason = _broken(live, by_rank, nodes)
        if reason is None:
            assert leader is not None
            leaders.append(leader)
            await _align_workers(kube, namespace, leader, live, busy)
            continue
        if leader is not None and leader["metadata"]["name"] in busy and reason == "resized":
            leaders.append(leader)  # let the switch end before the group is resized
            continue
        hold.add(index)
        if by_lws:
            continue  # unavailable until LWS has the whole group up again
        first = (live[0]["metadata"].get("labels") or {}).get(GROUP_LABEL)
        name = leader["metadata"]["name"] if leader else first or live[0]["metadata"]["name"]
        if leader is None and name in busy:
            # The executor is replacing this group after a failed switch: it deletes the
            # leader, then the workers. A cluster's API keeps the leader (terminating)
            # through its grace period; an API without one shows this tick the workers
            # alone. Either way the group is the executor's until its switch ends.
            continue
        for pod in live:
            await kube.delete_pod(namespace, pod["metadata"]["name"])
        restarted.append(name)
        log.warning("%s: restarting the whole group (%s)", name, reason)
        await post_event("Warning", "GroupRestarted", f"{name}: {reason}; recreating all pods")
    return GroupView(
        leaders=leaders, hold=frozenset(hold), pods=len(pods), restarted=tuple(restarted)
    )


def _broken(
    live: list[dict[str, Any]], by_rank: dict[int, dict[str, Any]], nodes: int
) -> str | None:
    """Why the group cannot serve as it is, or None when it is whole."""
    for pod in live:
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Failed", "Succeeded"):
            return f"pod {pod['metadata']['name']} {phase}"
    if any(_nodes(p) != nodes for p in live) or len(by_rank) != len(live):
        return "resized"
    if 0 not in by_rank:
        return "leader missing"
    missing = [r for r in range(1, nodes) if r not in by_rank]
    if missing:
        return f"worker rank(s) {', '.join(map(str, missing))} missing"
    if any(r >= nodes for r in by_rank):
        return "resized"
    return None


async def _align_workers(
    kube: Any,
    namespace: str,
    leader: dict[str, Any],
    members: list[dict[str, Any]],
    busy: set[str],
) -> None:
    meta = leader["metadata"]
    if meta["name"] in busy or SWITCH_ANNOTATION in (meta.get("annotations") or {}):
        return  # the switch (or its resumption) relabels the group
    role = (meta.get("labels") or {}).get(ROLE_LABEL)
    for pod in members:
        labels = pod["metadata"].get("labels") or {}
        if node_rank(pod) != 0 and role and labels.get(ROLE_LABEL) != role:
            await kube.patch_pod(
                namespace, pod["metadata"]["name"], {"metadata": {"labels": {ROLE_LABEL: role}}}
            )


async def label_workers(kube: Any, namespace: str, leader: str, role: RoleLabel) -> None:
    """Give every worker of ``leader``'s group the role label (none for a one-node pod)."""
    for pod in await kube.list_pods(namespace, f"{GROUP_LABEL}={leader}"):
        if node_rank(pod) != 0:
            await kube.patch_pod(
                namespace, pod["metadata"]["name"], {"metadata": {"labels": {ROLE_LABEL: role}}}
            )


async def delete_workers(kube: Any, namespace: str, leader: str) -> None:
    """Remove the workers with their leader: a group is never left half replaced."""
    for pod in await kube.list_pods(namespace, f"{GROUP_LABEL}={leader}"):
        if node_rank(pod) != 0:
            await kube.delete_pod(namespace, pod["metadata"]["name"])


async def discover_manager(kube: Any) -> str:
    """Who keeps multi-node groups whole: LWS_MANAGED when the cluster serves the
    LeaderWorkerSet v1 API, else OPERATOR_MANAGED (read once, at start-up).

    Discovery (``GET /apis``) is a non-resource URL every authenticated user may read
    (the ``system:discovery`` ClusterRole): it needs no grant of the operator's own.
    """
    from kubernetes import client

    try:
        found = await kube._call(client.ApisApi(kube.api).get_api_versions)
    except Exception:  # a failed discovery must not keep the operator from starting
        log.warning("API discovery failed; groups are managed by the operator", exc_info=True)
        return OPERATOR_MANAGED
    for group in found.groups or []:
        if group.name == lws.GROUP and any(v.version == lws.VERSION for v in group.versions or []):
            log.info("LeaderWorkerSet API found: multi-node instances are LeaderWorkerSets")
            return LWS_MANAGED
    return OPERATOR_MANAGED
