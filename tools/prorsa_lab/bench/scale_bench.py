"""``prorsa bench scale``: one operator (two replicas, leader election) running several
RolloutClusters of many engine pods under a trainer's load, then a switch storm.

Everything but the GPUs is real: the operator is ``prorsa operator --leader-elect`` twice,
as processes of their own; the API server is the emulator (its audit log counts the
operator's calls); every engine pod runs the real in-pod agent in front of a light engine
double (the fake kubelet, in this process); the trainer is the real SDK, in a process of
its own, sending each cluster the lifecycle events of ``--trajectories`` live agentic
trajectories at the rate the paper's coding and general settings produce
(:mod:`prorsa_lab.bench.trainer_load`; clusters alternate coding, general).

Phases, each measured: start (every engine pod up, bootstrapped to its initial split), the
trainer's ramp (every trajectory dispatched), a steady window (``--steady`` seconds), then
the storm: every cluster's ``roles.prefill.min`` raised at once (as ``kubectl patch`` of
each would), which the Controller must honour (a forced move, not priced), so every
cluster switches ``--storm-moves`` engines in the same ticks.

Figures: each cluster's tick p99 (the operator's ``prorsa_tick_duration_seconds``), the
webhook's batch p99 (``prorsa_webhook_batch_duration_seconds``), the operator's API calls
per tick and per switch (the emulator's audit log, two windows solved for both), agent
polls per second (``prorsa_agent_polls_total``), the storm's time from the patch to every
switch done, switches run twice (an engine flipped more than once in the storm; each
engine double counts its flips) and pods left draining, and the leader's peak RSS and open
files (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prorsa.shell.gc_tuning import tune_gc
from prorsa_agent.config import Timeouts
from prorsa_contract.labels import DRAINING, ROLE_LABEL, SWITCH_ANNOTATION, parse_intent
from prorsa_lab.bench import replicas as rep
from prorsa_lab.bench.trainer_load import LoadSettings, TrainerLoad, cluster_loads
from prorsa_lab.doubles.sglang_double import EngineConfig, TimingModel
from prorsa_lab.doubles.stack import OPERATOR_USER, Stack, cluster_manifest, stack

HELP = "one operator, 2 replicas, several clusters of many engine pods, a trainer's load, a storm"

KUBELET_POLL_SECONDS = 2.0
TARGET_TICK_P99_MS = 100.0
TARGET_RSS_BYTES = 1 << 30
TASKS = ("coding", "general")
# Agent timeouts for engine doubles at scale: the engines' health probe every 5 s as in a
# real engine pod (FAST_TIMEOUTS probes every 0.1 s, which at 128 pods is load of its own);
# switch steps short, as a double switches in --switch-seconds.
SCALE_TIMEOUTS = Timeouts(
    request=5.0,
    switch=60.0,
    verify=20.0,
    abort_settle=5.0,
    retry_drain=0.5,
    poll=0.1,
    health_interval=5.0,
    health_probe=5.0,
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clusters", type=int, default=4, help="RolloutClusters")
    parser.add_argument("--instances", type=int, default=32, help="engine pods per cluster")
    parser.add_argument(
        "--trajectories", type=int, default=25_000, help="live trajectories per cluster"
    )
    parser.add_argument(
        "--horizon", type=float, default=10.0, help="forecast.horizonSeconds: the tick period"
    )
    parser.add_argument("--steady", type=float, default=120.0, help="seconds of steady load")
    parser.add_argument(
        "--storm-moves", type=int, default=None, help="engines each cluster moves (instances/4)"
    )
    parser.add_argument(
        "--switch-seconds", type=float, default=2.0, help="an engine double's role flip"
    )
    parser.add_argument("--storm-timeout", type=float, default=900.0, help="give the storm up")
    parser.add_argument("--out", default=None, help="directory for the replicas' logs")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


@dataclass(kw_only=True)
class Sizes:
    clusters: int
    instances: int
    trajectories: int
    horizon: float
    steady: float
    storm_moves: int
    switch_seconds: float
    storm_timeout: float

    @property
    def initial_prefill(self) -> int:
        return max(1, self.instances // 8)

    def names(self) -> list[str]:
        return [f"scale-{i}" for i in range(self.clusters)]

    def task(self, index: int) -> str:
        return TASKS[index % len(TASKS)]


def sizes_of(args: argparse.Namespace) -> Sizes:
    for flag in ("clusters", "instances", "trajectories"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be at least 1")
    if args.instances < 4:
        raise SystemExit("--instances must be at least 4 (a storm needs room to move)")
    moves = args.storm_moves if args.storm_moves is not None else max(1, args.instances // 4)
    sizes = Sizes(
        clusters=args.clusters,
        instances=args.instances,
        trajectories=args.trajectories,
        horizon=args.horizon,
        steady=args.steady,
        storm_moves=moves,
        switch_seconds=args.switch_seconds,
        storm_timeout=args.storm_timeout,
    )
    if moves > args.instances // 2:
        raise SystemExit(f"--storm-moves {moves}: at most half of --instances {args.instances}")
    return sizes


def manifest(name: str, sizes: Sizes) -> dict[str, Any]:
    return cluster_manifest(
        name,
        gpuBudget=8 * sizes.instances,
        roles={"prefill": {"min": 1, "initial": sizes.initial_prefill}, "decode": {"min": 1}},
        forecast={"horizonSeconds": sizes.horizon},
        switching={
            "maxConcurrent": max(1, sizes.instances // 4),
            "drainTimeoutSeconds": 5,
        },
        trainer={"maxLiveTrajectories": max(100_000, 2 * sizes.trajectories)},
    )


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Watch:
    """The leader's peak RSS and open files, sampled every second while it runs."""

    replicas: list[rep.Replica]
    env: Stack
    peak_rss: int = 0
    peak_files: int = 0
    leaders: set[str] = field(default_factory=set)
    task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            leading = await rep.leader(self.env, self.replicas)
            if leading is not None:
                self.leaders.add(leading.name)
                try:
                    self.peak_rss = max(self.peak_rss, rep.rss_bytes(leading.pid))
                    self.peak_files = max(self.peak_files, rep.open_files(leading.pid))
                except OSError:
                    pass
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


async def wait_until(
    check: Callable[[], Awaitable[Any]], *, timeout: float, what: str, every: float = 0.5
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await check()
        if found:
            return found
        await asyncio.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s")


async def split_of(env: Stack, name: str) -> tuple[int, int, int, int]:
    """(prefill, decode, draining, with an intent) among a cluster's engine pods."""
    prefill = decode = draining = intents = 0
    for pod in await env.pods(name):
        meta = pod["metadata"]
        role = (meta.get("labels") or {}).get(ROLE_LABEL)
        prefill += role == "prefill"
        decode += role == "decode"
        draining += role == DRAINING
        intents += SWITCH_ANNOTATION in (meta.get("annotations") or {})
    return prefill, decode, draining, intents


CLOCK_DRIVEN = {("get", "leases"), ("update", "leases"), ("create", "leases"), ("get", "secrets")}
"""Calls that run on a clock of their own, not the ticks': the election's Lease renewals and
the trainer-token follower's Secret reads (one per cluster every 2 s,
:mod:`prorsa.k8s.trainer_token`); counted apart, per second."""
SWITCH_CALLS = {("patch", "pods"), ("get", "pods")}
"""A switch's own calls (:mod:`prorsa.switching.executor`): the intent and ``draining`` label,
its phase, the relabel (and a re-read of a pod without an IP); its Events are counted by
reason (``Switch*``). A tick relabels a pod only to correct a drifted label
(``prorsa_role_label_corrections_total``, reported)."""
KOPF_VERBS = {"watch"}
"""kopf's own: its watch streams, and its handlers' bookkeeping on the RolloutCluster
(``patch rolloutclusters``) when a spec changes."""


def operator_calls(env: Stack) -> Counter[tuple[str, str]]:
    """The operator's API calls so far by (verb, resource)."""
    out: Counter[tuple[str, str]] = Counter()
    for call, n in env.server.emulator.api_calls(OPERATOR_USER).items():
        out[(call.verb, call.resource)] += n
    return out


async def event_reasons(env: Stack) -> Counter[str]:
    """Events posted so far in the clusters' namespace, by reason."""
    return Counter(str(e.get("reason")) for e in await env.events())


@dataclass(frozen=True, kw_only=True)
class CallSplit:
    """One window's operator calls, by what made them."""

    tick: float
    switch: float
    clock: float
    kopf: float

    @classmethod
    def of(cls, calls: Counter[tuple[str, str]], reasons: Counter[str]) -> CallSplit:
        clock = sum(n for k, n in calls.items() if k in CLOCK_DRIVEN)
        kopf = sum(
            n for k, n in calls.items() if k[0] in KOPF_VERBS or k == ("patch", "rolloutclusters")
        )
        switch_events = sum(n for reason, n in reasons.items() if reason.startswith("Switch"))
        switch = sum(n for k, n in calls.items() if k in SWITCH_CALLS) + switch_events
        total = sum(calls.values())
        return cls(
            tick=float(total - clock - kopf - switch),
            switch=float(switch),
            clock=float(clock),
            kopf=float(kopf),
        )


def engine_flips(env: Stack) -> dict[str, int]:
    """Role flips each engine double has made (successful ``/pd_role_switch`` calls; an
    agent's second try after "not idle" is the same switch, and is not counted; a flip to
    the role an engine has is refused by the agent as a no-op, so a switch run twice shows
    in :func:`drains_since`, not here)."""
    return {name: pod.engine.counters().switches_ok for name, pod in env.kubelet.pods.items()}


@dataclass(frozen=True, kw_only=True)
class Drains:
    """The switches started on engine pods after some resourceVersion, from the API
    server's write log: each relabel to ``draining`` with its intent's destination."""

    started: dict[str, int]
    twice: dict[str, int]
    """Switches started toward the role the pod already had: one that was finished and
    then ran again (two replicas, or a resumed switch, doing it twice)."""


def drains_since(env: Stack, rv: int) -> Drains:
    started: dict[str, int] = {}
    twice: dict[str, int] = {}
    label: dict[str, str] = {}
    settled: dict[str, str] = {}  # the last role other than draining
    for event in env.server.emulator.writes(("", "v1", "pods")):
        meta = event.obj["metadata"]
        if event.type == "DELETED":
            continue
        name = meta["name"]
        role = (meta.get("labels") or {}).get(ROLE_LABEL, "")
        if event.rv > rv and role == DRAINING and label.get(name) != DRAINING:
            started[name] = started.get(name, 0) + 1
            intent = parse_intent((meta.get("annotations") or {}).get(SWITCH_ANNOTATION))
            if intent is not None and intent["to"] == settled.get(name):
                twice[name] = twice.get(name, 0) + 1
        label[name] = role
        if role in ("prefill", "decode"):
            settled[name] = role
    return Drains(started=started, twice=twice)


def resource_version(env: Stack) -> int:
    writes = env.server.emulator.writes(("", "v1", "pods"))
    return writes[-1].rv if writes else 0


@contextlib.asynccontextmanager
async def bench_stack(*, switch_seconds: float) -> AsyncIterator[Stack]:
    """The API emulator, the fake kubelet and engine doubles, with no operator in process:
    the replicas are real ``prorsa operator`` processes (:mod:`prorsa_lab.bench.replicas`)."""
    engine = EngineConfig(timing=TimingModel(switch_seconds=switch_seconds))
    async with stack(
        engine_config=lambda _n: engine,
        tick_seconds=None,
        agent_timeouts=SCALE_TIMEOUTS,
        operator_namespace=rep.OPERATOR_NAMESPACE,
        leader_election=rep.ELECTION,
        start_operator=False,
    ) as env:
        # The fake kubelet lists the engine pods to start and stop their doubles: every
        # 0.2 s by default, which at a hundred pods (each deserialized by the client
        # library) is most of this process's CPU; a kubelet's own sync is seconds apart.
        env.kubelet.poll_interval = KUBELET_POLL_SECONDS
        yield env


async def measure(sizes: Sizes, out_dir: Path) -> dict[str, Any]:
    started = time.monotonic()
    load_start = os.getloadavg()
    async with bench_stack(switch_seconds=sizes.switch_seconds) as env:
        replicas: list[rep.Replica] = []
        load: TrainerLoad | None = None
        watch = Watch(replicas, env)
        try:
            for name in ("prorsa-a", "prorsa-b"):
                replicas.append(await rep.start_replica(env, name, log_dir=out_dir))
            progress("two operator replicas started; waiting for a leader")

            async def serving() -> rep.Replica | None:
                found = await rep.leader(env, replicas)
                return found if found is not None and await env._webhook_up() else None

            await wait_until(serving, timeout=300, what="a replica leading")
            watch.start()
            names = sizes.names()
            for name in names:
                await env.create_cluster(manifest(name, sizes))
            total = sizes.clusters * sizes.instances
            progress(f"{sizes.clusters} clusters created: starting {total} engine pods")

            async def bootstrapped() -> bool:
                for name in names:
                    p, d, dr, it = await split_of(env, name)
                    if (p, d, dr, it) != (
                        sizes.initial_prefill,
                        sizes.instances - sizes.initial_prefill,
                        0,
                        0,
                    ):
                        return False
                return True

            await wait_until(
                bootstrapped, timeout=120 + 2 * total, what="every engine pod up", every=2
            )
            ready_at = time.monotonic()
            progress(f"every engine pod up and bootstrapped in {ready_at - started:.0f}s")

            loads = cluster_loads(names, task=sizes.task, live=sizes.trajectories)
            load = TrainerLoad(
                LoadSettings(
                    url=env.webhook, namespace=env.namespace, token=env.token, clusters=loads
                )
            )
            offered = sum(c.rate for c in loads)
            progress(
                f"trainer: {sizes.trajectories:,} live trajectories per cluster, "
                f"{offered:,.0f} events/s offered in all; dispatching"
            )
            await load.start()
            progress("every trajectory dispatched: steady window")
            lead = await rep.leader(env, replicas)
            assert lead is not None
            m0 = await rep.scrape(lead.metrics_url)
            calls0 = operator_calls(env)
            reasons0 = await event_reasons(env)
            l0 = await load.stats()
            t0 = time.monotonic()
            await asyncio.sleep(sizes.steady)
            lead = await rep.leader(env, replicas)
            assert lead is not None
            m1 = await rep.scrape(lead.metrics_url)
            calls1 = operator_calls(env)
            reasons1 = await event_reasons(env)
            l1 = await load.stats()
            t1 = time.monotonic()
            progress(f"steady window done ({t1 - t0:.0f}s); the storm")

            # The storm: every cluster's role minimum raised in one go, each from the split
            # it has now (the trainer's load may have moved it), toward prefill where
            # there is room, else toward decode.
            flips0 = engine_flips(env)
            rv0 = resource_version(env)
            goals: dict[str, tuple[str, int]] = {}
            patches = []
            for name in names:
                p_now, d_now, _dr, _it = await split_of(env, name)
                if p_now + sizes.storm_moves <= sizes.instances - 1:
                    want = p_now + sizes.storm_moves
                    goals[name] = ("prefill", want)
                    roles = {"prefill": {"min": want, "initial": want}}
                else:
                    want = d_now + sizes.storm_moves
                    goals[name] = ("decode", want)
                    first = sizes.instances - want
                    roles = {"prefill": {"min": 1, "initial": first}, "decode": {"min": want}}
                patches.append(env.patch_cluster(name, {"spec": {"roles": roles}}))
            storm_start = time.monotonic()
            await asyncio.gather(*patches)
            done_at: dict[str, float] = {}

            async def storm_done() -> bool:
                for name in names:
                    if name in done_at:
                        continue
                    p, d, dr, it = await split_of(env, name)
                    role, want = goals[name]
                    if (p if role == "prefill" else d) >= want and dr == 0 and it == 0:
                        done_at[name] = time.monotonic() - storm_start
                        progress(f"  {name}: storm done in {done_at[name]:.1f}s")
                return len(done_at) == len(names)

            converged = True
            try:
                await wait_until(storm_done, timeout=sizes.storm_timeout, what="the storm")
            except TimeoutError:
                converged = False
            storm_end = time.monotonic()
            await asyncio.sleep(2 * sizes.horizon)  # the ticks after: nothing moves again
            lead = await rep.leader(env, replicas)
            assert lead is not None
            m2 = await rep.scrape(lead.metrics_url)
            calls2 = operator_calls(env)
            reasons2 = await event_reasons(env)
            l2 = await load.stats()
            t2 = time.monotonic()
            flips1 = engine_flips(env)
            left = 0
            for name in names:
                _p, _d, dr, it = await split_of(env, name)
                left += max(dr, it)
            flipped = {n: flips1.get(n, 0) - flips0.get(n, 0) for n in flips1}
            drains = drains_since(env, rv0)
            doubles = sum(drains.twice.values())
            rss_now = rep.rss_bytes(lead.pid)
            files_now = rep.open_files(lead.pid)
            cpu = {r.name: rep.cpu_seconds(r.pid) for r in replicas if r.process.returncode is None}
            load_end = os.getloadavg()
        finally:
            await watch.stop()
            if load is not None:
                await load.stop()
            for replica in replicas:
                await replica.stop()

    def ticks(a: rep.Samples, b: rep.Samples) -> float:
        name = "prorsa_tick_duration_seconds_count"
        return rep.total(b, name) - rep.total(a, name)

    def switches(a: rep.Samples, b: rep.Samples) -> float:
        return rep.total(b, "prorsa_switches_total") - rep.total(a, "prorsa_switches_total")

    steady = CallSplit.of(calls1 - calls0, reasons1 - reasons0)
    storm = CallSplit.of(calls2 - calls1, reasons2 - reasons1)
    n_ticks = (ticks(m0, m1), ticks(m1, m2))
    n_switches = (switches(m0, m1), switches(m1, m2))
    per_tick = (steady.tick + storm.tick) / sum(n_ticks) if sum(n_ticks) else None
    per_switch = (steady.switch + storm.switch) / sum(n_switches) if sum(n_switches) else None
    corrections = rep.total(m2, "prorsa_role_label_corrections_total") - rep.total(
        m0, "prorsa_role_label_corrections_total"
    )
    clusters = []
    for i, name in enumerate(names):
        labels = {"namespace": env.namespace, "cluster": name}
        p99, bucket = rep.quantile(m0, m2, "prorsa_tick_duration_seconds", 0.99, **labels)
        live = rep.total(m2, "prorsa_live_trajectories", **labels)
        # In the steady window: what the trainer got through to the webhook.
        sent = (l1["clusters"][name]["stats"].sent - l0["clusters"][name]["stats"].sent) / max(
            l1["seconds"] - l0["seconds"], 1e-9
        )
        clusters.append(
            {
                "name": name,
                "task": sizes.task(i),
                "tickP99Ms": None if p99 is None else 1e3 * p99,
                "tickP99BucketMs": None if bucket is None else 1e3 * bucket,
                "ticks": rep.total(m2, "prorsa_tick_duration_seconds_count", **labels)
                - rep.total(m0, "prorsa_tick_duration_seconds_count", **labels),
                "liveTrajectories": live,
                "eventsPerSecondOffered": loads[i].rate,
                "eventsPerSecondSent": sent,
                "stormSeconds": done_at.get(name),
            }
        )
    batch_p99, batch_bucket = rep.quantile(m0, m2, "prorsa_webhook_batch_duration_seconds", 0.99)
    polls = rep.total(m1, "prorsa_agent_polls_total") - rep.total(m0, "prorsa_agent_polls_total")
    stats2 = [l2["clusters"][n]["stats"] for n in names]
    return {
        "sizes": {
            "clusters": sizes.clusters,
            "instances": sizes.instances,
            "trajectories": sizes.trajectories,
            "horizonSeconds": sizes.horizon,
            "steadySeconds": sizes.steady,
            "stormMoves": sizes.storm_moves,
        },
        "clusters": clusters,
        "webhookBatchP99Ms": None if batch_p99 is None else 1e3 * batch_p99,
        "webhookBatchP99BucketMs": None if batch_bucket is None else 1e3 * batch_bucket,
        "apiCallsPerTick": per_tick,
        "apiCallsPerSwitch": per_switch,
        "apiCallsPerSecondClockDriven": (steady.clock + storm.clock) / max(t2 - t0, 1e-9),
        "apiCalls": {
            "steady": {"ticks": n_ticks[0], "switches": n_switches[0]} | asdict(steady),
            "storm": {"ticks": n_ticks[1], "switches": n_switches[1]} | asdict(storm),
            "labelCorrections": corrections,
            "eventsByReason": dict(sorted((reasons2 - reasons0).items())),
            "byVerbResource": {
                f"{verb} {resource}": n for (verb, resource), n in sorted((calls2 - calls0).items())
            },
        },
        "throttled": sum(env.server.emulator.throttled_calls(OPERATOR_USER).values()),
        "agentPollsPerSecond": polls / max(t1 - t0, 1e-9),
        "storm": {
            "converged": converged,
            "doubleSwitches": doubles,
            "leftDraining": left,
            "seconds": (storm_end - storm_start) if converged else None,
            "switchesStarted": sum(drains.started.values()),
            "enginesFlipped": sum(1 for k in flipped.values() if k),
        },
        "rssBytes": watch.peak_rss or rss_now,
        "rssBytesEnd": rss_now,
        "openFiles": watch.peak_files or files_now,
        "leaders": sorted(watch.leaders),
        "trainer": {
            "offeredEventsPerSecond": offered,
            "sentEventsPerSecond": sum(c["eventsPerSecondSent"] for c in clusters),
            "dropped": sum(s.dropped for s in stats2),
            "retries": sum(s.retries for s in stats2),
            "resyncs": sum(s.resyncs for s in stats2),
            "pending": sum(s.pending for s in stats2),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "loadAverageStart": list(load_start),
            "loadAverageEnd": list(load_end),
            "wallSeconds": t2 - started,
            "operatorCpuSeconds": cpu,
        },
    }


def run(args: argparse.Namespace) -> int:
    tune_gc()
    sizes = sizes_of(args)
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="prorsa-scale-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    progress(f"replica logs in {out_dir}")
    result = asyncio.run(measure(sizes, out_dir))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_text(result)
    return 0 if goals_met(result) else 1


def goals_met(result: dict[str, Any]) -> bool:
    storm = result["storm"]
    ticks_ok = all(
        c["tickP99Ms"] is not None and c["tickP99Ms"] <= TARGET_TICK_P99_MS
        for c in result["clusters"]
    )
    return bool(
        ticks_ok
        and storm["converged"]
        and storm["doubleSwitches"] == 0
        and storm["leftDraining"] == 0
        and result["rssBytes"] <= TARGET_RSS_BYTES
    )


def print_text(r: dict[str, Any]) -> None:
    s, m, t = r["sizes"], r["machine"], r["trainer"]
    print(
        f"prorsa bench scale: {s['clusters']} clusters x {s['instances']} engine pods, "
        f"{s['trajectories']:,} live trajectories each; 2 operator replicas"
    )
    print(
        f"  machine: {m['cpus']} CPUs, load average {m['loadAverageStart'][0]:.2f} at the "
        f"start, {m['loadAverageEnd'][0]:.2f} at the end; {m['wallSeconds']:.0f} s wall"
    )
    print(
        f"  trainer: {t['offeredEventsPerSecond']:,.0f} events/s offered, "
        f"{t['sentEventsPerSecond']:,.0f} sent; dropped {t['dropped']}, "
        f"retries {t['retries']}, resyncs {t['resyncs']}"
    )
    print(f"  {'cluster':>10} {'task':>8} {'ticks':>6} {'tick p99 ms':>12} {'live':>8}")
    for c in r["clusters"]:
        p99 = "-" if c["tickP99Ms"] is None else f"{c['tickP99Ms']:.1f}"
        print(
            f"  {c['name']:>10} {c['task']:>8} {c['ticks']:>6.0f} {p99:>12} "
            f"{c['liveTrajectories']:>8,.0f}   target <= {TARGET_TICK_P99_MS:.0f} ms"
        )
    batch = r["webhookBatchP99Ms"]
    print(f"  webhook batch p99: {'-' if batch is None else f'{batch:.1f} ms'}")
    per_tick, per_switch = r["apiCallsPerTick"], r["apiCallsPerSwitch"]
    print(
        "  API calls per tick: "
        + ("-" if per_tick is None else f"{per_tick:.1f}")
        + ", per switch: "
        + ("-" if per_switch is None else f"{per_switch:.1f}")
        + f"; on their own clocks (Lease, token Secret): "
        f"{r['apiCallsPerSecondClockDriven']:.1f}/s; 429s answered to the operator: "
        f"{r['throttled']}"
    )
    print(f"  agent polls per second: {r['agentPollsPerSecond']:.1f}")
    st = r["storm"]
    seconds = "-" if st["seconds"] is None else f"{st['seconds']:.1f} s"
    print(
        f"  storm: converged {st['converged']} in {seconds}; switches "
        f"{st['switchesStarted']}, engines flipped {st['enginesFlipped']}, switched twice "
        f"{st['doubleSwitches']}, left draining {st['leftDraining']}"
    )
    print(
        f"  operator (leader) peak RSS {r['rssBytes'] / 2**20:,.0f} MiB (target <= 1024 MiB), "
        f"open files {r['openFiles']}; leaders seen {', '.join(r['leaders'])}"
    )
    print(f"  goals met: {goals_met(r)}")
