"""What a demo workload asks for, estimated without running it (docs/demo.md, "Sizing").

A steady-state estimate from the seeded trajectories (every turn in one shape, no
queueing, no CPU lag) says what a task or phase asks for in Eq. 1's units: prefill
instances (prompt tokens sent per second over the declared prefill rate) and decode
instances (KV held over the declared KV pool). The tests hold the demo's sizing to it, and
``python -m prorsa_lab.demo.sizing`` prints it for the default job, the figures that
docs/demo.md's sizing table quotes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from prorsa.core.allocate import solve
from prorsa_lab.demo.workload import DemoTask, PhaseName, draw_trajectory
from prorsa_lab.sim.workloads import TEMPLATE_TOKENS


class Engine(Protocol):
    """The figures of an engine the estimate needs (``EngineModel`` in run.py)."""

    @property
    def prefill_tokens_per_second(self) -> float: ...
    @property
    def kv_tokens(self) -> int: ...
    @property
    def decode_step_seconds(self) -> float: ...
    @property
    def decode_step_seconds_per_request(self) -> float: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Ask:
    prefill: float  # instances
    decode_kv: float  # instances
    trajectory_seconds: float = 0.0  # a trajectory's mean life, sandbox to reward
    turns: float = 0.0  # model calls per trajectory, mean


def steady_state(
    task: DemoTask,
    phase: PhaseName,
    model: Engine,
    *,
    live: int,
    decode_instances: int,
    samples: int = 300,
) -> Ask:
    """What ``live`` trajectories of ``task`` ask for when every turn has ``phase``'s shape,
    with their decodes spread over ``decode_instances`` (the decode step's batch)."""
    running = 5.0  # requests decoding per decode engine: iterated to a fixed point
    wall = prefill = kv_seconds = decoding = 0.0
    turns = 0
    for _ in range(5):
        wall = prefill = kv_seconds = decoding = 0.0
        turns = 0
        for index in range(samples):
            draw = draw_trajectory(task, seed=0, index=index)
            context = draw.prompt
            wall += draw.startup_seconds + draw.reward_seconds
            for turn, turn_draw in enumerate(draw.turn_draws):
                want = min(turn_draw.output[phase], task.max_context - context)
                if want < 1:
                    break
                turns += 1
                step = model.decode_step_seconds + model.decode_step_seconds_per_request * running
                seconds = want * step
                wall += context / model.prefill_tokens_per_second + seconds
                prefill += context / model.prefill_tokens_per_second
                kv_seconds += (context + want / 2) * seconds
                decoding += seconds
                context += want
                if turn == draw.turns - 1 or context >= task.max_context:
                    break
                wall += turn_draw.tool_seconds[phase]
                context += turn_draw.result_tokens[phase] + TEMPLATE_TOKENS
                if context >= task.max_context:
                    break
        running = live * decoding / wall / decode_instances
    return Ask(
        prefill=live * prefill / wall,
        decode_kv=live * kv_seconds / wall / model.kv_tokens,
        trajectory_seconds=wall / samples,
        turns=turns / samples,
    )


def eq1(ask: Ask, *, budget: int) -> tuple[int, int]:
    """Eq. 1's split for the estimate (at least one instance of each role)."""
    split = solve(ask.prefill, ask.decode_kv, budget=budget, min_prefill=1, min_decode=1)
    return split.prefill, split.decode


def main() -> None:
    from prorsa_lab.demo.job import MULTI_TASK_JOB
    from prorsa_lab.demo.run import TRAJECTORIES_PER_INSTANCE, EngineModel

    instances = 4
    model, live = EngineModel(), TRAJECTORIES_PER_INSTANCE * instances
    print(
        f"the default job on {instances} engine doubles, {live} live trajectories "
        "(steady state: no queueing, no CPU lag)"
    )
    print("task     leans      prefill a  decode b  Eq. 1   trajectory  calls")
    for job in MULTI_TASK_JOB:
        # Decodes spread over the decode instances the task's own split gives it.
        first = steady_state(job.task, job.lean, model, live=live, decode_instances=3)
        decode = eq1(first, budget=instances)[1]
        ask = steady_state(job.task, job.lean, model, live=live, decode_instances=decode)
        split = eq1(ask, budget=instances)
        lean = "prefill" if job.lean == "tools" else "decode"
        print(
            f"{job.task.name:<8} {lean:<10} {ask.prefill:>9.2f}  {ask.decode_kv:>8.2f}  "
            f"{split[0]}P:{split[1]}D  {ask.trajectory_seconds:>8.0f} s  {ask.turns:>5.1f}"
        )


if __name__ == "__main__":
    main()
