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
before each generation             ``request_queued`` (full prompt incl. the history) and
                                   ``prefill_started``
generation returned                ``prefill_finished``, ``decode_finished`` (finish:
                                   ``tool`` if tool calls follow, else stop/length)
tool calls                         ``tool_started`` / ``tool_finished`` (result tokens =
                                   how much the tool responses grew the context)
loop ends                          ``reward_started``; the reward is computed here (as
                                   verl lets agent loops do, e.g. SWE-agent) with
                                   ``default_compute_score`` and ``reward_finished``
an exception                       ``trajectory_dropped``
================================  =====================================================

Use it: put this file on the workers' PYTHONPATH and point verl at it (verl reads the
file in every AgentLoopWorker and instantiates the class per sample with hydra):

    # agent_loops.yaml, passed as actor_rollout_ref.rollout.agent.agent_loop_config_path
    - name: prorsa_tool_agent
      _target_: verl_agent_loop.ProrsaToolAgentLoop

    # and set agent_name: prorsa_tool_agent in the dataset (or as default_agent_loop),
    # plus, in the workers' environment (Ray runtime_env env_vars):
    PRORSA_URL=http://prorsa-webhook.rl.svc:8787   # or http://127.0.0.1:8787 (prorsa ingest)
    PRORSA_NAMESPACE=rl  PRORSA_CLUSTER=qwen3-coder  PRORSA_TOKEN_FILE=/var/run/prorsa/token

Resync: a snapshot replaces all of a cluster's trajectories, so it must come from a view
of all of them. With several AgentLoopWorkers each emitter sees only its own; set
``PRORSA_TRACK=1`` only when the job runs a single AgentLoopWorker. Otherwise the webhook's
resync request is logged, and the Controller re-learns the live trajectories from their
next events (it creates a trajectory it first hears of mid-life).

Role switches: verl's fully asynchronous client (``FullyAsyncLLMServerClient``) already
resends prompt + partial output when SGLang aborts a request (``stop_reason == "aborted"``),
which is exactly what a Prorsa role switch needs; outside verl, use
:class:`prorsa.client.ResumableGeneration`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.utils.reward_score import default_compute_score

from prorsa.client import AsyncEventEmitter

_EMITTERS: dict[asyncio.AbstractEventLoop, AsyncEventEmitter] = {}


def prorsa_emitter() -> AsyncEventEmitter:
    """One emitter per AgentLoopWorker event loop, configured from the environment."""
    loop = asyncio.get_running_loop()
    emitter = _EMITTERS.get(loop)
    if emitter is None:
        emitter = AsyncEventEmitter(
            url=os.environ.get("PRORSA_URL", "http://127.0.0.1:8787"),
            namespace=os.environ.get("PRORSA_NAMESPACE", "default"),
            name=os.environ["PRORSA_CLUSTER"],
            token=Path(os.environ["PRORSA_TOKEN_FILE"]).read_text().strip(),
            track=os.environ.get("PRORSA_TRACK") == "1",
        )
        _EMITTERS[loop] = emitter
    return emitter


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
        em.request_queued(tid, prompt_tokens=len(agent_data.prompt_ids), turn=self._turn)
        em.prefill_started(tid, request=agent_data.request_id)
        state = await super()._handle_generating_state(
            agent_data, sampling_params, ignore_termination=ignore_termination
        )
        em.prefill_finished(tid, request=agent_data.request_id)
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
