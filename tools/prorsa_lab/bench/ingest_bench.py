"""``prorsa bench ingest``: the trainer webhook end to end, over loopback HTTP.

The server is the real one (``WebhookServer`` + ``Controller``, ticking every second) in
its own process pinned to one CPU where the OS allows; the client is this process. Three
figures, each from one run (absolute times are noisy on shared machines):

1. Throughput: the SDK (``AsyncEventEmitter``, batches of 500) emits a realistic agentic
   lifecycle stream as fast as it can; events/s from the first ``emit()`` to the last
   reply, plus events per server CPU-second (the "one core" figure, independent of how
   fast the client is) and the server's event-loop lag meanwhile (how late a 5 ms timer
   fires: the longest the loop was blocked by parsing, applying or ticking).
2. Latency at a steady offered load (20k events/s by default): batches of 500 are sent
   open-loop on a fixed schedule, each in its own request, so a slow reply cannot delay
   the next send and hide queueing (no coordinated omission); latency is reply time minus
   scheduled send time; p50/p99/max.
3. Where the server's time goes: CPU per event for parsing and validation alone, to set
   against the whole.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

from prorsa.clusters import ClusterRegistry, IngestLimits
from prorsa.core.controller import Controller
from prorsa.core.spec import parse_cluster
from prorsa.ingest import WebhookServer
from prorsa.shell.gc_tuning import tune_gc
from prorsa_contract.events import parse_batch
from prorsa_sdk import AsyncEventEmitter

HELP = "trainer webhook end to end: SDK events/s over loopback HTTP, p99 batch latency"

TARGET_EVENTS_PER_S = 100_000
TARGET_P99_MS = 50.0
TOKEN = "bench-token"
NAMESPACE, NAME = "bench", "ingest"
PATH = f"/v1/namespaces/{NAMESPACE}/rolloutclusters/{NAME}/events"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller runs (CI, make bench)")
    parser.add_argument("--events", type=int, default=None, help="events in the throughput run")
    parser.add_argument(
        "--rate", type=float, default=20_000.0, help="offered load (events/s) in the latency run"
    )
    parser.add_argument("--seconds", type=float, default=None, help="length of the latency run")
    parser.add_argument("--batch", type=int, default=500, help="events per batch")
    parser.add_argument(
        "--offload-events",
        type=int,
        default=None,
        help="server: batches above this many events apply in a worker thread",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


# -- workload -------------------------------------------------------------------------------


def workload(n: int, *, prefix: str, live: int = 2000, seed: int = 3) -> Iterator[tuple[Any, ...]]:
    """``n`` events of ``live`` concurrent agentic trajectories, each in lifecycle order.

    Yields (type, trajectory, fields); a finished trajectory is replaced by a new one.
    """
    rng = random.Random(seed)
    made = 0
    serial = 0

    def lifecycle(traj: str) -> Iterator[tuple[Any, ...]]:
        ctx = rng.randint(800, 4000)
        yield ("sample_dispatched", traj, {"group": f"g{serial // 32}", "task": "swe"})
        yield ("sandbox_started", traj, {"mode": rng.choice(("prewarm", "cold"))})
        turns = rng.randint(2, 10)
        for turn in range(turns):
            yield ("request_queued", traj, {"prompt_tokens": ctx, "turn": turn})
            yield ("prefill_started", traj, {"instance": f"e-{rng.randint(0, 15)}"})
            yield ("prefill_finished", traj, {})
            out = rng.randint(20, 600)
            last = turn == turns - 1
            yield (
                "decode_finished",
                traj,
                {"output_tokens": out, "finish": "stop" if last else "tool"},
            )
            ctx += out
            if not last:
                yield ("tool_started", traj, {"tool": rng.choice(("bash", "read", "edit"))})
                result = rng.randint(50, 1500)
                yield ("tool_finished", traj, {"result_tokens": result})
                ctx += result
        yield ("reward_started", traj, {})
        yield ("reward_finished", traj, {"accepted": rng.random() < 0.7})

    active: list[Iterator[tuple[Any, ...]]] = []
    while made < n:
        while len(active) < live:
            active.append(lifecycle(f"{prefix}{serial}"))
            serial += 1
        i = rng.randrange(len(active))
        try:
            item = next(active[i])
        except StopIteration:
            active[i] = active[-1]
            active.pop()
            continue
        made += 1
        yield item


# -- the server process ---------------------------------------------------------------------


def _serve(conn: Any, cpu: int | None, offload_events: int | None) -> None:
    """Child process: the real webhook + Controller, ticking every second, until told."""

    tune_gc()  # as `prorsa operator` and `prorsa ingest` run
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cpu})
    asyncio.run(_serve_async(conn, offload_events))


async def _serve_async(conn: Any, offload_events: int | None) -> None:

    spec = parse_cluster(
        {
            "apiVersion": "prorsa.io/v1alpha1",
            "kind": "RolloutCluster",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": {"model": {"path": "/m"}, "gpuBudget": 128},
        }
    ).spec
    limits = (
        IngestLimits() if offload_events is None else IngestLimits(offload_events=offload_events)
    )
    registry = ClusterRegistry(limits=limits)
    # resync=False: a brand-new cluster and trainer, nothing to resynchronise.
    handle = registry.add(
        namespace=NAMESPACE, name=NAME, token=TOKEN, controller=Controller(spec), resync=False
    )
    server = WebhookServer(registry)
    running = await server.start(host="127.0.0.1", port=0)
    loop = asyncio.get_running_loop()
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            await asyncio.sleep(1.0)
            start = time.perf_counter()
            await handle.tick()
            ticks.append(time.perf_counter() - start)

    lags: list[float] = []

    async def lag_monitor() -> None:
        """How late a 5 ms timer fires: the longest the loop was blocked by anything."""
        while True:
            due = loop.time() + 0.005
            await asyncio.sleep(0.005)
            lags.append(loop.time() - due)

    tick_task = asyncio.create_task(ticker())
    lag_task = asyncio.create_task(lag_monitor())
    conn.send(running.port)
    while True:
        message = await loop.run_in_executor(None, conn.recv)
        if message == "stats":
            conn.send(
                {
                    "cpu": time.process_time(),
                    "applied": handle.applied,
                    "duplicates": handle.duplicates,
                    "batches": handle.batches,
                    "live": sum(handle.controller.live_trajectories().values()),
                    "ticks": len(ticks),
                    "tickP50Ms": 1e3 * statistics.median(ticks) if ticks else None,
                    "lagP99Ms": 1e3 * _pct(lags, 0.99) if lags else None,
                    "lagMaxMs": 1e3 * max(lags) if lags else None,
                }
            )
            lags.clear()
        else:
            break
    tick_task.cancel()
    lag_task.cancel()
    await running.stop()


# -- measurements -----------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _throughput(url: str, n: int, batch: int) -> dict[str, float]:

    items = list(workload(n, prefix="tp-"))
    cpu = time.process_time()
    start = time.perf_counter()
    async with AsyncEventEmitter(
        url=url, namespace=NAMESPACE, name=NAME, token=TOKEN, batch_size=batch, max_buffer=n + 1
    ) as em:
        emit = em.emit
        for i, (kind, traj, fields) in enumerate(items):
            emit(kind, traj, **fields)
            if i % batch == batch - 1:
                await asyncio.sleep(0)  # let the sender run alongside, as a trainer's loop would
        await em.flush(timeout=600)
        stats = em.stats
    elapsed = time.perf_counter() - start
    client_cpu = time.process_time() - cpu
    return {
        "events": n,
        "seconds": elapsed,
        "eventsPerSecond": stats.sent / elapsed,
        "clientCpuUsPerEvent": 1e6 * client_cpu / n,
        "dropped": stats.dropped,
    }


async def _latency(url: str, rate: float, seconds: float, batch: int) -> dict[str, float]:
    import httpx

    n_batches = max(1, round(rate * seconds / batch))
    items = list(workload(n_batches * batch, prefix="lat-", seed=11))
    now = time.time()
    bodies = []
    for b in range(n_batches):
        chunk = items[b * batch : (b + 1) * batch]
        events = [
            {"id": f"lat-{b}-{j}", "ts": now, "trajectory": traj, "type": kind, **fields}
            for j, (kind, traj, fields) in enumerate(chunk)
        ]
        bodies.append(json.dumps({"events": events}, separators=(",", ":")).encode())
    interval = batch / rate
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as http:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        await http.get("/healthz")  # connect before the clock starts
        t0 = time.perf_counter() + 0.05

        async def send(i: int, body: bytes) -> None:
            due = t0 + i * interval
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            r = await http.post(
                PATH, content=body, headers={**headers, "X-Prorsa-Sent-At": repr(time.time())}
            )
            latencies.append(time.perf_counter() - due)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

        await asyncio.gather(*(send(i, body) for i, body in enumerate(bodies)))
        achieved = n_batches * batch / (time.perf_counter() - t0)
    return {
        "offered": rate,
        "achieved": achieved,
        "batches": n_batches,
        "p50Ms": 1e3 * statistics.median(latencies),
        "p99Ms": 1e3 * _pct(latencies, 0.99),
        "maxMs": 1e3 * max(latencies),
        "non200": sum(v for k, v in statuses.items() if k != 200),
    }


def _parse_cost(batch: int) -> float:
    """Server CPU per event for JSON parsing + CONTRACT validation alone (µs)."""

    items = list(workload(20 * batch, prefix="pc-", seed=5))
    now = time.time()
    bodies = [
        json.dumps(
            {
                "events": [
                    {"id": f"pc-{i}-{j}", "ts": now, "trajectory": t, "type": k, **f}
                    for j, (k, t, f) in enumerate(items[i : i + batch])
                ]
            }
        ).encode()
        for i in range(0, len(items), batch)
    ]
    start = time.process_time()
    for body in bodies:
        parse_batch(body)
    return 1e6 * (time.process_time() - start) / len(items)


def _cpus() -> tuple[int | None, int | None]:
    """(server CPU, client CPU) to pin to, when there are two to spare."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return cpus[-1], cpus[-2]


def run(args: argparse.Namespace) -> int:
    n = args.events or (200_000 if args.quick else 1_000_000)
    seconds = args.seconds or (4.0 if args.quick else 10.0)
    server_cpu, client_cpu = _cpus()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, server_cpu, args.offload_events), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("the bench server did not start")
        url = f"http://127.0.0.1:{parent.recv()}"
        if client_cpu is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, {client_cpu})
        parent.send("stats")
        before = parent.recv()
        tp = asyncio.run(_throughput(url, n, args.batch))
        parent.send("stats")
        mid = parent.recv()
        lat = asyncio.run(_latency(url, args.rate, seconds, args.batch))
        parent.send("stats")
        after = parent.recv()
        parent.send("stop")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    server_cpu_s = mid["cpu"] - before["cpu"]
    per_core = (mid["applied"] - before["applied"]) / server_cpu_s if server_cpu_s > 0 else 0.0
    parse_us = _parse_cost(args.batch)
    figures = {
        "throughput": tp,
        "serverEventsPerCpuSecond": per_core,
        "serverCpuUsPerEvent": 1e6 / per_core if per_core else None,
        "parseUsPerEvent": parse_us,
        "latency": lat,
        "serverLoopLagMs": {"p99": mid["lagP99Ms"], "max": mid["lagMaxMs"]},
        "server": {
            "pinnedCpu": server_cpu,
            "liveTrajectories": after["live"],
            "ticks": after["ticks"],
            "tickP50Ms": after["tickP50Ms"],
            "duplicates": after["duplicates"],
        },
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    pinned = f"pinned to CPU {server_cpu}" if server_cpu is not None else "not pinned"
    print(
        f"prorsa bench ingest (server: own process, {pinned}, ticking every 1 s; "
        "client: this process)"
    )
    rows = [
        (
            f"events/s end to end, SDK, batches of {args.batch}",
            f"{tp['eventsPerSecond']:,.0f}",
            f">= {TARGET_EVENTS_PER_S:,}",
            f"{tp['eventsPerSecond'] / TARGET_EVENTS_PER_S:.2f}x",
        ),
        (
            "events per server CPU-second (one core)",
            f"{per_core:,.0f}",
            f">= {TARGET_EVENTS_PER_S:,}",
            f"{per_core / TARGET_EVENTS_PER_S:.2f}x",
        ),
        (
            f"p99 batch latency @ {args.rate:,.0f} events/s offered",
            f"{lat['p99Ms']:.1f} ms",
            f"< {TARGET_P99_MS:.0f} ms",
            f"{TARGET_P99_MS / lat['p99Ms']:.1f}x headroom" if lat["p99Ms"] > 0 else "-",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"  {'figure':<{width}}  {'measured':>12}  {'target':>11}  ratio")
    for name, measured, target, ratio in rows:
        print(f"  {name:<{width}}  {measured:>12}  {target:>11}  {ratio}")
    print(
        f"  detail: {tp['events']:,} events in {tp['seconds']:.2f} s, {tp['dropped']} dropped; "
        f"server loop blocked p99 {mid['lagP99Ms']:.1f} ms, max {mid['lagMaxMs']:.1f} ms; "
        f"client {tp['clientCpuUsPerEvent']:.1f} µs CPU/event"
    )
    server_us = 1e6 / per_core if per_core else float("nan")
    print(
        f"  detail: server {server_us:.1f} µs CPU/event, of which parsing + validation "
        f"{parse_us:.1f} µs; {after['live']:,} live trajectories at the end"
    )
    print(
        f"  detail: latency run {lat['batches']} batches, achieved {lat['achieved']:,.0f} ev/s, "
        f"p50 {lat['p50Ms']:.1f} ms, max {lat['maxMs']:.1f} ms, {lat['non200']} non-200; "
        f"server loop blocked p99 {after['lagP99Ms']:.1f} ms"
    )
    return 0
