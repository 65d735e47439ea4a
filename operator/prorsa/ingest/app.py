"""The trainer webhook as an aiohttp application, for any number of RolloutClusters.

``WebhookServer(registry).make_app()`` is a complete application (the standalone
``prorsa ingest`` serves it); ``WebhookServer.add_routes(app)`` mounts the same handlers on
an application the operator already runs in its own asyncio loop.

Order of checks on a request, cheapest and least revealing first: token (401: a token
of no served cluster, whether or not the cluster exists, so names cannot be probed), then
cluster known (404), header sanity (400), ``X-Prorsa-Sent-At`` within the window of
plausible times and ``X-Prorsa-Emitter`` well formed (422), declared size (413), the
cluster's queue (429), a Content-Encoding it decodes (400), body read within its
deadline (408), the size limit (413) and the server-wide bytes in flight (429; events
and snapshots each have a budget), parse and validate (400/422), event times within the
window (422), then dedupe and apply, where events that would start trajectories past the
cluster's ``maxLiveTrajectories`` are refused (429, the rest of the batch applied).

Nothing is read into memory before the token is checked, and the bytes held at once
across all requests are bounded, so memory stays bounded under any input. Bytes count
against that budget as they arrive, not as a request declares them, so clients that stall
mid-body hold only what they sent, and only until the body deadline; a connection that
never finishes its headers is closed after the header deadline (aiohttp's keep-alive
timer, which also runs from the connection's start). Parsing a large body happens in a
worker thread so the loop never stalls on it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from operator import attrgetter
from typing import TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prorsa.clusters.limits import IngestLimits, QueueFull, TrajectoryLimit
from prorsa.clusters.registry import ClusterRegistry, WebhookCluster
from prorsa.core.forecast.emitters import TooManyEmitters
from prorsa.ingest.openapi import CLUSTER_PATH, NDJSON_TYPES, SENT_AT_HEADER, openapi_document
from prorsa.ingest.webhook_metrics import WebhookMetrics
from prorsa.ingest.window import TimeWindow, events_outside, snapshot_outside
from prorsa.ingest.wire import (
    BatchReply,
    ClusterStatus,
    ErrorDetail,
    ErrorReply,
    Health,
    SnapshotReply,
)
from prorsa_contract.bearer import bearer_token
from prorsa_contract.events import (
    EMITTER_HEADER,
    BatchError,
    Event,
    FieldError,
    Snapshot,
    parse_batch,
    parse_ndjson,
    parse_snapshot,
    valid_emitter,
)

log = logging.getLogger("prorsa.ingest")

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Bodies above offload_events * this many bytes parse in a thread (pydantic-core parses
# ~500 events per ms). SDK events are 110-200 bytes of JSON; estimating at the top of that
# range keeps the SDK's default batch of 500 inline, as ``IngestLimits.offload_events``
# intends: at 100 bytes it went to a thread, paying the hop on every batch.
_BYTES_PER_EVENT = 200
_READ_CHUNK = 1 << 16
_ENCODINGS = frozenset({"gzip", "deflate", "identity"})  # the codings the webhook decodes
_EVENT_TYPE = attrgetter("type")  # a C-level loop over the batch for the metrics


class Refusal(Exception):
    """A request refused whole; becomes an :class:`ErrorReply` with ``status``."""

    def __init__(
        self,
        status: int,
        reason: str | None,
        message: str,
        *,
        handle: WebhookCluster | None = None,
        errors: list[FieldError] | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.handle = handle
        self.errors = errors
        self.retry_after = retry_after

    def response(self) -> web.Response:
        """The JSON reply; a 408 also closes the connection (its body never came)."""
        h = self.handle
        details = None
        if self.errors is not None:
            details = [
                ErrorDetail(index=e.index, field=e.field, message=e.message) for e in self.errors
            ]
        body = ErrorReply(
            error=self.message,
            reason=self.reason,
            epoch=None if h is None else h.epoch,
            resync=None if h is None else h.resync,
            errors=details,
            retry_after=self.retry_after,
        )
        headers: dict[str, str] = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if self.status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="prorsa"'
        response = web.json_response(body.wire(), status=self.status, headers=headers)
        if self.status == 408:
            response.force_close()
        return response


class _Budget:
    """Body bytes held at once by all requests of one kind (events, or snapshots)."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0


class _Held:
    """Body bytes one request holds against its kind's in-flight budget."""

    __slots__ = ("budget", "bytes")

    def __init__(self, budget: _Budget) -> None:
        self.budget = budget
        self.bytes = 0


@dataclass(frozen=True, slots=True)
class RunningServer:
    """A started listener: ``url`` is its base URL; ``stop()`` closes it."""

    runner: web.AppRunner
    host: str
    port: int
    tls: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


class WebhookServer:
    """HTTP handlers over a :class:`ClusterRegistry`; one listener, many clusters."""

    def __init__(
        self,
        registry: ClusterRegistry | None = None,
        *,
        metrics: WebhookMetrics | None = None,
    ) -> None:
        self.registry = registry if registry is not None else ClusterRegistry()
        self.limits: IngestLimits = self.registry.limits
        self.metrics = metrics if metrics is not None else WebhookMetrics()
        self.metrics.pending.set_function(self.registry.pending_events)
        self._events_budget = _Budget(self.limits.max_inflight_bytes)
        self._snapshots_budget = _Budget(self.limits.max_inflight_snapshot_bytes)

    @property
    def inflight_bytes(self) -> int:
        """Request body bytes held right now, server-wide (read, being parsed, a snapshot
        until it is loaded)."""
        return self._events_budget.held + self._snapshots_budget.held

    # -- assembly ------------------------------------------------------------------------

    def add_routes(
        self, app: web.Application, *, health: bool = True, metrics: bool = True
    ) -> None:
        """Mount the webhook on ``app`` (the operator's), optionally with health and metrics."""
        app.router.add_post(f"{CLUSTER_PATH}/events", self._guard(self.post_events))
        app.router.add_post(f"{CLUSTER_PATH}/snapshot", self._guard(self.post_snapshot))
        app.router.add_get(f"{CLUSTER_PATH}/forecast", self._guard(self.get_forecast))
        app.router.add_get(f"{CLUSTER_PATH}/status", self._guard(self.get_status))
        app.router.add_get("/openapi.json", self.get_openapi)
        if health:
            app.router.add_get("/healthz", self.get_health)
        if metrics:
            app.router.add_get("/metrics", self.get_metrics)

    def make_app(self) -> web.Application:
        """A complete application: the webhook, /healthz, /metrics, JSON errors everywhere."""
        app = web.Application(middlewares=[_json_errors])
        self.add_routes(app)
        return app

    def trainer_app(self) -> web.Application:
        """What the operator serves on the trainers' port: the webhook and ``/healthz``,
        no ``/metrics`` (it names every served cluster; the operator serves it on a port
        of its own, docs/security.md). The attack suite (``prorsa bench attack``) serves
        this same application."""
        app = web.Application()
        self.add_routes(app, metrics=False)
        return app

    def runner(self, app: web.Application | None = None) -> web.AppRunner:
        """A runner for ``app`` (default :meth:`make_app`) that drops stalled connections.

        aiohttp closes a connection waiting for a request's headers once its keep-alive
        timer runs out, and that timer starts when the connection is made: so
        ``header_timeout_seconds`` bounds both an idle kept-alive connection and one that
        never finishes its first request line and headers (aiohttp's default is an hour).
        """
        return web.AppRunner(
            app if app is not None else self.make_app(),
            access_log=None,
            handle_signals=False,
            keepalive_timeout=self.limits.header_timeout_seconds,
        )

    async def start(
        self, *, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None
    ) -> RunningServer:
        """Listen on ``host:port`` (port 0: any free port) in the running loop; HTTPS with
        ``ssl_context`` (a :class:`prorsa_contract.serving_tls.ServingCert`'s)."""
        runner = self.runner()
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        bound = runner.addresses[0][1] if runner.addresses else port
        return RunningServer(runner=runner, host=host, port=bound, tls=ssl_context is not None)

    @asynccontextmanager
    async def serving(
        self, *, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None
    ) -> AsyncIterator[str]:
        """``async with server.serving() as url:`` for tests and scripts."""
        running = await self.start(host=host, port=port, ssl_context=ssl_context)
        try:
            yield running.url
        finally:
            await running.stop()

    def _guard(self, handler: Handler) -> Handler:
        """Turn :class:`Refusal` into its JSON reply and count it by reason."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except Refusal as refusal:
                if refusal.reason is not None:
                    self.metrics.reject(refusal.reason)
                return refusal.response()

        return guarded

    # -- shared steps --------------------------------------------------------------------

    def _cluster(self, request: web.Request) -> WebhookCluster:
        """The cluster of the path, once the token is one this server knows.

        A token no served cluster holds is 401 whether or not the cluster exists, with the
        same body either way; only a caller holding some cluster's token learns that a name
        is not served (404).
        """
        ns, name = request.match_info["namespace"], request.match_info["name"]
        presented = bearer_token(request.headers.get("Authorization"))
        handle = self.registry.get(ns, name)
        if handle is not None and handle.authorized(presented):
            return handle
        if handle is None and self.registry.knows_token(presented):
            raise Refusal(404, "unknown_cluster", f"no RolloutCluster {ns}/{name} is served here")
        raise Refusal(401, "unauthorized", "missing or wrong bearer token")

    def _window(self, handle: WebhookCluster) -> TimeWindow:
        limits = self.limits
        return TimeWindow(
            now=handle.clock.wall(),
            ahead=limits.max_clock_ahead_seconds,
            behind=limits.max_clock_behind_seconds,
        )

    def _sent_at(
        self, request: web.Request, handle: WebhookCluster, window: TimeWindow
    ) -> float | None:
        raw = request.headers.get(SENT_AT_HEADER)
        if raw is None:
            return None
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise Refusal(
                400,
                "unreadable",
                f"{SENT_AT_HEADER} must be unix seconds, got {raw[:40]!r}",
                handle=handle,
            )
        if value not in window:
            raise Refusal(
                422,
                "invalid",
                f"{SENT_AT_HEADER} is outside the window of plausible times; the batch was "
                "not applied",
                handle=handle,
                errors=[FieldError(None, SENT_AT_HEADER, window.explain(value))],
            )
        return value

    def _emitter(self, request: web.Request, handle: WebhookCluster) -> str | None:
        """The ``X-Prorsa-Emitter`` id the request names, if any (422 when malformed)."""
        raw = request.headers.get(EMITTER_HEADER)
        if raw is None:
            return None
        if not valid_emitter(raw):
            raise _invalid_emitter(
                handle, "1-128 letters, digits and _.:- starting with a letter or digit"
            )
        return raw

    @asynccontextmanager
    async def _holding(
        self, request: web.Request, handle: WebhookCluster, budget: _Budget
    ) -> AsyncIterator[_Held]:
        """Count the body's bytes against ``budget`` until the block ends.

        Bytes are counted as they arrive (:meth:`_read`), so a stalled client holds only
        what it sent. A body whose declared size cannot fit now is refused before reading.
        """
        declared = request.content_length
        plain = not request.headers.get("Content-Encoding")
        inflight = budget.held
        if declared and plain and inflight and inflight + declared > budget.limit:
            raise _busy(handle)
        held = _Held(budget)
        try:
            yield held
        finally:
            budget.held -= held.bytes

    @staticmethod
    def _declared(request: web.Request, handle: WebhookCluster, *, limit: int) -> None:
        """413 for a body declared past ``limit``, before anything that says "retry": no
        retry of it could ever be accepted."""
        declared = request.content_length
        if declared is not None and declared > limit:
            raise Refusal(
                413, "too_large", f"body of {declared} bytes exceeds {limit}", handle=handle
            )

    async def _read(
        self, request: web.Request, handle: WebhookCluster, *, limit: int, held: _Held
    ) -> bytes:
        """The body, within ``body_timeout_seconds`` (408), ``limit`` bytes (413: the
        declared size is checked before, by :meth:`_declared`) and the server-wide
        budget (429), refusing as soon as one is exceeded."""
        encoding = request.headers.get("Content-Encoding")
        if encoding is not None and encoding.strip().lower() not in _ENCODINGS:
            # aiohttp reads a coding it does not know as if there were none: say so instead.
            raise Refusal(
                400,
                "unreadable",
                f"Content-Encoding {encoding[:40]!r} is not supported: send gzip, deflate "
                "or an unencoded body",
                handle=handle,
            )
        budget = held.budget
        deadline = self.limits.body_timeout_seconds
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(deadline):
                async for chunk in request.content.iter_chunked(_READ_CHUNK):
                    n = len(chunk)
                    size += n
                    if size > limit:
                        raise Refusal(
                            413, "too_large", f"body exceeds {limit} bytes", handle=handle
                        )
                    # Alone, a request may use the whole budget: a legal body always fits.
                    if budget.held + n > budget.limit and budget.held > held.bytes:
                        raise _busy(handle)
                    budget.held += n
                    held.bytes += n
                    chunks.append(chunk)
        except TimeoutError:
            raise Refusal(
                408,
                "timeout",
                f"the request body did not arrive within {deadline:g} s ({size} bytes came)",
                handle=handle,
            ) from None
        except web.RequestPayloadError as exc:
            problem = _payload_problem(request, exc)
            raise Refusal(400, "unreadable", problem, handle=handle) from None
        except ConnectionResetError:
            # The client hung up mid-body: nobody reads the reply; the budget is released.
            raise Refusal(400, None, "the client closed the connection", handle=handle) from None
        return b"".join(chunks)

    async def _parse(self, body: bytes, fn: Callable[[bytes], T], handle: WebhookCluster) -> T:
        try:
            if len(body) > self.limits.offload_events * _BYTES_PER_EVENT:
                return await asyncio.to_thread(fn, body)
            return fn(body)
        except UnicodeDecodeError as exc:
            raise Refusal(400, "unreadable", f"body is not UTF-8: {exc}", handle=handle) from None
        except BatchError as exc:
            if _unreadable(exc.errors):
                raise Refusal(400, "unreadable", exc.errors[0].message, handle=handle) from None
            raise Refusal(
                422,
                "invalid",
                f"{len(exc.errors)} problem(s); the batch was not applied",
                handle=handle,
                errors=exc.errors[:1000],
            ) from None

    # -- handlers ------------------------------------------------------------------------

    async def post_events(self, request: web.Request) -> web.Response:
        start = time.perf_counter()
        handle = self._cluster(request)
        received = handle.clock.monotonic()
        window = self._window(handle)
        sent_at = self._sent_at(request, handle, window)
        emitter = self._emitter(request, handle)
        limit = self.limits.max_batch_bytes
        self._declared(request, handle, limit=limit)
        try:
            handle.check_capacity()
        except QueueFull as full:
            raise _queue_full(full, handle) from None
        parse = parse_ndjson if request.content_type in NDJSON_TYPES else parse_batch

        def parse_in_window(body: bytes) -> list[Event]:
            events = parse(body)
            outside = events_outside(events, window)
            if outside:
                raise BatchError(outside)
            return events

        async with self._holding(request, handle, self._events_budget) as held:
            body = await self._read(request, handle, limit=limit, held=held)
            events: list[Event] = await self._parse(body, parse_in_window, handle)
        try:
            outcome = await handle.apply(
                events, received=received, sent_at=sent_at, emitter=emitter
            )
        except QueueFull as full:
            raise _queue_full(full, handle) from None
        except TooManyEmitters as exc:
            raise _invalid_emitter(handle, str(exc)) from None
        except TrajectoryLimit as capped:  # counted when the resent batch is accepted
            raise _trajectory_limit(capped, handle) from None
        m = self.metrics
        if outcome.applied:
            m.count_events(map(_EVENT_TYPE, events))
        if outcome.duplicates:
            m.duplicates.inc(outcome.duplicates)
        if outcome.superseded:
            m.superseded.inc(outcome.superseded)
        reply = BatchReply(
            epoch=handle.epoch,
            resync=handle.resync_for(emitter),
            accepted=outcome.accepted,
            applied=outcome.applied,
            duplicates=outcome.duplicates,
            superseded=outcome.superseded,
            anomalies=outcome.anomalies,
        )
        m.batch_seconds.observe(time.perf_counter() - start)
        return web.json_response(reply.wire())

    async def post_snapshot(self, request: web.Request) -> web.Response:
        handle = self._cluster(request)
        received = handle.clock.monotonic()
        window = self._window(handle)
        sent_at = self._sent_at(request, handle, window)
        emitter = self._emitter(request, handle)

        def parse_in_window(body: bytes) -> Snapshot:
            snapshot = parse_snapshot(body)
            outside = snapshot_outside(snapshot, window)
            if outside:
                raise BatchError(outside)
            return snapshot

        limit = self.limits.max_snapshot_bytes
        self._declared(request, handle, limit=limit)
        # Held until loaded: the parsed snapshot is the largest object a request makes.
        async with self._holding(request, handle, self._snapshots_budget) as held:
            body = await self._read(request, handle, limit=limit, held=held)
            snapshot = await self._parse(body, parse_in_window, handle)
            del body
            try:
                await handle.apply_snapshot(
                    snapshot, received=received, sent_at=sent_at, emitter=emitter
                )
            except TooManyEmitters as exc:
                raise _invalid_emitter(handle, str(exc)) from None
            except TrajectoryLimit as capped:
                raise _trajectory_limit(capped, handle) from None
        log.info(
            "%s/%s: resync snapshot with %d live trajectories%s",
            handle.namespace,
            handle.name,
            len(snapshot.trajectories),
            "" if emitter is None else f" of emitter {emitter}",
        )
        reply = SnapshotReply(
            epoch=handle.epoch,
            resync=handle.resync_for(emitter),
            trajectories=len(snapshot.trajectories),
        )
        return web.json_response(reply.wire())

    async def get_forecast(self, request: web.Request) -> web.Response:
        handle = self._cluster(request)
        decision = handle.last_decision
        if decision is None:
            raise Refusal(
                404, None, "no Decision yet: the controller has not ticked", handle=handle
            )
        return web.json_response(decision.wire())

    async def get_status(self, request: web.Request) -> web.Response:
        handle = self._cluster(request)
        return web.json_response(ClusterStatus.model_validate(handle.status()).wire())

    async def get_health(self, request: web.Request) -> web.Response:
        return web.json_response(Health(clusters=len(self.registry)).wire())

    async def get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def get_openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())


def _unreadable(errors: list[FieldError]) -> bool:
    """A body that is not JSON at all (400), as opposed to JSON that fails validation (422)."""
    return (
        len(errors) == 1
        and errors[0].index is None
        and errors[0].field == "body"
        and errors[0].message.startswith("Invalid JSON")
    )


def _invalid_emitter(handle: WebhookCluster, why: str) -> Refusal:
    return Refusal(
        422,
        "invalid",
        f"{EMITTER_HEADER} refused; nothing was applied",
        handle=handle,
        errors=[FieldError(None, EMITTER_HEADER, why)],
    )


def _trajectory_limit(capped: TrajectoryLimit, handle: WebhookCluster) -> Refusal:
    """429 with Retry-After at the cluster's live-trajectory limit; 422 for a snapshot
    that lists more trajectories than the limit (no retry can fit it)."""
    if capped.retry_after is None:
        return Refusal(
            422,
            "trajectory_limit",
            str(capped),
            handle=handle,
            errors=[
                FieldError(
                    None,
                    "trajectories",
                    f"{capped.deferred} listed; spec.trainer.maxLiveTrajectories is {capped.limit}",
                )
            ],
        )
    return Refusal(
        429,
        "trajectory_limit",
        f"{capped}; retry after {capped.retry_after}s",
        handle=handle,
        retry_after=capped.retry_after,
    )


def _busy(handle: WebhookCluster) -> Refusal:
    return Refusal(
        429,
        "busy",
        "too many request bodies in flight; retry shortly",
        handle=handle,
        retry_after=1,
    )


def _payload_problem(request: web.Request, exc: web.RequestPayloadError) -> str:
    """What was wrong with a body aiohttp could not decode, in the trainer's terms."""
    encoding = request.headers.get("Content-Encoding")
    cause = exc.__cause__ or exc
    detail = getattr(cause, "message", None) or str(cause)
    if encoding:
        return f"the body is not valid {encoding} (its Content-Encoding): {detail}"[:300]
    return f"the body could not be read: {detail}"[:300]


def _queue_full(full: QueueFull, handle: WebhookCluster) -> Refusal:
    return Refusal(
        429,
        "queue_full",
        f"{full.pending} events are waiting for the controller; retry after {full.retry_after}s",
        handle=handle,
        retry_after=full.retry_after,
    )


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 404/405/5xx as JSON :class:`ErrorReply` bodies, headers kept."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        return web.json_response(
            ErrorReply(error=exc.reason or "error").wire(), status=exc.status, headers=headers
        )
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return web.json_response(ErrorReply(error="internal error").wire(), status=500)
