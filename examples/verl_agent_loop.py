"""Emit Prorsa lifecycle events from a verl agent loop (verl 0.9, ``verl.experimental.agent_loop``).

verl runs each rollout sample as an ``AgentLoopBase`` subclass instantiated per sample by
an ``AgentLoopWorker`` (a Ray actor with its own asyncio loop) and awaits
``run(sampling_params, **dataset_fields) -> AgentLoopOutput``. This module registers
``prorsa_tool_agent``: verl's ``ToolAgentLoop`` (multi-turn, tool calling) with every
lifecycle transition reported to Prorsa:

================================  =====================================================
verl step                          Prorsa event
================================  =====================================================
``run()`` starts                   ``sample_dispatched`` (group = the GRPO ``uid``)
before each generation             ``request_queued`` (full prompt incl. the history)
generation returned                ``decode_finished`` (finish: ``tool`` if tool calls
                                   follow, else stop/length)
tool calls                         ``tool_started`` / ``tool_finished`` (result tokens =
                                   how much the tool responses grew the context)
loop ends                          ``reward_started``; the reward is computed here (as
                                   verl lets agent loops do, e.g. SWE-agent) with
                                   ``default_compute_score`` and ``reward_finished``
an exception                       ``trajectory_dropped``
weight sync, trainer process       ``weight_update_started`` (version = ``global_steps``)
(``CheckpointEngineManager.        before the replicas abort their requests;
update_weights``)                  ``weight_update_finished`` once generation resumed,
                                   with the live trajectories that re-prefill
================================  =====================================================

No prefill events: verl's ``LLMServerClient.generate`` is one blocking call that
returns the whole completion, and behind a PD router (smg) the reply names neither the
prefill engine nor when its prefill ended. Reporting ``prefill_started`` before the call
and ``prefill_finished`` after it would show every request in prefill for its whole
decode. The Controller instead reads which of the queued requests the prefill engines
still hold from their ``/v1/state`` (docs/webhook-events.md, "What a trainer can observe").

Use it: put this file on the workers' PYTHONPATH and point verl at it (verl reads the
file in every AgentLoopWorker and instantiates the class per sample with hydra):

    # agent_loops.yaml, passed as actor_rollout_ref.rollout.agent.agent_loop_config_path
    - name: prorsa_tool_agent
      _target_: verl_agent_loop.ProrsaToolAgentLoop

    # and set agent_name: prorsa_tool_agent in the dataset (or as default_agent_loop),
    # plus, in the workers' environment (Ray runtime_env env_vars):
    PRORSA_URL=https://prorsa-webhook.prorsa-system.svc:8787  # prorsa ingest: http://127.0.0.1:8787
    PRORSA_NAMESPACE=rl  PRORSA_CLUSTER=qwen3-coder  PRORSA_TOKEN_FILE=/var/run/prorsa/token
    PRORSA_CA_FILE=/var/run/prorsa/webhook-ca.crt  # the CA of the webhook's certificate

``PRORSA_CA_FILE`` is the CA bundle the webhook's certificate is verified with (the
webhook Secret's ``ca.crt``, mounted into the workers); unset, the system trust store.

Resync: each AgentLoopWorker's emitter sees only its own trajectories, so each names
itself (``emitter_id``: verl's actor name without its random suffix,
``agent_loop_worker_<i>``; outside Ray, host and process id) and tracks what it sent. Its
snapshot, posted when the webhook asks after a restart and once when the worker starts,
replaces only that worker's trajectories (docs/webhook-events.md, "More than one
emitter"). ``PRORSA_TRACK=0`` turns the tracking off.

Weight updates: verl syncs weights in the trainer process, in
``verl.checkpoint_engine.base.CheckpointEngineManager.update_weights``: it aborts every
replica's requests, loads the new weights (the KV and prefix caches are released), then
resumes generation, and the aborted requests come back with their whole context. verl's
agent loop never sees those aborts, so without these two events the Controller could not
tell that every prefix cache is gone. Importing this module wraps ``update_weights``; have
verl import it in the trainer process (and harmlessly in the workers) with

    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=verl_agent_loop

(verl imports that module before it builds the checkpoint engine), with the same
``PRORSA_*`` variables in the job's runtime_env. The number of trajectories that re-prefill
is read from the webhook's ``GET .../status`` (live trajectories ready, in prefill,
decoding or in a tool), since the trainer process does not hold the agent loops.

Role switches: verl's fully asynchronous client (``FullyAsyncLLMServerClient``) already
resends prompt + partial output when SGLang aborts a request (``stop_reason == "aborted"``),
which is exactly what a Prorsa role switch needs; outside verl, use
:class:`prorsa_sdk.ResumableGeneration`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
from verl.checkpoint_engine.base import CheckpointEngineManager
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.utils.ray_utils import auto_await
from verl.utils.reward_score import default_compute_score

from prorsa_sdk import AsyncEventEmitter, EventEmitter, tls_context

log = logging.getLogger("prorsa.verl")

_EMITTERS: dict[asyncio.AbstractEventLoop, AsyncEventEmitter] = {}
# States whose trajectories compute their whole context again on new weights.
_REPREFILL_STATES = ("ready", "prefill", "decode", "tool")


def _settings() -> dict[str, Any]:
    return {
        "url": os.environ.get("PRORSA_URL", "http://127.0.0.1:8787"),
        "namespace": os.environ.get("PRORSA_NAMESPACE", "default"),
        "name": os.environ["PRORSA_CLUSTER"],
        "token": Path(os.environ["PRORSA_TOKEN_FILE"]).read_text().strip(),
        "verify": os.environ.get("PRORSA_CA_FILE") or None,
    }


def worker_emitter_id() -> str:
    """A stable id for this AgentLoopWorker: verl names its actors
    ``agent_loop_worker_<i>_<8 hex>``, the suffix new at each launch; outside Ray, the host
    and process."""
    name = None
    try:
        import ray

        if ray.is_initialized():
            name = ray.get_runtime_context().get_actor_name()
    except Exception:  # not in a Ray actor, or an older Ray: fall back
        name = None
    if name:
        return re.sub(r"_[0-9a-f]{8}$", "", name)[:128]
    return f"{socket.gethostname()}-{os.getpid()}"[:128]


def prorsa_emitter() -> AsyncEventEmitter:
    """One emitter per AgentLoopWorker event loop, configured from the environment."""
    loop = asyncio.get_running_loop()
    emitter = _EMITTERS.get(loop)
    if emitter is None:
        emitter_id = worker_emitter_id() + (f"-{len(_EMITTERS)}" if _EMITTERS else "")
        emitter = AsyncEventEmitter(
            **_settings(),
            emitter_id=emitter_id,
            track=os.environ.get("PRORSA_TRACK", "1") != "0",
        )
        _EMITTERS[loop] = emitter
    return emitter


# -- weight updates, in the trainer process ---------------------------------------------


class _WeightUpdates:
    """The trainer's emitter (threaded: verl runs each sync in a fresh event loop or its own)
    and what the last update taught: its version and how long it took."""

    def __init__(self) -> None:
        self.emitter: EventEmitter | None = None
        self.version: int | None = None
        self.seconds: float | None = None

    def get_emitter(self) -> EventEmitter:
        if self.emitter is None:
            # Named, and tracking the update under way: its snapshot (after a restart) says
            # whether weights are loading, and replaces no worker's trajectories.
            self.emitter = EventEmitter(**_settings(), emitter_id="verl-trainer", track=True)
        return self.emitter

    def next_version(self, global_steps: int | None) -> int:
        """verl's step when it gives one; else one past the last (the initial sync: 0)."""
        if global_steps is not None:
            self.version = int(global_steps)
        else:
            self.version = 0 if self.version is None else self.version + 1
        return self.version


_UPDATES = _WeightUpdates()


async def _reprefilling() -> int:
    """Live trajectories whose context returns to prefill, as the webhook counts them."""
    cfg = _settings()
    path = f"/v1/namespaces/{cfg['namespace']}/rolloutclusters/{cfg['name']}/status"
    try:
        verify = tls_context(cfg["verify"])
        async with httpx.AsyncClient(base_url=cfg["url"], timeout=2.0, verify=verify) as client:
            reply = await client.get(path, headers={"Authorization": f"Bearer {cfg['token']}"})
            reply.raise_for_status()
            live = reply.json().get("liveTrajectories", {})
    except (httpx.HTTPError, ValueError) as exc:
        log.warning("prorsa: live trajectories unknown (%s); reporting 0 to re-prefill", exc)
        return 0
    return sum(int(live.get(state, 0)) for state in _REPREFILL_STATES)


def install_weight_update_events() -> None:
    """Wrap verl's weight sync so that it reports itself to Prorsa (idempotent).

    ``update_weights`` is an ``auto_await`` coroutine: the wrapper wraps the coroutine
    function under it and is made ``auto_await`` again, so every trainer (synchronous,
    colocated, fully asynchronous) calls it exactly as before.
    """
    current = CheckpointEngineManager.update_weights
    if getattr(current, "_prorsa", False):
        return
    original = current.__wrapped__

    @auto_await
    @functools.wraps(original)
    async def update_weights(
        self: CheckpointEngineManager, global_steps: int | None = None
    ) -> dict[str, Any] | None:
        em = _UPDATES.get_emitter()
        version = _UPDATES.next_version(global_steps)
        ids = f"verl-weights-{version}-{uuid4().hex[:8]}"
        em.weight_update_started(
            version=version, expected_seconds=_UPDATES.seconds, id=f"{ids}-started"
        )
        began = time.monotonic()
        try:
            return await original(self, global_steps=global_steps)
        finally:  # also when the sync fails: the Controller must not wait for it forever
            _UPDATES.seconds = max(time.monotonic() - began, 1e-3)
            em.weight_update_finished(
                version=version,
                reprefill_trajectories=await _reprefilling(),
                id=f"{ids}-finished",
            )

    update_weights._prorsa = True  # type: ignore[attr-defined]
    CheckpointEngineManager.update_weights = update_weights  # type: ignore[method-assign]


install_weight_update_events()


@register("prorsa_tool_agent")
class ProrsaToolAgentLoop(ToolAgentLoop):
    """verl's ToolAgentLoop, reporting each trajectory's lifecycle to Prorsa.

    verl builds one agent loop object per sample, so per-trajectory state lives on ``self``.
    """

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        self._prorsa = prorsa_emitter()
        self._trajectory = uuid4().hex
        self._turn = 0
        self._prorsa.sample_dispatched(
            self._trajectory,
            group=_label(kwargs.get("uid")),
            task=_label(kwargs.get("data_source")),
        )
        try:
            output = await super().run(sampling_params, **kwargs)
        except BaseException as exc:
            self._prorsa.trajectory_dropped(self._trajectory, reason=type(exc).__name__)
            raise
        self._prorsa.reward_started(self._trajectory)
        output.reward_score = await self._score(output, kwargs)
        self._prorsa.reward_finished(self._trajectory, accepted=output.reward_score > 0)
        return output

    async def _handle_generating_state(
        self,
        agent_data: AgentData,
        sampling_params: dict[str, Any],
        ignore_termination: bool = False,
    ) -> AgentState:
        em, tid = self._prorsa, self._trajectory
        em.request_queued(
            tid,
            prompt_tokens=len(agent_data.prompt_ids),
            turn=self._turn,
            request=_label(agent_data.request_id),
        )
        state = await super()._handle_generating_state(
            agent_data, sampling_params, ignore_termination=ignore_termination
        )
        generated = len(agent_data.response_ids)
        if state == AgentState.PROCESSING_TOOLS:
            finish = "tool"
        elif len(agent_data.response_mask) >= self.response_length:
            finish = "length"
        else:
            finish = "stop"
        em.decode_finished(tid, output_tokens=generated, finish=finish)
        return state

    async def _handle_processing_tools_state(self, agent_data: AgentData) -> AgentState:
        em, tid = self._prorsa, self._trajectory
        tool = agent_data.tool_calls[0].name if agent_data.tool_calls else None
        em.tool_started(tid, tool=tool)
        before = len(agent_data.prompt_ids)
        state = await super()._handle_processing_tools_state(agent_data)
        em.tool_finished(tid, result_tokens=max(0, len(agent_data.prompt_ids) - before))
        self._turn += 1
        return state

    async def _score(self, output: AgentLoopOutput, kwargs: dict[str, Any]) -> float:
        """The trajectory's reward, computed in the loop so its end is observable."""
        reward_model = kwargs.get("reward_model") or {}
        solution = self.tokenizer.decode(output.response_ids, skip_special_tokens=True)
        result = await self.loop.run_in_executor(
            None,
            lambda: default_compute_score(
                kwargs.get("data_source"),
                solution,
                reward_model.get("ground_truth"),
                kwargs.get("extra_info"),
            ),
        )
        return float(result["score"] if isinstance(result, dict) else result)


def _label(value: Any) -> str | None:
    """A dataset field as a short label (verl passes numpy scalars and strings)."""
    if value is None:
        return None
    text = str(value)
    return text[:128] or None
