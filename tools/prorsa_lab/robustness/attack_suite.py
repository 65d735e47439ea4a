"""``prorsa bench attack``: hostile requests against the trainer webhook and the agent,
with a legitimate trainer posting throughout, counted (docs/security.md#attack-and-chaos).

The webhook is the application the operator serves on the trainers' port
(``WebhookServer.trainer_app``), with the real Controller behind each cluster and the
operator's limits (``IngestLimits``; the deadlines can be shortened for short runs), in a
process of its own on loopback so that its peak RSS is its own. It serves two clusters:
``rl/c``, where a legitimate trainer (the SDK's ``AsyncEventEmitter``, named emitter,
token read from a file) posts a steady lifecycle stream, and ``rl/noisy``, a neighbour
whose token the attacker holds. The attacker draws hostile requests by kind
(:mod:`prorsa_lab.robustness.webhook_attacks`), seeded, and sends each on a connection of
its own, ``--concurrency`` at a time (stalled ones in a pool of their own). ``c``'s token
is rotated twice during the run; the trainer's file follows a moment later, as a kubelet
refreshes a mounted Secret.

Then the agent: a real in-pod agent in front of the engine double, in a process of its
own, gets its hostile requests (:mod:`prorsa_lab.robustness.agent_attacks`) with real
switches among them.

Counted: requests tried, replies by status (and by kind), 5xx (must be 0), outcomes the
contract does not allow (must be 0), events of the legitimate trainer lost (dropped by the
SDK, or accepted and not applied exactly once: must be 0), peak RSS of each server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import multiprocessing
import os
import platform
import random
import secrets
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from prorsa_lab.robustness import agent_attacks, webhook_attacks
from prorsa_lab.robustness.raw_http import Outcome, send
from prorsa_lab.robustness.webhook_attacks import (
    CLUSTER,
    LEGIT_PREFIX,
    NAMESPACE,
    NOISY,
    Attack,
    Kind,
    WebhookTarget,
)

HELP = "hostile requests against the webhook and the agent, with a trainer posting throughout"

NOISY_LIMIT = 5000  # the neighbour's spec.trainer.maxLiveTrajectories
LEGIT_EMITTER = "legit-trainer-0"
MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class AttackOptions:
    requests: int = 2500
    """Hostile requests to the webhook."""
    agent_requests: int | None = None
    """Hostile requests to the agent (default: a fifth of ``requests``; 0: none)."""
    seed: int = 1
    concurrency: int = 16
    """Requests in flight at once (a burst's go together)."""
    stalled: int = 32
    """Stalled connections held at once (slowloris)."""
    header_timeout: float | None = None
    """The webhook's and the agent's header deadline (default: theirs, 30 s)."""
    body_timeout: float | None = None
    """The webhook's body deadline (default 60 s) and the agent's (default 10 s)."""
    legit_rate: float = 300.0
    """Events per second of the legitimate trainer."""

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("--requests must be >= 1")
        if self.agent_requests is not None and self.agent_requests < 0:
            raise ValueError("--agent-requests must be >= 0")
        if self.concurrency < 1 or self.stalled < 1:
            raise ValueError("--concurrency and --stalled must be >= 1")
        for name in ("header_timeout", "body_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if not self.legit_rate > 0:
            raise ValueError("--legit-rate must be > 0")

    @property
    def agent_count(self) -> int:
        return self.requests // 5 if self.agent_requests is None else self.agent_requests


# -- the servers, each in a process of its own ------------------------------------------------


def _memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak RSS) of a process, in MiB, as the kernel counts them."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def _quiet() -> None:
    """Bad HTTP is what the suite sends: aiohttp logs a traceback for each request it
    cannot parse. Keep the servers' own warnings."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)


def _webhook_process(conn: Any, config: dict[str, Any]) -> None:
    from prorsa.shell.gc_tuning import tune_gc

    _quiet()
    tune_gc()  # as `prorsa operator` runs
    asyncio.run(_webhook_main(conn, config))


async def _webhook_main(conn: Any, config: dict[str, Any]) -> None:
    from aiohttp import web

    from prorsa.clusters import ClusterRegistry, IngestLimits
    from prorsa.core.controller import Controller
    from prorsa.core.spec import parse_cluster
    from prorsa.ingest import WebhookServer

    def spec(name: str, **trainer: Any) -> Any:
        return parse_cluster(
            {
                "apiVersion": "prorsa.io/v1alpha1",
                "kind": "RolloutCluster",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"model": {"path": "/m"}, "gpuBudget": 32, "trainer": trainer},
            }
        ).spec

    deadlines = {k: v for k, v in config["deadlines"].items() if v is not None}
    registry = ClusterRegistry(limits=IngestLimits(**deadlines))
    # resync=False: a new cluster and trainer (the trainer posts its own snapshot at start).
    c = registry.add(
        namespace=NAMESPACE,
        name=CLUSTER,
        token=config["token"],
        controller=Controller(spec(CLUSTER)),
        resync=False,
    )
    noisy = registry.add(
        namespace=NAMESPACE,
        name=NOISY,
        token=config["noisy_token"],
        controller=Controller(spec(NOISY, maxLiveTrajectories=NOISY_LIMIT)),
    )
    applied: Counter[str] = Counter()

    def count(events: Any) -> None:  # may run in a worker thread: Counter under the GIL
        for e in events:
            trajectory = getattr(e, "trajectory", None)
            if trajectory is not None and trajectory.startswith(LEGIT_PREFIX):
                applied[e.id] += 1

    c.on_applied = count
    server = WebhookServer(registry)
    runner = server.runner(server.trainer_app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    tick_errors: list[str] = []

    async def ticker() -> None:  # the operator ticks each cluster every horizon
        while True:
            await asyncio.sleep(1.0)
            for handle in (c, noisy):
                try:
                    await handle.tick()
                except Exception as exc:
                    tick_errors.append(repr(exc))

    ticking = asyncio.create_task(ticker())
    conn.send({"port": port, "pid": os.getpid()})
    loop = asyncio.get_running_loop()
    while True:
        message = await loop.run_in_executor(None, conn.recv)
        if message[0] == "rotate":
            c.set_token(message[1])
            conn.send(True)
        elif message[0] == "report":
            conn.send(
                {
                    "applied": dict(applied),
                    "clusters": {
                        h.name: h.status() | {"limitHits": h.limit_hits} for h in (c, noisy)
                    },
                    "inflightBytes": server.inflight_bytes,
                    "rejects": {
                        s.labels["reason"]: s.value
                        for m in server.metrics.registry.collect()
                        if m.name == "prorsa_webhook_rejects"
                        for s in m.samples
                        if s.name.endswith("_total")
                    },
                    "tickErrors": tick_errors[:10],
                }
            )
        else:
            break
    ticking.cancel()
    await runner.cleanup()


def _agent_process(conn: Any, config: dict[str, Any]) -> None:
    _quiet()
    asyncio.run(_agent_main(conn, config))


async def _agent_main(conn: Any, config: dict[str, Any]) -> None:
    from dataclasses import replace

    from prorsa_lab.doubles.sglang_double import FAST_TIMEOUTS, EnginePod

    deadlines = {k: v for k, v in config["deadlines"].items() if v is not None}
    timeouts = replace(FAST_TIMEOUTS, **deadlines)
    async with EnginePod(
        instance="attack-engine-0", token=config["token"], timeouts=timeouts
    ) as pod:
        conn.send({"url": pod.agent_url, "pid": os.getpid()})
        loop = asyncio.get_running_loop()
        while True:
            message = await loop.run_in_executor(None, conn.recv)
            if message[0] != "report":
                break
            async with httpx.AsyncClient(timeout=10) as client:
                state = (await client.get(f"{pod.agent_url}/v1/state")).json()
            conn.send({"state": state, "engineRole": pod.double.role})


@contextlib.contextmanager
def _process(target: Callable[..., None], config: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, config), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while not parent.poll(0.2):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server process did not start (exit code {proc.exitcode})")
        yield parent, parent.recv()
    finally:
        with contextlib.suppress(OSError, BrokenPipeError):
            parent.send(("stop",))
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


async def _ask(conn: Any, *message: Any) -> Any:
    def call() -> Any:
        conn.send(message)
        if not conn.poll(120):
            raise RuntimeError(f"no answer to {message[0]!r} within 120 s")
        return conn.recv()

    return await asyncio.to_thread(call)


# -- the legitimate trainer -----------------------------------------------------------------


class CapturingTransport(httpx.AsyncBaseTransport):
    """The trainer's HTTP transport: counts its replies by status and keeps the batches it
    got accepted, which the attacker replays (as one who captured them would)."""

    def __init__(self, target: WebhookTarget) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.target = target
        self.statuses: Counter[str] = Counter()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await self._inner.handle_async_request(request)
        except httpx.TransportError as exc:
            self.statuses[type(exc).__name__] += 1
            raise
        self.statuses[str(response.status_code)] += 1
        if response.status_code == 200 and request.url.path.endswith("/events"):
            headers = tuple(
                (k, v)
                for k, v in request.headers.items()
                if k.lower().startswith(("x-", "content-t"))
            )
            self.target.captured.append((request.content, headers))
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class LegitTrainer:
    """Agentic trajectories through their whole lifecycle at ``rate`` events/s; every
    event id it emits is kept, to be found applied exactly once."""

    def __init__(self, emitter: Any, *, rate: float, seed: int, live: int = 100) -> None:
        self.emitter = emitter
        self.rate = rate
        self.rng = random.Random(seed)
        self.live_target = live
        self.ids: list[str] = []
        self._live: dict[str, Iterator[str]] = {}
        self._serial = itertools.count()

    def _lifecycle(self, tid: str) -> Iterator[str]:
        em, rng = self.emitter, self.rng
        context = rng.randint(200, 4000)
        yield em.sample_dispatched(
            tid, group=f"g{rng.randrange(50)}", task="attack", prompt_tokens=context
        )
        turns = rng.randint(1, 3)
        for turn in range(turns):
            yield em.request_queued(tid, prompt_tokens=context, turn=turn)
            yield em.prefill_finished(tid)
            out = rng.randint(50, 600)
            last = turn == turns - 1
            yield em.decode_finished(tid, output_tokens=out, finish="stop" if last else "tool")
            context += out
            if not last:
                yield em.tool_started(tid, tool="bash")
                result = rng.randint(10, 300)
                yield em.tool_finished(tid, result_tokens=result)
                context += result
        yield em.reward_started(tid)
        yield em.reward_finished(tid, accepted=rng.random() < 0.5)

    def step(self) -> None:
        while len(self._live) < self.live_target:
            tid = f"{LEGIT_PREFIX}{next(self._serial)}"
            self._live[tid] = self._lifecycle(tid)
        tid = self.rng.choice(list(self._live))
        try:
            self.ids.append(next(self._live[tid]))
        except StopIteration:
            del self._live[tid]

    async def start(self) -> None:
        """One trajectory's first event, then wait for the emitter's start snapshot (a named
        emitter posts it after its first batch): every event emitted from then on is
        stamped after it, so none is superseded, each must be applied."""
        tid = f"{LEGIT_PREFIX}{next(self._serial)}"
        self._live[tid] = self._lifecycle(tid)
        self.ids.append(next(self._live[tid]))
        deadline = time.monotonic() + 120
        while self.emitter.stats.resyncs < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the trainer's start snapshot was not accepted in 120 s")
            await asyncio.sleep(0.05)

    async def run(self, stop: asyncio.Event) -> None:
        period = 0.02
        per_tick = max(1, round(self.rate * period))
        while not stop.is_set():
            for _ in range(per_tick):
                self.step()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period)
        for tid in list(self._live):  # the run ends: what is left is dropped, and said so
            self.ids.append(self.emitter.trajectory_dropped(tid, reason="attack run ended"))
        self._live.clear()


# -- the attack ---------------------------------------------------------------------------------


@dataclass
class Tally:
    """Outcomes of one suite's hostile requests."""

    tried: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    unexpected: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    slowest: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for label, n in self.by_status.items() if label[:1] == "5")

    def record(self, attack: Attack, outcome: Outcome, *, rotated: bool) -> None:
        self.tried += 1
        label = outcome.label
        self.by_status[label] += 1
        self.by_kind.setdefault(attack.kind, Counter())[label] += 1
        self.slowest = max(self.slowest, outcome.seconds)
        problem = None
        if label not in attack.expect and not (label == "401" and rotated):
            problem = f"{label} not in {sorted(attack.expect)}"
        elif attack.check is not None:
            problem = attack.check(outcome)
        if label[:1] == "5" and problem is None:
            problem = f"a {label}"
        if problem is not None:
            self.unexpected += 1
            if len(self.examples) < 25:
                self.examples.append(
                    {
                        "kind": attack.kind,
                        "outcome": label,
                        "problem": problem,
                        "body": outcome.body[:300].decode("utf-8", "replace"),
                        "request": attack.request.pieces[0][:200].decode("latin-1"),
                    }
                )

    def wire(self) -> dict[str, Any]:
        return {
            "tried": self.tried,
            "byStatus": dict(sorted(self.by_status.items())),
            "byKind": {k: dict(sorted(v.items())) for k, v in sorted(self.by_kind.items())},
            "serverErrors": self.server_errors,
            "unexpected": self.unexpected,
            "unexpectedExamples": self.examples,
            "slowestSeconds": round(self.slowest, 2),
        }


async def _hostile(
    *,
    kinds: dict[str, Kind],
    stalled_kinds: frozenset[str],
    target: Any,
    host: str,
    port: int,
    count: int,
    rng: random.Random,
    concurrency: int,
    stalled: int,
    deadline: float,
    tally: Tally,
    rotations: Callable[[], tuple[int, int]],
    on_progress: Callable[[], None],
) -> None:
    """Draw ``count`` hostile requests by kind and weight and send them, a burst at once,
    through two pools of workers: ``concurrency`` for the quick, ``stalled`` for the
    connections held on purpose. ``rotations`` says how many token rotations have started
    and ended: a 401 to a request built during one, or before one that began while it
    was in flight, carried a token that was rotated out (allowed)."""
    plan: list[tuple[str, int, int]] = []  # kind, seed, how many at once
    names = list(kinds)
    weights = [kinds[n].weight for n in names]
    planned = 0
    while planned < count:
        name = rng.choices(names, weights=weights)[0]
        low, high = kinds[name].burst
        n = min(rng.randint(low, high), count - planned)
        plan.append((name, rng.getrandbits(32), n))
        planned += n
    quick: asyncio.Queue[tuple[str, int, int]] = asyncio.Queue()
    held: asyncio.Queue[tuple[str, int, int]] = asyncio.Queue()
    for item in plan:
        (held if item[0] in stalled_kinds else quick).put_nowait(item)

    async def one(attack: Attack, built: tuple[int, int]) -> None:
        outcome = await send(host, port, attack.request, deadline=deadline)
        started, _ = rotations()
        rotated = built[0] != built[1] or started != built[0]
        tally.record(attack, outcome, rotated=rotated)
        on_progress()

    async def worker(queue: asyncio.Queue[tuple[str, int, int]]) -> None:
        while not queue.empty():
            name, seed, n = queue.get_nowait()
            build = random.Random(seed)
            built = rotations()
            attacks = [kinds[name].build(target, build) for _ in range(n)]
            await asyncio.gather(*(one(a, built) for a in attacks))

    workers = [worker(quick) for _ in range(concurrency)]
    workers += [worker(held) for _ in range(min(stalled, held.qsize()))]
    await asyncio.gather(*workers)


@dataclass
class AttackSummary:
    command: str
    date: str
    machine: str
    seed: int
    seconds: float
    webhook: dict[str, Any]
    agent: dict[str, Any]
    legit: dict[str, Any]
    server: dict[str, Any]
    limits: dict[str, Any]

    @property
    def requests_tried(self) -> int:
        return int(self.webhook["tried"]) + int(self.agent.get("tried", 0))

    @property
    def server_errors(self) -> int:
        return (
            int(self.webhook["serverErrors"])
            + int(self.agent.get("serverErrors", 0))
            + int(self.legit["serverErrors"])
        )

    @property
    def unexpected(self) -> int:
        return int(self.webhook["unexpected"]) + int(self.agent.get("unexpected", 0))

    @property
    def events_lost(self) -> int:
        return int(self.legit["lost"])

    @property
    def ok(self) -> bool:
        return (
            self.server_errors == 0
            and self.unexpected == 0
            and self.events_lost == 0
            and not self.server.get("tickErrors")
            and self.agent.get("consistent", True)
        )

    def wire(self) -> dict[str, Any]:
        return asdict(self) | {
            "requestsTried": self.requests_tried,
            "serverErrors": self.server_errors,
            "unexpected": self.unexpected,
            "eventsLost": self.events_lost,
            "ok": self.ok,
        }

    def lines(self) -> list[str]:
        w, a, lg, s = self.webhook, self.agent, self.legit, self.server
        statuses = ", ".join(f"{k} {v}" for k, v in w["byStatus"].items())
        out = [
            f"prorsa bench attack: {self.requests_tried} hostile requests in {self.seconds:.0f} s "
            f"(seed {self.seed}), {self.server_errors} 5xx, {self.unexpected} unexpected, "
            f"{self.events_lost} events lost: {'OK' if self.ok else 'FAILED'}",
            f"  webhook   {w['tried']} requests: {statuses}",
            f"  trainer   {lg['emitted']} events emitted, {lg['sent']} delivered, "
            f"{lg['appliedOnce']} applied exactly once, {lg['missing']} missing, "
            f"{lg['appliedTwice']} applied twice, {lg['dropped']} dropped; replies "
            + ", ".join(f"{k} {v}" for k, v in sorted(lg["statuses"].items())),
            f"  memory    webhook peak RSS {s['peakRssMiB']:.0f} MiB"
            + (f", agent {a['peakRssMiB']:.0f} MiB" if a.get("peakRssMiB") else ""),
        ]
        if a.get("tried"):
            agent_statuses = ", ".join(f"{k} {v}" for k, v in a["byStatus"].items())
            out.insert(
                2,
                f"  agent     {a['tried']} requests: {agent_statuses}; role "
                f"{a.get('role')} ({'agrees' if a.get('consistent') else 'DISAGREES'}"
                " with the engine)",
            )
        for example in [*w["unexpectedExamples"], *a.get("unexpectedExamples", [])][:10]:
            out.append(f"  UNEXPECTED {example['kind']}: {example['problem']}")
        return out


def machine() -> str:
    """This machine in a line, for the summaries (figures say where they came from)."""
    cpus = os.cpu_count() or 0
    python = platform.python_version()
    with contextlib.suppress(OSError, ValueError):
        mem = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
        return f"{platform.machine()}, {cpus} CPUs, {mem / (1 << 20):.0f} GiB, Python {python}"
    return f"{platform.machine()}, {cpus} CPUs, Python {python}"


async def run_attack(options: AttackOptions, *, stream: TextIO = sys.stdout) -> AttackSummary:
    """Run both suites; the summary says what came back and what was lost."""
    rng = random.Random(options.seed)
    started = time.monotonic()
    deadlines = {
        "header_timeout_seconds": options.header_timeout,
        "body_timeout_seconds": options.body_timeout,
    }
    from prorsa.clusters import IngestLimits

    default = IngestLimits()
    limits = IngestLimits(
        header_timeout_seconds=options.header_timeout or default.header_timeout_seconds,
        body_timeout_seconds=options.body_timeout or default.body_timeout_seconds,
    )
    tokens = [secrets.token_urlsafe(32) for _ in range(4)]
    config = {"token": tokens[0], "noisy_token": tokens[3], "deadlines": deadlines}

    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    say(
        f"prorsa bench attack: {options.requests} requests to the webhook, "
        f"{options.agent_count} to the agent, seed {options.seed}"
    )
    with (
        tempfile.TemporaryDirectory(prefix="prorsa-attack-") as tmp,
        _process(_webhook_process, config) as (conn, hello),
    ):
        port, pid = hello["port"], hello["pid"]
        url = f"http://127.0.0.1:{port}"
        target = WebhookTarget(
            host="127.0.0.1",
            port=port,
            token=tokens[0],
            noisy_token=tokens[3],
            header_timeout=limits.header_timeout_seconds,
            body_timeout=limits.body_timeout_seconds,
        )
        token_file = Path(tmp) / "token"
        token_file.write_text(tokens[0])
        transport = CapturingTransport(target)
        from prorsa_sdk import AsyncEventEmitter

        emitter = AsyncEventEmitter(
            url=url,
            namespace=NAMESPACE,
            name=CLUSTER,
            token_file=str(token_file),
            emitter_id=LEGIT_EMITTER,
            track=True,
            transport=transport,
            flush_interval=0.05,
            batch_size=200,
            give_up_after=300,
        )
        await asyncio.to_thread(target.prepare)
        trainer = LegitTrainer(emitter, rate=options.legit_rate, seed=options.seed)
        await trainer.start()
        stop = asyncio.Event()
        trainer_task = asyncio.create_task(trainer.run(stop))
        tally = Tally()
        rotate_at = [options.requests // 3, 2 * options.requests // 3]
        rotating: list[asyncio.Task[None]] = []
        every = max(1, options.requests // 20)
        lag = random.Random(options.seed + 1)

        async def rotate(new: str) -> None:
            target.rotations_started += 1
            await _ask(conn, "rotate", new)
            target.retired.append(target.token)
            target.token = new
            target.rotations_done += 1
            # The trainer's mounted Secret follows after the kubelet's refresh.
            await asyncio.sleep(lag.uniform(0.2, 2.0))
            token_file.write_text(new)
            say(f"  token of {NAMESPACE}/{CLUSTER} rotated ({target.rotations_done} so far)")

        def progress() -> None:
            done = tally.tried
            if rotate_at and done >= rotate_at[0]:
                rotate_at.pop(0)
                new = tokens[len(rotating) + 1]
                rotating.append(asyncio.create_task(rotate(new)))
            if done % every == 0 or done == options.requests:
                stats = emitter.stats
                mem = _memory(pid)
                say(
                    f"  webhook {done}/{options.requests} ({time.monotonic() - started:.0f} s): "
                    f"5xx {tally.server_errors}, unexpected {tally.unexpected}; trainer "
                    f"{stats.emitted} emitted, {stats.sent} delivered, {stats.dropped} dropped; "
                    f"RSS {mem.get('VmRSS', 0):.0f} MiB"
                )

        deadline = limits.header_timeout_seconds + limits.body_timeout_seconds + 60
        await _hostile(
            kinds=webhook_attacks.KINDS,
            stalled_kinds=webhook_attacks.STALLED,
            target=target,
            host="127.0.0.1",
            port=port,
            count=options.requests,
            rng=rng,
            concurrency=options.concurrency,
            stalled=options.stalled,
            deadline=deadline,
            tally=tally,
            rotations=lambda: (target.rotations_started, target.rotations_done),
            on_progress=progress,
        )
        await asyncio.gather(*rotating)
        stop.set()
        await trainer_task
        flushed = await emitter.flush(timeout=120)
        stats = await emitter.aclose(timeout=30)
        await transport.aclose()
        report = await _ask(conn, "report")
        memory = _memory(pid)
    legit = _legit(trainer.ids, report["applied"], stats, transport.statuses, flushed)
    server = {
        "peakRssMiB": memory.get("VmHWM", 0.0),
        "rssMiB": memory.get("VmRSS", 0.0),
        "clusters": report["clusters"],
        "rejects": report["rejects"],
        "inflightBytesAtEnd": report["inflightBytes"],
        "tickErrors": report["tickErrors"],
    }
    agent: dict[str, Any] = {}
    if options.agent_count:
        agent = await _attack_agent(options, rng=rng, say=say, started=started)
    summary = AttackSummary(
        command=_command(options),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        machine=machine(),
        seed=options.seed,
        seconds=round(time.monotonic() - started, 1),
        webhook=tally.wire(),
        agent=agent,
        legit=legit,
        server=server,
        limits={
            "headerTimeoutSeconds": limits.header_timeout_seconds,
            "bodyTimeoutSeconds": limits.body_timeout_seconds,
            "maxBatchBytes": limits.max_batch_bytes,
            "maxSnapshotBytes": limits.max_snapshot_bytes,
            "noisyMaxLiveTrajectories": NOISY_LIMIT,
        },
    )
    for line in summary.lines():
        say(line)
    return summary


def _legit(
    ids: list[str],
    applied: dict[str, int],
    stats: Any,
    statuses: Counter[str],
    flushed: bool,
) -> dict[str, Any]:
    """The legitimate trainer's events: each one emitted must have been applied once."""
    once = sum(1 for i in ids if applied.get(i) == 1)
    missing = sum(1 for i in ids if i not in applied)
    twice = sum(1 for i in ids if applied.get(i, 0) > 1)
    strangers = len(set(applied) - set(ids))
    server_errors = sum(n for label, n in statuses.items() if label[:1] == "5")
    return {
        "emitted": int(stats.emitted),
        "sent": int(stats.sent),
        "dropped": int(stats.dropped),
        "pending": int(stats.pending),
        "resyncs": int(stats.resyncs),
        "flushed": flushed,
        "appliedOnce": once,
        "missing": missing,
        "appliedTwice": twice,
        "appliedNotEmitted": strangers,
        "statuses": dict(statuses),
        "serverErrors": server_errors,
        "lost": int(stats.dropped) + missing + twice + strangers,
    }


async def _attack_agent(
    options: AttackOptions, *, rng: random.Random, say: Callable[[str], None], started: float
) -> dict[str, Any]:
    from prorsa_agent.config import Timeouts

    defaults = Timeouts()
    deadlines = {"client_headers": options.header_timeout, "client_body": options.body_timeout}
    token = secrets.token_urlsafe(32)
    with _process(_agent_process, {"token": token, "deadlines": deadlines}) as (conn, hello):
        host, port = hello["url"].removeprefix("http://").rsplit(":", 1)
        target = agent_attacks.AgentTarget(
            host=host,
            port=int(port),
            token=token,
            header_timeout=options.header_timeout or defaults.client_headers,
            body_timeout=options.body_timeout or defaults.client_body,
        )
        tally = Tally()
        count = options.agent_count
        every = max(1, count // 10)

        def progress() -> None:
            if tally.tried % every == 0 or tally.tried == count:
                say(
                    f"  agent {tally.tried}/{count} ({time.monotonic() - started:.0f} s): "
                    f"5xx {tally.server_errors}, unexpected {tally.unexpected}"
                )

        await _hostile(
            kinds=agent_attacks.KINDS,
            stalled_kinds=agent_attacks.STALLED,
            target=target,
            host=target.host,
            port=target.port,
            count=count,
            rng=rng,
            concurrency=options.concurrency,
            stalled=options.stalled,
            deadline=target.header_timeout + target.body_timeout + 60,
            tally=tally,
            rotations=lambda: (0, 0),
            on_progress=progress,
        )
        report = await _ask(conn, "report")
        memory = _memory(hello["pid"])
    state = report["state"]
    consistent = (
        state.get("role") == report["engineRole"]
        and state.get("healthy") is True
        and not state.get("switching")
    )
    return tally.wire() | {
        "role": state.get("role"),
        "engineRole": report["engineRole"],
        "consistent": consistent,
        "peakRssMiB": memory.get("VmHWM", 0.0),
    }


def _command(options: AttackOptions) -> str:
    parts = ["prorsa bench attack", f"--requests {options.requests}", f"--seed {options.seed}"]
    if options.agent_requests is not None:
        parts.append(f"--agent-requests {options.agent_requests}")
    if options.header_timeout is not None:
        parts.append(f"--header-timeout {options.header_timeout:g}")
    if options.body_timeout is not None:
        parts.append(f"--body-timeout {options.body_timeout:g}")
    return " ".join(parts)


# -- the command ----------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    d = AttackOptions()
    parser.add_argument(
        "--requests",
        type=int,
        default=d.requests,
        help=f"hostile requests to the webhook [{d.requests}]",
    )
    parser.add_argument(
        "--agent-requests",
        type=int,
        default=None,
        help="hostile requests to the agent [a fifth of --requests]",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help=f"[{d.seed}]")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=d.concurrency,
        help=f"requests in flight at once [{d.concurrency}]",
    )
    parser.add_argument(
        "--stalled",
        type=int,
        default=d.stalled,
        help=f"stalled (slowloris) connections held at once [{d.stalled}]",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        help="the servers' header deadline, seconds [theirs: 30]",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        help="the servers' body deadline, seconds [theirs: webhook 60, agent 10]",
    )
    parser.add_argument(
        "--legit-rate",
        type=float,
        default=d.legit_rate,
        help=f"events/s of the legitimate trainer [{d.legit_rate:g}]",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")


def run(args: argparse.Namespace) -> int:
    try:
        options = AttackOptions(
            requests=args.requests,
            agent_requests=args.agent_requests,
            seed=args.seed,
            concurrency=args.concurrency,
            stalled=args.stalled,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            legit_rate=args.legit_rate,
        )
    except ValueError as exc:
        print(f"prorsa bench attack: error: {exc}", file=sys.stderr)
        return 2
    stream = sys.stderr if args.json else sys.stdout
    summary = asyncio.run(run_attack(options, stream=stream))
    text = json.dumps(summary.wire(), indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    return 0 if summary.ok else 1
