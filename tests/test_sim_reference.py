"""The foresight reference: forks of the simulator that decide which split to keep.

What a reader of the benchmark relies on: a fork goes on exactly as the run it was copied
from, the reference never ends worse than the split it started from, it decides at each
weight update and every ``cadence`` seconds, and its forks give the same answer in parallel.
"""

from __future__ import annotations

import math
import pickle

import pytest

from prorsa_lab.sim.policies import Static
from prorsa_lab.sim.reference import Reference, move_to, run_fork
from prorsa_lab.sim.runner import GridConfig, Job, jobs, run_jobs
from prorsa_lab.sim.simulator import Scenario, Simulation, simulate

SMALL = Scenario(model="qwen3-dp2", task="general", staleness=8, steps=2, groups_per_step=1)


class _Snap(Static):
    """A static split that snapshots its simulation at ``at`` seconds."""

    def __init__(self, prefill: int, at: float) -> None:
        super().__init__(prefill)
        self.at = at
        self.snapshot = b""

    def attach(self, sim: Simulation) -> None:
        self.sim = sim
        sim.loop.at(self.at, self._snap)

    def _snap(self) -> None:
        self.snapshot = pickle.dumps(self.sim)


def test_a_fork_goes_on_exactly_as_the_run_it_was_copied_from() -> None:
    policy = _Snap(3, at=60.0)
    whole = simulate(SMALL, policy)
    assert policy.snapshot and math.isfinite(whole.makespan)
    fork: Simulation = pickle.loads(policy.snapshot)
    assert fork.loop.now == 60.0
    fork.loop.run(until=SMALL.time_limit)
    assert fork.trainer.finished_at == whole.makespan  # to the last bit
    # run_fork with the split it already has is the same run.
    assert run_fork(policy.snapshot, 3, SMALL.time_limit) == whole.makespan


def test_holding_its_start_split_the_reference_is_that_static_split() -> None:
    static = simulate(SMALL, Static(3))
    held = simulate(SMALL, Reference(start=3, moves=(), cadence=30.0))
    assert held.makespan == static.makespan
    assert held.switches == 0
    decisions = held.extra["schedule"]
    assert decisions and all(d["chosen"] == d["split"] == 3 for d in decisions)


def test_each_decision_keeps_the_least_foreseen_makespan_and_the_run_ends_there() -> None:
    static = simulate(SMALL, Static(1))
    ref = Reference(start=1, cadence=45.0, known_makespan=static.makespan)
    result = simulate(SMALL, ref)
    decisions = result.extra["schedule"]
    assert {d["why"] for d in decisions} == {"periodic", "weights"}
    assert any(d["why"] == "weights" for d in decisions)  # the update of a 2-step run
    periodic = [d["at"] for d in decisions if d["why"] == "periodic"]
    assert periodic == [45.0 * k for k in range(1, len(periodic) + 1)]
    hold = static.makespan
    for d in decisions:
        found = {int(k): v for k, v in d["makespans"].items()}
        assert found[d["split"]] == hold  # the previous choice's foresight is the hold
        assert set(found) - {d["split"]} <= {d["split"] + m for m in (-2, -1, 1, 2)}
        kept = found[d["chosen"]]
        assert kept is not None and kept <= hold
        for makespan in found.values():
            assert makespan is None or makespan >= kept  # none foreseen better was left
            if makespan == hold:
                assert d["chosen"] == d["split"] or kept < hold  # ties hold
        hold = kept
    assert any(d["chosen"] != d["split"] for d in decisions)  # split 1 is a poor start
    assert result.makespan == hold == result.extra["foreseenMakespan"]
    assert result.makespan < static.makespan


def test_forks_in_parallel_give_the_same_schedule() -> None:
    serial = simulate(SMALL, Reference(start=2, cadence=60.0))
    parallel = simulate(SMALL, Reference(start=2, cadence=60.0, workers=2))
    assert parallel.makespan == serial.makespan
    assert parallel.extra["schedule"] == serial.extra["schedule"]


def test_move_to_counts_switches_in_flight_and_refuses_what_cannot_be_reached() -> None:
    sim = Simulation(SMALL, Static(2))
    sim.policy.attach(sim)
    assert move_to(sim, 4)  # two decode instances start switching to prefill
    assert sum(1 for i in sim.cluster.instances if i.switch is not None) == 2
    assert move_to(sim, 4)  # already on its way: nothing more to start
    assert not move_to(sim, 8)  # no split leaves decode without an instance


def test_the_grid_runs_each_reference_from_its_best_static_split() -> None:
    cfg = GridConfig(
        models=("qwen3-dp2",),
        tasks=("general",),
        staleness=(8,),
        steps=1,
        scale=0.125,
        static=(2, 3, 4),
        policies=("static", "reference"),
        reference_cadence=40.0,
    )
    results = run_jobs(jobs(cfg), workers=1, config=cfg)
    statics = {r["policy"]: r["makespan"] for r in results if r["policy"].startswith("static")}
    (ref,) = [r for r in results if r["policy"] == "reference"]
    assert ref["makespan"] <= min(statics.values())
    first = ref["extra"]["schedule"][0]
    best = min(statics, key=lambda p: (statics[p], p))
    assert f"static-{first['split']}P" == best
    assert ref["extra"]["cadenceSeconds"] == 40.0
    with pytest.raises(ValueError, match="static sweep"):
        run_jobs([Job(cfg.scenarios()[0], "reference", False)], workers=1, config=cfg)
    # In a pool of two the one reference runs last and forks over both: the same answer.
    pooled = run_jobs(jobs(cfg), workers=2, config=cfg)
    assert sorted((r["policy"], r["makespan"]) for r in pooled) == sorted(
        (r["policy"], r["makespan"]) for r in results
    )


def test_the_default_cadence_follows_the_best_static_makespan() -> None:
    cfg = GridConfig()
    assert cfg.cadence(6000.0) == 1000.0
    assert cfg.cadence(200.0) == 60.0  # never below the 30-60 s
    assert cfg.cadence(math.inf) > 0
    assert GridConfig(reference_cadence=45.0).cadence(6000.0) == 45.0
