"""The objects of one RolloutCluster made to match its spec, and its labels its engines.

Engine pods by index 0..n-1 (a group of pods, or a LeaderWorkerSet, per multi-node
instance): failed ones are replaced, extra ones removed, missing ones created as decode
(the bootstrap in :mod:`prorsa.core.actions` flips them), never one out of the pod
security bounds. Role labels follow what the agents report: the router routes by label,
so a label that disagrees with its engine sends requests to the wrong side.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prorsa.control.events import EventPoster
from prorsa.control.metrics import OperatorMetrics
from prorsa.core.spec import RolloutClusterSpec
from prorsa.k8s import groups, lws
from prorsa.k8s import objects as obj
from prorsa.k8s.kube import Kube
from prorsa_contract.agent_api import EngineState
from prorsa_contract.labels import (
    CLUSTER_LABEL,
    COMPONENT_LABEL,
    INDEX_LABEL,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
)

log = logging.getLogger("prorsa.runtime")

Manifest = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Groups:
    """How the instances are deployed, for ``status.groups``."""

    nodes_per_instance: int
    pods: int  # every pod of every instance
    managed_by: str  # the operator, or LeaderWorkerSets


@dataclass(kw_only=True)
class Reconciler:
    namespace: str
    name: str
    kube: Kube
    metrics: OperatorMetrics
    post_event: EventPoster
    owned: Callable[[Manifest], Manifest]  # the manifest with the RolloutCluster as owner
    busy: Callable[[], set[str]]  # pods with a switch of this process in flight
    # New pods mount the agents' certificate Secret: make sure it is there first.
    ensure_agent_tls: Callable[[], Awaitable[None]]
    group_manager: str = groups.OPERATOR_MANAGED
    engine_pods: int = 0  # every pod of every instance, at the last reconcile
    _last_refusal: str | None = None  # the pod refusal last reported as an Event

    @property
    def selector(self) -> str:
        return f"{CLUSTER_LABEL}={self.name},{COMPONENT_LABEL}=engine"

    def uses_lws(self, spec: RolloutClusterSpec) -> bool:
        """Multi-node instances as LeaderWorkerSets (the API was found at start-up)."""
        return self.group_manager == groups.LWS_MANAGED and spec.engine.nodes_per_instance > 1

    def groups(self, spec: RolloutClusterSpec) -> Groups:
        return Groups(
            nodes_per_instance=spec.engine.nodes_per_instance,
            pods=self.engine_pods,
            managed_by=groups.LWS_MANAGED if self.uses_lws(spec) else groups.OPERATOR_MANAGED,
        )

    async def pods(self, spec: RolloutClusterSpec) -> list[Manifest]:
        """One engine pod (or group) per index 0..n-1; failed ones are replaced, extra ones
        removed; a multi-node instance is a LeaderWorkerSet when :meth:`uses_lws`. Returns
        each instance's pod (its leader), by index."""
        ns = self.namespace
        # Busy before and after the listing: a switch that replaced its group while the
        # list was in flight still owns what the list shows of it.
        busy = self.busy()
        pods = await self.kube.list_pods(ns, self.selector)
        busy |= self.busy()
        n = spec.instances
        by_index: dict[int, Manifest] = {}
        view = await groups.reconcile_groups(
            kube=self.kube,
            namespace=ns,
            pods=pods,
            nodes=spec.engine.nodes_per_instance,
            instances=n,
            busy=busy,
            post_event=self.post_event,
        )
        pods, self.engine_pods = view.leaders, view.pods
        sets: frozenset[int] = frozenset()
        if self.group_manager == groups.LWS_MANAGED:
            # Also with one node per instance: the sets of a former nodesPerInstance go.
            sets = await lws.reconcile_sets(
                kube=self.kube,
                namespace=ns,
                cluster=self.name,
                selector=self.selector,
                instances=n,
                nodes=spec.engine.nodes_per_instance,
                busy=busy,
                post_event=self.post_event,
            )
        for pod in pods:
            meta = pod["metadata"]
            try:
                index = int((meta.get("labels") or {}).get(INDEX_LABEL, "-1"))
            except ValueError:
                index = -1
            phase = (pod.get("status") or {}).get("phase")
            if meta.get("deletionTimestamp"):
                continue
            if index < 0 or index >= n:
                if meta["name"] not in busy and not lws.owned(pod):  # sets go with their pods
                    await self.kube.delete_pod(ns, meta["name"])
                    await self.post_event("Normal", "ScaledDown", f"removed {meta['name']}")
                continue
            if phase in ("Failed", "Succeeded"):
                await self.kube.delete_pod(ns, meta["name"])
                await self.post_event(
                    "Warning", "EngineFailed", f"{meta['name']} {phase}: replacing"
                )
                continue
            by_index[index] = pod
        if any(index not in by_index for index in range(n)):
            # New pods mount the certificate Secret: issue it again if it was deleted (a
            # rotation), and trust whatever CA it now holds.
            await self.ensure_agent_tls()
        missing = {
            index: groups.group_pods(
                cluster=self.name, namespace=ns, index=index, role="decode", spec=spec
            )
            for index in range(n)
            if index not in by_index and index not in view.hold and index not in sets
        }
        if not await self._within_bounds([p for group in missing.values() for p in group], spec):
            missing = {}
        for index, pods_of in missing.items():
            created = []
            if self.uses_lws(spec):
                manifest = lws.leader_worker_set(
                    cluster=self.name, namespace=ns, index=index, pods=pods_of
                )
                if await self.kube.create_leader_worker_set(ns, self.owned(manifest)):
                    created.append(f"LeaderWorkerSet {manifest['metadata']['name']}")
            else:
                for manifest in pods_of:
                    if await self.kube.ensure(self.owned(manifest)):
                        created.append(manifest["metadata"]["name"])
            if created:
                await self.post_event("Normal", "EngineCreated", ", ".join(created))
        return [p for _, p in sorted(by_index.items())]

    async def _within_bounds(self, pods: list[Manifest], spec: RolloutClusterSpec) -> bool:
        """The operator's own check of the pods it is about to create (docs/security.md):
        none is created when one is out of bounds; a Warning Event says why, once per cause."""
        problems: dict[str, list[str]] = {}
        for pod in pods:
            for problem in obj.pod_violations(pod, cluster=self.name, spec=spec):
                problems.setdefault(problem, []).append(pod["metadata"]["name"])
        if not problems:
            self._last_refusal = None  # a cause that comes back is reported again
            return True
        causes = "; ".join(problems)
        names = sorted({n for found in problems.values() for n in found})
        message = f"{', '.join(names)} not created, out of the pod security bounds: {causes}"
        log.error("%s/%s: %s", self.namespace, self.name, message)
        if causes != self._last_refusal:
            self._last_refusal = causes
            await self.post_event("Warning", "PodRefused", message[:1000])
        return False

    async def labels(self, pods: list[Manifest], states: dict[str, EngineState]) -> None:
        """Relabel a pod whose role label disagrees with the role its agent reports.

        Labels drift when a switch ends without knowing the engine's role (its agent was
        unreachable: the pod stays ``draining``), when a previous process died between
        the flip and the relabel, or when someone edits a label by hand. A pod mid-switch
        (intent annotation, or a switch of this executor) is left to its switch; a pod
        whose agent does not answer keeps its label until it does.
        """
        busy = self.busy()
        for pod in pods:
            meta = pod["metadata"]
            name = meta["name"]
            state = states.get(name)
            if state is None or state.switching or name in busy:
                continue
            if SWITCH_ANNOTATION in (meta.get("annotations") or {}):
                continue
            label = (meta.get("labels") or {}).get(ROLE_LABEL)
            if label == state.role:
                continue
            await self.kube.patch_pod(
                self.namespace, name, {"metadata": {"labels": {ROLE_LABEL: state.role}}}
            )
            meta.setdefault("labels", {})[ROLE_LABEL] = state.role
            self.metrics.label_corrections.labels(self.namespace, self.name).inc()
            log.warning(
                "%s/%s: %s labelled %s, engine reports %s: relabelled",
                self.namespace, self.name, name, label, state.role,
            )  # fmt: skip
            await self.post_event(
                "Warning",
                "RoleLabelCorrected",
                f"{name}: label {label or '(none)'} -> {state.role}, the role its engine reports",
            )
