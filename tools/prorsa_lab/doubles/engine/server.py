"""SGLang 0.5.23's HTTP surface in front of :class:`~prorsa_lab.doubles.engine.model.EngineCore`.

Routes, bodies and status codes follow ``srt/entrypoints/http_server.py`` and
``v1_loads.py`` of the 0.5.23 wheel; ``/_double/...`` routes are the double's own (counters,
faults, crash) and exist nowhere in SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import sys
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, ValidationError

from prorsa_contract.bearer import bearer_token
from prorsa_lab.doubles.engine.kv_handoff import Bootstrap, KvFetcher, bootstrap_app
from prorsa_lab.doubles.engine.model import (
    SGLANG_VERSION,
    Counters,
    EngineConfig,
    EngineCore,
    EngineCrashed,
    Faults,
    GenerateError,
    MetricsSink,
    Request,
)

log = logging.getLogger("prorsa_lab.doubles.sglang_double")

CRASH_EXIT_CODE = 70
ADMIN_PATHS = frozenset(
    {"/pd_role_switch", "/abort_request", "/pause_generation", "/continue_generation"}
)
VALID_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
SECTIONS = (
    ("memory", "memory"),
    ("speculative", "spec"),
    ("lora", "lora"),
    ("disaggregation", "disagg"),
    ("queues", "queues"),
)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)


class PdRoleSwitchReqInput(BaseModel):
    """``srt/managers/io_struct.py`` ``PdRoleSwitchReqInput`` (extra keys ignored, as there)."""

    model_config = ConfigDict(extra="ignore")

    rid: str | None = None
    http_worker_ipc: str | None = None
    new_role: Literal["prefill", "decode", ""] = ""
    decode_cuda_graph_bs: list[int] | None = None
    decode_cuda_graph_memory_gb: float | None = None
    prepare_only: bool = False


class AbortReq(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: str | None = None
    abort_all: bool = False


class PauseGenerationReqInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    mode: Literal["abort", "retract", "in_place"] = "abort"


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _unprocessable(errors: list[dict[str, Any]]) -> web.Response:
    """FastAPI's 422 body for a request body that does not fit the schema."""
    return web.json_response({"detail": errors}, status=422)


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise web.HTTPUnprocessableEntity(
            text=json.dumps({"detail": [{"type": "json_invalid", "msg": str(exc)}]}),
            content_type="application/json",
        ) from exc


def _prompt_tokens(value: Any, *, text: bool) -> int:
    """Tokens of one prompt: ``input_ids`` length, or one token per whitespace-split word."""
    if text:
        if not isinstance(value, str):
            raise GenerateError("text must be a string or a list of strings")
        return len(value.split())
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise GenerateError("input_ids must be a list of integers or a list of such lists")
    return len(value)


def _max_new_tokens(params: Any) -> int:
    if params is None:
        return 128
    if not isinstance(params, dict):
        raise GenerateError("sampling_params must be an object")
    value = params.get("max_new_tokens", 128)
    if value is None:
        return 128
    if not isinstance(value, int) or isinstance(value, bool):
        raise GenerateError("max_new_tokens must be an integer")
    if value < 0:
        raise GenerateError(f"max_new_tokens must be at least 0, got {value}.")
    return value


def routed_dp_rank(body: dict[str, Any], dp_size: int) -> int | None:
    """The DP rank a router chose for this request, as SGLang 0.5.23 reads it.

    smg ``--dp-aware`` sends ``routed_dp_rank`` (older gateways ``data_parallel_rank``, the
    deprecated alias ``GenerateReqInput`` still maps onto it, ``io_struct.py``). The
    tokenizer manager refuses a rank outside the engine's DP ranks and ignores rank 0 of
    a single-rank engine (``tokenizer_manager.py``, before the request is queued); the DP
    controller then sends it to that rank instead of its own choice
    (``data_parallel_controller.py`` ``maybe_external_dp_rank_routing``).
    """
    value = body.get("routed_dp_rank")
    if value is None:
        value = body.get("data_parallel_rank")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise GenerateError("routed_dp_rank must be an integer")
    if dp_size <= 1 and value == 0:
        return None
    if not 0 <= value < dp_size:
        raise GenerateError(f"routed_dp_rank={value} out of range [0, {dp_size})")
    return value


def parse_generate(body: dict[str, Any]) -> tuple[list[tuple[str | None, int, int]], bool]:
    """``(rid, prompt_tokens, max_new_tokens)`` per prompt, and whether it is a batch."""
    if body.get("input_ids") is not None:
        prompts, is_text = body["input_ids"], False
        batch = isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], list)
    elif body.get("text") is not None:
        prompts, is_text = body["text"], True
        batch = isinstance(prompts, list)
    else:
        raise GenerateError("Either text, input_ids or input_embeds should be provided.")
    items = prompts if batch else [prompts]
    if batch and not items:
        raise GenerateError("The batch is empty.")
    rids = body.get("rid")
    params = body.get("sampling_params")
    if batch:
        if rids is not None and (not isinstance(rids, list) or len(rids) != len(items)):
            raise GenerateError("The rid should be a list with one entry per prompt.")
        if isinstance(params, list) and len(params) != len(items):
            raise GenerateError("sampling_params should have one entry per prompt.")
    elif rids is not None and not isinstance(rids, str):
        raise GenerateError("The rid should be a string.")
    specs: list[tuple[str | None, int, int]] = []
    for i, prompt in enumerate(items):
        rid = (rids[i] if batch else rids) if rids is not None else None
        if rid is not None and not isinstance(rid, str):
            raise GenerateError("The rid should be a string.")
        p = params[i] if isinstance(params, list) else params
        specs.append((rid, _prompt_tokens(prompt, text=is_text), _max_new_tokens(p)))
    return specs, batch


class _Prometheus(MetricsSink):
    """The ``sglang:`` metrics of ``--enable-metrics``, read live from the engine core.

    Tokenizer-side series carry the launch mode's ``engine_type``; scheduler gauges carry
    ``"dynamic"`` when role switching is on, so a series survives a flip (as in 0.5.23).
    """

    def __init__(self, config: EngineConfig, core_ref: Callable[[], EngineCore | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._labels = {"model_name": config.model_name, "engine_type": config.engine_type}
        names = list(self._labels)
        stream = [*names, "is_streaming"]
        reg = self.registry
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", stream, registry=reg
        )
        self.generation_tokens = Counter(
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            stream,
            registry=reg,
        )
        self.requests = Counter(
            "sglang:num_requests", "Number of requests processed.", stream, registry=reg
        )
        # 0.5.23 splits cached prompt tokens by where they were found; the double's only
        # cache is the shared KV store (the storage tier).
        self.cached_tokens = Counter(
            "sglang:cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            [*names, "cache_source"],
            registry=reg,
        )
        self.aborted = Counter(
            "sglang:num_aborted_requests", "Number of requests aborted.", names, registry=reg
        )
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            stream,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            names,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            stream,
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        reg.register(_SchedulerGauges(config, core_ref))

    def _stream(self, req: Request) -> dict[str, str]:
        return {**self._labels, "is_streaming": "true" if req.stream else "false"}

    def request_finished(self, req: Request) -> None:
        labels = self._stream(req)
        self.prompt_tokens.labels(**labels).inc(req.prompt_tokens)
        self.generation_tokens.labels(**labels).inc(len(req.output_ids))
        self.requests.labels(**labels).inc()
        if req.cached_tokens:
            self.cached_tokens.labels(**self._labels, cache_source="storage").inc(req.cached_tokens)
        if req.finished_at is not None:
            self.e2e.labels(**labels).observe(req.finished_at - req.created)

    def first_token(self, req: Request, seconds: float) -> None:
        if not req.health:
            self.ttft.labels(**self._stream(req)).observe(seconds)

    def inter_token(self, seconds: float, count: int) -> None:
        child = self.itl.labels(**self._labels)
        for _ in range(count):
            child.observe(seconds)

    def abort_call(self) -> None:
        self.aborted.labels(**self._labels).inc()


class _SchedulerGauges(Collector):
    GAUGES = (
        ("num_running_reqs", "The number of running requests."),
        ("num_queue_reqs", "The number of requests in the waiting queue."),
        ("num_used_tokens", "The number of used tokens."),
        ("token_usage", "The token usage."),
        ("gen_throughput", "The generation throughput (token/s)."),
        ("cache_hit_rate", "The prefix cache hit rate."),
        ("kv_used_tokens", "KV cache tokens in use."),
        ("kv_available_tokens", "KV cache tokens available."),
        ("max_total_num_tokens", "Maximum total number of tokens in the KV pool."),
        ("num_prefill_bootstrap_queue_reqs", "Requests in the prefill bootstrap queue."),
        ("num_prefill_inflight_queue_reqs", "Requests in the prefill inflight queue."),
        ("num_decode_prealloc_queue_reqs", "Requests in the decode prealloc queue."),
        ("num_decode_transfer_queue_reqs", "Requests in the decode transfer queue."),
        ("kv_transfer_speed_gb_s", "KV transfer speed in GB/s."),
        ("kv_transfer_latency_ms", "KV transfer latency in ms."),
    )

    def __init__(self, config: EngineConfig, core_ref: Callable[[], EngineCore | None]) -> None:
        self._config = config
        self._core = core_ref

    def collect(self) -> Iterator[Metric]:
        core = self._core()
        if core is None:
            return
        config = self._config
        labels = {
            "model_name": config.model_name,
            "engine_type": "dynamic" if config.enable_pd_role_switch else config.engine_type,
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        if config.dp_size > 1:
            labels["dp_rank"] = ""
        families = {
            name: GaugeMetricFamily(f"sglang:{name}", doc, labels=list(labels))
            for name, doc in self.GAUGES
        }
        for rank in core.ranks:
            load = rank.load()
            disagg = load["disaggregation"]
            values = {
                "num_running_reqs": load["num_running_reqs"],
                "num_queue_reqs": load["num_waiting_reqs"],
                "num_used_tokens": load["num_used_tokens"],
                "token_usage": load["token_usage"],
                "gen_throughput": load["gen_throughput"],
                "cache_hit_rate": load["cache_hit_rate"],
                "kv_used_tokens": load["num_used_tokens"],
                "kv_available_tokens": load["max_total_num_tokens"] - load["num_used_tokens"],
                "max_total_num_tokens": load["max_total_num_tokens"],
                "num_prefill_bootstrap_queue_reqs": disagg["prefill_bootstrap_queue_reqs"],
                "num_prefill_inflight_queue_reqs": disagg["prefill_inflight_queue_reqs"],
                "num_decode_prealloc_queue_reqs": disagg["decode_prealloc_queue_reqs"],
                "num_decode_transfer_queue_reqs": disagg["decode_transfer_queue_reqs"],
                "kv_transfer_speed_gb_s": disagg["kv_transfer_speed_gb_s"],
                "kv_transfer_latency_ms": disagg["kv_transfer_latency_ms"],
            }
            row = {**labels}
            if "dp_rank" in row:
                row["dp_rank"] = str(rank.index)
            for name, value in values.items():
                families[name].add_metric(list(row.values()), float(value))
        yield from families.values()


def _load_dict(load: dict[str, Any], include: set[str] | None) -> dict[str, Any]:
    """``LoadSnapshot.to_dict``: core scalars always, sections as ``include`` asks."""
    out = {k: v for k, v in load.items() if not isinstance(v, dict)}
    if include == {"core"}:
        return out
    everything = include is None or "all" in include
    for key, name in SECTIONS:
        section = load.get(key)
        if section is not None and (everything or name in (include or ())):
            out[key] = dict(section)
    return out


class EngineDouble:
    """A running SGLang 0.5.23 double on loopback.

    ``async with EngineDouble(EngineConfig(role="prefill")) as engine:`` binds an ephemeral
    port (``config.port = 0``) and ``engine.url`` is the base URL. :meth:`crash` makes it stop
    answering (or exit the process, for the CLI); :meth:`restart` brings a fresh engine back
    on the same port, in its launch role, like a restarted container.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        faults: Faults | None = None,
        exit_on_crash: bool = False,
    ) -> None:
        self.config = config or EngineConfig()
        self.faults = faults if faults is not None else Faults()
        self.faults.validate()
        self._exit_on_crash = exit_on_crash
        self.core: EngineCore | None = None
        self._metrics: _Prometheus | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._port = self.config.port
        self._dying: asyncio.Task[None] | None = None
        self._counters = Counters()
        self._background: set[asyncio.Task[None]] = set()
        self._bootstrap: web.AppRunner | None = None
        self._fetch_kv = KvFetcher()

    # ---------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        if self._runner is None and self.core is None:
            raise RuntimeError("the engine double is not started")
        host = self.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://[{host}]:{self._port}" if ":" in host else f"http://{host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    @property
    def role(self) -> str:
        return self._core().mode

    @property
    def unhealthy(self) -> bool:
        core = self._core()
        return core.unhealthy or core.broken or core.crashed

    def counters(self) -> Counters:
        return self._core().counters() if self.core is not None else self._counters

    def _core(self) -> EngineCore:
        if self.core is None:
            raise RuntimeError("the engine double is not started")
        return self.core

    async def start(self) -> str:
        if self._runner is not None:
            raise RuntimeError("already started")
        self._metrics = _Prometheus(self.config, lambda: self.core)
        self.core = EngineCore(
            self.config, self.faults, metrics=self._metrics, on_crash=self._on_crash
        )
        self.core.fetch_kv = self._fetch_kv
        self.core.start()
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024 * 1024)
        self._routes(app)
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self._port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            await self.core.stop()
            raise
        self._runner, self._site = runner, site
        if self._port == 0:
            self._port = int(runner.addresses[0][1])
        if self.config.serve_bootstrap and self._bootstrap is None:
            await self._serve_bootstrap()
        log.info("engine double (%s) listening on %s", self.core.mode, self.url)
        return self.url

    async def _serve_bootstrap(self) -> None:
        """The bootstrap port lives as long as the double (a restart keeps it, as the
        pod's network does); it answers for whichever core runs now."""
        app = bootstrap_app(lambda: self._core().rooms)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.bootstrap_port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            # A router then only warns; a decode peer's hand-off from here aborts.
            log.warning("bootstrap port %s unavailable: %s", self.config.bootstrap_port, exc)
            await runner.cleanup()
            return
        self._bootstrap = runner

    async def stop(self) -> None:
        if self.core is not None:
            self._counters = self.core.counters()
            await self.core.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = self._site = None

    async def close(self) -> None:
        """Stop for good: also the bootstrap port and the KV client."""
        await self.stop()
        if self._bootstrap is not None:
            await self._bootstrap.cleanup()
            self._bootstrap = None
        await self._fetch_kv.close()

    async def __aenter__(self) -> EngineDouble:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def crash(self) -> None:
        """Stop answering at once: the listener closes and open connections are reset."""
        await self._core().crash()

    async def restart(self) -> str:
        """A fresh engine on the same port, in the launch role; counters carry over."""
        previous = self.counters()
        if self.core is not None and not self.core.crashed:
            await self.crash()
        await self.stop()
        self.core = None
        url = await self.start()
        self._core().note_restart(previous)
        return url

    def _on_crash(self) -> Awaitable[None]:
        if self._exit_on_crash:
            log.error("engine double: injected crash, exiting with %d", CRASH_EXIT_CODE)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)
        if self._dying is None:
            self._dying = asyncio.create_task(self._die())
        return asyncio.shield(self._dying)

    async def _die(self) -> None:
        core, runner, site = self.core, self._runner, self._site
        if site is not None:
            await site.stop()
        if runner is not None and runner.server is not None:
            for handler in list(runner.server.connections):
                if handler.transport is not None:
                    handler.transport.abort()
        if core is not None:
            await core.stop()
        self._dying = None

    # ---------------------------------------------------------------- HTTP
    def _routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/health", self._health)
        r.add_get("/health_generate", self._health)
        r.add_get("/ready", self._ready)
        r.add_get("/server_info", self._server_info)
        r.add_get("/get_server_info", self._server_info)
        r.add_get("/model_info", self._model_info)
        r.add_get("/v1/loads", self._loads)
        r.add_post("/generate", self._generate)
        r.add_put("/generate", self._generate)
        r.add_post("/abort_request", self._abort)
        r.add_post("/pd_role_switch", self._pd_role_switch)
        r.add_post("/pause_generation", self._pause)
        r.add_post("/continue_generation", self._continue)
        if self.config.enable_metrics:
            r.add_get("/metrics", self._prometheus)
        r.add_get("/_double/counters", self._double_counters)
        r.add_get("/_double/faults", self._double_faults)
        r.add_post("/_double/faults", self._double_faults)
        r.add_post("/_double/crash", self._double_crash)

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """SGLang's ``decide_request_auth``: probes and metrics are always open."""
        path = request.path
        if request.method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
            return await handler(request)
        api_key, admin_key = self.config.api_key, self.config.admin_api_key
        header = request.headers.get("Authorization")
        if path in ADMIN_PATHS or path.startswith("/_double/"):
            key = admin_key or api_key
        else:
            key = api_key
        if key is not None and not _bearer_ok(header, key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        del request
        core = self._core()
        if core.starting:
            return web.Response(status=503)
        healthy = await core.health_generate()
        return web.Response(status=200 if healthy else 503)

    async def _ready(self, request: web.Request) -> web.Response:
        del request
        core = self._core()
        return web.Response(status=503 if core.starting or core.paused else 200)

    def _server_args(self, core: EngineCore) -> dict[str, Any]:
        c = self.config
        return {
            "model_path": c.model_path,
            "tokenizer_path": c.model_path,
            "served_model_name": c.model_name,
            "host": c.host,
            "port": self._port,
            "tp_size": c.tp_size,
            "dp_size": c.dp_size,
            "pp_size": 1,
            "ep_size": 1,
            "context_length": c.context_length,
            "max_running_requests": c.max_running_requests,
            "chunked_prefill_size": c.timing.max_prefill_tokens,
            "disaggregation_mode": core.mode,
            "enable_pd_role_switch": c.enable_pd_role_switch,
            "disaggregation_transfer_backend": c.transfer_backend,
            "disaggregation_bootstrap_port": c.bootstrap_port,
            "enable_metrics": c.enable_metrics,
            "weight_version": "default",
            "incremental_streaming_output": c.incremental_streaming_output,
            # As SGLang 0.5.23 serves them: in clear, on an endpoint open to anyone who
            # reaches the port (it redacts only watermark secrets; docs/security.md).
            "api_key": c.api_key,
            "admin_api_key": c.admin_api_key,
        }

    def _internal_state(self, core: EngineCore) -> dict[str, Any]:
        c = self.config
        return {
            **self._server_args(core),
            "world_size": c.tp_size * c.dp_size,
            "startup_time": core.startup_time,
            "effective_max_running_requests_per_dp": c.max_running_requests,
            "last_gen_throughput": sum(r.load()["gen_throughput"] for r in core.ranks),
            "memory_usage": {
                "weight": round(c.weight_gb, 3),
                "kvcache": round(c.kv_cache_gb, 3),
                "startup_available": round(c.available_gpu_memory_gb, 3),
                "token_capacity": c.kv_capacity_tokens,
                "token_capacity_swa": None,
                "graph": core.graph_memory,
            },
            "disaggregation_mode": core.mode,
            "decode_cuda_graph_bs": list(core.graph_bs),
            "decode_cuda_graph_memory_gb": round(core.graph_memory_gb, 3),
        }

    async def _server_info(self, request: web.Request) -> web.Response:
        del request
        core = self._core()
        c = self.config
        body = {
            **self._server_args(core),
            "launch_command": c.launch_command,
            "max_total_num_tokens": c.kv_capacity_tokens,
            "max_req_input_len": min(c.context_length, c.kv_capacity_tokens) - 1,
            "kv_events": None,
            "startup_time": core.startup_time | {"tokenizer_e2e": 0.0},
            "internal_states": [self._internal_state(core) for _ in core.ranks],
            "version": SGLANG_VERSION,
            "frontend": "python",
        }
        return web.json_response(body)

    async def _model_info(self, request: web.Request) -> web.Response:
        del request
        c = self.config
        return web.json_response(
            {
                "model_path": c.model_path,
                "served_model_name": c.model_name,
                "tokenizer_path": c.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": self._core().mode,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "engine_double",
                "architectures": ["EngineDouble"],
            }
        )

    async def _loads(self, request: web.Request) -> web.Response:
        core = self._core()
        while core.faults.hang_loads:
            await asyncio.sleep(0.05)
        q = request.query
        include = {s.strip() for s in q["include"].split(",")} if q.get("include") else None
        if include is not None and "all" not in include and not include <= VALID_SECTIONS:
            bad = include - VALID_SECTIONS
            detail = f"Invalid include sections: {bad}. Valid options: {sorted(VALID_SECTIONS)}"
            return web.json_response({"detail": detail}, status=400)
        ranks = core.ranks
        if q.get("dp_rank") is not None:
            try:
                wanted = int(q["dp_rank"])
            except ValueError:
                return _unprocessable([{"loc": ["query", "dp_rank"], "msg": "not an int"}])
            if not 0 <= wanted < len(ranks):
                return web.json_response(
                    {"detail": f"dp_rank {wanted} out of range [0, {len(ranks)})"}, status=400
                )
            ranks = [ranks[wanted]]
        loads = [_load_dict(rank.load(), include) for rank in ranks]
        if q.get("format") == "prometheus":
            return web.Response(
                text=_loads_prometheus(loads),
                content_type="text/plain",
                charset="utf-8",
            )
        return web.json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": SGLANG_VERSION,
                "accelerator": self.config.accelerator,
                "num_accelerators": self.config.tp_size,
                "loads": loads,
            }
        )

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await _read_json(request)
        if not isinstance(body, dict):
            return _unprocessable([{"loc": ["body"], "msg": "Input should be an object"}])
        core = self._core()
        if core.starting:
            return _error("The server is not ready yet.", status=503)
        try:
            specs, batch = parse_generate(body)
            stream = bool(body.get("stream", False))
            if batch and stream:
                raise GenerateError("the engine double does not stream batched requests")
            reqs: list[Request] = []
            bootstrap = None if batch else Bootstrap.from_body(body)
            dp_rank = routed_dp_rank(body, len(core.ranks))
            ids: Any = body.get("input_ids")
            ids_of: list[Any] = (
                (ids if batch else [ids]) if ids is not None else [None] * len(specs)
            )
            extra_key = body.get("extra_key")
            if extra_key is not None and not isinstance(extra_key, str):
                raise GenerateError("extra_key must be a string")
            try:
                for i, (rid, prompt, max_new) in enumerate(specs):
                    reqs.append(
                        core.submit(
                            rid=rid,
                            prompt_tokens=prompt,
                            max_new_tokens=max_new,
                            stream=stream,
                            bootstrap=bootstrap,
                            dp_rank=dp_rank,
                            input_ids=list(ids_of[i]) if ids_of[i] is not None else None,
                            extra_key=extra_key,
                        )
                    )
            except GenerateError:
                for req in reqs:
                    core.drop(req)
                raise
        except GenerateError as exc:
            return _error(str(exc))
        except EngineCrashed:
            return await self._dead(request)
        if stream:
            return await self._stream(request, reqs[0])
        try:
            for req in reqs:
                await _wait_finished(req)
        except BaseException:
            for req in reqs:
                core.drop(req)
            raise
        if any(req.crashed for req in reqs):
            return await self._dead(request)
        outputs = [req.output() for req in reqs]
        return web.json_response(outputs if batch else outputs[0])

    async def _stream(self, request: web.Request, req: Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        sent = 0
        incremental = self.config.incremental_streaming_output
        try:
            while True:
                req.updated.clear()
                if req.crashed:
                    return await self._dead(request)
                new = len(req.output_ids) - sent
                due = new > 0 and (sent == 0 or new >= self.config.stream_interval)
                if req.finish_reason is not None or due:
                    chunk = req.output(since=sent if incremental else 0)
                    sent = len(req.output_ids)
                    await response.write(b"data: " + _dumps(chunk) + b"\n\n")
                    if req.finish_reason is not None:
                        break
                await req.updated.wait()
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except BaseException:
            if self.core is not None:
                self.core.drop(req)
            raise
        return response

    async def _dead(self, request: web.Request) -> web.Response:
        """What a client of a dead engine sees: the connection is reset."""
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=503)

    async def _abort(self, request: web.Request) -> web.Response:
        try:
            obj = AbortReq.model_validate(await _read_json(request))
        except ValidationError as exc:
            return _unprocessable(_errors(exc))
        self._core().abort(rid=obj.rid or "", abort_all=obj.abort_all)
        return web.Response(status=200)

    async def _pd_role_switch(self, request: web.Request) -> web.Response:
        try:
            obj = PdRoleSwitchReqInput.model_validate(await _read_json(request))
        except ValidationError as exc:
            return _unprocessable(_errors(exc))
        try:
            result = await self._core().pd_role_switch(
                new_role=obj.new_role,
                decode_cuda_graph_bs=obj.decode_cuda_graph_bs,
                decode_cuda_graph_memory_gb=obj.decode_cuda_graph_memory_gb,
                prepare_only=obj.prepare_only,
            )
        except EngineCrashed:
            return await self._dead(request)
        return web.json_response(result, status=200 if result["success"] else 400)

    async def _pause(self, request: web.Request) -> web.Response:
        try:
            obj = PauseGenerationReqInput.model_validate(await _read_json(request))
        except ValidationError as exc:
            return _unprocessable(_errors(exc))
        self._core().pause(obj.mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        del request
        self._core().resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _prometheus(self, request: web.Request) -> web.Response:
        del request
        assert self._metrics is not None
        return web.Response(
            body=generate_latest(self._metrics.registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def _double_counters(self, request: web.Request) -> web.Response:
        del request
        core = self._core()
        body = {
            **self.counters().wire(),
            "role": core.mode,
            "unhealthy": core.unhealthy or core.broken,
            "idle": core.idle,
            "open_requests": len(core.requests),
        }
        return web.json_response(body)

    async def _double_faults(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            values = await _read_json(request)
            if not isinstance(values, dict):
                return _error("the faults body must be an object")
            try:
                self.faults.update(values)
            except ValueError as exc:
                return _error(str(exc))
        return web.json_response({k: v for k, v in vars(self.faults).items()})

    async def _double_crash(self, request: web.Request) -> web.Response:
        """Crash shortly after answering, so the caller learns that the request landed."""
        del request

        async def later() -> None:
            await asyncio.sleep(0.05)
            with contextlib.suppress(Exception):
                await self.crash()

        task = asyncio.create_task(later())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return web.json_response({"crashing": True}, status=202)


def _bearer_ok(header: str | None, expected: str) -> bool:
    token = bearer_token(header)
    return token is not None and secrets.compare_digest(token, expected)


def _errors(exc: ValidationError) -> list[dict[str, Any]]:
    return [{"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]} for e in exc.errors()]


async def _wait_finished(req: Request) -> None:
    while not req.finished:
        req.updated.clear()
        if req.finished:
            break
        await req.updated.wait()


def _loads_prometheus(loads: list[dict[str, Any]]) -> str:
    """``/v1/loads?format=prometheus`` (``_format_loads_prometheus`` of 0.5.23)."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        load = dict(load)
        rank = load.pop("dp_rank")
        for key, value in load.items():
            if isinstance(value, dict):
                prefix = prefixes.get(key, key)
                for sub, sub_value in value.items():
                    if isinstance(sub_value, int | float) and not isinstance(sub_value, bool):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((rank, sub_value))
            elif isinstance(value, int | float) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, rows in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in rows)
    return "\n".join(lines) + "\n"
