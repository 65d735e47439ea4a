"""The agent's Prometheus metrics (``GET /metrics`` on the agent port).

One registry per agent, so that several agents in one process (tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SWITCH_RESULTS = ("ok", "noop", "failed_safe", "failed_unsafe", "refused")
"""``ok``: flipped and verified; ``noop``: already in the role; ``failed_safe``: the engine
refused or the switch failed before teardown (the old role can return); ``failed_unsafe``:
the engine is left unhealthy, crashed or hung (restart the pod); ``refused``: not started
(bad request, conflicting switch, engine not serving)."""

SWITCH_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600)


class AgentMetrics:
    def __init__(self, instance: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.switches = Counter(
            "prorsa_agent_switches",
            "Role calls by result (ok, noop, failed_safe, failed_unsafe, refused).",
            ["result", "to"],
            registry=reg,
        )
        self.switch_seconds = Histogram(
            "prorsa_agent_switch_duration_seconds",
            "Seconds from a role call to its result (drain, abort, flip and verification).",
            ["to"],
            buckets=SWITCH_BUCKETS,
            registry=reg,
        )
        self.drain_seconds = Histogram(
            "prorsa_agent_drain_duration_seconds",
            "Seconds spent waiting for in-flight requests before the flip (abort included).",
            buckets=SWITCH_BUCKETS,
            registry=reg,
        )
        self.aborted = Counter(
            "prorsa_agent_aborted_requests",
            "Requests still in flight at the drain deadline, aborted with abort_all.",
            registry=reg,
        )
        self.restarts = Counter(
            "prorsa_agent_engine_restarts",
            "Engine processes restarted by the agent after a crash.",
            registry=reg,
        )
        self.engine_healthy = Gauge(
            "prorsa_agent_engine_healthy",
            "1 when the engine answers its health check.",
            registry=reg,
        )
        self.switching = Gauge(
            "prorsa_agent_switching", "1 while a role switch runs.", registry=reg
        )
        # Not ``instance``: Prometheus gives every scraped series an ``instance`` label of
        # its own (the target's address), which this one would clash with.
        info = Gauge(
            "prorsa_agent_info",
            "Constant 1, labelled with the engine instance the agent runs.",
            ["engine_instance"],
            registry=reg,
        )
        info.labels(engine_instance=instance).set(1)
        for result in SWITCH_RESULTS:
            for to in ("prefill", "decode"):
                self.switches.labels(result=result, to=to)

    def render(self) -> bytes:
        return generate_latest(self.registry)
