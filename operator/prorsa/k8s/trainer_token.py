"""The trainer's bearer token: read from its Secret at start, then followed while it runs.

The token lives in the Secret ``spec.trainer.tokenSecretRef`` names, else in
``<cluster>-trainer-token`` (key ``token``), which the operator creates with 32 random
bytes and owns. Rotating it must not need an operator restart, and a leaked token must stop
working soon after it is replaced, so :class:`TokenFollower` reads the Secret again every
:data:`POLL_SECONDS` and puts a changed token in force at once: from then on the new token
is accepted and the old one refused (no overlap). A spec edit that names another Secret or
key is followed the same way, since each read looks at the spec as it is now.

Why polling: the chart grants ``get`` and ``create`` on Secrets, never ``list`` or
``watch`` (a watch would let the operator read every Secret of a namespace as it changes).
One GET per cluster every two seconds is the price.

A Secret that is missing, lacks its key or holds no usable token leaves the token in force
as it is (a typo in a spec edit must not lock the trainer out) and says why, once per cause,
in a Warning Event. The operator's own Secret is the exception: deleted, it is created again
with a fresh token, which is how to rotate it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prorsa.clusters import ClusterHandle
from prorsa.clusters.auth import normalize_token
from prorsa.core.spec import GROUP, VERSION, RolloutClusterSpec
from prorsa.k8s import objects as obj
from prorsa.k8s.kube import Kube

log = logging.getLogger("prorsa.operator")

POLL_SECONDS = 2.0
"""How often the token's Secret is read again: the longest a rotation takes to apply."""
START_ATTEMPTS = 30
START_RETRY_SECONDS = 2.0

EventPoster = Callable[[str, str, str], Awaitable[None]]  # (type, reason, message)


class TokenUnavailable(Exception):
    """The referenced Secret holds no token yet (the operator retries the cluster later)."""


def default_secret_name(cluster: str) -> str:
    return f"{cluster}-trainer-token"


def token_source(spec: RolloutClusterSpec, cluster: str) -> tuple[str, str]:
    """(Secret, key) the trainer token is read from, per the spec as it is now."""
    ref = spec.trainer.token_secret_ref
    if ref is None:
        return default_secret_name(cluster), "token"
    return ref.name, ref.key


def _default_secret(*, namespace: str, name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": default_secret_name(name),
            "namespace": namespace,
            "labels": obj.labels(name, "trainer-token"),
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "RolloutCluster",
                    "name": name,
                    "uid": uid,
                    "controller": True,
                }
            ],
        },
        "type": "Opaque",
        "stringData": {"token": secrets.token_urlsafe(32)},
    }


async def read_token(
    kube: Kube, *, namespace: str, name: str, uid: str, spec: RolloutClusterSpec
) -> str | None:
    """The token as its Secret holds it now; the operator's own Secret is created when
    missing (a fresh token). None when a referenced Secret or its key is missing."""
    secret, key = token_source(spec, name)
    token = await kube.read_secret_key(namespace, secret, key)
    if token is None and spec.trainer.token_secret_ref is None:
        await kube.ensure(_default_secret(namespace=namespace, name=name, uid=uid))
        token = await kube.read_secret_key(namespace, secret, key)
    return token


async def initial_token(
    kube: Kube, *, namespace: str, name: str, uid: str, spec: RolloutClusterSpec
) -> str:
    """The token to start serving with: a referenced Secret is waited for a minute (it may
    be created right after the RolloutCluster), then :class:`TokenUnavailable`."""
    secret, key = token_source(spec, name)
    for attempt in range(START_ATTEMPTS):
        token = await read_token(kube, namespace=namespace, name=name, uid=uid, spec=spec)
        if token and token.strip():
            return token.strip()
        if attempt + 1 < START_ATTEMPTS:
            log.warning("%s/%s: waiting for Secret %s key %s", namespace, name, secret, key)
            await asyncio.sleep(START_RETRY_SECONDS)
    raise TokenUnavailable(f"Secret {secret} has no key {key}")


@dataclass(kw_only=True)
class TokenFollower:
    """Reads the token's Secret every ``interval`` seconds; a new token replaces the old
    in ``handle`` at once. ``spec`` returns the cluster's spec as it is now."""

    kube: Kube
    namespace: str
    name: str
    uid: str
    handle: ClusterHandle
    spec: Callable[[], RolloutClusterSpec]
    token: str
    """The token in force (what the handle was created with)."""
    post_event: EventPoster
    interval: float = POLL_SECONDS
    _current: bytes = field(init=False)
    _problem: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._current = normalize_token(self.token)

    async def run(self) -> None:
        """Follow until cancelled; an API error is logged and the next read tries again."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._trouble(f"could not read the trainer token's Secret: {exc!r}"[:300])

    async def check(self) -> bool:
        """Read the token now and put it in force if it changed; True when it did."""
        spec = self.spec()
        secret, key = token_source(spec, self.name)
        raw = await read_token(
            self.kube, namespace=self.namespace, name=self.name, uid=self.uid, spec=spec
        )
        if raw is None:
            await self._trouble(f"Secret {secret} has no key {key}")
            return False
        try:
            token = normalize_token(raw)
        except ValueError as exc:
            await self._trouble(f"Secret {secret} key {key}: {exc}")
            return False
        self._problem = None
        if token == self._current:
            return False
        self.handle.set_token(token)
        self._current = token
        log.info(
            "%s/%s: trainer token rotated (Secret %s key %s): the previous one is refused",
            self.namespace, self.name, secret, key,
        )  # fmt: skip
        await self.post_event(
            "Normal",
            "TrainerTokenRotated",
            f"the token in Secret {secret} key {key} is in force; the previous one is refused",
        )
        return True

    async def _trouble(self, problem: str) -> None:
        if problem == self._problem:
            return
        self._problem = problem
        message = f"{problem}; the trainer token in force stays until it is fixed"
        log.warning("%s/%s: %s", self.namespace, self.name, message)
        await self.post_event("Warning", "TrainerTokenUnavailable", message)
