"""The Prorsa in-pod agent: supervises an SGLang engine, reports its load, flips its PD role.

``prorsa-agent`` runs it (see :mod:`prorsa_agent.agent_cli`); :class:`prorsa_agent.server.Agent` is
the programmatic entry point. The wire bodies are the CONTRACT models of
:mod:`prorsa_contract.agent_api`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prorsa_agent.server import Agent

__all__ = ["Agent"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `prorsa --help` does not import aiohttp through this package.
    if name == "Agent":
        from prorsa_agent.server import Agent

        return Agent
    raise AttributeError(name)
