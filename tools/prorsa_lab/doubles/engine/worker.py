"""The engine double's worker mode: node ranks >= 1 of a multi-node SGLang server.

SGLang 0.5.23 started with ``--nnodes n --node-rank r --dist-init-addr leader:port`` runs
no tokenizer or HTTP API on ranks r >= 1 (only a health listener); rank 0 broadcasts every
request, role switches included, to all ranks over the tensor-parallel group. So:

* rank 0 does not serve until every rank has joined the rendezvous (the leader reports
  starting, /health 503);
* a rank lost after that breaks the collective for good: the leader stops answering its
  health checks and refuses a role switch as unsafe (SGLang's "restart required");
* a worker whose rank 0 is gone exits (its collectives fail).

The ranks of a double share no GPU, so the group is linked in process: a
:class:`NodeGroup` holds the leader's :class:`EngineDouble` and its :class:`WorkerRank`\\ s,
and the fake kubelet wires them by the pods' group labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prorsa_lab.doubles.engine.server import EngineDouble

log = logging.getLogger("prorsa_lab.doubles.engine.worker")


@dataclass
class NodeGroup:
    """The ranks of one multi-node instance (torch.distributed's world, in process)."""

    name: str
    nnodes: int
    leader: EngineDouble | None = None
    workers: dict[int, WorkerRank] = field(default_factory=dict)
    formed: bool = False
    """Every rank joined once; from then on losing one is fatal to the leader."""
    _leader_ready_at: float = 0.0

    @property
    def complete(self) -> bool:
        return self.leader is not None and all(r in self.workers for r in range(1, self.nnodes))

    @property
    def leader_alive(self) -> bool:
        leader = self.leader
        return leader is not None and leader.core is not None and not leader.core.crashed

    def join_leader(self, leader: EngineDouble) -> None:
        self.leader, self.formed = leader, False
        assert leader.core is not None
        self._leader_ready_at = leader.core.ready_at
        self.sync()

    def leave_leader(self) -> None:
        self.leader = None
        self.sync()

    def join(self, worker: WorkerRank) -> None:
        self.workers[worker.rank] = worker
        self.sync()

    def leave(self, worker: WorkerRank) -> None:
        if self.workers.get(worker.rank) is worker:
            del self.workers[worker.rank]
        self.sync()

    def sync(self) -> None:
        """Make the leader's state what rank 0 of this world would show."""
        core = self.leader.core if self.leader is not None else None
        if core is None:
            return
        if self.complete and not self.formed:
            self.formed = True
            core.ready_at = self._leader_ready_at
            log.info("%s: all %d ranks joined", self.name, self.nnodes)
        elif not self.complete:
            core.ready_at = math.inf  # waiting for ranks: /health answers 503
            if self.formed:
                core.unhealthy = True  # a lost rank: restart required
                log.warning("%s: a rank was lost; rank 0 needs a restart", self.name)
        core.wake_all()


@dataclass
class WorkerRank:
    """One worker rank: joins its group, exits (``on_exit``) when its rank 0 is gone."""

    instance: str
    rank: int
    group: NodeGroup
    on_exit: Callable[[WorkerRank], Awaitable[None]] | None = None
    poll: float = 0.05
    rendezvous_timeout: float = 60.0
    """Like SGLang's --dist-timeout: a rank whose rank 0 never appears gives up."""
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    async def start(self) -> WorkerRank:
        self.group.join(self)
        self._task = asyncio.create_task(self._follow(), name=f"worker-{self.instance}")
        return self

    async def stop(self) -> None:
        """The pod is gone: leave the world (the leader notices)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.group.leave(self)
        self.exited.set()

    async def _follow(self) -> None:
        deadline = time.monotonic() + self.rendezvous_timeout
        while not self.group.leader_alive:  # the rendezvous: wait for rank 0
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(self.poll)
        while self.group.leader_alive:
            await asyncio.sleep(self.poll)
        log.info("%s: rank 0 is gone, exiting", self.instance)
        self.group.leave(self)
        self.exited.set()
        if self.on_exit is not None:
            await self.on_exit(self)
