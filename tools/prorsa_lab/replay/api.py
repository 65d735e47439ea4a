"""``replay_recording``: a recorded job replayed on every policy of the rollout simulator.

The replay is closed-loop: the recording gives each trajectory's script and the trainer's
dispatch rule, and the simulator's trainer dispatches each trajectory when that rule would
under the policy being replayed, not at its recorded time, so a faster split really
finishes sooner. Policies: colocation (when every instance has the same GPUs), every
static split, Prorsa (the real Controller with the manifest's settings) and the foresight
reference (:mod:`prorsa_lab.sim.reference`), which starts from the best static split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prorsa.core.spec import SpecError
from prorsa.k8s.manifest_file import load_cluster
from prorsa_lab.replay import verdict
from prorsa_lab.replay.engine_model import (
    KNEE_CONTEXT,
    EngineModel,
    from_capacity,
    from_table,
)
from prorsa_lab.replay.recording import Dispatch, Recording, RecordingError, rebuild
from prorsa_lab.replay.scenario import ReplayScenario, manifest_json
from prorsa_lab.replay.verdict import PolicyRun
from prorsa_lab.sim.runner import GridConfig, Job, run_jobs
from prorsa_lab.sim.trainer import INJECTIONS

# The engine's own role switch (drain and router apart): about 5 s (paper, Appendix C).
SWITCH_SECONDS = 5.0


class ReplayError(ValueError):
    """Input the replay cannot use; the message names the file, field or trajectory."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayReport:
    """Every policy's replay of one recording, and the verdict."""

    recording: Recording
    dispatch: Dispatch  # as replayed (inferred, then overridden by flags)
    engine: EngineModel
    instances: int
    runs: dict[str, PolicyRun]  # by policy name (colocation, static-NP, prorsa, reference)
    notes: tuple[str, ...] = ()

    def makespan(self, policy: str) -> float:
        """Seconds the replay took under ``policy`` (``best-static`` allowed)."""
        return self._run(policy).makespan

    def time_to_count(self, policy: str, n: int) -> float | None:
        """Seconds until ``n`` trajectories completed under ``policy`` (None: fewer did)."""
        return self._run(policy).time_to_count(n)

    def common_count(self) -> int:
        """The most trajectories every policy completed: the count to compare times at."""
        return min((len(r.completed_at) for r in self.runs.values()), default=0)

    @property
    def best_static(self) -> int | None:
        return verdict.best_static(self.runs)

    @property
    def advice(self) -> str:
        return verdict.advice(self.runs, instances=self.instances)

    def rows(self) -> list[dict[str, Any]]:
        return verdict.rows(self.runs, instances=self.instances)

    def _run(self, policy: str) -> PolicyRun:
        if policy == "best-static":
            n_p = self.best_static
            if n_p is None:
                raise KeyError("no static split was replayed")
            policy = f"static-{n_p}P"
        return self.runs[policy]

    def as_json(self) -> dict[str, Any]:
        n_p = self.best_static
        common = self.common_count()
        return {
            "rows": self.rows(),
            "bestStatic": None if n_p is None else {"prefill": n_p, "decode": self.instances - n_p},
            "advice": self.advice,
            "commonCount": common,
            "timeToCommonCount": {
                name: run.time_to_count(common) for name, run in sorted(self.runs.items())
            },
            "dispatch": {
                "groupSize": self.dispatch.group_size,
                "groupsPerStep": self.dispatch.groups_per_step,
                "batch": self.dispatch.batch,
                "staleness": self.dispatch.staleness,
                "injection": self.dispatch.injection,
                "maxConcurrent": self.dispatch.max_concurrent,
                "steps": self.dispatch.steps,
                "weightUpdateSeconds": self.dispatch.weight_update_seconds,
            },
            "recording": {
                "path": self.recording.path,
                "trajectories": len(self.recording.scripts),
                "completed": self.recording.completed,
                "cut": self.recording.cut,
                "dropped": self.recording.dropped,
                "spanSeconds": self.recording.span_seconds,
            },
            "engine": list(self.engine.sources),
        }


def load_recording(events: Path) -> Recording:
    try:
        return rebuild(events)
    except RecordingError as exc:
        raise ReplayError("\n".join(exc.problems)) from None


def _manifest(cluster: Path) -> tuple[Any, dict[str, Any]]:
    """The RolloutCluster and its raw ``spec.capacity`` (to tell a field set from a default)."""
    import yaml

    try:
        rc = load_cluster(cluster)
    except OSError as exc:
        raise ReplayError(f"{cluster}: {exc.strerror}") from None
    except SpecError as exc:
        raise ReplayError("\n".join(f"{cluster}: {p.text()}" for p in exc.problems)) from None
    raw: dict[str, Any] = {}
    for doc in yaml.safe_load_all(cluster.read_text()):
        if isinstance(doc, dict) and doc.get("kind") == "RolloutCluster":
            raw = dict((doc.get("spec") or {}).get("capacity") or {})
            break
    return rc, raw


def replay_recording(
    *,
    events: Path,
    cluster: Path,
    model: str | None = None,
    decode_step_ms: float | None = None,
    knee_context: int = KNEE_CONTEXT,
    kv_pool_tokens: int | None = None,
    staleness: int | None = None,
    groups_per_step: int | None = None,
    injection: str | None = None,
    max_concurrent: int | None = None,
    steps: int | None = None,
    static: Sequence[int] | None = None,
    reference: bool = True,
    policies: Sequence[str] | None = None,
    switch_seconds: float = SWITCH_SECONDS,
    workers: int | None = 1,
    progress: Callable[[str], None] | None = None,
) -> ReplayReport:
    """Replay the recording ``events`` on the deployment of the manifest ``cluster``.

    The dispatch rule is inferred from the recording; each keyword given overrides its
    part. ``model`` picks a committed cost table instead of the manifest's capacity.
    ``policies``: run only these of the rows (e.g. ``("prorsa",)``); ``switch_seconds``:
    the engine's own flip, drain and router apart (SGLang's ``/pd_role_switch``).
    ``workers``: simulations at once (None: one per CPU). Raises :class:`ReplayError`.
    """
    if not (math.isfinite(switch_seconds) and switch_seconds >= 0):
        raise ReplayError(f"switch seconds {switch_seconds}: must be finite and >= 0")
    rc, raw_capacity = _manifest(cluster)
    spec = rc.spec
    if not raw_capacity and model is None:
        raise ReplayError(
            f"{cluster}: no spec.capacity: the replay's engine model is built from it "
            "(run `prorsa profile` and paste its snippet, or pass --model NAME)"
        )
    rec = load_recording(events)
    try:
        engine = (
            from_table(model)
            if model is not None
            else from_capacity(
                spec,
                rec,
                raw_capacity=raw_capacity,
                decode_step_ms=decode_step_ms,
                knee_context=knee_context,
                kv_pool_tokens=kv_pool_tokens,
                source=str(cluster),
            )
        )
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    d = rec.dispatch
    if staleness is not None:
        d = replace(d, staleness=staleness)
    if groups_per_step is not None:
        d = replace(d, groups_per_step=groups_per_step)
    if injection is not None:
        d = replace(d, injection=injection)
    if max_concurrent is not None:
        d = replace(d, max_concurrent=max_concurrent)
    if steps is not None:
        d = replace(d, steps=steps)
    if d.injection not in INJECTIONS:
        raise ReplayError(f"unknown injection {d.injection!r}: one of {', '.join(INJECTIONS)}")
    if d.staleness > 0 and d.injection == "fixedRate" and d.rate_per_second <= 0:
        raise ReplayError(
            "fixedRate injection needs a rate, and the recording shows no mid-step "
            "dispatches to measure one from"
        )
    if d.staleness < 0:
        raise ReplayError(f"staleness {d.staleness}: must be >= 0")
    if d.staleness > 0 and d.max_concurrent is None:
        d = replace(d, max_concurrent=2 * d.batch)
    n = spec.instances
    if n < 2:
        raise ReplayError(f"{cluster}: {n} instance(s): a split needs at least 2")
    scenario = ReplayScenario(
        model=engine.profile.name,
        task="replay",
        staleness=d.staleness,
        steps=d.steps,
        instances=n,
        injection=d.injection,
        groups_per_step=d.groups_per_step,
        max_concurrent=d.max_concurrent if d.staleness > 0 else None,
        switch_seconds=switch_seconds,
        # capacity.prefillCacheTokens: 0 declares engines without a prefix cache (the
        # engine double): every turn then prefills its whole context.
        prefix_cache=raw_capacity.get("prefillCacheTokens") != 0,
        hicache_ratio=0.0 if raw_capacity.get("prefillCacheTokens") == 0 else 2.0,
        cooldown=spec.switching.cooldown_seconds,
        drain_timeout=spec.switching.drain_timeout_seconds,
        horizon=spec.forecast.horizon_seconds,
        weight_update_events=d.weight_update_events,
        prefill_events=d.prefill_events,  # type: ignore[arg-type]
        weight_update_seconds=d.weight_update_seconds,
        engine=engine.profile,
        manifest=manifest_json(spec),
        replayed=rec.scripts,
        group_size=d.group_size,
        rate_per_second=d.rate_per_second,
    )
    notes: list[str] = []
    same_gpus = spec.engine.prefill_gpus_per_instance in (None, spec.engine.gpus_per_instance)
    names = ["colocation"] if same_gpus else []
    if not same_gpus:
        notes.append("colocation left out: prefill and decode instances have different GPUs")
    splits = tuple(static) if static else tuple(range(1, n))
    bad = [p for p in splits if not 1 <= p <= n - 1]
    if bad:
        raise ReplayError(f"static split(s) {bad}: each needs 1..{n - 1} prefill instances")
    names += [f"static-{p}P" for p in splits] + ["prorsa"]
    if reference:
        names.append("reference")
    if policies is not None:
        unknown = sorted(set(policies) - set(names))
        if unknown:
            raise ReplayError(f"policies {unknown}: not among {', '.join(names)}")
        names = [name for name in names if name in policies]
    todo = [Job(scenario, name, True) for name in names]
    done = 0

    def tell(r: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            m = r["makespan"]
            shown = f"{m:.0f} s" if math.isfinite(m) else "did not finish"
            progress(f"[{done}/{len(todo)}] {r['policy']}: {shown}")

    config = GridConfig(instances=n)
    results = run_jobs(todo, workers=workers, progress=tell, config=config)
    runs = {r["policy"]: PolicyRun.from_summary(r) for r in results}
    return ReplayReport(
        recording=rec, dispatch=d, engine=engine, instances=n, runs=runs, notes=tuple(notes)
    )
