"""A 429 from the API server is honoured (issue 36): the operator's client sends nothing
before the ``Retry-After`` it was given, sends a refused call again a bounded number of
times, and a whole operator throttled for a while keeps its calls to a handful, then
carries on. The emulator's throttle stands in for API Priority and Fairness."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from prorsa.k8s.kube import THROTTLE_ATTEMPTS, Kube
from prorsa_lab.doubles.kube.emulator import KubeEmulatorServer
from prorsa_lab.doubles.stack import OPERATOR_USER, cluster_manifest, stack

WRITES = frozenset({"create", "update", "patch", "delete"})
POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "p", "namespace": "default"},
    "spec": {"containers": [{"name": "c", "image": "i"}]},
}


@pytest.fixture
def server() -> Iterator[KubeEmulatorServer]:
    with KubeEmulatorServer() as served:
        yield served


@pytest.fixture
def kube(server: KubeEmulatorServer) -> Iterator[Kube]:
    api = kubernetes.config.new_client_from_config(config_file=str(server.kubeconfig_path))
    try:
        yield Kube(api)
    finally:
        api.close()


def refused(server: KubeEmulatorServer, verb: str) -> int:
    return sum(n for c, n in server.emulator.throttled_calls("admin").items() if c.verb == verb)


async def test_the_emulator_answers_429_with_retry_after_and_lets_leases_through(
    server: KubeEmulatorServer, kube: Kube
) -> None:
    server.emulator.throttle("admin", requests=1, retry_after=7)
    with pytest.raises(ApiException) as caught:
        # A POST: the client library never sends it again by itself.
        await asyncio.to_thread(kube.core.create_namespaced_pod, "default", POD)
    assert caught.value.status == 429
    assert caught.value.headers["Retry-After"] == "7"
    server.emulator.throttle("admin", seconds=60, retry_after=1)
    assert await kube.create_lease(
        "default",
        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "l"}},
    )
    assert await kube.read_lease("default", "l") is not None
    assert sum(server.emulator.throttled_calls("admin").values()) == 1


async def test_a_refused_call_goes_again_once_the_server_allows_it_and_others_wait(
    server: KubeEmulatorServer, kube: Kube
) -> None:
    await kube.call(kube.core.create_namespaced_pod, "default", POD)
    server.emulator.throttle("admin", requests=2, retry_after=1)
    patch = {"metadata": {"labels": {"a": "b"}}}
    first = asyncio.create_task(kube.patch_pod("default", "p", patch))
    while not kube.throttle.refusals:  # the first refusal holds the client
        await asyncio.sleep(0.01)
    # A second call made meanwhile waits for the hold instead of going out at once.
    second = asyncio.create_task(kube.patch_pod("default", "p", {"metadata": {"labels": {}}}))
    await asyncio.gather(first, second)
    labels = (await kube.get_pod("default", "p") or {})["metadata"]["labels"]
    assert labels == {"a": "b"}
    # Two refusals (the server's two), each followed by one more send: never a burst.
    assert refused(server, "patch") == 2
    calls = server.emulator.api_calls("admin")
    patches = sum(n for c, n in calls.items() if c.verb == "patch")
    assert patches == 2 + 2


async def test_a_call_refused_again_and_again_is_given_up_after_a_few_sends(
    server: KubeEmulatorServer, kube: Kube
) -> None:
    await kube.call(kube.core.create_namespaced_pod, "default", POD)
    server.emulator.throttle("admin", requests=100, retry_after=1)
    with pytest.raises(ApiException) as caught:
        await kube.patch_pod("default", "p", {"metadata": {"labels": {"a": "b"}}})
    assert caught.value.status == 429
    assert refused(server, "patch") == THROTTLE_ATTEMPTS


@pytest.mark.slow  # the whole operator: left out by `make test-fast`
async def test_a_throttled_operator_backs_off_then_carries_on() -> None:
    async with stack(tick_seconds=0.3) as env:
        await env.create_cluster(cluster_manifest())

        async def running() -> bool:
            status = (await env.get_cluster()).get("status") or {}
            return status.get("phase") == "Running"

        await env.wait_for(running, what="the cluster running")
        emulator = env.server.emulator
        before = emulator.api_calls(OPERATOR_USER)
        # Every write refused for a while, each answer asking for 3 s of quiet (reads
        # pass: the client library already sends a refused GET again after Retry-After
        # by itself, so writes are where the operator's own honouring shows).
        emulator.throttle(OPERATOR_USER, seconds=6, retry_after=3, verbs=WRITES)
        await asyncio.sleep(6)
        during = emulator.api_calls(OPERATOR_USER) - before
        refusals = emulator.throttled_calls(OPERATOR_USER)
        writes = sum(n for c, n in during.items() if c.verb in WRITES and c.resource != "leases")
        # Ticking every 0.3 s, each tick writes the status at least once: ~20 refused
        # writes in 6 s if every tick tried. Honouring Retry-After, a writer sends once
        # per 3 s: the tick's status patch three times at most (0, 3, 6 s).
        assert 1 <= sum(refusals.values()) <= 6, refusals
        assert writes <= 8, collections.Counter(during)

        # Once the server answers again, the operator does too: a spec change is applied.
        await env.patch_cluster("demo", {"spec": {"switching": {"mode": "Recommend"}}})

        async def applied() -> bool:
            cluster = await env.get_cluster()
            status = cluster.get("status") or {}
            return status.get("observedGeneration") == cluster["metadata"]["generation"]

        await env.wait_for(applied, what="the spec change applied after the throttle")
