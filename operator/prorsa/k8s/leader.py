"""Leader election on a ``coordination.k8s.io/v1`` Lease, the way Kubernetes' own
controllers elect (docs/operations.md#high-availability).

Why a Lease and not kopf's peering: peering is built to pause in-cluster operators while a
developer runs one on a workstation. Replicas of the same priority each log a warning and
go on acting (kopf's ``peering.py``: "will continue to function"); there is no
compare-and-swap and no term. A Lease is written under the API server's optimistic
concurrency (``resourceVersion``), so one write wins each term; kube-scheduler,
kube-controller-manager and controller-runtime operators elect this way, and
``kubectl get lease`` shows who leads.

The rules, those of client-go's ``leaderelection`` with a LeaseLock:

- a candidate may take the Lease when it is absent, released (no holder), or expired: its
  record has not changed for ``lease_duration`` as measured by the candidate's own
  monotonic clock from when it last saw the record change, so no clock skew between nodes
  enters the decision;
- the leader renews every ``retry_period``; a renewal that does not succeed within
  ``renew_deadline`` (shorter than ``lease_duration``) ends its leadership, so it stops
  acting before another replica may take over;
- a leader that exits cleanly releases the Lease (no holder): the other replica takes over
  at its next try instead of after ``lease_duration``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prorsa.k8s.kube import Kube

log = logging.getLogger("prorsa.leader")

LEASE_NAME = "prorsa-operator"


@dataclass(frozen=True, kw_only=True)
class LeaderElection:
    """The Lease's terms: ``prorsa operator --leader-elect-*``, with client-go's defaults
    (kube-controller-manager's ``--leader-elect-*`` flags; docs/operations.md)."""

    lease_name: str = LEASE_NAME
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, "
                f"got {self.retry_period}, {self.renew_deadline}, {self.lease_duration}"
            )


class LeadershipLost(Exception):
    """This process no longer holds the Lease: it must stop acting at once."""


def micro_time(at: datetime.datetime) -> str:
    """Kubernetes' MicroTime: RFC 3339 with microseconds, UTC."""
    return at.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Takes and keeps the Lease ``election.lease_name`` in ``namespace`` for ``identity``;
    one per process."""

    def __init__(
        self,
        *,
        kube: Kube,
        election: LeaderElection,
        namespace: str,
        identity: str,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ) -> None:
        self.kube = kube
        self.election = election
        self.namespace = namespace
        self.identity = identity
        self._monotonic = monotonic
        self._wall = wall
        self._observed: tuple[Any, ...] | None = None  # the record last seen
        self._observed_at = 0.0  # when it last changed, by our clock
        self.leading = False
        self.holder: str | None = None  # who holds the Lease, as last seen

    async def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this process holds the Lease afterwards."""
        s = self.election
        now = self._monotonic()
        lease = await self.kube.read_lease(self.namespace, s.lease_name)
        if lease is None:
            created = await self.kube.create_lease(self.namespace, self._manifest(None))
            if created:
                self._observe(None, now)
                self.holder = self.identity
            return created
        spec = lease.get("spec") or {}
        record = (
            spec.get("holderIdentity"),
            spec.get("renewTime"),
            spec.get("leaseTransitions"),
            (lease.get("metadata") or {}).get("resourceVersion"),
        )
        if record != self._observed:
            self._observe(record, now)
        holder = spec.get("holderIdentity") or None
        self.holder = holder
        expired = now - self._observed_at >= s.lease_duration
        if holder is not None and holder != self.identity and not expired:
            return False
        body = self._manifest(lease)
        if not await self.kube.replace_lease(self.namespace, body):
            return False  # another replica wrote first: it leads this term
        self._observe(None, now)
        self.holder = self.identity
        return True

    def _observe(self, record: tuple[Any, ...] | None, at: float) -> None:
        self._observed = record
        self._observed_at = at

    def _manifest(self, lease: dict[str, Any] | None) -> dict[str, Any]:
        s = self.election
        now = micro_time(self._wall())
        spec: dict[str, Any] = dict((lease or {}).get("spec") or {})
        taking = spec.get("holderIdentity") != self.identity
        spec |= {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(s.lease_duration)),
            "renewTime": now,
        }
        if taking:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (
                1 if lease is not None else 0
            )
        metadata: dict[str, Any] = {"name": s.lease_name, "namespace": self.namespace}
        if lease is not None:
            metadata["resourceVersion"] = lease["metadata"]["resourceVersion"]
            metadata["labels"] = (lease.get("metadata") or {}).get("labels") or {}
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": spec,
        }

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait, as the standby, until this process leads (True) or ``stop`` is set."""
        s = self.election
        announced: str | None = ""
        while not stop.is_set():
            try:
                if await self.try_acquire_or_renew():
                    self.leading = True
                    log.info("%s leads (Lease %s/%s)", self.identity, self.namespace, s.lease_name)
                    return True
                if self.holder != announced:
                    announced = self.holder
                    log.info(
                        "standing by: %s leads (Lease %s/%s)",
                        self.holder,
                        self.namespace,
                        s.lease_name,
                    )
            except Exception as exc:  # the API server may be away for a while
                log.warning("leader election: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=s.retry_period)
        return False

    async def hold(self) -> None:
        """Renew while leading; raise :class:`LeadershipLost` when a renewal does not succeed
        within the renew deadline, or another holder is seen."""
        s = self.election
        renewed = self._monotonic()
        while True:
            await asyncio.sleep(s.retry_period)
            try:
                ok = await asyncio.wait_for(
                    self.try_acquire_or_renew(), timeout=max(0.1, s.renew_deadline / 2)
                )
            except Exception as exc:  # a timeout or an API error: try again until the deadline
                log.warning("leader election: renewing the Lease failed: %r", exc)
                ok = False
            now = self._monotonic()
            if ok:
                renewed = now
                continue
            if self.holder not in (None, self.identity):
                self.leading = False
                raise LeadershipLost(f"{self.holder} holds the Lease now")
            if now - renewed >= s.renew_deadline:
                self.leading = False
                raise LeadershipLost(
                    f"the Lease was not renewed for {now - renewed:.1f} s "
                    f"(renew deadline {s.renew_deadline:g} s)"
                )

    async def release(self) -> None:
        """Give the Lease up (a clean exit): the standby takes over at its next try."""
        s = self.election
        if not self.leading:
            return
        self.leading = False
        try:
            lease = await self.kube.read_lease(self.namespace, s.lease_name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            body = self._manifest(lease)
            body["spec"] |= {"holderIdentity": "", "leaseDurationSeconds": 1}
            await self.kube.replace_lease(self.namespace, body)
            log.info("%s released the Lease %s/%s", self.identity, self.namespace, s.lease_name)
        except Exception:
            log.warning("could not release the Lease: the standby waits for it to expire")
