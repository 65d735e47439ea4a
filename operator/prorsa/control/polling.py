"""Every agent's state, once a tick, for the Controller, the labels and the status.

The agents are asked concurrently (:class:`~prorsa.engines.agents.AgentClient`); an agent
that does not answer is remembered with why (:class:`Unanswered`) for the status's
judgement of unavailable engines, and its instance is left out of the states, so the
Controller counts it as unavailable and never chooses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prorsa.control.metrics import OperatorMetrics
from prorsa.engines.agents import AgentClient, Unanswered, agent_address
from prorsa_contract.agent_api import EngineState
from prorsa_contract.labels import AGENT_PORT, SWITCH_ANNOTATION


@dataclass(kw_only=True)
class AgentPoller:
    namespace: str
    name: str
    agents: AgentClient
    metrics: OperatorMetrics
    ca: Callable[[], str | None]  # the cluster's agent CA, as last read
    busy: Callable[[], set[str]]  # pods with a switch of this process in flight
    agent_port: int = AGENT_PORT
    unanswered: dict[str, Unanswered] = field(default_factory=dict)  # this tick's, by pod

    async def poll(self, pods: list[dict[str, Any]]) -> dict[str, EngineState]:
        """Agent states by instance; a pod mid-switch is reported as switching."""
        addresses = []
        for pod in pods:
            address = agent_address(pod, port=self.agent_port, ca=self.ca())
            if address is not None:
                addresses.append(address)
        answers = await self.agents.states(addresses)
        self.metrics.agent_polls.labels(self.namespace, self.name).inc(len(addresses))
        busy = self.busy()
        out: dict[str, EngineState] = {}
        self.unanswered = {}
        for pod in pods:
            name = pod["metadata"]["name"]
            state = answers.get(name)
            if isinstance(state, Unanswered):
                self.unanswered[name] = state
                self.metrics.agent_errors.labels(self.namespace, self.name).inc()
                continue
            if state is None:
                continue
            annotations = pod["metadata"].get("annotations") or {}
            if name in busy or SWITCH_ANNOTATION in annotations:
                state = state.model_copy(update={"switching": True})
            out[name] = state
        return out
