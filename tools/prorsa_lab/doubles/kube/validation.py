"""The emulator's admission checks: metadata, structural schemas, namespaces, defaults.

What an API server refuses with 422 (or fills in) before a write is stored, so that a
manifest the emulator accepts is one a cluster accepts too.
"""

from __future__ import annotations

import base64
import copy
import re
from collections.abc import Mapping
from typing import Any

import attrs

from prorsa_lab.doubles.kube.errors import ApiError
from prorsa_lab.doubles.kube.resources import (
    CRD_KEY,
    NAMESPACES_KEY,
    PODS_KEY,
    CRDError,
    ResourceSpec,
    specs_from_crd,
)
from prorsa_lab.doubles.kube.schema import FieldIssue, apply_structural_schema, validate
from prorsa_lab.doubles.kube.store import (
    Storage,
    metadata_of,
    timestamp_now,
)

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


@attrs.define(kw_only=True)
class Validation(Storage):
    """Metadata and schema checks, and the defaults the API server fills in on create."""

    def _check_metadata(self, spec: ResourceSpec, obj: Mapping[str, Any]) -> None:
        meta = metadata_of(obj)
        name = meta.get("name", "")
        issues: list[FieldIssue] = []
        pattern = (
            _DNS_LABEL
            if spec.key == NAMESPACES_KEY
            else (_DNS_1035 if spec.key == ("", "v1", "services") else _DNS_SUBDOMAIN)
        )
        if not isinstance(name, str) or len(name) > 253 or not pattern.match(name):
            issues.append(
                FieldIssue(
                    "metadata.name",
                    "FieldValueInvalid",
                    f'Invalid value: "{name}": a lowercase RFC 1123 name '
                    "must consist of lower case alphanumeric characters, '-' "
                    "or '.', and must start and end with an alphanumeric "
                    "character",
                )
            )
        for section in ("labels", "annotations"):
            values = meta.get(section)
            if values is None:
                continue
            if not isinstance(values, dict):
                issues.append(
                    FieldIssue(
                        f"metadata.{section}",
                        "FieldValueInvalid",
                        "Invalid value: must be a map of strings",
                    )
                )
                continue
            for key, value in values.items():
                path = f"metadata.{section}"
                short = key.rsplit("/", 1)[-1]
                if not isinstance(key, str) or len(short) > 63 or not _QUALIFIED_NAME.match(short):
                    issues.append(
                        FieldIssue(
                            path,
                            "FieldValueInvalid",
                            f'Invalid value: "{key}": name part must consist of '
                            "alphanumeric characters, '-', '_' or '.'",
                        )
                    )
                if not isinstance(value, str):
                    issues.append(
                        FieldIssue(
                            f"{path}.{key}",
                            "FieldValueTypeInvalid",
                            f"Invalid value: {value!r}: must be a string",
                        )
                    )
                elif section == "labels" and (len(value) > 63 or not _LABEL_VALUE.match(value)):
                    issues.append(
                        FieldIssue(
                            path,
                            "FieldValueInvalid",
                            f'Invalid value: "{value}": a valid label must be '
                            "an empty string or consist of alphanumeric "
                            "characters, '-', '_' or '.', at most 63",
                        )
                    )
        for i, ref in enumerate(meta.get("ownerReferences") or []):
            for required in ("apiVersion", "kind", "name", "uid"):
                if not isinstance(ref, dict) or not ref.get(required):
                    issues.append(
                        FieldIssue(
                            f"metadata.ownerReferences[{i}].{required}",
                            "FieldValueRequired",
                            "Required value",
                        )
                    )
        finalizers = meta.get("finalizers")
        if finalizers is not None and (
            not isinstance(finalizers, list) or not all(isinstance(f, str) for f in finalizers)
        ):
            issues.append(
                FieldIssue(
                    "metadata.finalizers",
                    "FieldValueInvalid",
                    "Invalid value: must be a list of strings",
                )
            )
        if issues:
            raise ApiError.invalid(spec, str(name), issues)

    def _apply_schema(
        self, spec: ResourceSpec, obj: dict[str, Any], *, check: bool = True
    ) -> dict[str, Any]:
        if not (spec.custom and self.structural_schemas and spec.schema):
            return obj
        obj = apply_structural_schema(obj, spec.schema)
        if check:
            issues = validate(obj, spec.schema)
            if issues:
                raise ApiError.invalid(spec, metadata_of(obj).get("name", ""), issues)
        return obj

    def _namespace_for_write(self, spec: ResourceSpec, namespace: str | None) -> None:
        if not spec.namespaced:
            return
        if not namespace:
            raise ApiError(
                405,
                "MethodNotAllowed",
                f"{spec.group_resource} is namespaced: write it under /namespaces/{{namespace}}/",
            )
        ns = self._current(self._specs[NAMESPACES_KEY], None, namespace)
        if ns is None:
            raise ApiError(
                404,
                "NotFound",
                f'namespaces "{namespace}" not found',
                details={"name": namespace, "kind": "namespaces"},
            )
        if metadata_of(ns).get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f"{spec.group_resource} is forbidden: unable to create new content in "
                f"namespace {namespace} because it is being terminated",
            )

    def _defaults_on_create(self, spec: ResourceSpec, obj: dict[str, Any]) -> dict[str, Any]:
        """What the built-in registries fill in on create (a small, useful subset)."""
        meta = obj["metadata"]
        if spec.key == NAMESPACES_KEY:
            meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
            obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
            obj["status"] = {"phase": "Active"}
        elif spec.key == PODS_KEY:
            pod_spec = obj.setdefault("spec", {})
            pod_spec.setdefault("restartPolicy", "Always")
            pod_spec.setdefault("serviceAccountName", "default")
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        elif spec.key == ("", "v1", "services"):
            svc = obj.setdefault("spec", {})
            svc.setdefault("type", "ClusterIP")
            if svc["type"] != "ExternalName" and not svc.get("clusterIP"):
                n = next(self._cluster_ips)
                svc["clusterIP"] = f"10.96.{n // 250}.{n % 250 + 1}"
            for port in svc.get("ports") or []:
                port.setdefault("protocol", "TCP")
                port.setdefault("targetPort", port.get("port"))
            obj["status"] = {"loadBalancer": {}}
        elif spec.key == ("apps", "v1", "deployments"):
            obj.setdefault("spec", {}).setdefault("replicas", 1)
            obj["status"] = {}
        elif spec.key == CRD_KEY:
            try:
                specs_from_crd(obj)
            except CRDError as exc:
                raise ApiError(
                    422,
                    "Invalid",
                    f"CustomResourceDefinition.apiextensions.k8s.io "
                    f'"{meta["name"]}" is invalid: {exc}',
                ) from None
            obj["status"] = self._crd_status(obj)
        self._secret_string_data(spec, obj)
        return obj

    @staticmethod
    def _secret_string_data(spec: ResourceSpec, obj: dict[str, Any]) -> None:
        if spec.key == ("", "v1", "secrets") and isinstance(obj.get("stringData"), dict):
            data = obj.setdefault("data", {})
            for key, value in obj.pop("stringData").items():
                data[key] = base64.b64encode(str(value).encode()).decode()
            obj.setdefault("type", "Opaque")
        elif spec.key == ("", "v1", "secrets"):
            obj.setdefault("type", "Opaque")

    @staticmethod
    def _crd_status(crd: Mapping[str, Any]) -> dict[str, Any]:
        spec = crd.get("spec") or {}
        now = timestamp_now()
        conditions = [
            {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": now}
            for t, r, m in (
                ("NamesAccepted", "NoConflicts", "no conflicts found"),
                ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
            )
        ]
        stored = [v["name"] for v in spec.get("versions") or [] if v.get("storage")]
        return {
            "acceptedNames": copy.deepcopy(spec.get("names") or {}),
            "conditions": conditions,
            "storedVersions": stored,
        }
