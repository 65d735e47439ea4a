"""What the emulated API server knows about each resource: built-ins and custom resources.

A :class:`ResourceSpec` carries what the real server derives from its Go types or from a
CustomResourceDefinition: the kind and list kind (clients need them to decode lists), the
scope, which subresources exist (``status`` decides how writes treat ``.status``), which
field selectors are allowed, the printer columns that ``kubectl get`` shows, and for
custom resources the structural schema (pruning and defaults).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kmock

from prorsa_lab.doubles.kube_event_table import EVENTS_KEY, event_columns, event_row, human_age

__all__ = [
    "BUILTIN_RESOURCES",
    "CRD_KEY",
    "NAMESPACES_KEY",
    "PODS_KEY",
    "PrinterColumn",
    "ResourceSpec",
    "specs_from_crd",
]

VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
BASE_FIELDS = frozenset({"metadata.name", "metadata.namespace"})


@dataclass(frozen=True, kw_only=True)
class PrinterColumn:
    """One column of ``kubectl get`` (a CRD's additionalPrinterColumns entry)."""

    name: str
    type: str
    json_path: str
    priority: int = 0
    format: str = ""
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class ResourceSpec:
    """One served resource (a group, version and plural) and how the server treats it."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: frozenset[str] = frozenset()
    custom: bool = False
    field_selectors: frozenset[str] = BASE_FIELDS
    printer_columns: tuple[PrinterColumn, ...] = ()
    schema: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)

    @property
    def resource(self) -> kmock.resource:
        return kmock.resource(self.group, self.version, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def group_resource(self) -> str:
        """How error messages name the resource: ``pods``, ``rolloutclusters.prorsa.io``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    def info(self) -> kmock.ResourceInfo:
        """The discovery record that kmock serves under ``/api/v1`` and ``/apis/g/v``."""
        return kmock.ResourceInfo(
            namespaced=self.namespaced,
            kind=self.kind,
            singular=self.singular or self.kind.lower(),
            verbs=set(VERBS),
            shortnames=set(self.short_names),
            categories=set(self.categories),
            subresources=set(self.subresources),
        )

    def describes(self, word: str) -> bool:
        """Whether ``word`` names this resource the way ``kubectl get WORD`` would."""
        word = word.lower()
        names = {self.plural, self.singular or self.kind.lower(), self.kind.lower()}
        return word in names or word in self.short_names


def _builtin(
    group: str,
    plural: str,
    kind: str,
    *,
    version: str = "v1",
    namespaced: bool = True,
    short: Sequence[str] = (),
    status: bool = False,
    fields: Iterable[str] = (),
    categories: Sequence[str] = (),
) -> ResourceSpec:
    return ResourceSpec(
        group=group,
        version=version,
        plural=plural,
        kind=kind,
        namespaced=namespaced,
        singular=kind.lower(),
        short_names=tuple(short),
        categories=tuple(categories),
        subresources=frozenset({"status"} if status else ()),
        field_selectors=BASE_FIELDS | frozenset(fields),
    )


_EVENT_FIELDS = (
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
)
_POD_FIELDS = (
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
)

BUILTIN_RESOURCES: tuple[ResourceSpec, ...] = (
    _builtin(
        "",
        "namespaces",
        "Namespace",
        namespaced=False,
        short=["ns"],
        status=True,
        fields=["status.phase"],
    ),
    _builtin("", "pods", "Pod", short=["po"], status=True, fields=_POD_FIELDS, categories=["all"]),
    _builtin("", "services", "Service", short=["svc"], status=True, categories=["all"]),
    _builtin("", "endpoints", "Endpoints", short=["ep"]),
    _builtin("", "secrets", "Secret", fields=["type"]),
    _builtin("", "configmaps", "ConfigMap", short=["cm"]),
    _builtin("", "serviceaccounts", "ServiceAccount", short=["sa"]),
    _builtin("", "events", "Event", short=["ev"], fields=_EVENT_FIELDS),
    _builtin("events.k8s.io", "events", "Event", short=["ev"]),
    _builtin(
        "apps", "deployments", "Deployment", short=["deploy"], status=True, categories=["all"]
    ),
    _builtin("policy", "poddisruptionbudgets", "PodDisruptionBudget", short=["pdb"], status=True),
    _builtin("rbac.authorization.k8s.io", "roles", "Role"),
    _builtin("rbac.authorization.k8s.io", "rolebindings", "RoleBinding"),
    _builtin("rbac.authorization.k8s.io", "clusterroles", "ClusterRole", namespaced=False),
    _builtin(
        "rbac.authorization.k8s.io", "clusterrolebindings", "ClusterRoleBinding", namespaced=False
    ),
    _builtin("coordination.k8s.io", "leases", "Lease"),
    _builtin("networking.k8s.io", "networkpolicies", "NetworkPolicy", short=["netpol"]),
    _builtin(
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        short=["crd", "crds"],
        status=True,
    ),
    _builtin(
        "admissionregistration.k8s.io",
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        namespaced=False,
    ),
    _builtin(
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        "MutatingWebhookConfiguration",
        namespaced=False,
    ),
)

NAMESPACES_KEY = ("", "v1", "namespaces")
PODS_KEY = ("", "v1", "pods")
CRD_KEY = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
WEBHOOK_KEYS = {
    ("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations"): "validating",
    ("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations"): "mutating",
}


class CRDError(ValueError):
    """A CustomResourceDefinition that the real server would refuse (422)."""


def specs_from_crd(crd: Mapping[str, Any]) -> list[ResourceSpec]:
    """One :class:`ResourceSpec` per served version of a CRD manifest (no conversion)."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural, kind = spec.get("group"), names.get("plural"), names.get("kind")
    if not group or not plural or not kind:
        raise CRDError("spec.group, spec.names.plural and spec.names.kind are required")
    expected = f"{plural}.{group}"
    name = (crd.get("metadata") or {}).get("name")
    if name != expected:
        raise CRDError(
            f"metadata.name: Invalid value: {name!r}: must be spec.names.plural"
            f'+"."+spec.group ({expected!r})'
        )
    scope = spec.get("scope", "Namespaced")
    if scope not in ("Namespaced", "Cluster"):
        raise CRDError(f"spec.scope: Unsupported value: {scope!r}")
    versions = spec.get("versions") or []
    if not versions:
        raise CRDError("spec.versions: Required value")
    result = []
    for version in versions:
        if not version.get("served", True):
            continue
        subresources = version.get("subresources") or {}
        columns = tuple(
            PrinterColumn(
                name=c["name"],
                type=c.get("type", "string"),
                json_path=c["jsonPath"],
                priority=int(c.get("priority", 0)),
                format=c.get("format", ""),
                description=c.get("description", ""),
            )
            for c in version.get("additionalPrinterColumns") or []
        )
        selectable = [s["jsonPath"].lstrip(".") for s in version.get("selectableFields") or []]
        result.append(
            ResourceSpec(
                group=group,
                version=version["name"],
                plural=plural,
                kind=kind,
                namespaced=scope == "Namespaced",
                singular=names.get("singular") or kind.lower(),
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                subresources=frozenset(k for k in subresources if k == "status"),
                custom=True,
                field_selectors=BASE_FIELDS | frozenset(selectable),
                printer_columns=columns,
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
            )
        )
    return result


def crd_manifest(
    *,
    group: str,
    version: str,
    plural: str,
    kind: str,
    namespaced: bool,
    status_subresource: bool,
    singular: str | None,
    short_names: Sequence[str],
    categories: Sequence[str],
    schema: Mapping[str, Any] | None,
    printer_columns: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """A minimal v1 CRD manifest, so that declared resources exist as CRD objects too."""
    version_entry: dict[str, Any] = {
        "name": version,
        "served": True,
        "storage": True,
        "schema": {
            "openAPIV3Schema": dict(schema)
            if schema is not None
            else {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        },
    }
    if status_subresource:
        version_entry["subresources"] = {"status": {}}
    if printer_columns:
        version_entry["additionalPrinterColumns"] = [dict(c) for c in printer_columns]
    names: dict[str, Any] = {
        "plural": plural,
        "singular": singular or kind.lower(),
        "kind": kind,
        "listKind": f"{kind}List",
    }
    if short_names:
        names["shortNames"] = list(short_names)
    if categories:
        names["categories"] = list(categories)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "names": names,
            "scope": "Namespaced" if namespaced else "Cluster",
            "versions": [version_entry],
        },
    }


# --- kubectl's tables ---------------------------------------------------------------------------


def _age(timestamp: str | None, now: datetime.datetime) -> str:
    """Kubernetes' short human duration (``5s``, ``3m12s``, ``2h``, ``4d``)."""
    return human_age(timestamp, now)


_PATH_STEP = re.compile(
    r"""\.(?P<key>[^.\[]+)"""
    r"""|\[(?P<index>-?\d+)\]"""
    r"""|\[\?\(@\.(?P<field>[\w.-]+)\s*==\s*(?P<quote>["'])(?P<value>.*?)(?P=quote)\)\]"""
)


def _json_path(obj: Any, path: str) -> Any:
    """The JSONPaths printer columns use: ``.a.b[0].c`` and filters such as
    ``.status.conditions[?(@.type=="Ready")].status``. Like the real server's table
    convertor, a filter yields its first match; None where nothing matches."""
    text = path.strip()
    node = obj
    at = 0
    while at < len(text):
        step = _PATH_STEP.match(text, at)
        if step is None:
            return None  # a path this printer does not follow: the cell stays empty
        at = step.end()
        if step["key"] is not None:
            if not isinstance(node, Mapping):
                return None
            node = node.get(step["key"])
        elif step["index"] is not None:
            if not isinstance(node, list):
                return None
            try:
                node = node[int(step["index"])]
            except IndexError:
                return None
        else:
            if not isinstance(node, list):
                return None
            node = next(
                (
                    item
                    for item in node
                    if str(_json_path(item, "." + step["field"])) == step["value"]
                ),
                None,
            )
        if node is None:
            return None
    return node


def _pod_row(pod: Mapping[str, Any]) -> list[Any]:
    status = pod.get("status") or {}
    containers = (pod.get("spec") or {}).get("containers") or []
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for s in statuses if s.get("ready"))
    restarts = sum(int(s.get("restartCount", 0)) for s in statuses)
    reason = status.get("phase") or "Pending"
    for s in statuses:
        state = s.get("state") or {}
        if "waiting" in state and state["waiting"].get("reason"):
            reason = state["waiting"]["reason"]
        elif "terminated" in state and state["terminated"].get("reason"):
            reason = state["terminated"]["reason"]
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        reason = "Terminating"
    return [f"{ready}/{len(containers)}", reason, restarts]


def table_columns(spec: ResourceSpec) -> list[dict[str, Any]]:
    """The columnDefinitions of a meta.k8s.io/v1 Table for ``spec``."""
    columns = [
        {
            "name": "Name",
            "type": "string",
            "format": "name",
            "priority": 0,
            "description": "Name of the object",
        }
    ]
    if spec.key == EVENTS_KEY:
        return event_columns()
    if spec.key == PODS_KEY:
        columns += [
            {"name": "Ready", "type": "string", "format": "", "priority": 0, "description": ""},
            {"name": "Status", "type": "string", "format": "", "priority": 0, "description": ""},
            {"name": "Restarts", "type": "integer", "format": "", "priority": 0, "description": ""},
        ]
    elif spec.key == NAMESPACES_KEY:
        columns.append(
            {"name": "Status", "type": "string", "format": "", "priority": 0, "description": ""}
        )
    for column in spec.printer_columns:
        if column.json_path.strip() == ".metadata.creationTimestamp":
            continue  # rendered as Age below, like the real server does
        columns.append(
            {
                "name": column.name,
                "type": column.type,
                "format": column.format,
                "priority": column.priority,
                "description": column.description,
            }
        )
    columns.append(
        {
            "name": "Age",
            "type": "string",
            "format": "",
            "priority": 0,
            "description": "Time since creation",
        }
    )
    if spec.key == PODS_KEY:
        columns += [
            {"name": "IP", "type": "string", "format": "", "priority": 1, "description": ""},
            {"name": "Node", "type": "string", "format": "", "priority": 1, "description": ""},
        ]
    return columns


def table_row(spec: ResourceSpec, obj: Mapping[str, Any], now: datetime.datetime) -> list[Any]:
    if spec.key == EVENTS_KEY:
        return event_row(obj, now)
    meta = obj.get("metadata") or {}
    cells: list[Any] = [meta.get("name", "")]
    if spec.key == PODS_KEY:
        cells += _pod_row(obj)
    elif spec.key == NAMESPACES_KEY:
        cells.append((obj.get("status") or {}).get("phase", "Active"))
    for column in spec.printer_columns:
        if column.json_path.strip() == ".metadata.creationTimestamp":
            continue
        value = _json_path(obj, column.json_path)
        if isinstance(value, (dict, list)):
            value = str(value)
        cells.append(value)
    cells.append(_age(meta.get("creationTimestamp"), now))
    if spec.key == PODS_KEY:
        status = obj.get("status") or {}
        cells += [
            status.get("podIP") or "<none>",
            (obj.get("spec") or {}).get("nodeName") or "<none>",
        ]
    return cells
