"""Leader election on a Lease (prorsa.k8s.leader) against the API emulator over HTTP.

One replica holds the Lease each term; a standby takes it only when it is released or
has not changed for the lease duration by the standby's own clock (so a leader's clock
skew changes nothing); a leader that cannot renew within its renew deadline, or sees
another holder, stops leading.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import Iterator
from typing import Any

import pytest

from prorsa.k8s.kube import Kube
from prorsa.k8s.leader import LeaderElection, LeaderElector, LeadershipLost
from prorsa_lab.doubles.kube.emulator import KubeEmulator, KubeEmulatorServer

NS = "prorsa-system"


@pytest.fixture
def kube() -> Iterator[Kube]:
    with KubeEmulatorServer(KubeEmulator(namespaces=[NS])) as server, server.api_client() as api:
        yield Kube(api)


def elector(kube: Kube, who: str, **timing: Any) -> LeaderElector:
    election = LeaderElection(
        **({"lease_duration": 1.0, "renew_deadline": 0.6, "retry_period": 0.1} | timing)
    )
    return LeaderElector(kube=kube, election=election, namespace=NS, identity=who)


def at(stamp: Any) -> datetime.datetime:
    """A Lease's MicroTime, as the client returns it (a string or a datetime)."""
    if isinstance(stamp, datetime.datetime):
        return stamp
    return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))


async def lease(kube: Kube) -> dict[str, Any]:
    found = await kube.read_lease(NS, "prorsa-operator")
    assert found is not None
    return dict(found["spec"])


async def test_one_leader_and_a_standby_that_takes_over_when_it_stops_renewing(kube) -> None:
    # A renew deadline of seconds, not tenths: with both cores busy one renewal round trip
    # to the emulator has taken over 0.6 s, and a leader that misses its deadline stops.
    timing = {"lease_duration": 3.0, "renew_deadline": 2.0, "retry_period": 0.1}
    a, b = elector(kube, "a", **timing), elector(kube, "b", **timing)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    spec = await lease(kube)
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == 3
    assert spec["leaseTransitions"] == 0 and spec["acquireTime"] == spec["renewTime"]

    # a renews: b keeps standing by for as long as it does.
    stop = asyncio.Event()
    holding = asyncio.create_task(a.hold())
    taking = asyncio.create_task(b.acquire(stop))
    await asyncio.sleep(6.5)  # more than two lease durations
    assert not taking.done() and b.holder == "a"
    # a dies (stops renewing): b takes over once a lease duration passed unchanged.
    holding.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await holding
    await asyncio.sleep(0.2)  # a renewal already in a worker thread lands meanwhile
    last = await lease(kube)
    assert last["holderIdentity"] == "a"  # nobody may take it this soon
    assert await asyncio.wait_for(taking, 20)
    spec = await lease(kube)
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    # Both times come from this process's clock: b waited a lease duration after a's last
    # renewal, however late it saw it.
    assert at(spec["acquireTime"]) - at(last["renewTime"]) >= datetime.timedelta(seconds=3)
    # a comes back believing it leads: its next renewal sees b and gives up at once.
    with pytest.raises(LeadershipLost, match="b holds the Lease"):
        await asyncio.wait_for(a.hold(), 5)


async def test_a_released_lease_is_taken_at_the_next_try(kube) -> None:
    a = elector(kube, "a", lease_duration=30.0, renew_deadline=20.0, retry_period=0.1)
    b = elector(kube, "b", lease_duration=30.0, renew_deadline=20.0, retry_period=0.1)
    stop = asyncio.Event()
    assert await a.acquire(stop)
    taking = asyncio.create_task(b.acquire(stop))
    await asyncio.sleep(0.3)
    assert not taking.done()
    await a.release()
    assert (await lease(kube))["holderIdentity"] == ""
    assert await asyncio.wait_for(taking, 5)  # far sooner than the 30 s lease
    assert (await lease(kube))["holderIdentity"] == "b"


async def test_the_standby_judges_expiry_by_its_own_clock_not_the_leaders(kube) -> None:
    """A leader whose clock is an hour behind writes renewTimes an hour old; as long as the
    record changes, the standby never takes the Lease."""
    hour_ago = lambda: datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)  # noqa: E731
    a = LeaderElector(
        kube=kube,
        election=LeaderElection(lease_duration=1.0, renew_deadline=0.6, retry_period=0.1),
        namespace=NS,
        identity="a",
        wall=hour_ago,
    )
    b = elector(kube, "b")
    stop = asyncio.Event()
    assert await a.acquire(stop)
    holding = asyncio.create_task(a.hold())
    taking = asyncio.create_task(b.acquire(stop))
    await asyncio.sleep(2.0)
    assert not taking.done()
    stop.set()
    assert await taking is False
    holding.cancel()


class FailingKube:
    """An API server the leader cannot reach any more."""

    async def read_lease(self, namespace: str, name: str) -> dict[str, Any]:
        raise ConnectionError("the API server is unreachable")


async def test_a_leader_that_cannot_renew_stops_within_the_renew_deadline(kube) -> None:
    a = elector(kube, "a", lease_duration=8.0, renew_deadline=2.0, retry_period=0.1)
    assert await a.try_acquire_or_renew()
    a.kube = FailingKube()  # type: ignore[assignment]
    started = time.monotonic()
    with pytest.raises(LeadershipLost, match="not renewed"):
        await asyncio.wait_for(a.hold(), 20)
    # It keeps trying until the renew deadline, and stops long before the lease duration
    # could let another replica take over.
    assert 2.0 <= time.monotonic() - started < 8.0
    assert not a.leading


def test_timings_must_leave_the_leader_time_to_stop() -> None:
    with pytest.raises(ValueError, match="renew deadline < lease duration"):
        LeaderElection(lease_duration=5, renew_deadline=5)
