"""``prorsa bench events``: the forecast's WAPE with the prefill events a trainer can send.

A trainer behind a PD router sees neither the prefill engine nor the end of a prefill
unless it streams. The same simulated rollout runs with Prorsa's Controller three times:
the full event set (``prefill_started``/``prefill_finished`` with the instance), what a
streaming client sees (``prefill_finished`` at the first token, no instance) and what a
blocking client sees (no prefill event; the engines' ``/v1/state`` fills the gap). Each row
prints the prefill and decode-admission WAPE, scored against the simulator's ground truth.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

from prorsa_lab.sim.costmodel import load_profile
from prorsa_lab.sim.policies import baseline
from prorsa_lab.sim.simulator import Scenario, simulate
from prorsa_lab.sim.trainer import PREFILL_EVENTS
from prorsa_lab.sim.workloads import get_task

HELP = "forecast WAPE with the full prefill events, first-token only, and none"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="one step of one group per task (about 30 s)"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--model", default="qwen3-235b")
    parser.add_argument("--tasks", default="coding,math", help="comma-separated")
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--steps", type=int, help="training steps per run (default 2; quick 1)")
    parser.add_argument(
        "--groups", help="groups per step, task=n comma-separated (default coding=2,math=8)"
    )
    parser.add_argument("--seed", type=int, default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    task: str
    prefill_events: str
    wape_prefill: float | None
    wape_decode: float | None
    makespan: float
    events: int
    wall_seconds: float


def _groups(args: argparse.Namespace) -> dict[str, int]:
    groups = {"coding": 2, "math": 8, "general": 1}
    if args.quick:
        groups = dict.fromkeys(groups, 1)
    for item in (args.groups or "").split(","):
        if item:
            task, _, n = item.partition("=")
            groups[task] = int(n)
    return groups


def measure(args: argparse.Namespace) -> list[Row]:
    load_profile(args.model)
    tasks = [t for t in args.tasks.split(",") if t]
    for t in tasks:
        get_task(t)
    groups = _groups(args)
    steps = args.steps or (1 if args.quick else 2)
    rows = []
    for task in tasks:
        for prefill_events in PREFILL_EVENTS:
            scenario = Scenario(
                model=args.model,
                task=task,
                staleness=args.staleness,
                steps=steps,
                seed=args.seed,
                groups_per_step=groups.get(task, 1),
                prefill_events=prefill_events,  # type: ignore[arg-type]
            )
            began = time.perf_counter()
            r = simulate(scenario, baseline("prorsa"))
            rows.append(
                Row(
                    task=task,
                    prefill_events=prefill_events,
                    wape_prefill=r.wape_prefill,
                    wape_decode=r.wape_decode,
                    makespan=r.makespan,
                    events=r.events,
                    wall_seconds=time.perf_counter() - began,
                )
            )
    return rows


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def table(rows: list[Row]) -> str:
    lines = [
        f"{'task':<8} {'prefill events':<15}{'WAPE P':>9}{'WAPE D':>9}{'makespan':>10}"
        f"{'events':>9}{'wall s':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r.task:<8} {r.prefill_events:<15}{_pct(r.wape_prefill):>9}"
            f"{_pct(r.wape_decode):>9}{r.makespan:>10.0f}{r.events:>9}{r.wall_seconds:>8.1f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        rows = measure(args)
    except (KeyError, ValueError) as exc:
        print(f"prorsa bench events: {exc}")
        return 2
    if args.json:
        out: list[dict[str, Any]] = [
            {
                "task": r.task,
                "prefillEvents": r.prefill_events,
                "wapePrefill": r.wape_prefill,
                "wapeDecode": r.wape_decode,
                "makespan": r.makespan,
                "events": r.events,
            }
            for r in rows
        ]
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.model}, staleness {args.staleness}: Prorsa's forecast by prefill events")
        print(table(rows))
    return 0
