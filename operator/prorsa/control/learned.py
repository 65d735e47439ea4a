"""What the Controller learned, kept across operator restarts in a ConfigMap.

Written every few ticks and when the loop ends (``<cluster>-prorsa-state``,
``learned.json``), read once at set-up: a restart keeps the duration statistics, θ_P and
the switch costs instead of learning them again from the next steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from prorsa.clusters import WebhookCluster
from prorsa.k8s import objects as obj
from prorsa.k8s.kube import Kube

log = logging.getLogger("prorsa.runtime")


@dataclass(kw_only=True)
class LearnedStore:
    namespace: str
    name: str  # the RolloutCluster's
    kube: Kube
    handle: WebhookCluster
    enabled: bool = True  # ClusterLoopSettings.persist

    @property
    def config_map(self) -> str:
        return f"{self.name}-prorsa-state"

    async def save(self) -> None:
        if not self.enabled:
            return
        async with self.handle.exclusive() as controller:
            data = controller.learned_state()
        text = await asyncio.to_thread(json.dumps, data, separators=(",", ":"))
        try:
            await self.kube.write_config_map(
                self.namespace,
                self.config_map,
                {"learned.json": text},
                labels=obj.labels(self.name, "state"),
            )
        except Exception:
            log.exception("%s/%s: could not persist learned statistics", self.namespace, self.name)

    async def restore(self) -> None:
        if not self.enabled:
            return
        data = await self.kube.read_config_map(self.namespace, self.config_map)
        if not data or "learned.json" not in data:
            return
        try:
            learned = json.loads(data["learned.json"])
            async with self.handle.exclusive() as controller:
                controller.restore_learned(learned)
            log.info("%s/%s: restored learned statistics", self.namespace, self.name)
        except (ValueError, TypeError) as exc:
            log.warning(
                "%s/%s: ignoring unreadable learned statistics: %s", self.namespace, self.name, exc
            )
