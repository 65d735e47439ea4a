"""The emulator's HTTP side: requests parsed, audited, routed to kmock or the emulator.

kmock reactions still take precedence over the emulator's answers
(``emulator['get /version'] << {...}``); as in kmock, a write is applied even when a
reaction answers it. Discovery, lists, gets and writes are answered as an API server does.

:meth:`HttpApi.throttle` makes the server turn one user's requests away with 429 and a
``Retry-After`` for a while, as API Priority and Fairness does to a flow whose priority
level is saturated; Lease calls pass, as APF's default ``leader-election`` flow schema
gives them a level of their own.
"""

from __future__ import annotations

import base64
import collections
import json
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import kmock
import yaml

from prorsa_lab.doubles.kube.audit import ApiCall, api_call
from prorsa_lab.doubles.kube.errors import ApiError
from prorsa_lab.doubles.kube.label_selectors import FieldSelector, LabelSelector, SelectorError
from prorsa_lab.doubles.kube.proto import PROTOBUF, ProtobufError
from prorsa_lab.doubles.kube.proto import decode as decode_protobuf
from prorsa_lab.doubles.kube.request_parts import ApiPath, parse_api_path, request_header
from prorsa_lab.doubles.kube.resources import (
    NAMESPACES_KEY,
    VERBS,
    ResourceSpec,
)
from prorsa_lab.doubles.kube.store import (
    metadata_of,
)
from prorsa_lab.doubles.kube.watch import Watches


class _EmulatorRenders(Exception):
    """Raised by the fallback reactions: no user reaction matched, the emulator answers."""


# Built-ins whose DELETE answers the deleted object; the others answer a Status once the
# object is gone (custom resources answer the object), as their real registries do.
_DELETE_RETURNS_OBJECT = {("", "v1", "pods"), ("", "v1", "services"), NAMESPACES_KEY}


def _started_response(exc: BaseException) -> aiohttp.web.StreamResponse | None:
    """The response kmock had started streaming when ``exc`` broke it, if any.

    kmock wraps such an error in an exception of its own whose only argument is that
    response and whose cause is the error: recognised by that shape, since the class is
    not part of kmock's public API.
    """
    started = exc.args[0] if len(exc.args) == 1 else None
    if isinstance(started, aiohttp.web.StreamResponse) and exc.__cause__ is not None:
        return started
    return None


THROTTLE_EXEMPT = frozenset({"leases"})
"""Resources a throttle lets through (APF's ``leader-election`` flow schema)."""


@attrs.define
class _Throttle:
    until: float  # time.monotonic()
    retry_after: int
    left: int | None  # requests still to refuse (None: every one until ``until``)
    verbs: frozenset[str] | None  # the verbs refused (None: all)


@attrs.define(kw_only=True)
class HttpApi(Watches):
    """The HTTP entry point: parsing, the audit log, discovery and the resource endpoints."""

    _throttles: dict[str, _Throttle] = attrs.field(factory=dict, init=False)
    _refused: collections.Counter[ApiCall] = attrs.field(factory=collections.Counter, init=False)
    _throttle_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def throttle(
        self,
        user: str,
        *,
        seconds: float = float("inf"),
        requests: int | None = None,
        retry_after: int = 1,
        verbs: frozenset[str] | None = None,
    ) -> None:
        """Answer ``user``'s resource requests 429 with ``Retry-After: retry_after`` for the
        next ``seconds``, or only its next ``requests`` ones (Leases excepted); ``verbs``
        limits it to those (as a flow schema's rules can); :meth:`throttled_calls` counts
        them."""
        if seconds == float("inf") and requests is None:
            raise ValueError("throttle for some seconds, some requests, or both")
        with self._throttle_lock:
            until = time.monotonic() + seconds
            self._throttles[user] = _Throttle(until, retry_after, requests, verbs)

    def throttled_calls(self, user: str | None = None) -> collections.Counter[ApiCall]:
        """The requests answered 429 so far, as the audit log names them."""
        with self._throttle_lock:
            return collections.Counter(
                {c: n for c, n in self._refused.items() if user is None or c.user == user}
            )

    def _refusal(self, call: ApiCall | None) -> aiohttp.web.Response | None:
        if call is None or call.resource.split("/")[0] in THROTTLE_EXEMPT:
            return None
        with self._throttle_lock:
            found = self._throttles.get(call.user)
            if found is None or time.monotonic() >= found.until or found.left == 0:
                return None
            if found.verbs is not None and call.verb not in found.verbs:
                return None
            if found.left is not None:
                found.left -= 1
            self._refused[call] += 1
        error = ApiError(
            429,
            "TooManyRequests",
            "The server has received too many requests and has asked us to try again "
            f"later (retry after {found.retry_after}s)",
            details={"retryAfterSeconds": found.retry_after},
        )
        return aiohttp.web.json_response(
            error.status(), status=429, headers={"Retry-After": str(found.retry_after)}
        )

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
            refusal = self._refusal(self._audit_request(raw_request))
            if refusal is not None:
                return refusal
            try:
                return await self._handle(request)
            except Exception as exc:
                raw_response = _started_response(exc)
                if raw_response is None:
                    raise
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
    async def _parse_request(raw_request: aiohttp.web.BaseRequest, *, id: int) -> kmock.Request:
        parsed = parse_api_path(raw_request.path)
        if parsed is None or parsed.plural is None:  # discovery and non-API paths
            return await kmock.Request._parse(raw_request, id=id)
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
        return kmock.Request(
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

    def _audit_request(self, raw: aiohttp.web.BaseRequest) -> ApiCall | None:
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
        return call

    def _trim_request_log(self) -> None:
        limit = self.request_log_limit
        if limit is not None and len(self._requests) > limit:
            del self._requests[: len(self._requests) - limit]

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        self._bind_loop()
        self._trim_request_log()
        parsed = parse_api_path(request.url.path)
        # kmock matches reactions by scanning every recorded request, which makes each request
        # cost O(requests so far); without user reactions the emulator answers directly.
        reactions = len(self._payloads) > self._own_reactions
        if parsed is None or parsed.plural is None:
            try:
                if not reactions:
                    served = await self._serve_discovery(request)
                    if served is not None:
                        return served
                return await kmock.RawHandler._handle(self, request)
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
                    return await kmock.RawHandler._handle(self, request)
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

    async def _serve_discovery(self, request: kmock.Request) -> aiohttp.web.StreamResponse | None:
        """Answer the discovery endpoints without kmock's reaction matching (None: not one)."""
        if request.method != "GET":
            return None
        parts = [p for p in request.url.path.split("/") if p]
        if parts in (["healthz"], ["livez"], ["readyz"]):
            return aiohttp.web.Response(text="ok")
        payload: kmock.Payload
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
    async def _serve_list(self, request: kmock.Request) -> kmock.Payload:
        raise _EmulatorRenders

    def _serve_watch(self, request: kmock.Request) -> kmock.Payload:  # type: ignore[override]
        raise _EmulatorRenders

    async def _serve_fetch(self, request: kmock.Request) -> kmock.Payload:
        raise _EmulatorRenders

    async def _serve_create(self, request: kmock.Request) -> kmock.Payload:
        raise _EmulatorRenders

    async def _serve_update(self, request: kmock.Request) -> kmock.Payload:
        raise _EmulatorRenders

    async def _serve_delete(self, request: kmock.Request) -> kmock.Payload:
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

    async def _serve_api(self, request: kmock.Request) -> kmock.Payload:
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": request.url.host or "127.0.0.1"}
            ],
        }

    async def _serve_apis(self, request: kmock.Request) -> kmock.Payload:
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [self._group_entry(g, vs) for g, vs in sorted(self._groups().items()) if g],
        }

    async def _serve_group(self, request: kmock.Request) -> kmock.Payload:
        group = request.url.path.strip("/").split("/")[1]
        versions = self._groups().get(group)
        if not versions or not group:
            raise kmock.KubernetesResourceNotFoundError()
        return {"kind": "APIGroup", "apiVersion": "v1", **self._group_entry(group, versions)}

    async def _serve_version(self, request: kmock.Request) -> kmock.Payload:
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

    async def _serve_server_version(self, request: kmock.Request) -> kmock.Payload:
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
    def _body(request: kmock.Request, content_type: str) -> Any:
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
        self, spec: ResourceSpec, request: kmock.Request, parsed: ApiPath
    ) -> tuple[int, Any]:
        content_type = (request_header(request, "Content-Type") or "application/json").split(";")[0]
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
                        "uid": metadata_of(result).get("uid"),
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
        request: kmock.Request,
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
                meta = metadata_of(obj)
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
        self, spec: ResourceSpec, request: kmock.Request, parsed: ApiPath
    ) -> aiohttp.web.StreamResponse:
        if parsed.subresource not in (None, "status") or (
            parsed.subresource == "status" and not spec.has_status
        ):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        with self._state:
            obj = self._current(spec, parsed.namespace, parsed.name or "")
            if obj is None:
                raise ApiError.not_found(spec, parsed.name or "")
        if "as=Table" in (request_header(request, "Accept") or ""):
            return aiohttp.web.json_response(self._table(spec, [obj], {}))
        return aiohttp.web.json_response(obj)

    def _list_response(
        self, spec: ResourceSpec, request: kmock.Request, parsed: ApiPath
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
                o
                for o in items
                if ((metadata_of(o).get("namespace") or ""), metadata_of(o)["name"]) > after
            ]
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        limit = request.params.get("limit")
        if limit and limit.isdigit() and int(limit) > 0 and len(items) > int(limit):
            rest = len(items) - int(limit)
            items = items[: int(limit)]
            last = metadata_of(items[-1])
            meta["continue"] = base64.urlsafe_b64encode(
                json.dumps(
                    {"rv": rv, "ns": last.get("namespace") or "", "name": last["name"]}
                ).encode()
            ).decode()
            meta["remainingItemCount"] = rest
        if "as=Table" in (request_header(request, "Accept") or ""):
            return aiohttp.web.json_response(self._table(spec, items, meta))
        return aiohttp.web.json_response(
            {
                "kind": spec.list_kind,
                "apiVersion": spec.api_version,
                "metadata": meta,
                "items": items,
            }
        )
