"""Clusters served by one webhook listener: token, Controller, epoch and resync state each.

The registry is what lets one aiohttp listener serve many RolloutClusters: the operator
adds a :class:`WebhookCluster` when it starts managing a cluster and removes it when the
cluster goes away, at runtime, from the same asyncio loop the server runs on.

A handle takes a trainer's batches and snapshots to its Controller: it dedupes them,
leaves out what a snapshot superseded (:mod:`prorsa.clusters.resync`) and what would pass
the live-trajectory limit (:mod:`prorsa.clusters.limits`), and makes every call into the
Controller through its queue (:mod:`prorsa.clusters.call_queue`), one at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from prorsa.clusters.auth import normalize_token, token_matches
from prorsa.clusters.call_queue import CallQueue
from prorsa.clusters.clock import ClockOffset
from prorsa.clusters.limits import BatchOutcome, IngestLimits, TrajectoryLimit
from prorsa.clusters.resync import ResyncState
from prorsa.core.controller import Controller
from prorsa.core.decision import Decision
from prorsa.core.dedupe import DedupeWindow
from prorsa.core.forecast.table import ApplyResult
from prorsa.core.types import TickInput
from prorsa_contract.agent_api import EngineState
from prorsa_contract.events import Event, Snapshot

EVICTION_CLOCK_RATE = 2.0
"""The eviction clock runs at most this many times as fast as real time (see tick)."""


def _epoch_now() -> int:
    return time.time_ns() // 1_000_000


class WebhookCluster:
    """One RolloutCluster as the webhook sees it."""

    def __init__(
        self,
        *,
        namespace: str,
        name: str,
        token: str | bytes,
        controller: Controller,
        epoch: int,
        resync: bool = True,
        limits: IngestLimits | None = None,
        clock: ClockOffset | None = None,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.controller = controller
        self.epoch = epoch
        self.limits = limits or IngestLimits()
        self.clock = clock or ClockOffset()
        self._token = normalize_token(token)
        self._resync = ResyncState(resync=resync)
        self._evicted_at: tuple[float, float] | None = None  # (monotonic, eviction present)
        self._window = DedupeWindow(capacity=self.limits.dedupe_window)
        # This handle dedupes every batch before the Controller sees it: one window is enough.
        controller.table.set_dedupe_window(0)
        self._queue = CallQueue(controller, max_pending_events=self.limits.max_pending_events)
        self.batches = 0
        self.applied = 0
        self.duplicates = 0
        self.superseded = 0
        self.anomalies = 0
        self.snapshots = 0
        # Requests refused at the live-trajectory limit (the runtime's status condition).
        self.limit_hits = 0
        self.created = time.time()
        # Called when a batch announces a weight update: the operator ticks at once, since
        # the update's duration is the lead time a switch toward prefill can use.
        self.on_weight_update: Callable[[], None] | None = None
        # Called with each batch's new events right after the Controller applied them, in
        # the order it applied them (a recorder, ``prorsa record``); may run in a thread.
        self.on_applied: Callable[[Sequence[Event]], None] | None = None

    # -- identity and auth ---------------------------------------------------------------

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    def set_token(self, token: str | bytes) -> None:
        """Rotate the trainer token (the operator does when the Secret changes)."""
        self._token = normalize_token(token)

    def authorized(self, presented: str | None) -> bool:
        return token_matches(presented, self._token)

    @property
    def resync(self) -> bool:
        """True until the trainer has posted a snapshot of every trajectory to this epoch
        (one without an emitter id; named emitters each resync on their own)."""
        return self._resync.resync

    def resync_for(self, emitter: str | None) -> bool:
        """Whether the replies to ``emitter`` ask for its snapshot (:class:`ResyncState`)."""
        return self._resync.resync_for(emitter)

    def request_resync(self) -> None:
        """Ask the trainer for a snapshot in the next reply (e.g. after losing state)."""
        self._resync.request()

    def trainer_now(self) -> float:
        return self.clock.trainer_now()

    @property
    def last_decision(self) -> Decision | None:
        return self.controller.last_decision

    # -- inputs --------------------------------------------------------------------------

    @property
    def pending_events(self) -> int:
        """Validated events waiting for the Controller, or being applied."""
        return self._queue.pending_events

    def check_capacity(self, incoming: int = 1) -> None:
        """Raise :class:`~prorsa.clusters.limits.QueueFull` when ``incoming`` more events
        would overflow the queue (:meth:`CallQueue.check_capacity`)."""
        self._queue.check_capacity(incoming)

    async def apply(
        self,
        events: Sequence[Event],
        *,
        received: float,
        sent_at: float | None = None,
        emitter: str | None = None,
    ) -> BatchOutcome:
        """Validate-then-apply step of one batch: capacity, dedupe, Controller.

        Raises :class:`QueueFull` before changing anything. ``received`` is the arrival
        time on ``self.clock.monotonic()``; ``sent_at`` the client's send time if it said;
        ``emitter`` the id the batch names (``X-Prorsa-Emitter``), if any.
        """
        self.check_capacity(len(events))
        if events:
            newest = sent_at if sent_at is not None else max(e.ts for e in events)
            self.clock.observe(received=received, trainer_sent=newest)
        window = self._window
        current, stale = self._resync.superseded(events, emitter)
        if stale:
            # Seen all the same: sent again under another emitter id (or none), they would
            # apply what this emitter's snapshot already holds.
            window.admit(stale)
        fresh, duplicates, older = window.admit(current, before=self._resync.snapshot_ts)
        superseded = len(stale) + older
        applied = anomalies = 0
        left: list[Event] = []
        if fresh:
            controller = self.controller
            on_applied = self.on_applied

            def observe(batch: list[Event]) -> tuple[ApplyResult, list[Event]]:
                table = controller.table
                # Under the lock: the batches queued ahead may have filled the table.
                limit = controller.spec.trainer.max_live_trajectories
                fits, refused = table.split_at_limit(batch, limit)
                if refused:
                    window.forget(e.id for e in refused)  # a retry applies them
                with table.emitting(emitter):
                    result = controller.observe(fits)
                if on_applied is not None:
                    on_applied(fits)
                return result, refused

            result, left = await self._queue.call(
                lambda: observe(fresh),
                offload=len(fresh) > self.limits.offload_events,
                pending=len(fresh),
                on_error=lambda: window.forget(e.id for e in fresh),
            )
            applied, anomalies = result.applied, result.anomalies
            duplicates += result.duplicates
            if self.on_weight_update is not None and any(
                e.type == "weight_update_started" for e in fresh
            ):
                self.on_weight_update()
        self.batches += 1
        self.applied += applied
        self.duplicates += duplicates
        self.superseded += superseded
        self.anomalies += anomalies
        outcome = BatchOutcome(
            accepted=len(events) - len(left),
            applied=applied,
            duplicates=duplicates,
            superseded=superseded,
            anomalies=anomalies,
        )
        if left:
            raise self._at_limit(deferred=len(left), outcome=outcome)
        return outcome

    def _at_limit(
        self, *, deferred: int, outcome: BatchOutcome | None, retry: bool = True
    ) -> TrajectoryLimit:
        """The refusal at the live-trajectory limit, counted for the status condition. A
        retry is worth it after about a horizon, when trajectories have ended."""
        self.limit_hits += 1
        spec = self.controller.spec
        return TrajectoryLimit(
            live=len(self.controller.table),
            limit=spec.trainer.max_live_trajectories,
            deferred=deferred,
            retry_after=max(1, math.ceil(spec.forecast.horizon_seconds)) if retry else None,
            outcome=outcome,
        )

    async def apply_snapshot(
        self,
        snapshot: Snapshot,
        *,
        received: float,
        sent_at: float | None = None,
        emitter: str | None = None,
    ) -> None:
        """Replace the Controller's trajectories with the trainer's; clears ``resync``.

        With an ``emitter`` id, only the trajectories that emitter reported last are
        replaced, and only that emitter's ``resync`` is cleared. Events stamped before the
        snapshot that arrive after it (from a buffer, a retry or another emitter, for a
        snapshot of every trajectory; from the same emitter, for a named one) are already
        reflected in it; they are counted as ``superseded`` and not applied, so no
        transition is applied twice.
        """
        sent = sent_at if sent_at is not None else snapshot.ts
        self.clock.observe(received=received, trainer_sent=sent)
        n = len(snapshot.trajectories)
        # The cutoff moves now, as the snapshot joins the queue: batches queued before it
        # apply first and are then replaced by it; batches arriving after it are filtered.
        undo = self._resync.move_cutoff(snapshot.ts, emitter)
        controller = self.controller

        def observe(loaded: Snapshot) -> bool | None:
            """Load it; else whether a retry may fit (False: it never can)."""
            table = controller.table
            limit = controller.spec.trainer.max_live_trajectories
            if n > limit:
                return False
            if len(table) - table.live_of(emitter) + n > limit:
                return True  # other emitters' trajectories may end meanwhile
            with table.emitting(emitter):
                controller.observe_snapshot(loaded)
            return None

        refused = await self._queue.call(
            lambda: observe(snapshot),
            offload=n > self.limits.offload_events,
            pending=n,
            on_error=undo,
        )
        if refused is not None:
            undo()
            raise self._at_limit(deferred=n, outcome=None, retry=refused)
        self._resync.loaded(emitter)
        self.snapshots += 1

    async def observe_engines(self, states: Sequence[EngineState]) -> None:
        await self._queue.call(
            lambda: self.controller.observe_engines(states), offload=False, pending=0, control=True
        )

    async def tick(self, now: float | None = None) -> Decision:
        """One control tick at ``now`` (trainer clock; default: the corrected present)."""

        def run() -> Decision:
            if now is None and not self.clock.trusted:
                # The present is the server's guess until the trainer's clock is known: a
                # trainer whose clock is behind would see its trajectories evicted.
                return self.controller.tick(TickInput(now=self.trainer_now(), evict_now=-math.inf))
            at = self.trainer_now() if now is None else now
            return self.controller.tick(TickInput(now=at, evict_now=self._eviction_now(at)))

        return await self._queue.call(
            run, offload=self.limits.offload_ticks, pending=0, control=True
        )

    def _eviction_now(self, now: float) -> float:
        """The present for eviction: ``now``, but advancing at most twice as fast as the
        server's monotonic clock since the previous tick (from the server's wall clock at
        the first one).

        A majority of batches stamped an hour ahead can move the clock estimate by an
        hour; without this, the next tick would find every live trajectory silent for
        longer than the TTL and evict it. A trainer clock that really is ahead of the
        server's is caught up with at one extra second per second.
        """
        mono = self.clock.monotonic()
        if self._evicted_at is None:
            limit = self.clock.wall()
        else:
            last_mono, last = self._evicted_at
            limit = last + EVICTION_CLOCK_RATE * max(0.0, mono - last_mono)
        at = min(now, limit)
        self._evicted_at = (mono, at)
        return at

    # -- the queue -----------------------------------------------------------------------

    async def idle(self) -> None:
        """Wait until every queued call has run (orderly shutdown)."""
        await self._queue.idle()

    def exclusive(self) -> AbstractAsyncContextManager[Controller]:
        """Hold the Controller alone (:meth:`CallQueue.exclusive`), e.g. to persist its
        statistics consistently; keep the block short."""
        return self._queue.exclusive()

    def status(self) -> dict[str, Any]:
        """The handle's state for ``GET .../status`` (camelCase, like the CRD status)."""
        decision = self.controller.last_decision
        diag = None if decision is None else decision.diagnostics
        return {
            "namespace": self.namespace,
            "name": self.name,
            "epoch": self.epoch,
            "resync": self._resync.resync,
            "trainerNow": self.trainer_now(),
            "clockSkewSeconds": self.clock.skew(),
            "pendingEvents": self.pending_events,
            "batches": self.batches,
            "events": {
                "applied": self.applied,
                "duplicates": self.duplicates,
                "superseded": self.superseded,
                "anomalies": self.anomalies,
            },
            "snapshots": self.snapshots,
            # Counts as they stand (plain integers, read whole); the accuracy from the last
            # tick's snapshot, since the next tick may be closing windows in a thread.
            "liveTrajectories": self.controller.live_trajectories(),
            "accuracy": {
                "prefillWape": None if diag is None else diag.prefill_wape,
                "decodeWape": None if diag is None else diag.decode_wape,
            },
            "lastDecisionAt": None if decision is None else decision.at,
        }


class ClusterRegistry:
    """(namespace, name) -> :class:`WebhookCluster`; add and remove at runtime.

    Epochs are the registration time in unix milliseconds, made strictly increasing
    within a process: a cluster removed and added again (or a restarted server) gets a
    new epoch, which is how a trainer learns that the server lost its state.
    """

    def __init__(self, *, limits: IngestLimits | None = None) -> None:
        self.limits = limits or IngestLimits()
        self._clusters: dict[tuple[str, str], WebhookCluster] = {}
        self._last_epoch = 0

    def next_epoch(self) -> int:
        self._last_epoch = max(self._last_epoch + 1, _epoch_now())
        return self._last_epoch

    def add(
        self,
        *,
        namespace: str,
        name: str,
        token: str | bytes,
        controller: Controller,
        epoch: int | None = None,
        resync: bool = True,
        clock: ClockOffset | None = None,
    ) -> WebhookCluster:
        """Serve a cluster (replacing any handle of the same name, with a new epoch).

        ``resync=True`` (the default) makes replies ask the trainer for a snapshot: right
        for any server that may have lost state. Pass False only for a cluster that is new
        to the world, with no trainer running against it yet.
        """
        handle = WebhookCluster(
            namespace=namespace,
            name=name,
            token=token,
            controller=controller,
            epoch=self.next_epoch() if epoch is None else epoch,
            resync=resync,
            limits=self.limits,
            clock=clock,
        )
        self._clusters[handle.key] = handle
        return handle

    def remove(self, *, namespace: str, name: str) -> WebhookCluster | None:
        """Stop serving a cluster; requests already running finish on the old handle."""
        return self._clusters.pop((namespace, name), None)

    def get(self, namespace: str, name: str) -> WebhookCluster | None:
        return self._clusters.get((namespace, name))

    def knows_token(self, presented: str | None) -> bool:
        """Whether ``presented`` is the token of some served cluster (each one compared)."""
        matches = [h.authorized(presented) for h in self._clusters.values()]
        return any(matches)

    def __len__(self) -> int:
        return len(self._clusters)

    def __iter__(self) -> Iterator[WebhookCluster]:
        return iter(list(self._clusters.values()))

    def pending_events(self) -> int:
        return sum(h.pending_events for h in self._clusters.values())
