"""The foresight reference: the split schedule a policy that could see the future would keep.

At each decision point (every ``cadence`` seconds of virtual time, and at each weight
update) :class:`Reference` forks the simulator once per candidate split (the current split
and ±1, ±2 prefill instances by default), moves the fork to its candidate the way the
operator's executor does (the least-loaded instances first: the same drain, router delays,
flip and cache flush as every other switch in the simulator), runs each fork to the end of
the run holding that split, and keeps the candidate with the least remaining makespan;
on a tie it holds. It is not a policy anyone can deploy: it reads the simulator's future.
It is the figure the Controller is judged against.

Forks are copies of the whole simulation made with :mod:`pickle` (the event loop holds only
data and bound methods): one snapshot per decision point, unpickled once per candidate.
Replaying the run from its seed to the decision point would cost the elapsed part of the
run again for every fork; a snapshot costs a fraction of a second (``forkSeconds`` in the
result says how much). The simulation is deterministic, so a fork that holds the split the
main run then keeps is the main run: the remaining makespan of the split chosen at one
decision point is the "hold" candidate of the next, and it is not simulated again.

The reference starts from a given split (the benchmark passes the best static split, whose
makespan is then the first "hold"), so what it finds is a gain over that split: every
choice is a strict improvement on the makespan the previous one foresaw, and the run ends
at the makespan of the last choice. Forks run in parallel over ``workers`` processes.
"""

from __future__ import annotations

import math
import pickle
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from prorsa_lab.sim.engine import DECODE, PREFILL
from prorsa_lab.sim.loop import SimulationError
from prorsa_lab.sim.policies import _least_loaded, _split

if TYPE_CHECKING:
    from prorsa_lab.sim.simulator import SimResult, Simulation

# The candidates: the current split, one and two instances either way.
MOVES: tuple[int, ...] = (-2, -1, 1, 2)
CADENCE_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class DecisionPoint:
    """One decision point: what each candidate split would leave, and what was kept."""

    at: float
    why: str  # "periodic" or "weights"
    split: int  # prefill instances before the decision (switches in flight counted)
    chosen: int
    # Candidate prefill instances -> makespan of the run if it moves there now and holds;
    # None: the fork ran past the hold's makespan and was cut (it cannot win).
    makespans: dict[int, float | None] = field(default_factory=dict)

    @property
    def moved(self) -> bool:
        return self.chosen != self.split


def _prefill_target(sim: Simulation) -> int:
    """Prefill instances, counting each switch in flight as done."""
    n = 0
    for inst in sim.cluster.instances:
        job = inst.switch
        if (job is None and inst.role == PREFILL) or (job is not None and job.to == PREFILL):
            n += 1
    return n


def move_to(sim: Simulation, target: int) -> bool:
    """Start the switches that bring the split to ``target`` prefill instances (False: not
    enough instances free to switch, or a split without one of the roles), least-loaded
    first, as the operator's executor."""
    if not 1 <= target <= len(sim.cluster.instances) - 1:
        return False
    need = target - _prefill_target(sim)
    if need == 0:
        return True
    src, dst = (DECODE, PREFILL) if need > 0 else (PREFILL, DECODE)
    pool = [i for i in sim.cluster.instances if i.role == src and i.switch is None]
    if len(pool) < abs(need):
        return False
    for inst in _least_loaded(pool, src)[: abs(need)]:
        if not sim.cluster.start_switch(inst.name, dst):
            return False
    return True


def run_fork(snapshot: bytes, target: int, until: float) -> float:
    """Makespan of the snapshot moved to ``target`` and held to the end (inf: it runs past
    ``until`` or cannot reach the split)."""
    sim: Simulation = pickle.loads(snapshot)
    sim.policy.forked = True  # type: ignore[attr-defined]
    if not move_to(sim, target):
        return math.inf
    try:
        sim.loop.run(until=until)
    except SimulationError:
        return math.inf
    finished = sim.trainer.finished_at
    return finished if finished is not None else math.inf


class Reference:
    """The foresight reference policy (module docstring)."""

    name = "reference"

    def __init__(
        self,
        *,
        start: int | None = None,
        cadence: float = CADENCE_SECONDS,
        moves: tuple[int, ...] = MOVES,
        at_weight_updates: bool = True,
        workers: int = 1,
        known_makespan: float | None = None,
    ) -> None:
        if cadence <= 0:
            raise ValueError("the reference's cadence must be positive")
        self.start = start
        self.cadence = cadence
        self.moves = tuple(sorted(set(moves) - {0}, key=lambda m: (abs(m), m)))
        self.at_weight_updates = at_weight_updates
        self.workers = max(1, workers)
        # The makespan of holding the start split (the static run's, when the caller has
        # it): the first decision then forks only the moves.
        self.hold: float | None = known_makespan
        self.forked = False  # a copy inside a fork: it holds its split and decides nothing
        self.decisions: list[DecisionPoint] = []
        self.forks = 0
        self.fork_seconds = 0.0
        self.snapshot_seconds = 0.0
        self.snapshot_bytes = 0
        self._pool: Executor | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["decisions"] = []  # a fork never reads them
        return state

    def initial_roles(self, sim: Simulation) -> list[str]:
        n = sim.scenario.instances
        start = sim.spec.initial_prefill() if self.start is None else self.start
        if not 1 <= start <= n - 1:
            raise ValueError(f"the reference needs a start split of 1..{n - 1} prefill")
        return _split(n, start)

    def attach(self, sim: Simulation) -> None:
        self.sim = sim
        sim.loop.every(self.cadence, self._periodic, start=self.cadence)
        if self.at_weight_updates:
            sim.trainer.on_new_weights.append(self._on_weights)

    # Decisions run as loop events of their own, so that a snapshot is taken between
    # events (a weight update calls its hooks in the middle of the trainer's step end).
    def _periodic(self, now: float) -> None:
        self.decide(now, "periodic")

    def _on_weights(self, now: float) -> None:
        self.sim.loop.at(now, self.decide, now, "weights")

    def decide(self, now: float, why: str) -> None:
        sim = self.sim
        if self.forked or sim.trainer.finished_at is not None:
            return
        n = sim.scenario.instances
        split = _prefill_target(sim)
        candidates = [split + m for m in self.moves if 1 <= split + m <= n - 1]
        t0 = time.perf_counter()
        snapshot = pickle.dumps(sim, protocol=pickle.HIGHEST_PROTOCOL)
        self.snapshot_seconds += time.perf_counter() - t0
        self.snapshot_bytes = max(self.snapshot_bytes, len(snapshot))
        limit = sim.scenario.time_limit
        hold = self._forks(snapshot, [split], limit)[0] if self.hold is None else self.hold
        # A candidate must beat holding: a fork still running at the hold's end is cut.
        until = min(hold, limit) if math.isfinite(hold) else limit
        found = self._forks(snapshot, candidates, until)
        makespans: dict[int, float | None] = {split: hold}
        chosen, best = split, hold
        for cand, makespan in zip(candidates, found, strict=True):
            makespans[cand] = makespan if math.isfinite(makespan) else None
            if makespan < best:  # strictly: ties hold (candidates go nearest first)
                chosen, best = cand, makespan
        self.decisions.append(
            DecisionPoint(at=now, why=why, split=split, chosen=chosen, makespans=makespans)
        )
        if chosen != split:
            moved = move_to(sim, chosen)
            assert moved, "a candidate its fork reached is reachable in the run"
        self.hold = best

    def _forks(self, snapshot: bytes, targets: list[int], until: float) -> list[float]:
        if not targets:
            return []
        t0 = time.perf_counter()
        self.forks += len(targets)
        if self.workers > 1 and len(targets) > 1:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(max_workers=self.workers)
            out = list(
                self._pool.map(run_fork, [snapshot] * len(targets), targets, [until] * len(targets))
            )
        else:
            out = [run_fork(snapshot, t, until) for t in targets]
        self.fork_seconds += time.perf_counter() - t0
        return out

    def finish(self, sim: Simulation, result: SimResult) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        result.extra["schedule"] = [asdict(d) for d in self.decisions]
        result.extra["forks"] = self.forks
        result.extra["forkSeconds"] = round(self.fork_seconds, 3)
        result.extra["snapshotSeconds"] = round(self.snapshot_seconds, 3)
        result.extra["snapshotBytes"] = self.snapshot_bytes
        result.extra["cadenceSeconds"] = self.cadence
        result.extra["moves"] = list(self.moves)
        result.extra["foreseenMakespan"] = self.hold
