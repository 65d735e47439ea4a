"""Talking to engine pods: their agents' ``/v1/state`` and ``/v1/role``, and the router.

Every call has a short, explicit timeout; a pod that does not answer is reported as
unavailable instead of holding up the tick for every other pod.

Agents serve HTTPS with their cluster's certificate (:mod:`prorsa.engines.agent_tls`): the
operator connects to the pod IP, trusts that cluster's CA only, and checks the pod's DNS
name ``<pod>.<cluster>-engines.<namespace>.svc`` in the certificate (sent as SNI too). A
pod whose spec mounts no agent certificate (made by an operator before TLS) is reached
over plain HTTP until it is replaced.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import ValidationError

from prorsa.engines.agent_env import AGENT_TLS_CERT_ENV
from prorsa.engines.agent_tls import agent_server_name
from prorsa_contract.agent_api import EngineState, RoleRequest, RoleResult
from prorsa_contract.labels import CLUSTER_LABEL

STATE_TIMEOUT = 2.0


@dataclass(frozen=True, slots=True)
class AgentAddress:
    instance: str
    url: str  # http(s)://<pod IP>:<agent port>
    server_name: str | None = None
    """The name the agent's certificate must carry (https only)."""
    ca: str | None = field(default=None, repr=False)
    """PEM of the only CA trusted for this agent (https only)."""


def serves_tls(pod: dict[str, Any]) -> bool:
    """Whether the pod's agent was configured with a serving certificate."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if any(e.get("name") == AGENT_TLS_CERT_ENV for e in container.get("env") or []):
            return True
    return False


def agent_address(pod: dict[str, Any], *, port: int, ca: str | None) -> AgentAddress | None:
    """How to reach the pod's agent: None while it has no IP.

    A pod that serves TLS with no CA known to the operator gets an https address with no
    CA: every call to it fails (reported unavailable) rather than going out unverified.
    """
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    meta = pod["metadata"]
    return address_of(
        pod=meta["name"],
        ip=ip,
        cluster=(meta.get("labels") or {}).get(CLUSTER_LABEL, ""),
        namespace=meta.get("namespace") or "default",
        tls=serves_tls(pod),
        port=port,
        ca=ca,
    )


def address_of(
    *, pod: str, ip: str | None, cluster: str, namespace: str, tls: bool, port: int, ca: str | None
) -> AgentAddress | None:
    """:func:`agent_address` from the pod's fields (a typed pod view holds them)."""
    if not ip:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    if not tls:
        return AgentAddress(pod, f"http://{host}:{port}")
    name = agent_server_name(pod=pod, cluster=cluster, namespace=namespace)
    return AgentAddress(pod, f"https://{host}:{port}", server_name=name, ca=ca or "")


@dataclass(frozen=True, slots=True)
class Unanswered:
    """Why an agent gave no usable ``/v1/state``: ``cause`` is the Event reason (one Warning
    Event per cause), ``detail`` the sentence for the status, the Event and the log."""

    cause: str
    detail: str


class AgentClient:
    """httpx clients for every agent of every cluster: one for plain HTTP, one per CA
    (each trusting that CA alone); the token is per cluster."""

    def __init__(self, *, client: httpx.AsyncClient | None = None) -> None:
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(STATE_TIMEOUT), limits=httpx.Limits(max_connections=256)
        )
        self._verified: dict[str, httpx.AsyncClient] = {}
        self._closed = False

    async def aclose(self) -> None:
        self._closed = True
        clients = [self._client, *self._verified.values()]
        self._verified.clear()
        for client in clients:
            await client.aclose()

    def _for(self, address: AgentAddress) -> tuple[httpx.AsyncClient, dict[str, Any]]:
        """The client and request extensions for one agent."""
        if self._closed:
            raise RuntimeError("the agent client has been closed")
        if address.server_name is None:
            return self._client, {}
        if not address.ca:
            raise httpx.ConnectError(f"no CA known for the agent of {address.instance}")
        client = self._verified.get(address.ca)
        if client is None:
            context = ssl.create_default_context(cadata=address.ca)
            client = httpx.AsyncClient(
                verify=context,
                timeout=httpx.Timeout(STATE_TIMEOUT),
                limits=httpx.Limits(max_connections=256),
            )
            self._verified[address.ca] = client
        return client, {"sni_hostname": address.server_name}

    async def state(self, address: AgentAddress) -> EngineState | None:
        """The agent's ``/v1/state``; None when it does not answer sensibly in time."""
        answer = await self.poll(address)
        return answer if isinstance(answer, EngineState) else None

    async def poll(self, address: AgentAddress) -> EngineState | Unanswered:
        """The agent's ``/v1/state``, or why there is none (what the status and the
        Events then say about the pod)."""
        url = f"{address.url}/v1/state"
        try:
            client, extensions = self._for(address)
            reply = await client.get(url, timeout=STATE_TIMEOUT, extensions=extensions)
            reply.raise_for_status()
            state = EngineState.model_validate_json(reply.content)
        except httpx.TimeoutException:
            return Unanswered(
                "AgentTimeout", f"its agent did not answer {url} within {STATE_TIMEOUT:g} s"
            )
        except httpx.HTTPStatusError as exc:
            code = exc.response.status_code
            return Unanswered("AgentError", f"its agent answered {url} with HTTP {code}")
        except httpx.ConnectError as exc:
            text = str(exc)
            if (
                isinstance(exc.__context__, ssl.SSLError)
                or "CERTIFICATE" in text.upper()
                or "no CA known" in text
            ):
                return Unanswered(
                    "AgentUntrusted", f"its agent's certificate does not verify ({exc})"
                )
            return Unanswered("AgentUnreachable", f"cannot connect to its agent at {url} ({exc})")
        except httpx.HTTPError as exc:
            return Unanswered("AgentUnreachable", f"{url}: {type(exc).__name__}: {exc}")
        except ValidationError:
            return Unanswered("AgentError", f"its agent's {url} is not a /v1/state body")
        if state.instance != address.instance:
            # A pod IP reused by another pod: never act on the wrong engine.
            return Unanswered(
                "AgentError", f"{url} answers as {state.instance!r}: the pod IP was reused"
            )
        return state

    async def states(
        self, addresses: Iterable[AgentAddress]
    ) -> dict[str, EngineState | Unanswered]:
        """Poll every agent concurrently."""
        addresses = list(addresses)
        results = await asyncio.gather(*(self.poll(a) for a in addresses))
        return {a.instance: r for a, r in zip(addresses, results, strict=True)}

    async def set_role(
        self, address: AgentAddress, *, request: RoleRequest, token: str
    ) -> RoleResult:
        """``POST /v1/role`` with ``request``. The agent drains, aborts, flips and verifies;
        this waits.

        The call is idempotent on the agent: a retry after a lost connection reports the
        same switch's progress or result instead of starting another.
        """
        body = request.model_dump(mode="json", by_alias=True)
        headers = {"Authorization": f"Bearer {token}"}
        timeout = httpx.Timeout(request.drain_timeout_seconds + 900.0, connect=5.0)
        last_error = ""
        last_reply: httpx.Response | None = None
        failures = 0
        while failures < 3:
            try:
                client, extensions = self._for(address)
                reply = await client.post(
                    f"{address.url}/v1/role",
                    json=body,
                    headers=headers,
                    timeout=timeout,
                    extensions=extensions,
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


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterView:
    """The router's workers' URLs at one moment."""

    urls: tuple[str, ...]

    def lists(self, ip: str) -> bool:
        # smg's URLs: ``http://IP:PORT``, with ``@RANK`` per DP rank under --dp-aware.
        return any(f"//{ip}:" in url for url in self.urls)


class RouterClient:
    """The router's worker list, to know when a ``draining`` pod has left the pool."""

    def __init__(self, *, client: httpx.AsyncClient) -> None:
        self._client = client

    async def view(self, router_url: str) -> RouterView | None:
        """What the router routes to now; None when it cannot be asked.

        smg lists a worker in ``GET /workers`` only once its registration (a background
        job that probes the engine, seconds on a busy one) has finished, and a router that
        has just (re)started lists nothing until discovery has registered the pods. An
        absent worker is therefore no proof on its own; the rest of the list tells a
        caller whether it is the router's settled view.
        """
        try:
            reply = await self._client.get(f"{router_url}/workers", timeout=STATE_TIMEOUT)
            reply.raise_for_status()
            data = reply.json()
        except (httpx.HTTPError, ValueError):
            return None
        workers = data.get("workers", data) if isinstance(data, dict) else data
        if not isinstance(workers, list):
            return None
        urls = (w.get("url", "") if isinstance(w, dict) else str(w) for w in workers)
        return RouterView(urls=tuple(u for u in urls if isinstance(u, str)))

    async def lists(self, router_url: str, pod_ip: str) -> bool | None:
        """Whether the router still routes to ``pod_ip``; None when it cannot be asked."""
        view = await self.view(router_url)
        return None if view is None else view.lists(pod_ip)
