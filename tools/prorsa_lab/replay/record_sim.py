"""Record the simulator's own trainer: a recording and a manifest ``prorsa replay`` reads.

The simulator's trainer emits exactly the webhook contract events (``emit=True``); this
runs one benchmark scenario on a static split, keeps every event it emitted, and writes
them as the NDJSON ``prorsa record`` writes, next to the RolloutCluster manifest the
operator would run that scenario with (its ``capacity.*`` as the benchmark profiles it).
The committed test recording (tests/data/replay/) was made with it:

    python -m prorsa_lab.replay.record_sim --model deepseek-v3-dp8 --task math \\
        --staleness 2 --groups 3 --steps 3 --prefill 3 --out tests/data/replay/deepseek-math
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from prorsa_lab.sim.policies import Static
from prorsa_lab.sim.simulator import Scenario, SimResult, Simulation
from prorsa_lab.sim.trainer import PREFILL_EVENTS


def record(scenario: Scenario, *, prefill: int) -> tuple[list[str], SimResult]:
    """The NDJSON lines of ``scenario`` run on ``prefill`` prefill instances, and its result."""
    sim = Simulation(scenario, Static(prefill), emit_events=True)
    result = sim.run()
    lines = [e.model_dump_json(exclude_none=True) for e in sim.trainer.drain_outbox()]
    return lines, result


def manifest(scenario: Scenario, *, name: str) -> str:
    spec = scenario.spec().model_dump(mode="json", by_alias=True, exclude_none=True)
    doc = {
        "apiVersion": "prorsa.io/v1alpha1",
        "kind": "RolloutCluster",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }
    text: str = yaml.safe_dump(doc, sort_keys=False)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prorsa_lab.replay.record_sim")
    parser.add_argument("--model", default="qwen3-dp8")
    parser.add_argument("--task", default="general")
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--groups", type=int, default=2, help="GRPO groups per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--prefill", type=int, default=3, help="prefill instances recorded on")
    parser.add_argument(
        "--prefill-events",
        choices=PREFILL_EVENTS,
        default="full",
        help="which prefill events the trainer sends (default full)",
    )
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.ndjson, OUT.yaml")
    args = parser.parse_args(argv)
    scenario = Scenario(
        model=args.model,
        task=args.task,
        staleness=args.staleness,
        steps=args.steps,
        seed=args.seed,
        instances=args.instances,
        groups_per_step=args.groups,
        prefill_events=args.prefill_events,
    )
    lines, result = record(scenario, prefill=args.prefill)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    events = args.out.with_suffix(".ndjson")
    events.write_text("".join(line + "\n" for line in lines))
    args.out.with_suffix(".yaml").write_text(manifest(scenario, name=args.out.name))
    print(
        json.dumps(
            {
                "events": str(events),
                "lines": len(lines),
                "makespanSeconds": result.makespan,
                "split": f"{args.prefill}:{args.instances - args.prefill}",
            }
        ),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
