"""What the agent knows about its engine's health, from probes, switches and the supervisor.

``status`` is ``starting`` (never answered yet, or restarted), ``healthy``, ``unhealthy``
(answered before, now fails ``health_failures`` probes in a row) or ``down`` (the supervised
process is not running). Separately, ``failed`` holds why the engine needs a restart after a
switch went wrong; only a restart of the engine clears it (seen as a new process from the
supervisor, or a new ``startup_time`` in ``/server_info`` when the agent merely attaches).
"""

from __future__ import annotations

import logging
from typing import Any

from prorsa_agent.engine_client import EngineProtocolError, internal_states
from prorsa_contract.agent_api import Role

log = logging.getLogger("prorsa_agent.health")


class EngineHealth:
    def __init__(self, *, failures_threshold: int, launch_role: Role = "decode") -> None:
        self.failures_threshold = failures_threshold
        self.status = "starting"
        self.reason = "waiting for the engine's first health check"
        self.failed: str | None = None
        self.consecutive_failures = 0
        self.last_role: Role = launch_role
        # SGLang 0.5.23's start-up phase durations (a dict): compared, never read.
        self.startup_time: object | None = None
        self.graph_memory_gb: float | None = None

    @property
    def effective(self) -> tuple[str, str]:
        if self.failed is not None and self.status != "down":
            return "failed", self.failed
        return self.status, self.reason

    @property
    def healthy(self) -> bool:
        return self.effective[0] == "healthy"

    def mark_failed(self, reason: str) -> None:
        if self.failed is None:
            log.error("engine needs a restart: %s", reason)
        self.failed = reason

    def engine_restarted(self, reason: str) -> None:
        if self.failed is not None:
            log.info("engine restarted; clearing the failed state (%s)", self.failed)
        self.failed = None
        self.status = "starting"
        self.reason = reason
        self.consecutive_failures = 0
        self.startup_time = None

    def down(self, reason: str) -> None:
        self.status = "down"
        self.reason = reason

    def probe_ok(self) -> None:
        if self.status != "healthy":
            log.info("engine healthy")
        self.consecutive_failures = 0
        self.status = "healthy"
        self.reason = "engine answers /health"

    def probe_failed(self, reason: str) -> None:
        self.consecutive_failures += 1
        if self.status == "healthy" and self.consecutive_failures >= self.failures_threshold:
            log.warning("engine unhealthy: %s", reason)
            self.status = "unhealthy"
        if self.status != "healthy":
            self.reason = reason

    def observe_info(self, info: dict[str, Any]) -> None:
        """Learn from ``/server_info``: restarts, the role, the decode-graph memory."""
        startup = info.get("startup_time")
        if self.startup_time is not None and startup is not None and startup != self.startup_time:
            self.engine_restarted("engine restarted (new startup_time in /server_info)")
        if startup is not None:
            self.startup_time = startup
        try:
            state = internal_states(info)[0]
        except EngineProtocolError:
            return
        role = state.get("disaggregation_mode")
        if role in ("prefill", "decode"):
            self.last_role = role
        gb = state.get("decode_cuda_graph_memory_gb")
        if state.get("decode_cuda_graph_bs") and isinstance(gb, int | float) and gb > 0:
            self.graph_memory_gb = float(gb)
