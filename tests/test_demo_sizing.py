"""The demo's default sizing, checked without running it (docs/demo.md, "Sizing").

What the demo must show depends on its numbers: each phase must lean one way within what
four instances serve, and the RolloutCluster must declare what the engine doubles serve.
A steady-state estimate from the seeded trajectories (every turn in one phase, no queueing,
no CPU lag) says what each phase asks for, in Eq. 1's units: prefill instances (prompt
tokens sent per second over the declared prefill rate) and decode instances (KV held over
the declared KV pool).
"""

from __future__ import annotations

import pytest

from prorsa_lab.demo.run import (
    SGLANG_MODEL,
    SGLANG_OUTPUT_SCALE,
    SGLANG_TOKEN_SCALE,
    SGLANG_TRAJECTORIES_PER_INSTANCE,
    TRAJECTORIES_PER_INSTANCE,
    DemoOptions,
    EngineModel,
    demo_manifest,
)
from prorsa_lab.demo.sizing import Ask
from prorsa_lab.demo.sizing import eq1 as split_of
from prorsa_lab.demo.sizing import steady_state as estimate
from prorsa_lab.demo.workload import (
    CODING_DEMO,
    DEMO_TASKS,
    DemoTask,
    PhaseName,
    PhaseSchedule,
    default_phase_seconds,
)

INSTANCES = 4
DECODE_INSTANCES = 3  # where a reasoning phase runs, for the decode batch per engine


def steady_state(
    task: DemoTask,
    phase: PhaseName,
    model: EngineModel,
    *,
    live: int,
    decode_instances: int = DECODE_INSTANCES,
) -> Ask:
    """What ``live`` trajectories ask for when every turn starts in ``phase``."""
    return estimate(task, phase, model, live=live, decode_instances=decode_instances)


def eq1(ask: Ask, *, budget: int = INSTANCES) -> tuple[int, int]:
    return split_of(ask, budget=budget)


def test_each_phase_of_the_coding_workload_leans_its_own_way() -> None:
    """``--task coding``: one task whose turns alternate a tools and a reasoning shape (the
    default job's tasks: tests/test_demo_job.py)."""
    model, live = EngineModel(), TRAJECTORIES_PER_INSTANCE * INSTANCES
    tools = steady_state(CODING_DEMO, "tools", model, live=live)
    reasoning = steady_state(CODING_DEMO, "reasoning", model, live=live)
    # Tools: new prompts at well over one prefill instance's rate (a second one pays for
    # its switch only if the first cannot keep up with the arrivals), little KV held.
    assert tools.prefill > 1.5 and tools.decode_kv < 0.5, tools
    assert eq1(tools)[0] >= 2, tools
    # Reasoning: about two decode instances' KV, so that two are full (a move from decode
    # to prefill is then priced a loss, whatever a burst of prompts asks) and three hold
    # it; prompts for about half a prefill instance.
    assert reasoning.prefill < 0.6, reasoning
    assert 1.8 < reasoning.decode_kv < 2.6, reasoning
    assert eq1(reasoning) == (1, 3), reasoning


def test_a_default_run_judges_following_on_phases_long_enough_to_settle() -> None:
    """The default 240 s run: the job's prefill-leaning general agent between the coding
    agent and math, each 80 s (60 s left a burst's move in place at the phase end in two
    runs of three), so the summary has a tools phase with decode-leaning phases on both
    sides to judge following by; a one-task run has tools, reasoning, tools."""
    duration = DemoOptions().duration
    spans = DemoOptions().phases.spans(duration)
    assert [phase for _, _, phase in spans] == ["reasoning", "tools", "reasoning"]
    single = PhaseSchedule(seconds=default_phase_seconds(duration)).spans(duration)
    assert [phase for _, _, phase in single] == ["tools", "reasoning", "tools"]
    assert all(end - start == 80.0 for start, end, _ in spans)
    # Longer runs repeat 80 s phases; short ones keep three phases of at least 5 s.
    assert default_phase_seconds(600.0) == 80.0
    assert default_phase_seconds(60.0) == 20.0
    assert default_phase_seconds(6.0) == 5.0


def test_the_rollout_cluster_declares_what_the_doubles_serve() -> None:
    options = DemoOptions()
    model = options.model
    capacity = demo_manifest(options)["spec"]["capacity"]
    assert capacity["prefillTokensPerSecond"] == model.prefill_tokens_per_second
    assert capacity["decodeKvTokens"] == model.kv_tokens
    config = model.engine_config()
    assert config.kv_capacity_tokens == model.kv_tokens
    timing = config.timing
    assert timing.prefill_tokens_per_second == model.prefill_tokens_per_second
    # A decode step over n requests takes t0·(1 + n/k): k is the declared knee.
    knee = timing.decode_step_seconds / timing.decode_step_seconds_per_request
    assert capacity["decodeConcurrency"] == round(knee)


def test_real_engines_get_the_task_at_their_scale() -> None:
    # Prompts and tool results 0.45 of the doubles', outputs 2.5 times theirs: a reasoning
    # answer of ~750 tokens, contexts up to 3,600 tokens.
    task = CODING_DEMO.scaled(SGLANG_TOKEN_SCALE, output=SGLANG_OUTPUT_SCALE)
    assert task.prompt.median == CODING_DEMO.prompt.median * SGLANG_TOKEN_SCALE
    assert task.reasoning.output.median == CODING_DEMO.reasoning.output.median * 2.5
    assert task.tools.result_tokens.median == CODING_DEMO.tools.result_tokens.median * 0.45
    assert task.max_context == int(CODING_DEMO.max_context * SGLANG_TOKEN_SCALE)


# The tiny model the real-engine demo serves: its context (max_position_embeddings).
TINY_MODEL_CONTEXT = 4096
# The CPU engine's speeds, as pairs: on an idle core (`prorsa profile`: θ_P 14,050
# tokens/s, a decode knee of 4 requests; docs/benchmarks.md), and as `make demo-sglang`
# measured them with three engines on two cores at load 12 (docs/demo.md: about 2,000
# prefill tokens/s and 150-250 decoded tokens/s per engine, whatever the batch).
REAL_SPEEDS = {
    "idle core": EngineModel(
        prefill_tokens_per_second=14_050.0,
        kv_tokens=16_384,
        decode_step_seconds=0.005,
        decode_step_seconds_per_request=0.00125,
    ),
    "shared cores": EngineModel(
        prefill_tokens_per_second=2_000.0,
        kv_tokens=16_384,
        decode_step_seconds=0.01,
        decode_step_seconds_per_request=0.004,
    ),
}


@pytest.mark.parametrize("task", sorted(DEMO_TASKS))
def test_a_real_engine_call_fits_the_tiny_models_context(task: str) -> None:
    scaled = DEMO_TASKS[task].scaled(SGLANG_TOKEN_SCALE, output=SGLANG_OUTPUT_SCALE)
    # The trainer caps an answer at max_context minus the prompt, so no call asks past it.
    assert scaled.max_context <= TINY_MODEL_CONTEXT
    assert scaled.max_context <= SGLANG_MODEL.kv_tokens


@pytest.mark.parametrize("speeds", sorted(REAL_SPEEDS))
def test_each_phase_leans_its_own_way_on_three_real_engines(speeds: str) -> None:
    """With the real engines' sizing (3 instances, 3 live trajectories each), the tools
    phase asks Eq. 1 for 2P:1D and the reasoning phase for 1P:2D, the one ask at least
    twice the other, on an idle core as on two shared ones; the reasoning phase's KV fits
    two decode engines and overfills one."""
    task = CODING_DEMO.scaled(SGLANG_TOKEN_SCALE, output=SGLANG_OUTPUT_SCALE)
    model = REAL_SPEEDS[speeds]
    live = SGLANG_TRAJECTORIES_PER_INSTANCE * 3
    tools = steady_state(task, "tools", model, live=live, decode_instances=1)
    reasoning = steady_state(task, "reasoning", model, live=live, decode_instances=2)
    assert tools.prefill > 2 * tools.decode_kv, tools
    assert reasoning.decode_kv > 2 * reasoning.prefill, reasoning
    assert 1.0 < reasoning.decode_kv < 1.6, reasoning
    assert eq1(tools, budget=3) == (2, 1), tools
    assert eq1(reasoning, budget=3) == (1, 2), reasoning
