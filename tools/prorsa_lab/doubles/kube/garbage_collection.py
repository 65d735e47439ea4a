"""The emulator's deletion: finalizers, ``deletionTimestamp`` and garbage collection.

Dependents go through ``ownerReferences`` with background, foreground or orphan
propagation, and a namespace terminates once what it holds is gone, as on a cluster.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from prorsa_lab.doubles.kube.errors import ApiError
from prorsa_lab.doubles.kube.resources import (
    CRD_KEY,
    NAMESPACES_KEY,
    ResourceSpec,
)
from prorsa_lab.doubles.kube.store import (
    metadata_of,
    timestamp_now,
)
from prorsa_lab.doubles.kube.validation import (
    Validation,
)


@attrs.define(kw_only=True)
class GarbageCollection(Validation):
    """Deletion with finalizers, owner-reference garbage collection and namespace termination."""

    def _removable(self, spec: ResourceSpec, obj: Mapping[str, Any]) -> bool:
        """Whether a deleting object may go now: no finalizers, and nothing left inside."""
        if metadata_of(obj).get("finalizers"):
            return False
        if spec.key == NAMESPACES_KEY:
            name = metadata_of(obj)["name"]
            return not any(
                s.namespaced and metadata_of(o).get("namespace") == name for s, o in self._iter()
            )
        if spec.key == CRD_KEY:
            kinds = {s.key for s in self._crd_specs(obj)}
            return not any(s.key in kinds for s, _ in self._iter())
        return True

    def _mark_deleting(
        self, spec: ResourceSpec, obj: dict[str, Any], extra_finalizers: Sequence[str] = ()
    ) -> dict[str, Any]:
        new = copy.deepcopy(obj)
        meta = new["metadata"]
        if extra_finalizers:
            meta["finalizers"] = [*(meta.get("finalizers") or []), *extra_finalizers]
        meta["deletionTimestamp"] = timestamp_now()
        meta["deletionGracePeriodSeconds"] = 0
        meta["generation"] = int(meta.get("generation", 1)) + 1
        if spec.key == NAMESPACES_KEY:
            new["status"] = {"phase": "Terminating"}
        meta["resourceVersion"] = str(self._next_rv())
        self._store(spec, new, obj)
        return new

    def _delete_one(
        self, spec: ResourceSpec, obj: dict[str, Any], policy: str
    ) -> tuple[dict[str, Any], bool]:
        """Delete one object; returns the final or current state and whether it is gone."""
        meta = metadata_of(obj)
        if policy == "Orphan":
            self._orphan_dependents(meta["uid"])
        if meta.get("deletionTimestamp"):
            return copy.deepcopy(obj), False
        extra = (
            ["foregroundDeletion"]
            if policy == "Foreground" and "foregroundDeletion" not in (meta.get("finalizers") or [])
            else []
        )
        if not extra and self._removable(spec, obj):
            return self._remove(spec, obj), True
        return copy.deepcopy(self._mark_deleting(spec, obj, extra)), False

    def _orphan_dependents(self, uid: str) -> None:
        for spec, obj in list(self._iter()):
            refs = metadata_of(obj).get("ownerReferences") or []
            if any(ref.get("uid") == uid for ref in refs):
                new = copy.deepcopy(obj)
                kept = [r for r in refs if r.get("uid") != uid]
                if kept:
                    new["metadata"]["ownerReferences"] = kept
                else:
                    new["metadata"].pop("ownerReferences", None)
                new["metadata"]["resourceVersion"] = str(self._next_rv())
                self._store(spec, new, obj)

    def _reconcile(self) -> None:
        """The controllers a cluster runs in the background, run to a fixed point now.

        Garbage collection deletes objects whose every owner is gone; foreground deletion
        waits for dependents; terminating namespaces and CRDs empty themselves, then go.
        """
        for _ in range(1000):
            if not self._reconcile_once():
                return
        raise RuntimeError("the emulator's controllers did not settle")  # pragma: no cover

    def _reconcile_once(self) -> bool:
        objects = list(self._iter())
        uids = {metadata_of(o).get("uid") for _, o in objects}
        self._uids = {u for u in uids if u}
        for spec, obj in objects:
            meta = metadata_of(obj)
            deleting = bool(meta.get("deletionTimestamp"))
            refs = meta.get("ownerReferences") or []
            if refs and not deleting and all(r.get("uid") not in uids for r in refs):
                self._delete_one(spec, obj, "Background")
                return True
            if refs and any(r.get("uid") not in uids for r in refs):
                # Some owners remain: the collector only drops the dangling references.
                new = copy.deepcopy(obj)
                new["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") in uids]
                new["metadata"]["resourceVersion"] = str(self._next_rv())
                self._store(spec, new, obj)
                return True
            if not deleting:
                continue
            if spec.key == NAMESPACES_KEY:
                inside = [
                    (s, o)
                    for s, o in objects
                    if s.namespaced
                    and metadata_of(o).get("namespace") == meta["name"]
                    and not metadata_of(o).get("deletionTimestamp")
                ]
                if inside:
                    for s, o in inside:
                        self._delete_one(s, o, "Background")
                    return True
            if spec.key == CRD_KEY:
                kinds = {s.key for s in self._crd_specs(obj)}
                inside = [
                    (s, o)
                    for s, o in objects
                    if s.key in kinds and not metadata_of(o).get("deletionTimestamp")
                ]
                if inside:
                    for s, o in inside:
                        self._delete_one(s, o, "Background")
                    return True
            if "foregroundDeletion" in (meta.get("finalizers") or []):
                dependents = [
                    (s, o)
                    for s, o in objects
                    if any(
                        r.get("uid") == meta["uid"]
                        for r in metadata_of(o).get("ownerReferences") or []
                    )
                ]
                waiting = [
                    (s, o) for s, o in dependents if not metadata_of(o).get("deletionTimestamp")
                ]
                for s, o in waiting:
                    self._delete_one(s, o, "Foreground")
                if not dependents:
                    new = copy.deepcopy(obj)
                    new["metadata"]["finalizers"] = [
                        f for f in meta["finalizers"] if f != "foregroundDeletion"
                    ]
                    new["metadata"]["resourceVersion"] = str(self._next_rv())
                    self._store(spec, new, obj)
                    if self._removable(spec, new):
                        self._remove(spec, new)
                    return True
                if waiting:
                    return True
            if self._removable(spec, obj):
                self._remove(spec, obj)
                return True
        return False

    def _delete(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        name: str,
        options: Mapping[str, Any],
        *,
        dry_run: bool = False,
    ) -> tuple[dict[str, Any], bool]:
        obj = self._current(spec, namespace, name)
        if obj is None:
            raise ApiError.not_found(spec, name)
        preconditions = options.get("preconditions") or {}
        meta = metadata_of(obj)
        if preconditions.get("uid") and preconditions["uid"] != meta.get("uid"):
            raise ApiError.conflict(
                spec,
                name,
                f"Precondition failed: UID in precondition: "
                f"{preconditions['uid']}, UID in object meta: {meta.get('uid')}",
            )
        if preconditions.get("resourceVersion") and str(
            preconditions["resourceVersion"]
        ) != meta.get("resourceVersion"):
            raise ApiError.conflict(spec, name)
        policy = options.get("propagationPolicy") or (
            "Orphan" if options.get("orphanDependents") else "Background"
        )
        if policy not in ("Background", "Foreground", "Orphan"):
            raise ApiError.bad_request(f"unsupported propagationPolicy {policy!r}")
        if dry_run:
            return copy.deepcopy(obj), False
        result, gone = self._delete_one(spec, obj, policy)
        self._reconcile()
        return result, gone
