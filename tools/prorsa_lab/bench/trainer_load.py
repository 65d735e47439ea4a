"""A trainer's webhook load for the operator benches (``prorsa bench scale``, ``soak``): many
live agentic trajectories per RolloutCluster, their lifecycle events sent at a steady rate
through the real SDK (``AsyncEventEmitter`` with its tracker, so a new leader's resync is
answered as a trainer answers it), from a process of its own.

Each trajectory follows a task profile of the paper's evaluation (:mod:`prorsa_lab.sim.
workloads`: coding agent, general agent): its turns, outputs, tools and tool results are
drawn from the profile; when it ends (rewarded, or dropped) a new one replaces it, so the
number of live trajectories stays where it was put. The event rate of a cluster is what
``live`` trajectories of that task produce when each lasts as long as the paper measured
(:data:`TRAJECTORY_SECONDS`): live x events per trajectory / seconds per trajectory.
Events are interleaved across trajectories at random, each trajectory's in its own order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import multiprocessing
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prorsa_lab.sim.workloads import TaskProfile, get_task
from prorsa_sdk import AsyncEventEmitter

TRAJECTORY_SECONDS = {"coding": 846.0, "general": 216.0, "math": 300.0}
"""Seconds one trajectory lasts end to end: coding and general from the paper (§5.4: ~846 s
and ~216 s, the figures :mod:`prorsa_lab.sim.workloads` is calibrated to); math is not a
setting of this bench (an estimate from the simulator's static split)."""
EventItem = tuple[str, str, dict[str, Any]]  # (type, trajectory, fields)
MAX_CONTEXT = 131_072


def lifecycle(
    profile: TaskProfile, traj: str, *, rng: random.Random, group: str, drop_share: float
) -> Iterator[EventItem]:
    """One trajectory's events in order, drawn from ``profile`` (a share ``drop_share`` of
    trajectories is dropped by the trainer part-way)."""
    turns = (
        rng.randint(profile.turns_min, profile.turns_max)
        if profile.turns is None
        else min(max(round(profile.turns.draw(rng)), profile.turns_min), profile.turns_max)
    )
    drop_at = rng.randrange(turns) if rng.random() < drop_share else None
    ctx = int(profile.prompt.draw(rng))
    yield "sample_dispatched", traj, {"group": group, "task": profile.name, "prompt_tokens": ctx}
    yield "sandbox_started", traj, {"mode": rng.choice(("prewarm", "cold"))}
    weights = [t.weight for t in profile.tools]
    for turn in range(turns):
        if turn == drop_at:
            yield "trajectory_dropped", traj, {"reason": "sandbox lost"}
            return
        yield "request_queued", traj, {"prompt_tokens": ctx, "turn": turn}
        yield "prefill_started", traj, {}
        yield "prefill_finished", traj, {}
        last = turn == turns - 1
        dist = profile.last_output if (last and profile.last_output) else profile.output
        out = max(1, int(dist.draw(rng)))
        ctx = min(ctx + out, MAX_CONTEXT)
        if last or not profile.tools or ctx >= MAX_CONTEXT:
            yield "decode_finished", traj, {"output_tokens": out, "finish": "stop"}
            break
        yield "decode_finished", traj, {"output_tokens": out, "finish": "tool"}
        tool = rng.choices(profile.tools, weights)[0]
        yield "tool_started", traj, {"tool": tool.name}
        result = int(tool.result_tokens.draw(rng))
        yield "tool_finished", traj, {"result_tokens": result}
        ctx = min(ctx + result, MAX_CONTEXT)
    yield "reward_started", traj, {}
    yield "reward_finished", traj, {"accepted": rng.random() < profile.accept}


@functools.cache
def events_per_trajectory(task: str, *, samples: int = 2000, seed: int = 11) -> float:
    """The mean number of events of one trajectory of ``task`` (drawn, not assumed)."""
    profile = get_task(task)
    rng = random.Random(seed)
    total = sum(
        sum(1 for _ in lifecycle(profile, f"m{i}", rng=rng, group="g", drop_share=0.0))
        for i in range(samples)
    )
    return total / samples


def event_rate(task: str, live: int) -> float:
    """Events per second of ``live`` trajectories of ``task`` at the paper's durations."""
    return live * events_per_trajectory(task) / TRAJECTORY_SECONDS[task]


def cluster_loads(
    names: Sequence[str], *, task: Callable[[int], str], live: int
) -> tuple[ClusterLoad, ...]:
    """Each named cluster's load: ``live`` trajectories of ``task(i)`` at its paper rate."""
    return tuple(
        ClusterLoad(name=name, task=task(i), live=live, rate=event_rate(task(i), live))
        for i, name in enumerate(names)
    )


@dataclass(frozen=True, kw_only=True)
class ClusterLoad:
    name: str
    task: str
    live: int
    rate: float  # events per second once every trajectory is live


@dataclass(frozen=True, kw_only=True)
class LoadSettings:
    url: str
    namespace: str
    token: str
    clusters: tuple[ClusterLoad, ...]
    drop_share: float = 0.0
    seed: int = 5
    ca: str | None = None


class _Trajectories:
    """``live`` trajectories of one cluster, each a lifecycle in progress."""

    def __init__(self, load: ClusterLoad, *, seed: int, drop_share: float) -> None:
        self.load = load
        self.profile = get_task(load.task)
        self.rng = random.Random(f"{seed}:{load.name}")
        self.drop_share = drop_share
        self.active: list[Iterator[EventItem]] = []
        self.started = 0
        self.finished = 0

    def new(self) -> Iterator[EventItem]:
        n = self.started
        self.started += 1
        group_size = self.profile.group_size
        return lifecycle(
            self.profile,
            f"{self.load.name}-t{n}",
            rng=self.rng,
            group=f"{self.load.name}-g{n // group_size}",
            drop_share=self.drop_share,
        )

    def next_event(self) -> EventItem:
        while True:
            i = self.rng.randrange(len(self.active))
            try:
                return next(self.active[i])
            except StopIteration:
                self.finished += 1
                self.active[i] = self.new()


async def _drive(conn: Any, settings: LoadSettings) -> None:
    emitters = {
        c.name: AsyncEventEmitter(
            url=settings.url,
            namespace=settings.namespace,
            name=c.name,
            token=settings.token,
            track=True,
            verify=settings.ca,
            flush_interval=0.1,
            # One batch in flight per emitter: at a cluster's ~9,000 events/s, batches of
            # 2,000 leave each request a fifth of a second (the server takes up to 4 MiB).
            batch_size=2000,
            max_buffer=1_000_000,
            give_up_after=600.0,
        )
        for c in settings.clusters
    }
    pools = {
        c.name: _Trajectories(c, seed=settings.seed, drop_share=settings.drop_share)
        for c in settings.clusters
    }
    for emitter in emitters.values():
        await emitter.start()
    # Every trajectory dispatched first (its first event), then the steady stream.
    for name, pool in pools.items():
        emitter = emitters[name]
        for k in range(pool.load.live):
            traj = pool.new()
            kind, who, fields = next(traj)
            emitter.emit(kind, who, **fields)
            pool.active.append(traj)
            if k % 2000 == 0:
                await asyncio.sleep(0)
    for emitter in emitters.values():
        await emitter.flush(timeout=600)
    conn.send({"ready": True})
    start = time.monotonic()
    emitted = dict.fromkeys(pools, 0)
    stop = asyncio.Event()

    async def control() -> None:
        loop = asyncio.get_running_loop()
        while True:
            message = await loop.run_in_executor(None, conn.recv)
            if message == "stats":
                now = time.monotonic()
                conn.send(
                    {
                        "seconds": now - start,
                        "clusters": {
                            name: {
                                "emitted": emitted[name],
                                "finished": pools[name].finished,
                                "stats": emitters[name].stats,
                            }
                            for name in pools
                        },
                    }
                )
            else:
                stop.set()
                return

    controller = asyncio.create_task(control())
    period = 0.1
    while not stop.is_set():
        elapsed = time.monotonic() - start
        for name, pool in pools.items():
            due = int(pool.load.rate * elapsed) - emitted[name]
            emitter = emitters[name]
            for k in range(max(due, 0)):
                kind, who, fields = pool.next_event()
                emitter.emit(kind, who, **fields)
                if k % 500 == 499:
                    await asyncio.sleep(0)  # the sender's turn: it posts what is due
            emitted[name] += max(due, 0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period)
    for emitter in emitters.values():
        await emitter.aclose(timeout=5)  # the run is measured: no backlog to deliver
    await controller
    conn.send({"closed": True})


def _main(conn: Any, settings: LoadSettings) -> None:
    asyncio.run(_drive(conn, settings))


class _Worker:
    """One load process (one cluster's trainer: its own emitter, as a rollout worker's)."""

    def __init__(self, settings: LoadSettings) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(child, settings), daemon=True)

    async def recv(self, timeout: float) -> dict[str, Any]:
        ready = await asyncio.to_thread(self._conn.poll, timeout)
        if not ready:
            raise TimeoutError(f"the trainer load process did not answer in {timeout:.0f}s")
        reply: dict[str, Any] = self._conn.recv()
        return reply

    def send(self, message: str) -> None:
        self._conn.send(message)


class TrainerLoad:
    """The load, one process per cluster: ``start()`` returns once every trajectory is
    live; ``stats()`` (``seconds`` of steady load, and per cluster what was emitted, the
    trajectories finished and the emitter's stats); ``stop()``."""

    def __init__(self, settings: LoadSettings) -> None:
        self.settings = settings
        self.workers = [
            _Worker(dataclasses.replace(settings, clusters=(c,))) for c in settings.clusters
        ]

    async def start(self, *, timeout: float = 900.0) -> None:
        for worker in self.workers:
            worker.process.start()
        for worker in self.workers:
            reply = await worker.recv(timeout)
            if not reply.get("ready"):
                raise RuntimeError(f"the trainer load did not start: {reply!r}")

    async def stats(self) -> dict[str, Any]:
        for worker in self.workers:
            worker.send("stats")
        replies = [await worker.recv(60.0) for worker in self.workers]
        return {
            "seconds": min(r["seconds"] for r in replies),
            "clusters": {k: v for r in replies for k, v in r["clusters"].items()},
        }

    async def stop(self) -> None:
        for worker in self.workers:
            if not worker.process.is_alive():
                continue
            try:
                worker.send("stop")
                await worker.recv(60.0)
            except (OSError, EOFError, TimeoutError):
                pass
        for worker in self.workers:
            await asyncio.to_thread(worker.process.join, 10)
            if worker.process.is_alive():
                worker.process.kill()
                await asyncio.to_thread(worker.process.join, 5)
