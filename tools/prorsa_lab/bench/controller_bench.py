"""``prorsa bench controller``: what the control core costs per event, per tick, per trajectory.

Three figures, each from one run on this machine (absolute times are noisy on shared
machines; the targets are for one core):
- events applied per second, from the JSON bytes of a 500-event batch to applied state;
- tick p50/p99 at 1k, 10k and 100k live trajectories in an agentic state mix;
- memory per live trajectory (tracemalloc around loading the table).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import tracemalloc
from typing import Any

from prorsa.core.controller import Controller
from prorsa.core.spec import parse_cluster
from prorsa.core.types import TickInput
from prorsa.shell.gc_tuning import tune_gc
from prorsa_contract.agent_api import EngineState
from prorsa_contract.events import parse_batch, parse_events

HELP = "controller cost: events/s ingested, tick p50/p99 vs live trajectories, bytes/trajectory"

TARGET_EVENTS_PER_S = 200_000
TARGET_P99_MS = {10_000: 20.0, 100_000: 150.0}
TARGET_BYTES = 1024
# An agentic mix (coding agent, mid-step): most trajectories wait on tools or decode.
MIX = (
    ("tool", 0.45),
    ("decode", 0.2),
    ("reward", 0.12),
    ("ready", 0.08),
    ("starting", 0.1),
    ("prefill", 0.05),
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI, make bench)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--sizes", default="1000,10000,100000", help="live trajectory counts for the tick test"
    )


def _spec() -> Any:

    manifest = {
        "apiVersion": "prorsa.io/v1alpha1",
        "kind": "RolloutCluster",
        "metadata": {"name": "bench"},
        "spec": {
            "model": {"path": "/m"},
            "gpuBudget": 512,
            "engine": {"gpusPerInstance": 8},
            "forecast": {"injection": {"policy": "groupReplenish", "groupSize": 32}},
        },
    }
    return parse_cluster(manifest).spec


class _Stream:
    """Realistic lifecycle events for many concurrent trajectories, in time order."""

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.n = 0

    def _event(self, out: list[dict[str, Any]], kind: str, traj: str, ts: float, **f: Any) -> None:
        self.n += 1
        out.append({"id": f"ev-{self.n}", "ts": round(ts, 3), "trajectory": traj, "type": kind} | f)

    def lifecycle(self, traj: str, t0: float, turns: int) -> list[dict[str, Any]]:
        r, ts = self.rng, t0
        out: list[dict[str, Any]] = []
        task = r.choice(("swe", "search", "math"))
        self._event(
            out,
            "sample_dispatched",
            traj,
            ts,
            group=f"g-{traj[:-2]}",
            task=task,
            prompt_tokens=r.randint(800, 4000),
        )
        self._event(
            out,
            "sandbox_started",
            traj,
            ts + 0.2,
            mode=r.choice(("prewarm", "cold")),
            image=f"img-{r.randint(0, 9)}",
            node_class="cpu-large",
        )
        ts += r.uniform(1, 20)
        ctx = r.randint(800, 4000)
        for turn in range(turns):
            self._event(out, "request_queued", traj, ts, prompt_tokens=ctx, turn=turn)
            self._event(out, "prefill_started", traj, ts + 0.1, instance=f"e-{r.randint(0, 15)}")
            self._event(out, "prefill_finished", traj, ts + 0.4)
            gen = r.randint(20, 800)
            ctx += gen
            last = turn == turns - 1
            self._event(
                out,
                "decode_finished",
                traj,
                ts + 6,
                output_tokens=gen,
                finish="stop" if last else "tool",
            )
            ts += 6
            if not last:
                tool = r.choice(("bash", "read", "edit"))
                self._event(out, "tool_started", traj, ts + 0.05, tool=tool)
                dur = r.lognormvariate(1.0, 1.0)
                result = r.randint(50, 2000)
                self._event(out, "tool_finished", traj, ts + dur, result_tokens=result)
                ctx += result + 30
                ts += dur + 0.1
        self._event(out, "reward_started", traj, ts + 0.1)
        self._event(out, "reward_finished", traj, ts + r.uniform(5, 60), accepted=r.random() < 0.8)
        return out


def bench_events(quick: bool) -> dict[str, float]:

    stream = _Stream()
    raw: list[dict[str, Any]] = []
    for i in range(1500 if quick else 6000):
        raw += stream.lifecycle(f"t{i:06d}-00", t0=i * 0.05, turns=stream.rng.randint(2, 12))
    raw.sort(key=lambda e: e["ts"])
    batches = [json.dumps({"events": raw[i : i + 500]}).encode() for i in range(0, len(raw), 500)]
    controller = Controller(_spec())
    start = time.perf_counter()
    for body in batches:
        controller.observe(parse_batch(body))
    elapsed = time.perf_counter() - start
    # Split the cost: validation alone, to show where the time goes.
    start = time.perf_counter()
    for body in batches:
        parse_batch(body)
    parse_only = time.perf_counter() - start
    return {
        "events": len(raw),
        "eventsPerSecond": len(raw) / elapsed,
        "parseShare": parse_only / elapsed,
        "anomalies": sum(v for k, v in controller.table.anomalies.items() if k != "duplicate"),
    }


def _populate(controller: Any, n: int, now: float, rng: random.Random) -> None:
    """n live trajectories spread over states per MIX, plus learned duration statistics."""

    stream = _Stream(seed=rng.randint(0, 1 << 30))
    history: list[dict[str, Any]] = []
    for i in range(400):  # finished trajectories teach the duration statistics
        history += stream.lifecycle(f"h{i:06d}-00", t0=now - 900 + i, turns=rng.randint(2, 8))
    history.sort(key=lambda e: e["ts"])
    controller.observe(parse_events(history))
    live: list[dict[str, Any]] = []
    states = [s for s, _ in MIX]
    weights = [w for _, w in MIX]
    for i in range(n):
        traj = f"t{i:07d}-00"
        state = rng.choices(states, weights)[0]
        t0 = now - rng.uniform(1, 40)
        ctx = rng.randint(1000, 30_000)
        ev = stream._event
        ev(live, "sample_dispatched", traj, t0, group=f"g{i // 32}", task="swe")
        if state == "starting":
            ev(live, "sandbox_started", traj, t0 + 0.1, mode=rng.choice(("prewarm", "cold")))
            continue
        ev(live, "request_queued", traj, t0 + 0.5, prompt_tokens=ctx, turn=rng.randint(0, 30))
        if state == "ready":
            continue
        ev(live, "prefill_started", traj, t0 + 0.6, instance=f"e-{rng.randint(0, 15)}")
        if state == "prefill":
            continue
        ev(live, "prefill_finished", traj, t0 + 0.7)
        if state == "decode":
            continue
        finish = "tool" if state == "tool" else "stop"
        ev(live, "decode_finished", traj, t0 + 0.8, output_tokens=200, finish=finish)
        if state == "tool":
            ev(live, "tool_started", traj, t0 + 0.9, tool=rng.choice(("bash", "read", "edit")))
        else:
            ev(live, "reward_started", traj, t0 + 0.9)
    for i in range(0, len(live), 5000):
        controller.observe(parse_events(live[i : i + 5000]))


def _engines(n: int) -> list[Any]:

    return [
        EngineState.model_validate(
            {
                "instance": f"e-{i}",
                "role": "prefill" if i < 16 else "decode",
                "kvCapacityTokens": 1_300_000,
                "kvUsedTokens": 400_000,
                "runningRequests": 20,
                "waitingTokens": 10_000,
            }
        )
        for i in range(n)
    ]


def bench_ticks(sizes: list[int], quick: bool) -> list[dict[str, float]]:

    rows = []
    for n in sizes:
        rng = random.Random(n)
        controller = Controller(_spec())
        now = 10_000.0
        _populate(controller, n, now, rng)
        controller.observe_engines(_engines(64))
        reps = max(5, (30 if quick else 100) * 10_000 // max(n, 10_000))
        times = []
        for k in range(reps):
            start = time.perf_counter()
            controller.tick(TickInput(now=now + 0.01 * k))
            times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
        rows.append(
            {
                "live": len(controller.table),
                "ticks": reps,
                "p50Ms": statistics.median(times),
                "p99Ms": p99,
            }
        )
    return rows


def bench_memory(n: int) -> float:

    controller = Controller(_spec())
    controller.table.set_dedupe_window(0)  # measure trajectories, not the replay window
    rng = random.Random(1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    _populate(controller, n, 10_000.0, rng)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / max(len(controller.table), 1)


def run(args: argparse.Namespace) -> int:

    tune_gc()  # as `prorsa operator` and `prorsa ingest` run
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    ev = bench_events(args.quick)
    ticks = bench_ticks(sizes, args.quick)
    mem = bench_memory(20_000 if args.quick else 100_000)
    if args.json:
        print(json.dumps({"events": ev, "ticks": ticks, "bytesPerTrajectory": mem}, indent=2))
        return 0
    print("prorsa bench controller (one process, one core; targets from the issue)")
    print(
        f"  events applied/s (JSON bytes -> state, 500/batch): {ev['eventsPerSecond']:>10,.0f}"
        f"   target >= {TARGET_EVENTS_PER_S:,}"
        f"  ({ev['eventsPerSecond'] / TARGET_EVENTS_PER_S:.2f}x)"
        f"   [{ev['events']:,} events, validation {ev['parseShare']:.0%} of the time]"
    )
    print(
        f"  {'live trajectories':>18} {'ticks':>6} {'p50 ms':>8} {'p99 ms':>8} {'target p99':>11}"
    )
    for row in ticks:
        target = TARGET_P99_MS.get(int(row["live"]) // 1000 * 1000)
        shown = f"<= {target:.0f} ms" if target else "-"
        print(
            f"  {row['live']:>18,} {row['ticks']:>6} {row['p50Ms']:>8.2f} {row['p99Ms']:>8.2f}"
            f" {shown:>11}"
        )
    print(f"  memory per live trajectory: {mem:,.0f} bytes   target <= {TARGET_BYTES} bytes")
    return 0
