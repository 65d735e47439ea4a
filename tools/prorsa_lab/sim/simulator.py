"""One simulated rollout: a scenario, a policy, and what was measured.

:func:`simulate` builds the cluster, the trainer and the policy on one event loop, runs the
requested number of training steps in virtual time and returns a :class:`SimResult`:
makespan, GPU idle ratio from attention-DP interference, switch counts, the P/D allocation
over time, and (for policies that forecast) predicted against measured demand per window.

Measured demand follows the paper's definitions (Appendix B, §5.5), computed from the
simulator's ground truth rather than from anything the Controller reports:
- prefill demand of [t, t+S): full prompt tokens queued or in prefill at t, plus every
  request queued during the window;
- decode admissions of [t, t+S): full prompt tokens of requests whose prefill finished in it.
WAPE is the sum of absolute errors over all windows divided by the sum of measured tokens.
"""

from __future__ import annotations

import contextlib
import math
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prorsa.core.spec import RolloutClusterSpec
from prorsa.k8s.objects import router_args
from prorsa_lab.sim.costmodel import ModelProfile, load_profile
from prorsa_lab.sim.engine import DECODE, SimCluster
from prorsa_lab.sim.kv_store import (
    KV_STORES,
    PER_INSTANCE,
    KvStore,
    SharedKVStore,
    default_capacity_tokens,
)
from prorsa_lab.sim.loop import Loop, SimulationError
from prorsa_lab.sim.trainer import OVER_DISPATCH, PrefillEvents, Trainer
from prorsa_lab.sim.workloads import TaskProfile, TrajectoryScript, get_task

# Mean trajectory duration used only to size fixed-rate injection (Little's law), paper §5.4:
# coding 846 s, general agent 216 s; math from this simulator's own profile (~10k tokens).
FIXED_RATE_LIFETIME = {"coding": 846.0, "general": 216.0, "math": 400.0}
# Seconds a weight update stops the engines, by model family: checkpoint-engine 0.1.3's
# broadcast benchmark (its README: metadata gather plus broadcast update), Qwen3-235B-A22B
# BF16 on 8xH800 at TP8 0.46 + 6.75 s, DeepSeek-V3.1 FP8 on 16xH20 at TP16 1.44 + 12.22 s.
# The fastest published path, so a lower bound on the lead time a real trainer gives.
WEIGHT_UPDATE_SECONDS = {"qwen3": 0.46 + 6.75, "deepseek": 1.44 + 12.22}
# smg 1.13.0's part of a role switch, measured against the real binary on the project's
# machine (tests/test_smg_router.py; docs/testing.md): ~1 s to see the relabel plus its fixed
# 5 s drain before it drops the worker, ~2 s after the flip until it lists the new role.
SMG_DRAIN_SECONDS = 6.0
SMG_REGISTER_SECONDS = 2.0
DpRouting = Literal["dp-aware", "round-robin"]
DP_ROUTINGS: tuple[str, ...] = ("dp-aware", "round-robin")


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    model: str
    task: str
    staleness: int = 0
    steps: int = 3
    seed: int = 1
    instances: int = 8
    injection: str = "replaceOnReward"
    groups_per_step: int | None = None  # default: the task profile's
    max_concurrent: int | None = None  # async in-flight cap; default OVER_DISPATCH batches
    switch_seconds: float = 5.0  # paper Appendix C: about 5 s per role switch
    # The router's part of a switch: smg 1.13.0, the router the chart deploys, measured
    # against the real binary (tests/test_smg_router.py): it drops a worker relabelled
    # draining about 6 s after the relabel (the engine flips only then) and lists it with
    # its new role about 2 s after the flip. 0 and 0: a router that takes no time.
    router_drain_seconds: float = SMG_DRAIN_SECONDS
    router_register_seconds: float = SMG_REGISTER_SECONDS
    drain_timeout: float = 30.0  # spec default switching.drainTimeoutSeconds
    cooldown: float = 30.0  # spec default switching.cooldownSeconds
    smoothing: float | None = None  # switching.smoothingSeconds; None: the spec default
    hysteresis: float | None = None  # switching.hysteresis; None: the spec default
    horizon: float = 10.0  # S
    # HiCache host tier per rank over its GPU KV pool: SGLang 0.5.23's default ratio (2.0),
    # which the engine image enables (--enable-hierarchical-cache); 0 for a GPU-only cache.
    hicache_ratio: float = 2.0
    # False: the engines keep no prefix cache (capacity.prefillCacheTokens: 0 in a replay).
    prefix_cache: bool = True
    # Where prefix KV lives (kv_store.py): "per-instance" (SGLang 0.5.23 as shipped: a flip
    # wipes the instance's caches) or "shared" (an L3 store every engine reads and no flip
    # wipes, with decode-side KV offload). kv_store_tokens: its capacity; None: the nodes'
    # host memory the HiCache host tiers leave (kv_store.default_capacity_tokens).
    kv_store: KvStore = PER_INSTANCE
    kv_store_tokens: int | None = None
    # The spec's capacity.prefillCacheTokens. None: what one prefill instance's cache tiers
    # hold (below). 0 tells the Controller no prefix cache is lost with a flip and sets no
    # cache floor: what a cluster whose shared store keeps every context could declare.
    prefill_cache_tokens: int | None = None
    # The trainer announces weight updates (weight_update_started/_finished); off: the
    # Controller infers them from the burst of aborts, as with a trainer that does not.
    weight_update_events: bool = True
    # Which prefill events the trainer sends (trainer.PREFILL_EVENTS): ``full``, what a
    # streaming client behind a PD router sees (``first-token``) or a blocking one (``none``).
    prefill_events: PrefillEvents = "full"
    # How long the engines stop for each weight update (the trainer holds its requests
    # meanwhile, as AReaL's pause()/resume() does). None: the broadcast time
    # checkpoint-engine measured for the model (WEIGHT_UPDATE_SECONDS); 0: instantaneous.
    weight_update_seconds: float | None = None
    time_limit: float = 24 * 3600.0  # a run still going then counts as did-not-finish
    # Who picks an engine's attention-DP rank (engine.SimCluster._route_prefill): "dp-aware"
    # (smg --dp-aware places each request on a rank, by prefix) or "round-robin" (smg sees
    # whole engines and SGLang's DP controller round-robins the ranks). None: as the
    # operator deploys smg for this scenario's spec (prorsa.k8s.objects.router_args).
    dp_routing: DpRouting | None = None

    def dp_aware(self) -> bool:
        """Whether smg places requests on DP ranks (``--dp-aware``) in this scenario."""
        if self.dp_routing is not None:
            if self.dp_routing not in DP_ROUTINGS:
                raise ValueError(f"unknown DP routing {self.dp_routing!r}: one of {DP_ROUTINGS}")
            return self.dp_routing == "dp-aware"
        return "--dp-aware" in router_args(cluster="sim", namespace="sim", spec=self.spec())

    def shared_store(self) -> SharedKVStore | None:
        """A fresh shared KV store for one run of this scenario; None when per-instance."""
        if self.kv_store not in KV_STORES:
            raise ValueError(f"unknown kv_store {self.kv_store!r}: one of {KV_STORES}")
        if self.kv_store == PER_INSTANCE:
            return None
        tokens = self.kv_store_tokens
        if tokens is None:
            tokens = default_capacity_tokens(
                self.profile(), instances=self.instances, hicache_ratio=self.hicache_ratio
            )
        return SharedKVStore(capacity_tokens=tokens)

    def update_seconds(self) -> float:
        """The weight update's duration in seconds (see ``weight_update_seconds``)."""
        if self.weight_update_seconds is not None:
            return self.weight_update_seconds
        return WEIGHT_UPDATE_SECONDS["deepseek" if "deepseek" in self.model else "qwen3"]

    @property
    def label(self) -> str:
        s = "on-policy" if self.staleness == 0 else f"stale={self.staleness}"
        return f"{self.model}/{self.task}/{s}"

    def profile(self) -> ModelProfile:
        return load_profile(self.model)

    def task_profile(self) -> TaskProfile:
        return get_task(self.task)

    def scripts(self) -> tuple[TrajectoryScript, ...] | None:
        """Trajectories to replay instead of the task profile's draws (``prorsa replay``'s
        scenario overrides this; the benchmark's draws them)."""
        return None

    def fixed_rate(self) -> float:
        """Little's law: the rate that keeps ``max_concurrent`` trajectories in flight."""
        t = self.task_profile()
        batch = (self.groups_per_step or t.groups_per_step) * t.group_size
        return (self.max_concurrent or OVER_DISPATCH * batch) / FIXED_RATE_LIFETIME[self.task]

    def spec(self) -> RolloutClusterSpec:
        """The RolloutCluster spec the operator would run this scenario with."""
        p = self.profile()
        t = self.task_profile()
        if self.staleness == 0:
            injection: dict[str, Any] = {"policy": "none", "groupSize": t.group_size}
        else:
            # replaceOnEnd is no CRD policy: the operator forecasts it as replaceOnReward
            # (one new sample per trajectory that ends with a reward).
            policy = "replaceOnReward" if self.injection == "replaceOnEnd" else self.injection
            injection = {"policy": policy, "groupSize": t.group_size}
            if self.injection == "fixedRate":
                injection["ratePerSecond"] = self.fixed_rate()
        return RolloutClusterSpec.model_validate(
            {
                "model": {"path": f"/models/{p.name}", "servedName": p.name},
                "engine": {
                    "gpusPerInstance": p.gpus_per_instance,
                    "tensorParallelSize": p.gpus_per_instance,
                    "extraArgs": ["--enable-dp-attention", "--dp-size", str(p.ranks)]
                    if p.ranks > 1
                    else [],
                },
                "gpuBudget": p.gpus_per_instance * self.instances,
                "roles": {"prefill": {"min": 1}, "decode": {"min": 1}},
                "forecast": {"horizonSeconds": self.horizon, "injection": injection},
                "capacity": {
                    "prefillTokensPerSecond": p.prefill_tokens_per_second,
                    "prefillCostDoublingTokens": p.prefill_cost_doubling_tokens(),
                    "decodeKvTokens": p.usable_kv_tokens(),
                    "decodeConcurrency": p.decode_concurrency(),
                    # What one prefill instance's prefix cache holds: the host tier keeps a
                    # copy of the GPU cache (write-through), so the larger of the two.
                    "prefillCacheTokens": int(p.kv_capacity * max(1.0, self.hicache_ratio))
                    if self.prefill_cache_tokens is None
                    else self.prefill_cache_tokens,
                },
                "switching": {
                    "cooldownSeconds": self.cooldown,
                    "drainTimeoutSeconds": self.drain_timeout,
                }
                | ({} if self.smoothing is None else {"smoothingSeconds": self.smoothing})
                | ({} if self.hysteresis is None else {"hysteresis": self.hysteresis}),
            }
        )


@dataclass(frozen=True, slots=True)
class Prediction:
    at: float
    prefill: float  # predicted W_P of [at, at + S)
    decode: float  # predicted Â_D
    backlog: int  # ground truth at `at`
    arrivals_before: int  # index into the arrival log at `at`
    admissions_before: int


@dataclass
class SimResult:
    scenario: Scenario
    policy: str
    makespan: float
    step_times: list[float]
    idle_ratio: float  # decode ranks held by a prefill rank / active GPU time (colocation)
    switches: int
    aborted: int
    retracted: int
    dropped: int
    trajectories: int
    mean_completion: float
    events: int
    wall_seconds: float
    timeline: list[tuple[float, int, int, int]]
    windows: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    # (t, predicted prefill, measured prefill, predicted admissions, measured admissions)
    wape_prefill: float | None = None
    wape_decode: float | None = None
    controller_accuracy: dict[str, float | None] | None = None
    # Time averages over the run, sampled every horizon: decode instances' KV in use over
    # their capacity, and requests waiting for decode admission (KV full) per instance.
    decode_kv_utilisation: float = 0.0
    admission_queue: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Policy(Protocol):
    """A P/D allocation policy under test."""

    name: str

    def initial_roles(self, sim: Simulation) -> list[str]: ...
    def attach(self, sim: Simulation) -> None: ...


class Simulation:
    """The pieces of one run, shared with the policy under test."""

    def __init__(self, scenario: Scenario, policy: Policy, *, emit_events: bool = False) -> None:
        self.scenario = scenario
        self.policy = policy
        self.profile = scenario.profile()
        self.task = scenario.task_profile()
        self.spec = scenario.spec()
        self.loop = Loop()
        self.predictions: list[Prediction] = []
        self._kv_samples: list[tuple[float, float]] = []  # (KV used share, queue per inst)
        self.trainer_started_at: float | None = None  # when the trainer saw Ready
        self.cluster = SimCluster(
            loop=self.loop,
            profile=self.profile,
            roles=policy.initial_roles(self),
            switch_seconds=scenario.switch_seconds,
            drain_timeout=scenario.drain_timeout,
            hicache_ratio=scenario.hicache_ratio,
            prefix_cache=scenario.prefix_cache,
            kv_store=scenario.shared_store(),
            router_drain_seconds=scenario.router_drain_seconds,
            router_register_seconds=scenario.router_register_seconds,
            dp_aware=scenario.dp_aware(),
            prefix="sim",
        )
        self.trainer = Trainer(
            loop=self.loop,
            cluster=self.cluster,
            task=self.task,
            seed=scenario.seed,
            staleness=scenario.staleness,
            steps=scenario.steps,
            injection=scenario.injection,  # type: ignore[arg-type]
            rate_per_second=scenario.fixed_rate() if scenario.injection == "fixedRate" else 0.0,
            groups_per_step=scenario.groups_per_step,
            max_concurrent=scenario.max_concurrent,
            max_context=self.profile.max_context,
            emit=emit_events,
            weight_update_events=scenario.weight_update_events,
            prefill_events=scenario.prefill_events,
            weight_update_seconds=scenario.update_seconds(),
            scripts=scenario.scripts(),
        )

    @property
    def trainer_started(self) -> bool:
        return self.trainer_started_at is not None

    def start_trainer(self) -> None:
        """The trainer begins its first dispatch now (once).

        A policy that runs the operator's bootstrap (every engine starts as decode) calls
        this when the operator would write Ready (:mod:`prorsa.core.readiness`): the
        simulated trainer models a user who waits for it, as docs/trainers.md tells users
        to, since smg refuses every request (HTTP 503) while no prefill engine is listed.
        The other policies start at their split and serve at once. The makespan counts
        from the simulation's start either way: the wait is the user's.
        """
        if self.trainer_started_at is None:
            self.trainer_started_at = self.loop.now
            self.trainer.start()

    def record_prediction(self, now: float, *, prefill: float, decode: float) -> None:
        stats = self.trainer.stats
        self.predictions.append(
            Prediction(
                at=now,
                prefill=prefill,
                decode=decode,
                # Prompts a paused trainer holds during a weight update are queued too.
                backlog=self.cluster.backlog_tokens + sum(r.prompt for r in self.trainer.held),
                arrivals_before=len(stats.arrivals),
                admissions_before=len(stats.admissions),
            )
        )

    def measured(self, p: Prediction) -> tuple[float, float]:
        """Ground-truth prefill demand and decode admissions of [p.at, p.at + S)."""
        end = p.at + self.scenario.horizon
        arr = self.trainer.stats.arrivals
        adm = self.trainer.stats.admissions
        a_end = bisect_left(arr, end, lo=p.arrivals_before, key=lambda e: e[0])
        d_end = bisect_left(adm, end, lo=p.admissions_before, key=lambda e: e[0])
        prefill = p.backlog + sum(x for _t, x in arr[p.arrivals_before : a_end])
        decode = sum(x for _t, x in adm[p.admissions_before : d_end])
        return float(prefill), float(decode)

    def run(self) -> SimResult:
        started = time.perf_counter()
        self.policy.attach(self)
        self.loop.every(self.scenario.horizon, self._sample_decode)
        if not getattr(self.policy, "trainer_waits_for_ready", False):
            self.start_trainer()
        with contextlib.suppress(SimulationError):  # did not finish: infinite makespan
            self.loop.run(until=self.scenario.time_limit)
        makespan = self.trainer.finished_at if self.trainer.finished_at is not None else math.inf
        wall = time.perf_counter() - started
        return self._result(makespan, wall)

    def _sample_decode(self, now: float) -> None:
        """How full the decode side is: the regime a setting runs in (KV-bound or not)."""
        if self.trainer.finished_at is not None:
            return
        decode = [i for i in self.cluster.instances if i.role == DECODE and i.switch is None]
        if not decode:
            return
        used = sum(r.kv_used() for i in decode for r in i.ranks)
        cap = sum(i.cap * len(i.ranks) for i in decode)
        waiting = sum(len(r.wait) for i in decode for r in i.ranks)
        self._kv_samples.append((used / cap, waiting / len(decode)))

    def _result(self, makespan: float, wall: float) -> SimResult:
        cl = self.cluster
        active = sum(i.active_gpu_seconds for i in cl.instances)
        idle = sum(i.interference_idle for i in cl.instances)
        stats = self.trainer.stats
        windows: list[tuple[float, float, float, float, float]] = []
        err_p = act_p = err_d = act_d = 0.0
        end = makespan if math.isfinite(makespan) else self.loop.now
        for p in self.predictions:
            if p.at + self.scenario.horizon > end:
                break
            mp, md = self.measured(p)
            windows.append((p.at, p.prefill, mp, p.decode, md))
            err_p += abs(p.prefill - mp)
            act_p += mp
            err_d += abs(p.decode - md)
            act_d += md
        comp = stats.completions
        result = SimResult(
            scenario=self.scenario,
            policy=self.policy.name,
            makespan=makespan,
            step_times=list(stats.steps),
            idle_ratio=idle / active if active > 0 else 0.0,
            switches=cl.switches_done,
            aborted=cl.aborted,
            retracted=cl.retracted,
            dropped=stats.dropped,
            trajectories=stats.dispatched,
            mean_completion=sum(comp) / len(comp) if comp else 0.0,
            events=stats.events,
            wall_seconds=wall,
            timeline=list(cl.timeline),
            windows=windows,
            wape_prefill=err_p / act_p if act_p > 0 else None,
            wape_decode=err_d / act_d if act_d > 0 else None,
        )
        if self.trainer.scripts is not None:  # a replay: what its verdict reads
            # From the trainer's start, as a recording's are (replay/recording.py): a
            # recorded trainer started once the cluster served, so a policy's wait for
            # Ready is no part of what is compared with it (the makespan keeps it).
            begun = self.trainer_started_at or 0.0
            result.extra["completedAt"] = [t - begun for t in stats.completed_at]
            result.extra["trainerStartedAt"] = begun
            result.extra["cut"] = stats.cut
            result.extra["ranOut"] = stats.ran_out
        if self._kv_samples:
            n = len(self._kv_samples)
            result.decode_kv_utilisation = sum(u for u, _q in self._kv_samples) / n
            result.admission_queue = sum(q for _u, q in self._kv_samples) / n
        if cl.kv_store is not None:
            result.extra["kvStore"] = cl.kv_store.summary()
        finish = getattr(self.policy, "finish", None)
        if finish is not None:
            finish(self, result)
        return result


def simulate(scenario: Scenario, policy: Policy) -> SimResult:
    """Run ``policy`` on ``scenario`` and measure it (deterministic for a given seed)."""
    emit = bool(getattr(policy, "needs_events", False))
    return Simulation(scenario, policy, emit_events=emit).run()
