"""``prorsa bench chaos``: rounds of faults injected into a whole deployment under a
trainer's load, each checked for convergence (docs/security.md#attack-and-chaos).

What runs, on loopback: the Kubernetes API emulator; two operator replicas, each a ``prorsa
operator --leader-elect`` process of its own (as the chart's two replicas); engine pods run
by the fake kubelet (engine double + the real agent each); the router Deployment as the
real smg; and the demo's trainer (:class:`prorsa_lab.demo.trainer.DemoTrainer`):
multi-turn trajectories whose every model call is a real ``/generate`` through smg,
resumed after an abort and retried after a failure, each answer checked token for token,
and whose every lifecycle event goes through the SDK, its token read from a file that
follows the Secret.

Each round forces one switch (it moves ``roles.*.min`` so that the split must change) and
injects one fault (:mod:`prorsa_lab.robustness.chaos_faults`, drawn in a seeded shuffle
so every kind comes up), most at a random moment of that switch. Then it waits until the
deployment has converged, all at once:

* every engine pod of the cluster exists and runs; none is ``draining``, none carries a
  switch intent (every intent resolved, finished or rolled back);
* every pod's role label is the role its engine is in, and the engine is healthy;
* the split is within the spec's bounds (``roles.*.min``), and smg routes to every engine
  as the role its label says;
* one replica leads (holds the Lease, serves the webhook), and the RolloutCluster's status,
  written by a tick after the fault, says Running, not Degraded, not Switching.

At the end the trainer must have lost nothing: every request answered with exactly the
tokens it asked for, every event delivered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from prorsa.k8s.leader import LeaderElection
from prorsa_contract.labels import DRAINING, NODE_RANK_LABEL, ROLE_LABEL, SWITCH_ANNOTATION
from prorsa_lab.demo.run import CLUSTER, DemoOptions, EngineModel, demo_manifest
from prorsa_lab.demo.smg_client import SmgClient
from prorsa_lab.demo.trainer import DemoTrainer
from prorsa_lab.demo.workload import DEMO_TASKS, PhaseSchedule
from prorsa_lab.doubles.smg_router import smg_binary, smg_version
from prorsa_lab.doubles.stack import Stack, stack
from prorsa_lab.robustness.attack_suite import machine
from prorsa_lab.robustness.chaos_faults import (
    FAULTS,
    OPERATOR_NS,
    ChaosContext,
    Replica,
    describe,
    supervise,
)
from prorsa_sdk import AsyncEventEmitter

HELP = "faults (operator, engine, agent, pod, router, API watches, token) under a trainer's load"

log = logging.getLogger("prorsa_lab.chaos")

# Shorter terms than the chart's (client-go's 15/10/2 s), long enough for a replica on a
# loaded 2-core machine to renew in time (as tests/test_operator_ha.py).
ELECTION = LeaderElection(lease_duration=8.0, renew_deadline=6.0, retry_period=0.5)
REPLICAS = ("prorsa-a", "prorsa-b")


@dataclass(frozen=True, kw_only=True)
class ChaosOptions:
    rounds: int = 15
    seed: int = 1
    faults: tuple[str, ...] = tuple(FAULTS)
    instances: int = 4
    trajectories: int = 48
    """Live trajectories of the trainer."""
    converge_timeout: float = 180.0
    switch_wait: float = 30.0
    """How long a mid-switch fault waits for the round's switch to be in flight."""
    out: Path = Path("bench-out/chaos")

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError("--rounds must be >= 1")
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown or not self.faults:
            raise ValueError(f"unknown faults {unknown} (known: {', '.join(FAULTS)})")
        if not 3 <= self.instances <= 8:
            # Each round forces a switch by moving roles.*.min: prefill >= 2 and
            # decode >= 1 need three engines.
            raise ValueError("--instances must be between 3 and 8")
        if self.trajectories < 1:
            raise ValueError("--trajectories must be >= 1")
        if not (self.converge_timeout > 0 and self.switch_wait >= 0):
            raise ValueError("--converge-timeout must be > 0 and --switch-wait >= 0")


@dataclass
class Round:
    index: int
    fault: str
    detail: dict[str, Any]
    converged: bool
    fault_seconds: float  # injection until the fault's course ended (restarts included)
    converge_seconds: float | None  # from then until every check held
    split: str = ""
    problems: list[str] = field(default_factory=list)


@dataclass
class ChaosSummary:
    command: str
    date: str
    machine: str
    seed: int
    seconds: float
    rounds: list[Round]
    trainer: dict[str, Any]
    operator: dict[str, Any]
    router: str

    @property
    def converged(self) -> int:
        return sum(1 for r in self.rounds if r.converged)

    @property
    def ok(self) -> bool:
        t = self.trainer
        return (
            self.converged == len(self.rounds)
            and t["tokensLost"] == 0
            and t["requestsFailed"] == 0
            and t["requestsCompleted"] == t["requestsSent"]
            and t["eventsDropped"] == 0
            and t["eventsPending"] == 0
        )

    def converge_times(self) -> dict[str, float | None]:
        times = sorted(r.converge_seconds for r in self.rounds if r.converge_seconds is not None)
        if not times:
            return {"median": None, "p90": None, "max": None}
        p90 = times[min(len(times) - 1, math.ceil(0.9 * len(times)) - 1)]
        return {
            "median": round(statistics.median(times), 1),
            "p90": round(p90, 1),
            "max": round(times[-1], 1),
        }

    def wire(self) -> dict[str, Any]:
        by_fault: dict[str, dict[str, int]] = {}
        for r in self.rounds:
            entry = by_fault.setdefault(r.fault, {"rounds": 0, "converged": 0, "midSwitch": 0})
            entry["rounds"] += 1
            entry["converged"] += r.converged
            entry["midSwitch"] += bool(r.detail.get("midSwitch"))
        return asdict(self) | {
            "roundsRun": len(self.rounds),
            "roundsConverged": self.converged,
            "convergeSeconds": self.converge_times(),
            "byFault": by_fault,
            "ok": self.ok,
        }

    def lines(self) -> list[str]:
        t, times = self.trainer, self.converge_times()
        faults = Counter(r.fault for r in self.rounds)
        out = [
            f"prorsa bench chaos: {self.converged}/{len(self.rounds)} rounds converged in "
            f"{self.seconds:.0f} s (seed {self.seed}): {'OK' if self.ok else 'FAILED'}",
            "  faults      " + ", ".join(f"{n} {f}" for f, n in sorted(faults.items())),
            f"  converged   median {times['median']} s, p90 {times['p90']} s, max "
            f"{times['max']} s after each fault's course ended",
            f"  trainer     {t['requestsSent']} requests, {t['requestsCompleted']} completed, "
            f"{t['requestsFailed']} failed, {t['resumes']} resumes; tokens lost "
            f"{t['tokensLost']} of {t['tokensGenerated']:,}",
            f"  events      {t['eventsEmitted']:,} emitted, {t['eventsDelivered']:,} delivered, "
            f"{t['eventsDropped']} dropped, {t['eventsPending']} pending; {t['resyncs']} resyncs",
            f"  operator    {self.operator['leaseTransitions']} leader changes, replicas started "
            f"{self.operator['starts']}; router {self.router}",
        ]
        unfinished = t["requestsSent"] - t["requestsCompleted"] - t["requestsFailed"]
        if unfinished:
            out.append(
                f"  UNFINISHED  {unfinished} trainer requests had no answer when the run ended"
            )
        for r in self.rounds:
            if not r.converged:
                out.append(f"  NOT CONVERGED round {r.index} {r.fault}: {'; '.join(r.problems)}")
        return out


@contextlib.contextmanager
def _log_to(path: Path) -> Iterator[None]:
    """Every component's log records to ``path``, none to the terminal."""
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    chatty = logging.getLogger("httpx")
    level = chatty.level
    chatty.setLevel(logging.WARNING)
    try:
        yield
    finally:
        handler.close()
        root.handlers = saved[1]
        root.setLevel(saved[0])
        chatty.setLevel(level)


def _utc(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _problems(ctx: ChaosContext, *, since: float, instances: int) -> list[str]:
    """What keeps the deployment from having converged (nothing: it has)."""
    env, out = ctx.env, []
    pods = [p for p in await env.pods(ctx.cluster) if not p["metadata"].get("deletionTimestamp")]
    if len(pods) != instances:
        out.append(f"{len(pods)} engine pods, want {instances}")
    counts: Counter[str] = Counter()
    want_routes: dict[str, str] = {}
    for pod in pods:
        meta = pod["metadata"]
        name = meta["name"]
        role = (meta.get("labels") or {}).get(ROLE_LABEL, "")
        status = pod.get("status") or {}
        if status.get("phase") != "Running" or not status.get("podIP"):
            out.append(f"{name} not running")
            continue
        if role == DRAINING:
            out.append(f"{name} draining")
        if SWITCH_ANNOTATION in (meta.get("annotations") or {}):
            out.append(f"{name} has a switch intent")
        runtime = env.kubelet.pods.get(name)
        try:
            engine_role = None if runtime is None else runtime.engine.role
            unhealthy = runtime is None or runtime.engine.unhealthy
        except RuntimeError:  # restarting
            engine_role, unhealthy = None, True
        if unhealthy:
            out.append(f"{name}: engine not healthy")
        elif engine_role != role:
            out.append(f"{name} labelled {role or '(none)'}, its engine is {engine_role}")
        counts[role] += 1
        if (meta.get("labels") or {}).get(NODE_RANK_LABEL, "0") == "0":
            want_routes[status["podIP"]] = role
    cluster = await env.get_cluster(ctx.cluster)
    roles = cluster["spec"]["roles"]
    for role in ("prefill", "decode"):
        low = int(roles[role].get("min", 1))
        if counts[role] < low:
            out.append(f"{counts[role]} {role}, roles.{role}.min is {low}")
    router = env.kubelet.router
    if router is not None:
        async with httpx.AsyncClient(trust_env=False) as client:
            workers = await router.workers(client)
        routes = {
            str(w.get("url", "")).split("://", 1)[-1].rsplit(":", 1)[0]: w.get("worker_type")
            for w in workers or []
        }
        if routes != want_routes:
            out.append(f"smg routes {routes}, pods say {want_routes}")
    elif env.router_url:
        out.append("smg is not running")
    leader = await ctx.lease_holder()
    if leader is None:
        out.append("no live replica holds the Lease")
    elif not await env._webhook_up():
        out.append(f"{leader.pod} leads, its webhook does not answer")
    status = cluster.get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    at = str((status.get("target") or {}).get("at") or "")
    if at <= _utc(since):
        out.append("no status written by a tick since the fault")
    elif status.get("phase") != "Running" or conditions.get("Degraded") != "False":
        out.append(f"status phase {status.get('phase')}, Degraded {conditions.get('Degraded')}")
    elif conditions.get("Switching") != "False":
        out.append("status says Switching")
    if status.get("observedGeneration") != cluster["metadata"].get("generation"):
        out.append("status does not observe the spec's generation")
    return out


async def _converge(
    ctx: ChaosContext, *, since: float, instances: int, timeout: float
) -> tuple[bool, float, list[str]]:
    """Poll until every check holds; (converged, seconds, the last problems)."""
    start = time.monotonic()
    problems: list[str] = []
    while time.monotonic() - start < timeout:
        try:
            problems = await _problems(ctx, since=since, instances=instances)
        except Exception as exc:  # an API call refused while things restart: not yet
            problems = [f"{type(exc).__name__}: {exc}"[:200]]
        if not problems:
            return True, time.monotonic() - start, []
        await asyncio.sleep(0.25)
    return False, time.monotonic() - start, problems


async def _force_switch(env: Stack, instances: int) -> str:
    """Move ``roles.*.min`` so that the split must change (and one switch starts now)."""
    counts = await env.count_roles(CLUSTER)
    if counts.get("prefill", 0) <= 1:
        roles = {"prefill": {"min": 2, "initial": 2}, "decode": {"min": 1}}
        wanted = "prefill >= 2"
    else:
        roles = {"prefill": {"min": 1, "initial": 1}, "decode": {"min": instances - 1}}
        wanted = f"decode >= {instances - 1}"
    await env.patch_cluster(CLUSTER, {"spec": {"roles": roles}})
    return wanted


def _split(roles: dict[str, str]) -> str:
    counts = Counter(roles.values())
    return f"{counts.get('prefill', 0)}P:{counts.get('decode', 0)}D"


def chaos_manifest(options: ChaosOptions) -> dict[str, Any]:
    """The demo's RolloutCluster (its engine model's capacity and time scale)."""
    return demo_manifest(DemoOptions(instances=options.instances, out=options.out))


async def run_chaos(options: ChaosOptions, *, stream: TextIO = sys.stdout) -> ChaosSummary:
    out = options.out
    out.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    binary = smg_binary()
    if binary is None:
        raise RuntimeError("the smg router is not installed: pip install 'smg==1.13.0'")
    with _log_to(out / "chaos.log"):
        summary = await _run(options, say=say, router=f"smg {smg_version(binary) or '?'}")
    (out / "summary.json").write_text(json.dumps(summary.wire(), indent=2) + "\n")
    for line in summary.lines():
        say(line)
    return summary


async def _run(options: ChaosOptions, *, say: Any, router: str) -> ChaosSummary:
    rng = random.Random(options.seed)
    started = time.monotonic()
    model = EngineModel()
    config = model.engine_config()
    out = options.out
    say(
        f"prorsa bench chaos: {options.rounds} rounds, seed {options.seed}, faults "
        f"{', '.join(options.faults)}; logs in {out}"
    )
    async with stack(
        engine_config=lambda _name: config,
        tick_seconds=model.tick_seconds,
        agent_timeouts=model.agent_timeouts(),
        run_router=True,
        log_dir=out,
        operator_namespace=OPERATOR_NS,
        leader_election=ELECTION,
        start_operator=False,
    ) as env:
        token_file = out / "trainer-token"
        token_file.write_text(env.token)
        replicas = [Replica(pod=name, env=env, log_dir=out) for name in REPLICAS]
        ctx = ChaosContext(
            env=env,
            cluster=CLUSTER,
            replicas=replicas,
            token_file=token_file,
            rng=rng,
            switch_wait=options.switch_wait,
        )
        supervisor: asyncio.Task[None] | None = None
        try:
            for replica in replicas:
                await env.create_operator_pod(replica.pod)
                await replica.start()
            supervisor = asyncio.create_task(supervise(replicas))
            await env.create_cluster(chaos_manifest(options))
            say("  starting: two operator replicas, the engine pods, smg...")
            ok, _seconds, problems = await _converge(
                ctx, since=time.time(), instances=options.instances, timeout=240
            )
            if not ok:
                raise RuntimeError(f"the deployment did not come up: {'; '.join(problems)}")
            say(f"  up in {time.monotonic() - started:.0f} s: {_split(await env.roles(CLUSTER))}")
            return await _rounds(options, ctx, rng=rng, say=say, router=router, started=started)
        finally:
            if supervisor is not None:
                supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await supervisor
            for replica in replicas:
                await replica.stop()


async def _rounds(
    options: ChaosOptions,
    ctx: ChaosContext,
    *,
    rng: random.Random,
    say: Any,
    router: str,
    started: float,
) -> ChaosSummary:
    env = ctx.env
    assert env.router_url is not None
    manifest = chaos_manifest(options)["spec"]["model"]
    served = manifest.get("servedName") or manifest["path"]
    emitter = AsyncEventEmitter(
        url=env.webhook,
        namespace=env.namespace,
        name=CLUSTER,
        token_file=str(ctx.token_file),
        track=True,
        give_up_after=600,
    )
    smg = SmgClient(url=env.router_url, model=served, emitter=emitter, incremental=True)
    rounds: list[Round] = []
    async with (
        emitter,
        httpx.AsyncClient(transport=smg, base_url=env.router_url, timeout=600) as http,
    ):
        trainer = DemoTrainer(
            task=DEMO_TASKS["coding"],
            schedule=PhaseSchedule(seconds=10.0),
            emitter=emitter,
            router=http,
            concurrency=options.trajectories,
            seed=options.seed,
            max_retries=10,
        )
        running = asyncio.create_task(trainer.run(duration=1e9))  # until stop()
        try:
            await _each_round(
                options,
                ctx,
                rng=rng,
                say=say,
                started=started,
                trainer=trainer,
                emitter=emitter,
                rounds=rounds,
            )
        finally:
            trainer.stop()
            try:
                await asyncio.wait_for(running, 300)
            except TimeoutError:
                log.error("the trainer's last requests did not finish within 300 s")
        flushed = await emitter.flush(timeout=120)
        stats = await emitter.aclose(timeout=30)
        await smg.aclose()
    lease = await env.kube.read_lease(OPERATOR_NS, ELECTION.lease_name)
    t = trainer.stats
    return ChaosSummary(
        command=_command(options),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        machine=machine(),
        seed=options.seed,
        seconds=round(time.monotonic() - started, 1),
        rounds=rounds,
        trainer={
            "requestsSent": len(t.requests),
            "requestsCompleted": t.completed,
            "requestsFailed": t.failed,
            "resumes": t.resumes,
            "tokensLost": t.tokens_lost,
            "tokensGenerated": t.tokens_generated,
            "trajectories": t.started,
            "eventsEmitted": stats.emitted,
            "eventsDelivered": stats.sent,
            "eventsDropped": stats.dropped,
            "eventsPending": stats.pending,
            "flushed": flushed,
            "resyncs": stats.resyncs,
            # The requests that went wrong, for the report (the first few).
            "wrongAnswers": [r.wire() for r in t.requests if r.lost or r.error][:10],
        },
        operator={
            "leaseTransitions": int(((lease or {}).get("spec") or {}).get("leaseTransitions") or 0),
            "starts": {r.pod: r.starts for r in ctx.replicas},
        },
        router=router,
    )


async def _each_round(
    options: ChaosOptions,
    ctx: ChaosContext,
    *,
    rng: random.Random,
    say: Any,
    started: float,
    trainer: DemoTrainer,
    emitter: AsyncEventEmitter,
    rounds: list[Round],
) -> None:
    env = ctx.env
    order: list[str] = []
    for index in range(1, options.rounds + 1):
        if not order:
            order = list(options.faults)
            rng.shuffle(order)
        name = order.pop()
        wanted = await _force_switch(env, options.instances)
        since = time.time()
        t0 = time.monotonic()
        detail = await FAULTS[name](ctx)
        fault_seconds = time.monotonic() - t0
        converged, seconds, problems = await _converge(
            ctx, since=since, instances=options.instances, timeout=options.converge_timeout
        )
        split = _split(await env.roles(CLUSTER))
        rounds.append(
            Round(
                index=index,
                fault=name,
                detail=detail | {"forced": wanted},
                converged=converged,
                fault_seconds=round(fault_seconds, 1),
                converge_seconds=round(seconds, 1) if converged else None,
                split=split,
                problems=problems,
            )
        )
        stats = emitter.stats
        verdict = f"converged in {seconds:.1f} s" if converged else "NOT CONVERGED"
        say(
            f"  round {index}/{options.rounds} {name} {describe(detail)}: {verdict}, "
            f"{split}; trainer {trainer.stats.completed} requests done, "
            f"{trainer.stats.tokens_lost} tokens lost, {stats.sent}/{stats.emitted} "
            f"events delivered ({time.monotonic() - started:.0f} s)"
        )
        if not converged:
            say(f"    still wrong: {'; '.join(problems)}")


def _command(options: ChaosOptions) -> str:
    parts = ["prorsa bench chaos", f"--rounds {options.rounds}", f"--seed {options.seed}"]
    if set(options.faults) != set(FAULTS):
        parts.append(f"--faults {','.join(options.faults)}")
    return " ".join(parts)


# -- the command ----------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    d = ChaosOptions()
    parser.add_argument("--rounds", type=int, default=d.rounds, help=f"[{d.rounds}]")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"[{d.seed}]")
    parser.add_argument(
        "--faults",
        default=",".join(d.faults),
        help=f"comma-separated, drawn in a seeded shuffle [{','.join(d.faults)}]",
    )
    parser.add_argument("--instances", type=int, default=d.instances, help=f"[{d.instances}]")
    parser.add_argument(
        "--trajectories",
        type=int,
        default=d.trajectories,
        help=f"the trainer's live trajectories [{d.trajectories}]",
    )
    parser.add_argument(
        "--converge-timeout",
        type=float,
        default=d.converge_timeout,
        help=f"seconds a round may take to converge [{d.converge_timeout:g}]",
    )
    parser.add_argument(
        "--out", type=Path, default=d.out, help=f"logs and summary.json go here [{d.out}]"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        options = ChaosOptions(
            rounds=args.rounds,
            seed=args.seed,
            faults=tuple(f.strip() for f in args.faults.split(",") if f.strip()),
            instances=args.instances,
            trajectories=args.trajectories,
            converge_timeout=args.converge_timeout,
            out=args.out,
        )
    except ValueError as exc:
        print(f"prorsa bench chaos: error: {exc}", file=sys.stderr)
        return 2
    stream = sys.stderr if args.json else sys.stdout
    summary = asyncio.run(run_chaos(options, stream=stream))
    if args.json:
        print(json.dumps(summary.wire(), indent=2))
    return 0 if summary.ok else 1


__all__ = ["ChaosOptions", "ChaosSummary", "chaos_manifest", "run_chaos"]
