"""The trainer token follows its Secret and ``spec.trainer.tokenSecretRef`` while the
operator runs (issue 25 item 1): within a poll of a change the new token is accepted and
the old one refused, with no restart.

Against the Kubernetes API emulator and the real webhook over loopback HTTP; the last test
runs the whole operator (kopf) and rotates the Secret a trainer is using.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from conftest import make_spec
from kubernetes import client

from prorsa.clusters import ClusterRegistry
from prorsa.core.controller import Controller
from prorsa.core.spec import GROUP, PLURAL, VERSION, RolloutClusterSpec
from prorsa.ingest import WebhookServer
from prorsa.k8s import crd_manifest
from prorsa.k8s.kube import Kube
from prorsa.k8s.trainer_token import TokenFollower, initial_token
from prorsa_lab.doubles.kube.emulator import KubeEmulatorServer
from prorsa_lab.doubles.stack import PATIENCE, TOKEN_SECRET, cluster_manifest, stack

NS = "rl"
BASE = f"/v1/namespaces/{NS}/rolloutclusters/c"
OLD, NEW = "token-before-rotation", "token-after-rotation"


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Wait for ``check`` (a bound, not a delay: it returns as soon as the check holds)."""
    deadline = time.monotonic() + PATIENCE
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {PATIENCE:.0f} s: {what}")
        await asyncio.sleep(0.05)


@dataclass
class Served:
    kube: Kube
    http: httpx.AsyncClient
    follower: TokenFollower
    spec: list[RolloutClusterSpec]
    events: list[tuple[str, str, str]] = field(default_factory=list)

    async def status(self, token: str) -> int:
        r = await self.http.get(f"{BASE}/status", headers={"Authorization": f"Bearer {token}"})
        return r.status_code

    async def write_secret(self, name: str, data: dict[str, str]) -> None:
        body = {"metadata": {"name": name}, "stringData": data}
        if await self.kube.read_secret_key(NS, name, next(iter(data))) is None:
            await self.kube._call(self.kube.core.create_namespaced_secret, NS, body)
        else:
            await self.kube._call(self.kube.core.replace_namespaced_secret, name, NS, body)


@asynccontextmanager
async def served(spec: RolloutClusterSpec, *, follow: bool = True) -> AsyncIterator[Served]:
    """Namespace rl, Secret trainer-token holding OLD, cluster rl/c served by a webhook whose
    token a follower keeps (polling every 50 ms when ``follow``)."""
    server = KubeEmulatorServer()
    server.emulator.add_crd(crd_manifest.crd())
    with server:
        api = server.api_client()
        kube = Kube(api)
        try:
            namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
            await kube._call(kube.core.create_namespace, namespace)
            secret = {"metadata": {"name": TOKEN_SECRET}, "stringData": {"token": OLD}}
            await kube._call(kube.core.create_namespaced_secret, NS, secret)
            # The owner of the Secret the operator creates (else garbage-collected at once).
            manifest = cluster_manifest("c", namespace=NS)
            owner = await kube._call(
                client.CustomObjectsApi(api).create_namespaced_custom_object,
                GROUP, VERSION, NS, PLURAL, manifest,
            )  # fmt: skip
            uid = owner["metadata"]["uid"]
            token = await initial_token(kube, namespace=NS, name="c", uid=uid, spec=spec)
            registry = ClusterRegistry()
            handle = registry.add(namespace=NS, name="c", token=token, controller=Controller(spec))
            current = [spec]
            events: list[tuple[str, str, str]] = []

            async def post_event(kind: str, reason: str, message: str) -> None:
                events.append((kind, reason, message))

            follower = TokenFollower(
                kube=kube, namespace=NS, name="c", uid=uid, handle=handle,
                spec=lambda: current[0], token=token, post_event=post_event, interval=0.05,
            )  # fmt: skip
            webhook = WebhookServer(registry)
            async with webhook.serving() as url, httpx.AsyncClient(base_url=url) as http:
                task = asyncio.create_task(follower.run()) if follow else None
                try:
                    yield Served(
                        kube=kube, http=http, follower=follower, spec=current, events=events
                    )
                finally:
                    if task is not None:
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)
        finally:
            api.close()


def referenced(name: str = TOKEN_SECRET, key: str = "token") -> RolloutClusterSpec:
    return make_spec(trainer={"tokenSecretRef": {"name": name, "key": key}})


async def test_a_rotated_secret_is_in_force_within_a_poll_and_the_old_token_refused() -> None:
    async with served(referenced()) as env:
        assert await env.status(OLD) == 200
        await env.write_secret(TOKEN_SECRET, {"token": NEW + "\n"})  # a file's trailing newline

        async def rotated() -> bool:
            return await env.status(NEW) == 200

        await eventually(rotated, "the new token accepted")
        assert await env.status(OLD) == 401
        assert [(k, r) for k, r, _ in env.events] == [("Normal", "TrainerTokenRotated")]


async def test_a_spec_naming_another_secret_is_followed() -> None:
    async with served(referenced()) as env:
        await env.write_secret("other", {"bearer": NEW})
        env.spec[0] = referenced("other", "bearer")  # what kopf's spec-update handler sets

        async def followed() -> bool:
            return await env.status(NEW) == 200

        await eventually(followed, "the token of the newly named Secret accepted")
        assert await env.status(OLD) == 401


@pytest.mark.parametrize("problem", ["deleted", "empty", "spaces"])
async def test_a_secret_without_a_usable_token_keeps_the_token_in_force_and_warns_once(
    problem: str,
) -> None:
    async with served(referenced(), follow=False) as env:
        if problem == "deleted":
            await env.kube._call(env.kube.core.delete_namespaced_secret, TOKEN_SECRET, NS)
        else:
            await env.write_secret(TOKEN_SECRET, {"token": "" if problem == "empty" else "a b"})
        for _ in range(3):
            assert await env.follower.check() is False
        assert await env.status(OLD) == 200
        assert [(k, r) for k, r, _ in env.events] == [("Warning", "TrainerTokenUnavailable")]
        assert TOKEN_SECRET in env.events[0][2]
        await env.write_secret(TOKEN_SECRET, {"token": NEW})
        assert await env.follower.check() is True
        assert (await env.status(NEW), await env.status(OLD)) == (200, 401)


async def test_the_operators_own_secret_deleted_is_created_again_with_a_fresh_token() -> None:
    async with served(make_spec(), follow=False) as env:  # no tokenSecretRef
        created = await env.kube.read_secret_key(NS, "c-trainer-token", "token")
        assert created and await env.status(created) == 200
        await env.kube._call(env.kube.core.delete_namespaced_secret, "c-trainer-token", NS)
        assert await env.follower.check() is True
        fresh = await env.kube.read_secret_key(NS, "c-trainer-token", "token")
        assert fresh and fresh != created
        assert (await env.status(fresh), await env.status(created)) == (200, 401)


@pytest.mark.slow  # the whole operator: left out by `make test-fast`
async def test_the_operator_follows_a_rotation_while_a_trainer_posts() -> None:
    """The whole operator: the Secret a running cluster's trainer uses is rotated, then the
    spec is edited to name another Secret; each time the new token works and the old one
    gets 401, with no restart (the webhook's epoch stays)."""
    async with stack() as env:
        await env.create_cluster(cluster_manifest(gpuBudget=16))
        kube = env.kube

        async def status(token: str) -> httpx.Response:
            async with env.http(base_url=env.webhook) as http:
                return await http.get(
                    f"{env.cluster_path()}/status", headers={"Authorization": f"Bearer {token}"}
                )

        def accepted(token: str) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return (await status(token)).status_code == 200

            return check

        await eventually(accepted(env.token), "the cluster served")
        epoch = (await status(env.token)).json()["epoch"]
        secret: dict[str, Any] = {"metadata": {"name": TOKEN_SECRET}, "stringData": {"token": NEW}}
        await kube._call(kube.core.replace_namespaced_secret, TOKEN_SECRET, env.namespace, secret)
        await eventually(accepted(NEW), "the rotated token accepted")
        assert (await status(env.token)).status_code == 401
        other = {"metadata": {"name": "other"}, "stringData": {"key": "third-token"}}
        await kube._call(kube.core.create_namespaced_secret, env.namespace, other)
        ref = {"tokenSecretRef": {"name": "other", "key": "key"}}
        await env.patch_cluster("demo", {"spec": {"trainer": ref}})
        await eventually(accepted("third-token"), "the newly named Secret's token")
        assert (await status(NEW)).status_code == 401
        assert (await status("third-token")).json()["epoch"] == epoch
        await env.wait_for_event("TrainerTokenRotated")
