"""The emulator's storage: objects, resourceVersions, the change log and its wake-ups.

Objects live in kmock's ``objects`` (so ``emulator.objects['v1/pods', 'ns', 'p']``
assertions work), keyed by resource, namespace and name; every write gets the next
resourceVersion and an entry in the change log that watches replay. All state changes
happen under one lock, so any thread may write; watchers in the server's loop are woken
through asyncio objects that only that loop touches.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import datetime
import itertools
import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import attrs
import kmock

from prorsa_lab.doubles.kube.audit import ApiCall
from prorsa_lab.doubles.kube.label_selectors import FieldSelector, LabelSelector
from prorsa_lab.doubles.kube.resources import (
    CRD_KEY,
    WEBHOOK_KEYS,
    ResourceSpec,
)

DEFAULT_TOKEN = "prorsa-emulator-token"


ResourceRef = str | tuple[str, str, str] | kmock.resource | ResourceSpec
"""``'v1/pods'``, ``'pods'``, ``'rc'``, ``('prorsa.io', 'v1alpha1', 'rolloutclusters')``, ..."""


def timestamp_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(slots=True)
class WatchEvent:
    """One write as watchers see it; ``old`` lets selector watches synthesize ADDED/DELETED."""

    rv: int
    key: tuple[str, str, str]
    type: Literal["ADDED", "MODIFIED", "DELETED"]
    obj: dict[str, Any]
    old: dict[str, Any] | None = None
    at: float = field(default_factory=time.monotonic)
    """When it was written (``time.monotonic``): tests time a label against other clocks."""
    _lines: dict[str, bytes] = field(default_factory=dict)

    def line(self, kind: str) -> bytes:
        cached = self._lines.get(kind)
        if cached is None:
            cached = json.dumps({"type": kind, "object": self.obj}).encode() + b"\n"
            self._lines[kind] = cached
        return cached


@dataclass
class Pending:
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


def metadata_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


@attrs.define(kw_only=True)
class Storage(kmock.KubernetesEmulator):
    """Objects by resource, the resourceVersion counter and the change log, under one lock."""

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

    def _register(self, spec: ResourceSpec) -> None:
        self._specs[spec.key] = spec
        self.resources[spec.resource] = spec.info()

    def _unregister(self, spec: ResourceSpec) -> None:
        self._specs.pop(spec.key, None)
        if spec.resource in self.resources:
            del self.resources[spec.resource]

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
            found = self._specs.get(
                (resource.group or "", resource.version or "", resource.plural or "")
            )
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
            if (namespace is None or metadata_of(o).get("namespace") == namespace)
            and (name is None or metadata_of(o).get("name") == name)
            and labels.matches(o)
            and fields.matches(o)
        ]
        found.sort(key=lambda o: (metadata_of(o).get("namespace") or "", metadata_of(o)["name"]))
        return found

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
