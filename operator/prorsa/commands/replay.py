"""``prorsa replay``: will switching pay on my job? A recording replayed on every policy.

Reads a trainer's NDJSON recording (``prorsa record``, or the SDK's ``record=``) and the
RolloutCluster manifest, rebuilds each trajectory from its events, infers the trainer's
dispatch (printed; flags override it) and replays the job closed-loop in the rollout
simulator on colocation, every static split, Prorsa with the manifest's settings and the
foresight reference. Prints each makespan, Prorsa against the best static split and
against colocation, and one line of advice. The simulator is the lab's
(``prorsa_lab.replay``), loaded when the command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from prorsa.commands import lab

# The lab's ReplayReport (prorsa_lab.replay.api), reached through its entry point: the
# operator imports nothing of the lab, not even for a type.
ReplayReport = Any

HELP = "replay a recorded job on every P/D policy in the rollout simulator: does switching pay?"
INJECTIONS = ("replaceOnReward", "fixedRate", "groupReplenish", "replaceOnEnd")


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return n


def _splits(value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of counts: {value}") from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", required=True, type=Path, help="RolloutCluster manifest")
    parser.add_argument(
        "--events", required=True, type=Path, help="the recording: NDJSON events, one per line"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"rows": [...], "bestStatic": {...}, "advice": "..."} (and what was '
        "inferred) instead of the table",
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        help="a committed cost table of the simulator (e.g. qwen3-dp8) instead of the engine "
        "model built from the manifest's capacity.*",
    )
    parser.add_argument(
        "--decode-step-ms",
        type=float,
        metavar="MS",
        help="the lone request's decode step (default: measured in the recording)",
    )
    parser.add_argument(
        "--knee-context",
        type=_positive_int,
        default=8192,
        metavar="TOKENS",
        help="the request length capacity.decodeConcurrency was measured at (prorsa "
        "profile --decode-context; default its default, 8192)",
    )
    parser.add_argument(
        "--kv-pool-tokens",
        type=_positive_int,
        metavar="TOKENS",
        help="a decode instance's whole KV pool (SGLang's max_total_num_tokens), for a "
        "manifest whose decodeKvTokens is not prorsa profile's usable figure (default: "
        "decodeKvTokens plus the profile's growth reserve at the knee)",
    )
    parser.add_argument("--staleness", type=int, help="override the inferred staleness")
    parser.add_argument(
        "--groups-per-step", type=_positive_int, help="override the inferred GRPO groups per step"
    )
    parser.add_argument("--injection", choices=INJECTIONS, help="override the inferred injection")
    parser.add_argument(
        "--max-concurrent", type=_positive_int, help="override the inferred in-flight cap"
    )
    parser.add_argument("--steps", type=_positive_int, help="override the inferred step count")
    parser.add_argument(
        "--static", type=_splits, metavar="N,N,...", help="prefill counts to sweep (default all)"
    )
    parser.add_argument(
        "--no-reference", action="store_true", help="leave out the foresight reference"
    )
    parser.add_argument(
        "--switch-seconds",
        type=float,
        default=5.0,
        metavar="S",
        help="the engine's own role switch, drain and router apart (default 5: the paper's "
        "figure for SGLang on H200, Appendix C)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=os.cpu_count() or 1,
        help="simulations at once (default: one per CPU)",
    )
    parser.add_argument("--png", type=Path, help="write the split over time to this PNG")
    parser.add_argument(
        "--count",
        type=_positive_int,
        metavar="N",
        help="also give each policy's time until N trajectories had completed (e.g. what a "
        "run you measured finished; JSON: timeToCount)",
    )


def run(args: argparse.Namespace) -> int:
    replay = lab.load(lab.LAB, "replay")
    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"prorsa replay: {time.monotonic() - started:5.0f}s {line}", file=sys.stderr)

    try:
        report = replay.replay_recording(
            events=args.events,
            cluster=args.cluster,
            model=args.model,
            decode_step_ms=args.decode_step_ms,
            knee_context=args.knee_context,
            kv_pool_tokens=args.kv_pool_tokens,
            staleness=args.staleness,
            groups_per_step=args.groups_per_step,
            injection=args.injection,
            max_concurrent=args.max_concurrent,
            steps=args.steps,
            static=args.static,
            reference=not args.no_reference,
            switch_seconds=args.switch_seconds,
            workers=args.workers,
            progress=progress,
        )
    except replay.ReplayError as exc:
        for line in str(exc).splitlines():
            print(f"prorsa replay: error: {line}", file=sys.stderr)
        return 2
    if args.png is not None:
        try:
            write_png(report, args.png)
        except ImportError:
            print(
                "prorsa replay: error: --png needs matplotlib (pip install -e '.[bench]')",
                file=sys.stderr,
            )
            return 2
    if args.json:
        doc = report.as_json()
        doc["inferred"] = list(report.recording.inferred)
        doc["png"] = str(args.png) if args.png else None
        if args.count is not None:
            doc["timeToCount"] = {"count": args.count} | {
                name: report.time_to_count(name, args.count) for name in sorted(report.runs)
            }
        print(json.dumps(doc, indent=1))
        return 0
    print(text(report))
    if args.count is not None:
        times = ", ".join(
            f"{name} {_s(report.time_to_count(name, args.count))}" for name in sorted(report.runs)
        )
        print(f"time to {args.count} completed trajectories (--count): {times}")
    if args.png is not None:
        print(f"wrote {args.png}")
    return 0


def _s(v: float | None) -> str:
    return "did not finish" if v is None or not math.isfinite(v) else f"{v:,.0f} s"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def text(report: ReplayReport) -> str:
    rec = report.recording
    d = report.dispatch
    lines = [
        f"recording {rec.path}: {len(rec.scripts)} trajectories ({rec.completed} completed, "
        f"{rec.cut} cut by its end, {rec.dropped} dropped) over {rec.span_seconds:,.0f} s",
        f"dispatch: {d.describe()}",
        *(f"  inferred: {note}" for note in rec.inferred),
        f"engine model ({report.instances} instances):",
        *(f"  {source}" for source in report.engine.sources),
        *(f"note: {note}" for note in report.notes),
        "",
        f"{'policy':<12} {'makespan':>14} {'vs best static':>15} {'vs colocation':>14} "
        f"{'switches':>9} {'completed':>10}",
    ]
    rows = report.rows()
    for row in rows:
        flag = " (ran out of recording)" if row["ranOutOfRecording"] else ""
        lines.append(
            f"{row['policy']:<12} {_s(row['makespanSeconds']):>14} "
            f"{_x(row['speedupVsBestStatic']):>15} {_x(row['speedupVsColocation']):>14} "
            f"{row['switches']:>9} {row['completed']:>10}{flag}"
        )
    n_p = report.best_static
    by = {row["policy"]: row for row in rows}
    lines.append("")
    if n_p is not None:
        lines.append(
            f"best static split: {n_p}:{report.instances - n_p} "
            f"({_s(by['best-static']['makespanSeconds'])}); the start split for a job like "
            f"this one: roles.prefill.initial: {n_p} (docs/crd-reference.md)"
        )
    if "prorsa" in by:
        p = by["prorsa"]
        lines.append(
            f"Prorsa: {_x(p['speedupVsBestStatic'])} the best static split, "
            f"{_x(p['speedupVsColocation'])} colocation"
        )
    common = report.common_count()
    times = ", ".join(
        f"{name} {_s(report.time_to_count(name, common))}"
        for name in ("colocation", "best-static", "prorsa", "reference")
        if name in by
    )
    lines.append(f"time to {common} completed trajectories (every policy's count): {times}")
    lines.append(f"advice: {report.advice}")
    return "\n".join(lines)


def write_png(report: ReplayReport, path: Path) -> Path:
    """Prefill instances over time under Prorsa, the reference and the best static split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=110)
    shown: list[tuple[str, Any]] = [
        ("best static", "best-static"),
        ("Prorsa", "prorsa"),
        ("reference", "reference"),
    ]
    for label, name in shown:
        try:
            run = report._run(name)
        except KeyError:
            continue
        xs: list[float] = []
        ys: list[float] = []
        for t, p, _d, _sw in run.timeline:
            xs.append(t / 60)
            ys.append(p)
        if not xs:
            continue
        end = run.makespan if math.isfinite(run.makespan) else xs[-1] * 60
        xs.append(end / 60)
        ys.append(ys[-1])
        ax.step(xs, ys, where="post", label=f"{label} ({_s(run.makespan)})")
    ax.set_xlabel("minutes")
    ax.set_ylabel("prefill instances")
    ax.set_ylim(0, report.instances)
    ax.set_title(f"prorsa replay: {Path(report.recording.path).name}", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
