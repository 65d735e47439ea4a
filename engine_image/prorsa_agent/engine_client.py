"""The agent's HTTP client for one SGLang 0.5.23 engine on the same pod.

Every failure to reach the engine (refused connection, reset, timeout, a 5xx that is not
part of an endpoint's contract) becomes :class:`EngineUnavailable`, so that the switch logic
can tell "the engine said no" (an answer) from "the engine is gone" (no answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

LOADS_QUERY = {"include": "core,memory,disagg,queues"}


class EngineUnavailable(Exception):
    """No usable answer from the engine: it is down, restarting, hung or crashed."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


class EngineProtocolError(EngineUnavailable):
    """The engine answered, but not in the 0.5.23 wire format."""


class EngineRefused(Exception):
    """The engine answered a control call with a client error (401, 403, 404, 422): the call
    had no effect, typically a wrong engine API key or an engine without role switching."""


@dataclass(frozen=True, kw_only=True)
class Loads:
    """``GET /v1/loads`` summed over DP ranks, in the quantities the agent reports."""

    role: str | None
    running: int
    waiting: int
    inflight: int
    waiting_tokens: int
    kv_used: int
    kv_capacity: int
    prefill_busy_seconds: float
    prefill_tokens: int
    ranks: int

    @property
    def busy(self) -> int:
        """Requests the engine still holds; SGLang refuses a switch unless this is 0."""
        return self.running + self.waiting + self.inflight

    @classmethod
    def parse(cls, body: Any) -> Loads:
        try:
            loads = body["loads"]
            if not isinstance(loads, list) or not loads:
                raise ValueError("no DP rank in 'loads'")
            modes = {(load.get("disaggregation") or {}).get("mode") for load in loads}
            inflight = sum(
                int((load.get("disaggregation") or {}).get("prefill_inflight_queue_reqs", 0))
                for load in loads
            )
            return cls(
                role=modes.pop() if len(modes) == 1 else None,
                running=sum(int(load["num_running_reqs"]) for load in loads),
                waiting=sum(int(load["num_waiting_reqs"]) for load in loads),
                inflight=inflight,
                waiting_tokens=sum(_waiting_tokens(load) for load in loads),
                kv_used=sum(int(load["num_used_tokens"]) for load in loads),
                kv_capacity=sum(int(load["max_total_num_tokens"]) for load in loads),
                prefill_busy_seconds=sum(int(load["total_prefill_busy_us"]) for load in loads)
                / 1e6,
                prefill_tokens=sum(int(load["total_prefill_uncached_tokens"]) for load in loads),
                ranks=len(loads),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineProtocolError(f"unexpected /v1/loads body: {exc!r}") from exc


def _waiting_tokens(load: dict[str, Any]) -> int:
    """Prompt tokens waiting on one DP rank: for prefill, those still to compute; for
    decode, those waiting for KV room.

    SGLang 0.5.23 (``load_inquirer.py``) reports no uncached tokens on a decode rank, and
    counts its prealloc and retracted queues' prompts in ``num_total_tokens`` beyond
    ``num_used_tokens``: requests that wait for this engine's KV, not for a prefill.
    """
    if (load.get("disaggregation") or {}).get("mode") == "decode":
        return max(0, int(load["num_total_tokens"]) - int(load["num_used_tokens"]))
    return int(load["num_waiting_uncached_tokens"])


@dataclass(frozen=True, kw_only=True)
class SwitchReply:
    """``PdRoleSwitchReqOutput`` plus the HTTP status it came with."""

    status: int
    success: bool
    message: str
    old_role: str
    new_role: str
    safe_to_restore: bool


def internal_states(info: Any) -> list[dict[str, Any]]:
    states = info.get("internal_states") if isinstance(info, dict) else None
    if not isinstance(states, list) or not states or not all(isinstance(s, dict) for s in states):
        raise EngineProtocolError("/server_info has no internal_states")
    return states


class EngineClient:
    def __init__(self, base_url: str, *, timeout: float, api_key_file: Path | None = None) -> None:
        self._base = base_url.rstrip("/")
        self._timeout = timeout
        self._key_file = api_key_file
        self._client = httpx.AsyncClient(base_url=self._base, timeout=timeout, trust_env=False)

    @property
    def url(self) -> str:
        return self._base

    async def aclose(self) -> None:
        await self._client.aclose()

    def _headers(self) -> dict[str, str]:
        if self._key_file is None:
            return {}
        try:
            key = self._key_file.read_text().strip()
        except OSError as exc:
            raise EngineUnavailable(f"cannot read the engine API key file: {exc}") from exc
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _request(
        self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        try:
            return await self._client.request(
                method,
                path,
                headers=self._headers(),
                timeout=self._timeout if timeout is None else timeout,
                **kwargs,
            )
        except httpx.TimeoutException as exc:
            raise EngineUnavailable(f"{method} {path} timed out", timeout=True) from exc
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"{method} {path} failed: {exc!r}") from exc

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self._request(method, path, **kwargs)
        if response.status_code != 200:
            raise EngineUnavailable(f"{method} {path} answered HTTP {response.status_code}")
        try:
            return response.json()
        except ValueError as exc:
            raise EngineProtocolError(f"{method} {path} did not answer JSON") from exc

    async def loads(self) -> Loads:
        return Loads.parse(await self._json("GET", "/v1/loads", params=LOADS_QUERY))

    async def server_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        info: dict[str, Any] = await self._json("GET", "/server_info", timeout=timeout)
        internal_states(info)
        return info

    async def health(self, path: str = "/health", *, timeout: float | None = None) -> bool:
        """True on HTTP 200; False on any other answer; raises when there is no answer."""
        response = await self._request("GET", path, timeout=timeout)
        return response.status_code == 200

    async def abort_all(self) -> None:
        response = await self._request("POST", "/abort_request", json={"abort_all": True})
        if 400 <= response.status_code < 500:
            raise EngineRefused(f"/abort_request answered HTTP {response.status_code}")
        if response.status_code != 200:
            raise EngineUnavailable(f"/abort_request answered HTTP {response.status_code}")

    async def pd_role_switch(self, body: dict[str, Any], *, timeout: float) -> SwitchReply:
        response = await self._request("POST", "/pd_role_switch", json=body, timeout=timeout)
        if response.status_code not in (200, 400):
            message = f"/pd_role_switch answered HTTP {response.status_code}: {response.text[:200]}"
            if 400 <= response.status_code < 500:
                raise EngineRefused(message)
            raise EngineUnavailable(message)
        try:
            data = response.json()
            return SwitchReply(
                status=response.status_code,
                success=bool(data["success"]),
                message=str(data.get("message", "")),
                old_role=str(data.get("old_role", "")),
                new_role=str(data.get("new_role", "")),
                safe_to_restore=bool(data.get("safe_to_restore", False)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            # A 400 from the framework (no PdRoleSwitchReqOutput): treat as a refusal.
            raise EngineProtocolError(
                f"/pd_role_switch answered HTTP {response.status_code} without "
                f"PdRoleSwitchReqOutput: {response.text[:200]!r}"
            ) from exc
