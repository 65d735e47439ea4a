"""The benchmark grid: every model x task x staleness, every policy, in parallel processes.

Each (setting, policy) pair is one deterministic simulation; the static sweep is one run per
split. Jobs run in a process pool (one worker per CPU by default) and come back as plain
dicts, so that the table, the JSON and the picture are all built from the same numbers.

The foresight reference (:mod:`prorsa_lab.sim.reference`) of a setting starts from the best
static split, so it runs once that setting's static sweep is in; the longest jobs start
first, and a reference with the pool to itself forks over every worker.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

from prorsa_lab.sim.policies import baseline
from prorsa_lab.sim.reference import CADENCE_SECONDS, MOVES, Reference
from prorsa_lab.sim.simulator import (
    SMG_DRAIN_SECONDS,
    SMG_REGISTER_SECONDS,
    Scenario,
    SimResult,
    simulate,
)

DYNAMIC = ("reactive", "throughput", "prorsa", "oracle")
REPORTED = ("colocation", "best-static", *DYNAMIC, "reference")


@dataclass(frozen=True, slots=True, kw_only=True)
class GridConfig:
    # Attention data parallel over a tensor-parallel MoE first (where PD pays), then the
    # attention tensor-parallel deployments (where the product advises colocation). The
    # EP deployments SGLang cannot flip (qwen3-235b, deepseek-v3) run on request.
    models: tuple[str, ...] = (
        "deepseek-v3-dp8",
        "qwen3-dp8",
        "qwen3-dp4",
        "qwen3-dp2",
        "deepseek-v3-dp16",
        "qwen3-tp8",
        "deepseek-v3-tp16",
    )
    tasks: tuple[str, ...] = ("math", "coding", "general")
    staleness: tuple[int, ...] = (0, 2, 8)
    steps: int = 3
    seed: int = 1
    instances: int = 8
    scale: float = 1.0  # multiplies every task's groups per step (at least one group)
    hicache_ratio: float = 2.0  # HiCache host tier over the GPU pool; 0: GPU-only caches
    kv_store: str = "per-instance"  # Scenario.kv_store: "shared" keeps prefix KV through flips
    weight_update_events: bool = True  # the trainer announces weight updates
    weight_update_seconds: float | None = None  # Scenario.weight_update_seconds (measured)
    # Scenario.router_drain/register_seconds: smg's, as measured
    router_seconds: tuple[float, float] = (SMG_DRAIN_SECONDS, SMG_REGISTER_SECONDS)
    prefill_events: str = "full"  # the prefill events it sends (trainer.PREFILL_EVENTS)
    smoothing: float | None = None  # switching.smoothingSeconds; None: the spec default
    static: tuple[int, ...] | None = None  # prefill counts to sweep; None: all 1..n-1
    # Scenario.dp_routing: None is what the operator deploys (smg --dp-aware for DP engines)
    dp_routing: str | None = None
    policies: tuple[str, ...] = ("colocation", "static", *DYNAMIC, "reference")
    # The reference decides at each weight update and every reference_cadence seconds;
    # None: the best static makespan over reference_points, at least CADENCE_SECONDS (the
    # whole grid must run in 40 minutes on 2 cores: docs/benchmarks.md).
    reference_cadence: float | None = None
    reference_points: int = 6
    reference_moves: tuple[int, ...] = MOVES

    def scenarios(self) -> list[Scenario]:
        from prorsa_lab.sim.workloads import get_task

        out = []
        for model in self.models:
            for task in self.tasks:
                groups = max(1, round(get_task(task).groups_per_step * self.scale))
                for s in self.staleness:
                    out.append(
                        Scenario(
                            model=model,
                            task=task,
                            staleness=s,
                            steps=self.steps,
                            seed=self.seed,
                            instances=self.instances,
                            groups_per_step=groups,
                            hicache_ratio=self.hicache_ratio,
                            kv_store=self.kv_store,  # type: ignore[arg-type]
                            weight_update_events=self.weight_update_events,
                            weight_update_seconds=self.weight_update_seconds,
                            router_drain_seconds=self.router_seconds[0],
                            router_register_seconds=self.router_seconds[1],
                            prefill_events=self.prefill_events,  # type: ignore[arg-type]
                            smoothing=self.smoothing,
                            dp_routing=self.dp_routing,  # type: ignore[arg-type]
                        )
                    )
        return out

    def static_splits(self) -> tuple[int, ...]:
        return self.static or tuple(range(1, self.instances))

    def cadence(self, best_static: float) -> float:
        """The reference's seconds between periodic decisions for one setting."""
        if self.reference_cadence is not None:
            return self.reference_cadence
        span = best_static if math.isfinite(best_static) else 24 * 3600.0
        return max(CADENCE_SECONDS, span / max(1, self.reference_points))


@dataclass(frozen=True, slots=True)
class ReferenceRun:
    """How one setting's reference runs: from the best static split, whose makespan is
    its first "hold", deciding every ``cadence`` seconds, forking over ``workers``."""

    start: int
    known: float
    cadence: float
    moves: tuple[int, ...]
    workers: int = 1


@dataclass(frozen=True, slots=True)
class Job:
    scenario: Scenario
    policy: str
    detail: bool  # keep windows and timeline (for the picture)
    reference: ReferenceRun | None = None  # the reference's settings, once they are known


def _cost(job: Job) -> float:
    """A rough relative cost, to start the longest jobs first."""
    sc = job.scenario
    task = {"coding": 4.0, "general": 1.5, "math": 1.0}.get(sc.task, 1.0)
    model = 1.5 if sc.model.startswith("deepseek") else 1.0
    policy = {"colocation": 2.0, "prorsa": 2.0, "reference": 12.0}.get(job.policy, 1.0)
    return task * model * policy * (1 + sc.staleness) * sc.steps


def jobs(config: GridConfig) -> list[Job]:
    """Every simulation of the grid; a reference job waits for its setting's statics."""
    out: list[Job] = []
    for sc in config.scenarios():
        for name in config.policies:
            if name == "static":
                out.extend(Job(sc, f"static-{p}", False) for p in config.static_splits())
            else:
                out.append(Job(sc, name, name in ("prorsa", "oracle", "reference")))
    return out


def summarize(result: SimResult, *, detail: bool) -> dict[str, Any]:
    sc = result.scenario
    out: dict[str, Any] = {
        "model": sc.model,
        "task": sc.task,
        "staleness": sc.staleness,
        "seed": sc.seed,
        "dpRouting": "dp-aware" if sc.dp_aware() else "round-robin",
        "kvStore": sc.kv_store,
        "policy": result.policy,
        "weightUpdateSeconds": sc.update_seconds(),
        "routerSeconds": [sc.router_drain_seconds, sc.router_register_seconds],
        "makespan": result.makespan,
        "idleRatio": result.idle_ratio,
        "switches": result.switches,
        "aborted": result.aborted,
        "dropped": result.dropped,
        "trajectories": result.trajectories,
        "meanCompletion": result.mean_completion,
        "wapePrefill": result.wape_prefill,
        "wapeDecode": result.wape_decode,
        "decodeKvUtilisation": result.decode_kv_utilisation,
        "admissionQueue": result.admission_queue,
        "controllerAccuracy": result.controller_accuracy,
        "wall": result.wall_seconds,
        "extra": result.extra,
    }
    if detail:
        out["windows"] = result.windows
        out["timeline"] = result.timeline
    return out


def run_job(job: Job) -> dict[str, Any]:
    if job.policy == "reference":
        ref = job.reference
        if ref is None:
            raise ValueError("a reference job needs its setting's best static split")
        policy: Any = Reference(
            start=ref.start,
            known_makespan=ref.known,
            cadence=ref.cadence,
            moves=ref.moves,
            workers=ref.workers,
        )
    else:
        policy = baseline(job.policy)
    result = simulate(job.scenario, policy)
    return summarize(result, detail=job.detail)


def _reference_run(
    job: Job, statics: dict[int, float], config: GridConfig | None, workers: int
) -> Job:
    """The reference job of a setting, from its finished static sweep."""
    start = min(statics, key=lambda n: (statics[n], n))
    best = statics[start]
    cfg = config or GridConfig()
    run = ReferenceRun(
        start=start,
        known=best,
        cadence=cfg.cadence(best),
        moves=cfg.reference_moves,
        workers=workers,
    )
    return replace(job, reference=run)


def run_jobs(
    todo: Sequence[Job],
    *,
    workers: int | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    config: GridConfig | None = None,
) -> list[dict[str, Any]]:
    """Run every job, longest first; a reference once its setting's statics are in.

    At most ``workers`` simulations run at once. A reference job left with idle workers
    and nothing else to run (the last ones, or a grid of one setting) forks over them.
    """
    workers = workers or os.cpu_count() or 1
    ready = sorted((j for j in todo if j.policy != "reference"), key=_cost, reverse=True)
    waiting = {j.scenario: j for j in todo if j.policy == "reference"}
    statics: dict[Scenario, dict[int, float]] = {}
    pending = {
        sc: sum(1 for j in todo if j.scenario == sc and j.policy.startswith("static-"))
        for sc in waiting
    }
    for sc, n in pending.items():
        if n == 0:
            raise ValueError(f"the reference of {sc.label} needs the static sweep")
    results: list[dict[str, Any]] = []

    def done(r: dict[str, Any], job: Job) -> None:
        results.append(r)
        if progress:
            progress(r)
        sc = job.scenario
        if sc in waiting and job.policy.startswith("static-"):
            n_p = int(job.policy.removeprefix("static-").removesuffix("P"))
            statics.setdefault(sc, {})[n_p] = r["makespan"]
            pending[sc] -= 1

    # Fewer references than workers (a grid of one setting): they run last, each forking
    # over its share of the workers; otherwise one process each, as soon as they can.
    late = 0 < len(waiting) < workers

    def next_jobs(free: int, running: int) -> list[Job]:
        out: list[Job] = []
        refs = [sc for sc, left in pending.items() if left == 0 and sc in waiting]
        refs.sort(key=lambda sc: _cost(waiting[sc]), reverse=True)
        if late and (ready or running):
            refs = []
        share = max(1, workers // len(waiting)) if late and waiting else 1
        while free > 0 and (refs or ready):
            if refs:
                sc = refs.pop(0)
                out.append(_reference_run(waiting.pop(sc), statics[sc], config, share))
            else:
                out.append(ready.pop(0))
            free -= 1
        return out

    if workers <= 1:
        while ready or waiting:
            batch = next_jobs(1, 0)
            if not batch:
                raise RuntimeError("reference jobs wait for statics that never ran")
            job = batch[0]
            done(run_job(job), job)
        return results
    with ProcessPoolExecutor(max_workers=workers) as pool:
        flying: dict[Future[dict[str, Any]], Job] = {}
        while ready or waiting or flying:
            for job in next_jobs(workers - len(flying), len(flying)):
                flying[pool.submit(run_job, job)] = job
            if not flying:
                raise RuntimeError("reference jobs wait for statics that never ran")
            finished, _ = wait(flying, return_when=FIRST_COMPLETED)
            for fut in finished:
                job = flying.pop(fut)
                done(fut.result(), job)
    return results


@dataclass
class SettingRow:
    model: str
    task: str
    staleness: int
    makespan: dict[str, float] = field(default_factory=dict)  # REPORTED policy -> seconds
    best_static: int = 0  # prefill instances of the best static split
    task_static: int = 0  # prefill instances of the task's one split (paper §5.4 baseline)
    instances: int = 8
    colocation_idle: float | None = None
    wape_prefill: float | None = None
    wape_decode: float | None = None
    details: dict[str, dict[str, Any]] = field(default_factory=dict)
    statics: dict[int, float] = field(default_factory=dict)  # prefill count -> makespan

    @property
    def role_switch_capable(self) -> bool:
        from prorsa_lab.sim.costmodel import load_profile

        return load_profile(self.model).role_switch_capable

    @property
    def dp_size(self) -> int:
        """Attention data-parallel ranks per instance (1: attention tensor parallel)."""
        from prorsa_lab.sim.costmodel import load_profile

        return load_profile(self.model).ranks

    @property
    def attention(self) -> str:
        """``dp`` when attention runs data parallel (several ranks per instance), else
        ``tp``: the product advises colocation there, PD where ranks meet at the MoE."""
        return "dp" if self.dp_size > 1 else "tp"

    @property
    def regime(self) -> str:
        """``kv-bound`` when the best static split's decode side runs out of KV.

        That is, requests wait for decode admission (more than one per decode instance on
        average) or decode KV averages 80% full or more; otherwise ``latency-bound``: every
        decode fits and the split only trades step times.
        """
        best = self.details.get("best-static")
        if best is None:
            return "latency-bound"
        kv_full = best["decodeKvUtilisation"] >= 0.8 or best["admissionQueue"] > 1.0
        return "kv-bound" if kv_full else "latency-bound"

    def speedup(self, policy: str, *, over: str) -> float | None:
        base = self.makespan.get(over)
        mine = self.makespan.get(policy)
        if base is None or mine is None or mine <= 0:
            return None
        return base / mine


def aggregate(results: Iterable[dict[str, Any]], *, instances: int) -> list[SettingRow]:
    rows: dict[tuple[str, str, int], SettingRow] = {}
    statics: dict[tuple[str, str, int], dict[int, dict[str, Any]]] = {}
    for r in results:
        key = (r["model"], r["task"], r["staleness"])
        row = rows.setdefault(key, SettingRow(*key, instances=instances))
        name = r["policy"]
        if name.startswith("static-"):
            n_p = int(name.removeprefix("static-").removesuffix("P"))
            statics.setdefault(key, {})[n_p] = r
            continue
        row.makespan[name] = r["makespan"]
        if name == "colocation":
            row.colocation_idle = r["idleRatio"]
        if name == "prorsa":
            row.wape_prefill = r["wapePrefill"]
            row.wape_decode = r["wapeDecode"]
        row.details[name] = r
    for key, found in statics.items():
        rows[key].statics = {n: found[n]["makespan"] for n in sorted(found)}
        n_p = min(found, key=lambda n: (found[n]["makespan"], n))
        rows[key].makespan["best-static"] = found[n_p]["makespan"]
        rows[key].best_static = n_p
        rows[key].details["best-static"] = found[n_p]
    _task_statics(rows, statics)
    order = {"math": 0, "coding": 1, "general": 2}
    return sorted(rows.values(), key=lambda r: (r.model, order.get(r.task, 9), r.task, r.staleness))


def _task_statics(
    rows: dict[tuple[str, str, int], SettingRow],
    statics: dict[tuple[str, str, int], dict[int, dict[str, Any]]],
) -> None:
    """The paper's static baseline (§5.4): one split per task for every setting of it.

    The paper picks the best ratio per task (4:4 math, 5:3 coding, 3:5 general) and keeps
    it across models and staleness. Here that is the split with the smallest geometric
    mean of makespan over the best static one, across every setting of the task.
    """
    tasks = {key[1] for key in statics}
    for task in tasks:
        keys = [k for k in statics if k[1] == task]
        common = set.intersection(*(set(statics[k]) for k in keys))
        scores: dict[int, float] = {}
        for n_p in common:
            logs = []
            for k in keys:
                mine, best = statics[k][n_p]["makespan"], rows[k].makespan["best-static"]
                logs.append(math.log(mine / best) if math.isfinite(mine) else math.inf)
            scores[n_p] = sum(logs) / len(logs)
        if not scores:
            continue
        pick = min(scores, key=lambda n: (scores[n], n))
        for k in keys:
            rows[k].task_static = pick
            rows[k].makespan["task-static"] = statics[k][pick]["makespan"]
