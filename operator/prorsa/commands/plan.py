"""``prorsa plan``: replay a trainer's event stream offline and print the Decision.

A trainer developer runs this on a captured NDJSON stream before going live: it shows what
the operator would decide, with the same Controller, and reports every event the stream
gets wrong with its line number and field.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "replay lifecycle events (NDJSON) against a RolloutCluster and print the Decision"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", required=True, type=Path, help="RolloutCluster manifest")
    parser.add_argument(
        "--events", required=True, type=Path, help="events, one JSON object per line ('-': stdin)"
    )
    parser.add_argument(
        "--engines", type=Path, help="JSON list of agent /v1/state bodies (current engines)"
    )
    parser.add_argument(
        "--at", type=float, help="tick time, trainer clock (default: the last event's ts)"
    )
    parser.add_argument(
        "--no-replay-ticks",
        action="store_true",
        help="tick once at the end instead of every horizon while replaying, as the "
        "operator would (replay ticks let the bias correction and accuracy learn)",
    )


def _fail(message: str) -> int:
    print(f"prorsa plan: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from prorsa.core.advice import deployment_advice
    from prorsa.core.controller import Controller
    from prorsa.core.spec import SpecError
    from prorsa.k8s.manifest_file import load_cluster
    from prorsa_contract.agent_api import ENGINE_STATES
    from prorsa_contract.events import BatchError, parse_lines

    try:
        cluster = load_cluster(args.cluster)
    except (OSError, SpecError) as exc:
        return _fail(str(exc))
    try:
        text = sys.stdin.read() if str(args.events) == "-" else args.events.read_text()
    except OSError as exc:
        return _fail(f"{args.events}: {exc.strerror}")
    numbered = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    try:
        events = parse_lines([line for _, line in numbered])
    except BatchError as exc:
        for err in exc.errors:
            line = numbered[err.index][0] if err.index is not None else 0
            print(f"{args.events}:{line}: {err.field}: {err.message}", file=sys.stderr)
        return _fail(f"{len(exc.errors)} invalid event(s); nothing was replayed")
    states = []
    if args.engines is not None:
        try:
            states = ENGINE_STATES.validate_json(args.engines.read_bytes())
        except OSError as exc:
            return _fail(f"{args.engines}: {exc.strerror}")
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(map(str, first["loc"]))
            return _fail(f"{args.engines}: [{where}] {first['msg']}")
    if not events and args.at is None:
        return _fail("no events and no --at: nothing to tick at")
    at = args.at if args.at is not None else max(e.ts for e in events)

    controller = Controller(cluster.spec)
    horizon = controller.horizon
    events.sort(key=lambda e: e.ts)  # the operator sees them in time order too
    if args.no_replay_ticks or not events:
        controller.observe(e for e in events if e.ts <= at)
    else:
        next_tick = events[0].ts + horizon
        start = 0
        for i, event in enumerate(events):
            if event.ts > at:
                break
            while event.ts >= next_tick and next_tick < at:
                controller.observe(events[start:i])
                start = i
                controller.tick(next_tick)
                next_tick += horizon
        else:
            i = len(events)
        controller.observe(events[start:i])
    controller.observe_engines(states)
    decision = controller.tick(at)
    print(json.dumps(decision.wire(), indent=2))
    for note in deployment_advice(cluster.spec):
        print(f"prorsa plan: advice: {note}", file=sys.stderr)
    anomalies = {k: v for k, v in controller.table.anomalies.items() if v}
    if anomalies:
        summary = ", ".join(f"{k}={v}" for k, v in anomalies.items())
        print(
            f"prorsa plan: note: events that did not fit the state machine: {summary}",
            file=sys.stderr,
        )
    return 0
