"""How much could any switching policy gain over the best static split in one setting?

A hindsight search over role schedules in the rollout simulator, to read the benchmark's
"Prorsa vs best static" column against what switching can give at all:

- every static split;
- two-phase schedules: split X until time T, then split Y (|X - Y| <= 3), for each T given;
- weight-update bursts: split X, and split Y for D seconds after every weight update (the
  re-prefill of every carried-over trajectory), for D in 30, 60, 100, 150 s.

Each schedule is executed like the Controller's switches (least-loaded instance first, the
same drain, switch time and cache flush). The schedules read the simulator's clock and its
trainer's version directly: an upper bound for such schedules, not a policy.

    python scripts/schedule_bound.py deepseek-v3 coding 8 --at 300,1000,2000,3000
    python scripts/schedule_bound.py qwen3-tp8 coding 8 --at '' --splits 3,4,5
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from prorsa_lab.sim.engine import DECODE, PREFILL
from prorsa_lab.sim.policies import _least_loaded, _split
from prorsa_lab.sim.simulator import Scenario, Simulation, simulate


@dataclass(frozen=True)
class Plan:
    first: int  # prefill instances at the start
    then: int  # prefill instances after `at`, or during a burst
    at: float = float("inf")  # two-phase: switch at this time
    burst: float = 0.0  # burst: hold `then` this long after each weight update

    @property
    def label(self) -> str:
        if self.burst:
            return f"{self.first}P, {self.then}P for {self.burst:.0f}s after each update"
        if self.at == float("inf"):
            return f"static {self.first}P"
        return f"{self.first}P, {self.then}P from {self.at:.0f}s"


class Scheduled:
    """Follows a :class:`Plan`, checking every 5 s."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.name = plan.label
        self._version = 0
        self._until = -1.0

    def initial_roles(self, sim: Simulation) -> list[str]:
        return _split(sim.scenario.instances, self.plan.first)

    def attach(self, sim: Simulation) -> None:
        self.sim = sim
        sim.loop.every(5.0, self.tick, start=5.0)

    def target(self, now: float) -> int:
        p = self.plan
        if p.burst:
            if self.sim.trainer.version != self._version:
                self._version = self.sim.trainer.version
                self._until = now + p.burst
            return p.then if now < self._until else p.first
        return p.then if now >= p.at else p.first

    def tick(self, now: float) -> None:
        cl = self.sim.cluster
        cur = sum(
            1
            for i in cl.instances
            if (i.switch is None and i.role == PREFILL)
            or (i.switch is not None and i.switch.to == PREFILL)
        )
        need = self.target(now) - cur
        if not need:
            return
        src, dst = (DECODE, PREFILL) if need > 0 else (PREFILL, DECODE)
        pool = [i for i in cl.instances if i.role == src and i.switch is None]
        for inst in _least_loaded(pool, src)[: abs(need)]:
            cl.start_switch(inst.name, dst)


def run(job: tuple[Scenario, Plan]) -> tuple[Plan, float]:
    scenario, plan = job
    return plan, simulate(scenario, Scheduled(plan)).makespan  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("task")
    ap.add_argument("staleness", type=int)
    ap.add_argument("--at", default="300,1000,2000", help="two-phase switch times, seconds")
    ap.add_argument("--steps", type=int, default=3, help="training steps (the benchmark's 3)")
    ap.add_argument("--groups", type=int, default=None, help="groups per step (task default)")
    ap.add_argument(
        "--splits",
        default="",
        help="prefill instances to start schedules from, e.g. 3,4,5, moving at most 3 "
        "(default: every split, every move)",
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    scenario = Scenario(
        model=args.model,
        task=args.task,
        staleness=args.staleness,
        steps=args.steps,
        groups_per_step=args.groups,
    )
    n = scenario.instances
    firsts = [int(x) for x in args.splits.split(",") if x] or list(range(1, n))
    plans = [Plan(k, k) for k in range(1, n)]
    for t in (float(x) for x in args.at.split(",") if x):
        plans += [Plan(x, y, at=t) for x in firsts for y in range(1, n) if 0 < abs(x - y) <= 3]
    plans += [
        Plan(x, y, burst=d)
        for x in firsts
        for y in range(x + 1, min(x + 4, n) if args.splits else n)
        for d in (30, 60, 100, 150)
    ]
    results: list[tuple[Plan, float]] = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for i, r in enumerate(pool.map(run, [(scenario, p) for p in plans]), 1):
            results.append(r)
            print(f"\r[{i}/{len(plans)}] {r[0].label:<45}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    static = min(m for p, m in results if p.first == p.then)
    results.sort(key=lambda r: r[1])
    print(f"{scenario.label}: best static {static:.0f} s; best schedules:")
    for plan, makespan in results[:8]:
        print(f"  {makespan:8.0f} s  {static / makespan:5.3f}x  {plan.label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
