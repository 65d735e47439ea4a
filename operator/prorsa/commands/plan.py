"""``prorsa plan``: check a RolloutCluster, and replay a trainer's event stream against it.

Without events it reads the manifest alone: every problem the API server would refuse, in
one pass, and the deployment advice (is attention data-parallel; what SGLang will refuse
or change). With a captured NDJSON stream (``prorsa record``, or the SDK's ``record=``) it
shows what the operator would decide, with the same Controller, and reports every event
the stream gets wrong with its line number and field.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prorsa.core.actions import Actions, Order
    from prorsa.core.controller import Controller
    from prorsa.core.spec import RolloutCluster
    from prorsa_contract.events import Event

HELP = (
    "check a RolloutCluster manifest and its deployment; with --events, replay lifecycle "
    "events (NDJSON) against it and print the Decision"
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", required=True, type=Path, help="RolloutCluster manifest")
    parser.add_argument(
        "--events",
        type=Path,
        help="events, one JSON object per line ('-': stdin), e.g. from `prorsa record`; "
        "without it (and without --at) only the manifest is checked",
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

    from prorsa.core.actions import ActionState, decide_actions
    from prorsa.core.advice import deployment_advice
    from prorsa.core.spec import SpecError
    from prorsa.k8s.manifest_file import load_cluster
    from prorsa_contract.agent_api import ENGINE_STATES

    try:
        cluster = load_cluster(args.cluster)
    except OSError as exc:
        return _fail(f"{args.cluster}: {exc.strerror}")
    except SpecError as exc:
        for problem in exc.problems:
            print(f"{args.cluster}: {problem.text()}", file=sys.stderr)
        n = len(exc.problems)
        return _fail(f"{args.cluster}: {n} problem{'s' if n != 1 else ''}; nothing was planned")
    advice = deployment_advice(cluster.spec)
    if args.events is None and args.at is None:
        print(describe(cluster))
        for note in advice:
            print(f"advice: {note}")
        if not advice:
            print("advice: none")
        return 0

    events: list[Event] = []
    if args.events is not None:
        parsed = _read_events(args.events)
        if isinstance(parsed, int):
            return parsed
        events = parsed
    states = []
    if args.engines is not None:
        try:
            states = ENGINE_STATES.validate_json(args.engines.read_bytes())
        except OSError as exc:
            return _fail(f"{args.engines}: {exc.strerror}")
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            for err in errors:
                where = ".".join(map(str, err["loc"]))
                print(f"{args.engines}: [{where}] {err['msg']}", file=sys.stderr)
            return _fail(f"{args.engines}: {len(errors)} invalid engine state field(s)")
    if not events and args.at is None:
        return _fail("no events and no --at: nothing to tick at")
    at = args.at if args.at is not None else max(e.ts for e in events)
    from prorsa.core.types import TickInput

    controller = _replay(cluster, events, at=at, replay_ticks=not args.no_replay_ticks)
    decision = controller.tick(TickInput(now=at, engines=tuple(states)))
    print(json.dumps(decision.wire(), indent=2))
    # What the operator would carry out of it, by the same stage (bootstrap, mode gate),
    # as a process that just started and sees these engines.
    actions = decide_actions(
        decision=decision,
        mode=cluster.spec.switching.mode,
        spec=cluster.spec,
        states=states,
        state=ActionState(),
    )
    print(f"prorsa plan: {carried_out(actions, mode=cluster.spec.switching.mode)}", file=sys.stderr)
    for note in advice:
        print(f"prorsa plan: advice: {note}", file=sys.stderr)
    anomalies = {k: v for k, v in controller.table.anomalies.items() if v}
    if anomalies:
        summary = ", ".join(f"{k}={v}" for k, v in anomalies.items())
        print(
            f"prorsa plan: note: events that did not fit the state machine: {summary}",
            file=sys.stderr,
        )
    return 0


def _read_events(path: Path) -> list[Event] | int:
    """The events of ``path`` in order, or the exit code after naming every bad line."""
    from prorsa_contract.events import BatchError, parse_lines

    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
    except OSError as exc:
        return _fail(f"{path}: {exc.strerror}")
    numbered = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    try:
        return parse_lines([line for _, line in numbered])
    except BatchError as exc:
        for err in exc.errors:
            line = numbered[err.index][0] if err.index is not None else 0
            print(f"{path}:{line}: {err.field}: {err.message}", file=sys.stderr)
        return _fail(f"{len(exc.errors)} invalid event(s); nothing was replayed")


def _replay(
    cluster: RolloutCluster, events: list[Event], *, at: float, replay_ticks: bool
) -> Controller:
    """A Controller fed ``events`` up to ``at``, ticking every horizon on the way (as the
    operator would) unless ``replay_ticks`` is off."""
    from prorsa.core.controller import Controller
    from prorsa.core.types import TickInput

    controller = Controller(cluster.spec)
    horizon = controller.horizon
    events.sort(key=lambda e: e.ts)  # the operator sees them in time order too
    if not replay_ticks or not events:
        controller.observe(e for e in events if e.ts <= at)
        return controller
    next_tick = events[0].ts + horizon
    start = 0
    for i, event in enumerate(events):
        if event.ts > at:
            break
        while event.ts >= next_tick and next_tick < at:
            controller.observe(events[start:i])
            start = i
            controller.tick(TickInput(now=next_tick))
            next_tick += horizon
    else:
        i = len(events)
    controller.observe(events[start:i])
    return controller


def carried_out(actions: Actions, *, mode: str) -> str:
    """One line: what the operator would do with the Decision (prorsa.core.actions)."""

    def listed(orders: tuple[Order, ...]) -> str:
        return ", ".join(f"{o.switch.instance}: {o.switch.from_} -> {o.switch.to}" for o in orders)

    if actions.bootstrap:
        return f"bootstrap: the operator would first start {listed(actions.execute)}"
    if actions.execute:
        return f"switching {mode}: the operator would start {listed(actions.execute)}"
    if actions.announce:
        return f"switching {mode}: the operator would recommend {listed(actions.announce)}"
    return f"switching {mode}: the operator would start no switch"


def describe(cluster: RolloutCluster) -> str:
    """What the manifest deploys, in the terms of Eq. 1, for a user checking it."""
    spec = cluster.spec
    e, cap = spec.engine, spec.capacity
    n = spec.instances
    first = spec.initial_prefill()
    dp = e.attention_dp_size
    attention = (
        f"attention data-parallel over {dp} ranks of tensor parallel {e.tensor_parallel_size // dp}"
        if dp > 1
        else f"attention tensor-parallel over {e.tensor_parallel_size} GPUs (no attention DP)"
    )
    nodes = f", {e.nodes_per_instance} nodes each" if e.nodes_per_instance > 1 else ""
    kv = (
        f"C_KV {cap.decode_kv_tokens:,} tokens per decode instance"
        if cap.decode_kv_tokens
        else "C_KV: the engines' reported KV (capacity.decodeKvTokens unset)"
    )
    lines = [
        f"{cluster.metadata.namespace}/{cluster.metadata.name}: {n} instances of "
        f"{e.gpus_per_instance} GPUs{nodes} (gpuBudget {spec.gpu_budget}), starting at "
        f"{first}P:{n - first}D, at least {spec.roles.prefill.min}P and "
        f"{spec.roles.decode.min}D; switching {spec.switching.mode}",
        f"engine: {e.image}, {attention}, KV transfer {e.transfer_backend}",
        f"capacity: θ_P {cap.prefill_tokens_per_second:,.0f} tokens/s per prefill instance; {kv}",
        "events: replay a trainer's recording with --events (see `prorsa record`)",
    ]
    return "\n".join(lines)
