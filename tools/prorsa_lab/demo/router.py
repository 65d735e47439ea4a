"""A client-side PD router for the demo: engine pods found by their role label.

With ``router.enabled: false`` there is no router deployment, so the demo trainer routes
its own requests, the way a PD router with Kubernetes discovery would:

* :class:`PodDirectory` lists the cluster's engine pods from the API server every 0.1 s
  and keeps each one's ``prorsa.io/role`` label. A pod labelled ``draining`` matches
  neither role, which is how a switching engine stops receiving work.
* :class:`PdRouter` is an ``httpx`` transport, so :class:`prorsa_sdk.ResumableGeneration`
  posts to it as it would to a router URL. Each ``/generate`` runs in two phases: the
  prompt goes to the least-loaded prefill pod (by tokens this router has in flight there;
  SGLang's PD prefill answers with one token and ``finish_reason {"type": "length",
  "length": 0}`` once the KV is ready), then the same request goes to the least-loaded
  decode pod, whose answer is returned. The double's
  decode side simulates the KV arrival, so the prefill time is paid on the prefill pod and
  the decode time on the decode pod, as with real disaggregation.

A switch drains an engine and then aborts what is left: an abort in the decode phase comes
back with the partial output, an abort in the prefill phase with none; both go back to the
caller as ``finish_reason.type == "abort"`` and ResumableGeneration resends. A reply that
shows the engine had already flipped (the label view lags the flip by up to one refresh)
is not the caller's output: that phase is sent again to another pod and counted as
``misrouted``.

The router emits ``prefill_started`` / ``prefill_finished`` with the instance name, so the
Controller's decode-admission recurrence (Eq. 13) knows which prefill queue each request
is in. The request id carries the trajectory: ``rid = "<trajectory>@<turn>"`` (a resume
appends ``-resumeN``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from prorsa_contract.labels import (
    CLUSTER_LABEL,
    COMPONENT_LABEL,
    NODE_RANK_LABEL,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
    parse_intent,
)

log = logging.getLogger("prorsa_lab.demo.router")

PREFILL_DONE = {"type": "length", "length": 0}


class _Emitter(Protocol):
    def prefill_started(
        self, trajectory: str, *, request: str | None = None, instance: str | None = None
    ) -> str: ...

    def prefill_finished(
        self, trajectory: str, *, request: str | None = None, instance: str | None = None
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class PodView:
    name: str
    uid: str
    role: str  # the prorsa.io/role label: prefill, decode or draining
    ip: str | None
    intent: str | None  # the switch intent annotation's target role, while one runs


@dataclass(frozen=True, slots=True)
class LabelChange:
    at: float  # wall clock
    pod: str
    old: str | None  # None: the pod appeared
    new: str | None  # None: the pod is gone


class PodDirectory:
    """The engine pods of one RolloutCluster as the API server lists them.

    ``resolve(name, uid)`` gives a pod's engine URL (in a cluster: ``http://<podIP>:30000``;
    in the demo the fake kubelet knows the port each double listens on).
    """

    def __init__(
        self,
        *,
        api_url: str,
        namespace: str,
        cluster: str,
        resolve: Callable[[str, str], str | None],
        token: str = "",
        interval: float = 0.1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.namespace = namespace
        self.cluster = cluster
        self.resolve = resolve
        self.interval = interval
        self.clock = clock
        self.pods: dict[str, PodView] = {}
        self.changes: list[LabelChange] = []
        self.refreshed = asyncio.Event()
        self._selector = f"{CLUSTER_LABEL}={cluster},{COMPONENT_LABEL}=engine"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=api_url, headers=headers, timeout=5.0)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PodDirectory:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="pod-directory")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._http.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("listing engine pods failed: %s", exc)

    async def refresh(self) -> None:
        reply = await self._http.get(
            f"/api/v1/namespaces/{self.namespace}/pods", params={"labelSelector": self._selector}
        )
        reply.raise_for_status()
        now = self.clock()
        fresh: dict[str, PodView] = {}
        for item in reply.json().get("items", []):
            meta = item.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                continue
            if (meta.get("labels") or {}).get(NODE_RANK_LABEL, "0") != "0":
                continue  # a multi-node instance's worker rank: only leaders serve
            intent = None
            raw = (meta.get("annotations") or {}).get(SWITCH_ANNOTATION)
            parsed = parse_intent(raw) if raw else None
            if parsed:
                intent = parsed.get("to")
            fresh[meta["name"]] = PodView(
                name=meta["name"],
                uid=meta.get("uid", ""),
                role=(meta.get("labels") or {}).get(ROLE_LABEL, ""),
                ip=(item.get("status") or {}).get("podIP"),
                intent=intent,
            )
        for name in sorted(set(self.pods) | set(fresh)):
            old, new = self.pods.get(name), fresh.get(name)
            if old is None or new is None or old.role != new.role:
                self.changes.append(
                    LabelChange(
                        at=now,
                        pod=name,
                        old=old.role if old else None,
                        new=new.role if new else None,
                    )
                )
        self.pods = fresh
        self.refreshed.set()

    def counts(self) -> dict[str, int]:
        out = {"prefill": 0, "decode": 0, "draining": 0}
        for pod in self.pods.values():
            out[pod.role] = out.get(pod.role, 0) + 1
        return out

    def candidates(self, role: str) -> list[tuple[str, str]]:
        """``(pod, engine URL)`` of every pod labelled ``role`` whose engine is reachable."""
        out = []
        for pod in self.pods.values():
            if pod.role != role:
                continue
            url = self.resolve(pod.name, pod.uid)
            if url is not None:
                out.append((pod.name, url))
        return out


@dataclass(slots=True)
class PrefillJob:
    """One prompt's stay in the prefill stage, for the measured-demand curve."""

    queued: float
    tokens: int
    done: float | None = None
    aborted: bool = False


@dataclass(slots=True)
class RouterCounters:
    requests: int = 0
    prefill_aborts: int = 0
    decode_aborts: int = 0
    misrouted: int = 0
    engine_errors: int = 0
    no_pod: int = 0
    by_pod: dict[str, int] = field(default_factory=dict)


class NoEngine(Exception):
    """No pod had the role for ``wait_timeout`` seconds."""


def _finish(reply: dict[str, Any]) -> dict[str, Any]:
    finish = (reply.get("meta_info") or {}).get("finish_reason")
    return finish if isinstance(finish, dict) else {}


def prompt_tokens(body: dict[str, Any]) -> int:
    """Tokens of the prompt as the engine counts them (ids, or whitespace-split words)."""
    ids = body.get("input_ids")
    if isinstance(ids, list):
        return len(ids)
    text = body.get("text")
    return len(text.split()) if isinstance(text, str) else 0


class PdRouter(httpx.AsyncBaseTransport):
    """``POST /generate`` in two phases, prefill pod then decode pod (module docstring)."""

    def __init__(
        self,
        *,
        directory: PodDirectory,
        emitter: _Emitter | None = None,
        wait_timeout: float = 30.0,
        engine_timeout: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.emitter = emitter
        self.wait_timeout = wait_timeout
        self.clock = clock
        self.counters = RouterCounters()
        self.jobs: list[PrefillJob] = []
        self.outstanding: dict[str, int] = {}  # tokens this router has in flight, per pod
        self._turn = 0
        self._engines = httpx.AsyncClient(
            timeout=engine_timeout,
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )

    async def aclose(self) -> None:
        await self._engines.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or request.url.path != "/generate":
            return httpx.Response(404, json={"error": f"no route for {request.url.path}"})
        try:
            body = json.loads(await request.aread())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            return httpx.Response(400, json={"error": str(exc)})
        try:
            reply = await self.generate(body)
        except NoEngine as exc:
            self.counters.no_pod += 1
            return httpx.Response(503, json={"error": str(exc)})
        except httpx.HTTPStatusError as exc:
            self.counters.engine_errors += 1
            return httpx.Response(exc.response.status_code, content=exc.response.content)
        except httpx.TransportError as exc:
            self.counters.engine_errors += 1
            return httpx.Response(502, json={"error": f"engine unreachable: {exc}"})
        return httpx.Response(200, json=reply)

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        self.counters.requests += 1
        rid = str(body.get("rid") or "")
        trajectory = rid.split("@", 1)[0] if "@" in rid else None
        tokens = prompt_tokens(body)
        params = dict(body.get("sampling_params") or {})
        job = PrefillJob(queued=self.clock(), tokens=tokens)
        self.jobs.append(job)

        # Phase 1: prefill. The prefill pod computes the KV and samples the first token.
        prefill_body = {**body, "sampling_params": {**params, "max_new_tokens": 1}}
        while True:
            try:
                pod, reply = await self._send("prefill", prefill_body, trajectory, rid, tokens)
            except BaseException:
                job.done, job.aborted = self.clock(), True
                raise
            finish = _finish(reply)
            if finish == PREFILL_DONE:
                break
            if finish.get("type") == "abort":
                self.counters.prefill_aborts += 1
                job.done, job.aborted = self.clock(), True
                return {
                    "text": "",
                    "output_ids": [],
                    "meta_info": {
                        "id": rid,
                        "finish_reason": {
                            "type": "abort",
                            "message": f"prefill on {pod} aborted: {finish.get('message', '')}",
                        },
                        "prompt_tokens": tokens,
                        "completion_tokens": 0,
                    },
                }
            self.counters.misrouted += 1  # that engine had flipped to decode already
        job.done = self.clock()
        if self.emitter is not None and trajectory is not None:
            self.emitter.prefill_finished(trajectory, request=rid or None, instance=pod)

        # Phase 2: decode, with the KV "transferred" from the prefill pod.
        want = params.get("max_new_tokens", 128)
        kv = tokens + (want if isinstance(want, int) else 0)  # what the decode pod reserves
        while True:
            pod, reply = await self._send("decode", body, None, rid, kv)
            finish = _finish(reply)
            if finish == PREFILL_DONE and isinstance(want, int) and want > 0:
                self.counters.misrouted += 1  # that engine had flipped to prefill already
                continue
            if finish.get("type") == "abort":
                self.counters.decode_aborts += 1
            return reply

    async def _send(
        self, role: str, body: dict[str, Any], trajectory: str | None, rid: str, load: int
    ) -> tuple[str, dict[str, Any]]:
        """POST to the least-loaded pod of ``role``; ``load`` is what the request weighs
        there (prompt tokens to prefill, or KV tokens to hold while decoding)."""
        name, url = await self._pick(role)
        if self.emitter is not None and trajectory is not None:
            self.emitter.prefill_started(trajectory, request=rid or None, instance=name)
        self.outstanding[name] = self.outstanding.get(name, 0) + load
        self.counters.by_pod[name] = self.counters.by_pod.get(name, 0) + 1
        try:
            reply = await self._engines.post(f"{url}/generate", json=body)
        finally:
            self.outstanding[name] -= load
        reply.raise_for_status()
        data = reply.json()
        if not isinstance(data, dict):
            raise httpx.TransportError(f"{name} answered {type(data).__name__}, not an object")
        return name, data

    async def _pick(self, role: str) -> tuple[str, str]:
        """The least-loaded pod with the role (by tokens this router has in flight there)."""
        deadline = time.monotonic() + self.wait_timeout
        while True:
            found = self.directory.candidates(role)
            if found:
                self._turn += 1
                n = len(found)
                # Ties rotate, so equal pods share the work.
                ranked = sorted(
                    range(n),
                    key=lambda i: (self.outstanding.get(found[i][0], 0), (i - self._turn) % n),
                )
                return found[ranked[0]]
            if time.monotonic() >= deadline:
                raise NoEngine(f"no {role} engine for {self.wait_timeout:.0f}s")
            await asyncio.sleep(0.05)
