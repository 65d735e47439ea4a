"""What a cluster's agents are called and trusted with: their bearer token, the engines'
admin key, and the per-cluster certificate they serve (docs/security.md).

Each is a Secret made once and then only read back, so an operator restart keeps them and
running pods stay reachable; a Secret deleted (a rotation) is made anew before the next
pod that mounts it is created.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from prorsa.engines.agent_tls import issue_agent_cert
from prorsa.k8s import objects as obj
from prorsa.k8s.kube import Kube
from prorsa_contract.labels import agent_secret_name, agent_tls_secret_name

log = logging.getLogger("prorsa.runtime")


@dataclass(kw_only=True)
class AgentCredentials:
    namespace: str
    name: str  # the RolloutCluster's
    uid: str  # the RolloutCluster's, which owns the Secrets
    kube: Kube
    token: str = ""  # the agents' bearer token
    ca: str | None = None  # the CA the agents' certificate is checked against

    def _owned(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return obj.owned(manifest, cluster=self.name, uid=self.uid)

    async def ensure(self) -> None:
        """The agents' token, the engines' admin key and the agents' certificate."""
        ns, name = self.namespace, self.name
        secret_name = agent_secret_name(name)
        token = await self.kube.read_secret_key(ns, secret_name, "token")
        if token is None:
            token = secrets.token_urlsafe(32)
            await self.kube.ensure(
                self._owned(obj.agent_secret(cluster=name, namespace=ns, token=token))
            )
            token = await self.kube.read_secret_key(ns, secret_name, "token") or token
        self.token = token
        # Created once (ensure() leaves an existing one alone), before any engine pod mounts it.
        key = obj.engine_key_secret(cluster=name, namespace=ns, key=secrets.token_urlsafe(32))
        await self.kube.ensure(self._owned(key))
        await self.ensure_tls()

    async def ensure_tls(self) -> None:
        """The agents' certificate Secret: issued once, then only its CA is read back.

        The Secret may also come from elsewhere (cert-manager, docs/security.md): whatever
        ``ca.crt`` it holds is the one CA trusted for this cluster's agents.
        """
        ns, name = self.namespace, self.name
        secret_name = agent_tls_secret_name(name)
        ca = await self.kube.read_secret_key(ns, secret_name, "ca.crt")
        if ca is None:
            issued = await asyncio.to_thread(issue_agent_cert, cluster=name, namespace=ns)
            manifest = obj.agent_tls_secret(
                cluster=name, namespace=ns, ca=issued.ca, cert=issued.cert, key=issued.key
            )
            await self.kube.ensure(self._owned(manifest))
            ca = await self.kube.read_secret_key(ns, secret_name, "ca.crt")
        if not ca:
            log.error(
                "%s/%s: Secret %s has no ca.crt: agents cannot be verified", ns, name, secret_name
            )
        self.ca = ca or None
