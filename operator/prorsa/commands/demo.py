"""``prorsa demo``: the whole system on one machine, no cluster, no GPU.

Starts the in-process Kubernetes API emulator, the operator (kopf, real webhook, real
metrics), one engine pod per instance (SGLang engine double + the real agent) and a
simulated agentic trainer that posts lifecycle events through the SDK and sends real
``/generate`` requests; shows a live view, then a summary, and writes a timeline PNG.
Then the same seeded workload runs on a static split, and the summary says whether
switching saved time against it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from prorsa.commands import lab

HELP = "run the operator, engine doubles and a simulated agentic trainer on this machine"


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration",
        type=_positive,
        default=None,
        metavar="SECONDS",
        help="seconds of rollout after the engines are up, in each run (default 240; "
        "with --engine sglang 150)",
    )
    parser.add_argument(
        "--task",
        choices=("multi", "coding", "general", "math"),
        default=None,
        help="multi: a multi-task job dispatching the paper's coding agent, general agent "
        "and math in turn, one task per phase (default with the doubles); coding, general, "
        "math: one task whose turns alternate tools and reasoning phases (default coding "
        "with --engine sglang)",
    )
    parser.add_argument(
        "--instances",
        type=int,
        default=None,
        metavar="N",
        help="engine pods, 8 GPUs each: gpuBudget = 8N (default 4; with --engine sglang one "
        "CPU engine each, default 3)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out/demo"),
        metavar="DIR",
        help="where timeline.png, summary.json, requests.jsonl, decisions.jsonl, "
        "samples.jsonl, demo.log and (while it runs) kubeconfig go (default bench-out/demo)",
    )
    parser.add_argument(
        "--no-live",
        dest="live",
        action="store_false",
        help="plain log lines instead of the live view (CI, pipes)",
    )
    parser.add_argument(
        "--phase-seconds",
        type=_positive,
        default=None,
        metavar="SECONDS",
        help="length of each phase: one task of the job, or a tools / reasoning phase "
        "(default: duration / 3, 5 to 80 s)",
    )
    parser.add_argument(
        "--phases",
        choices=("alternate", "steady"),
        default="alternate",
        help="alternate: the job's tasks (or one task's tools and reasoning phases) in "
        "turn, whose best splits differ (default); steady: the coding agent (or reasoning) "
        "in every phase, a workload that favours one split throughout, where switching "
        "should cost nothing",
    )
    parser.add_argument(
        "--trajectories",
        type=int,
        default=None,
        metavar="N",
        help="live trajectories at once (default 6 per instance; with --engine sglang 3)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="N:M|best|none",
        help="the static prefill:decode split to run the same workload on afterwards and "
        "compare with: N:M; best (every split, one run each: the fastest is compared); none "
        "(no second run). Default: the even split, what one picks without knowing the "
        "workload's mix",
    )
    parser.add_argument(
        "--no-noise",
        dest="noise",
        action="store_false",
        help="skip the second run of the fastest static split on the same seed; without "
        "it the verdict cannot tell a difference from this machine's noise",
    )
    parser.add_argument(
        "--nodes-per-instance",
        type=int,
        default=1,
        choices=(1, 2, 4, 8),
        metavar="N",
        help="pods per engine instance: a leader and N-1 worker ranks sharing its 8 GPUs "
        "(engine.nodesPerInstance; default 1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload random seed")
    parser.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="DIR",
        help="save each run's trainer events (NDJSON) and RolloutCluster to DIR, replay them "
        "in the simulator and set its prediction beside the measured times (summary's "
        "`replay`; docs/benchmarks.md, 'How close the simulator is to the engines')",
    )
    parser.add_argument(
        "--engine",
        choices=("double", "sglang"),
        default="double",
        help="what serves the engine pods: the SGLang engine double (default), or the real "
        "SGLang 0.5.23 on this CPU with a tiny local model (`make demo-sglang` builds its "
        "environment first; at most 3 instances, token counts a tenth of the double's)",
    )


def options(args: argparse.Namespace) -> Any:
    """The lab's ``DemoOptions`` for ``args``: the engine's own defaults where an option was
    not given (raises ValueError naming a bad one)."""
    demo = lab.load(lab.LAB, "demo")
    real = args.engine == "sglang"
    return demo.DemoOptions(
        duration=args.duration or (demo.SGLANG_DURATION if real else 240.0),
        task=args.task,
        instances=args.instances or (3 if real else 4),
        engine=args.engine,
        model=demo.SGLANG_MODEL if real else demo.EngineModel(),
        out=args.out,
        live=args.live and sys.stdout.isatty(),
        seed=args.seed,
        phase_seconds=args.phase_seconds,
        phase_pattern=args.phases,
        concurrency=args.trajectories,
        nodes_per_instance=args.nodes_per_instance,
        baseline=args.baseline,
        record=args.record,
        noise=args.noise,
    )


def run(args: argparse.Namespace) -> int:
    demo = lab.load(lab.LAB, "demo")
    try:
        chosen = options(args)
    except ValueError as exc:
        print(f"prorsa demo: error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(demo.run_demo(chosen))
    except demo.DemoInterrupted as exc:
        print(f"prorsa demo: {exc}", file=sys.stderr)
        return 130
    return 0 if summary.ok else 1
