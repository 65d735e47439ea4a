"""A stand-in LeaderWorkerSet controller (sigs.k8s.io/lws, API v1) for the API emulator.

:func:`leader_worker_set_crd` is the CRD (the fields the controller reads, the defaults
of the real one); :class:`FakeLwsController` turns each LeaderWorkerSet into pods, named
and labelled as the real controller and its pod webhook do, so that the operator and the
fake kubelet meet what a cluster with LWS installed would give them:

* group ``g`` of set ``s`` is the leader ``s-g`` and the workers ``s-g-1`` .. ``s-g-(size-1)``;
* every pod carries ``leaderworkerset.sigs.k8s.io/name``, ``/group-index``,
  ``/worker-index`` (0 for the leader), ``/group-key`` (the SHA-1 of ``<namespace>/<leader>``)
  and ``/template-revision-hash``, the ``/size`` annotation, workers ``/leader-name`` too;
* every container gets ``LWS_LEADER_ADDRESS`` (``s-g.<subdomain>.<namespace>``),
  ``LWS_GROUP_SIZE`` and ``LWS_WORKER_INDEX`` in front of its own variables (so that
  ``$(...)`` references to them expand), and each pod ``hostname`` = its name and
  ``subdomain`` = the set's name, as LWS's StatefulSets set them;
* the leader is owned by the set and the workers by the leader (LWS puts them in a
  StatefulSet the leader pod owns), so deleting either takes the group's workers with it;
* ``startupPolicy`` LeaderCreated creates the workers with the leader, LeaderReady once the
  leader is ready;
* ``restartPolicy`` RecreateGroupOnPodRestart (the default, and RecreateGroupAfterStart,
  not told apart here): a pod of the group failed, deleted, restarted or gone makes the
  controller delete the leader, so the whole group comes back (event ``RecreateGroup``);
  None: only the failed pod is recreated;
* a new template revision recreates the group (LWS rolls it out; one group at a time
  is not modelled), as does a scale-down remove the groups past ``replicas``.

No StatefulSets, headless Service, status or subgroups: nothing Prorsa reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prorsa.k8s.kube import Kube
from prorsa_contract.aio import cancel_and_wait

log = logging.getLogger("prorsa.fake-lws")

GROUP = "leaderworkerset.x-k8s.io"
VERSION = "v1"
PLURAL = "leaderworkersets"
KIND = "LeaderWorkerSet"
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
REVISION_LABEL = "leaderworkerset.sigs.k8s.io/template-revision-hash"
SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
LEADER_NAME_ANNOTATION = "leaderworkerset.sigs.k8s.io/leader-name"
RECREATE_POLICIES = ("RecreateGroupOnPodRestart", "RecreateGroupAfterStart")

_OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def leader_worker_set_crd() -> dict[str, Any]:
    """The LeaderWorkerSet CRD, with the real one's defaults for the fields read here."""
    template = {
        "type": "object",
        "required": ["workerTemplate"],
        "properties": {
            "size": {"type": "integer", "format": "int32", "default": 1, "minimum": 1},
            "restartPolicy": {
                "type": "string",
                "default": "RecreateGroupOnPodRestart",
                "enum": ["Default", *RECREATE_POLICIES, "None"],
            },
            "leaderTemplate": _OPEN,
            "workerTemplate": _OPEN,
            "subGroupPolicy": _OPEN,
            "volumeClaimTemplates": {"type": "array", "items": _OPEN},
            "persistentVolumeClaimRetentionPolicy": _OPEN,
        },
    }
    spec = {
        "type": "object",
        "required": ["leaderWorkerTemplate"],
        "properties": {
            "replicas": {"type": "integer", "format": "int32", "default": 1, "minimum": 0},
            "startupPolicy": {
                "type": "string",
                "default": "LeaderCreated",
                "enum": ["LeaderCreated", "LeaderReady"],
            },
            "leaderWorkerTemplate": template,
            "rolloutStrategy": _OPEN,
            "networkConfig": _OPEN,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": "leaderworkerset",
                "shortNames": ["lws"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {"spec": spec, "status": _OPEN},
                        }
                    },
                }
            ],
        },
    }


def group_key(namespace: str, leader: str) -> str:
    return hashlib.sha1(f"{namespace}/{leader}".encode()).hexdigest()


def revision(lws: dict[str, Any]) -> str:
    """A hash of the leader/worker templates: a new one is a new revision to roll out."""
    template = lws["spec"]["leaderWorkerTemplate"]
    text = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _failed(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    restarted = any(int(s.get("restartCount", 0)) > 0 for s in statuses)
    return status.get("phase") == "Failed" or restarted


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


@dataclass(kw_only=True)
class FakeLwsController:
    """Keeps the pods of every LeaderWorkerSet in ``namespace`` (a polling loop)."""

    kube: Kube
    namespace: str
    poll_interval: float = 0.1
    _workers: dict[str, set[str]] = field(default_factory=dict)
    """Leader uid: the workers created for it (one that disappears restarts the group)."""
    _task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeLwsController:
        self._task = asyncio.create_task(self._loop(), name="fake-lws-controller")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._task)

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("fake LeaderWorkerSet controller")
            await asyncio.sleep(self.poll_interval)

    async def sync(self) -> None:
        """One pass over every set: create what is missing, recreate what broke."""
        api = self.kube.custom
        listed = await self.kube.call(
            api.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL
        )
        found = await self.kube.list_pods(self.namespace, NAME_LABEL)
        pods = {p["metadata"]["name"]: p for p in found}
        for lws in listed.get("items") or []:
            if lws["metadata"].get("deletionTimestamp"):
                continue
            replicas = int(lws["spec"].get("replicas", 1))
            for group in range(replicas):
                await self._sync_group(lws, group, pods)
            for pod in pods.values():
                labels = pod["metadata"].get("labels") or {}
                if (
                    labels.get(NAME_LABEL) == lws["metadata"]["name"]
                    and labels.get(WORKER_INDEX_LABEL) == "0"
                    and int(labels.get(GROUP_INDEX_LABEL, "0")) >= replicas
                ):
                    await self.kube.delete_pod(self.namespace, pod["metadata"]["name"])

    async def _sync_group(self, lws: dict[str, Any], group: int, pods: dict[str, Any]) -> None:
        name = lws["metadata"]["name"]
        template = lws["spec"]["leaderWorkerTemplate"]
        size = int(template.get("size", 1))
        policy = template.get("restartPolicy", "RecreateGroupOnPodRestart")
        head = f"{name}-{group}"
        leader = pods.get(head)
        if leader is None:
            leader = await self._create(lws, group, 0, None)
            if lws["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated":
                for worker in range(1, size):
                    await self._create(lws, group, worker, leader)
            return
        if leader["metadata"].get("deletionTimestamp"):
            return
        uid = leader["metadata"]["uid"]
        workers = {w: pods.get(f"{head}-{w}") for w in range(1, size)}
        reason = None
        if (leader["metadata"].get("labels") or {}).get(REVISION_LABEL) != revision(lws):
            reason = "a new template revision"
        elif policy in RECREATE_POLICIES:
            present = [p for p in (leader, *workers.values()) if p is not None]
            for pod in present:
                if _failed(pod) or pod["metadata"].get("deletionTimestamp"):
                    reason = f"pod {pod['metadata']['name']} failed"
                    break
            gone = sorted(self._workers.get(uid, set()) - {p["metadata"]["name"] for p in present})
            if reason is None and gone:
                reason = f"pod {gone[0]} deleted"
        elif _failed(leader):
            reason = f"pod {head} failed"
        if reason is not None:
            await self._recreate(lws, head, reason)
            return
        for pod in workers.values():
            if pod is not None and _failed(pod):  # restartPolicy None: that pod alone
                await self.kube.delete_pod(self.namespace, pod["metadata"]["name"])
        ready = lws["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated"
        if ready or _ready(leader):
            for worker, pod in workers.items():
                if pod is None:
                    await self._create(lws, group, worker, leader)

    async def _recreate(self, lws: dict[str, Any], leader: str, reason: str) -> None:
        """Delete the leader: its workers go with it, and the next pass starts a new group."""
        pod = await self.kube.get_pod(self.namespace, leader)
        if pod is not None:
            self._workers.pop(pod["metadata"]["uid"], None)
        await self.kube.delete_pod(self.namespace, leader)
        message = f"{reason}, deleted leader pod {leader} to recreate the group"
        log.info("%s: %s", lws["metadata"]["name"], message)
        await self._event(lws, "RecreateGroup", message)

    async def _create(
        self, lws: dict[str, Any], group: int, worker: int, leader: dict[str, Any] | None
    ) -> dict[str, Any]:
        body = self.pod(lws, group, worker, leader)
        pod = await self.kube.call(self.kube.core.create_namespaced_pod, self.namespace, body)
        if leader is not None:
            self._workers.setdefault(leader["metadata"]["uid"], set()).add(pod["metadata"]["name"])
        return pod

    def pod(
        self, lws: dict[str, Any], group: int, worker: int, leader: dict[str, Any] | None
    ) -> dict[str, Any]:
        """Pod ``worker`` (0: the leader) of group ``group``, as LWS would create it."""
        name = lws["metadata"]["name"]
        template = lws["spec"]["leaderWorkerTemplate"]
        chosen = template["workerTemplate"]
        if worker == 0:
            chosen = template.get("leaderTemplate") or chosen
        chosen = copy.deepcopy(chosen)
        head = f"{name}-{group}"
        pod_name = head if worker == 0 else f"{head}-{worker}"
        meta = chosen.get("metadata") or {}
        labels = dict(meta.get("labels") or {}) | {
            NAME_LABEL: name,
            GROUP_INDEX_LABEL: str(group),
            WORKER_INDEX_LABEL: str(worker),
            GROUP_KEY_LABEL: group_key(self.namespace, head),
            REVISION_LABEL: revision(lws),
        }
        annotations = dict(meta.get("annotations") or {})
        annotations[SIZE_ANNOTATION] = str(template.get("size", 1))
        if leader is None:
            owner = {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name,
                "uid": lws["metadata"]["uid"],
            }  # fmt: skip
        else:
            annotations[LEADER_NAME_ANNOTATION] = head
            owner = {
                "apiVersion": "v1", "kind": "Pod", "name": head,
                "uid": leader["metadata"]["uid"],
            }  # fmt: skip
        spec = chosen.get("spec") or {}
        spec["hostname"], spec["subdomain"] = pod_name, name
        injected = [
            {"name": "LWS_LEADER_ADDRESS", "value": f"{head}.{name}.{self.namespace}"},
            {"name": "LWS_GROUP_SIZE", "value": str(template.get("size", 1))},
            {"name": "LWS_WORKER_INDEX", "value": str(worker)},
        ]
        ours = {e["name"] for e in injected}
        for kind in ("initContainers", "containers"):
            for container in spec.get(kind) or []:
                own = [e for e in container.get("env") or [] if e["name"] not in ours]
                container["env"] = [*injected, *own]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": self.namespace,
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [owner | {"controller": True, "blockOwnerDeletion": True}],
            },
            "spec": spec,
        }

    async def _event(self, lws: dict[str, Any], reason: str, message: str) -> None:
        meta = lws["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": meta["name"],
                "namespace": self.namespace,
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message,
            "type": "Normal",
            "source": {"component": "lws"},
            "firstTimestamp": _now(),
            "lastTimestamp": _now(),
            "count": 1,
        }
        with contextlib.suppress(Exception):
            await self.kube.call(self.kube.core.create_namespaced_event, self.namespace, body)
