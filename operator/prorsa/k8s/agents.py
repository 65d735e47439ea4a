"""The agents' HTTP client, re-exported for :mod:`prorsa.k8s.executor` alone.

The client lives in :mod:`prorsa.engines.agents`; this name stays until the switch
executor moves out of ``k8s/`` (issue 35 part 6), whose import then names the new home.
Nothing else imports it.
"""

from __future__ import annotations

from prorsa.engines.agents import AgentClient, RouterClient, agent_address

__all__ = ["AgentClient", "RouterClient", "agent_address"]
