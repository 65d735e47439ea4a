"""``prorsa demo``: start everything, run the trainer, watch, summarise, plot.

What runs, all in this process on loopback: the Kubernetes API emulator (its own thread),
the operator (kopf with the real handlers, webhook and ``/metrics``), the fake kubelet
with one engine pod per instance (engine double + real agent) and the router Deployment
as the real smg binary (PyPI ``smg``, in the ``demo`` extra), and the simulated trainer,
which sends every request through smg. Files go to ``--out``: ``kubeconfig`` (valid while
the demo runs), ``demo.log`` (every component's log), ``demo-router.log`` (smg's),
``summary.json``, ``timeline.png``, ``decisions.jsonl`` (every Decision read, with its
reason).

Then, unless ``--baseline none``, the same seeded trajectories run again on a fresh
deployment whose split is pinned (:func:`demo_manifest` with ``static``), for the same
rollout time (with ``--baseline best``, once per split), and the summary sets the
switching run against the fastest static one (:mod:`prorsa_lab.demo.compare`); each
static run's files go to ``--out``/baseline-<N>P<M>D.

The engine doubles are given a timing model and a KV pool, and the RolloutCluster states
the same figures as its profiled capacity (``prefillTokensPerSecond``, ``decodeKvTokens``,
``decodeConcurrency``), as an operator would after profiling real engines; θ_P is then
re-measured online from the agents' busy-time counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import httpx

from prorsa_agent.config import Timeouts
from prorsa_contract.aio import drop_stop_signals, on_stop_signals
from prorsa_contract.labels import NODE_RANK_LABEL, ROLE_LABEL
from prorsa_lab.demo import recorded, replay_check
from prorsa_lab.demo.compare import (
    compare,
    load_average,
    parse_split,
    split_text,
    spread,
    verdict,
)
from prorsa_lab.demo.frame import wrap_lines
from prorsa_lab.demo.job import MULTI_TASK_JOB
from prorsa_lab.demo.lag_parts import parts_line, switch_spans
from prorsa_lab.demo.monitor import Monitor
from prorsa_lab.demo.phase_calls import PhaseCalls, calls_line, phase_calls
from prorsa_lab.demo.phases import (
    PhaseBacklog,
    PhaseChange,
    follows_phases,
    phase_changes,
    phases_line,
    prefill_backlogs,
    split_timeline,
    summary_line,
)
from prorsa_lab.demo.pod_directory import PodDirectory
from prorsa_lab.demo.smg_client import SmgClient
from prorsa_lab.demo.trainer import DemoTrainer, TrainerStats
from prorsa_lab.demo.view import LiveView, PlainView
from prorsa_lab.demo.workload import (
    DEMO_TASKS,
    PATTERNS,
    DemoTask,
    PhaseSchedule,
    default_phase_seconds,
)
from prorsa_lab.doubles.sglang_double import SGLANG_VERSION, EngineConfig, TimingModel
from prorsa_lab.doubles.smg_router import SmgRouter, smg_binary, smg_version
from prorsa_lab.doubles.stack import Stack, cluster_manifest, stack
from prorsa_lab.replay.engine_model import KNEE_CONTEXT
from prorsa_lab.sglang_cpu.environment import CpuEngineEnv, EngineEnvMissing
from prorsa_lab.sglang_cpu.sglang_pod import CPU_TIMEOUTS
from prorsa_sdk import AsyncEventEmitter

log = logging.getLogger("prorsa_lab.demo")

CLUSTER = "demo"
GPUS_PER_INSTANCE = 8


@dataclass(frozen=True, kw_only=True)
class EngineModel:
    """The simulated hardware, and the control settings that fit its time scale.

    The demo runs about ten times faster than a real rollout, so the horizon, the control
    period, the cooldown and the drain timeout are scaled down alike.

    The doubles are slow engines on purpose: everything runs in one Python process on a
    shared machine, where an asyncio sleep takes longer than asked by however long the
    event loop is busy. Coarse decode steps (40 ms, half the tokens of a real engine in the
    time) make that overshoot a small share of each step and halve the tokens streamed,
    and prompts of a few thousand tokens keep the engines' timing, not the CPU, the
    bottleneck. A reasoning phase's decodes fill two instances' KV and fit in three, and a
    tools phase's prompts arrive faster than one instance prefills them (docs/demo.md,
    "Sizing").
    """

    prefill_tokens_per_second: float = 10_000.0
    kv_tokens: int = 40_000
    decode_step_seconds: float = 0.04
    decode_step_seconds_per_request: float = 0.001
    switch_seconds: float = 0.3
    graph_capture_seconds: float = 0.2
    horizon_seconds: float = 1.0
    tick_seconds: float = 1.0
    cooldown_seconds: float = 3.0
    drain_timeout_seconds: float = 1.0
    hysteresis: float = 0.1
    # Five horizons (the default 60 s would lag a 60 s phase by most of it).
    smoothing_seconds: float = 5.0

    @property
    def decode_concurrency(self) -> int:
        """The decode step's half-saturation knee: a step over n requests takes
        t₀·(1 + n/k), so k = t₀ / (seconds per request) (``capacity.decodeConcurrency``)."""
        return round(self.decode_step_seconds / self.decode_step_seconds_per_request)

    def agent_timeouts(self) -> Timeouts:
        """The agent's defaults (5 s health checks, 30 s probes...) at the demo's scale."""
        return Timeouts(
            request=5.0,
            switch=30.0,
            verify=10.0,
            abort_settle=5.0,
            retry_drain=0.5,
            poll=0.05,
            health_interval=1.0,
            health_probe=10.0,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            role="decode",
            kv_capacity_tokens=self.kv_tokens,
            context_length=self.kv_tokens,
            max_running_requests=256,
            # The trainer streams through smg only to see its first token: incremental
            # chunks (whole-output ones cost O(n²)), and few of them.
            incremental_streaming_output=True,
            stream_interval=256,
            timing=TimingModel(
                prefill_tokens_per_second=self.prefill_tokens_per_second,
                decode_step_seconds=self.decode_step_seconds,
                decode_step_seconds_per_request=self.decode_step_seconds_per_request,
                switch_seconds=self.switch_seconds,
                graph_capture_seconds=self.graph_capture_seconds,
            ),
        )


# Live trajectories per instance by default: on four instances the tools phases then ask
# for more than one prefill instance and the reasoning phases for more KV than two decode
# instances hold, so Eq. 1 moves the split both ways, and each side is loaded enough that
# a switch pays for itself within a phase (smg drains a worker for about 6 s before it
# flips); docs/demo.md, "Sizing".
TRAJECTORIES_PER_INSTANCE = 6

ENGINES = ("double", "sglang")
MULTI_TASK = "multi"
TASKS = (MULTI_TASK, *DEMO_TASKS)
MAX_REAL_ENGINES = 3
SGLANG_TRAJECTORIES_PER_INSTANCE = 3
SGLANG_TOKEN_SCALE = 0.45
SGLANG_OUTPUT_SCALE = 2.5
"""Real engines on a CPU (the tiny model: 16,384 KV tokens each, a 4,096-token context;
on two cores shared with the rest of the demo and other work, about 2,000 prefill tokens/s
and 150-250 decoded tokens/s per engine, whatever the batch): the task's prompts and tool
results at 0.45 of the doubles' (first prompts ~900 tokens, contexts up to 3,600), its
outputs 2.5 times theirs (reasoning answers ~750 tokens, 300-1,500; tool commands ~25),
3 live trajectories per instance. Each reasoning turn then decodes for tens of seconds
while it holds its context's KV, and each tools turn re-prefills its context for a short
answer, so the two phases lean opposite ways on three engines by a wide margin
(docs/demo.md, "With the real SGLang"): Eq. 1 asks for 2P:1D in a tools phase and 1P:2D
in a reasoning phase, whose KV fits two decode engines but not one. With a tenth of the
tokens the decode engines held about 1,000 of their 16,384 tokens and Eq. 1 asked for
1P:2D in every phase; with 5 trajectories per instance and answers of ~600 tokens the
reasoning phase overfilled two decode engines, and the prompts waiting for their KV read
as prefill demand (Eq. 1 asked for 2P:1D in it)."""
SGLANG_DURATION = 150.0
"""The real-engine demo's default rollout time: three 50 s phases (tools, reasoning,
tools), so that the switching run, the static run and its repeat, each on three engines
that take about two minutes to serve, take about 15 minutes on two cores (15:05 measured,
docs/demo.md)."""
SGLANG_SERVED_NAME = "tiny"
# The agent's idle flip of the tiny model's engine on this CPU (loads check, flip, verify):
# 1.1-2.9 s measured (docs/sglang-role-switch.md, "Times"); what the replay takes for it.
SGLANG_CPU_FLIP_SECONDS = 2.0
# The request length the tiny model's decodeConcurrency is profiled at (its context is 4,096
# tokens; tests/real_engine/test_profile_sglang.py's --decode-context).
SGLANG_KNEE_CONTEXT = 256
SGLANG_MODEL = EngineModel(
    # The RolloutCluster's profiled figures for the tiny model on one CPU core: the KV pool
    # the engines are launched with, and a prefill speed of the order measured there.
    prefill_tokens_per_second=2_000.0,
    kv_tokens=16_384,
    drain_timeout_seconds=2.0,
    cooldown_seconds=5.0,
)


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    duration: float = 240.0
    # "multi" (the multi-task job: coding, general agent, math in turn, one per phase),
    # "coding", "general" or "math" (one task whose turns alternate tools and reasoning
    # phases). None: "multi" on the doubles, "coding" on the real engines.
    task: str | None = None
    instances: int = 4
    out: Path = Path("bench-out/demo")
    live: bool = True
    seed: int = 0
    phase_seconds: float | None = None  # default: default_phase_seconds(duration)
    # "alternate": tools, reasoning, tools...; "steady": reasoning in every phase, a
    # workload whose phases all favour one split (docs/demo.md, "--phases steady").
    phase_pattern: str = "alternate"
    concurrency: int | None = None  # live trajectories; TRAJECTORIES_PER_INSTANCE each
    nodes_per_instance: int = 1  # pods per instance: a leader and its worker ranks
    # The static split the switching run is compared with: "N:M"; "best" (every split is
    # run, the fastest is the baseline); "none" (no second run). Default: the even split,
    # what one picks without knowing the workload's mix (docs/demo.md, "Switching against
    # a static split").
    baseline: str | None = None
    model: EngineModel = field(default_factory=EngineModel)
    engine: str = "double"  # "sglang": the real SGLang on this CPU (prorsa_lab.sglang_cpu)
    # Where each run's trainer events (NDJSON, as `prorsa record` writes them) and the
    # RolloutCluster it ran go, to be replayed in the simulator (None: not recorded).
    record: Path | None = None
    # Run the fastest static split a second time on the same seed: the two runs' spread is
    # the comparison's noise, and a difference inside it is said "within noise".
    noise: bool = True

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r} (known: {', '.join(ENGINES)})")
        if self.engine == "sglang":
            if self.instances > MAX_REAL_ENGINES:
                raise ValueError(
                    f"at most {MAX_REAL_ENGINES} instances with --engine sglang: each real "
                    "engine takes about 3.5 GB and a share of this machine's cores"
                )
            if self.nodes_per_instance != 1:
                raise ValueError("--engine sglang runs one-node instances only")
        if not (self.duration > 0 and math.isfinite(self.duration)):
            raise ValueError("duration must be a positive number of seconds")
        if self.phase_pattern not in PATTERNS:
            raise ValueError(
                f"unknown phases {self.phase_pattern!r} (known: {', '.join(PATTERNS)})"
            )
        if self.task_name not in TASKS:
            raise ValueError(f"unknown task {self.task_name!r} (known: {', '.join(TASKS)})")
        if self.task_name == MULTI_TASK and self.engine == "sglang":
            raise ValueError(
                "the multi-task job is sized for the engine doubles; with --engine sglang "
                f"choose one task ({', '.join(DEMO_TASKS)})"
            )
        if not 2 <= self.instances <= 64:
            raise ValueError("instances must be between 2 and 64 (one prefill, one decode)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.nodes_per_instance not in (1, 2, 4, 8):
            raise ValueError("nodes per instance must divide the 8 GPUs of an instance")
        if self.baseline not in (None, "best", "none"):
            parse_split(self.baseline, instances=self.instances)

    def static_splits(self) -> list[tuple[int, int]]:
        """The static splits to run after the switching run (none for "none")."""
        n = self.instances
        if self.baseline == "none":
            return []
        if self.baseline == "best":
            return [(p, n - p) for p in range(1, n)]
        if self.baseline is None:
            return [(n // 2, n - n // 2)]
        return [parse_split(self.baseline, instances=n)]

    @property
    def task_name(self) -> str:
        if self.task is not None:
            return self.task
        return "coding" if self.engine == "sglang" else MULTI_TASK

    @property
    def workload(self) -> DemoTask:
        """The task a single-task run sends, or the job's first."""
        if self.task_name == MULTI_TASK:
            return MULTI_TASK_JOB[0].task
        return DEMO_TASKS[self.task_name]

    @property
    def trajectories(self) -> int:
        per_instance = (
            SGLANG_TRAJECTORIES_PER_INSTANCE
            if self.engine == "sglang"
            else TRAJECTORIES_PER_INSTANCE
        )
        return self.concurrency or per_instance * self.instances

    @property
    def gpus_per_instance(self) -> int:
        """8 for the doubles (they stand for 8-GPU instances); a CPU engine is one."""
        return 1 if self.engine == "sglang" else GPUS_PER_INSTANCE

    @property
    def phases(self) -> PhaseSchedule:
        seconds = self.phase_seconds or default_phase_seconds(self.duration)
        steady = self.phase_pattern == "steady"
        if self.task_name == MULTI_TASK:
            # Steady: the job's first task (the coding agent) in every phase.
            return PhaseSchedule(seconds=seconds, steady=steady, job=MULTI_TASK_JOB)
        if steady:
            return PhaseSchedule(seconds=seconds, first="reasoning", steady=True)
        return PhaseSchedule(seconds=seconds)


def demo_manifest(
    options: DemoOptions,
    *,
    static: tuple[int, int] | None = None,
    model_path: str | None = None,
) -> dict[str, Any]:
    """The RolloutCluster the demo applies (capacity figures match the engine doubles, or
    with ``--engine sglang`` the tiny model at ``model_path`` on one CPU core per instance).

    ``static`` pins the split: each role's minimum is its share of it, so the Controller
    can move no instance (the baseline run).
    """
    m = options.model
    roles: dict[str, Any] = {"prefill": {"min": 1, "initial": 1}, "decode": {"min": 1}}
    if static is not None:
        roles = {"prefill": {"min": static[0], "initial": static[0]}, "decode": {"min": static[1]}}
    engine: dict[str, Any] = {
        "image": "prorsa/engine-double:demo",
        "gpusPerInstance": GPUS_PER_INSTANCE,
        "tensorParallelSize": GPUS_PER_INSTANCE,
        "nodesPerInstance": options.nodes_per_instance,
    }
    extra: dict[str, Any] = {}
    if options.engine == "sglang":
        engine = {
            "image": "prorsa/engine:0.5.23",
            "gpusPerInstance": 1,
            "tensorParallelSize": 1,
            "gpuResourceName": "",
            # SGLang's HiCache host tier needs CUDA (docs/testing.md).
            "env": [{"name": "PRORSA_DISABLE_HICACHE", "value": "1"}],
        }
        extra["model"] = {"path": model_path or "", "servedName": SGLANG_SERVED_NAME}
    return cluster_manifest(
        CLUSTER,
        engine=engine,
        gpuBudget=options.instances * options.gpus_per_instance,
        **extra,
        roles=roles,
        # smg with Kubernetes discovery, run by the fake kubelet. Round robin: the demo's
        # prompts share one prefix ("w w w ..."), on which cache_aware would pick one engine.
        router={"enabled": True, "policy": "round_robin"},
        forecast={
            "horizonSeconds": m.horizon_seconds,
            "injection": {"policy": "replaceOnReward", "groupSize": 1},
        },
        capacity={
            "prefillTokensPerSecond": m.prefill_tokens_per_second,
            "decodeKvTokens": m.kv_tokens,
            "decodeConcurrency": m.decode_concurrency,
            "prefillCacheTokens": 0,  # the engine doubles keep no prefix cache (and a
            # flipped real engine's is flushed by every flip)
        },
        switching={
            "mode": "Auto",
            "cooldownSeconds": m.cooldown_seconds,
            "maxConcurrent": 1,
            "drainTimeoutSeconds": m.drain_timeout_seconds,
            "hysteresis": m.hysteresis,
            "smoothingSeconds": m.smoothing_seconds,
            # The default 300 s is 30 horizons; the demo runs ten times faster.
            "payoffSeconds": 30 * m.horizon_seconds,
            # Eq. 1 on each horizon: the demo's phases swing within what would be one
            # training step, with no weight update, and the step-scale target (which sizes
            # the split for whole steps) would hold the split the first two minutes favour.
            "stepCycle": False,
        },
    )


@dataclass(frozen=True, kw_only=True)
class DemoSummary:
    task: str
    instances: int
    gpus: int
    seconds: float  # of dispatching new requests
    finish_seconds: float  # then, until the last request was answered
    switches: int
    switch_results: dict[str, int]
    switch_directions: dict[str, int]
    switch_mean_seconds: float | None
    prefill_wape: float | None
    decode_wape: float | None
    requests_sent: int
    requests_completed: int
    requests_failed: int
    requests_resumed: int
    resumes: int
    tokens_lost: int
    tokens_generated: int
    prefill_aborts: int
    decode_aborts: int
    router: dict[str, Any]  # {"name": "smg", "version": ..., "requests": N}
    engine: dict[str, str]  # {"name": "sglang", "version": "0.5.23"} or the double's
    trajectories_started: int
    trajectories_finished: int
    trajectories_dropped: int
    events_emitted: int
    events_delivered: int
    events_dropped: int
    anomalies: dict[str, int]
    timeline: str | None
    # One per phase change: seconds until the split settled (None: still switching at
    # the phase end); phase_changes has the splits, prefill_backlog_at_phase_end the
    # backlog left when each phase ended. See prorsa_lab.demo.phases and docs/demo.md.
    phase_lag_seconds: list[float | None] = field(default_factory=list)
    phase_changes: list[PhaseChange] = field(default_factory=list)
    prefill_backlog_at_phase_end: list[PhaseBacklog] = field(default_factory=list)
    # Per phase, the mean model call time under each split the run saw (requests.jsonl);
    # prorsa_lab.demo.phase_calls.
    phase_calls: list[PhaseCalls] = field(default_factory=list)
    nodes_per_instance: int = 1
    seed: int = 0
    pods: int = 0  # engine pods at the end: instances × nodes_per_instance when whole
    # The most KV the decode engines held at once, as their agents reported it.
    decode_kv_peak_tokens: int = 0
    # How long the RolloutCluster's Degraded condition was True (engines unavailable).
    degraded_seconds: float = 0.0
    # Whether each tools phase settled with more prefill than the reasoning phases around
    # it (None: too few phases to tell); see prorsa_lab.demo.phases.
    follows_phases: bool | None = None
    # The static split's run and this one over the trajectories both finished (None with
    # --baseline none): {"split", "completed", "seconds", "completed_in_run", "requests",
    # ...}; see prorsa_lab.demo.compare.
    baseline: dict[str, Any] | None = None
    prorsa: dict[str, Any] | None = None
    switching_saved_seconds: float | None = None
    switching_saved_ratio: float | None = None
    # The spread of two runs of the baseline's split on this seed (None: not measured, as
    # with --no-noise), and the verdict: "saved", "lost" or "within noise".
    noise_seconds: float | None = None
    verdict: str | None = None
    # With --record: each run's recording replayed in the simulator beside what it
    # measured (prorsa_lab.demo.replay_check.summary).
    replay: dict[str, Any] | None = None
    # This machine while the switching run went: CPUs and the 1-minute load average.
    machine: dict[str, Any] = field(default_factory=dict)
    # What the resumed requests cost in prefill (prorsa_sdk.ResumePrefill.summary).
    resume_prefill: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Nothing lost: every request answered in full, every event delivered (in the
        baseline run too)."""
        base = self.baseline or {}
        return (
            self.tokens_lost == 0
            and self.requests_failed == 0
            and self.requests_completed == self.requests_sent
            and self.events_dropped == 0
            and not base.get("tokens_lost")
            and not base.get("requests_failed")
            and not base.get("events_dropped")
        )

    def lines(self) -> list[str]:
        results = ", ".join(f"{n} {r}" for r, n in sorted(self.switch_results.items())) or "none"
        directions = ", ".join(f"{d} {n}" for d, n in sorted(self.switch_directions.items()))
        mean = f"mean {self.switch_mean_seconds:.2f} s" if self.switch_mean_seconds else "-"
        anomalies = sum(self.anomalies.values())
        return [
            f"prorsa demo summary: task {self.task}, {self.instances} instances "
            f"({self.gpus} GPUs, {self.pods} pods, {self.nodes_per_instance} per instance), "
            f"{self.seconds:.0f} s of rollout "
            f"(+{self.finish_seconds:.0f} s for the last requests)",
            f"  switches      {self.switches} ({results}); {directions or 'no direction'}; {mean}",
            f"  degraded      {self.degraded_seconds:.0f} s (engines unavailable, Degraded=True)",
            f"  forecast WAPE prefill {_fmt(self.prefill_wape)}, decode {_fmt(self.decode_wape)}"
            " (Controller, scored horizon windows)",
            f"  requests      {self.requests_sent} sent, {self.requests_completed} completed, "
            f"{self.requests_failed} failed; {self.requests_resumed} resumed after aborts "
            f"({self.resumes} resumes; aborts seen: {self.prefill_aborts} in prefill, "
            f"{self.decode_aborts} in decode)",
            f"  router        {self.router['name']} {self.router['version']}, "
            f"{self.router['requests']} requests",
            f"  engine        {self.engine['name']} {self.engine['version']}",
            f"  tokens lost   {self.tokens_lost} (of {self.tokens_generated:,} generated; "
            "each answer checked against the tokens asked)",
            f"  trajectories  {self.trajectories_started} started, "
            f"{self.trajectories_finished} finished, {self.trajectories_dropped} cut at the end",
            f"  events        {self.events_emitted:,} emitted, {self.events_delivered:,} "
            f"delivered, {self.events_dropped} dropped; {anomalies} anomalies",
            summary_line(self.phase_changes, self.prefill_backlog_at_phase_end),
            parts_line([c.lag_parts for c in self.phase_changes]),
            phases_line(self.phase_changes),
            calls_line(self.phase_calls, label="calls"),
            *self._baseline_lines(),
            *replay_check.lines(self.replay),
            f"  machine       {self._machine_text()}",
            f"  timeline      {self.timeline or 'not written'}",
        ]

    def _baseline_lines(self) -> list[str]:
        if self.baseline is None or self.prorsa is None:
            return ["  baseline      none (--baseline none)"]
        b, p = self.baseline, self.prorsa
        lines = [
            f"  baseline      static {b['split']}: {b['completed_in_run']} trajectories "
            f"finished, {b['requests']} model calls; switching: {p['completed_in_run']} "
            f"and {p['requests']}, in {self.seconds:.0f} s of rollout each"
        ]
        for split, run in (b.get("runs") or {}).items():
            if run.get("phase_calls"):
                lines.append(calls_line(run["phase_calls"], label=f"calls {split}"))
        saved, ratio = self.switching_saved_seconds, self.switching_saved_ratio
        noise = self.noise_seconds
        if saved is None or ratio is None:
            lines.append("  switching     not compared: a run finished no trajectory")
            return lines
        said = self.verdict or ("saved" if saved >= 0 else "lost")
        if said == "within noise":
            faster = "faster" if saved >= 0 else "slower"
            head = f"within noise: {abs(saved):.1f} s ({abs(ratio):.0%}) {faster} than"
        else:
            head = f"{said} {abs(saved):.1f} s ({abs(ratio):.0%}) against"
        lines.append(
            f"  switching     {head} static {b['split']}: the first {p['completed']} "
            f"trajectories took {p['seconds']:.1f} s switching, {b['seconds']:.1f} s static"
        )
        if noise is None and b.get("again") is not None:
            lines.append(
                "  noise         not measured: a run of the pair finished no trajectory; "
                "the verdict ignores it"
            )
        elif noise is None:
            lines.append("  noise         not measured (--no-noise): the verdict ignores it")
        else:
            lines.append(
                f"  noise         two runs of static {b['split']} on seed {self.seed} ended "
                f"{noise:.1f} s apart: a difference up to that is within noise"
            )
        return lines

    def _machine_text(self) -> str:
        m = self.machine
        if not m:
            return "-"

        def load(run: dict[str, Any] | None) -> str:
            avg = (run or {}).get("load_average") or {}
            if avg.get("mean") is None:
                return "-"
            return f"{avg['mean']:.1f} (max {avg['max']:.1f})"

        text = f"{m.get('cpus', '?')} CPUs, load average {load(m)} switching"
        if self.baseline is not None:
            text += f", {load(self.baseline)} static"
        return text


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


@contextlib.contextmanager
def _log_to(path: Path) -> Iterator[None]:
    """Every log record to ``path`` and none to the terminal, for the run's duration."""
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    chatty = logging.getLogger("httpx")  # one line per request: thousands a minute
    chatty_level = chatty.level
    chatty.setLevel(logging.WARNING)
    try:
        yield
    finally:
        handler.close()
        root.handlers = saved[1]
        root.setLevel(saved[0])
        chatty.setLevel(chatty_level)


async def _warm_up(
    env: Stack, options: DemoOptions, stop: asyncio.Event, *, prefill: int = 1
) -> None:
    """Until every engine pod runs and the operator has made its ``prefill`` first prefill
    engines (roles.prefill.initial)."""

    async def ready() -> bool:
        if stop.is_set():
            raise DemoInterrupted("interrupted while the engines were starting")
        counts = await env.count_roles(CLUSTER)  # every pod of a group shows its role
        pods = options.instances * options.nodes_per_instance
        # Every pod running (real engines load for minutes; the doubles at once).
        running = [p for p in await env.pods(CLUSTER) if (p.get("status") or {}).get("podIP")]
        return (
            counts.get("prefill", 0) >= prefill * options.nodes_per_instance
            and sum(counts.values()) == pods
            and len(running) == pods
        )

    # Real engines load for minutes on a CPU; the doubles start at once.
    patience = 900 if options.engine == "sglang" else 180
    await env.wait_for(
        ready, timeout=patience, what="the engine pods and the first prefill engines"
    )
    router = env.kubelet.router
    if router is None:
        raise RuntimeError("the fake kubelet did not start smg for the router Deployment")

    async def routed() -> bool:
        if stop.is_set():
            raise DemoInterrupted("interrupted while smg was discovering the engines")
        return await _smg_lists_every_engine(env, router)

    await env.wait_for(routed, timeout=120, what="smg listing every engine with its role")


async def _smg_lists_every_engine(env: Stack, router: SmgRouter) -> bool:
    """smg's workers are the engine pods that serve (one-node instances, the leaders of
    multi-node ones), each with the type of its role label."""
    pods = await env.pods(CLUSTER)
    want = {
        p["status"]["podIP"]: p["metadata"]["labels"].get(ROLE_LABEL)
        for p in pods
        if (p.get("status") or {}).get("podIP")
        and p["metadata"]["labels"].get(NODE_RANK_LABEL, "0") == "0"
    }
    async with httpx.AsyncClient(trust_env=False) as client:
        workers = await router.workers(client)
    got = {
        str(w.get("url", "")).split("://", 1)[-1].rsplit(":", 1)[0]: w.get("worker_type")
        for w in workers or []
    }
    return bool(want) and got == want


class DemoInterrupted(Exception):
    """Ctrl-C before the rollout started, or a second Ctrl-C: nothing to summarise."""


def _real_engines(options: DemoOptions) -> CpuEngineEnv | None:
    """The engine environment for ``--engine sglang`` (None for the doubles)."""
    if options.engine != "sglang":
        return None
    try:
        return CpuEngineEnv.find()
    except EngineEnvMissing as exc:
        raise DemoInterrupted(str(exc)) from None


async def _engine_identity(env: Stack, real: CpuEngineEnv | None) -> dict[str, str]:
    """What served the rollout: the real engines' own ``/server_info`` version, or the
    double (which copies SGLang 0.5.23's wire format and says so)."""
    if real is None:
        return {"name": "engine-double", "version": f"sglang {SGLANG_VERSION} wire format"}
    versions = set()
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        for runtime in list(env.kubelet.pods.values()):
            try:
                reply = await client.get(f"{runtime.pod.engine_url}/server_info")
                versions.add(str(reply.json().get("version")))
            except (httpx.HTTPError, ValueError):
                continue  # an engine restarting: the others answer
    return {"name": "sglang", "version": ", ".join(sorted(versions)) or "unknown"}


async def run_demo(options: DemoOptions, *, stream: TextIO = sys.stdout) -> DemoSummary:
    """Run the whole demo; returns the summary (also written to ``out/summary.json``).

    The first SIGINT/SIGTERM ends the rollout early (in-flight requests finish, the
    summary and the PNG are written); a second one stops at once (:class:`DemoInterrupted`).
    """
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    main = asyncio.current_task()

    def on_signal() -> None:
        if stop.is_set() and main is not None:
            main.cancel()
        stop.set()

    def take_signals() -> None:
        # kopf installs its own handlers when the operator starts; a signal there would
        # stop the operator and cancel every task created after it, the trainer's included.
        on_stop_signals(on_signal)

    take_signals()
    try:
        with _log_to(out / "demo.log"):
            return await _run(options, stream=stream, stop=stop, operator_started=take_signals)
    except asyncio.CancelledError:
        if stop.is_set():
            raise DemoInterrupted("interrupted twice: stopped without a summary") from None
        raise
    finally:
        drop_stop_signals()


async def _run(
    options: DemoOptions,
    *,
    stream: TextIO,
    stop: asyncio.Event,
    operator_started: Callable[[], None],
) -> DemoSummary:
    """The switching run, then (unless ``--baseline none``) the static one; the summary."""
    out = options.out
    switching = await _rollout(
        options, stream=stream, stop=stop, operator_started=operator_started, static=None
    )
    summary = switching.summary
    if options.static_splits() and not stop.is_set():
        summary = await _with_baseline(
            options, switching, stream=stream, stop=stop, operator_started=operator_started
        )
    elif switching.recording is not None and switching.trainer.finish_times and not stop.is_set():
        # No static run: the switching run alone, to the trajectories it finished.
        finished = sorted(switching.trainer.finish_times)
        check = await _replay_checks(
            options, [(switching, None)], count=len(finished), stream=stream
        )
        summary = replace(summary, replay=replay_check.summary(switching=check[0], static=None))
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    width = shutil.get_terminal_size().columns if stream.isatty() else None
    for line in wrap_lines(summary.lines(), width):
        print(line, file=stream)
    stream.flush()
    return summary


async def _with_baseline(
    options: DemoOptions,
    switching: Rollout,
    *,
    stream: TextIO,
    stop: asyncio.Event,
    operator_started: Callable[[], None],
) -> DemoSummary:
    """The same trajectories on each pinned split, for as long; the fastest of them set
    side by side with the switching run."""
    static: dict[tuple[int, int], Rollout] = {}
    for split in options.static_splits():
        if stop.is_set():
            break
        print(
            f"prorsa demo: now the same seeded workload on a static {split_text(split)} split, "
            f"{options.duration:.0f} s again...",
            file=stream,
            flush=True,
        )
        static[split] = await _rollout(
            replace(options, out=options.out / f"baseline-{split[0]}P{split[1]}D"),
            stream=stream,
            stop=stop,
            operator_started=operator_started,
            static=split,
        )
    if not static:
        return switching.summary
    # Over the trajectories every run finished, the static split that took least time.
    common = min(len(r.trainer.finish_times) for r in (switching, *static.values()))

    def time_to_common(run: Rollout) -> float:
        times = sorted(run.trainer.finish_times)
        return times[common - 1] if common else 0.0

    split = min(static, key=lambda s: time_to_common(static[s]))
    fastest = static[split]
    repeat: Rollout | None = None
    if options.noise and not stop.is_set():
        print(
            f"prorsa demo: static {split_text(split)} once more on seed {options.seed}, to "
            "measure how far two runs of one split land apart on this machine...",
            file=stream,
            flush=True,
        )
        repeat = await _rollout(
            replace(options, out=options.out / f"baseline-{split[0]}P{split[1]}D-again"),
            stream=stream,
            stop=stop,
            operator_started=operator_started,
            static=split,
        )
    result = compare(
        switching_times=switching.trainer.finish_times,
        static_times=fastest.trainer.finish_times,
        static_split=split_text(split),
        switching_requests=switching.trainer.completed,
        static_requests=fastest.trainer.completed,
    )
    noise = (
        None
        if repeat is None or stop.is_set()
        else spread(
            fastest.trainer.finish_times,
            repeat.trainer.finish_times,
            count=result.switching.completed,
        )
    )
    checked = [*static.values(), *([repeat] if repeat is not None else [])]
    runs = {
        split_text(s): {
            "completed_in_run": len(r.trainer.finish_times),
            "seconds_to_common": round(time_to_common(r), 2) if common else None,
            "phase_calls": r.summary.phase_calls,
            "tokens_lost": r.summary.tokens_lost,
            "load_average": r.summary.machine.get("load_average"),
        }
        for s, r in static.items()
    }
    base = fastest.summary
    replay = None
    if common and switching.recording is not None and fastest.recording is not None:
        checks = await _replay_checks(
            options, [(switching, None), (fastest, split[0])], count=common, stream=stream
        )
        replay = replay_check.summary(switching=checks[0], static=checks[1])
    return replace(
        switching.summary,
        replay=replay,
        baseline=asdict(result.static)
        | {
            "how": options.baseline or "default",
            "tokens_lost": sum(r.summary.tokens_lost for r in checked),
            "requests_failed": sum(r.summary.requests_failed for r in checked),
            "events_dropped": sum(r.summary.events_dropped for r in checked),
            "load_average": base.machine.get("load_average"),
            "seconds_of_rollout": round(fastest.seconds, 1),
            "runs": runs,
            # The same split again on the same seed (None: --no-noise): its time to the
            # comparison's count, and what it finished.
            "again": None
            if repeat is None
            else {
                "completed_in_run": len(repeat.trainer.finish_times),
                "tokens_lost": repeat.summary.tokens_lost,
                "load_average": repeat.summary.machine.get("load_average"),
            },
        },
        prorsa=asdict(result.switching) | {"seconds_of_rollout": round(switching.seconds, 1)},
        switching_saved_seconds=result.saved_seconds,
        switching_saved_ratio=result.saved_ratio,
        noise_seconds=noise,
        verdict=verdict(result.saved_seconds, noise),
    )


async def _replay_checks(
    options: DemoOptions,
    runs: list[tuple[Rollout, int | None]],
    *,
    count: int,
    stream: TextIO,
) -> list[replay_check.Check]:
    """Each run's recording replayed on its own policy (``None``: Prorsa; N: static NP),
    to ``count`` trajectories, in worker threads (the simulator is CPU-bound)."""
    print(
        f"prorsa demo: replaying the runs' recordings in the simulator ({options.record})...",
        file=stream,
        flush=True,
    )
    flip = _flip_seconds(options)

    def one(run: Rollout, prefill: int | None) -> replay_check.Check:
        assert run.recording is not None
        times = sorted(run.trainer.finish_times)
        return replay_check.check(
            run.recording,
            prefill=prefill,
            count=count,
            measured_seconds=times[count - 1],
            switch_seconds=flip,
            knee_context=SGLANG_KNEE_CONTEXT if options.engine == "sglang" else KNEE_CONTEXT,
            kv_pool_tokens=options.model.kv_tokens,
        )

    return list(
        await asyncio.gather(*(asyncio.to_thread(one, run, prefill) for run, prefill in runs))
    )


def _flip_seconds(options: DemoOptions) -> float:
    """The engine's own role switch, for the replay: the double's timing model (the flip
    and the CUDA-graph capture it simulates), or SGLang's on this CPU."""
    if options.engine == "sglang":
        return SGLANG_CPU_FLIP_SECONDS
    m = options.model
    return m.switch_seconds + m.graph_capture_seconds


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """One run of the trainer on a fresh deployment, and what was watched."""

    summary: DemoSummary
    trainer: TrainerStats
    monitor: Monitor
    t0: float  # wall clock of the first dispatch
    seconds: float  # of dispatching
    recording: recorded.RecordedRun | None = None  # with --record


async def _rollout(
    options: DemoOptions,
    *,
    stream: TextIO,
    stop: asyncio.Event,
    operator_started: Callable[[], None],
    static: tuple[int, int] | None,
) -> Rollout:
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    model = options.model
    task = options.workload
    kubeconfig = (out / "kubeconfig").resolve()
    run_label = "" if static is None else f"static {split_text(static)}"
    print(
        f"prorsa demo: starting the API emulator, the operator and {options.instances} engine "
        f"pods (task {options.task_name}, {options.duration:.0f} s of rollout"
        f"{', ' + run_label if run_label else ''})...",
        file=stream,
        flush=True,
    )
    config = model.engine_config()
    binary = smg_binary()
    if binary is None:
        raise DemoInterrupted(
            "the smg router is not installed: pip install 'smg==1.13.0' (the demo extra has it)"
        )
    real = _real_engines(options)
    if real is not None:
        print(
            f"  the real SGLang on this CPU ({real.python}): each engine loads for 1.5-2 "
            "minutes before the rollout starts",
            file=stream,
            flush=True,
        )
    manifest = demo_manifest(options, static=static, model_path=str(real.model) if real else None)
    async with stack(
        engine_config=lambda _name: config,
        tick_seconds=model.tick_seconds,
        kubeconfig_path=kubeconfig,
        agent_timeouts=CPU_TIMEOUTS if real else model.agent_timeouts(),
        run_router=True,
        log_dir=out,
        real_engines=real,
    ) as env:
        operator_started()
        await env.create_cluster(manifest)
        print(
            f"  API server {env.server.url}, webhook {env.webhook}, "
            f"metrics {env.metrics_url}, "
            f"smg router {env.router_url}\n"
            "  While it runs, from another shell:\n"
            f"    export KUBECONFIG={kubeconfig}\n"
            "    kubectl get rolloutclusters -A\n"
            "    kubectl get pods -n rl -L prorsa.io/role -w\n"
            "    kubectl describe rolloutcluster -n rl demo   # status, then one Event per switch\n"
            f"    curl -s {env.metrics_url} | grep ^prorsa_instances\n"
            "    # the latest Decision (the trainer's token opens the webhook's endpoints):\n"
            f"    curl -s -H 'Authorization: Bearer {env.token}' "
            f"{env.webhook}{env.cluster_path(CLUSTER)}/forecast\n"
            "  (kubectl apply/create need --validate=false against the emulator)\n"
            f"  Logs: {out / 'demo.log'}",
            file=stream,
            flush=True,
        )
        await _warm_up(env, options, stop, prefill=1 if static is None else static[0])
        assert env.router_url is not None
        served = manifest["spec"]["model"]
        served_model = served.get("servedName") or served["path"]
        engine = await _engine_identity(env, real)

        async with contextlib.AsyncExitStack() as stack_:
            directory = await stack_.enter_async_context(
                PodDirectory(
                    api_url=env.server.url,
                    namespace=env.namespace,
                    cluster=CLUSTER,
                    token=env.server.token,
                )
            )
            recording = (
                None
                if options.record is None
                else recorded.prepare(options.record, static=static, manifest=manifest)
            )
            emitter = await stack_.enter_async_context(
                AsyncEventEmitter(
                    url=env.webhook,
                    namespace=env.namespace,
                    name=CLUSTER,
                    token=env.token,
                    track=True,
                    record=None if recording is None else recording.events,
                )
            )
            # The doubles stream incremental chunks (whole-output ones cost O(n²)); SGLang
            # streams the whole output so far by default, short here.
            router = SmgClient(
                url=env.router_url, model=served_model, emitter=emitter, incremental=real is None
            )
            stack_.push_async_callback(router.aclose)
            http = await stack_.enter_async_context(
                httpx.AsyncClient(transport=router, base_url=env.router_url, timeout=600)
            )
            monitor = await stack_.enter_async_context(
                Monitor(
                    webhook=env.webhook,
                    cluster_path=env.cluster_path(CLUSTER),
                    api_url=env.server.url,
                    namespace=env.namespace,
                    cluster=CLUSTER,
                    token=env.token,
                    agent_port=env.kubelet.agent_port,
                    directory=directory,
                    metrics_url=env.metrics_url,
                )
            )
            trainer = DemoTrainer(
                task=task.scaled(SGLANG_TOKEN_SCALE, output=SGLANG_OUTPUT_SCALE) if real else task,
                token_ids=real is not None,
                schedule=options.phases,
                emitter=emitter,
                router=http,
                concurrency=options.trajectories,
                seed=options.seed,
            )
            view = (LiveView if options.live else PlainView)(
                options=options,
                monitor=monitor,
                trainer=trainer,
                router=router,
                directory=directory,
                stream=stream,
                run_label=run_label,
            )

            async def interrupt() -> None:
                await stop.wait()
                trainer.stop()

            watcher = asyncio.create_task(interrupt())
            cpu_at_start = time.process_time()
            try:
                async with view:
                    await trainer.run(duration=options.duration)
                    # Every thread of this process (operator, doubles, agents, emulator,
                    # trainer); smg runs in its own process.
                    cpu = (time.process_time() - cpu_at_start) / max(time.time() - trainer.t0, 1e-9)
                    view.note("rollout over: waiting for the last events and one more tick")
                    await emitter.flush(timeout=15)
                    await asyncio.sleep(model.tick_seconds * 1.5)
                    await monitor.poll()
            finally:
                watcher.cancel()
            ended = trainer.stopped_at or time.time()
            seconds, finish = ended - trainer.t0, time.time() - ended
            stats = await emitter.aclose(timeout=15)

        summary = _summarise(
            options, monitor=monitor, trainer=trainer.stats, router=router,
            router_version=smg_version(binary) or "unknown", trainer_t0=trainer.t0, engine=engine,
            seconds=seconds, finish_seconds=finish, emitter=stats, cpu_share=cpu,
        )  # fmt: skip
        summary = replace(summary, pods=len(await env.pods(CLUSTER)))
        timeline = out / "timeline.png"
        try:
            from prorsa_lab.demo.timeline_plot import plot_timeline

            plot_timeline(
                timeline,
                options=options,
                t0=trainer.t0,
                stopped=(trainer.stopped_at or time.time()) - trainer.t0,
                monitor=monitor,
                trainer=trainer.stats,
                router=router,
                directory=directory,
            )
            summary = _with_timeline(summary, str(timeline))
        except ImportError as exc:  # matplotlib is in the bench/demo extras
            print(f"  no timeline: {exc}", file=stream)
    kubeconfig.unlink(missing_ok=True)  # it pointed at the emulator, gone now
    with (out / "requests.jsonl").open("w", encoding="utf-8") as f:
        for record in trainer.stats.requests:
            f.write(json.dumps(record.wire()) + "\n")
    with (out / "decisions.jsonl").open("w", encoding="utf-8") as f:
        for decision in monitor.decisions:
            f.write(json.dumps(decision) + "\n")
    with (out / "samples.jsonl").open("w", encoding="utf-8") as f:
        for sample in monitor.samples:
            f.write(json.dumps(asdict(sample) | {"since_start": round(sample.t - trainer.t0, 2)}))
            f.write("\n")
    return Rollout(
        summary=summary,
        trainer=trainer.stats,
        monitor=monitor,
        t0=trainer.t0,
        seconds=seconds,
        recording=recording,
    )


def _with_timeline(summary: DemoSummary, path: str) -> DemoSummary:
    return replace(summary, timeline=path)


def _summarise(
    options: DemoOptions,
    *,
    monitor: Monitor,
    trainer: TrainerStats,
    router: SmgClient,
    router_version: str,
    engine: dict[str, str],
    trainer_t0: float,
    seconds: float,
    finish_seconds: float,
    emitter: Any,
    cpu_share: float,
) -> DemoSummary:
    # Scored over the last horizons of the rollout itself: read when dispatching stopped.
    accuracy = monitor.accuracy_at(trainer_t0 + seconds)
    results = {k: int(v) for k, v in monitor.switch_counts().items()}
    anomalies = {
        labels["kind"]: int(value)
        for labels, value in monitor.metrics.get("prorsa_event_anomalies_total", [])
        if labels.get("cluster") == CLUSTER and value
    }
    # The phases of the rollout as asked; a stop a few ms late makes no extra phase.
    spans = options.phases.spans(min(seconds, options.duration))
    best = [(x.t, x.best) for x in monitor.samples if x.best is not None]
    switches = switch_spans(monitor.directory.changes, monitor.directory.intents, monitor.drains)
    changes = phase_changes(
        split_timeline(monitor.directory.changes),
        spans,
        t0=trainer_t0,
        best=best,
        switches=switches,
    )
    calls = phase_calls(
        trainer.requests, split_timeline(monitor.directory.changes), spans, t0=trainer_t0
    )
    if options.phases.job:  # name each phase by its task
        changes = [replace(c, task=options.phases.label(c.at)) for c in changes]
        calls = [replace(c, task=options.phases.label(c.start)) for c in calls]
    during = [x for x in monitor.samples if trainer_t0 <= x.t <= trainer_t0 + seconds]
    backlogs = prefill_backlogs(router.jobs, monitor.samples, spans, t0=trainer_t0)
    return DemoSummary(
        task=options.task_name,
        instances=options.instances,
        nodes_per_instance=options.nodes_per_instance,
        seed=options.seed,
        gpus=options.instances * options.gpus_per_instance,
        seconds=seconds,
        finish_seconds=finish_seconds,
        switches=sum(results.values()),
        switch_results=results,
        switch_directions={k: int(v) for k, v in monitor.switch_directions().items()},
        switch_mean_seconds=monitor.switch_mean_seconds(),
        prefill_wape=accuracy.get("prefillWape"),
        decode_wape=accuracy.get("decodeWape"),
        requests_sent=len(trainer.requests),
        requests_completed=trainer.completed,
        requests_failed=trainer.failed,
        requests_resumed=trainer.resumed,
        resumes=trainer.resumes,
        resume_prefill=trainer.resume_prefill,
        tokens_lost=trainer.tokens_lost,
        tokens_generated=trainer.tokens_generated,
        prefill_aborts=router.counters.prefill_aborts,
        decode_aborts=router.counters.decode_aborts,
        router={"name": "smg", "version": router_version, "requests": router.counters.requests},
        engine=engine,
        trajectories_started=trainer.started,
        trajectories_finished=trainer.finished,
        trajectories_dropped=trainer.dropped,
        events_emitted=int(emitter.emitted),
        events_delivered=int(emitter.sent),
        events_dropped=int(emitter.dropped),
        anomalies=anomalies,
        timeline=None,
        phase_lag_seconds=[c.lag_seconds for c in changes],
        phase_changes=changes,
        prefill_backlog_at_phase_end=backlogs,
        phase_calls=calls,
        decode_kv_peak_tokens=max((x.kv_used_decode for x in monitor.samples), default=0),
        degraded_seconds=round(monitor.degraded_seconds, 1),
        follows_phases=follows_phases(changes),
        machine={
            "cpus": os.cpu_count(),
            "load_average": load_average(during),
            # What the demo itself used: its process's CPU seconds per second of the
            # rollout and its last requests (near 1, one Python process cannot keep up).
            "demo_cpu_per_second": round(cpu_share, 2),
        },
    )


__all__ = [
    "SGLANG_DURATION",
    "SGLANG_MODEL",
    "DemoInterrupted",
    "DemoOptions",
    "DemoSummary",
    "EngineModel",
    "demo_manifest",
    "run_demo",
]
