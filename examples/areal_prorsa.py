"""Emit Prorsa lifecycle events from AReaL 1.0.4's asynchronous rollout (``pip install areal``).

AReaL runs each rollout as ``RolloutWorkflow.arun_episode(engine, data)`` on its
``WorkflowExecutor``, which dispatches a new episode only while its ``StalenessManager``
has capacity: ``(max_head_offpolicyness + version + 1) × consumer_batch_size`` episodes
accepted or running. That gate is the paper's asynchronous setting (staleness η), so the
moment an episode starts *is* the dispatch the Controller forecasts from. This module wraps
any workflow (AReaL's ``RLVRWorkflow``, ``MultiTurnWorkflow`` or one of the user's) and the
SGLang engine client:

===================================================  ===========================================
AReaL step                                           Prorsa event
===================================================  ===========================================
``arun_episode`` starts (the staleness gate let it)  ``sample_dispatched`` (group: the prompt;
                                                     AReaL runs a group's episodes on one
                                                     ``data``)
``engine.agenerate(ModelRequest)`` sent              ``request_queued`` (``len(input_ids)``,
                                                     the request's ``rid``)
``agenerate`` returns a ``ModelResponse``            ``decode_finished`` (finish: ``tool_calls``
                                                     → ``tool``, ``length``, else ``stop``)
``with reported_tool(name)`` in the workflow         ``tool_started`` / ``tool_finished``
the workflow's ``async_reward_fn``                   ``reward_started`` / ``reward_finished``
                                                     (accepted: reward > 0)
``arun_episode`` returns ``None`` or raises          ``trajectory_dropped``
``update_weights_from_disk`` / ``_distributed``      ``weight_update_started`` (version:
on the rollout engine (trainer process)              ``meta.version``, the new one)
``continue_generation`` after that update            ``weight_update_finished`` (re-prefill: the
                                                     episodes in flight)
===================================================  ===========================================

No prefill events: ``agenerate`` is one non-streaming ``/generate`` (its ``ttft`` is the
whole latency). Aborts need nothing either: ``RemoteInfEngine.agenerate`` already resends
prompt plus partial output while SGLang answers ``abort``, which is what a role switch
needs; each resend is one more ``/generate`` inside one ``agenerate`` and one
``request_queued``.

The weight version on every request: :class:`ProrsaSGLangBackend` adds SGLang's
``extra_key`` (``prorsa_sdk.weight_version_key``) to each ``/generate`` AReaL builds,
resends included: the version of the weights the engines hold, which changes when an
update starts (AReaL's own ``get_version()`` moves only at ``set_version``, after
generation resumed on the new weights). SGLang scopes its prefix cache and HiCache storage
namespace with it.

Use it, in the user's training script (AReaL's ``PPOTrainer`` or a loop of one's own):

    import areal_prorsa                       # on PYTHONPATH; patches the trainer's engine class
    workflow = areal_prorsa.ProrsaWorkflow(RLVRWorkflow(reward_fn=..., gconfig=..., tokenizer=...))
    trainer.train(workflow=workflow, ...)     # or rollout.prepare_batch(loader, workflow=workflow)

Importing it makes ``areal.trainer.rl_trainer`` build :class:`ProrsaRemoteSGLangEngine`
instead of ``RemoteSGLangEngine`` (a loop of one's own constructs it directly). Settings,
in the environment of every process that runs rollouts or updates weights:

    PRORSA_URL=https://prorsa-webhook.prorsa-system.svc:8787  # prorsa ingest: http://127.0.0.1:8787
    PRORSA_NAMESPACE=rl  PRORSA_CLUSTER=qwen3-coder  PRORSA_TOKEN_FILE=/var/run/prorsa/token
    PRORSA_CA_FILE=/var/run/prorsa/webhook-ca.crt   # the CA of the webhook's certificate
    PRORSA_TRACK=0                                  # no resync snapshots (default: tracked)
    PRORSA_RECORD=/data/job-events.ndjson           # also record the stream for `prorsa plan`
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import areal.trainer.rl_trainer as _rl_trainer
from areal.api.engine_api import InferenceEngine
from areal.api.io_struct import HttpRequest, ModelRequest, ModelResponse, WeightUpdateMeta
from areal.api.reward_api import AsyncRewardWrapper
from areal.api.workflow_api import RolloutWorkflow
from areal.engine.sglang_remote import RemoteSGLangEngine, SGLangBackend
from areal.infra import RemoteInfEngine
from areal.utils.dynamic_import import import_from_string

from prorsa_sdk import AsyncEventEmitter, EventEmitter, weight_version_key

log = logging.getLogger("prorsa.areal")

_FINISH = {"tool_calls": "tool", "length": "length", "abort": "abort"}


def _settings() -> dict[str, Any]:
    return {
        "url": os.environ.get("PRORSA_URL", "http://127.0.0.1:8787"),
        "namespace": os.environ.get("PRORSA_NAMESPACE", "default"),
        "name": os.environ["PRORSA_CLUSTER"],
        "token": Path(os.environ["PRORSA_TOKEN_FILE"]).read_text().strip(),
        "verify": os.environ.get("PRORSA_CA_FILE") or None,
    }


def _emitter_id(role: str) -> str:
    """AReaL runs one rollout engine per trainer rank: each names its emitter, so a resync
    snapshot replaces only that rank's trajectories."""
    return f"areal-{role}-{socket.gethostname()}-{os.getpid()}"[:128]


_EMITTERS: dict[asyncio.AbstractEventLoop, AsyncEventEmitter] = {}


def prorsa_emitter() -> AsyncEventEmitter:
    """The rollout's emitter: one per event loop (AReaL's ``AsyncTaskRunner`` runs every
    episode of an engine on one loop, in a thread of its own)."""
    loop = asyncio.get_running_loop()
    emitter = _EMITTERS.get(loop)
    if emitter is None:
        emitter = AsyncEventEmitter(
            **_settings(),
            emitter_id=_emitter_id("rollout") + (f"-{len(_EMITTERS)}" if _EMITTERS else ""),
            track=os.environ.get("PRORSA_TRACK", "1") != "0",
            record=os.environ.get("PRORSA_RECORD") or None,
        )
        _EMITTERS[loop] = emitter
    return emitter


def close_rollout_emitters(timeout: float = 10.0) -> None:
    """Deliver what the rollout emitters hold and close them, from a thread other than
    their loops' (the trainer's, before AReaL stops its rollout loop)."""
    try:
        here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    for loop, emitter in list(_EMITTERS.items()):
        if loop is here or not loop.is_running():
            continue
        _EMITTERS.pop(loop, None)
        done = asyncio.run_coroutine_threadsafe(emitter.aclose(timeout), loop)
        stats = done.result(timeout + 5)
        if stats.dropped:
            log.warning("prorsa: %d rollout events not delivered", stats.dropped)


# -- one episode: the trajectory ----------------------------------------------------------


@dataclass
class _Episode:
    id: str
    emitter: AsyncEventEmitter
    requests: int = 0
    rewarded: bool = False


_EPISODE: ContextVar[_Episode | None] = ContextVar("prorsa_areal_episode", default=None)
_IN_FLIGHT = 0  # episodes between dispatch and their end, in this process
_IN_FLIGHT_LOCK = threading.Lock()


def _in_flight(delta: int) -> int:
    global _IN_FLIGHT
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT += delta
        return _IN_FLIGHT


def _episode(what: str) -> _Episode:
    episode = _EPISODE.get()
    if episode is None:
        raise RuntimeError(f"{what} outside a ProrsaWorkflow episode: wrap the workflow")
    return episode


@dataclass
class ToolReport:
    """What the tool added to the context, set by the workflow when it knows."""

    result_tokens: int | None = None


@contextlib.contextmanager
def reported_tool(tool: str | None = None) -> Iterator[ToolReport]:
    """A tool call of the current episode, for workflows that run tools between requests:

    >>> with reported_tool("python") as report:
    ...     result = run_python(code)
    ...     report.result_tokens = len(tokenizer.encode(result))
    """
    episode = _episode("reported_tool")
    episode.emitter.tool_started(episode.id, tool=tool)
    report = ToolReport()
    try:
        yield report
    finally:
        episode.emitter.tool_finished(episode.id, result_tokens=report.result_tokens)


class _ReportingEngine:
    """The engine an episode sees: AReaL's, with each ``agenerate`` reported."""

    def __init__(self, engine: InferenceEngine, episode: _Episode) -> None:
        self._engine = engine
        self._episode = episode

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        ep = self._episode
        ep.emitter.request_queued(
            ep.id, prompt_tokens=len(req.input_ids), turn=ep.requests, request=req.rid[:256]
        )
        ep.requests += 1
        resp = await self._engine.agenerate(req)
        finish = _FINISH.get(resp.stop_reason, "stop")
        ep.emitter.decode_finished(ep.id, output_tokens=len(resp.output_tokens), finish=finish)
        return resp


class _ReportingReward:
    """The workflow's ``async_reward_fn`` (AReaL's ``AsyncRewardWrapper``), reported."""

    def __init__(self, reward: Any) -> None:
        self.inner = reward

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        episode = _EPISODE.get()
        if episode is None:
            return await self.inner(*args, **kwargs)
        episode.emitter.reward_started(episode.id)
        episode.rewarded = True
        try:
            reward = await self.inner(*args, **kwargs)
        except BaseException:
            episode.emitter.reward_finished(episode.id, accepted=False)
            raise
        value = reward.get("reward") if isinstance(reward, dict) else reward
        accepted = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        episode.emitter.reward_finished(episode.id, accepted=accepted)
        return reward


class ProrsaWorkflow(RolloutWorkflow):
    """An AReaL workflow whose every episode reports its lifecycle to Prorsa."""

    def __init__(self, workflow: RolloutWorkflow, *, task: str | None = None) -> None:
        self.workflow = workflow
        self.task = task[:128] if task else None
        self._report_rewards()

    def _report_rewards(self) -> None:
        """Wrap the inner workflow's reward function (AReaL's ``RLVRWorkflow`` and
        ``MultiTurnWorkflow`` await ``self.async_reward_fn``); one given as an import path
        is resolved here, as AReaL would at the first episode."""
        inner = self.workflow
        if isinstance(getattr(inner, "reward_fn", None), str):
            inner.reward_fn = import_from_string(inner.reward_fn)  # type: ignore[attr-defined]
            inner.async_reward_fn = AsyncRewardWrapper(inner.reward_fn)  # type: ignore[attr-defined]
        reward = getattr(inner, "async_reward_fn", None)
        if reward is not None and not isinstance(reward, _ReportingReward):
            inner.async_reward_fn = _ReportingReward(reward)  # type: ignore[attr-defined]

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Any:
        em = prorsa_emitter()
        episode = _Episode(id=uuid4().hex, emitter=em)
        em.sample_dispatched(episode.id, group=_group(data), task=self.task)
        _in_flight(+1)
        token = _EPISODE.set(episode)
        try:
            traj = await self.workflow.arun_episode(_ReportingEngine(engine, episode), data)  # type: ignore[arg-type]
        except BaseException as exc:
            em.trajectory_dropped(episode.id, reason=type(exc).__name__)
            raise
        finally:
            _EPISODE.reset(token)
            _in_flight(-1)
        if traj is None:
            em.trajectory_dropped(episode.id, reason="rejected by the workflow")
        elif not episode.rewarded:
            # A workflow whose reward Prorsa cannot see ends the trajectory here.
            em.reward_started(episode.id)
            em.reward_finished(episode.id, accepted=True)
        return traj


def _group(data: dict[str, Any]) -> str:
    """The prompt's label: its dataset id when it has one, else the ``data`` object AReaL
    hands every episode of the group (``GroupedRolloutWorkflow``)."""
    for key in ("query_id", "id", "uid"):
        value = data.get(key)
        if value is not None and str(value):
            return str(value)[:128]
    return f"areal-{id(data):x}"


# -- the engine: the weight version on every request, weight updates reported ----------


@dataclass
class _Weights:
    """The version of the weights the engines hold, and the update under way."""

    loaded: int = 0
    pending: int | None = None
    seconds: float | None = None
    began: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def current(self) -> int:
        with self.lock:
            return self.loaded


class ProrsaSGLangBackend(SGLangBackend):
    """AReaL's SGLang request builder, adding the loaded weight version as ``extra_key``."""

    def __init__(self, weights: _Weights) -> None:
        super().__init__()
        self.weights = weights

    def build_generation_request(
        self, req: ModelRequest, with_lora: bool, version: int
    ) -> HttpRequest:
        http = super().build_generation_request(req, with_lora, version)
        http.payload["extra_key"] = weight_version_key(self.weights.current())
        return http


class ProrsaRemoteSGLangEngine(RemoteSGLangEngine):
    """AReaL's SGLang client, reporting weight updates and keying requests by version."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.prorsa_weights = _Weights()
        self._engine = RemoteInfEngine(config, ProrsaSGLangBackend(self.prorsa_weights))
        self._prorsa_emitter: EventEmitter | None = None

    def _trainer_emitter(self) -> EventEmitter:
        if self._prorsa_emitter is None:
            # Threaded: the trainer calls these from its own (synchronous) thread.
            self._prorsa_emitter = EventEmitter(
                **_settings(), emitter_id=_emitter_id("trainer"), track=True
            )
        return self._prorsa_emitter

    def _update_started(self, meta: WeightUpdateMeta) -> None:
        weights = self.prorsa_weights
        with weights.lock:
            version = meta.version if meta.version is not None else weights.loaded + 1
            weights.pending = version
            weights.loaded = version  # generation is paused; what runs next runs on it
            weights.began = time.monotonic()
        self._trainer_emitter().weight_update_started(
            version=version, expected_seconds=weights.seconds, id=f"areal-weights-{version}-started"
        )

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future[None]:
        self._update_started(meta)
        return super().update_weights_from_disk(meta)

    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs: list[Any]
    ) -> Future[None]:
        self._update_started(meta)
        return super().update_weights_from_distributed(meta, param_specs)

    def continue_generation(self) -> Any:
        result = super().continue_generation()
        weights = self.prorsa_weights
        with weights.lock:
            version, weights.pending = weights.pending, None
            if version is not None:
                weights.seconds = max(time.monotonic() - weights.began, 1e-3)
        if version is not None:
            self._trainer_emitter().weight_update_finished(
                version=version,
                reprefill_trajectories=max(_in_flight(0), 0),
                id=f"areal-weights-{version}-finished",
            )
        return result

    def destroy(self) -> Any:
        close_rollout_emitters()  # while AReaL's rollout loop still runs them
        result = super().destroy()
        if self._prorsa_emitter is not None:
            self._prorsa_emitter.close()
        return result


def install() -> None:
    """Make AReaL's trainer build :class:`ProrsaRemoteSGLangEngine` (idempotent)."""
    _rl_trainer.RemoteSGLangEngine = ProrsaRemoteSGLangEngine  # type: ignore[misc]


install()
