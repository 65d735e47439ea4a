"""The emulator's writes: create, update, the four patch types, and their commit.

Each write is prepared (server-owned metadata kept, generation moved on spec changes,
conflicts on stale resourceVersions) into a pending write that admission may still change,
then committed to storage in one step.
"""

from __future__ import annotations

import copy
import random
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from prorsa_lab.doubles.kube.errors import ApiError
from prorsa_lab.doubles.kube.garbage_collection import GarbageCollection
from prorsa_lab.doubles.kube.patch import PatchError, json_patch, merge_patch, strategic_merge_patch
from prorsa_lab.doubles.kube.resources import (
    CRD_KEY,
    NAMESPACES_KEY,
    PODS_KEY,
    CRDError,
    ResourceSpec,
    specs_from_crd,
)
from prorsa_lab.doubles.kube.schema import FieldIssue
from prorsa_lab.doubles.kube.store import (
    Pending,
    metadata_of,
    timestamp_now,
)

MERGE_PATCH = "application/merge-patch+json"


STRATEGIC_PATCH = "application/strategic-merge-patch+json"


JSON_PATCH = "application/json-patch+json"


APPLY_PATCH = "application/apply-patch+yaml"


_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what the real generateName suffix draws from


# Fields the server owns: a client can neither set nor change them through a write.
_SYSTEM_META = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
    "selfLink",
    "managedFields",
)


@attrs.define(kw_only=True)
class Writes(GarbageCollection):
    """Create, update and patch prepared into pending writes, then committed to storage."""

    def _schedule_pod_start(self, pod: Mapping[str, Any]) -> None:
        """A pod was created; the pod lifecycle layer (``pods``) starts it."""

    def _prepare_create(self, spec: ResourceSpec, namespace: str | None, body: Any) -> Pending:
        if not isinstance(body, dict):
            raise ApiError.bad_request("the body of the request must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            meta = obj["metadata"] = {}
        if spec.namespaced:
            body_ns = meta.get("namespace")
            if namespace is None:
                namespace = body_ns
            elif body_ns and body_ns != namespace:
                raise ApiError.bad_request(
                    "the namespace of the provided object does not match "
                    "the namespace sent on the request"
                )
            self._namespace_for_write(spec, namespace)
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise ApiError.invalid(
                    spec,
                    "",
                    [
                        FieldIssue(
                            "metadata.name",
                            "FieldValueRequired",
                            "Required value: name or generateName is required",
                        )
                    ],
                )
            for _ in range(100):
                candidate = prefix + "".join(random.choices(_NAME_CHARS, k=5))
                if self._current(spec, namespace, candidate) is None:
                    meta["name"] = candidate
                    break
        name = meta["name"]
        if self._current(spec, namespace, name) is not None:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{spec.group_resource} "{name}" already exists',
                details={"name": name, "group": spec.group, "kind": spec.plural},
            )
        for system in _SYSTEM_META:
            meta.pop(system, None)
        obj["apiVersion"], obj["kind"] = spec.api_version, spec.kind
        self._check_metadata(spec, obj)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = timestamp_now()
        meta["generation"] = 1
        if spec.has_status:
            obj.pop("status", None)
        obj = self._defaults_on_create(spec, obj)
        obj = self._apply_schema(spec, obj)
        return Pending(spec, namespace, name, "CREATE", None, obj, None)

    def _merge_update(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        name: str,
        old: dict[str, Any],
        incoming: Any,
        subresource: str | None,
        *,
        require_rv: bool,
    ) -> Pending:
        """Turn a full proposed object (from PUT, or a patch applied to ``old``) into a write."""
        if subresource not in (None, "status") or (subresource and not spec.has_status):
            raise ApiError(
                404,
                "NotFound",
                f"the server could not find the requested resource "
                f"({spec.group_resource}/{subresource})",
            )
        if not isinstance(incoming, dict):
            raise ApiError.bad_request("the body of the request must be a JSON object")
        in_meta = metadata_of(incoming)
        if in_meta.get("name", name) != name:
            raise ApiError.bad_request(
                f"the name of the object ({in_meta.get('name')}) does not "
                f"match the name on the URL ({name})"
            )
        if spec.namespaced and in_meta.get("namespace", namespace) != namespace:
            raise ApiError.bad_request(
                "the namespace of the provided object does not match the "
                "namespace sent on the request"
            )
        old_meta = metadata_of(old)
        rv = in_meta.get("resourceVersion")
        if rv not in (None, "") and str(rv) != old_meta.get("resourceVersion"):
            raise ApiError.conflict(spec, name)
        if require_rv and rv in (None, "") and spec.custom:
            raise ApiError.invalid(
                spec,
                name,
                [
                    FieldIssue(
                        "metadata.resourceVersion",
                        "FieldValueInvalid",
                        "Invalid value: 0x0: must be specified for an update",
                    )
                ],
            )
        if subresource == "status":
            new = copy.deepcopy(old)
            if "status" in incoming:
                new["status"] = copy.deepcopy(incoming["status"])
            else:
                new.pop("status", None)
        else:
            new = copy.deepcopy(incoming)
            meta = new.setdefault("metadata", {})
            for system in _SYSTEM_META:
                if system in old_meta:
                    meta[system] = copy.deepcopy(old_meta[system])
                else:
                    meta.pop(system, None)
            meta["name"] = name
            if spec.namespaced:
                meta["namespace"] = namespace
            else:
                meta.pop("namespace", None)
            if spec.has_status:
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
                else:
                    new.pop("status", None)
            if spec.key == NAMESPACES_KEY:
                new["spec"] = copy.deepcopy(old.get("spec") or {})
            self._secret_string_data(spec, new)
        new["apiVersion"], new["kind"] = spec.api_version, spec.kind
        self._check_metadata(spec, new)
        if old_meta.get("deletionTimestamp"):
            added = set(metadata_of(new).get("finalizers") or []) - set(
                old_meta.get("finalizers") or []
            )
            if added:
                raise ApiError.invalid(
                    spec,
                    name,
                    [
                        FieldIssue(
                            "metadata.finalizers",
                            "FieldValueForbidden",
                            "Forbidden: no new finalizers can be added if the object is being "
                            f"deleted, found new finalizers {sorted(added)!r}",
                        )
                    ],
                )
        if spec.key == CRD_KEY:
            try:
                specs_from_crd(new)
            except CRDError as exc:
                raise ApiError(
                    422,
                    "Invalid",
                    f'CustomResourceDefinition.apiextensions.k8s.io "{name}" is invalid: {exc}',
                ) from None
        new = self._apply_schema(spec, new)
        if self._content(spec, new) != self._content(spec, old):
            new["metadata"]["generation"] = int(old_meta.get("generation", 1)) + 1
        noop = self._comparable(new) == self._comparable(old)
        return Pending(
            spec,
            namespace,
            name,
            "UPDATE",
            old,
            new,
            old_meta.get("resourceVersion"),
            subresource,
            noop,
        )

    @staticmethod
    def _content(spec: ResourceSpec, obj: Mapping[str, Any]) -> dict[str, Any]:
        """The part whose change bumps ``generation`` (all but metadata and the status)."""
        skip = {"metadata", "apiVersion", "kind"} | ({"status"} if spec.has_status else set())
        return {k: v for k, v in obj.items() if k not in skip}

    @staticmethod
    def _comparable(obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = {k: v for k, v in metadata_of(obj).items() if k != "resourceVersion"}
        return {**obj, "metadata": meta}

    def _prepare_patch(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        name: str,
        patch: Any,
        content_type: str,
        subresource: str | None,
    ) -> Pending:
        old = self._current(spec, namespace, name)
        if content_type == APPLY_PATCH and old is None and subresource is None:
            if not isinstance(patch, dict):
                raise ApiError.bad_request("an apply patch must be an object")
            return self._prepare_create(spec, namespace, patch)
        if old is None:
            raise ApiError.not_found(spec, name)
        try:
            if content_type in (MERGE_PATCH, APPLY_PATCH):
                if not isinstance(patch, dict):
                    raise ApiError.bad_request("a merge patch must be a JSON object")
                proposed = merge_patch(old, patch)
            elif content_type == STRATEGIC_PATCH:
                if spec.custom:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "the body of the request was in an unknown format - accepted "
                        f"media types include: {JSON_PATCH}, {MERGE_PATCH}, "
                        f"{APPLY_PATCH}",
                    )
                if not isinstance(patch, dict):
                    raise ApiError.bad_request("a strategic merge patch must be a JSON object")
                proposed = strategic_merge_patch(old, patch)
            elif content_type == JSON_PATCH:
                if not isinstance(patch, list):
                    raise ApiError.bad_request("a JSON patch must be a list of operations")
                proposed = json_patch(old, patch)
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - accepted "
                    f"media types include: {JSON_PATCH}, {MERGE_PATCH}, "
                    f"{APPLY_PATCH}, {STRATEGIC_PATCH}",
                )
        except PatchError as exc:
            raise ApiError(
                422, "Invalid" if content_type != JSON_PATCH else "UnprocessableEntity", str(exc)
            ) from None
        return self._merge_update(
            spec, namespace, name, old, proposed, subresource, require_rv=False
        )

    def _commit(self, pending: Pending) -> dict[str, Any]:
        """Store a prepared write; the caller holds the lock and checked ``base_rv``."""
        if pending.noop:
            assert pending.old is not None
            return copy.deepcopy(pending.old)
        new = pending.new
        new["metadata"]["resourceVersion"] = str(self._next_rv())
        self._store(pending.spec, new, pending.old)
        spec = pending.spec
        if spec.key == CRD_KEY:
            if pending.old is not None:
                for stale in self._crd_specs(pending.old):
                    if stale.key not in {s.key for s in specs_from_crd(new)}:
                        self._unregister(stale)
            for served in specs_from_crd(new):
                self._register(served)
        if pending.operation == "CREATE" and spec.key == PODS_KEY:
            self._schedule_pod_start(new)
        result = copy.deepcopy(new)
        meta = new["metadata"]
        removed = bool(meta.get("deletionTimestamp")) and self._removable(spec, new)
        if removed:
            self._remove(spec, new)
        # Run the controllers only when they may have work: an owner went away, an object
        # names an owner that is unknown, or a deletion is in progress.
        owners = {r.get("uid") for r in meta.get("ownerReferences") or []}
        if removed or meta.get("deletionTimestamp") or not owners <= self._uids:
            self._reconcile()
        return result

    def _base_rv(self, pending: Pending) -> str | None:
        current = self._current(pending.spec, pending.namespace, pending.name)
        return None if current is None else metadata_of(current).get("resourceVersion")
