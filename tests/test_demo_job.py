"""The default doubles demo's workload: a multi-task job of the paper's tasks (docs/demo.md,
"Sizing: the multi-task job").

What a user would notice: each phase dispatches its own task, whose trajectories carry the
task's label to the webhook and keep it to their end; the phases' sizes are the documented
table's; each task leans its own way in Eq. 1 on four doubles; and ``--phases steady`` runs
the coding agent throughout.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from prorsa_lab.demo.job import CODING_AGENT, GENERAL_AGENT, MATH_TASK, MULTI_TASK_JOB
from prorsa_lab.demo.run import TRAJECTORIES_PER_INSTANCE, DemoOptions, EngineModel
from prorsa_lab.demo.sizing import eq1, steady_state
from prorsa_lab.demo.trainer import DemoTrainer
from prorsa_lab.demo.workload import PhaseSchedule
from prorsa_sdk.event_helpers import EventHelpers

DOCS = Path(__file__).resolve().parents[1] / "docs" / "demo.md"


class Recorder(EventHelpers):
    """Keeps every event the trainer emits, as the webhook would get it."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(
        self,
        type: str,
        trajectory: str | None,
        *,
        ts: float | None = None,
        id: str | None = None,
        **fields: Any,
    ) -> str:
        self.events.append({"type": type, "trajectory": trajectory, **fields})
        return str(len(self.events))


def _answer(request: httpx.Request) -> httpx.Response:
    """An engine that answers every call at once with exactly the tokens asked."""
    payload = json.loads(request.content)
    n = payload["sampling_params"]["max_new_tokens"]
    return httpx.Response(
        200,
        json={
            "text": " t" * n,
            "output_ids": list(range(n)),
            "meta_info": {"finish_reason": {"type": "length", "length": n}},
        },
    )


SPEED = 200.0  # virtual seconds per real second


def _run_job(seconds: float) -> tuple[DemoTrainer, Recorder]:
    """The default job, 80 s phases, on a clock 200 times faster than the machine's: every
    wait of the trainer (sandbox, tool, reward) lasts 1/200 of its length, and the engine
    answers at once."""
    recorder = Recorder()
    router = httpx.AsyncClient(transport=httpx.MockTransport(_answer), base_url="http://smg")
    trainer = DemoTrainer(
        task=MULTI_TASK_JOB[0].task,
        schedule=DemoOptions().phases,
        emitter=recorder,  # type: ignore[arg-type]
        router=router,
        concurrency=24,
        clock=lambda: time.monotonic() * SPEED,
    )

    async def wait(seconds: float) -> bool:
        if trainer.stopping:
            return False
        await asyncio.sleep(seconds / SPEED)
        return not trainer.stopping

    trainer._sleep = wait  # type: ignore[method-assign]
    asyncio.run(trainer.run(duration=seconds / SPEED))
    return trainer, recorder


def test_each_phase_dispatches_its_task_and_its_trajectories_carry_the_label() -> None:
    trainer, recorder = _run_job(240.0)
    dispatched = [e for e in recorder.events if e["type"] == "sample_dispatched"]
    tasks = {e["trajectory"]: e["task"] for e in dispatched}
    # Every phase's task was dispatched, in the job's order.
    order = [tasks[e["trajectory"]] for e in dispatched]
    first = [order.index(name) for name in ("coding", "general", "math")]
    assert first == sorted(first), first
    # A trajectory's calls are of the task it was dispatched with, to its end.
    records = trainer.stats.requests
    assert records and all(r.task == tasks[r.trajectory] for r in records)
    assert {r.task for r in records} == {"coding", "general", "math"}
    # Trajectories carry their task's GRPO group (32 for the agents, 8 for math).
    groups = {e["group"] for e in dispatched if e["task"] == "math"}
    assert all(g.startswith("math-g") for g in groups), groups
    # The requests file says which task a call was of.
    assert records[0].wire()["task"] == tasks[records[0].trajectory]


def test_the_job_alternates_the_papers_tasks_one_per_phase() -> None:
    schedule = DemoOptions().phases
    assert [schedule.label(t) for t in (5.0, 85.0, 165.0, 245.0)] == [
        "coding",
        "general",
        "math",
        "coding",
    ]
    # The summary judges following by each task's lean: general leans prefill.
    assert [phase for _, _, phase in schedule.spans(240.0)] == ["reasoning", "tools", "reasoning"]
    steady = DemoOptions(phase_pattern="steady").phases
    assert {steady.label(t) for t in (5.0, 85.0, 165.0)} == {"coding"}
    # The real engines keep their own one-task workload.
    assert DemoOptions(engine="sglang", instances=3).task_name == "coding"
    with pytest.raises(ValueError, match="multi-task job is sized for the engine doubles"):
        DemoOptions(engine="sglang", instances=3, task="multi")
    single = DemoOptions(task="coding").phases
    assert single.job == () and single.label(5.0) == "tools"


def test_each_task_leans_its_own_way_on_four_doubles() -> None:
    """Eq. 1 on a steady-state estimate (every trajectory of the one task, no queueing):
    the coding agent asks for 1P:3D with more KV than two decode instances hold, the general
    agent for 3P:1D with its KV within one, and math for little of either."""
    model, live = EngineModel(), TRAJECTORIES_PER_INSTANCE * 4
    coding = steady_state(CODING_AGENT, "reasoning", model, live=live, decode_instances=3)
    general = steady_state(GENERAL_AGENT, "tools", model, live=live, decode_instances=1)
    math = steady_state(MATH_TASK, "reasoning", model, live=live, decode_instances=3)
    assert eq1(coding, budget=4) == (1, 3) and 2.0 < coding.decode_kv < 3.0, coding
    assert eq1(general, budget=4) == (3, 1) and general.prefill > 2.0 and general.decode_kv < 1.0, (
        general
    )
    assert eq1(math, budget=4) == (1, 3) and math.prefill < 0.2 and math.decode_kv < 1.0, math


def _table() -> dict[str, list[str]]:
    """docs/demo.md's table of the job's tasks: row name -> cells (coding, general, math)."""
    text = DOCS.read_text()
    start = text.index("| | coding agent | general agent | math |")
    rows: dict[str, list[str]] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _number(cell: str) -> float:
    """The demo's figure of a cell: the first number after "demo", or the first one."""
    found = re.search(r"demo ~?([\d,.]+)", cell) or re.search(r"~?([\d,.]+)", cell)
    assert found, cell
    return float(found.group(1).replace(",", ""))


def test_the_documented_table_is_the_jobs_sizing() -> None:
    rows = _table()
    tasks = (CODING_AGENT, GENERAL_AGENT, MATH_TASK)
    for i, task in enumerate(tasks):
        shape = task.phase(MULTI_TASK_JOB[i].lean)
        assert _number(rows["first prompt (tokens, median)"][i]) == task.prompt.median
        assert _number(rows["output per turn (tokens, median)"][i]) == shape.output.median
        assert _number(rows["tool result (tokens, median)"][i]) == shape.result_tokens.median
        assert _number(rows["tool call (s, median)"][i]) == pytest.approx(shape.tool_seconds.median)
        assert _number(rows["reward (s, median)"][i]) == pytest.approx(task.reward_seconds.median)
        turns = rows["turns"][i]
        assert f"{task.turns_min}-{task.turns_max}" in turns, turns


def test_a_single_task_schedule_is_unchanged() -> None:
    schedule = PhaseSchedule(seconds=80.0)
    assert schedule.job_task(100.0) is None
    assert (schedule.at(5.0), schedule.at(100.0)) == ("tools", "reasoning")
