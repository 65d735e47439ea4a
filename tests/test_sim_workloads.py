"""Task profiles: seeded, reproducible, and calibrated to the figures in the notes."""

from __future__ import annotations

import statistics

import pytest

from prorsa_lab.sim.workloads import TASKS, TEMPLATE_TOKENS, get_task

CTX = 131072


def scripts(task: str, n: int, *, seed: int = 1, group_size: int | None = None) -> list:
    t = get_task(task)
    g = group_size or t.group_size
    return [t.script(seed=seed, index=i, group=i // g, max_context=CTX) for i in range(n)]


def test_same_seed_same_trajectories_other_seed_other_ones() -> None:
    a = scripts("coding", 40)
    assert a == scripts("coding", 40)
    assert a != scripts("coding", 40, seed=2)


def test_group_members_share_the_prompt_but_not_the_rollout() -> None:
    group = scripts("coding", 32)
    assert len({s.prompt for s in group}) == 1
    assert len({len(s.turns) for s in group}) > 1


def test_coding_agent_matches_the_notes() -> None:
    """~38-40 model calls, bash ~5.9 s on average, reads/edits < 0.1 s, cold tens of s."""
    s = scripts("coding", 3000)
    turns = statistics.mean(len(x.turns) for x in s)
    assert 33 <= turns <= 43
    bash = [t.tool_seconds for x in s for t in x.turns if t.tool == "bash"]
    assert statistics.mean(bash) == pytest.approx(5.9, rel=0.15)
    quick = [t.tool_seconds for x in s for t in x.turns if t.tool in ("read", "edit")]
    assert statistics.median(quick) < 0.1
    assert 15 <= statistics.mean(x.cold_seconds for x in s) <= 45
    assert statistics.mean(x.prewarm_seconds for x in s) == pytest.approx(1.0, rel=0.2)
    assert all(10 <= x.reward_seconds <= 120 for x in s)
    results = [t.result_tokens for x in s for t in x.turns if t.tool]
    assert 100 <= statistics.median(results) <= 2000  # hundreds to thousands of tokens
    assert get_task("coding").group_size == 32


def test_general_agent_and_math_match_the_notes() -> None:
    g = scripts("general", 1000)
    assert all(1 <= len(x.turns) <= 20 for x in g)
    assert min(len(x.turns) for x in g if x.turns[-1].finish == "stop") >= 5
    assert all(1.0 <= t.tool_seconds <= 10.0 for x in g for t in x.turns if t.tool)
    m = scripts("math", 1000)
    assert all(1 <= len(x.turns) <= 3 for x in m)
    finals = [x.turns[-1].output for x in m]
    assert 4000 <= statistics.median(finals) <= 16384  # long decodes of 4-16k tokens
    assert get_task("math").group_size == 8


def test_context_accounting_and_length_cap() -> None:
    t = get_task("coding")
    small = t.script(seed=3, index=5, group=0, max_context=20_000)
    ctx = small.prompt
    for k, turn in enumerate(small.turns):
        assert small.context_after(k) == ctx + turn.output + turn.result_tokens + TEMPLATE_TOKENS
        ctx = small.context_after(k)
    # A 20k-token window ends long SWE episodes with finish=length, never accepted.
    capped = [t.script(seed=3, index=i, group=0, max_context=20_000) for i in range(50)]
    cut = [s for s in capped if s.turns[-1].finish == "length"]
    assert cut and not any(s.accepted for s in cut)


def test_unknown_task_is_named() -> None:
    with pytest.raises(ValueError, match="coding"):
        get_task("poetry")
    assert set(TASKS) == {"math", "coding", "general"}
