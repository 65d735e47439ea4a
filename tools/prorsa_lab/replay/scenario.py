"""A simulator scenario that replays a recording on a manifest's deployment.

It is a :class:`~prorsa_lab.sim.simulator.Scenario` whose trajectories are the recording's
scripts, whose engine is the replay's engine model, and whose RolloutCluster spec is the
manifest's, so the Prorsa policy runs the Controller with the user's own settings. Being a
frozen, hashable scenario it runs in the benchmark's process pool and forks for the
foresight reference like any other.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any

from prorsa.core.spec import RolloutClusterSpec
from prorsa_lab.sim.costmodel import ModelProfile
from prorsa_lab.sim.simulator import Scenario
from prorsa_lab.sim.workloads import LogNormal, TaskProfile, Tool, TrajectoryScript


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayScenario(Scenario):
    engine: ModelProfile
    manifest: str  # the RolloutCluster spec, JSON by alias (hashable)
    replayed: tuple[TrajectoryScript, ...]
    group_size: int = 1
    rate_per_second: float = 0.0

    def profile(self) -> ModelProfile:
        return self.engine

    def spec(self) -> RolloutClusterSpec:
        return RolloutClusterSpec.model_validate(json.loads(self.manifest))

    def scripts(self) -> tuple[TrajectoryScript, ...]:
        return self.replayed

    def fixed_rate(self) -> float:
        return self.rate_per_second

    def task_profile(self) -> TaskProfile:
        """The recording as a task profile: its group size and batch, and its medians.

        The trainer draws nothing from the distributions when it replays scripts; they
        describe the recording (sigma 0) for anything that reads a profile."""
        s = self.replayed
        turns = [len(x.turns) for x in s if x.turns] or [1]
        outputs = [t.output for x in s for t in x.turns] or [1]
        tools = [t for x in s for t in x.turns if t.finish == "tool"]

        def fixed(values: list[float]) -> LogNormal:
            m = max(float(statistics.median(values)), 1e-3) if values else 1e-3
            return LogNormal(m, 0.0, m, m)

        tool = Tool(
            "recorded",
            1.0,
            fixed([t.tool_seconds for t in tools]),
            fixed([float(t.result_tokens) for t in tools]),
        )
        return TaskProfile(
            name="replay",
            group_size=self.group_size,
            groups_per_step=self.groups_per_step or 1,
            prompt=fixed([float(x.prompt) for x in s]),
            turns_min=min(turns),
            turns_max=max(turns),
            turns=None,
            output=fixed([float(o) for o in outputs]),
            last_output=None,
            tools=(tool,) if tools else (),
            prewarm=fixed([x.prewarm_seconds for x in s if x.sandbox == "prewarm"]),
            cold=fixed([x.cold_seconds for x in s if x.sandbox == "cold"]),
            reward=fixed([x.reward_seconds for x in s if x.reward_seconds > 0]),
            accept=sum(x.accepted for x in s) / len(s) if s else 0.0,
            group_sigma=0.0,
            prewarm_pool=0,
            sources="a recording (prorsa replay)",
        )


def manifest_json(spec: RolloutClusterSpec) -> str:
    data: dict[str, Any] = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    return json.dumps(data, sort_keys=True)
