"""The in-pod agent's HTTP server (CONTRACT: docs/agent-api.md, port 8080).

Engine pods serve it over HTTPS with their cluster's certificate (``--tls-cert-file``,
``--tls-key-file``; :mod:`prorsa_contract.serving_tls`, which also picks up a rotated
pair), so the bearer token of ``POST /v1/role`` never crosses the network in clear text.

``GET /v1/state``  the engine as an :class:`~prorsa_contract.agent_api.EngineState` (summed over DP
                   ranks), from ``/v1/loads``; 200 even when the engine is down (then
                   ``healthy: false``), so the operator can tell a dead engine from a dead pod.
``POST /v1/role``  bearer token; runs one switch at a time. The caller gets the final
                   :class:`~prorsa_contract.agent_api.RoleResult` (200 ok, 502 failed); the same
                   target while it runs answers 202 with the progress, another target 409;
                   503 when the engine cannot switch now (down, starting, failed); 401 bad
                   token; 400 unreadable body; 422 invalid body; 413 a body over 64 KiB
                   (declared or sent); 408 a body not sent within ``--body-timeout``
                   seconds. The switch runs on even if
                   its caller goes away (an operator restart), and a repeat of the call
                   after it finished answers 200 "already in the requested role".
``GET /v1/role``   the running switch's progress and the last result (not a CONTRACT).
``GET /healthz``   200 when the engine is healthy, else 503 with the reason.
``GET /readyz``    200 when healthy and not switching.
``GET /livez``     200 while the agent runs (for a liveness probe: an engine loading weights
                   for minutes must not get the pod killed).
``GET /metrics``   Prometheus: switches by result, switch and drain seconds, aborted
                   requests, engine restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from pydantic import ValidationError

from prorsa_agent.agent_metrics import AgentMetrics
from prorsa_agent.bootstrap_gate import BootstrapGate
from prorsa_agent.config import AgentConfig
from prorsa_agent.engine_client import EngineClient, EngineUnavailable
from prorsa_agent.health import EngineHealth
from prorsa_agent.loads_reader import LoadsReader
from prorsa_agent.supervisor import EngineSupervisor
from prorsa_agent.switch import Switcher, SwitchProgress
from prorsa_contract.agent_api import EngineState, Role, RoleRequest, RoleResult, as_role
from prorsa_contract.bearer import bearer_token
from prorsa_contract.serving_tls import ServingCert
from prorsa_contract.watched_files import WatchedFiles

log = logging.getLogger("prorsa_agent")

MAX_ROLE_BODY = 64 << 10
"""Largest ``POST /v1/role`` body: the request is a few dozen bytes of JSON."""
_READ_CHUNK = 8 << 10


class RoleTokenFile:
    """The bearer token for ``/v1/role``, re-read when the file changes (Secret rotation).

    An empty or missing file accepts no token at all: a misconfigured pod refuses switches
    rather than accepting anyone. Tokens are compared as bytes, in constant time: the file's
    bytes against the header's bytes as they came (aiohttp keeps bytes that are not UTF-8
    as surrogate escapes), so no header, however encoded, can make the check fail with an
    error instead of a refusal.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = WatchedFiles(path)
        self._token = b""
        self._warned = False

    def token(self) -> bytes:
        try:
            stamp = self._file.changed()
            if stamp is not None:
                self._token = self.path.read_bytes().strip()
                self._file.accept(stamp)
        except OSError as exc:
            if not self._warned:
                log.error("cannot read the token file %s: %s", self.path, exc)
                self._warned = True
            self._file.forget()
            self._token = b""
        return self._token

    def check(self, header: str | None) -> bool:
        expected = self.token()
        given = bearer_token(header)
        if not expected or given is None:
            return False
        try:
            presented = given.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate no bytes decoded to: never the token
            return False
        return hmac.compare_digest(presented, expected)


@dataclass
class _Job:
    progress: SwitchProgress
    task: asyncio.Task[RoleResult]


def _result(status: int, result: RoleResult) -> web.Response:
    return web.json_response(result.wire(), status=status)


def _refused_body(status: int, message: str) -> web.Response:
    """A reply to a request whose body was not read whole: the connection then closes,
    instead of lingering to read (and discard) what the client may still send."""
    response = web.json_response({"error": message}, status=status)
    response.force_close()
    return response


async def read_limited(request: web.Request, *, limit: int, timeout: float) -> bytes | web.Response:
    """The body, or the reply that refuses it: 413 as soon as it is over ``limit`` bytes
    (declared or sent), 408 when it has not arrived within ``timeout`` seconds.

    aiohttp's own ``read()`` waits as long as a client keeps the connection open and
    refuses an oversized body only after reading ``client_max_size`` of it.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        return _refused_body(413, f"a body of {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.content.iter_chunked(_READ_CHUNK):
                size += len(chunk)
                if size > limit:
                    return _refused_body(413, f"the body exceeds {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        return _refused_body(
            408, f"the request body did not arrive within {timeout:g} s ({size} bytes came)"
        )
    return b"".join(chunks)


class Agent:
    """One engine's agent. ``url = await agent.start()``; ``await agent.stop()``."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.metrics = AgentMetrics(config.instance)
        self.health = EngineHealth(failures_threshold=config.health_failures)
        self.supervisor: EngineSupervisor | None = None
        self._engine: EngineClient | None = None
        self._switcher: Switcher | None = None
        self._loads: LoadsReader | None = None
        self._token = RoleTokenFile(config.token_file)
        self._job: _Job | None = None
        self._last: RoleResult | None = None
        self._lock: asyncio.Lock | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._port = config.listen_port
        self._tls: ServingCert | None = None
        self.gate: BootstrapGate | None = None

    # ---------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        host = self.config.listen_host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        if ":" in host:
            host = f"[{host}]"
        scheme = "https" if self.config.tls_cert_file is not None else "http"
        return f"{scheme}://{host}:{self._port}"

    @property
    def engine(self) -> EngineClient:
        if self._engine is None:
            raise RuntimeError("the agent is not started")
        return self._engine

    async def start(self) -> str:
        config = self.config
        if config.tls_cert_file is not None and config.tls_key_file is not None:
            # Before anything starts: an unreadable certificate fails the start, loudly.
            self._tls = ServingCert(cert_file=config.tls_cert_file, key_file=config.tls_key_file)
        self._lock = asyncio.Lock()
        self._engine = EngineClient(
            config.engine_url,
            timeout=config.timeouts.request,
            api_key_file=config.engine_api_key_file,
        )
        self._loads = LoadsReader(
            self._engine,
            wait=config.timeouts.state,
            max_age=config.timeouts.state_max_age,
        )
        if config.bootstrap_gate is not None:
            gate = config.bootstrap_gate
            self.gate = BootstrapGate(
                host=config.listen_host,
                port=gate.port,
                engine_host=urlsplit(config.engine_url).hostname or "127.0.0.1",
                engine_port=gate.engine_port,
                hold=gate.hold,
            )
        self._switcher = Switcher(
            engine=self._engine,
            config=config,
            health=self.health,
            metrics=self.metrics,
            gate=self.gate,
        )
        app = web.Application()
        self._routes(app)
        # keepalive_timeout runs from the connection's start too: it closes a connection
        # that has not finished its request headers in time, as well as an idle one.
        runner = web.AppRunner(
            app,
            access_log=None,
            shutdown_timeout=1.0,
            keepalive_timeout=config.timeouts.client_headers,
        )
        await runner.setup()
        site = web.TCPSite(
            runner,
            config.listen_host,
            config.listen_port,
            reuse_address=True,
            ssl_context=self._tls.context if self._tls else None,
        )
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            await self._engine.aclose()
            raise
        self._runner = runner
        if self._port == 0:
            self._port = int(runner.addresses[0][1])
        if self.gate is not None:
            try:
                await self.gate.start()
            except BaseException:
                await self.stop()
                raise
        if config.launch is not None:
            self.supervisor = EngineSupervisor(
                argv=config.launch.argv,
                backoff=config.launch.backoff,
                stop_grace=config.launch.stop_grace,
                redact=config.launch.secrets,
                on_exit=self._engine_exited,
                on_spawn=self._engine_spawned,
            )
            await self.supervisor.start()
        else:
            await self._probe()
        self._monitor = asyncio.create_task(self._monitor_loop(), name="agent-health")
        log.info("agent for %s on %s (engine %s)", config.instance, self.url, config.engine_url)
        return self.url

    async def stop(self) -> None:
        tasks = [t for t in (self._monitor, self._job.task if self._job else None) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.gate is not None:
            await self.gate.stop()
        if self._loads is not None:
            self._loads.close()
        if self._engine is not None:
            await self._engine.aclose()

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---------------------------------------------------------------- engine health
    def _engine_spawned(self, generation: int) -> None:
        self.health.engine_restarted(f"engine process started (start #{generation})")
        if self.gate is not None:
            self.gate.close()  # a fresh engine, in its launch role decode

    def _engine_exited(self, code: int | None, ran: float) -> None:
        if self.gate is not None:
            self.gate.close()  # no prefill behind it until a flip says so again
        self.metrics.restarts.inc()
        self.health.down(f"engine exited with {code} after {ran:.1f}s; restarting")
        self.metrics.engine_healthy.set(0)

    @property
    def switching(self) -> bool:
        return self._job is not None and not self._job.task.done()

    async def _probe(self) -> None:
        sup = self.supervisor
        if sup is not None and not sup.running:
            if sup.state != "backoff":  # in backoff, the exit reason is already recorded
                self.health.down(f"engine process not running ({sup.state})")
        elif not self.switching:
            # A switch holds the engine's scheduler; its own checks decide meanwhile.
            generation = sup.generation if sup is not None else None
            try:
                ok = await self.engine.health("/health", timeout=self.config.timeouts.health_probe)
                reason = "engine answered /health with an error"
            except EngineUnavailable as exc:
                ok, reason = False, str(exc)
            if sup is not None and (not sup.running or sup.generation != generation):
                # The process exited (or was replaced) while the probe was out: its answer
                # is of an engine that is gone, and the exit is already recorded.
                return
            if ok:
                # server_info first: a new startup_time (a restart) clears a failed state.
                with contextlib.suppress(EngineUnavailable):
                    self.health.observe_info(await self.engine.server_info())
                self.health.probe_ok()
            else:
                self.health.probe_failed(reason)
        self.metrics.engine_healthy.set(1 if self.health.healthy else 0)

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.timeouts.health_interval)
            try:
                await self._probe()
            except Exception:  # keep probing whatever one probe hit
                log.exception("health probe failed unexpectedly")

    # ---------------------------------------------------------------- HTTP
    def _routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/v1/state", self._state)
        r.add_post("/v1/role", self._role)
        r.add_get("/v1/role", self._role_status)
        r.add_get("/healthz", self._healthz)
        r.add_get("/readyz", self._readyz)
        r.add_get("/livez", self._livez)
        r.add_get("/metrics", self._metrics)

    async def _state(self, request: web.Request) -> web.Response:
        del request
        health = self.health
        try:
            if self._loads is None:
                raise EngineUnavailable("the agent is not started")
            loads = await self._loads.loads()
        except EngineUnavailable as exc:
            log.debug("no loads from the engine: %s", exc)
            state = EngineState(
                instance=self.config.instance,
                role=health.last_role,
                switching=self.switching,
                healthy=False,
            )
            return web.json_response(state.wire())
        role = as_role(loads.role)
        in_pd = role is not None
        if role is not None:
            health.last_role = role
        state = EngineState(
            instance=self.config.instance,
            role=health.last_role,
            switching=self.switching,
            healthy=health.healthy and in_pd,
            running_requests=loads.running,
            waiting_requests=loads.waiting,
            waiting_tokens=loads.waiting_tokens,
            kv_used_tokens=loads.kv_used,
            kv_capacity_tokens=loads.kv_capacity,
            prefill_busy_seconds=loads.prefill_busy_seconds,
            prefill_tokens=loads.prefill_tokens,
        )
        return web.json_response(state.wire())

    def _refusal(self) -> RoleResult | None:
        """Why a switch cannot start now, or None."""
        status, reason = self.health.effective
        if status == "healthy":
            return None
        failed = status == "failed"
        return RoleResult(
            ok=False,
            old_role=self.health.last_role,
            new_role=self.health.last_role,
            safe_to_restore=not failed,
            message=f"engine {status}: {reason}",
        )

    async def _role(self, request: web.Request) -> web.Response:
        if not self._token.check(request.headers.get("Authorization")):
            return web.json_response(
                {"error": "missing or wrong bearer token"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="prorsa-agent"'},
            )
        body = await read_limited(
            request, limit=MAX_ROLE_BODY, timeout=self.config.timeouts.client_body
        )
        if isinstance(body, web.Response):
            return body
        try:
            # pydantic-core parses with a nesting limit: a deeply nested body is "not JSON"
            # (400), where json.loads would raise RecursionError (a 500).
            wanted = RoleRequest.model_validate_json(body)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            unreadable = [e for e in errors if e["type"] == "json_invalid"]
            if unreadable:
                message = f"the body is not JSON: {unreadable[0]['msg']}"[:300]
                return web.json_response({"error": message}, status=400)
            details = [{"field": ".".join(map(str, e["loc"])), "message": e["msg"]} for e in errors]
            return web.json_response(
                {"error": "invalid role request", "details": details}, status=422
            )
        assert self._lock is not None
        async with self._lock:
            job = self._job
            if job is not None and not job.task.done():
                p = job.progress
                if p.target == wanted.role:
                    return _result(202, p.as_result())
                self.metrics.switches.labels(result="refused", to=wanted.role).inc()
                message = f"a switch to {p.target} is in progress; refusing a switch to "
                return _result(
                    409,
                    RoleResult(
                        ok=False,
                        old_role=p.old_role,
                        new_role=p.target,
                        safe_to_restore=True,
                        message=message + wanted.role,
                    ),
                )
            refusal = self._refusal()
            current: Role | None = None
            if refusal is None:
                try:
                    mode = (await self.engine.loads()).role
                except EngineUnavailable as exc:
                    refusal = RoleResult(
                        ok=False, safe_to_restore=True, message=f"engine not answering: {exc}"
                    )
                else:
                    current = as_role(mode)
                    if current is None:
                        refusal = RoleResult(
                            ok=False,
                            safe_to_restore=True,
                            message=f"engine is not in PD disaggregation mode (mode {mode!r})",
                        )
            if refusal is not None:
                self.metrics.switches.labels(result="refused", to=wanted.role).inc()
                return _result(503, refusal)
            if current == wanted.role:
                self.metrics.switches.labels(result="noop", to=wanted.role).inc()
                return _result(
                    200,
                    RoleResult(
                        ok=True,
                        old_role=wanted.role,
                        new_role=wanted.role,
                        message="already in the requested role",
                    ),
                )
            progress = SwitchProgress(
                target=wanted.role,
                old_role=current,
                drain_timeout=wanted.drain_timeout_seconds,
            )
            job = _Job(progress, asyncio.create_task(self._run_switch(progress)))
            self._job = job
        # Shielded: the switch finishes even when this caller disconnects.
        result = await asyncio.shield(job.task)
        return _result(200 if result.ok else 502, result)

    async def _run_switch(self, progress: SwitchProgress) -> RoleResult:
        assert self._switcher is not None
        sup = self.supervisor
        generation = sup.generation if sup is not None else None
        log.info("switching %s -> %s", progress.old_role, progress.target)
        self.metrics.switching.set(1)
        try:
            result, label = await self._switcher.run(progress)
        except Exception as exc:
            log.exception("switch crashed in the agent")
            self.health.mark_failed(f"agent error during a switch: {exc!r}")
            result = RoleResult(
                ok=False,
                old_role=progress.old_role,
                safe_to_restore=False,
                aborted_requests=progress.aborted,
                seconds=progress.elapsed(),
                message=f"agent error during the switch: {exc!r}",
            )
            label = "failed_unsafe"
        finally:
            self.metrics.switching.set(0)
        if sup is not None and sup.generation != generation:
            # The engine died and was restarted meanwhile: a fresh engine in its launch role.
            self.health.engine_restarted("engine restarted during the switch")
        self.metrics.switches.labels(result=label, to=progress.target).inc()
        self.metrics.switch_seconds.labels(to=progress.target).observe(result.seconds)
        self._last = result
        log.info("switch to %s: %s", progress.target, result.message)
        return result

    async def _role_status(self, request: web.Request) -> web.Response:
        del request
        job = self._job
        running = job is not None and not job.task.done()
        return web.json_response(
            {
                "switching": running,
                "progress": job.progress.wire() if running and job else None,
                "last": self._last.wire() if self._last else None,
            }
        )

    def _health_body(self) -> dict[str, Any]:
        status, reason = self.health.effective
        sup = self.supervisor
        return {
            "instance": self.config.instance,
            "status": status,
            "reason": reason,
            "switching": self.switching,
            "role": self.health.last_role,
            "engineRestarts": sup.restarts if sup is not None else 0,
        }

    async def _healthz(self, request: web.Request) -> web.Response:
        del request
        body = self._health_body()
        return web.json_response(body, status=200 if body["status"] == "healthy" else 503)

    async def _readyz(self, request: web.Request) -> web.Response:
        del request
        body = self._health_body()
        ready = body["status"] == "healthy" and not body["switching"]
        return web.json_response(body, status=200 if ready else 503)

    async def _livez(self, request: web.Request) -> web.Response:
        del request
        return web.json_response({"status": "alive"})

    async def _metrics(self, request: web.Request) -> web.Response:
        del request
        self.metrics.engine_healthy.set(1 if self.health.healthy else 0)
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )
