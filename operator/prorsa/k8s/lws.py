"""Multi-node groups as LeaderWorkerSets (sigs.k8s.io/lws v1), when the cluster serves the API.

With the API installed the operator creates one LeaderWorkerSet per multi-node instance
(``replicas: 1``, ``size: nodesPerInstance``) and lets the LWS controller create the pods,
keep their names stable and recreate the whole group when any pod of it fails
(``RecreateGroupOnPodRestart``). The templates carry the pods the operator would create
itself (:func:`prorsa.k8s.groups.group_pods`): the same labels, annotations, probes and
SGLang flags; only what LWS decides differs. LWS names the leader ``<set>-0`` and the
workers ``<set>-0-<rank>``, and serves them under its own headless Service (the set's
name), so the rendezvous address and each worker's rank come from the variables LWS
injects into every container (``LWS_LEADER_ADDRESS``, ``LWS_WORKER_INDEX``), which the
kubelet expands in ``$(...)`` references.

The role label is switched on the live pods, as for operator-managed groups: neither the
LWS controller nor its StatefulSets revert pod labels (the role label is in no selector).
The templates keep ``decode``, the role every freshly started engine has; changing them
would be a new template revision, which LWS rolls out by recreating every group.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prorsa.k8s.objects import labels as engine_labels
from prorsa_contract.labels import (
    GROUP_LABEL,
    INDEX_LABEL,
    NODE_RANK_LABEL,
    NODES_LABEL,
    engine_name,
)

log = logging.getLogger("prorsa.lws")

GROUP = "leaderworkerset.x-k8s.io"
VERSION = "v1"
PLURAL = "leaderworkersets"
KIND = "LeaderWorkerSet"
# Labels and variables the LWS controller sets on the pods it creates (api/leaderworkerset/v1).
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
RESTART_POLICY = "RecreateGroupOnPodRestart"
# Workers start with their leader pod, not once it is ready: the leader's readiness waits
# for SGLang, which waits for every rank to join.
STARTUP_POLICY = "LeaderCreated"

EventPoster = Callable[[str, str, str], Awaitable[None]]


def set_name(cluster: str, index: int) -> str:
    """Instance ``index``'s LeaderWorkerSet, named like a one-node instance's pod."""
    return engine_name(cluster, index)


def leader_name(cluster: str, index: int) -> str:
    """The leader pod LWS creates for the set's one group (group index 0)."""
    return f"{set_name(cluster, index)}-0"


def owned(pod: dict[str, Any]) -> bool:
    """Whether an LWS controller keeps this pod's group (then the operator never deletes
    one of its pods for being broken: LWS recreates the group itself)."""
    return SET_NAME_LABEL in (pod["metadata"].get("labels") or {})


def leader_worker_set(
    *, cluster: str, namespace: str, index: int, pods: list[dict[str, Any]]
) -> dict[str, Any]:
    """The LeaderWorkerSet of instance ``index`` from the group's pods (leader first, then a
    worker), as :func:`prorsa.k8s.groups.group_pods` builds them."""
    leader, worker = pods[0], pods[1]
    name = set_name(cluster, index)
    head = leader_name(cluster, index)
    rendezvous = f"$({LEADER_ADDRESS_ENV}):{_dist_init_port(leader)}"
    templates = []
    for pod, rank in ((leader, "0"), (worker, f"$({WORKER_INDEX_ENV})")):
        meta = pod["metadata"]
        labels = dict(meta["labels"]) | {GROUP_LABEL: head}
        if rank != "0":
            labels.pop(NODE_RANK_LABEL)  # one template for every worker: LWS labels the rank
        spec = json.loads(json.dumps(pod["spec"]))
        # LWS's StatefulSets name the pods and put them under the set's headless Service.
        spec.pop("hostname", None)
        spec.pop("subdomain", None)
        (container,) = spec["containers"]
        values = {
            "PRORSA_INSTANCE": head,
            "PRORSA_NODE_RANK": rank,
            "PRORSA_DIST_INIT_ADDR": rendezvous,
        }
        container["env"] = [
            e | {"value": values[e["name"]]} if e["name"] in values else e for e in container["env"]
        ]
        templates.append(
            {"metadata": {"labels": labels, "annotations": dict(meta["annotations"])}, "spec": spec}
        )
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": engine_labels(cluster, "engine")
            | {INDEX_LABEL: str(index), NODES_LABEL: str(len(pods))},
        },
        "spec": {
            "replicas": 1,
            "startupPolicy": STARTUP_POLICY,
            "leaderWorkerTemplate": {
                "size": len(pods),
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": templates[0],
                "workerTemplate": templates[1],
            },
        },
    }


def _dist_init_port(leader: dict[str, Any]) -> int:
    (container,) = leader["spec"]["containers"]
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == "dist-init"))


async def reconcile_sets(
    *,
    kube: Any,
    namespace: str,
    cluster: str,
    selector: str,
    instances: int,
    nodes: int,
    busy: set[str],
    post_event: EventPoster,
) -> frozenset[int]:
    """Delete the sets of removed instances and of another size; the indices that keep one.

    A set whose leader is switching stays until the switch ends, as an operator-managed
    group does. Deleting a set takes its pods with it (they are its dependents); the group
    reconcile holds the index until they are gone, then a set of the new size is created.
    """
    kept: set[int] = set()
    for found in await kube.list_leader_worker_sets(namespace, selector):
        meta = found["metadata"]
        index = _int((meta.get("labels") or {}).get(INDEX_LABEL))
        size = _int(((found.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size"))
        if meta.get("deletionTimestamp"):
            kept.add(index)  # still going: its successor waits under the same name
            continue
        if 0 <= index < instances and size == nodes and nodes > 1:
            kept.add(index)
            continue
        if f"{meta['name']}-0" in busy:
            kept.add(index)
            continue
        await kube.delete_leader_worker_set(namespace, meta["name"])
        if 0 <= index < instances:
            reason, why = "GroupRestarted", f"size {size}, nodesPerInstance {nodes}"
        else:
            reason, why = "ScaledDown", "instance removed"
        log.info("%s/%s: deleted LeaderWorkerSet %s (%s)", namespace, cluster, meta["name"], why)
        await post_event("Normal", reason, f"removed LeaderWorkerSet {meta['name']} ({why})")
    return frozenset(kept)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1
