"""An in-process Kubernetes API server for tests, CI and ``make demo`` (no cluster needed).

:class:`KubeEmulator` is a subclass of ``kmock.KubernetesEmulator`` (kmock 0.8, by kopf's
author) that fills the gaps listed below (and in docs/testing.md) so that kopf,
the official ``kubernetes`` client and ``kubectl`` behave against it as against a cluster:

* server-filled metadata: namespace from the URL, ``uid``, a ``resourceVersion`` that
  grows on every write, ``creationTimestamp``, a ``generation`` that moves on spec changes
  only, ``generateName``; with a ``status`` subresource the main endpoint keeps the status
  and ``/status`` changes only the status;
* 201 on create, PUT, 409 on duplicates and on stale ``resourceVersion`` s, merge,
  strategic-merge and RFC 6902 JSON patches (``test`` included, 422 when it fails),
  server-side apply (simplified), ``dryRun``;
* label and field selectors, paginated lists, watches that replay from a
  ``resourceVersion`` with nothing lost between a list and the watch, honour
  ``timeoutSeconds`` and end cleanly, 410 Gone once a version is compacted away;
* finalizers and ``deletionTimestamp``, garbage collection through ``ownerReferences``
  (background, foreground and orphan propagation), namespace termination, CRDs that
  register their resource when created through the API, structural pruning, defaulting
  and validation (CEL rules too when ``cel-python`` is installed), validating and mutating
  admission webhooks reached by ``clientConfig.url``;
* ``kubectl`` tables with a CRD's printer columns, and a pod-phase helper in lieu of a
  kubelet.

:class:`KubeEmulatorServer` serves it on 127.0.0.1 (an ephemeral port) and writes a
kubeconfig; ``with`` runs it on a thread of its own, ``async with`` in the current loop.
``python -m prorsa_lab.doubles.kube_emulator`` serves it until interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import copy
import datetime
import itertools
import json
import pathlib
import random
import re
import shutil
import signal
import ssl
import sys
import tempfile
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

import aiohttp
import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import apps, rendering

from prorsa_lab.doubles.kube_audit import ApiCall, api_call
from prorsa_lab.doubles.kube_patch import PatchError, json_patch, merge_patch, strategic_merge_patch
from prorsa_lab.doubles.kube_proto import PROTOBUF, ProtobufError
from prorsa_lab.doubles.kube_proto import decode as decode_protobuf
from prorsa_lab.doubles.kube_resources import (
    BUILTIN_RESOURCES,
    CRD_KEY,
    NAMESPACES_KEY,
    PODS_KEY,
    VERBS,
    WEBHOOK_KEYS,
    CRDError,
    ResourceSpec,
    crd_manifest,
    specs_from_crd,
    table_columns,
    table_row,
)
from prorsa_lab.doubles.kube_schema import FieldIssue, apply_structural_schema, validate
from prorsa_lab.doubles.kube_select import FieldSelector, LabelSelector, SelectorError
from prorsa_lab.doubles.pod_status import kubelet_pod_status

__all__ = [
    "ApiError",
    "KubeEmulator",
    "KubeEmulatorServer",
    "ResourceRef",
    "ResourceSpec",
    "main",
    "write_kubeconfig",
]

DEFAULT_TOKEN = "prorsa-emulator-token"
SYSTEM_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what the real generateName suffix draws from
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
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
# Built-ins whose DELETE answers the deleted object; the others answer a Status once the
# object is gone (custom resources answer the object), as their real registries do.
_DELETE_RETURNS_OBJECT = {("", "v1", "pods"), ("", "v1", "services"), NAMESPACES_KEY}


ResourceRef = str | tuple[str, str, str] | kmock.resource | ResourceSpec
"""``'v1/pods'``, ``'pods'``, ``'rc'``, ``('prorsa.io', 'v1alpha1', 'rolloutclusters')``, ..."""


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """A refusal rendered as a ``kind: Status`` body with the real server's code and reason."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body

    @classmethod
    def not_found(cls, spec: ResourceSpec, name: str) -> ApiError:
        return cls(
            404,
            "NotFound",
            f'{spec.group_resource} "{name}" not found',
            details={"name": name, "group": spec.group, "kind": spec.plural},
        )

    @classmethod
    def conflict(cls, spec: ResourceSpec, name: str, why: str = "") -> ApiError:
        why = why or (
            "the object has been modified; please apply your changes to the latest "
            "version and try again"
        )
        return cls(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {spec.group_resource} "{name}": {why}',
            details={"name": name, "group": spec.group, "kind": spec.plural},
        )

    @classmethod
    def invalid(cls, spec: ResourceSpec, name: str, issues: Sequence[FieldIssue]) -> ApiError:
        kind = f"{spec.kind}.{spec.group}" if spec.group else spec.kind
        texts = [issue.text() for issue in issues]
        joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
        return cls(
            422,
            "Invalid",
            f'{kind} "{name}" is invalid: {joined}',
            details={
                "name": name,
                "group": spec.group,
                "kind": spec.kind,
                "causes": [
                    {"reason": i.reason, "message": i.message, "field": i.field} for i in issues
                ],
            },
        )

    @classmethod
    def bad_request(cls, message: str) -> ApiError:
        return cls(400, "BadRequest", message)


@dataclass(slots=True)
class WatchEvent:
    """One write as watchers see it; ``old`` lets selector watches synthesize ADDED/DELETED."""

    rv: int
    key: tuple[str, str, str]
    type: Literal["ADDED", "MODIFIED", "DELETED"]
    obj: dict[str, Any]
    old: dict[str, Any] | None = None
    _lines: dict[str, bytes] = field(default_factory=dict)

    def line(self, kind: str) -> bytes:
        cached = self._lines.get(kind)
        if cached is None:
            cached = json.dumps({"type": kind, "object": self.obj}).encode() + b"\n"
            self._lines[kind] = cached
        return cached


@dataclass(frozen=True, slots=True)
class _Path:
    group: str
    version: str
    plural: str | None
    namespace: str | None
    name: str | None
    subresource: str | None
    watch: bool


def _parse_path(path: str) -> _Path | None:
    """Parse an API path, including the ``/api/v1/namespaces[/{name}[/status]]`` forms."""
    parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    watch = False
    if rest[:1] == ["watch"]:
        watch, rest = True, rest[1:]
    namespace = None
    if (
        len(rest) >= 3
        and rest[0] == "namespaces"
        and not (len(rest) == 3 and rest[2] in ("status", "finalize"))
    ):
        namespace, rest = rest[1], rest[2:]
    plural = rest[0] if rest else None
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return _Path(group, version, plural, namespace, name, subresource, watch)


class _EmulatorRenders(Exception):
    """Raised by the fallback reactions: no user reaction matched, the emulator answers."""


@dataclass
class _Pending:
    """A write computed against ``base_rv`` (None: the object must not exist yet)."""

    spec: ResourceSpec
    namespace: str | None
    name: str
    operation: Literal["CREATE", "UPDATE"]
    old: dict[str, Any] | None
    new: dict[str, Any]
    base_rv: str | None
    subresource: str | None = None
    noop: bool = False


def _meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with an API server's semantics (see the module doc).

    The state lives in kmock's ``objects`` (so ``emulator.objects['v1/pods', 'ns', 'p']``
    assertions work) and every change goes through one lock, so the helper methods below
    (``create_object``, ``get_object``, ``patch_object``, ``set_pod_status``, ...) are safe
    to call from any thread, including while a server thread serves kopf. (They are not
    named ``get``/``patch``/...: kmock uses those names for its HTTP client shortcuts.)
    kmock reactions still take precedence over the emulator's answers
    (``emulator['get /version'] << {...}``); as in kmock, a write is applied even when a
    reaction answers it.
    """

    namespaces: Sequence[str] = ()
    history_limit: int | None = 100
    request_log_limit: int | None = 10_000
    event_log_limit: int = 50_000
    watch_timeout: float = 1800.0
    pod_startup_seconds: float | None = None
    structural_schemas: bool = True
    admission: bool = True
    # Bearer token -> user name, for the audit log (see add_user and api_calls).
    users: dict[str, str] = attrs.field(factory=lambda: {DEFAULT_TOKEN: "admin"})

    _specs: dict[tuple[str, str, str], ResourceSpec] = attrs.field(factory=dict, init=False)
    _state: threading.RLock = attrs.field(factory=threading.RLock, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _log: collections.deque[WatchEvent] = attrs.field(init=False)
    _evicted_rv: int = attrs.field(default=0, init=False)
    _loop: asyncio.AbstractEventLoop | None = attrs.field(default=None, init=False)
    _loop_thread: int | None = attrs.field(default=None, init=False)
    _changed: asyncio.Event | None = attrs.field(default=None, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _ips: Iterator[int] = attrs.field(factory=lambda: itertools.count(10), init=False)
    _cluster_ips: Iterator[int] = attrs.field(factory=lambda: itertools.count(10), init=False)
    _uids: set[str] = attrs.field(factory=set, init=False)
    _hooks: dict[str, list[dict[str, Any]]] | None = attrs.field(default=None, init=False)
    _own_reactions: int = attrs.field(default=0, init=False)
    _audit: collections.Counter[ApiCall] = attrs.field(factory=collections.Counter, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for probe in ("/healthz", "/livez", "/readyz"):
            self.fallback[f"get {probe}"] << b"ok"
        self._own_reactions = len(self._payloads)
        self._log = collections.deque()
        for spec in BUILTIN_RESOURCES:
            self._register(spec)
        with self._state:
            for name in (*SYSTEM_NAMESPACES, *self.namespaces):
                if self._current(self._specs[NAMESPACES_KEY], None, name) is None:
                    self.create_object("v1/namespaces", {"metadata": {"name": name}})

    # --- resources ------------------------------------------------------------------------

    def _register(self, spec: ResourceSpec) -> None:
        self._specs[spec.key] = spec
        self.resources[spec.resource] = spec.info()

    def _unregister(self, spec: ResourceSpec) -> None:
        self._specs.pop(spec.key, None)
        if spec.resource in self.resources:
            del self.resources[spec.resource]

    def add_custom_resource(
        self,
        *,
        group: str,
        version: str,
        plural: str,
        kind: str,
        namespaced: bool = True,
        status_subresource: bool = True,
        singular: str | None = None,
        short_names: Sequence[str] = (),
        categories: Sequence[str] = (),
        schema: Mapping[str, Any] | None = None,
        printer_columns: Sequence[Mapping[str, Any]] = (),
    ) -> ResourceSpec:
        """Declare a custom resource by creating its CRD (a schema-less one by default)."""
        manifest = crd_manifest(
            group=group,
            version=version,
            plural=plural,
            kind=kind,
            namespaced=namespaced,
            status_subresource=status_subresource,
            singular=singular,
            short_names=short_names,
            categories=categories,
            schema=schema,
            printer_columns=printer_columns,
        )
        self.add_crd(manifest)
        return self._specs[(group, version, plural)]

    def add_crd(self, manifest: Mapping[str, Any]) -> list[ResourceSpec]:
        """Create (or replace) a CustomResourceDefinition, as ``kubectl apply`` would."""
        specs = specs_from_crd(manifest)
        name = _meta(manifest).get("name", "")
        with self._state:
            current = self._current(self._specs[CRD_KEY], None, name)
            if current is None:
                self.create_object(CRD_KEY, manifest)
            else:
                body = copy.deepcopy(dict(manifest))
                body.setdefault("metadata", {})["resourceVersion"] = _meta(current).get(
                    "resourceVersion"
                )
                self.replace_object(CRD_KEY, name, body)
        return specs

    def load_crds(self, source: str | pathlib.Path) -> list[ResourceSpec]:
        """Register every CRD in a YAML file (e.g. ``crds/rolloutcluster.yaml``)."""
        text = pathlib.Path(source).read_text(encoding="utf-8")
        specs: list[ResourceSpec] = []
        for doc in yaml.safe_load_all(text):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                specs += self.add_crd(doc)
        return specs

    def spec_for(self, resource: ResourceRef) -> ResourceSpec:
        """Resolve ``'v1/pods'``, ``'prorsa.io/v1alpha1/rolloutclusters'``, ``'pods'``, ``'rc'``."""
        if isinstance(resource, ResourceSpec):
            return resource
        if isinstance(resource, tuple):
            found = self._specs.get(resource)
            if found is None:
                raise KeyError(f"unknown resource {resource!r}")
            return found
        if isinstance(resource, str) and "/" not in resource and "." not in resource:
            candidates = [s for s in self._specs.values() if s.describes(resource)]
            groups = {s.group for s in candidates}
            if len(candidates) == 1 or (candidates and len(groups) > 1 and "" in groups):
                return next(s for s in candidates if len(candidates) == 1 or s.group == "")
            raise KeyError(f"unknown or ambiguous resource {resource!r}")
        parsed = kmock.resource(resource)
        for spec in self._specs.values():
            if (spec.group, spec.version, spec.plural) == (
                parsed.group or "",
                parsed.version,
                parsed.plural,
            ):
                return spec
        raise KeyError(f"unknown resource {resource!r}")

    @property
    def resource_version(self) -> int:
        """The latest resourceVersion handed out (the list version of a list made now)."""
        return self._rv

    # --- state ----------------------------------------------------------------------------

    def _key(self, spec: ResourceSpec, namespace: str | None, name: str) -> Any:
        return (spec.resource, namespace if spec.namespaced else None, name)

    def _current(
        self, spec: ResourceSpec, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        key = self._key(spec, namespace, name)
        if key not in self._objects:
            return None
        obj = self._objects[key]
        return None if obj.deleted else obj.last.raw

    def _iter(
        self, spec: ResourceSpec | None = None
    ) -> Iterator[tuple[ResourceSpec, dict[str, Any]]]:
        for (resource, _ns, _name), obj in list(self._objects.items()):
            if obj.deleted:
                continue
            found = self._specs.get((resource.group or "", resource.version or "", resource.plural))
            if found is None or (spec is not None and found.key != spec.key):
                continue
            yield found, obj.last.raw

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def writes(self, key: tuple[str, str, str]) -> list[WatchEvent]:
        """Every write of one resource type still in the event log, oldest first: what a
        test reads to see each state an object went through, however briefly."""
        with self._state:
            return [e for e in self._log if e.key == key]

    def _record(self, event: WatchEvent) -> None:
        self._log.append(event)
        while len(self._log) > self.event_log_limit:
            self._evicted_rv = self._log.popleft().rv
        self._wake()

    def _store(self, spec: ResourceSpec, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        meta = obj["metadata"]
        key = self._key(spec, meta.get("namespace"), meta["name"])
        if key not in self._objects:
            self._objects[key] = obj
        elif self._objects[key].deleted:
            self._objects[key].create(obj)
        else:
            self._objects[key].history.append(obj)
        self._uids.add(meta.get("uid", ""))
        if spec.key in WEBHOOK_KEYS:
            self._hooks = None
        history = self._objects[key].history
        if self.history_limit is not None and len(history) > self.history_limit:
            del history[: len(history) - self.history_limit]
        self._record(
            WatchEvent(
                int(meta["resourceVersion"]),
                spec.key,
                "MODIFIED" if old is not None else "ADDED",
                copy.deepcopy(obj),
                old,
            )
        )

    def _remove(self, spec: ResourceSpec, obj: Mapping[str, Any]) -> dict[str, Any]:
        final = copy.deepcopy(dict(obj))
        final["metadata"]["resourceVersion"] = str(self._next_rv())
        meta = final["metadata"]
        self._objects[self._key(spec, meta.get("namespace"), meta["name"])].delete()
        self._uids.discard(meta.get("uid", ""))
        if spec.key in WEBHOOK_KEYS:
            self._hooks = None
        self._record(WatchEvent(self._rv, spec.key, "DELETED", copy.deepcopy(final)))
        if spec.key == CRD_KEY:
            for served in self._crd_specs(final):
                self._unregister(served)
        return final

    def _crd_specs(self, crd: Mapping[str, Any]) -> list[ResourceSpec]:
        spec = crd.get("spec") or {}
        group, plural = spec.get("group"), (spec.get("names") or {}).get("plural")
        return [
            s for s in self._specs.values() if s.custom and (s.group, s.plural) == (group, plural)
        ]

    # --- watch wake-ups (the loop thread only touches asyncio objects) ---------------------

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._loop_thread = threading.get_ident()
            self._changed = asyncio.Event()

    def _swap(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        if event is not None:
            event.set()

    def _wake(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._swap()
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._swap)

    def close_watches(self) -> None:
        """End every open watch stream (cleanly, with the chunked response terminated)."""
        self._closing = True
        self._wake()

    # --- server-side write logic (all under self._state) ----------------------------------

    def _check_metadata(self, spec: ResourceSpec, obj: Mapping[str, Any]) -> None:
        meta = _meta(obj)
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
                raise ApiError.invalid(spec, _meta(obj).get("name", ""), issues)
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
        if _meta(ns).get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f"{spec.group_resource} is forbidden: unable to create new content in "
                f"namespace {namespace} because it is being terminated",
            )

    def _prepare_create(self, spec: ResourceSpec, namespace: str | None, body: Any) -> _Pending:
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
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        if spec.has_status:
            obj.pop("status", None)
        obj = self._defaults_on_create(spec, obj)
        obj = self._apply_schema(spec, obj)
        return _Pending(spec, namespace, name, "CREATE", None, obj, None)

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
        now = _now()
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
    ) -> _Pending:
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
        in_meta = _meta(incoming)
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
        old_meta = _meta(old)
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
            added = set(_meta(new).get("finalizers") or []) - set(old_meta.get("finalizers") or [])
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
        return _Pending(
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
        meta = {k: v for k, v in _meta(obj).items() if k != "resourceVersion"}
        return {**obj, "metadata": meta}

    def _prepare_patch(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        name: str,
        patch: Any,
        content_type: str,
        subresource: str | None,
    ) -> _Pending:
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

    def _commit(self, pending: _Pending) -> dict[str, Any]:
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

    def _base_rv(self, pending: _Pending) -> str | None:
        current = self._current(pending.spec, pending.namespace, pending.name)
        return None if current is None else _meta(current).get("resourceVersion")

    # --- deletion, finalizers, garbage collection -----------------------------------------

    def _removable(self, spec: ResourceSpec, obj: Mapping[str, Any]) -> bool:
        """Whether a deleting object may go now: no finalizers, and nothing left inside."""
        if _meta(obj).get("finalizers"):
            return False
        if spec.key == NAMESPACES_KEY:
            name = _meta(obj)["name"]
            return not any(
                s.namespaced and _meta(o).get("namespace") == name for s, o in self._iter()
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
        meta["deletionTimestamp"] = _now()
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
        meta = _meta(obj)
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
            refs = _meta(obj).get("ownerReferences") or []
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
        uids = {_meta(o).get("uid") for _, o in objects}
        self._uids = {u for u in uids if u}
        for spec, obj in objects:
            meta = _meta(obj)
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
                    and _meta(o).get("namespace") == meta["name"]
                    and not _meta(o).get("deletionTimestamp")
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
                    if s.key in kinds and not _meta(o).get("deletionTimestamp")
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
                        r.get("uid") == meta["uid"] for r in _meta(o).get("ownerReferences") or []
                    )
                ]
                waiting = [(s, o) for s, o in dependents if not _meta(o).get("deletionTimestamp")]
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
        meta = _meta(obj)
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

    # --- pods (no kubelet: tests and the demo move pods along) ----------------------------

    def _schedule_pod_start(self, pod: Mapping[str, Any]) -> None:
        delay, loop = self.pod_startup_seconds, self._loop
        if delay is None or loop is None or loop.is_closed():
            return
        meta = _meta(pod)
        args = (meta["namespace"], meta["name"], meta["uid"])

        def later() -> None:
            loop.call_later(delay, self._auto_start, *args)

        if threading.get_ident() == self._loop_thread:
            later()
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(later)

    def _auto_start(self, namespace: str, name: str, uid: str) -> None:
        with self._state:
            pod = self._current(self._specs[PODS_KEY], namespace, name)
            if pod is None or _meta(pod).get("uid") != uid or _meta(pod).get("deletionTimestamp"):
                return
            if (pod.get("status") or {}).get("phase") != "Pending":
                return
            self.set_pod_status(namespace, name, phase="Running")

    def set_pod_status(
        self,
        namespace: str,
        name: str,
        *,
        phase: Literal["Pending", "Running", "Succeeded", "Failed", "Unknown"] = "Running",
        ready: bool | None = None,
        pod_ip: str | None = None,
        restarts: int = 0,
        reason: str | None = None,
        message: str | None = None,
    ) -> dict[str, Any]:
        """Write a pod's status as a kubelet would (conditions, container statuses, IP).

        ``ready`` defaults to ``phase == 'Running'``. The pod keeps its IP across calls
        unless ``pod_ip`` is given; a fresh one comes from 10.244.0.0/16.
        """
        spec = self._specs[PODS_KEY]
        with self._state:
            pod = self._current(spec, namespace, name)
            if pod is None:
                raise ApiError.not_found(spec, name)
            ip = pod_ip or (pod.get("status") or {}).get("podIP")
            if ip is None and phase != "Pending":
                n = next(self._ips)
                ip = f"10.244.{n // 250}.{n % 250 + 1}"
            status = kubelet_pod_status(
                pod,
                phase=phase,
                now=_now(),
                ready=ready,
                ip=ip,
                restarts=restarts,
                reason=reason,
                message=message,
            )
            body = {**pod, "status": status}
            return self.replace_object(spec, name, body, namespace=namespace, subresource="status")

    # --- the Python API (synchronous, thread-safe; no admission webhooks) -----------------

    def create_object(
        self,
        resource: ResourceRef,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
    ) -> dict[str, Any]:
        """Create as a POST would (metadata filled, events emitted); returns the object."""
        spec = self.spec_for(resource)
        with self._state:
            ns = namespace or (_meta(body).get("namespace") if spec.namespaced else None)
            return self._commit(self._prepare_create(spec, ns, dict(body)))

    def replace_object(
        self,
        resource: ResourceRef,
        name: str,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """Replace as a PUT would (409 on a stale ``metadata.resourceVersion``)."""
        spec = self.spec_for(resource)
        with self._state:
            old = self._current(spec, namespace, name)
            if old is None:
                raise ApiError.not_found(spec, name)
            return self._commit(
                self._merge_update(
                    spec, namespace, name, old, dict(body), subresource, require_rv=True
                )
            )

    def patch_object(
        self,
        resource: ResourceRef,
        name: str,
        patch: Any,
        *,
        namespace: str | None = None,
        subresource: str | None = None,
        content_type: str = MERGE_PATCH,
    ) -> dict[str, Any]:
        """Patch as a PATCH would; ``content_type`` picks merge, strategic or JSON patch."""
        spec = self.spec_for(resource)
        with self._state:
            return self._commit(
                self._prepare_patch(spec, namespace, name, patch, content_type, subresource)
            )

    def delete_object(
        self,
        resource: ResourceRef,
        name: str,
        *,
        namespace: str | None = None,
        propagation_policy: str = "Background",
    ) -> dict[str, Any]:
        """Delete as a DELETE would: finalizers hold it, dependents are collected."""
        spec = self.spec_for(resource)
        with self._state:
            return self._delete(spec, namespace, name, {"propagationPolicy": propagation_policy})[0]

    def get_object(
        self, resource: ResourceRef, name: str, *, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The stored object (a copy), or None."""
        spec = self.spec_for(resource)
        with self._state:
            obj = self._current(spec, namespace, name)
            return None if obj is None else copy.deepcopy(obj)

    def list_objects(
        self,
        resource: ResourceRef,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        """Stored objects (copies) sorted by namespace and name, filtered like a LIST."""
        spec = self.spec_for(resource)
        labels = LabelSelector.parse(label_selector)
        fields = FieldSelector.parse(field_selector, allowed=spec.field_selectors)
        with self._state:
            return [copy.deepcopy(o) for o in self._select(spec, namespace, None, labels, fields)]

    def _select(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        name: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
    ) -> list[dict[str, Any]]:
        found = [
            o
            for _, o in self._iter(spec)
            if (namespace is None or _meta(o).get("namespace") == namespace)
            and (name is None or _meta(o).get("name") == name)
            and labels.matches(o)
            and fields.matches(o)
        ]
        found.sort(key=lambda o: (_meta(o).get("namespace") or "", _meta(o)["name"]))
        return found

    # --- HTTP -----------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """kmock's entry point, with a request parser that knows ``/api/v1/namespaces``.

        kmock 0.8 fails to parse that path (and ``/api/v1/namespaces/{name}``) before any
        handler runs, so the parsing step is redone here; the rest mirrors kmock: requests
        are recorded, errors of the handler are collected in ``errors`` and answered 500.
        """
        await raw_request.read()
        raw_response: aiohttp.web.StreamResponse | None = None
        try:
            if self.limit is not None and len(self._requests) >= self.limit:
                raise kmock.KMockError("Too many requests have been served so far.")
            request = await self._parse_request(raw_request, id=len(self._requests))
            self._requests.append(request)
            self._audit_request(raw_request)
            try:
                return await self._handle(request)
            except rendering.StreamingError as exc:
                raw_response = exc.args[0]
                raise (exc.__cause__ or exc) from None
        except Exception as exc:
            if not self._errors:
                raise
            self._errors[-1].append(exc)
            if raw_response is None or not raw_response.prepared:
                return await self._render_error(exc)
            await self._stream_error(exc, raw_response)
            await raw_response.write_eof()
            return raw_response

    @staticmethod
    async def _parse_request(raw_request: aiohttp.web.BaseRequest, *, id: int) -> rendering.Request:
        parsed = _parse_path(raw_request.path)
        if parsed is None or parsed.plural is None:  # discovery and non-API paths
            return await rendering.Request._parse(raw_request, id=id)
        body = await raw_request.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        method = raw_request.method.upper()
        watch = parsed.watch or raw_request.query.get("watch") in ("true", "1")
        action: kmock.action | None
        if watch and method == "GET":
            action = kmock.action.WATCH
        elif parsed.name is None:
            action = {
                "GET": kmock.action.LIST,
                "POST": kmock.action.CREATE,
                "DELETE": kmock.action.DELETE,
            }.get(method)
        else:
            action = {
                "GET": kmock.action.FETCH,
                "PATCH": kmock.action.UPDATE,
                "PUT": kmock.action.UPDATE,
                "DELETE": kmock.action.DELETE,
            }.get(method)
        return rendering.Request(
            id=id,
            raw_request=raw_request,
            url=raw_request.url,
            method=method,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            cookies=dict(raw_request.cookies),
            data=data,
            body=body,
            text=body.decode("utf-8", errors="replace"),
            action=action,
            resource=kmock.resource(
                group=parsed.group, version=parsed.version, plural=parsed.plural
            ),
            namespace=parsed.namespace,
            name=parsed.name,
            subresource=parsed.subresource,
        )

    # --- the audit log -------------------------------------------------------------------

    def add_user(self, name: str) -> str:
        """A new bearer token that the audit log attributes to user ``name``."""
        token = f"{name}-{uuid.uuid4().hex}"
        with self._state:
            self.users[token] = name
        return token

    def api_calls(self, user: str | None = None) -> collections.Counter[ApiCall]:
        """How often each (user, verb, group, resource, namespace) was requested so far;
        unlike kmock's request log it is never trimmed."""
        with self._state:
            return collections.Counter(
                {c: n for c, n in self._audit.items() if user is None or c.user == user}
            )

    def _audit_request(self, raw: aiohttp.web.BaseRequest) -> None:
        call = api_call(
            method=raw.method,
            path=raw.path,
            query=dict(raw.query),
            authorization=raw.headers.get("Authorization"),
            users=self.users,
        )
        if call is not None:
            with self._state:
                self._audit[call] += 1

    def _trim_request_log(self) -> None:
        limit = self.request_log_limit
        if limit is not None and len(self._requests) > limit:
            del self._requests[: len(self._requests) - limit]

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self._bind_loop()
        self._trim_request_log()
        parsed = _parse_path(request.url.path)
        # kmock matches reactions by scanning every recorded request, which makes each request
        # cost O(requests so far); without user reactions the emulator answers directly.
        reactions = len(self._payloads) > self._own_reactions
        if parsed is None or parsed.plural is None:
            try:
                if not reactions:
                    served = await self._serve_discovery(request)
                    if served is not None:
                        return served
                return await apps.RawHandler._handle(self, request)
            except kmock.KubernetesError as exc:  # e.g. 404 for /openapi/v2: not an emulator bug
                error = ApiError(exc.status, exc.reason or "NotFound", exc.message or "")
                return aiohttp.web.json_response(error.status(), status=exc.status)
        try:
            spec = self._specs.get((parsed.group, parsed.version, parsed.plural))
            outcome: tuple[int, Any] | None = None
            if spec is not None and request.action in (
                kmock.action.CREATE,
                kmock.action.UPDATE,
                kmock.action.DELETE,
            ):
                outcome = await self._write(spec, request, parsed)
            if reactions:
                try:
                    return await apps.RawHandler._handle(self, request)
                except (_EmulatorRenders, kmock.KubernetesEndpointNotFoundError):
                    pass
            if spec is None:
                raise ApiError(
                    404,
                    "NotFound",
                    "the server could not find the requested "
                    f"resource ({parsed.group}/{parsed.version}/{parsed.plural})",
                )
            if outcome is not None:
                return aiohttp.web.json_response(outcome[1], status=outcome[0])
            if request.action == kmock.action.WATCH:
                return await self._watch(spec, request, parsed)
            if request.action == kmock.action.LIST:
                return self._list_response(spec, request, parsed)
            if request.action == kmock.action.FETCH:
                return self._fetch_response(spec, request, parsed)
            raise ApiError(
                405,
                "MethodNotAllowed",
                f"the server does not allow this method on the requested resource "
                f"({request.method} {request.url.path})",
            )
        except ApiError as exc:
            return aiohttp.web.json_response(exc.status(), status=exc.code)
        except SelectorError as exc:
            return aiohttp.web.json_response(ApiError.bad_request(str(exc)).status(), status=400)

    async def _serve_discovery(
        self, request: rendering.Request
    ) -> aiohttp.web.StreamResponse | None:
        """Answer the discovery endpoints without kmock's reaction matching (None: not one)."""
        if request.method != "GET":
            return None
        parts = [p for p in request.url.path.split("/") if p]
        if parts in (["healthz"], ["livez"], ["readyz"]):
            return aiohttp.web.Response(text="ok")
        payload: rendering.Payload
        if parts == ["version"]:
            payload = await self._serve_server_version(request)
        elif parts == ["api"]:
            payload = await self._serve_api(request)
        elif parts == ["apis"]:
            payload = await self._serve_apis(request)
        elif len(parts) == 2 and parts[0] == "apis":
            payload = await self._serve_group(request)
        elif (len(parts) == 2 and parts[0] == "api") or (len(parts) == 3 and parts[0] == "apis"):
            payload = await self._serve_version(request)
        else:
            return None
        return aiohttp.web.json_response(payload)

    # The fallback reactions kmock registers: reaching one means no user reaction answered.
    def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        raise _EmulatorRenders

    def _serve_watch(self, request: rendering.Request) -> rendering.Payload:  # type: ignore[override]
        raise _EmulatorRenders

    def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        raise _EmulatorRenders

    def _serve_create(self, request: rendering.Request) -> rendering.Payload:
        raise _EmulatorRenders

    def _serve_update(self, request: rendering.Request) -> rendering.Payload:
        raise _EmulatorRenders

    def _serve_delete(self, request: rendering.Request) -> rendering.Payload:
        raise _EmulatorRenders

    def _groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        with self._state:
            specs = list(self._specs.values())
        for spec in specs:
            versions = groups.setdefault(spec.group, [])
            if spec.version not in versions:
                versions.append(spec.version)
        return groups

    @staticmethod
    def _group_entry(group: str, versions: Sequence[str]) -> dict[str, Any]:
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": entries, "preferredVersion": entries[0]}

    async def _serve_api(self, request: rendering.Request) -> rendering.Payload:
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": request.url.host or "127.0.0.1"}
            ],
        }

    async def _serve_apis(self, request: rendering.Request) -> rendering.Payload:
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [self._group_entry(g, vs) for g, vs in sorted(self._groups().items()) if g],
        }

    async def _serve_group(self, request: rendering.Request) -> rendering.Payload:
        group = request.url.path.strip("/").split("/")[1]
        versions = self._groups().get(group)
        if not versions or not group:
            raise kmock.KubernetesResourceNotFoundError()
        return {"kind": "APIGroup", "apiVersion": "v1", **self._group_entry(group, versions)}

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        parts = request.url.path.strip("/").split("/")
        group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2])
        with self._state:
            specs = [s for s in self._specs.values() if (s.group, s.version) == (group, version)]
        if not specs:
            raise kmock.KubernetesResourceNotFoundError()
        resources: list[dict[str, Any]] = []
        for spec in sorted(specs, key=lambda s: s.plural):
            resources.append(
                {
                    "name": spec.plural,
                    "singularName": spec.singular or spec.kind.lower(),
                    "namespaced": spec.namespaced,
                    "kind": spec.kind,
                    "verbs": list(VERBS),
                    "shortNames": list(spec.short_names),
                    "categories": list(spec.categories),
                }
            )
            for sub in sorted(spec.subresources):
                resources.append(
                    {
                        "name": f"{spec.plural}/{sub}",
                        "singularName": "",
                        "namespaced": spec.namespaced,
                        "kind": spec.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }

    async def _serve_server_version(self, request: rendering.Request) -> rendering.Payload:
        return {
            "major": "1",
            "minor": "32",
            "gitVersion": "v1.32.0-prorsa-emulator",
            "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean",
            "buildDate": "2025-01-01T00:00:00Z",
            "goVersion": "go1.23",
            "compiler": "gc",
            "platform": "linux/amd64",
        }

    @staticmethod
    def _body(request: rendering.Request, content_type: str) -> Any:
        if not request.body:
            return None
        if content_type == PROTOBUF:
            try:
                return decode_protobuf(request.body)
            except ProtobufError as exc:
                raise ApiError(415, "UnsupportedMediaType", f"{exc}: send JSON") from None
        if "json" not in content_type and "yaml" not in content_type:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the emulator does not decode {content_type!r}: send JSON or YAML",
            )
        try:
            if "yaml" in content_type:
                return yaml.safe_load(request.body)
            return json.loads(request.body)
        except (ValueError, yaml.YAMLError) as exc:
            raise ApiError.bad_request(f"the body could not be decoded: {exc}") from None

    async def _write(
        self, spec: ResourceSpec, request: rendering.Request, parsed: _Path
    ) -> tuple[int, Any]:
        content_type = (_header(request, "Content-Type") or "application/json").split(";")[0]
        content_type = content_type.strip().lower()
        dry_run = request.params.get("dryRun") == "All"
        ns, name, sub = parsed.namespace, parsed.name, parsed.subresource
        body = self._body(request, content_type)
        method = request.method
        if request.action == kmock.action.DELETE:
            if sub is not None:
                raise ApiError(405, "MethodNotAllowed", f"DELETE is not allowed on {sub}")
            options = dict(body) if isinstance(body, dict) else {}
            dry_run = dry_run or options.get("dryRun") == ["All"]
            for param in ("propagationPolicy", "gracePeriodSeconds"):
                if param in request.params:
                    options[param] = request.params[param]
            if name is None:
                return self._delete_collection(spec, request, ns, options, dry_run=dry_run)
            with self._state:
                result, gone = self._delete(spec, ns, name, options, dry_run=dry_run)
            if gone and not spec.custom and spec.key not in _DELETE_RETURNS_OBJECT:
                return 200, {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Success",
                    "details": {
                        "name": name,
                        "group": spec.group,
                        "kind": spec.plural,
                        "uid": _meta(result).get("uid"),
                    },
                }
            return 200, result
        for _attempt in range(20):
            with self._state:
                if request.action == kmock.action.CREATE:
                    if sub is not None:
                        raise ApiError(405, "MethodNotAllowed", "POST is not allowed here")
                    pending = self._prepare_create(spec, ns, body)
                elif method == "PUT":
                    old = self._current(spec, ns, name or "")
                    if old is None:
                        raise ApiError.not_found(spec, name or "")
                    pending = self._merge_update(
                        spec, ns, name or "", old, body, sub, require_rv=True
                    )
                else:
                    pending = self._prepare_patch(spec, ns, name or "", body, content_type, sub)
                if pending.noop or dry_run:
                    return (201 if pending.operation == "CREATE" else 200), pending.new
            if self.admission:
                await self._admit(pending, request, dry_run=dry_run)
            with self._state:
                if self._base_rv(pending) != pending.base_rv:
                    continue  # something else wrote meanwhile: recompute, as the server does
                result = self._commit(pending)
            return (201 if pending.operation == "CREATE" else 200), result
        raise ApiError.conflict(spec, name or "")

    def _delete_collection(
        self,
        spec: ResourceSpec,
        request: rendering.Request,
        namespace: str | None,
        options: Mapping[str, Any],
        *,
        dry_run: bool,
    ) -> tuple[int, Any]:
        labels = LabelSelector.parse(request.params.get("labelSelector"))
        fields = FieldSelector.parse(
            request.params.get("fieldSelector"), allowed=spec.field_selectors
        )
        with self._state:
            items = []
            for obj in self._select(spec, namespace, None, labels, fields):
                meta = _meta(obj)
                if self._current(spec, meta.get("namespace"), meta["name"]) is None:
                    continue  # collected by an earlier deletion's garbage collection
                items.append(
                    self._delete(
                        spec, meta.get("namespace"), meta["name"], options, dry_run=dry_run
                    )[0]
                )
            return 200, {
                "kind": spec.list_kind,
                "apiVersion": spec.api_version,
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }

    def _fetch_response(
        self, spec: ResourceSpec, request: rendering.Request, parsed: _Path
    ) -> aiohttp.web.StreamResponse:
        if parsed.subresource not in (None, "status") or (
            parsed.subresource == "status" and not spec.has_status
        ):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        with self._state:
            obj = self._current(spec, parsed.namespace, parsed.name or "")
            if obj is None:
                raise ApiError.not_found(spec, parsed.name or "")
        if "as=Table" in (_header(request, "Accept") or ""):
            return aiohttp.web.json_response(self._table(spec, [obj], {}))
        return aiohttp.web.json_response(obj)

    @staticmethod
    def _table(
        spec: ResourceSpec, items: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]
    ) -> dict[str, Any]:
        """A meta.k8s.io/v1 Table, which ``kubectl get`` asks for to print its columns."""
        now = datetime.datetime.now(datetime.UTC)
        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": dict(meta),
            "columnDefinitions": table_columns(spec),
            "rows": [
                {
                    "cells": table_row(spec, o, now),
                    "object": {
                        "kind": "PartialObjectMetadata",
                        "apiVersion": "meta.k8s.io/v1",
                        "metadata": _meta(o),
                    },
                }
                for o in items
            ],
        }

    def _list_response(
        self, spec: ResourceSpec, request: rendering.Request, parsed: _Path
    ) -> aiohttp.web.StreamResponse:
        labels = LabelSelector.parse(request.params.get("labelSelector"))
        fields = FieldSelector.parse(
            request.params.get("fieldSelector"), allowed=spec.field_selectors
        )
        token = request.params.get("continue")
        with self._state:
            rv = self._rv
            items = self._select(spec, parsed.namespace, None, labels, fields)
        after: tuple[str, str] | None = None
        if token:
            try:
                decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
                rv, after = int(decoded["rv"]), (decoded["ns"], decoded["name"])
            except (ValueError, KeyError, TypeError):
                raise ApiError.bad_request("invalid continue token") from None
            items = [
                o for o in items if ((_meta(o).get("namespace") or ""), _meta(o)["name"]) > after
            ]
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        limit = request.params.get("limit")
        if limit and limit.isdigit() and int(limit) > 0 and len(items) > int(limit):
            rest = len(items) - int(limit)
            items = items[: int(limit)]
            last = _meta(items[-1])
            meta["continue"] = base64.urlsafe_b64encode(
                json.dumps(
                    {"rv": rv, "ns": last.get("namespace") or "", "name": last["name"]}
                ).encode()
            ).decode()
            meta["remainingItemCount"] = rest
        if "as=Table" in (_header(request, "Accept") or ""):
            return aiohttp.web.json_response(self._table(spec, items, meta))
        return aiohttp.web.json_response(
            {
                "kind": spec.list_kind,
                "apiVersion": spec.api_version,
                "metadata": meta,
                "items": items,
            }
        )

    async def _watch(
        self, spec: ResourceSpec, request: rendering.Request, parsed: _Path
    ) -> aiohttp.web.StreamResponse:
        params = request.params
        labels = LabelSelector.parse(params.get("labelSelector"))
        fields = FieldSelector.parse(params.get("fieldSelector"), allowed=spec.field_selectors)
        namespace, name = parsed.namespace, parsed.name

        def matches(obj: Mapping[str, Any]) -> bool:
            meta = _meta(obj)
            return (
                (namespace is None or meta.get("namespace") == namespace)
                and (name is None or meta.get("name") == name)
                and labels.matches(obj)
                and fields.matches(obj)
            )

        try:
            timeout = float(params.get("timeoutSeconds") or self.watch_timeout)
        except ValueError:
            raise ApiError.bad_request("timeoutSeconds must be a number") from None
        since_text = params.get("resourceVersion") or ""
        initial_events = params.get("sendInitialEvents") == "true"
        with self._state:
            if since_text in ("", "0") or initial_events:
                since = self._rv
                initial = self._select(spec, namespace, name, labels, fields)
            else:
                try:
                    since = int(since_text)
                except ValueError:
                    raise ApiError.bad_request(f"invalid resourceVersion {since_text!r}") from None
                initial = []
        response = aiohttp.web.StreamResponse(
            status=200, headers={"Content-Type": "application/json"}
        )
        raw = request._raw_request
        assert raw is not None
        as_table = "as=Table" in (_header(request, "Accept") or "")

        def line(kind: str, obj: Mapping[str, Any]) -> bytes:
            if as_table:  # kubectl get -w: every event carries a one-row Table
                meta = {"resourceVersion": _meta(obj).get("resourceVersion", "")}
                obj = self._table(spec, [obj], meta)
            return json.dumps({"type": kind, "object": obj}).encode() + b"\n"

        await response.prepare(raw)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            for obj in initial:
                await response.write(line("ADDED", obj))
            if initial_events:
                bookmark = {
                    "kind": spec.kind,
                    "apiVersion": spec.api_version,
                    "metadata": {
                        "resourceVersion": str(since),
                        "annotations": {"k8s.io/initial-events-end": "true"},
                    },
                }
                await response.write(
                    json.dumps({"type": "BOOKMARK", "object": bookmark}).encode() + b"\n"
                )
            position = since
            while True:
                with self._state:
                    expired = position < self._evicted_rv
                    events = (
                        []
                        if expired
                        else [e for e in self._events_after(position) if e.key == spec.key]
                    )
                    if not expired and self._log:
                        position = max(position, self._log[-1].rv)
                    waiter = self._changed
                if expired:
                    gone = ApiError(
                        410,
                        "Expired",
                        f"too old resource version: {since_text} ({self._evicted_rv + 1})",
                    )
                    await response.write(
                        json.dumps({"type": "ERROR", "object": gone.status()}).encode() + b"\n"
                    )
                    break
                for event in events:
                    kind = self._view(event, matches)
                    if kind is not None:
                        await response.write(
                            line(kind, event.obj) if as_table else event.line(kind)
                        )
                remaining = deadline - loop.time()
                if self._closing or remaining <= 0:
                    break
                if raw.transport is None or raw.transport.is_closing():
                    return response
                if not events and waiter is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(waiter.wait(), timeout=min(remaining, 1.0))
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass
        return response

    def _events_after(self, rv: int) -> list[WatchEvent]:
        newer: list[WatchEvent] = []
        for event in reversed(self._log):
            if event.rv <= rv:
                break
            newer.append(event)
        newer.reverse()
        return newer

    @staticmethod
    def _view(event: WatchEvent, matches: Callable[[Mapping[str, Any]], bool]) -> str | None:
        """The event type a filtered watcher sees (an object leaving the filter: DELETED)."""
        now = matches(event.obj)
        if event.type == "MODIFIED" and event.old is not None:
            was = matches(event.old)
            if was and now:
                return "MODIFIED"
            if now:
                return "ADDED"
            return "DELETED" if was else None
        return event.type if now else None

    # --- admission webhooks ---------------------------------------------------------------

    def _webhooks(self, kind: str) -> list[dict[str, Any]]:
        if self._hooks is None:
            hooks: dict[str, list[dict[str, Any]]] = {"mutating": [], "validating": []}
            for key, flavour in WEBHOOK_KEYS.items():
                for _, config in self._iter(self._specs[key]):
                    hooks[flavour] += [copy.deepcopy(w) for w in config.get("webhooks") or []]
            self._hooks = hooks
        return self._hooks[kind]

    def _hook_matches(self, hook: Mapping[str, Any], pending: _Pending) -> bool:
        spec = pending.spec
        for rule in hook.get("rules") or []:
            ops = rule.get("operations") or []
            if "*" not in ops and pending.operation not in ops:
                continue
            if not _glob_in(spec.group, rule.get("apiGroups")):
                continue
            if not _glob_in(spec.version, rule.get("apiVersions")):
                continue
            wanted = spec.plural + (f"/{pending.subresource}" if pending.subresource else "")
            resources = rule.get("resources") or []
            if not any(
                r in ("*", "*/*", wanted) or (r == f"{spec.plural}/*" and pending.subresource)
                for r in resources
            ):
                continue
            scope = rule.get("scope", "*")
            if scope == "Namespaced" and not spec.namespaced:
                continue
            if scope == "Cluster" and spec.namespaced:
                continue
            break
        else:
            return False
        selector = hook.get("objectSelector")
        if selector and not LabelSelector.from_dict(selector).matches(pending.new):
            return False
        selector = hook.get("namespaceSelector")
        if selector and spec.namespaced and pending.namespace:
            ns = self._current(self._specs[NAMESPACES_KEY], None, pending.namespace) or {}
            if not LabelSelector.from_dict(selector).matches(ns):
                return False
        return True

    async def _admit(self, pending: _Pending, request: rendering.Request, *, dry_run: bool) -> None:
        """Call the mutating, then the validating webhooks (``clientConfig.url`` only)."""
        for flavour in ("mutating", "validating"):
            with self._state:
                hooks = [h for h in self._webhooks(flavour) if self._hook_matches(h, pending)]
            for hook in hooks:
                await self._call_webhook(hook, pending, flavour, dry_run=dry_run)

    async def _call_webhook(
        self, hook: Mapping[str, Any], pending: _Pending, flavour: str, *, dry_run: bool
    ) -> None:
        spec = pending.spec
        client_config = hook.get("clientConfig") or {}
        url = client_config.get("url")
        fail_closed = hook.get("failurePolicy", "Fail") == "Fail"
        review_uid = str(uuid.uuid4())
        gvk = {"group": spec.group, "version": spec.version, "kind": spec.kind}
        gvr = {"group": spec.group, "version": spec.version, "resource": spec.plural}
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": review_uid,
                "kind": gvk,
                "resource": gvr,
                "requestKind": gvk,
                "requestResource": gvr,
                "subResource": pending.subresource,
                "name": pending.name,
                "namespace": pending.namespace,
                "operation": pending.operation,
                "userInfo": {"username": "emulator-user", "groups": ["system:authenticated"]},
                "object": pending.new,
                "oldObject": pending.old,
                "dryRun": dry_run,
                "options": {
                    "kind": f"{pending.operation.title()}Options",
                    "apiVersion": "meta.k8s.io/v1",
                },
            },
        }
        denial = f'admission webhook "{hook.get("name")}" denied the request'
        try:
            if not url:
                raise ValueError("only clientConfig.url webhooks can be reached from the emulator")
            ssl_context: ssl.SSLContext | bool = False
            if url.startswith("https://"):
                ca = client_config.get("caBundle")
                ssl_context = ssl.create_default_context(
                    cadata=base64.b64decode(ca).decode() if ca else None
                )
            timeout = aiohttp.ClientTimeout(total=float(hook.get("timeoutSeconds", 10)))
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(url, json=review, ssl=ssl_context) as reply,
            ):
                reply.raise_for_status()
                answer = (await reply.json()).get("response") or {}
        except (aiohttp.ClientError, TimeoutError, ValueError, ssl.SSLError) as exc:
            if not fail_closed:
                return
            raise ApiError(
                500,
                "InternalError",
                f'Internal error occurred: failed calling webhook "{hook.get("name")}": {exc}',
            ) from None
        if not answer.get("allowed"):
            status = answer.get("status") or {}
            message = status.get("message") or "denied"
            raise ApiError(
                int(status.get("code") or 400),
                status.get("reason") or "BadRequest",
                f"{denial}: {message}",
            )
        patch = answer.get("patch")
        if flavour == "mutating" and patch:
            try:
                ops = json.loads(base64.b64decode(patch))
                mutated = json_patch(pending.new, ops)
            except (ValueError, PatchError) as exc:
                raise ApiError(
                    500, "InternalError", f'webhook "{hook.get("name")}" sent a bad patch: {exc}'
                ) from None
            with self._state:
                if pending.old is None:
                    replanned = mutated
                    replanned["metadata"] = {**pending.new["metadata"], **_meta(mutated)}
                    self._check_metadata(spec, replanned)
                    pending.new = self._apply_schema(spec, replanned)
                else:
                    redo = self._merge_update(
                        spec,
                        pending.namespace,
                        pending.name,
                        pending.old,
                        mutated,
                        pending.subresource,
                        require_rv=False,
                    )
                    pending.new, pending.noop = redo.new, redo.noop

    # --- lifecycle ------------------------------------------------------------------------

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close_watches()
        await super().__aexit__(exc_type, exc_value, traceback)


def _header(request: rendering.Request, name: str) -> str | None:
    """A request header, looked up case-insensitively (kmock keeps them in a plain dict)."""
    raw = request._raw_request
    if raw is not None:
        return raw.headers.get(name)
    wanted = name.lower()
    return next((v for k, v in request.headers.items() if k.lower() == wanted), None)


def _glob_in(value: str, allowed: Iterable[str] | None) -> bool:
    allowed = list(allowed or [])
    return "*" in allowed or value in allowed


# --- kubeconfig and the server ----------------------------------------------------------------


def write_kubeconfig(
    path: str | pathlib.Path,
    *,
    server: str,
    token: str = DEFAULT_TOKEN,
    namespace: str = "default",
    name: str = "prorsa-emulator",
) -> pathlib.Path:
    """Write a kubeconfig for ``server`` (plain http, a bearer token) and return its path."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server}}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [
            {"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}
        ],
        "current-context": name,
        "preferences": {},
    }
    target = pathlib.Path(path)
    target.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return target


class KubeEmulatorServer:
    """Serve a :class:`KubeEmulator` on 127.0.0.1 with a kubeconfig pointing at it.

    ``async with KubeEmulatorServer() as kube:`` serves in the running event loop (then do
    not block that loop, e.g. with the synchronous ``kubernetes`` client; use a thread).
    ``with KubeEmulatorServer() as kube:`` serves from a thread with its own loop, so any
    client (sync or async, kopf's ``KopfRunner`` thread, ``kubectl``) can use it freely.
    """

    def __init__(
        self,
        emulator: KubeEmulator | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        kubeconfig_path: str | pathlib.Path | None = None,
        token: str = DEFAULT_TOKEN,
        namespace: str = "default",
        crds: Iterable[str | pathlib.Path] = (),
    ) -> None:
        self.emulator = emulator if emulator is not None else KubeEmulator()
        self.host, self.port = host, port
        self.token, self.namespace = token, namespace
        self.emulator.users.setdefault(token, "admin")
        self._kubeconfig_arg = pathlib.Path(kubeconfig_path) if kubeconfig_path else None
        self._tmpdir: pathlib.Path | None = None
        self._runner: aiohttp.web.ServerRunner | None = None
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self.kubeconfig_path: pathlib.Path | None = None
        for crd in crds:
            self.emulator.load_crds(crd)

    @property
    def url(self) -> str:
        if self._runner is None:
            raise RuntimeError("the emulator is not serving")
        return f"http://{self.host}:{self.port}"

    async def start(self) -> Self:
        """Serve in the running loop and write the kubeconfig."""
        await self.emulator.__aenter__()
        self.emulator._bind_loop()
        self.emulator._closing = False
        server = aiohttp.web.Server(self.emulator, handler_cancellation=True, access_log=None)
        self._runner = aiohttp.web.ServerRunner(server, shutdown_timeout=1.0)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = site._server.sockets if site._server is not None else ()  # type: ignore[union-attr]
        self.port = sockets[0].getsockname()[1]
        if self._kubeconfig_arg is not None:
            path = self._kubeconfig_arg
        else:
            self._tmpdir = pathlib.Path(tempfile.mkdtemp(prefix="prorsa-kube-"))
            path = self._tmpdir / "kubeconfig"
        self.kubeconfig_path = write_kubeconfig(
            path, server=self.url, token=self.token, namespace=self.namespace
        )
        return self

    def kubeconfig_for(self, user: str, path: str | pathlib.Path) -> pathlib.Path:
        """A kubeconfig at ``path`` whose token the audit log attributes to ``user``."""
        return write_kubeconfig(
            path, server=self.url, token=self.emulator.add_user(user), namespace=self.namespace
        )

    async def stop(self) -> None:
        """End the watches, stop serving, and remove a kubeconfig this server created."""
        self.emulator.close_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.emulator.__aexit__(None, None, None)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    def start_in_thread(self) -> Self:
        """Serve from a daemon thread with its own loop; returns once the port is open."""
        ready: asyncio.Future[None] | None = None
        started = threading.Event()
        failure: list[BaseException] = []

        def target() -> None:
            nonlocal ready
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._thread_loop = loop
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self.stop())
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=target, name="kube-emulator", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return self

    def stop_thread(self) -> None:
        loop, thread = self._thread_loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._thread = self._thread_loop = None

    def __enter__(self) -> Self:
        return self.start_in_thread()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop_thread()

    # --- clients --------------------------------------------------------------------------

    def kopf_connection_info(self) -> Any:
        """For ``@kopf.on.login()``: credentials of this server (kopf is imported lazily)."""
        import kopf

        return kopf.ConnectionInfo(
            server=self.url, scheme="Bearer", token=self.token, default_namespace=self.namespace
        )

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` configured from this server's kubeconfig."""
        return self.client_for(self.kubeconfig_path)

    @staticmethod
    def client_for(kubeconfig_path: str | pathlib.Path | None) -> Any:
        """A ``kubernetes.client.ApiClient`` for a kubeconfig file, read now (not at import)."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(
            config_file=str(kubeconfig_path), client_configuration=configuration
        )
        return client.ApiClient(configuration)


# --- CLI --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prorsa_lab.doubles.kube_emulator``: serve until interrupted, print the
    kubeconfig."""
    parser = argparse.ArgumentParser(
        prog="python -m prorsa_lab.doubles.kube_emulator",
        description=("Serve the in-process Kubernetes API emulator on 127.0.0.1."),
    )
    parser.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    parser.add_argument(
        "--kubeconfig",
        type=pathlib.Path,
        default=None,
        help="where to write the kubeconfig (default: a temporary file)",
    )
    parser.add_argument(
        "--crd",
        action="append",
        default=[],
        type=pathlib.Path,
        help="a CRD manifest file to register (repeatable)",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="a namespace to create at start (repeatable)",
    )
    parser.add_argument(
        "--pod-startup-seconds",
        type=float,
        default=None,
        help="mark new pods Running and Ready after this many seconds",
    )
    args = parser.parse_args(argv)

    async def serve() -> None:
        emulator = KubeEmulator(
            namespaces=args.namespace, pod_startup_seconds=args.pod_startup_seconds
        )
        server = KubeEmulatorServer(
            emulator, port=args.port, kubeconfig_path=args.kubeconfig, crds=args.crd
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(signum, stop.set)
        async with server:
            print(f"serving {server.url}", flush=True)
            print(f"export KUBECONFIG={server.kubeconfig_path}", flush=True)
            await stop.wait()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
