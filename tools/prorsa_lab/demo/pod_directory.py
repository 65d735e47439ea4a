"""The engine pods of the demo's RolloutCluster by their role label, as a user watches them.

:class:`PodDirectory` lists the cluster's engine pods from the API server every 0.1 s and
keeps each one's ``prorsa.io/role`` label (``prefill``, ``decode``, or ``draining`` while a
switch runs) and every change of it: the live view's split, the phase lags of the summary
and the timeline's role steps come from it. Routing is smg's (it reads the same labels
through its own Kubernetes discovery); nothing here sends a request to an engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from prorsa_contract.aio import cancel_and_wait
from prorsa_contract.labels import (
    CLUSTER_LABEL,
    COMPONENT_LABEL,
    NODE_RANK_LABEL,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
    parse_intent,
)

log = logging.getLogger("prorsa_lab.demo.pod_directory")


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


@dataclass(frozen=True, slots=True)
class IntentChange:
    """The switch intent annotation's phase on a pod: ``draining`` (waiting for the router
    to drop it), ``switching`` (the router dropped it: the agent drains and flips), or None
    (no switch runs). What the demo splits each switch's time by (demo/lag_parts.py)."""

    at: float  # wall clock
    pod: str
    phase: str | None


class PodDirectory:
    """The engine pods of one RolloutCluster as the API server lists them."""

    def __init__(
        self,
        *,
        api_url: str,
        namespace: str,
        cluster: str,
        token: str = "",
        interval: float = 0.1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.namespace = namespace
        self.cluster = cluster
        self.interval = interval
        self.clock = clock
        self.pods: dict[str, PodView] = {}
        self.changes: list[LabelChange] = []
        self.intents: list[IntentChange] = []
        self._phases: dict[str, str | None] = {}
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
        await cancel_and_wait(self._task)
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
            phase = str(parsed["phase"]) if parsed and parsed.get("phase") else None
            if self._phases.get(meta["name"]) != phase:
                self._phases[meta["name"]] = phase
                self.intents.append(IntentChange(at=now, pod=meta["name"], phase=phase))
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
