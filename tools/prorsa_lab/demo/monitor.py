"""What the demo watches while it runs, through the interfaces a user has.

Every ``interval`` seconds, concurrently: the latest Decision (``GET .../forecast`` on the
webhook), the operator's ``/metrics``, the RolloutCluster's status from the API server, and
each engine pod's agent (``GET /v1/state``). The samples feed the live view, the summary
and the timeline PNG; label changes come from the demo's :class:`PodDirectory`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prorsa.core.spec import GROUP, PLURAL, VERSION
from prorsa.engines.agent_tls import agent_server_name
from prorsa_contract.aio import cancel_and_wait
from prorsa_contract.labels import agent_tls_secret_name
from prorsa_lab.demo.pod_directory import PodDirectory

log = logging.getLogger("prorsa_lab.demo.monitor")

Metrics = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Metrics:
    """Prometheus text -> {sample name: [(labels, value)]} (``_total``, ``_sum`` included)."""
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def metric_sum(
    metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str
) -> float:
    """Sum of a sample's values over the series whose labels include ``match``."""
    return sum(
        value
        for labels, value in metrics.get(name, [])
        if all(labels.get(k) == v for k, v in match.items())
    )


@dataclass(frozen=True, slots=True)
class PodState:
    """One engine pod as the demo sees it: its label and its agent's report."""

    name: str
    role: str  # label
    intent: str | None  # switching toward
    engine_role: str | None  # what the engine itself says
    running: int = 0
    waiting: int = 0
    waiting_tokens: int = 0
    kv_used: int = 0
    kv_capacity: int = 0
    healthy: bool = False


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # wall clock
    labels: dict[str, int]  # prefill / decode / draining pod counts
    target: tuple[int, int] | None  # the latest Decision's target (prefill, decode)
    demand: tuple[float, float] | None  # a = W_P/(S·θ_P), b = (K_D+K̂_D)/C_KV, instances
    kv_used_decode: int  # Σ KV in use on decode engines (agents)
    waiting_prefill_tokens: int  # Σ prompt tokens queued on prefill engines (agents)
    waiting_prefill_requests: int  # Σ requests queued on prefill engines (agents)
    events_total: float  # webhook events accepted so far
    mode: str | None
    # Eq. 1's best split (prefill, decode) for the planned demand, before the hold rules
    # and switch pricing (prorsa_best_split_instances); the planned (smoothed) demand in
    # instances; this machine's 1-minute load average.
    best: tuple[int, int] | None = None
    planned: tuple[float, float] | None = None
    load: float | None = None


@dataclass(frozen=True, slots=True)
class SeenSwitch:
    """A switch the demo saw finished: the RolloutCluster status's record of it
    (``prorsa.core.spec.SwitchRecord``, as the API returns it) and when it was seen."""

    pod: str
    origin: str
    to: str
    started: str  # as the operator stamps it (UTC, seconds)
    seconds: float
    result: str
    seen: float  # wall clock when the demo first saw it finished


@dataclass(frozen=True, slots=True)
class DrainMark:
    """An agent's cumulative drain seconds (``prorsa_agent_drain_duration_seconds_sum``)
    as read at ``t``: the difference across a switch is that switch's drain."""

    t: float  # wall clock
    pod: str
    total: float


AGENT_DRAIN_SUM = "prorsa_agent_drain_duration_seconds_sum"


@dataclass
class Monitor:
    webhook: str
    cluster_path: str  # /v1/namespaces/<ns>/rolloutclusters/<name>
    api_url: str
    namespace: str
    cluster: str
    token: str
    agent_port: int
    directory: PodDirectory
    interval: float = 1.0
    clock: Callable[[], float] = time.time
    decisions: list[dict[str, Any]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    switches: dict[tuple[str, str], SeenSwitch] = field(default_factory=dict)
    pods: list[PodState] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    # (wall clock, status.accuracy) at every poll: the WAPE of the rollout is the one read
    # when dispatching stopped, not after the drain the scored windows then slide over.
    accuracy: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    metrics: Metrics = field(default_factory=dict)
    event_rate: float = 0.0  # webhook events per second over the last interval
    metrics_url: str = ""  # the operator's /metrics (its own port); empty: {webhook}/metrics
    # Seconds the cluster's Degraded condition was True, between status reads.
    degraded_seconds: float = 0.0
    _degraded_since: float | None = None
    errors: int = 0
    _http: httpx.AsyncClient | None = None
    # The agents serve https with their cluster's CA (operator/prorsa/engines/agent_tls.py):
    # a client trusting it alone, built once the Secret is readable.
    _agents_http: httpx.AsyncClient | None = None
    _task: asyncio.Task[None] | None = None
    # Each agent's drain seconds, read at its first poll, then while its pod is labelled
    # ``draining`` and at the poll after (one /metrics a second per switching pod only).
    drains: list[DrainMark] = field(default_factory=list)
    _drain_watch: set[str] = field(default_factory=set)

    async def __aenter__(self) -> Monitor:
        self._http = httpx.AsyncClient(timeout=5.0)
        await self.poll()
        self._task = asyncio.create_task(self._loop(), name="demo-monitor")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._task)
        with contextlib.suppress(Exception):
            await self.poll()  # the final counters for the summary
        if self._http is not None:
            await self._http.aclose()
        if self._agents_http is not None:
            await self._agents_http.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.poll()

    @property
    def decision(self) -> dict[str, Any] | None:
        return self.decisions[-1] if self.decisions else None

    async def poll(self) -> None:
        assert self._http is not None
        results = await asyncio.gather(
            self._forecast(), self._metrics(), self._status(), self._agents(),
            return_exceptions=True,
        )  # fmt: skip
        for result in results:
            if isinstance(result, BaseException):
                self.errors += 1
                log.debug("monitor poll failed: %r", result)
        self._sample()

    async def _forecast(self) -> None:
        assert self._http is not None
        reply = await self._http.get(
            f"{self.webhook}{self.cluster_path}/forecast",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        if reply.status_code == 404:
            return  # no tick yet
        reply.raise_for_status()
        decision = reply.json()
        if not self.decisions or decision.get("at") != self.decisions[-1].get("at"):
            self.decisions.append(decision)

    async def _metrics(self) -> None:
        assert self._http is not None
        reply = await self._http.get(self.metrics_url or f"{self.webhook}/metrics")
        reply.raise_for_status()
        fresh = parse_metrics(reply.text)
        before = metric_sum(self.metrics, "prorsa_webhook_events_total")
        after = metric_sum(fresh, "prorsa_webhook_events_total")
        if self.metrics:
            self.event_rate = max(0.0, after - before) / self.interval
        self.metrics = fresh

    async def _status(self) -> None:
        assert self._http is not None
        reply = await self._http.get(
            f"{self.api_url}/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/"
            f"{PLURAL}/{self.cluster}"
        )
        reply.raise_for_status()
        self.status = reply.json().get("status") or {}
        now = self.clock()
        degraded = any(
            c.get("type") == "Degraded" and c.get("status") == "True"
            for c in self.status.get("conditions") or []
        )
        if self._degraded_since is not None:
            self.degraded_seconds += now - self._degraded_since
        self._degraded_since = now if degraded else None
        if self.status.get("accuracy"):
            self.accuracy.append((now, self.status["accuracy"]))
        for entry in self.status.get("switchHistory") or []:
            key = (str(entry.get("pod")), str(entry.get("started")))
            if key not in self.switches:
                self.switches[key] = SeenSwitch(
                    pod=key[0],
                    origin=str(entry.get("from")),
                    to=str(entry.get("to")),
                    started=key[1],
                    seconds=float(entry.get("seconds") or 0.0),
                    result=str(entry.get("result")),
                    seen=now,
                )

    async def _agent_client(self) -> httpx.AsyncClient | None:
        """A client that trusts the cluster's agent CA (None until its Secret exists)."""
        if self._agents_http is None:
            assert self._http is not None
            reply = await self._http.get(
                f"{self.api_url}/api/v1/namespaces/{self.namespace}/secrets/"
                f"{agent_tls_secret_name(self.cluster)}"
            )
            if reply.status_code == 404:
                return None
            reply.raise_for_status()
            secret = reply.json()
            ca = (secret.get("stringData") or {}).get("ca.crt")
            if ca is None and (secret.get("data") or {}).get("ca.crt"):
                ca = base64.b64decode(secret["data"]["ca.crt"]).decode()
            if not ca:
                return None
            self._agents_http = httpx.AsyncClient(
                verify=ssl.create_default_context(cadata=ca), timeout=5.0
            )
        return self._agents_http

    async def _agents(self) -> None:
        assert self._http is not None
        views = sorted(self.directory.pods.values(), key=lambda p: p.name)
        client = await self._agent_client()

        seen = {m.pod for m in self.drains}
        draining = {v.name for v in views if v.role == "draining"}
        watch, self._drain_watch = self._drain_watch | draining, draining

        async def get(view: Any, path: str) -> httpx.Response:
            if client is None:
                assert self._http is not None
                return await self._http.get(f"http://{view.ip}:{self.agent_port}{path}")
            name = agent_server_name(pod=view.name, cluster=self.cluster, namespace=self.namespace)
            return await client.get(
                f"https://{view.ip}:{self.agent_port}{path}", extensions={"sni_hostname": name}
            )

        async def drained(view: Any) -> None:
            reply = await get(view, "/metrics")
            reply.raise_for_status()
            total = metric_sum(parse_metrics(reply.text), AGENT_DRAIN_SUM)
            self.drains.append(DrainMark(t=self.clock(), pod=view.name, total=total))

        async def one(view: Any) -> PodState:
            base = PodState(name=view.name, role=view.role, intent=view.intent, engine_role=None)
            if not view.ip:
                return base
            if view.name in watch or view.name not in seen:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    await drained(view)
            try:
                reply = await get(view, "/v1/state")
                body = reply.json()
            except (httpx.HTTPError, ValueError):
                return base
            return PodState(
                name=view.name,
                role=view.role,
                intent=view.intent,
                engine_role=body.get("role"),
                running=int(body.get("runningRequests") or 0),
                waiting=int(body.get("waitingRequests") or 0),
                waiting_tokens=int(body.get("waitingTokens") or 0),
                kv_used=int(body.get("kvUsedTokens") or 0),
                kv_capacity=int(body.get("kvCapacityTokens") or 0),
                healthy=bool(body.get("healthy")) and reply.status_code == 200,
            )

        self.pods = list(await asyncio.gather(*(one(v) for v in views)))

    def accuracy_at(self, t: float) -> dict[str, Any]:
        """``status.accuracy`` as last read at or before wall time ``t`` (else the latest)."""
        before = [acc for at, acc in self.accuracy if at <= t]
        if before:
            return before[-1]
        return self.status.get("accuracy") or {}

    def demand(self) -> tuple[float, float] | None:
        a = metric_sum(self.metrics, "prorsa_demand_instances", role="prefill")
        b = metric_sum(self.metrics, "prorsa_demand_instances", role="decode")
        if "prorsa_demand_instances" not in self.metrics:
            return None
        return a, b

    def _by_role(self, name: str) -> tuple[float, float] | None:
        if name not in self.metrics:
            return None
        pick = {"cluster": self.cluster}
        return (
            metric_sum(self.metrics, name, role="prefill", **pick),
            metric_sum(self.metrics, name, role="decode", **pick),
        )

    def best(self) -> tuple[int, int] | None:
        """Eq. 1's best split, as the operator's last tick exported it."""
        split = self._by_role("prorsa_best_split_instances")
        return None if split is None else (round(split[0]), round(split[1]))

    def planned(self) -> tuple[float, float] | None:
        """The demand the split is sized for (averaged over smoothingSeconds), instances."""
        return self._by_role("prorsa_planned_demand_instances")

    def _sample(self) -> None:
        d = self.decision
        target = (int(d["target"]["prefill"]), int(d["target"]["decode"])) if d else None
        self.samples.append(
            Sample(
                t=self.clock(),
                labels=self.directory.counts(),
                target=target,
                demand=self.demand(),
                kv_used_decode=sum(p.kv_used for p in self.pods if p.engine_role == "decode"),
                waiting_prefill_tokens=sum(
                    p.waiting_tokens for p in self.pods if p.engine_role == "prefill"
                ),
                waiting_prefill_requests=sum(
                    p.waiting for p in self.pods if p.engine_role == "prefill"
                ),
                events_total=metric_sum(self.metrics, "prorsa_webhook_events_total"),
                mode=d.get("mode") if d else None,
                best=self.best(),
                planned=self.planned(),
                load=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            )
        )

    # -- the numbers of the summary -----------------------------------------------------------

    def switch_counts(self) -> dict[str, float]:
        """Switches by result, from the operator's counter (every switch, not the last 5)."""
        out: dict[str, float] = {}
        for labels, value in self.metrics.get("prorsa_switches_total", []):
            if labels.get("cluster") == self.cluster and value:
                out[labels["result"]] = out.get(labels["result"], 0.0) + value
        return out

    def switch_directions(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in self.metrics.get("prorsa_switches_total", []):
            if labels.get("cluster") == self.cluster and value:
                key = f"{labels['from_role']}->{labels['to_role']}"
                out[key] = out.get(key, 0.0) + value
        return out

    def switch_mean_seconds(self) -> float | None:
        total = metric_sum(self.metrics, "prorsa_switch_duration_seconds_sum", cluster=self.cluster)
        count = metric_sum(
            self.metrics, "prorsa_switch_duration_seconds_count", cluster=self.cluster
        )
        return total / count if count else None
