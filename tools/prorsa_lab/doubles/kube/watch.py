"""The emulator's watches: a list's resourceVersion replayed, then every change.

A watch replays the change log from its resourceVersion (410 Gone once that version is
compacted away), follows new changes, honours ``timeoutSeconds`` and ends cleanly; kubectl
tables are rendered here too, for watches and lists alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import kmock

from prorsa_lab.doubles.kube.admission import Admission
from prorsa_lab.doubles.kube.errors import ApiError
from prorsa_lab.doubles.kube.label_selectors import FieldSelector, LabelSelector
from prorsa_lab.doubles.kube.request_parts import ApiPath, request_header
from prorsa_lab.doubles.kube.resources import (
    ResourceSpec,
    table_columns,
    table_row,
)
from prorsa_lab.doubles.kube.store import (
    WatchEvent,
    metadata_of,
)


@attrs.define(kw_only=True)
class Watches(Admission):
    """Watch streams over the change log, and kubectl tables."""

    # The connections of the watches being served (for drop_watches).
    _watching: set[asyncio.Transport] = attrs.field(factory=set, init=False)

    def drop_watches(self) -> int:
        """Reset every open watch connection, as an API server that restarts or a load
        balancer that times out idle streams does: clients must notice, list and watch
        again, losing no change (the chaos suite's ``drop-watches`` fault). Safe from any
        thread; returns how many were open."""
        transports = list(self._watching)
        loop = self._loop
        if loop is None or loop.is_closed():
            return 0
        for transport in transports:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(transport.abort)
        return len(transports)

    async def _watch(
        self, spec: ResourceSpec, request: kmock.Request, parsed: ApiPath
    ) -> aiohttp.web.StreamResponse:
        params = request.params
        labels = LabelSelector.parse(params.get("labelSelector"))
        fields = FieldSelector.parse(params.get("fieldSelector"), allowed=spec.field_selectors)
        namespace, name = parsed.namespace, parsed.name

        def matches(obj: Mapping[str, Any]) -> bool:
            meta = metadata_of(obj)
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
        as_table = "as=Table" in (request_header(request, "Accept") or "")

        def line(kind: str, obj: Mapping[str, Any]) -> bytes:
            if as_table:  # kubectl get -w: every event carries a one-row Table
                meta = {"resourceVersion": metadata_of(obj).get("resourceVersion", "")}
                obj = self._table(spec, [obj], meta)
            return json.dumps({"type": kind, "object": obj}).encode() + b"\n"

        await response.prepare(raw)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        transport = raw.transport
        if transport is not None:
            self._watching.add(transport)
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
        finally:
            if transport is not None:
                self._watching.discard(transport)
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
                        "metadata": metadata_of(o),
                    },
                }
                for o in items
            ],
        }
