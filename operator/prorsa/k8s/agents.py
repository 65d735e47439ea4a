"""Talking to engine pods: their agents' ``/v1/state`` and ``/v1/role``, and the router.

Every call has a short, explicit timeout; a pod that does not answer is reported as
unavailable instead of holding up the tick for every other pod.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from prorsa_contract.agent_api import EngineState, RoleResult

STATE_TIMEOUT = 2.0


@dataclass(frozen=True, slots=True)
class AgentAddress:
    instance: str
    url: str  # http://<pod IP>:<agent port>


def agent_url(pod: dict[str, Any], *, port: int) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{port}" if ip else None


class AgentClient:
    """One httpx client for every agent of every cluster; the token is per cluster."""

    def __init__(self, *, client: httpx.AsyncClient | None = None) -> None:
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(STATE_TIMEOUT), limits=httpx.Limits(max_connections=256)
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def state(self, address: AgentAddress) -> EngineState | None:
        """The agent's ``/v1/state``; None when it does not answer sensibly in time."""
        try:
            reply = await self._client.get(f"{address.url}/v1/state", timeout=STATE_TIMEOUT)
            reply.raise_for_status()
            state = EngineState.model_validate_json(reply.content)
        except (httpx.HTTPError, ValidationError):
            return None
        if state.instance != address.instance:
            # A pod IP reused by another pod: never act on the wrong engine.
            return None
        return state

    async def states(self, addresses: Iterable[AgentAddress]) -> dict[str, EngineState | None]:
        """Poll every agent concurrently."""
        addresses = list(addresses)
        results = await asyncio.gather(*(self.state(a) for a in addresses))
        return {a.instance: r for a, r in zip(addresses, results, strict=True)}

    async def set_role(
        self, address: AgentAddress, *, role: str, drain_timeout: float, token: str
    ) -> RoleResult:
        """``POST /v1/role``. The agent drains, aborts, flips and verifies; this waits.

        The call is idempotent on the agent: a retry after a lost connection reports the
        same switch's progress or result instead of starting another.
        """
        body = {"role": role, "drainTimeoutSeconds": drain_timeout}
        headers = {"Authorization": f"Bearer {token}"}
        timeout = httpx.Timeout(drain_timeout + 900.0, connect=5.0)
        last_error = ""
        last_reply: httpx.Response | None = None
        failures = 0
        while failures < 3:
            try:
                reply = await self._client.post(
                    f"{address.url}/v1/role", json=body, headers=headers, timeout=timeout
                )
            except httpx.HTTPError as exc:
                failures += 1
                last_error = f"agent unreachable: {exc!r}"
                await asyncio.sleep(min(2.0 * failures, 10.0))
                continue
            if reply.status_code == 202:
                # The same switch is still running (we reconnected): ask again shortly.
                await asyncio.sleep(1.0)
                continue
            if reply.status_code in (409, 503):
                # 409: another switch runs; 503: the engine cannot switch right now (busy
                # health probes, restarting). Both pass; a failed engine stays failed and
                # its last answer is returned below.
                failures += 1
                last_error = f"agent answered {reply.status_code}: {reply.text[:200]}"
                last_reply = reply
                await asyncio.sleep(min(2.0 * failures, 10.0))
                continue
            try:
                return RoleResult.model_validate_json(reply.content)
            except ValidationError:
                return RoleResult(
                    ok=False,
                    safe_to_restore=True,
                    message=f"agent answered {reply.status_code}: {reply.text[:200]}",
                )
        if last_reply is not None:
            try:
                return RoleResult.model_validate_json(last_reply.content)
            except ValidationError:
                pass
        return RoleResult(ok=False, safe_to_restore=True, message=last_error)


class RouterClient:
    """The router's worker list, to know when a ``draining`` pod has left the pool."""

    def __init__(self, *, client: httpx.AsyncClient) -> None:
        self._client = client

    async def lists(self, router_url: str, pod_ip: str) -> bool | None:
        """Whether the router still routes to ``pod_ip``; None when it cannot be asked."""
        try:
            reply = await self._client.get(f"{router_url}/workers", timeout=STATE_TIMEOUT)
            reply.raise_for_status()
            data = reply.json()
        except (httpx.HTTPError, ValueError):
            return None
        workers = data.get("workers", data) if isinstance(data, dict) else data
        if not isinstance(workers, list):
            return None
        for worker in workers:
            url = worker.get("url", "") if isinstance(worker, dict) else str(worker)
            if f"//{pod_ip}:" in url:
                return True
        return False
