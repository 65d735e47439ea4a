"""The role switch of one engine: drain, abort at the deadline, flip, verify.

Every way it can end is a :class:`~prorsa_contract.agent_api.RoleResult` and a metrics label:

* the engine flipped, reports the new role in ``/server_info`` and generates: ``ok`` (a flip
  to prefill once the agent's bootstrap port is open again, see prorsa_agent.bootstrap_gate);
* it refused before tearing anything down (``safe_to_restore: true``, e.g. a backend that
  cannot switch, no decode-graph headroom), a control call was rejected, or the cluster's
  shared KV store does not answer (the agent asks before draining): ``failed_safe``, the pod
  can take its old label back;
* it answered "not idle" (a request slipped in after the drain): the agent drains and aborts
  again and retries, up to ``max_switch_attempts`` calls. When ``/v1/loads`` shows nothing
  left, the scheduler still holds what no load field counts (its last batch, a transfer
  queue's deferred KV releases, KV offloads: ``Scheduler.is_fully_idle``), so the retry
  waits first, doubling from ``poll`` up to ``retry_drain``: at once, every attempt is
  refused within milliseconds;
* an engine call timed out before the flip was asked for (draining, aborting): ``failed_safe``,
  the role is unchanged and the engine is left to its health checks, not restarted;
* it failed during teardown (``safe_to_restore: false``), it crashed or hung, or it reports
  the wrong role or generates nothing for the whole verify budget after the flip (it asks
  ``/health_generate`` again after each 503): ``failed_unsafe``; the agent marks the engine
  failed (``/healthz`` 503) until the engine restarts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from prorsa_agent.agent_metrics import AgentMetrics
from prorsa_agent.bootstrap_gate import BootstrapGate
from prorsa_agent.config import AgentConfig
from prorsa_agent.engine_client import (
    EngineClient,
    EngineRefused,
    EngineUnavailable,
    Loads,
    internal_states,
)
from prorsa_agent.health import EngineHealth
from prorsa_agent.kv_store import unreachable
from prorsa_contract.agent_api import Role, RoleResult

log = logging.getLogger("prorsa_agent.switch")

NOT_IDLE = "not idle"
GRAPH_MEMORY_REQUIRED = "decode_cuda_graph_memory_gb is required"
# Phases in which no ``/pd_role_switch`` is outstanding: the engine keeps its role whatever
# happens (a retry after "not idle" drains again, the refused flip tore nothing down).
UNTOUCHED_PHASES = frozenset({"starting", "draining", "aborting"})


@dataclass(kw_only=True)
class SwitchProgress:
    """A switch in progress, as a repeated role call or ``GET /v1/role`` reports it."""

    target: Role
    old_role: Role | None
    drain_timeout: float
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)
    phase: str = "starting"
    running: int = 0
    waiting: int = 0
    aborted: int = 0
    attempts: int = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def describe(self) -> str:
        return (
            f"switch to {self.target} in progress: {self.phase} "
            f"(running={self.running}, waiting={self.waiting}, aborted={self.aborted}, "
            f"attempt {self.attempts}) for {self.elapsed():.1f}s"
        )

    def as_result(self) -> RoleResult:
        """The progress in the RoleResult shape (``ok`` false: not finished)."""
        return RoleResult(
            ok=False,
            old_role=self.old_role,
            new_role=self.target,
            safe_to_restore=True,
            aborted_requests=self.aborted,
            seconds=self.elapsed(),
            message=self.describe(),
        )

    def wire(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "oldRole": self.old_role,
            "phase": self.phase,
            "runningRequests": self.running,
            "waitingRequests": self.waiting,
            "abortedRequests": self.aborted,
            "attempts": self.attempts,
            "startedAt": self.started_at,
            "seconds": self.elapsed(),
        }


class Switcher:
    def __init__(
        self,
        *,
        engine: EngineClient,
        config: AgentConfig,
        health: EngineHealth,
        metrics: AgentMetrics,
        gate: BootstrapGate | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.health = health
        self.metrics = metrics
        self.gate = gate

    def _result(
        self, p: SwitchProgress, *, ok: bool, message: str, safe: bool = True
    ) -> RoleResult:
        if ok:
            new_role: Role | None = p.target
        else:
            new_role = p.old_role if safe else None
        return RoleResult(
            ok=ok,
            old_role=p.old_role,
            new_role=new_role,
            safe_to_restore=safe,
            aborted_requests=p.aborted,
            seconds=p.elapsed(),
            message=message,
        )

    async def run(self, p: SwitchProgress) -> tuple[RoleResult, str]:
        """Run the switch to ``p.target``; returns the result and its metrics label."""
        timeouts = self.config.timeouts
        store = self.config.kv_store
        if store is not None:
            # A flip aborts what the drain leaves running, and those requests resume from
            # the store (and every engine's prefixes stay there): without it they would be
            # recomputed in full, so the engine keeps its role until the store answers.
            down = await unreachable(store, timeout=timeouts.request)
            if down is not None:
                return self._fail(p, f"refused: the KV store is unreachable: {down}", safe=True)
        try:
            drain_started = time.monotonic()
            await self._drain(p, deadline=p.started + p.drain_timeout)
            self.metrics.drain_seconds.observe(time.monotonic() - drain_started)
            body = await self._switch_body(p.target)
            while True:
                p.attempts += 1
                p.phase = "switching"
                reply = await self.engine.pd_role_switch(body, timeout=timeouts.switch)
                if reply.success:
                    break
                message = reply.message
                retries_left = p.attempts < self.config.max_switch_attempts
                if reply.safe_to_restore and NOT_IDLE in message and retries_left:
                    log.warning(
                        "engine not idle at the switch (attempt %d); draining again", p.attempts
                    )
                    if not await self._drain(p, deadline=time.monotonic() + timeouts.retry_drain):
                        # Nothing the loads show: wait for what they do not.
                        await asyncio.sleep(
                            min(timeouts.retry_drain, timeouts.poll * 2**p.attempts)
                        )
                    continue
                if reply.safe_to_restore and GRAPH_MEMORY_REQUIRED in message:
                    gb = self._graph_memory_gb()
                    if gb is not None and "decode_cuda_graph_memory_gb" not in body:
                        body["decode_cuda_graph_memory_gb"] = gb
                        if retries_left:
                            continue
                    message += " (set --decode-cuda-graph-memory-gb on the agent)"
                if not reply.safe_to_restore:
                    self.health.mark_failed(f"role switch failed: {message}")
                    return self._fail(p, f"engine failed the switch: {message}", safe=False)
                return self._fail(p, f"engine refused the switch: {message}", safe=True)
            p.phase = "verifying"
            verify_until = time.monotonic() + timeouts.verify
            info = await self.engine.server_info(timeout=timeouts.verify)
            self.health.observe_info(info)
            roles = {state.get("disaggregation_mode") for state in internal_states(info)}
            if roles != {p.target}:
                reason = f"engine reports role {sorted(map(str, roles))} after switching"
                self.health.mark_failed(reason)
                return self._fail(p, reason, safe=False)
            if not await self._generates(until=verify_until):
                reason = (
                    "engine left unhealthy: /health_generate failed after the switch "
                    f"(no output for {timeouts.verify:g}s)"
                )
                self.health.mark_failed(reason)
                return self._fail(p, reason, safe=False)
            self.health.last_role = p.target
            if self.gate is not None:
                if p.target != "prefill":
                    self.gate.close()
                else:
                    # Reported (and routed to) only once every decode engine has dropped
                    # what it kept of this engine's last prefill term (bootstrap_gate).
                    p.phase = "opening the bootstrap port"
                    if not await self.gate.open():
                        reason = "engine restarted while its bootstrap port was opening"
                        return self._fail(p, reason, safe=False)
            return self._result(p, ok=True, message="switched"), "ok"
        except EngineRefused as exc:
            return self._fail(p, f"engine rejected a control call: {exc}", safe=True)
        except EngineUnavailable as exc:
            what = "timed out" if exc.timeout else "stopped answering (crashed?)"
            reason = f"engine {what} while {p.phase}: {exc}"
            if exc.timeout and p.phase in UNTOUCHED_PHASES:
                # A slow answer before any flip was asked for (a loaded host) leaves the
                # engine in its old role, serving: restarting it would reload the weights of
                # a healthy engine (a whole multi-node group). The health checks judge a hang.
                return self._fail(p, f"{reason}; the role is unchanged", safe=True)
            self.health.mark_failed(reason)
            return self._fail(p, reason, safe=False)

    async def _generates(self, *, until: float) -> bool:
        """Whether the engine generates, asked until ``until`` (the verify budget).

        SGLang's ``/health_generate`` gives up on its own after ``HEALTH_CHECK_TIMEOUT``
        (20 s, ``srt/entrypoints/http_server.py`` ``health_generate``) and answers 503: one
        such answer is one window without output, not an engine that needs a restart. A
        single call would cut the verify budget (120 s by default) to SGLang's 20 s, and a
        loaded host would get a healthy engine (a whole multi-node group) replaced.
        """
        poll = self.config.timeouts.poll
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return False
            # A call that runs out of budget raises (timed out while verifying).
            if await self.engine.health("/health_generate", timeout=left):
                return True
            log.warning("engine answered /health_generate with an error; asking again")
            await asyncio.sleep(min(poll, max(0.0, until - time.monotonic())))

    def _fail(self, p: SwitchProgress, message: str, *, safe: bool) -> tuple[RoleResult, str]:
        if not safe and self.gate is not None:
            self.gate.close()  # the role is unknown: no decode engine should keep this one
        log.error("switch to %s failed (safe_to_restore=%s): %s", p.target, safe, message)
        label = "failed_safe" if safe else "failed_unsafe"
        return self._result(p, ok=False, message=message, safe=safe), label

    async def _loads(self, p: SwitchProgress) -> Loads:
        loads = await self.engine.loads()
        p.running = loads.running
        p.waiting = loads.waiting + loads.inflight
        return loads

    async def _drain(self, p: SwitchProgress, *, deadline: float) -> bool:
        """Wait for in-flight requests until ``deadline``; then abort them all. Returns
        whether the loads showed any request at all."""
        timeouts = self.config.timeouts
        p.phase = "draining"
        loads = await self._loads(p)
        held = bool(loads.busy)
        while loads.busy and time.monotonic() < deadline:
            await asyncio.sleep(min(timeouts.poll, max(0.0, deadline - time.monotonic())))
            loads = await self._loads(p)
        if not loads.busy:
            return held
        p.phase = "aborting"
        count = loads.busy
        await self.engine.abort_all()
        p.aborted += count
        self.metrics.aborted.inc(count)
        log.info("drain deadline passed: aborted %d in-flight requests", count)
        settle = time.monotonic() + timeouts.abort_settle
        while time.monotonic() < settle:
            await asyncio.sleep(timeouts.poll)
            if not (await self._loads(p)).busy:
                return True
        log.warning(
            "engine still busy %.0fs after abort_all; trying the switch anyway",
            timeouts.abort_settle,
        )
        return True

    def _graph_memory_gb(self) -> float | None:
        if self.config.decode_cuda_graph_memory_gb is not None:
            return self.config.decode_cuda_graph_memory_gb
        return self.health.graph_memory_gb

    async def _switch_body(self, target: Role) -> dict[str, Any]:
        """``PdRoleSwitchReqInput``; a flip to decode carries the decode-graph memory when
        the engine has no decode CUDA graphs (it was launched as prefill)."""
        body: dict[str, Any] = {"new_role": target}
        if target != "decode":
            return body
        try:
            info = await self.engine.server_info()
        except EngineUnavailable as exc:
            # Nothing is lost: an engine that needs the value answers 400 and says so.
            log.warning("no /server_info before the flip (%s); sending no graph memory", exc)
            return body
        self.health.observe_info(info)
        if not internal_states(info)[0].get("decode_cuda_graph_bs"):
            gb = self._graph_memory_gb()
            if gb is not None:
                body["decode_cuda_graph_memory_gb"] = gb
        return body
