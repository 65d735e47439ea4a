"""What a RolloutCluster may ask of the pods the operator creates for it (docs/security.md).

The operator creates engine pods with its own permissions, so whoever may write a
RolloutCluster would otherwise get any pod of the namespace. The spec is bounded instead:

- no privileged container, no capability that amounts to root on the node, no privilege
  escalation, no unmasked ``/proc``;
- no host namespaces (the spec has no field for them; a rendered pod is checked anyway) and
  no ``hostPath`` volume;
- non-root: ``runAsNonRoot`` is never false and ``runAsUser`` never 0, in the pod and in
  the container;
- Secrets only through the references the spec names for their purpose:
  ``engine.imagePullSecrets`` (the kubelet pulls the image with them) and
  ``trainer.tokenSecretRef`` (read by the operator, never mounted). An env var, a volume
  or a projected source of the passthrough fields that names a Secret is refused; the
  engine pods mount only the cluster's own Secrets, which the operator creates.

The checks run three times: on the spec (the pydantic models, hence the operator's
admission, ``prorsa plan`` and the operator before it runs a cluster), as CEL rules of the
CRD (the schema fragments below, so the API server refuses without any webhook), and on
every pod manifest the operator renders, right before it creates it (:func:`pod_violations`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from prorsa_contract.labels import BOOTSTRAP_ANNOTATION, COMPONENT_LABEL, MANAGED_BY

FORBIDDEN_CAPABILITIES = frozenset(
    {"ALL", "SYS_ADMIN", "SYS_MODULE", "SYS_RAWIO", "SYS_PTRACE", "SYS_BOOT", "BPF",
     "DAC_READ_SEARCH"}
)  # fmt: skip
"""Capabilities that amount to root on the node (load modules, raw devices, ptrace any
process, read any file): refused like ``privileged``."""

SECRET_KEYS = frozenset(
    {"secret", "secretName", "secretRef", "secretKeyRef", "nodePublishSecretRef",
     "nodeStageSecretRef", "nodeExpandSecretRef", "controllerPublishSecretRef",
     "controllerExpandSecretRef"}
)  # fmt: skip
"""Keys through which a volume source or an env var names a Secret (``secret`` volumes and
projected sources, ``secretKeyRef``, ``envFrom.secretRef``, CSI and in-tree drivers' refs)."""

RESERVED_LABEL_PREFIXES = ("prorsa.io/", "leaderworkerset.sigs.k8s.io/")
RESERVED_LABELS = frozenset(
    {MANAGED_BY, COMPONENT_LABEL, "app.kubernetes.io/name", "app.kubernetes.io/instance"}
)
"""Labels the operator, the router's selectors and LeaderWorkerSet own on engine pods."""
RESERVED_ANNOTATION_PREFIXES = ("prorsa.io/", "leaderworkerset.sigs.k8s.io/")
RESERVED_ANNOTATIONS = frozenset({BOOTSTRAP_ANNOTATION})

_CAPABILITY = re.compile(r"^(CAP_)?[A-Z0-9_]+$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

Problem = tuple[str, str]
"""(path below the checked object, what is wrong): the caller prefixes its own path."""


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


# -- the checks, each on one Kubernetes object of a pod ------------------------------------------


def pod_security_problems(ctx: Mapping[str, Any]) -> list[Problem]:
    """A PodSecurityContext: non-root."""
    out: list[Problem] = []
    if ctx.get("runAsNonRoot") is False:
        out.append(("runAsNonRoot", "must not be false: engine pods run as non-root"))
    if ctx.get("runAsUser") == 0:
        out.append(("runAsUser", "must not be 0 (root): engine pods run as non-root"))
    return out


def container_security_problems(ctx: Mapping[str, Any]) -> list[Problem]:
    """A container's SecurityContext: not privileged, non-root, no escalation."""
    out = pod_security_problems(ctx)
    if ctx.get("privileged") is True:
        out.append(("privileged", "privileged containers are not allowed"))
    if ctx.get("allowPrivilegeEscalation") is True:
        out.append(("allowPrivilegeEscalation", "must not be true: no privilege escalation"))
    if ctx.get("procMount") not in (None, "Default"):
        out.append(("procMount", "only Default: an unmasked /proc is not allowed"))
    added = (ctx.get("capabilities") or {}).get("add") or []
    for i, cap in enumerate(added):
        name = str(cap)
        if not _CAPABILITY.match(name):
            out.append((f"capabilities.add.{i}", f"{name!r} is not a capability name"))
        elif name.removeprefix("CAP_") in FORBIDDEN_CAPABILITIES:
            out.append(
                (f"capabilities.add.{i}", f"{name} amounts to root on the node: not allowed")
            )
    return out


def _secret_refs(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, the reference) of every key that names a Secret, at any depth."""
    if isinstance(value, Mapping):
        for key, child in value.items():
            here = _join(path, str(key))
            if key in SECRET_KEYS:
                yield here, child
            else:
                yield from _secret_refs(child, here)
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _secret_refs(child, _join(path, str(i)))


def secret_name(ref: Any) -> str | None:
    """The Secret a reference names: ``{secretName}``, ``{name}`` or a plain name."""
    if isinstance(ref, str):
        return ref
    if isinstance(ref, Mapping):
        name = ref.get("secretName", ref.get("name"))
        return name if isinstance(name, str) else None
    return None


def volume_problems(volume: Mapping[str, Any], *, secrets: Collection[str] = ()) -> list[Problem]:
    """A Volume: no hostPath; Secrets only among ``secrets``."""
    out: list[Problem] = []
    if "hostPath" in volume:
        out.append(("hostPath", "hostPath volumes are not allowed"))
    out.extend(_secret_problems(volume, secrets=secrets))
    return out


def env_problems(env: Mapping[str, Any], *, secrets: Collection[str] = ()) -> list[Problem]:
    """An EnvVar (or EnvFromSource): Secrets only among ``secrets``; a ``value`` is a string
    (the schema declares it, the engine-flag rules read it)."""
    out = _secret_problems(env, secrets=secrets)
    if "value" in env and not isinstance(env["value"], str):
        out.append(("value", "must be a string"))
    return out


def _secret_problems(value: Mapping[str, Any], *, secrets: Collection[str]) -> list[Problem]:
    out: list[Problem] = []
    for path, ref in _secret_refs(value):
        name = secret_name(ref)
        if name is None or name not in secrets:
            shown = f"Secret {name!r}" if name else "a Secret"
            out.append(
                (
                    path,
                    f"{shown} is not one the spec names for its purpose: engine pods get "
                    "Secrets only through imagePullSecrets (docs/security.md)",
                )
            )
    return out


def metadata_problems(items: Mapping[str, str], *, labels: bool) -> list[Problem]:
    """Pod labels or annotations the spec adds: valid keys, none the operator owns."""
    out: list[Problem] = []
    reserved, prefixes = (
        (RESERVED_LABELS, RESERVED_LABEL_PREFIXES)
        if labels
        else (RESERVED_ANNOTATIONS, RESERVED_ANNOTATION_PREFIXES)
    )
    for key, value in items.items():
        prefix, slash, name = key.rpartition("/")
        if (
            not name
            or len(name) > 63
            or not _QUALIFIED_NAME.match(name)
            or (slash and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)))
        ):
            out.append((key, "not a valid key ([prefix/]name, name of at most 63 characters)"))
        elif key in reserved or key.startswith(prefixes):
            out.append((key, "reserved: the operator sets it on engine pods"))
        elif labels and (len(value) > 63 or not _LABEL_VALUE.match(value)):
            out.append((key, f"{value!r} is not a valid label value"))
    return out


# -- the rendered pod --------------------------------------------------------------------------


def pod_violations(
    pod: Mapping[str, Any],
    *,
    secrets: Collection[str],
    pull_secrets: Collection[str],
) -> list[str]:
    """Every way a rendered pod manifest breaks the bounds, as ``path: problem``.

    ``secrets`` are the Secrets its volumes and env may name (the cluster's own),
    ``pull_secrets`` those ``imagePullSecrets`` may (the spec's). Run on each pod right
    before it is created: whatever the rendering does, no pod out of bounds is made.
    """
    spec = pod.get("spec") or {}
    out: list[str] = []

    def report(where: str, problems: list[Problem]) -> None:
        out.extend(f"{_join(where, path)}: {message}" for path, message in problems)

    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"spec.{field}: host namespaces are not allowed")
    pod_ctx = spec.get("securityContext") or {}
    report("spec.securityContext", pod_security_problems(pod_ctx))
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(kind) or []):
            where = f"spec.{kind}.{i}"
            ctx = c.get("securityContext") or {}
            report(f"{where}.securityContext", container_security_problems(ctx))
            non_root = ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot"))
            if non_root is not True:
                out.append(f"{where}: runAsNonRoot must be true (pod or container)")
            if ctx.get("allowPrivilegeEscalation") is not False:
                out.append(f"{where}.securityContext.allowPrivilegeEscalation: must be false")
            for j, env in enumerate(c.get("env") or []):
                report(f"{where}.env.{j}", env_problems(env, secrets=secrets))
            for j, env in enumerate(c.get("envFrom") or []):
                report(f"{where}.envFrom.{j}", env_problems(env, secrets=secrets))
    for i, volume in enumerate(spec.get("volumes") or []):
        report(f"spec.volumes.{i}", volume_problems(volume, secrets=secrets))
    for i, ref in enumerate(spec.get("imagePullSecrets") or []):
        name = secret_name(ref)
        if name not in pull_secrets:
            out.append(f"spec.imagePullSecrets.{i}: {name!r} is not in engine.imagePullSecrets")
    return out


# -- the same bounds as CRD schema fragments (CEL), for the API server ---------------------------

_FREE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _forbidden(field: str, message: str) -> dict[str, str]:
    return {
        "rule": f"!has(self.{field})",
        "message": message,
        "fieldPath": f".{field}",
        "reason": "FieldValueForbidden",
    }


_SECRET_MESSAGE = (
    "engine pods get Secrets only through imagePullSecrets and the operator's own "
    "(docs/security.md)"
)

VOLUME_SCHEMA: dict[str, Any] = {
    **_FREE,
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "hostPath": _FREE,
        "secret": _FREE,
        "projected": {
            **_FREE,
            "properties": {
                "sources": {
                    "type": "array",
                    "maxItems": 32,
                    "items": {**_FREE, "properties": {"secret": _FREE}},
                }
            },
        },
        "csi": {**_FREE, "properties": {"nodePublishSecretRef": _FREE}},
    },
    "x-kubernetes-validations": [
        _forbidden("hostPath", "hostPath volumes are not allowed"),
        _forbidden("secret", f"secret volumes are not allowed: {_SECRET_MESSAGE}"),
        {
            "rule": "!has(self.projected) || !has(self.projected.sources) || "
            "self.projected.sources.all(s, !has(s.secret))",
            "message": f"projected Secrets are not allowed: {_SECRET_MESSAGE}",
            "fieldPath": ".projected.sources",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "!has(self.csi) || !has(self.csi.nodePublishSecretRef)",
            "message": f"csi.nodePublishSecretRef is not allowed: {_SECRET_MESSAGE}",
            "fieldPath": ".csi.nodePublishSecretRef",
            "reason": "FieldValueForbidden",
        },
    ],
}
"""A Volume: free-form, with the fields the rules read declared (CEL sees only those)."""

ENV_SCHEMA: dict[str, Any] = {
    **_FREE,
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "value": {"type": "string"},
        "valueFrom": {**_FREE, "properties": {"secretKeyRef": _FREE}},
    },
    "x-kubernetes-validations": [
        {
            "rule": "!has(self.valueFrom) || !has(self.valueFrom.secretKeyRef)",
            "message": f"valueFrom.secretKeyRef is not allowed: {_SECRET_MESSAGE}",
            "fieldPath": ".valueFrom.secretKeyRef",
            "reason": "FieldValueForbidden",
        }
    ],
}

_NON_ROOT_RULES = [
    {
        "rule": "!has(self.runAsNonRoot) || self.runAsNonRoot",
        "message": "runAsNonRoot must not be false: engine pods run as non-root",
        "fieldPath": ".runAsNonRoot",
        "reason": "FieldValueForbidden",
    },
    {
        "rule": "!has(self.runAsUser) || self.runAsUser != 0",
        "message": "runAsUser must not be 0 (root): engine pods run as non-root",
        "fieldPath": ".runAsUser",
        "reason": "FieldValueForbidden",
    },
]

POD_SECURITY_SCHEMA: dict[str, Any] = {
    **_FREE,
    "properties": {"runAsNonRoot": {"type": "boolean"}, "runAsUser": {"type": "integer"}},
    "x-kubernetes-validations": _NON_ROOT_RULES,
}

_CAPABILITY_LIST = ", ".join(
    f"'{prefix}{cap}'" for cap in sorted(FORBIDDEN_CAPABILITIES) for prefix in ("", "CAP_")
)

CONTAINER_SECURITY_SCHEMA: dict[str, Any] = {
    **_FREE,
    "properties": {
        "runAsNonRoot": {"type": "boolean"},
        "runAsUser": {"type": "integer"},
        "privileged": {"type": "boolean"},
        "allowPrivilegeEscalation": {"type": "boolean"},
        "procMount": {"type": "string"},
        "capabilities": {
            **_FREE,
            "properties": {
                "add": {
                    "type": "array",
                    "maxItems": 64,
                    "items": {"type": "string", "pattern": _CAPABILITY.pattern},
                }
            },
        },
    },
    "x-kubernetes-validations": [
        *_NON_ROOT_RULES,
        {
            "rule": "!has(self.privileged) || !self.privileged",
            "message": "privileged containers are not allowed",
            "fieldPath": ".privileged",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "!has(self.allowPrivilegeEscalation) || !self.allowPrivilegeEscalation",
            "message": "allowPrivilegeEscalation must not be true: no privilege escalation",
            "fieldPath": ".allowPrivilegeEscalation",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "!has(self.procMount) || self.procMount == 'Default'",
            "message": "procMount must be Default: an unmasked /proc is not allowed",
            "fieldPath": ".procMount",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "!has(self.capabilities) || !has(self.capabilities.add) || "
            f"self.capabilities.add.all(c, !(c in [{_CAPABILITY_LIST}]))",
            "message": "capabilities.add: "
            + ", ".join(sorted(FORBIDDEN_CAPABILITIES))
            + " amount to root on the node and are not allowed",
            "fieldPath": ".capabilities.add",
            "reason": "FieldValueForbidden",
        },
    ],
}


def _metadata_schema(*, labels: bool) -> dict[str, Any]:
    reserved = RESERVED_LABELS if labels else RESERVED_ANNOTATIONS
    prefixes = RESERVED_LABEL_PREFIXES if labels else RESERVED_ANNOTATION_PREFIXES
    listed = ", ".join(f"'{k}'" for k in sorted(reserved))
    starts = " || ".join(f"k.startsWith('{p}')" for p in prefixes)
    value: dict[str, Any] = {"type": "string"}
    if labels:
        value |= {"maxLength": 63, "pattern": _LABEL_VALUE.pattern}
    return {
        "type": "object",
        "maxProperties": 64,
        "additionalProperties": value,
        "x-kubernetes-validations": [
            {
                "rule": f"self.all(k, !(k in [{listed}]) && !({starts}))",
                "message": "reserved: the operator sets "
                + ", ".join(sorted(reserved))
                + " and every "
                + " or ".join(f"{p}*" for p in prefixes)
                + (" label" if labels else " annotation")
                + " on engine pods",
                "reason": "FieldValueForbidden",
            }
        ],
    }


POD_LABELS_SCHEMA = _metadata_schema(labels=True)
POD_ANNOTATIONS_SCHEMA = _metadata_schema(labels=False)
