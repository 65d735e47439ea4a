"""``prorsa bench soak``: the operator for an hour (``--minutes``) at a steady event rate, to
see that nothing it holds grows with time.

The set-up of ``prorsa bench scale`` (two ``prorsa operator`` replicas, the API emulator,
engine pods with the real agent in front of an engine double, the trainer's SDK in
processes of their own at the paper's coding and general event rates), smaller by default.
A share of trajectories is dropped by the trainer part-way (``trajectory_dropped``) and every
ended one is replaced, and every ``--switch-every`` minutes each cluster's
``roles.prefill.min`` moves up or back down, so engines switch all along.

Every ``--every`` minutes it prints (stderr, and in the JSON's ``samples``) the leader's
resident memory and open files, the trajectory table's size (``prorsa_live_trajectories``
summed), events sent, switches done and the machine's load; at the end, how much each grew
from the first sample to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from prorsa.shell.gc_tuning import tune_gc
from prorsa_lab.bench import replicas as rep
from prorsa_lab.bench.scale_bench import (
    Sizes,
    bench_stack,
    manifest,
    progress,
    split_of,
    wait_until,
)
from prorsa_lab.bench.trainer_load import LoadSettings, TrainerLoad, cluster_loads

HELP = "the operator for an hour at a steady event rate: RSS, open files, table size over time"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=60.0, help="how long to run")
    parser.add_argument("--every", type=float, default=5.0, help="minutes between samples")
    parser.add_argument("--clusters", type=int, default=2, help="RolloutClusters")
    parser.add_argument("--instances", type=int, default=8, help="engine pods per cluster")
    parser.add_argument(
        "--trajectories", type=int, default=5000, help="live trajectories per cluster"
    )
    parser.add_argument(
        "--drop-share", type=float, default=0.05, help="share of trajectories dropped part-way"
    )
    parser.add_argument(
        "--switch-every", type=float, default=3.0, help="minutes between forced moves"
    )
    parser.add_argument("--horizon", type=float, default=10.0, help="forecast.horizonSeconds")
    parser.add_argument("--out", default=None, help="directory for the replicas' logs")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


async def sample(
    env: Any, replicas: list[rep.Replica], load: TrainerLoad, started: float
) -> dict[str, Any]:
    lead = await rep.leader(env, replicas)
    if lead is None:
        return {"minute": (time.monotonic() - started) / 60, "leader": None}
    metrics = await rep.scrape(lead.metrics_url)
    stats = await load.stats()
    return {
        "minute": (time.monotonic() - started) / 60,
        "leader": lead.name,
        "rssBytes": rep.rss_bytes(lead.pid),
        "openFiles": rep.open_files(lead.pid),
        "liveTrajectories": rep.total(metrics, "prorsa_live_trajectories"),
        "switches": rep.total(metrics, "prorsa_switches_total"),
        "ticks": rep.total(metrics, "prorsa_tick_duration_seconds_count"),
        "eventsSent": sum(c["stats"].sent for c in stats["clusters"].values()),
        "eventsDropped": sum(c["stats"].dropped for c in stats["clusters"].values()),
        "trajectoriesEnded": sum(c["finished"] for c in stats["clusters"].values()),
        "operatorCpuSeconds": rep.cpu_seconds(lead.pid),
        "loadAverage": os.getloadavg()[0],
    }


def show(s: dict[str, Any]) -> None:
    if s.get("leader") is None:
        progress(f"  minute {s['minute']:5.1f}: no leader")
        return
    progress(
        f"  minute {s['minute']:5.1f}: RSS {s['rssBytes'] / 2**20:7.1f} MiB, "
        f"open files {s['openFiles']:4d}, table {s['liveTrajectories']:8,.0f}, "
        f"events sent {s['eventsSent']:>11,}, ended {s['trajectoriesEnded']:>8,}, "
        f"switches {s['switches']:4.0f}, operator CPU {s['operatorCpuSeconds']:7.1f} s, "
        f"load {s['loadAverage']:.2f}"
    )


async def soak(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    sizes = Sizes(
        clusters=args.clusters,
        instances=args.instances,
        trajectories=args.trajectories,
        horizon=args.horizon,
        steady=0.0,
        storm_moves=max(1, args.instances // 4),
        switch_seconds=1.0,
        storm_timeout=0.0,
    )
    samples: list[dict[str, Any]] = []
    async with bench_stack(switch_seconds=sizes.switch_seconds) as env:
        replicas: list[rep.Replica] = []
        load: TrainerLoad | None = None
        try:
            for name in ("prorsa-a", "prorsa-b"):
                replicas.append(await rep.start_replica(env, name, log_dir=out_dir))

            async def serving() -> bool:
                return await rep.leader(env, replicas) is not None and await env._webhook_up()

            await wait_until(serving, timeout=300, what="a replica leading")
            names = sizes.names()
            for name in names:
                await env.create_cluster(manifest(name, sizes))

            async def up() -> bool:
                for name in names:
                    p, d, _dr, _it = await split_of(env, name)
                    if p + d < sizes.instances:
                        return False
                return True

            await wait_until(up, timeout=120 + 2 * sizes.instances * sizes.clusters, what="pods")
            loads = cluster_loads(names, task=sizes.task, live=sizes.trajectories)
            load = TrainerLoad(
                LoadSettings(
                    url=env.webhook,
                    namespace=env.namespace,
                    token=env.token,
                    clusters=loads,
                    drop_share=args.drop_share,
                )
            )
            progress(
                f"soak: {sizes.clusters} clusters x {sizes.instances} pods, "
                f"{sizes.trajectories:,} live trajectories each, "
                f"{sum(c.rate for c in loads):,.0f} events/s, {args.minutes:.0f} minutes"
            )
            await load.start()
            started = time.monotonic()
            end = started + 60 * args.minutes
            next_sample = started
            next_move = started + 60 * args.switch_every
            raised = False
            while True:
                now = time.monotonic()
                if now >= next_sample:
                    samples.append(await sample(env, replicas, load, started))
                    show(samples[-1])
                    next_sample += 60 * args.every
                if now >= next_move:
                    raised = not raised
                    want = sizes.initial_prefill + (sizes.storm_moves if raised else 0)
                    for name in names:
                        roles = {"prefill": {"min": want, "initial": want}}
                        await env.patch_cluster(name, {"spec": {"roles": roles}})
                    next_move += 60 * args.switch_every
                if now >= end:
                    break
                await asyncio.sleep(min(5.0, max(0.0, end - now)))
            if samples and time.monotonic() - started - 60 * samples[-1]["minute"] > 5:
                samples.append(await sample(env, replicas, load, started))
                show(samples[-1])
        finally:
            if load is not None:
                await load.stop()
            for replica in replicas:
                await replica.stop()
    measured = [s for s in samples if s.get("leader")]
    first, last = measured[0], measured[-1]
    return {
        "minutes": args.minutes,
        "sizes": {
            "clusters": sizes.clusters,
            "instances": sizes.instances,
            "trajectories": sizes.trajectories,
            "dropShare": args.drop_share,
        },
        "samples": samples,
        "growth": {
            "rssBytes": last["rssBytes"] - first["rssBytes"],
            "openFiles": last["openFiles"] - first["openFiles"],
            "liveTrajectories": last["liveTrajectories"] - first["liveTrajectories"],
        },
        # From the second sample: the first interval holds the warm-up (the table filling
        # with learned statistics, the first switches, caches of the client libraries).
        "growthAfterWarmup": None
        if len(measured) < 3
        else {
            "rssBytes": last["rssBytes"] - measured[1]["rssBytes"],
            "openFiles": last["openFiles"] - measured[1]["openFiles"],
            "liveTrajectories": last["liveTrajectories"] - measured[1]["liveTrajectories"],
        },
        "leaders": sorted({s["leader"] for s in measured}),
        "cpus": os.cpu_count(),
    }


def run(args: argparse.Namespace) -> int:
    tune_gc()
    if args.minutes <= 0 or args.every <= 0:
        raise SystemExit("--minutes and --every must be > 0")
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="prorsa-soak-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    progress(f"replica logs in {out_dir}")
    result = asyncio.run(soak(args, out_dir))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        g = result["growth"]
        print(
            f"prorsa bench soak: {result['minutes']:.0f} minutes, {len(result['samples'])} "
            f"samples; from the first to the last: RSS {g['rssBytes'] / 2**20:+.1f} MiB, "
            f"open files {g['openFiles']:+d}, trajectory table {g['liveTrajectories']:+,.0f}"
        )
    return 0
