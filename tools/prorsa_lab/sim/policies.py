"""The P/D allocation policies compared by ``prorsa bench rollout``.

- :class:`Colocation`: every instance prefills and decodes (chunked prefill); no switching.
- :class:`Static`: a fixed nP:nD split (the benchmark sweeps every split for the best one).
- :class:`Reactive`: NVIDIA Dynamo's load planner rules (``core/load_scaling.py``), queue and
  KV thresholds, one instance per 5 s step, nothing new while a change is pending.
- :class:`Throughput`: Dynamo's throughput planner rules (``core/throughput_scaling.py``):
  predicted request rate x length over per-engine throughput, every 180 s.
- :class:`Prorsa`: the project's :class:`prorsa.core.controller.Controller`, fed only webhook
  CONTRACT events and ``/v1/state`` bodies; its engines start as decode, as the operator's
  do, and the operator's own stage (:mod:`prorsa.core.actions`: the bootstrap to
  ``roles.prefill.initial``, then the ``switching.mode`` gate) chooses which switches are
  executed as the operator's executor would (drain, switch time, relabel) and reported back.
- :class:`Oracle`: the same Controller with the true demand of the next horizon plugged in
  switch rules as the Controller, fed the true demand of the next horizon read from the
  simulator's ground truth: the limit any forecaster can reach under the same switch cost.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from functools import partial
from typing import TYPE_CHECKING

from prorsa.core.actions import Actions, ActionState, decide_actions
from prorsa.core.controller import Controller
from prorsa.core.decision import Forecast
from prorsa.core.measure import CACHE_FILL
from prorsa.core.readiness import readiness, role_counts
from prorsa.core.types import Demand, DemandInputs, TickInput
from prorsa_lab.sim.engine import COLOCATED, DECODE, PREFILL, RUNNING, Instance
from prorsa_lab.sim.workloads import TEMPLATE_TOKENS

if TYPE_CHECKING:
    from prorsa_lab.sim.simulator import Policy, SimResult, Simulation
    from prorsa_lab.sim.trainer import Trajectory


def _split(n: int, prefill: int) -> list[str]:
    return [PREFILL] * prefill + [DECODE] * (n - prefill)


def _initial_split(sim: Simulation) -> list[str]:
    return _split(sim.scenario.instances, sim.spec.initial_prefill())


def _least_loaded(insts: list[Instance], src: str) -> list[Instance]:
    """Appendix C step 1 ordering: the instance with the least work to drain first."""
    if src == DECODE:
        return sorted(
            insts,
            key=lambda i: (
                sum(r.n_run + len(r.wait) for r in i.ranks),
                sum(r.kv_used() for r in i.ranks),
                i.index,
            ),
        )
    return sorted(insts, key=lambda i: (i.load_tokens(), i.index))


def _eligible(sim: Simulation, src: str, cooldown: dict[str, float], now: float) -> list[Instance]:
    return [
        i
        for i in sim.cluster.instances
        if i.role == src and i.switch is None and cooldown.get(i.name, -math.inf) <= now
    ]


class Colocation:
    name = "colocation"

    def initial_roles(self, sim: Simulation) -> list[str]:
        return [COLOCATED] * sim.scenario.instances

    def attach(self, sim: Simulation) -> None:
        return None


class Static:
    def __init__(self, prefill: int) -> None:
        self.prefill = prefill
        self.name = f"static-{prefill}P"

    def initial_roles(self, sim: Simulation) -> list[str]:
        n = sim.scenario.instances
        if not 1 <= self.prefill <= n - 1:
            raise ValueError(f"static split needs 1..{n - 1} prefill instances")
        return _split(n, self.prefill)

    def attach(self, sim: Simulation) -> None:
        return None


class Reactive:
    """Dynamo load planner, under a fixed budget (a "+1 prefill" is a decode->prefill switch).

    Prefill scales up when any engine's queued prefill tokens reach the context length and
    down when every engine is below 0.1 of it; decode scales up when (scheduled + queued KV)
    over capacity exceeds 1.0 on any engine and down when all are below 0.6.
    """

    name = "reactive"

    def __init__(
        self,
        *,
        interval: float = 5.0,
        up: float = 1.0,
        down: float = 0.6,
        prefill_down: float = 0.1,
    ) -> None:
        self.interval = interval
        self.up, self.down, self.prefill_down = up, down, prefill_down

    def initial_roles(self, sim: Simulation) -> list[str]:
        return _initial_split(sim)

    def attach(self, sim: Simulation) -> None:
        self.sim = sim
        sim.loop.every(self.interval, self.tick, start=self.interval)

    def tick(self, now: float) -> None:
        cl = self.sim.cluster
        if any(i.switch is not None for i in cl.instances):
            return  # nothing new while a change is pending
        ctx = self.sim.profile.max_context
        prefill = [i for i in cl.instances if i.role == PREFILL]
        decode = [i for i in cl.instances if i.role == DECODE]
        queued = [i.load_tokens() for i in prefill]
        p_up = any(q >= ctx for q in queued)
        p_down = all(q < self.prefill_down * ctx for q in queued)
        kv = [i.kv_load() for i in decode]
        d_up = any(k > self.up for k in kv)
        d_down = all(k < self.down for k in kv)
        to: str | None = None
        if p_up and not d_up:
            to = PREFILL
        elif (d_up and not p_up) or (p_down and not d_down):
            to = DECODE
        elif d_down and not p_down:
            to = PREFILL
        if to == PREFILL and len(decode) > 1:
            src = _least_loaded(decode, DECODE)[0]
            cl.start_switch(src.name, PREFILL)
        elif to == DECODE and len(prefill) > 1:
            src = _least_loaded(prefill, PREFILL)[0]
            cl.start_switch(src.name, DECODE)


class Throughput:
    """Dynamo throughput planner with its constant predictor, under a fixed budget.

    n_P = ceil(rate x ISL / per-engine prefill throughput) and n_D = ceil(rate x OSL /
    per-engine decode throughput), both from the last interval's observations, then scaled
    proportionally to the instance budget. Per-engine throughputs are the profiled ones.
    """

    name = "throughput"

    def __init__(self, *, interval: float = 180.0) -> None:
        self.interval = interval

    def initial_roles(self, sim: Simulation) -> list[str]:
        return _initial_split(sim)

    def attach(self, sim: Simulation) -> None:
        self.sim = sim
        self._arr = 0
        self._out = 0
        sim.loop.every(self.interval, self.tick, start=self.interval)

    def tick(self, now: float) -> None:
        sim = self.sim
        stats = sim.trainer.stats
        arr = stats.arrivals[self._arr :]
        outs = stats.outputs[self._out :]
        self._arr, self._out = len(stats.arrivals), len(stats.outputs)
        if not arr:
            return
        rate = len(arr) / self.interval
        isl = sum(x for _t, x in arr) / len(arr)
        osl = sum(x for _t, x in outs) / len(outs) if outs else 1.0
        p = sim.profile
        n_p = math.ceil(rate * isl / p.prefill_tokens_per_second)
        n_d = math.ceil(rate * osl / p.decode_tokens_per_second(context=isl))
        n = sim.scenario.instances
        total = max(n_p + n_d, 1)
        target = min(max(round(n * n_p / total), 1), n - 1)
        cur = sum(1 for i in sim.cluster.instances if i.role == PREFILL and i.switch is None)
        cur += sum(
            1 for i in sim.cluster.instances if i.switch is not None and i.switch.to == PREFILL
        )
        need = target - cur
        if need == 0:
            return
        src, dst = (DECODE, PREFILL) if need > 0 else (PREFILL, DECODE)
        pool = [i for i in sim.cluster.instances if i.role == src and i.switch is None]
        for inst in _least_loaded(pool, src)[: abs(need)]:
            sim.cluster.start_switch(inst.name, dst)


class _Planned(ABC):
    """Shared by Prorsa's executor and the oracle: execute switches, keep cooldowns."""

    def _execute(self, sim: Simulation, name: str, to: str) -> bool:
        return sim.cluster.start_switch(name, to, on_done=partial(self._done, name, to))

    def _done(self, name: str, to: str, ok: bool, at: float) -> None:
        self._switched(name, to, at, ok)

    @abstractmethod
    def _switched(self, name: str, to: str, at: float, ok: bool) -> None: ...


class Prorsa(_Planned):
    """The real Controller behind the operator's executor, in virtual time."""

    name = "prorsa"
    needs_events = True
    # The trainer starts when the operator's status would say Ready (Simulation.start_trainer).
    trainer_waits_for_ready = True

    def initial_roles(self, sim: Simulation) -> list[str]:
        # Every engine the operator deploys is launched as decode (core/engine_flags.py:
        # `--disaggregation-mode decode`; k8s/objects.py engine pods); the bootstrap stage
        # (core/actions.py) flips them to roles.prefill.initial once all answer healthy.
        return [DECODE] * sim.scenario.instances

    def attach(self, sim: Simulation) -> None:
        self.sim = sim
        self.controller = Controller(sim.spec)
        self.actions = ActionState()
        self.last_actions: Actions | None = None  # what the last tick carried out
        self.decisions = 0
        self.anomalies = 0
        self.tick_seconds = 0.0
        # The engines answer from the start, and the operator is woken as the last engine pod
        # turns Ready (shell/handlers.py, pod events while the bootstrap has not begun), so its
        # first tick, the one that starts the bootstrap, comes at once, not a period later.
        sim.loop.at(0.0, self._woken, 0.0)
        sim.loop.every(sim.scenario.horizon, self.tick, start=sim.scenario.horizon)
        if sim.trainer.weight_update_events:
            # The operator ticks when the event comes in (the runtime is woken), not at the
            # end of its period: the update is the lead time a switch can use.
            sim.trainer.on_update_started.append(self._woken)

    def _woken(self, now: float) -> None:
        self.tick(now, scheduled=False)

    def tick(self, now: float, *, scheduled: bool = True) -> None:
        sim = self.sim
        c = self.controller
        t0 = time.perf_counter()
        result = c.observe(sim.trainer.drain_outbox())
        self.anomalies += result.anomalies
        states = sim.cluster.engine_states()
        decision = c.tick(TickInput(now=now, engines=tuple(states)))
        self.tick_seconds += time.perf_counter() - t0
        self.decisions += 1
        if scheduled:  # one prediction per horizon window, as the WAPE is scored
            sim.record_prediction(
                now,
                prefill=decision.forecast.prefill_tokens,
                decode=decision.forecast.decode_admission_tokens,
            )
        actions = decide_actions(
            decision=decision,
            mode=sim.spec.switching.mode,
            spec=sim.spec,
            states=states,
            state=self.actions,
        )
        self.actions, self.last_actions = actions.state, actions
        for order in actions.execute:
            self._execute(sim, order.switch.instance, order.switch.to)
        if not sim.trainer_started:
            # The status this tick writes, from the states it read (control/status.py).
            roles = role_counts(states)
            ready = readiness(
                expected=sim.spec.instances,
                prefill=roles["prefill"],
                decode=roles["decode"],
                switching=roles["switching"],
                degraded=False,
            )
            if ready.ready:
                sim.start_trainer()

    def _switched(self, name: str, to: str, at: float, ok: bool) -> None:
        self.controller.record_switch(name, at=at)

    def finish(self, sim: Simulation, result: SimResult) -> None:
        result.controller_accuracy = self.controller.accuracy()
        result.extra["anomalies"] = self.anomalies
        result.extra["controllerSeconds"] = self.tick_seconds
        result.extra["ticks"] = self.decisions
        costs = self.controller.switch_costs
        result.extra["switchSeconds"] = costs.seconds
        result.extra["abortShare"] = costs.abort_share
        result.extra["switchesMeasured"] = costs.measured


class Oracle(Prorsa):
    """The same Controller, fed the true demand of the next horizon (a demand source).

    Everything but the demand is the shipped code: smoothing, Eq. 1, switch pricing and
    the choice of instances. What it reaches is the limit of any forecaster under the
    same switch cost.
    """

    name = "oracle"

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        self.kv_capacity = sim.spec.capacity.decode_kv_tokens or sim.profile.kv_capacity
        self.controller.demand_source = self.true_demand

    def true_demand(self, inputs: DemandInputs) -> Demand:
        a, b, w_p, adm, (queued, burst), decoding = self.demand(inputs.now)
        forecast = Forecast(
            prefill_tokens=round(w_p), decode_admission_tokens=round(adm), decode_kv_tokens=0
        )
        return Demand(
            mode="predictive",
            a=a,
            b=b,
            forecast=forecast,
            cache=self.cache_demand(),
            queued=queued,
            burst=burst,
            decoding=decoding,
        )

    def demand(self, now: float) -> tuple[float, float, float, float, tuple[float, float], int]:
        """True (prefill instances, decode KV instances, prefill tokens, admission tokens,
        prefill instance-seconds (queued at engines, waiting to be routed), requests in or
        headed for decode)."""
        sim = self.sim
        p = sim.profile
        S = sim.scenario.horizon
        end = now + S
        cl = sim.cluster
        per_token_cache: dict[int, float] = {}

        def per_token(prefix: int) -> float:
            # Cost per token of a full chunk at this prefix (chunks pack several requests).
            key = prefix // 1024
            v = per_token_cache.get(key)
            if v is None:
                v = per_token_cache[key] = p.prefill_seconds(p.chunk, key * 1024) / p.chunk
            return v

        # (arrival time, prompt tokens, rank-seconds of prefill work)
        work: list[tuple[float, int, float]] = []
        queued = 0.0  # rank-seconds already routed to a prefill instance
        for inst in cl.instances:
            if inst.role == DECODE:
                continue
            for r in inst.ranks:
                for req in r.pq:
                    if req.silent:
                        continue
                    left = req.prompt - req.done
                    work.append((now, req.prompt, left * per_token(req.done)))
                    queued += work[-1][2]
        # Not routed yet: the router's queue, and what a paused trainer holds during a
        # weight update (sent when it ends, wherever prefill capacity is then).
        for req in (*cl.pending_prefill, *sim.trainer.held):
            work.append((now, req.prompt, req.prompt * per_token(0)))
        cached: dict[str, int] = {}
        for inst in cl.instances:
            if inst.role == DECODE:
                continue
            for r in inst.ranks:
                for traj, n in r.cache.items():
                    if n > cached.get(traj, 0):
                        cached[traj] = n
        tr = sim.trainer
        launches = 0
        for t in tr.live.values():
            arrival = t.next_arrival
            reward_end = t.reward_end
            if arrival is None and reward_end is None and t.state == "decode":
                arrival, reward_end = self._after_decode(t, now)
            if arrival is not None and arrival[0] < end:
                at, x = arrival
                hit = min(cached.get(t.tid, 0), x - 1)
                work.append((at, x, (x - hit) * per_token(hit)))
            elif (
                reward_end is not None
                and reward_end < end
                and not tr.on_policy
                and tr.injection == "replaceOnReward"
                and t.script.accepted
            ):
                arrive = reward_end + sim.task.prewarm.median
                if arrive < end and tr.stats.dispatched + launches < (
                    (tr.version + tr.staleness + 1) * tr.batch
                ):
                    launches += 1
                    x = tr.peek_prompt()
                    work.append((arrive, x, x * per_token(0)))
        prefill_tokens = float(sum(x for _a, x, _w in work))
        a = sum(w for _a, _x, w in work) / (p.ranks * S)
        # K_D: KV held or about to be held by decode instances; K̂_D: prompts whose prefill
        # ends within the horizon (fluid per-instance schedule over the true work).
        k_d = 0
        decoding = 0
        for inst in cl.instances:
            if inst.role == DECODE:
                k_d += sum(r.kv_running() + r.wait_tokens for r in inst.ranks)
                decoding += sum(r.n_run + len(r.wait) for r in inst.ranks)
        k_d += sum(req.prompt for req in cl.transferring)
        free = [now] * max(1, sum(1 for i in cl.instances if i.role == PREFILL))
        admitted = 0.0
        admissions = 0
        for at, x, w in sorted(work, key=lambda e: e[0]):
            m = min(range(len(free)), key=free.__getitem__)
            finish = max(free[m], at) + w / p.ranks
            free[m] = finish
            if finish < end:
                admitted += x
                admissions += 1
        # The Controller's decode demand: KV (Eq. 1) or concurrency, the larger; requests
        # queued for prefill now decode next, as the Controller counts them.
        pending = sum(1 for at, _x, _w in work if at <= now)
        decoding += max(admissions, pending)
        b = (k_d + admitted) / self.kv_capacity
        # Work that has arrived but is not routed yet: everything due now less what is
        # already queued at a prefill instance (both in rank-seconds).
        waiting = sum(w for at, _x, w in work if at <= now) - queued
        return a, b, prefill_tokens, admitted, (queued / p.ranks, waiting / p.ranks), decoding

    def cache_demand(self) -> float:
        """The Controller's prefix-cache floor on the true contexts of live trajectories."""
        sim = self.sim
        per = sim.spec.capacity.prefill_cache_tokens
        per = sim.profile.kv_capacity if per is None else per
        if per <= 0:
            return 0.0
        returning = ("ready", "prefill", "decode", "tool")
        ctx = sum(t.context for t in sim.trainer.live.values() if t.state in returning)
        return ctx / (CACHE_FILL * per)

    def _after_decode(
        self, t: Trajectory, now: float
    ) -> tuple[tuple[float, int] | None, float | None]:
        """When a decoding trajectory's turn ends: (next arrival, reward end), one is None.

        The turn's output length, tool time and reward time are the trajectory's script;
        the decode speed is its rank's current step time (or, before it runs, the mean step
        of the decode instances), so the arrival is as true as the next steps allow.
        """
        req = t.req
        if req is None:
            return None, None
        left: float = req.new_tokens - req.generated
        inst, rank = req.inst, req.rank
        if req.where == RUNNING and inst is not None and rank is not None and inst.busy:
            step = inst.seg_step
            left = req.finish_counter - rank.counter - (now - inst.seg_start) / step
        else:
            steps = [i.seg_step for i in self.sim.cluster.instances if i.busy and i.role != PREFILL]
            step = sum(steps) / len(steps) if steps else self.sim.profile.decode_seconds(1, 8192)
        done = now + max(left, 0.0) * step
        turn = t.script.turns[t.turn]
        if turn.finish == "tool":
            x = req.prompt + req.new_tokens + turn.result_tokens + TEMPLATE_TOKENS
            return (done + turn.tool_seconds, x), None
        return None, done + t.script.reward_seconds


def baseline(name: str) -> Policy:
    """A policy by name: colocation, static-<n>, reactive, throughput, prorsa, oracle."""
    if name == "colocation":
        return Colocation()
    if name.startswith("static-"):
        return Static(int(name.removeprefix("static-").removesuffix("P")))
    table: dict[str, type[Policy]] = {
        "reactive": Reactive,
        "throughput": Throughput,
        "prorsa": Prorsa,
        "oracle": Oracle,
    }
    try:
        return table[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}") from None
