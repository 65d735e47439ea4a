"""The simulated engine behind the SGLang double: scheduler, KV accounting, role switching.

No HTTP here: :mod:`prorsa_lab.doubles.engine.server` puts SGLang 0.5.23's endpoints in front of
:class:`EngineCore`. The behaviour copies the parts of SGLang that an agent, a router and an
operator can observe (read from the 0.5.23 wheel: ``srt/disaggregation/role_switch.py``,
``srt/managers/scheduler.py``, ``tokenizer_control_mixin.py``, ``load_inquirer.py``):

* every DP rank runs a scheduler loop; prefill batches take time by prompt length, decode
  steps by batch size (:class:`TimingModel`), KV tokens are allocated and freed as requests
  move through the queues;
* in the ``prefill`` role a request is prefilled, its KV "transferred" and it finishes with
  one token (``finish_reason`` ``{"type": "length", "length": 0}``, as SGLang's PD prefill);
  in ``decode`` it waits for its KV (a transfer delay), then decodes; ``null`` does both;
* ``/abort_request`` pops queued requests (``"Abort in waiting queue"``) and marks running
  ones to finish after the current step with the tokens produced so far;
* ``/pd_role_switch`` runs SGLang's checks in SGLang's order, refuses unless every rank is
  fully idle, and a failed teardown leaves the instance unhealthy for good.

Faults (:class:`Faults`) can be changed while the engine runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from prorsa_lab.doubles.engine.kv_handoff import Bootstrap, KvRooms
from prorsa_lab.doubles.engine.kv_store import PageStore

SGLANG_VERSION = "0.5.23"
Mode = Literal["prefill", "decode", "null"]
SwitchFailure = Literal["safe", "unsafe"]
log = logging.getLogger("prorsa_lab.doubles.sglang_double")
ROLE_SWITCH_BACKENDS = frozenset({"mooncake", "mori", "fake"})
"""Transfer backends whose KV manager supports runtime role switching (fake has none)."""

GRAPH_PHASES = (
    "prefill",
    "decode",
    "target_verify",
    "draft_prefill",
    "draft_decode",
    "draft_extend",
)
NOT_IDLE = "instance is not idle; drain all requests before switching"
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}
KV_FAILED = {
    "type": "abort",
    "message": "KV transfer failed: the prefill of this bootstrap room was aborted",
    "status_code": None,
    "err_type": None,
}
HEALTH_POLL_SECONDS = 0.05
"""How often a health check looks for output (SGLang: every 1 s; shorter keeps tests fast)."""
KvFetch = Callable[[Bootstrap], Awaitable[bool]]
"""The decode side of the hand-off: True once the room's KV has arrived."""


@dataclass(frozen=True, kw_only=True)
class TimingModel:
    """How long the simulated GPU work takes (seconds). Defaults are a fast, small engine.

    A prefill batch of ``n`` prompt tokens takes ``prefill_overhead + n / prefill_tps``; a
    decode step over ``b`` running requests takes ``decode_step + b * decode_step_per_request``.
    With ``prefill_cost_doubling_tokens`` L > 0, attention makes the token at prompt position
    p cost 1 + p/L times one at the start (the cost model of ``capacity.
    prefillCostDoublingTokens``): a prompt of n tokens takes n·(1 + n/2L) / prefill_tps.
    """

    prefill_tokens_per_second: float = 200_000.0
    prefill_overhead_seconds: float = 0.001
    prefill_cost_doubling_tokens: float = 0.0  # 0: every prompt token costs the same
    max_prefill_tokens: int = 16_384
    decode_step_seconds: float = 0.004
    decode_step_seconds_per_request: float = 0.00005
    kv_transfer_seconds: float = 0.001
    kv_transfer_tokens_per_second: float = 20_000_000.0
    switch_seconds: float = 0.02
    graph_capture_seconds: float = 0.02
    startup_seconds: float = 0.0
    health_check_timeout_seconds: float = 20.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"TimingModel.{f.name} must be finite and >= 0, got {value}")
        if self.prefill_tokens_per_second <= 0 or self.kv_transfer_tokens_per_second <= 0:
            raise ValueError("token rates must be > 0")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")

    def prefill_seconds(self, tokens: int) -> float:
        return self.prefill_overhead_seconds + tokens / self.prefill_tokens_per_second

    def prefill_batch_seconds(self, prompts: Iterable[int]) -> float:
        """One prefill batch of these uncached prompts, attention's growth included."""
        doubling = self.prefill_cost_doubling_tokens
        work = sum(n * (1.0 + n / (2.0 * doubling)) if doubling else n for n in prompts)
        return self.prefill_overhead_seconds + work / self.prefill_tokens_per_second

    def decode_seconds(self, batch: int) -> float:
        return self.decode_step_seconds + batch * self.decode_step_seconds_per_request

    def transfer_seconds(self, tokens: int) -> float:
        return self.kv_transfer_seconds + tokens / self.kv_transfer_tokens_per_second


@dataclass(kw_only=True)
class Faults:
    """Failure injection. Mutable on purpose: a test flips a fault while the engine runs.

    * ``switch_failure``: the next ``switch_failure_count`` switches fail, ``"safe"`` before
      teardown (HTTP 400, ``safe_to_restore: true``) or ``"unsafe"`` during it (400,
      ``safe_to_restore: false``, instance unhealthy until restarted).
    * ``busy_on_switch``: the next N switches see a request that raced in (``not idle``).
    * ``busy_seconds_on_switch``: switches see ``not idle`` for this many seconds after the
      engine's first switch call (once in its life), while ``/v1/loads`` shows nothing:
      SGLang's idle check (``Scheduler.is_fully_idle``) also waits for its last batch, a
      transfer queue's deferred KV releases and KV offloads, which no load field counts.
    * ``crash_on_switch``: the engine dies when ``/pd_role_switch`` arrives.
    * ``hang_on_switch``: ``/pd_role_switch`` never answers.
    * ``unhealthy_after_switch``: the switch reports success but the engine no longer
      generates (``/health_generate`` times out with 503).
    * ``step_time_multiplier``: slows every prefill batch and decode step (a slow drain).
    * ``hang_loads``: ``/v1/loads`` answers only once the fault is cleared (a scheduler
      stuck in a collective: the agent's ``/v1/state`` then outlasts the operator's poll).
    """

    switch_failure: SwitchFailure | None = None
    switch_failure_count: int = 1
    busy_on_switch: int = 0
    busy_seconds_on_switch: float = 0.0
    crash_on_switch: bool = False
    hang_on_switch: bool = False
    unhealthy_after_switch: bool = False
    step_time_multiplier: float = 1.0
    hang_loads: bool = False

    def update(self, values: dict[str, Any]) -> None:
        """Apply a partial update (the ``POST /_double/faults`` body); unknown keys fail."""
        known = {f.name: f for f in fields(self)}
        checked = replace(self)
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {sorted(known)}")
            setattr(checked, key, value)
        checked.validate()
        for key in values:
            setattr(self, key, getattr(checked, key))

    def validate(self) -> None:
        if self.switch_failure not in (None, "safe", "unsafe"):
            raise ValueError("switch_failure must be null, 'safe' or 'unsafe'")
        for name in ("switch_failure_count", "busy_on_switch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0")
        for name in ("crash_on_switch", "hang_on_switch", "unhealthy_after_switch", "hang_loads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean")
        busy = self.busy_seconds_on_switch
        if not isinstance(busy, int | float) or not math.isfinite(busy) or busy < 0:
            raise ValueError("busy_seconds_on_switch must be a finite number >= 0")
        mult = self.step_time_multiplier
        if not isinstance(mult, int | float) or not math.isfinite(mult) or mult <= 0:
            raise ValueError("step_time_multiplier must be a finite number > 0")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The launch configuration; names follow SGLang's server arguments where one exists."""

    role: Mode = "decode"
    enable_pd_role_switch: bool = True
    transfer_backend: str = "mooncake"
    bootstrap_port: int = 8998
    model_path: str = "prorsa/engine-double"
    served_model_name: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    kv_capacity_tokens: int = 200_000
    """``max_total_num_tokens`` of each DP rank."""
    max_running_requests: int = 256
    context_length: int = 131_072
    enable_metrics: bool = True
    api_key: str | None = None
    admin_api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    timing: TimingModel = field(default_factory=TimingModel)
    decode_cuda_graph_bs: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    decode_cuda_graph_memory_gb: float = 1.25
    available_gpu_memory_gb: float = 6.0
    weight_gb: float = 15.0
    kv_cache_gb: float = 60.0
    vocab_size: int = 32_000
    accelerator: str | None = "engine-double"
    launch_command: str = ""
    incremental_streaming_output: bool = False
    """SGLang's ``--incremental-streaming-output``: each streamed chunk carries only the new
    tokens (by default every chunk repeats the whole output so far)."""
    stream_interval: int = 1
    """SGLang's ``--stream-interval``: a stream sends the first token, then a chunk every
    this many tokens, and the last one."""
    kv_store_dir: str | None = None
    """The cluster's shared KV store (``spec.kvStore`` with the file backend): HiCache's
    storage tier, shared by every double given the same directory
    (:mod:`prorsa_lab.doubles.engine.kv_store`). With it, a request given as ``input_ids``
    finds its whole pages there (``cached_tokens``; only the rest is prefilled), the pages it
    computed are stored, and its output tokens follow from its whole context, as a greedy
    model's do, so a request resumed from ``prompt + partial output`` continues token for
    token."""
    kv_page_size: int = 16
    """SGLang's ``--page-size`` of the store's pages."""
    kv_prefetch_threshold: int = 256
    """SGLang's HiCache ``prefetch_threshold`` (default 256 tokens,
    ``hybrid_cache_controller.py`` ``parse_storage_backend_extra_config``): a store hit
    shorter than this is not fetched; those tokens are prefilled."""
    kv_store_clears_on_flip: bool = False
    """A role flip clears the store, as SGLang's own file backend does (``HiCacheFile.clear``);
    the shipped backend keeps it (``prorsa_agent.kv_backend``)."""
    serve_bootstrap: bool = False
    """Serve the KV hand-off's bootstrap port (:mod:`prorsa_lab.doubles.engine.kv_handoff`) on
    ``host:bootstrap_port``, as SGLang's prefill side does; a PD router needs it."""

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "null"):
            raise ValueError(f"role must be prefill, decode or null, got {self.role!r}")
        for name in (
            "tp_size",
            "dp_size",
            "kv_capacity_tokens",
            "max_running_requests",
            "stream_interval",
            "kv_page_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def engine_type(self) -> str:
        """SGLang's ``DisaggregationMode.to_engine_type`` of the launch mode."""
        return "unified" if self.role == "null" else self.role


@dataclass(frozen=True, kw_only=True)
class Counters:
    """What the double has done since it (re)started; for assertions in tests."""

    requests_received: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens found in the KV store instead of prefilled."""
    prefill_busy_seconds: float = 0.0
    abort_calls: int = 0
    switch_calls: int = 0
    switches_ok: int = 0
    switches_failed: int = 0
    health_checks: int = 0
    crashes: int = 0
    restarts: int = 0

    def wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _report_loop_death(task: asyncio.Task[None]) -> None:
    """A scheduler loop must only end by cancellation; anything else is a bug to surface."""
    if not task.cancelled() and task.exception() is not None:
        log.error("engine double scheduler loop died", exc_info=task.exception())


class EngineCrashed(Exception):
    """The engine stopped answering (injected crash); open requests are dropped."""


class GenerateError(ValueError):
    """A ``/generate`` request SGLang would refuse with HTTP 400."""


def token_id(rid: str, index: int, vocab: int) -> int:
    """A deterministic output token: the same request and position give the same token."""
    return (zlib.crc32(rid.encode()) + 7919 * index) % vocab


def _token_bytes(tokens: list[int]) -> bytes:
    return b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)


def token_text(tok: int) -> str:
    return f" t{tok}"


@dataclass(eq=False)
class Request:
    """One generation request inside the double (an SGLang ``Req`` plus its ``ReqState``)."""

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    stream: bool = False
    health: bool = False
    rank: int = 0
    created: float = field(default_factory=time.monotonic)
    created_wall: float = field(default_factory=time.time)
    output_ids: list[int] = field(default_factory=list)
    phase: str = "waiting"
    finish_reason: dict[str, Any] | None = None
    to_finish: dict[str, Any] | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    last_token_at: float | None = None
    kv_held: int = 0
    kv_reserved: int = 0
    ready_at: float = 0.0
    crashed: bool = False
    bootstrap: Bootstrap | None = None
    prefill_side: bool = False  # submitted in the prefill role: its end resolves the room
    kv_wait: asyncio.Task[None] | None = None
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    input_ids: list[int] | None = None
    extra_key: str | None = None
    cached_tokens: int = 0
    context: int = 0
    """CRC-32 of the context so far (prompt and output): the next token with a KV store."""

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.crashed

    @property
    def text(self) -> str:
        return "".join(token_text(t) for t in self.output_ids)

    def meta_info(self) -> dict[str, Any]:
        """SGLang's ``meta_info`` for this request (the tokenizer manager's key set)."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
        }
        if self.finished_at is not None:
            meta["e2e_latency"] = self.finished_at - self.created
        return meta

    def output(self, since: int = 0) -> dict[str, Any]:
        """The reply; ``since`` > 0 leaves out the first ``since`` tokens (a chunk of
        SGLang's ``--incremental-streaming-output``)."""
        ids = self.output_ids[since:]
        return {
            "text": "".join(token_text(t) for t in ids),
            "output_ids": list(ids),
            "meta_info": self.meta_info(),
        }


class MetricsSink:
    """What the engine reports as it runs; the HTTP server's Prometheus metrics implement it.

    The default does nothing, so the model runs without prometheus_client.
    """

    def request_finished(self, req: Request) -> None: ...

    def first_token(self, req: Request, seconds: float) -> None: ...

    def inter_token(self, seconds: float, count: int) -> None: ...

    def abort_call(self) -> None: ...


class Rank:
    """One DP rank's scheduler: queues, KV pool and the loop that runs batches."""

    def __init__(self, core: EngineCore, index: int) -> None:
        self.core = core
        self.index = index
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.inflight: list[Request] = []
        self.transfer: list[Request] = []
        self.running: list[Request] = []
        self.kv_used = 0
        self.kv_reserved = 0
        self.total_prefill_tokens = 0
        self.total_prefill_busy_us = 0
        # SGLang 0.5.23's decode step-time moment sums (scheduler.py _accumulate_decode_moment):
        # steps, Σ batch, Σ step µs, Σ batch², Σ batch·step µs, Σ generated tokens.
        self.decode_moments = [0.0] * 6
        self.wake = asyncio.Event()
        self.last_output_at = 0.0
        self._busy: deque[tuple[float, float, int]] = deque()  # (end, seconds, gen tokens)
        self.task: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- observation
    @property
    def capacity(self) -> int:
        return self.core.config.kv_capacity_tokens

    def requests(self) -> Iterable[Request]:
        yield from self.waiting
        yield from self.prefilling
        yield from self.inflight
        yield from self.transfer
        yield from self.running

    def is_idle(self) -> bool:
        return not any(True for _ in self.requests())

    def _window(self, now: float, seconds: float = 5.0) -> tuple[float, int]:
        while self._busy and self._busy[0][0] < now - seconds:
            self._busy.popleft()
        return sum(b for _, b, _ in self._busy), sum(t for _, _, t in self._busy)

    def load(self) -> dict[str, Any]:
        """The rank's ``LoadSnapshot`` as ``/v1/loads`` returns it (every section)."""
        core = self.core
        now = time.monotonic()
        busy, generated = self._window(now)
        mode = core.mode
        waiting_prefill = mode in ("prefill", "null")
        pending = sum(r.prompt_tokens for r in self.waiting)
        if mode == "decode":
            num_waiting = len(self.waiting) + len(self.transfer)
            total = self.kv_used + pending
            active = max(0, total - sum(r.prompt_tokens for r in self.transfer))
        else:
            num_waiting = len(self.waiting)
            total = self.kv_used + (pending if mode == "prefill" else 0)
            active = total
        running = len(self.running) + len(self.prefilling)
        return {
            "timestamp": time.time(),
            "dp_rank": self.index,
            "num_running_reqs": running,
            "num_waiting_reqs": num_waiting,
            "num_waiting_uncached_tokens": pending if waiting_prefill else 0,
            "num_used_tokens": self.kv_used,
            "num_total_tokens": total,
            "num_active_tokens": active,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self.capacity,
            "max_running_requests": core.config.max_running_requests,
            "token_usage": round(self.kv_used / self.capacity, 4),
            "gen_throughput": round(generated / 5.0, 2),
            "cache_hit_rate": 0.0,
            "utilization": round(min(1.0, busy / 5.0), 4),
            "total_prefill_uncached_tokens": self.total_prefill_tokens,
            "total_prefill_busy_us": self.total_prefill_busy_us,
            "decode_moments": list(self.decode_moments) if self.decode_moments[0] else None,
            "memory": {
                "weight_gb": core.config.weight_gb,
                "kv_cache_gb": core.config.kv_cache_gb,
                "graph_gb": round(core.graph_memory_gb, 3),
                "token_capacity": self.capacity,
            },
            "disaggregation": {
                "mode": mode,
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": len(self.inflight) if mode == "prefill" else 0,
                "decode_prealloc_queue_reqs": len(self.waiting) if mode == "decode" else 0,
                "decode_transfer_queue_reqs": len(self.transfer) if mode == "decode" else 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
            "queues": {
                "waiting": len(self.waiting),
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            },
        }

    # ---------------------------------------------------------------- scheduling
    def notify(self) -> None:
        self.wake.set()

    async def run(self) -> None:
        core = self.core
        while True:
            if not core.can_schedule():
                await self._sleep_until_woken(None)
                continue
            now = time.monotonic()
            self._complete_transfers(now)
            if core.mode == "decode":
                self._admit_decode(now)
            batch = self._take_prefill_batch() if core.mode != "decode" else []
            if batch:
                await self._prefill(batch)
            elif self.running:
                await self._decode_step()
            else:
                due = [
                    r.ready_at
                    for r in (*self.inflight, *self.transfer)
                    if r.ready_at != math.inf  # still waiting for its prefill's KV
                ]
                await self._sleep_until_woken(max(0.0, min(due) - now) if due else None)

    async def _sleep_until_woken(self, timeout: float | None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout)
        self.wake.clear()

    def _free(self) -> int:
        return self.capacity - self.kv_reserved

    def _take_prefill_batch(self) -> list[Request]:
        timing = self.core.config.timing
        batch: list[Request] = []
        tokens = 0
        while self.waiting:
            req = self.waiting[0]
            need = req.prompt_tokens + (req.max_new_tokens if self.core.mode == "null" else 0)
            if batch and tokens + req.prompt_tokens > timing.max_prefill_tokens:
                break
            if need > self._free():
                break
            if self.core.mode == "null" and len(self.running) + len(batch) >= (
                self.core.config.max_running_requests
            ):
                break
            self.waiting.popleft()
            req.phase = "prefill"
            req.kv_reserved = need
            req.kv_held = req.prompt_tokens
            self.kv_reserved += need
            self.kv_used += req.prompt_tokens
            batch.append(req)
            tokens += req.prompt_tokens
        # A copy: a health check that gives up mid-prefill leaves the queue, not the batch
        # on the GPU, whose forward pass still produces its token (SGLang aborts after it).
        self.prefilling = list(batch)
        return batch

    def _admit_decode(self, now: float) -> None:
        timing = self.core.config.timing
        limit = self.core.config.max_running_requests
        while self.waiting and len(self.running) + len(self.transfer) < limit:
            req = self.waiting[0]
            need = req.prompt_tokens + req.max_new_tokens
            if need > self._free():
                break
            self.waiting.popleft()
            req.phase = "transfer"
            req.kv_reserved = need
            req.kv_held = req.prompt_tokens
            self.kv_reserved += need
            self.kv_used += req.prompt_tokens
            fetch = self.core.fetch_kv
            if req.bootstrap is not None and fetch is not None and not req.health:
                # The KV comes from the prefill peer of the same room (prefill + transfer).
                req.ready_at = math.inf
                req.kv_wait = asyncio.create_task(self.core.await_kv(req, fetch))
            else:
                delay = 0.0 if req.health else timing.transfer_seconds(req.prompt_tokens)
                req.ready_at = now + delay
            self.transfer.append(req)

    def _complete_transfers(self, now: float) -> None:
        for req in [r for r in self.inflight if r.ready_at <= now]:
            self.inflight.remove(req)
            self.core.finish(req, {"type": "length", "length": 0})
        for req in [r for r in self.transfer if r.ready_at <= now]:
            self.transfer.remove(req)
            if req.max_new_tokens == 0:
                self.core.finish(req, {"type": "length", "length": 0})
                continue
            # The first token was sampled by the prefill peer and arrives with the KV.
            self._emit(req, now)
            if len(req.output_ids) >= req.max_new_tokens:
                self.core.finish(req, {"type": "length", "length": req.max_new_tokens})
            else:
                req.phase = "running"
                self.running.append(req)

    def _emit(self, req: Request, now: float) -> None:
        vocab = self.core.config.vocab_size
        if req.input_ids is not None and self.core.store is not None:
            tok = req.context % vocab
            req.context = zlib.crc32(_token_bytes([tok]), req.context)
        else:
            tok = token_id(req.rid, len(req.output_ids), vocab)
        req.output_ids.append(tok)
        if req.first_token_at is None:
            req.first_token_at = now
            self.core.metrics.first_token(req, now - req.created)
        req.last_token_at = now
        self.kv_used += 1 if req.phase == "running" else 0
        req.kv_held += 1 if req.phase == "running" else 0
        self.last_output_at = now
        req.updated.set()

    async def _work(self, seconds: float) -> float:
        start = time.monotonic()
        await asyncio.sleep(seconds * self.core.faults.step_time_multiplier)
        return time.monotonic() - start

    async def _prefill(self, batch: list[Request]) -> None:
        tokens = sum(r.uncached_tokens for r in batch)
        mode = self.core.mode
        timing = self.core.config.timing
        try:
            elapsed = await self._work(
                timing.prefill_batch_seconds(r.uncached_tokens for r in batch)
            )
        finally:
            self.prefilling = []
        now = time.monotonic()
        self.total_prefill_tokens += tokens
        self.total_prefill_busy_us += int(elapsed * 1e6)
        self.core.note_prefill(tokens, elapsed)
        self._busy.append((now, elapsed, 0))
        for req in batch:
            self.core.store_pages(req, req.input_ids)
            if req.finished:
                continue
            if req.to_finish is not None:
                self.core.finish(req, req.to_finish)
                continue
            if mode == "prefill" or req.max_new_tokens > 0:
                self._emit(req, now)
            if mode == "prefill":
                if req.health:
                    self.core.finish(req, {"type": "length", "length": 0})
                else:
                    req.phase = "inflight"
                    req.ready_at = now + self.core.config.timing.transfer_seconds(req.prompt_tokens)
                    self.inflight.append(req)
            elif len(req.output_ids) >= req.max_new_tokens:
                self.core.finish(req, {"type": "length", "length": req.max_new_tokens})
            else:
                req.phase = "running"
                self.running.append(req)

    async def _decode_step(self) -> None:
        batch = list(self.running)
        elapsed = await self._work(self.core.config.timing.decode_seconds(len(batch)))
        now = time.monotonic()
        produced = 0
        for req in batch:
            if req.finished or req.phase != "running":
                continue
            self._emit(req, now)
            produced += 1
            if req.to_finish is not None:
                self.core.finish(req, req.to_finish)
            elif len(req.output_ids) >= req.max_new_tokens:
                self.core.finish(req, {"type": "length", "length": req.max_new_tokens})
        self._busy.append((now, elapsed, produced))
        self.core.metrics.inter_token(elapsed, produced)
        if batch and produced:
            b, t = float(len(batch)), float(int(elapsed * 1e6))
            for i, value in enumerate((1.0, b, t, b * b, b * t, float(produced))):
                self.decode_moments[i] += value

    # ---------------------------------------------------------------- removal
    def remove(self, req: Request) -> None:
        for queue in (self.prefilling, self.inflight, self.transfer, self.running):
            if req in queue:
                queue.remove(req)
        with contextlib.suppress(ValueError):
            self.waiting.remove(req)
        self.kv_used -= req.kv_held
        self.kv_reserved -= req.kv_reserved
        req.kv_held = req.kv_reserved = 0

    def abort(self, match: Callable[[Request], bool]) -> list[Request]:
        """SGLang's ``Scheduler.abort_request`` for this rank; returns the requests hit."""
        hit: list[Request] = []
        for req in [r for r in self.waiting if match(r)]:
            self.core.finish(req, dict(ABORTED_WAITING))
            hit.append(req)
        for req in [r for r in (*self.inflight, *self.transfer) if match(r)]:
            self.core.finish(req, dict(ABORTED))
            hit.append(req)
        for req in [r for r in (*self.prefilling, *self.running) if match(r)]:
            if req.to_finish is None:
                req.to_finish = dict(ABORTED)
                hit.append(req)
        if not self.core.can_schedule():
            # No forward pass will come to finish them; finish them now.
            for req in [r for r in (*self.prefilling, *self.running) if r.to_finish]:
                self.core.finish(req, req.to_finish or dict(ABORTED))
        self.notify()
        return hit


class EngineCore:
    """The whole simulated engine: DP ranks, role, health, switching and counters."""

    def __init__(
        self,
        config: EngineConfig,
        faults: Faults | None = None,
        *,
        metrics: MetricsSink | None = None,
        on_crash: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        self.faults = faults if faults is not None else Faults()
        self.faults.validate()
        self.metrics = metrics or MetricsSink()
        self._on_crash = on_crash
        self.mode: Mode = config.role
        self.ranks = [Rank(self, i) for i in range(config.dp_size)]
        self.requests: dict[str, Request] = {}
        self.rooms = KvRooms()  # prefill side of the KV hand-off, by bootstrap room
        self.fetch_kv: KvFetch | None = None  # decode side; None: the KV just arrives
        # A test's probe of what the rest of the system sees at the instant this engine
        # changes role (does the router still list it?): awaited with the new role once the
        # switch is under way, before the mode changes, so nothing it checks can be missed.
        self.before_flip: Callable[[str], Awaitable[None]] | None = None
        self.switching = False
        # busy_seconds_on_switch: when the hidden work the idle check waits for is done
        self._quiet_at: float | None = None
        self.unhealthy = False  # SGLang's _pd_role_switch_unhealthy: restart required
        self.broken = False  # generation stopped (injected unhealthy_after_switch)
        self.paused = False
        self.crashed = False
        self.ready_at = time.monotonic() + config.timing.startup_seconds
        # SGLang 0.5.23 reports how long its start-up phases took (a dict of seconds,
        # srt/observability/startup_time.py), not when it started: another dict after a
        # restart. The double's differ from one start to the next as measured times do.
        created = time.perf_counter()
        self.startup_time: dict[str, Any] = {
            "load_weight": round(config.timing.startup_seconds + created % 1e-3, 9),
            "kv_cache_allocation": 0.0,
            "scheduler_e2e": round(config.timing.startup_seconds + created % 1e-2, 9),
            "cuda_graph": {"prefill": 0.0, "decode": 0.0, "target_verify": 0.0},
        }
        # Launching as decode captures decode CUDA graphs at start-up; prefill does not.
        launched_decode = self.mode == "decode"
        self.graph_bs: list[int] = list(config.decode_cuda_graph_bs) if launched_decode else []
        self.graph_memory_gb = config.decode_cuda_graph_memory_gb if self.graph_bs else 0.0
        self._counters = Counters()
        self._next_rank = 0
        self._hangs: list[asyncio.Future[None]] = []
        self._switch_lock = asyncio.Lock()
        self.store = (
            PageStore(config.kv_store_dir, page_size=config.kv_page_size)
            if config.kv_store_dir is not None
            else None
        )

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        for rank in self.ranks:
            rank.task = asyncio.create_task(rank.run(), name=f"engine-double-rank-{rank.index}")
            rank.task.add_done_callback(_report_loop_death)

    async def stop(self) -> None:
        tasks = [r.task for r in self.ranks if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for hang in self._hangs:
            if not hang.done():
                hang.cancel()
        for req in list(self.requests.values()):
            req.crashed = True
            req.updated.set()
            self._lost(req)
        self.requests.clear()

    def _lost(self, req: Request) -> None:
        """A request the engine will never finish: its KV never comes, nor leaves."""
        if req.kv_wait is not None and not req.kv_wait.done():
            req.kv_wait.cancel()
        if req.bootstrap is not None and req.prefill_side:
            self.rooms.resolve(req.bootstrap.room, "aborted")

    @property
    def starting(self) -> bool:
        return time.monotonic() < self.ready_at

    def can_schedule(self) -> bool:
        return not (self.switching or self.unhealthy or self.broken or self.paused or self.crashed)

    def wake_all(self) -> None:
        for rank in self.ranks:
            rank.notify()

    def counters(self) -> Counters:
        return self._counters

    def _count(self, **deltas: float) -> None:
        values = {k: getattr(self._counters, k) + v for k, v in deltas.items()}
        self._counters = replace(self._counters, **values)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        self._count(prefill_tokens=tokens, prefill_busy_seconds=seconds)

    def note_restart(self, previous: Counters) -> None:
        self._counters = replace(previous, restarts=previous.restarts + 1)

    @property
    def idle(self) -> bool:
        return all(rank.is_idle() for rank in self.ranks)

    # ---------------------------------------------------------------- requests
    def submit(
        self,
        *,
        prompt_tokens: int,
        max_new_tokens: int,
        rid: str | None = None,
        stream: bool = False,
        health: bool = False,
        bootstrap: Bootstrap | None = None,
        dp_rank: int | None = None,
        input_ids: list[int] | None = None,
        extra_key: str | None = None,
    ) -> Request:
        if self.crashed:
            raise EngineCrashed("engine crashed")
        rid = rid or uuid.uuid4().hex
        if rid in self.requests:
            raise GenerateError(f"Duplicate request ID detected: {rid}")  # tokenizer_manager.py
        if prompt_tokens < 1:
            raise GenerateError("The input is empty: at least one prompt token is required.")
        if max_new_tokens < 0:
            raise GenerateError("max_new_tokens must be at least 0")
        limit = min(self.config.context_length, self.config.kv_capacity_tokens)
        if prompt_tokens + max_new_tokens > limit:
            raise GenerateError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{limit} tokens. You requested a total of {prompt_tokens + max_new_tokens} "
                f"tokens: {prompt_tokens} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion."
            )
        rank = self._pick_dp_rank(dp_rank)
        req = Request(
            rid=rid,
            prompt_tokens=prompt_tokens,
            max_new_tokens=max_new_tokens,
            stream=stream,
            health=health,
            rank=rank.index,
            bootstrap=bootstrap,
            prefill_side=self.mode == "prefill",
            input_ids=input_ids,
            extra_key=extra_key,
        )
        if self.store is not None and input_ids is not None and not health:
            req.context = zlib.crc32(_token_bytes(input_ids))
            if self.mode != "decode":  # a decode engine gets the prompt's KV from its peer
                # SGLang matches all but the last token (whose logits it must compute), in
                # whole pages: at most the last page is prefilled again.
                keys = self.store.page_keys(input_ids[:-1], extra_key)
                hit = self.store.hit_pages(keys) * self.store.page_size
                req.cached_tokens = hit if hit >= self.config.kv_prefetch_threshold else 0
                self._count(cached_tokens=req.cached_tokens)
        self.requests[rid] = req
        rank.waiting.append(req)
        if not health:
            self._count(requests_received=1)
        rank.notify()
        return req

    def _pick_dp_rank(self, routed: int | None) -> Rank:
        """SGLang's DP controller: the router's rank when it sent one
        (``maybe_external_dp_rank_routing``, which leaves the round-robin counter alone),
        else round robin, the method every engine launched as decode resolves to and keeps
        after a flip (``handle_load_balance_method``; ``round_robin_scheduler``)."""
        if routed is not None:
            return self.ranks[routed]
        rank = self.ranks[self._next_rank % len(self.ranks)]
        self._next_rank += 1
        return rank

    def finish(self, req: Request, reason: dict[str, Any]) -> None:
        if req.finish_reason is not None:
            return
        self.ranks[req.rank].remove(req)
        req.finish_reason = reason
        req.phase = "done"
        req.finished_at = time.monotonic()
        self.requests.pop(req.rid, None)
        if req.kv_wait is not None and not req.kv_wait.done():
            req.kv_wait.cancel()
        if req.bootstrap is not None and req.prefill_side:
            aborted = reason.get("type") == "abort"
            self.rooms.resolve(req.bootstrap.room, "aborted" if aborted else "done")
        if self.store is not None and req.input_ids is not None and self.mode != "prefill":
            # What reached this engine's KV, aborted requests too, whole pages only: a
            # unified engine inserts prompt and output into its radix tree, written through
            # to the store (HiCache write_through); a decode engine offloads the pages after
            # the prompt's whole ones, which the prefill side stored
            # (--disaggregation-decode-enable-offload-kvcache, docs/sglang-role-switch.md §3).
            skip = len(req.input_ids) // self.store.page_size if self.mode == "decode" else 0
            self.store_pages(req, [*req.input_ids, *req.output_ids], from_page=skip)
        if not req.health:
            aborted = reason.get("type") == "abort"
            self._count(
                requests_finished=1,
                requests_aborted=1 if aborted else 0,
                prompt_tokens=req.prompt_tokens,
                generation_tokens=len(req.output_ids),
            )
            self.metrics.request_finished(req)
        req.updated.set()

    def store_pages(self, req: Request, tokens: list[int] | None, *, from_page: int = 0) -> None:
        if self.store is None or tokens is None or req.health:
            return
        self.store.write(self.store.page_keys(tokens, req.extra_key)[from_page:])

    def abort(self, *, rid: str = "", abort_all: bool = False) -> int:
        """``POST /abort_request``; returns how many requests it hit."""
        if not abort_all and not rid:
            return 0
        if not abort_all and rid not in self.requests:
            return 0
        self._count(abort_calls=1)
        self.metrics.abort_call()

        def match(req: Request) -> bool:
            return abort_all or req.rid.startswith(rid)

        return sum(len(rank.abort(match)) for rank in self.ranks)

    async def await_kv(self, req: Request, fetch: KvFetch) -> None:
        """Wait for the prefill peer's KV; on a failed transfer the request is aborted."""
        assert req.bootstrap is not None
        arrived = await fetch(req.bootstrap)
        if req.finished:
            return
        if arrived:
            req.ready_at = time.monotonic()
            self.ranks[req.rank].notify()
        else:
            self.finish(req, dict(KV_FAILED))

    def drop(self, req: Request) -> None:
        """The client went away: SGLang aborts the request (``create_abort_task``)."""
        if not req.finished and req.rid in self.requests:
            self.abort(rid=req.rid)

    # ---------------------------------------------------------------- role switch
    @property
    def graph_memory(self) -> dict[str, float]:
        graph = dict.fromkeys(GRAPH_PHASES, 0.0)
        graph["decode"] = round(self.graph_memory_gb, 3)
        return graph

    def _reply(self, success: bool, message: str, old: str, new: str, safe: bool) -> dict[str, Any]:
        self._count(switches_ok=1 if success else 0, switches_failed=0 if success else 1)
        return {
            "rid": None,
            "http_worker_ipc": None,
            "success": success,
            "message": message,
            "old_role": old,
            "new_role": new,
            "safe_to_restore": safe,
        }

    async def pd_role_switch(
        self,
        *,
        new_role: str,
        decode_cuda_graph_bs: list[int] | None = None,
        decode_cuda_graph_memory_gb: float | None = None,
        prepare_only: bool = False,
    ) -> dict[str, Any]:
        """SGLang 0.5.23's ``/pd_role_switch`` (tokenizer fan-out + scheduler handler).

        Calls are serialised, as SGLang's scheduler handles one control message at a time.
        """
        async with self._switch_lock:
            return await self._pd_role_switch(
                new_role=new_role,
                decode_cuda_graph_bs=decode_cuda_graph_bs,
                decode_cuda_graph_memory_gb=decode_cuda_graph_memory_gb,
                prepare_only=prepare_only,
            )

    async def _pd_role_switch(
        self,
        *,
        new_role: str,
        decode_cuda_graph_bs: list[int] | None,
        decode_cuda_graph_memory_gb: float | None,
        prepare_only: bool,
    ) -> dict[str, Any]:
        self._count(switch_calls=1)
        old = self.mode
        requested = new_role
        new = (new_role or "").lower()
        faults = self.faults
        if not self.config.enable_pd_role_switch:
            msg = "--enable-pd-role-switch is not set on this server"
            return self._reply(False, msg, old, requested, True)
        rejection = self._reject_reason(new)
        if rejection is not None:
            return self._reply(False, rejection[0], old, requested, rejection[1])
        if new == old:
            # The scheduler leaves safe_to_restore at its default (False) on success.
            return self._reply(True, "ok" if not prepare_only else "ready", old, requested, False)
        if faults.busy_seconds_on_switch and self.idle:
            now = time.monotonic()
            if self._quiet_at is None:
                self._quiet_at = now + faults.busy_seconds_on_switch
            if now < self._quiet_at:
                return self._reply(False, NOT_IDLE, old, requested, True)
        if not self.idle or faults.busy_on_switch > 0:
            if self.idle:
                faults.busy_on_switch -= 1
            return self._reply(False, NOT_IDLE, old, requested, True)
        will_capture = new == "decode" and not self.graph_bs
        if will_capture:
            need = decode_cuda_graph_memory_gb
            if need is None:
                msg = "decode_cuda_graph_memory_gb is required before capturing decode graphs"
                return self._reply(False, msg, old, requested, True)
            if need < 0:
                msg = "decode_cuda_graph_memory_gb must be non-negative"
                return self._reply(False, msg, old, requested, True)
            available = self.config.available_gpu_memory_gb
            if available < need:
                msg = (
                    "insufficient decode CUDA graph headroom: "
                    f"required={need:.3f} GB, available={available:.3f} GB"
                )
                return self._reply(False, msg, old, requested, True)
        if prepare_only:
            return self._reply(True, "ready", old, requested, True)
        if faults.switch_failure == "safe" and faults.switch_failure_count > 0:
            faults.switch_failure_count -= 1
            msg = "failed to check decode CUDA graph headroom: injected fault"
            return self._reply(False, msg, old, requested, True)
        if faults.crash_on_switch:
            await self.crash()
            raise EngineCrashed("engine crashed during the role switch")
        if faults.hang_on_switch:
            hang = asyncio.get_running_loop().create_future()
            self._hangs.append(hang)
            await hang
        self.switching = True
        try:
            if self.before_flip is not None:
                await self.before_flip(new)
            await asyncio.sleep(self.config.timing.switch_seconds)
            if faults.switch_failure == "unsafe" and faults.switch_failure_count > 0:
                faults.switch_failure_count -= 1
                self.unhealthy = True
                msg = "role switch failed; instance unhealthy, restart required: injected fault"
                return self._reply(False, msg, old, requested, False)
            self.mode = "decode" if new == "decode" else "prefill"
            if self.store is not None and self.config.kv_store_clears_on_flip:
                self.store.clear()
            if will_capture:
                await asyncio.sleep(self.config.timing.graph_capture_seconds)
                self.graph_bs = list(decode_cuda_graph_bs or self.config.decode_cuda_graph_bs)
                self.graph_memory_gb = float(decode_cuda_graph_memory_gb or 0.0)
            if faults.unhealthy_after_switch:
                self.broken = True
            return self._reply(True, "ok", old, requested, False)
        finally:
            self.switching = False
            self.wake_all()

    def _reject_reason(self, new: str) -> tuple[str, bool] | None:
        backend = self.config.transfer_backend
        checks: tuple[tuple[bool, bool, str], ...] = (
            (
                self.unhealthy,
                False,
                "instance is unhealthy after a failed role switch; restart required",
            ),
            (self.switching, False, "another role switch is already in progress"),
            (new not in ("prefill", "decode"), True, f"invalid new_role={new!r}"),
            (self.mode == "null", True, "instance is not running in PD disaggregation mode"),
            (
                backend not in ROLE_SWITCH_BACKENDS,
                True,
                f"transfer backend {backend!r} does not support runtime role switch",
            ),
        )
        return next(((msg, safe) for failed, safe, msg in checks if failed), None)

    # ---------------------------------------------------------------- health
    async def health_generate(self) -> bool:
        """SGLang's ``/health_generate``: healthy if any output arrives before the timeout.

        Any output, not only the check's own: SGLang polls ``last_receive_tstamp > tic``
        (``srt/entrypoints/http_server.py`` ``health_generate``), so a check queued behind
        other work passes as soon as that work produces a token, and the last poll comes
        after the window has passed.
        """
        if self.starting or self.crashed:
            return False
        self._count(health_checks=1)
        tic = time.monotonic()
        req = self.submit(prompt_tokens=1, max_new_tokens=1, health=True)
        deadline = tic + self.config.timing.health_check_timeout_seconds
        try:
            while True:
                if req.finished or any(r.last_output_at > tic for r in self.ranks):
                    return not req.crashed
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                req.updated.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(req.updated.wait(), min(left, HEALTH_POLL_SECONDS))
        finally:
            if not req.finished:
                self.ranks[req.rank].remove(req)
                self.requests.pop(req.rid, None)

    # ---------------------------------------------------------------- pause
    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(abort_all=True)
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.wake_all()

    # ---------------------------------------------------------------- crash
    async def crash(self) -> None:
        """Stop answering, as a dead engine process would; open requests are dropped."""
        if self.crashed:
            return
        self.crashed = True
        self._count(crashes=1)
        for req in list(self.requests.values()):
            req.crashed = True
            req.updated.set()
            self._lost(req)
        if self._on_crash is not None:
            await self._on_crash()
