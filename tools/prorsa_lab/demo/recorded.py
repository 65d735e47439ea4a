"""``prorsa demo --record DIR``: each run's trainer events and the RolloutCluster it ran.

A run's recording is what ``prorsa record`` (or the SDK's ``record=``) would have written
for the same trainer, and its manifest is the one the demo applied, so ``prorsa replay
--cluster DIR/<run>-cluster.yaml --events DIR/<run>.ndjson`` asks the simulator the same
question a user asks of their own job. The demo replays both runs itself and sets the
prediction beside what it measured (:mod:`prorsa_lab.demo.replay_check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordedRun:
    name: str  # "switching" or "static-<N>P<M>D"
    events: Path
    cluster: Path


def run_name(static: tuple[int, int] | None) -> str:
    return "switching" if static is None else f"static-{static[0]}P{static[1]}D"


def prepare(
    directory: Path, *, static: tuple[int, int] | None, manifest: dict[str, Any]
) -> RecordedRun:
    """The run's file names, its manifest written, and an empty recording (the SDK appends)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = run_name(static)
    run = RecordedRun(
        name=name, events=directory / f"{name}.ndjson", cluster=directory / f"{name}-cluster.yaml"
    )
    run.events.unlink(missing_ok=True)  # a rerun into the same folder starts a new recording
    run.cluster.write_text(yaml.safe_dump(manifest, sort_keys=False), encoding="utf-8")
    return run
