"""Engine instances and the cluster around them: the inference half of the simulator.

An instance has R attention-DP ranks (SGLang ``--enable-dp-attention``). Each rank keeps
its own prefill queue, running decode batch and prefix (radix) cache, as SGLang's per-rank
schedulers do. Instances step in lockstep across their ranks: in one forward step a rank
runs either a prefill chunk (at most ``chunk`` tokens, several requests packed; SGLang
gives waiting prefill priority and does not mix chunks into decode batches by default) or
one decode step of its running batch, and every rank then waits for the slowest one at the
MoE all-to-all. That single rule produces the colocation interference of paper §3.2: a
rank busy with a prefill chunk holds every decoding rank of the instance, whose idle time
is reported as the GPU idle ratio.

Roles: ``prefill`` (PD disaggregated; finished prompts move to a decode instance over
RDMA), ``decode`` (admits transferred requests while their KV fits), ``colocated`` (both,
chunked prefill, the PD-colocation baseline). A role switch drains the instance (queued
prefills move elsewhere, running decodes get ``drain_timeout`` seconds to finish and are
then aborted and resent, as the operator's switch does) and then costs ``switch_seconds``.
A flip wipes the instance's prefix caches; with a shared KV store (:mod:`.kv_store`) what
the store holds survives it, and every instance's prefill can load from it.

Decode steps between events are taken in bulk: with no prefill work anywhere in the
instance, the batch is constant until the next request finishes, so k steps of identical
length are one event. Arrivals cut a bulk segment at the next step boundary.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from prorsa_contract.agent_api import EngineState
from prorsa_lab.sim.costmodel import ModelProfile, StepTimes
from prorsa_lab.sim.kv_store import STORE_BYTES_PER_SECOND_PER_GPU, SharedKVStore
from prorsa_lab.sim.loop import Loop

PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"

# SGLang keeps room for running requests to grow: its new_token_ratio decays to 0.1 of the
# clipped max-new-tokens estimate (4096), i.e. about 410 tokens reserved per running request.
DECODE_RESERVE_TOKENS = 410
# Bulk decode segments are re-planned at least this often, so step times follow KV growth.
MAX_SEGMENT_SECONDS = 5.0
# A decode request evicted for KV space is offloaded to host memory and loaded back.
HOST_BYTES_PER_SECOND_PER_GPU = 25e9
# The router's cache_aware policy, at smg's defaults (--cache-threshold 0.3,
# --balance-abs-threshold 64, --balance-rel-threshold 1.5).
CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5

# Where a request is.
NEW, QUEUED, TRANSFER, WAITING, RUNNING, DONE = range(6)


class Listener(Protocol):
    """What the engines tell the trainer (the SDK sees these on its HTTP streams)."""

    def on_prefill_started(self, req: SimRequest, instance: str, now: float) -> None: ...
    def on_prefill_finished(self, req: SimRequest, instance: str, now: float) -> None: ...
    def on_decode_finished(self, req: SimRequest, now: float) -> None: ...
    def on_aborted(self, req: SimRequest, now: float) -> None: ...


class _Detached:
    """The listener of a cluster no trainer has attached to yet: any report is a bug."""

    def _fail(self, *_args: object) -> None:
        raise RuntimeError("the cluster has no trainer attached")

    on_prefill_started = on_prefill_finished = on_decode_finished = on_aborted = _fail


class SimRequest:
    """One generate call: a full prompt and the tokens this call must produce."""

    __slots__ = (
        "admit_counter",
        "admit_kv",
        "cached",
        "done",
        "finish_counter",
        "generated",
        "inst",
        "new_tokens",
        "owner",
        "prompt",
        "rank",
        "rid",
        "silent",
        "started",
        "traj",
        "turn",
        "where",
    )

    def __init__(
        self, *, rid: str, traj: str, turn: int, prompt: int, new_tokens: int, owner: object = None
    ) -> None:
        self.rid = rid
        self.traj = traj
        self.turn = turn
        self.prompt = prompt  # x_j, full prompt including any cached prefix
        self.new_tokens = max(1, new_tokens)
        self.owner = owner  # the trainer's trajectory object
        self.generated = 0
        self.done = 0  # tokens of the prompt already in KV (cached + prefilled)
        self.cached = 0
        self.started = False
        self.silent = False  # re-prefill after a colocated KV retraction: no new events
        self.where = NEW
        self.inst: Instance | None = None
        self.rank: SimRank | None = None
        self.admit_counter = 0
        self.admit_kv = 0
        self.finish_counter = 0

    def context(self) -> int:
        return self.prompt + self.generated


class SimRank:
    """One attention-DP rank: its queues, its running batch, its slice of KV."""

    __slots__ = (
        "cache",
        "cache_tokens",
        "counter",
        "dkey_b",
        "dkey_n",
        "dtime",
        "heap",
        "host",
        "host_tokens",
        "idx",
        "inst",
        "kind",
        "kv_base",
        "kv_prefill",
        "load_seconds",
        "n_run",
        "plan",
        "pq",
        "pq_tokens",
        "processed",
        "running",
        "step_time",
        "tx_free",
        "wait",
        "wait_tokens",
    )

    def __init__(self, inst: Instance, idx: int) -> None:
        self.inst = inst
        self.idx = idx
        self.pq: deque[SimRequest] = deque()  # waiting for or in prefill (FIFO)
        self.pq_tokens = 0  # prompt tokens not yet prefilled in pq (routing load)
        self.processed = 0  # requests smg sent it as a worker (--dp-aware): a tie-break
        self.kv_prefill = 0  # KV held by prompts being prefilled
        self.wait: deque[SimRequest] = deque()  # decode admission queue
        self.wait_tokens = 0
        self.running: dict[SimRequest, None] = {}  # in admission order (last = newest)
        self.heap: list[tuple[int, int, SimRequest]] = []  # (finish counter, seq, request)
        self.counter = 0  # decode steps this rank has run
        self.kv_base = 0  # sum(admit_kv - admit_counter) over running
        self.n_run = 0
        self.cache: OrderedDict[str, int] = OrderedDict()  # trajectory -> cached prefix
        self.cache_tokens = 0
        # HiCache's host tier (L2), written through from the GPU cache; LRU by its size.
        self.host: OrderedDict[str, int] = OrderedDict()
        self.host_tokens = 0
        self.load_seconds = 0.0  # host -> GPU loads to run with the next prefill step
        self.kind = 0  # this step: 0 idle, 1 prefill, 2 decode
        self.plan: list[tuple[SimRequest, int]] = []
        self.step_time = 0.0
        self.tx_free = 0.0  # when this rank's NIC is free for the next KV transfer
        self.dkey_n = -1  # memo of the last decode step time: (batch, 128-token bucket)
        self.dkey_b = -1
        self.dtime = 0.0

    def kv_running(self) -> int:
        return self.kv_base + self.n_run * self.counter

    def kv_used(self) -> int:
        return self.kv_base + self.n_run * self.counter + self.kv_prefill


@dataclass
class SwitchJob:
    to: str
    started: float
    deadline: float
    on_done: Callable[[bool, float], None] | None
    phase: str = "draining"


class Instance:
    """One engine instance (an SGLang server with R attention-DP ranks)."""

    def __init__(self, cluster: SimCluster, index: int, role: str) -> None:
        self.cluster = cluster
        self.index = index
        self.name = f"{cluster.prefix}-engine-{index}"
        self.role = role
        p = cluster.profile
        self.ranks = [SimRank(self, i) for i in range(p.ranks)]
        self.cap = p.kv_capacity_per_rank
        self.host_cap = int(cluster.hicache_ratio * self.cap)
        self.accepting = True
        self.switch: SwitchJob | None = None
        self.gen = 0  # bumps to cancel a scheduled step
        self.busy = False
        self._stepping = False
        self.seg_start = 0.0
        self.seg_step = 0.0
        self.seg_k = 0
        self.seg_end = 0.0
        self.seg_prefill_max = 0.0
        self.kv_est = 0  # KV used + waiting, refreshed at every step plan (router signal)
        self.transfers_in = 0
        self.rr = 0  # SGLang DataParallelController.round_robin_counter
        self.processed = 0  # requests smg sent it as a worker: cache_aware's tie-break
        self.nreq = 0  # requests queued, in prefill or decoding: the router's load metric
        # Counters for /v1/state and the benchmark.
        self.prefill_busy_seconds = 0.0
        self.prefill_tokens = 0
        self.active_gpu_seconds = 0.0  # R x step length over steps with any work
        self.interference_idle = 0.0  # decode ranks waiting on a prefill rank, rank-seconds
        self.imbalance_idle = 0.0  # ranks with work waiting on a slower rank of the same kind

    # -- state for the agents --------------------------------------------------------------

    def state(self) -> EngineState:
        running = waiting = waiting_tokens = kv = 0
        for r in self.ranks:
            started = sum(1 for q in r.pq if q.started)
            running += r.n_run + started
            waiting += len(r.pq) - started + len(r.wait)
            waiting_tokens += r.pq_tokens + r.wait_tokens
            kv += r.kv_used()
        if self.role == DECODE:
            waiting += self.transfers_in
        role = self.role if self.role != COLOCATED else PREFILL
        return EngineState(
            instance=self.name,
            role=role,  # type: ignore[arg-type]
            switching=self.switch is not None,
            healthy=True,
            running_requests=running,
            waiting_requests=waiting,
            waiting_tokens=waiting_tokens,
            kv_used_tokens=kv,
            kv_capacity_tokens=self.cap * len(self.ranks),
            prefill_busy_seconds=round(self.prefill_busy_seconds, 6),
            prefill_tokens=self.prefill_tokens,
        )

    def load_tokens(self) -> int:
        return sum(r.pq_tokens for r in self.ranks)

    def next_rank(self) -> int:
        """The rank SGLang's DP controller gives a request the router did not place.

        Every engine Prorsa runs is launched as decode, for which SGLang 0.5.23 resolves
        ``--load-balance-method auto`` to ``round_robin`` (``serving_hook.py``
        ``handle_load_balance_method``); the DP controller reads it once at start-up, so it
        stays round robin after a flip to prefill (``data_parallel_controller.py``
        ``round_robin_scheduler``), and a colocated (non-PD) engine resolves to round robin
        too. (An engine *launched* as prefill would follow the bootstrap room instead.)
        """
        n = len(self.ranks)
        i = self.rr % n
        self.rr = (self.rr + 1) % n
        return i

    def kv_load(self) -> float:
        """(KV in use + KV waiting for admission) / capacity, as of the last step plan."""
        return self.kv_est / (self.cap * len(self.ranks))

    def kv_exact(self) -> int:
        return sum(r.kv_used() + r.wait_tokens for r in self.ranks)

    # -- scheduling --------------------------------------------------------------------------

    def poke(self) -> None:
        """New work arrived: start stepping, or cut a bulk segment at the next boundary."""
        if self._stepping:
            return  # the step being closed re-plans when it is done
        loop = self.cluster.loop
        if not self.busy:
            self._plan(loop.now)
            return
        if self.seg_k <= 1:
            return  # the step in flight ends soon and re-plans
        done = math.floor((loop.now - self.seg_start) / self.seg_step + 1e-9)
        k = max(1, done + 1)
        if k < self.seg_k:
            self.seg_k = k
            self.seg_end = self.seg_start + k * self.seg_step
            self.gen += 1
            loop.at(self.seg_end, self._step_end, self.gen)

    def _plan(self, now: float) -> None:
        """Choose every rank's work for the next step (ranks enter with kind 0)."""
        times = self.cluster.times
        can_prefill = self.role != DECODE
        can_decode = self.role != PREFILL
        step = 0.0
        prefill_max = 0.0
        kv = 0
        for r in self.ranks:
            if can_decode and r.wait:
                self._admit(r)
            kv += r.kv_base + r.n_run * r.counter + r.kv_prefill + r.wait_tokens
            if can_prefill and r.pq:
                t = self._plan_prefill(r, now, times)
                if t > 0:
                    r.kind = 1
                    r.step_time = t
                    if t > prefill_max:
                        prefill_max = t
                    continue
            n = r.n_run
            if can_decode and n:
                bucket = (r.kv_base + n * r.counter) // n >> 7
                if n != r.dkey_n or bucket != r.dkey_b:
                    r.dkey_n, r.dkey_b = n, bucket
                    r.dtime = times.decode(n, (bucket << 7) + 64)
                t = r.dtime
                r.kind = 2
                r.step_time = t
                if t > step:
                    step = t
        self.kv_est = kv
        any_prefill = prefill_max > 0.0
        self.seg_prefill_max = prefill_max
        if prefill_max > step:
            step = prefill_max
        if step <= 0.0:
            self.busy = False
            self._maybe_finish_drain(now)
            return
        k = 1
        if not any_prefill:
            k = max(1, int(MAX_SEGMENT_SECONDS / step))
            cap = self.cap
            for r in self.ranks:
                if r.kind != 2:
                    continue
                heap = r.heap
                while heap and heap[0][2].where != RUNNING:
                    heapq.heappop(heap)
                if heap:
                    left = heap[0][0] - r.counter
                    if left < k:
                        k = max(1, left)
                left = (cap - r.kv_base - r.n_run * r.counter - r.kv_prefill) // r.n_run
                if left < k:
                    k = max(1, left)
        self.busy = True
        self.seg_start = now
        self.seg_step = step
        self.seg_k = k
        self.seg_end = now + k * step
        self.gen += 1
        self.cluster.loop.at(self.seg_end, self._step_end, self.gen)

    def _plan_prefill(self, r: SimRank, now: float, times: StepTimes) -> float:
        budget = self.cluster.profile.chunk
        tokens = 0
        prefix_weight = 0.0
        plan: list[tuple[SimRequest, int]] = []
        colocated = self.role == COLOCATED
        for req in r.pq:
            if not req.started:
                if colocated:
                    need = req.prompt + req.generated
                    reserve = r.n_run * DECODE_RESERVE_TOKENS
                    if r.kv_running() + r.kv_prefill + reserve + need > self.cap:
                        break  # SGLang admits prefill only when its KV fits
                self._start_prefill(r, req, now)
            take = min(budget, req.prompt + (req.generated if req.silent else 0) - req.done)
            if take <= 0:
                continue
            plan.append((req, take))
            prefix_weight += take * req.done
            tokens += take
            budget -= take
            if budget <= 0:
                break
        r.plan = plan
        if not tokens:
            return 0.0
        load, r.load_seconds = r.load_seconds, 0.0
        return times.prefill(tokens, prefix_weight / tokens) + load

    def _start_prefill(self, r: SimRank, req: SimRequest, now: float) -> None:
        req.started = True
        target = req.prompt + (req.generated if req.silent else 0)
        hit = r.cache.pop(req.traj, 0)
        if hit:
            r.cache_tokens -= hit
        else:
            hit = r.host.get(req.traj, 0)
            if hit:
                # A host-tier hit is loaded back to GPU memory before it is attended to.
                r.load_seconds += self.cluster.host_load_seconds(min(hit, target - 1))
        store = self.cluster.kv_store
        if store is not None:
            stored = min(store.lookup(req.traj), target - 1)
            near = min(hit, target - 1)
            if stored > near:
                # HiCache prefetches the rest of the prefix from L3 into the host tier and
                # loads it to GPU memory; charged to the step (the prefetch may overlap
                # the request's wait in the queue: a conservative choice).
                r.load_seconds += self.cluster.store_load_seconds(stored - near)
                store.loaded_tokens += stored - near
                store.loads += 1
                hit = stored
        cached = min(hit, target - 1)
        req.cached = cached
        req.done = cached
        r.pq_tokens -= cached
        r.kv_prefill += target
        self._evict(r)
        if not req.silent:
            self.cluster.listener.on_prefill_started(req, self.name, now)

    def _evict(self, r: SimRank) -> None:
        """LRU-evict the prefix cache while KV is over capacity."""
        over = r.kv_used() + r.cache_tokens - self.cap
        cache = r.cache
        while over > 0 and cache:
            _t, n = cache.popitem(last=False)
            r.cache_tokens -= n
            over -= n

    def _remember(self, r: SimRank, traj: str, tokens: int) -> None:
        if not self.cluster.prefix_cache:
            return
        self.cluster.home[traj] = r
        old = r.cache.pop(traj, 0)
        r.cache_tokens += tokens - old
        r.cache[traj] = tokens
        self._evict(r)
        host_cap = self.host_cap
        if host_cap > 0:
            # HiCache write-through (SGLang's default policy): the host tier holds a copy,
            # so a prefix the GPU cache evicts is loaded back instead of recomputed.
            old = r.host.pop(traj, 0)
            r.host_tokens += tokens - old
            r.host[traj] = tokens
            while r.host_tokens > host_cap and r.host:
                _t, n = r.host.popitem(last=False)
                r.host_tokens -= n
        store = self.cluster.kv_store
        if store is not None:
            store.put(traj, tokens)  # HiCache backs its host tier up to L3

    def _step_end(self, gen: int) -> None:
        if gen != self.gen:
            return
        now = self.cluster.loop.now
        k = self.seg_k
        step = self.seg_step
        ranks = self.ranks
        self.busy = False
        self._stepping = True
        self.active_gpu_seconds += len(ranks) * step * k
        prefill_max = self.seg_prefill_max
        any_prefill = prefill_max > 0.0
        if any_prefill:
            self.prefill_busy_seconds += step * k
        interference = imbalance = 0.0
        for r in ranks:
            kind = r.kind
            if kind == 2:
                # A decoding rank held at the MoE barrier by a rank running a prefill chunk
                # is interference; held by a slower decoding rank, imbalance.
                if any_prefill:
                    interference += step - r.step_time
                else:
                    imbalance += step - r.step_time
                r.counter += k
                heap = r.heap
                if heap and heap[0][0] <= r.counter:
                    self._finish_decodes(r, now)
            elif kind == 1:
                imbalance += prefill_max - r.step_time
                self._finish_prefill_chunk(r, now)
            r.kind = 0
        self.interference_idle += interference * k
        self.imbalance_idle += imbalance * k
        if self.role != PREFILL:
            cap = self.cap
            for r in ranks:
                if r.kv_base + r.n_run * r.counter + r.kv_prefill > cap:
                    self._retract(r, now)
        self._stepping = False
        self._plan(now)

    def _finish_prefill_chunk(self, r: SimRank, now: float) -> None:
        listener = self.cluster.listener
        for req, take in r.plan:
            if req.where != QUEUED or req.rank is not r:
                continue  # cancelled during the step: its tokens were already taken off
            req.done += take
            r.pq_tokens -= take
        r.plan = []
        while r.pq:
            req = r.pq[0]
            target = req.prompt + (req.generated if req.silent else 0)
            if req.done < target:
                break
            r.pq.popleft()
            self.nreq -= 1
            r.kv_prefill -= target
            if not req.silent:
                # As the real agent counts (SGLang's total_prefill_uncached_tokens).
                self.prefill_tokens += max(req.prompt - req.cached, 0)
                req.generated = 1  # the first token comes out of prefill
                self.cluster.on_prefill_done(req, now)
                listener.on_prefill_finished(req, self.name, now)
            if self.role == COLOCATED:
                req.silent = False
                self._run(r, req, now)
            else:
                self._remember(r, req.traj, req.prompt)
                self.cluster.send_to_decode(req, r, now)

    def _run(self, r: SimRank, req: SimRequest, now: float) -> None:
        """Add a request with its KV in place to the rank's running batch."""
        req.where = RUNNING
        req.inst, req.rank = self, r
        req.admit_counter = r.counter
        req.admit_kv = req.prompt + req.generated
        req.finish_counter = r.counter + (req.new_tokens - req.generated)
        r.kv_base += req.admit_kv - req.admit_counter
        r.n_run += 1
        self.nreq += 1
        r.running[req] = None
        if req.finish_counter <= r.counter:
            self._complete(r, req, now)
            return
        cluster = self.cluster
        cluster.seq += 1
        heapq.heappush(r.heap, (req.finish_counter, cluster.seq, req))

    def _take_off(self, r: SimRank, req: SimRequest) -> None:
        """Remove a running request from its rank's batch (KV freed)."""
        generated = req.generated + (r.counter - req.admit_counter)
        req.generated = min(generated, req.new_tokens)
        r.kv_base -= req.admit_kv - req.admit_counter
        r.n_run -= 1
        self.nreq -= 1
        del r.running[req]
        req.where = DONE

    def _complete(self, r: SimRank, req: SimRequest, now: float) -> None:
        self._take_off(r, req)
        if self.role == COLOCATED:
            self._remember(r, req.traj, req.context())
        elif self.cluster.kv_store is not None:
            self.cluster.offload(req)
        self.cluster.listener.on_decode_finished(req, now)

    def _finish_decodes(self, r: SimRank, now: float) -> None:
        heap = r.heap
        while heap and heap[0][0] <= r.counter:
            _c, _i, req = heapq.heappop(heap)
            if req.where != RUNNING or req.rank is not r:
                continue
            self._complete(r, req, now)

    def _admit(self, r: SimRank) -> None:
        now = self.cluster.loop.now
        while r.wait:
            req = r.wait[0]
            need = req.prompt + req.generated
            reserve = (r.n_run + 1) * DECODE_RESERVE_TOKENS
            if r.n_run and r.kv_used() + need + reserve > self.cap:
                break
            r.wait.popleft()
            r.wait_tokens -= need
            self._run(r, req, now)
        self._evict(r)

    def _retract(self, r: SimRank, now: float) -> None:
        """KV overflowed while decoding: evict the newest requests (SGLang retract_decode)."""
        cluster = self.cluster
        while r.kv_used() > self.cap and r.n_run > 1:
            req = next(reversed(r.running))
            self._take_off(r, req)
            if self.role == COLOCATED:
                # Recomputed later: back to the head of the prefill queue, full context.
                req.where = QUEUED
                req.started = False
                req.silent = True
                req.done = 0
                r.pq.appendleft(req)
                self.nreq += 1
                r.pq_tokens += req.prompt + req.generated
            else:
                req.where = TRANSFER
                cluster.transferring[req] = None
                cluster.retracted += 1
                bw = HOST_BYTES_PER_SECOND_PER_GPU * cluster.gpus_per_rank
                delay = 2 * req.context() * cluster.profile.kv_wire_bytes_per_token / bw
                self.transfers_in += 1
                cluster.loop.after(delay, self._reload, req, r)

    def _reload(self, req: SimRequest, rank: SimRank) -> None:
        self.transfers_in -= 1
        self.cluster.transferring.pop(req, None)
        if req.where != TRANSFER:
            return
        # A retracted request waits in its own rank's queue (SGLang retracts per scheduler).
        self.cluster.arrive_decode(req, self, rank=rank)

    # -- draining and role switches -------------------------------------------------------

    def _maybe_finish_drain(self, now: float) -> None:
        job = self.switch
        if job is None or job.phase != "draining":
            return
        if any(r.pq or r.n_run or r.wait for r in self.ranks) or self.transfers_in:
            return
        job.phase = "switching"
        cl = self.cluster
        # The engine flips once the router has dropped it (smg's fixed drain after the
        # relabel) and it is idle, whichever comes last.
        start = max(now, job.started + cl.router_drain_seconds)
        cl.loop.at(start + cl.switch_seconds, self._flip)

    def _flip(self) -> None:
        job = self.switch
        assert job is not None
        cl = self.cluster
        now = cl.loop.now
        self.role = job.to
        self.processed = 0  # smg registers the pod anew, as a worker of the new type
        for r in self.ranks:
            # SGLang 0.5.23's flip resets the radix tree and the HiCache host pool.
            _clear_caches(r)
            r.processed = 0
        self.switch = None
        # The router lists it with its new role a little later (smg's discovery).
        self.accepting = cl.router_register_seconds <= 0
        cl.on_switched(self, job, now)
        if not self.accepting:
            cl.loop.after(cl.router_register_seconds, self._routable)

    def _routable(self) -> None:
        if self.switch is None and not self.accepting:
            self.accepting = True
            self.cluster.on_routable(self)


def _clear_caches(r: SimRank) -> None:
    r.cache.clear()
    r.cache_tokens = 0
    r.host.clear()
    r.host_tokens = 0
    r.load_seconds = 0.0


class SimCluster:
    """The instances plus the router, the KV transfer links and the switch executor."""

    def __init__(
        self,
        *,
        loop: Loop,
        profile: ModelProfile,
        roles: Iterable[str],
        listener: Listener | None = None,
        switch_seconds: float = 5.0,
        drain_timeout: float = 30.0,
        hicache_ratio: float = 0.0,
        prefix_cache: bool = True,
        kv_store: SharedKVStore | None = None,
        router_drain_seconds: float = 0.0,
        router_register_seconds: float = 0.0,
        dp_aware: bool = True,
        prefix: str = "sim",
    ) -> None:
        self.loop = loop
        # Who picks an instance's attention-DP rank: the router (smg --dp-aware) or
        # SGLang's DP controller (round robin); see _route_prefill.
        self.dp_aware = dp_aware
        self.profile = profile
        self.listener: Listener = listener if listener is not None else _Detached()
        self.switch_seconds = switch_seconds
        self.router_drain_seconds = router_drain_seconds
        self.router_register_seconds = router_register_seconds
        self.drain_timeout = drain_timeout
        self.hicache_ratio = hicache_ratio
        # False: an engine that keeps no prefix cache (the engine double; a RolloutCluster's
        # capacity.prefillCacheTokens: 0), so every turn prefills its whole context.
        self.prefix_cache = prefix_cache
        # None: each instance's caches are its own and a flip wipes them (SGLang 0.5.23).
        self.kv_store = kv_store
        self.prefix = prefix
        self.gpus_per_rank = profile.gpus_per_rank
        self.times = StepTimes(profile)
        self.instances = [Instance(self, i, role) for i, role in enumerate(roles)]
        self.by_name = {i.name: i for i in self.instances}
        self.home: dict[str, SimRank] = {}  # trajectory -> rank that cached its prefix last
        self._prefill_insts: list[Instance] = []
        self._decode_insts: list[Instance] = []
        self._refresh_routes()
        self.pending_prefill: deque[SimRequest] = deque()
        self.pending_decode: deque[SimRequest] = deque()
        # KV on the wire or reloading from host (a dict: insertion order keeps runs reproducible)
        self.transferring: dict[SimRequest, None] = {}
        self.seq = 0  # tie-breaks in heaps: never object ids (reproducible); a plain int pickles
        # Ground truth for measurement: prompt tokens queued or in prefill right now.
        self.backlog_tokens = 0
        self.switches_done = 0
        self.aborted = 0
        self.retracted = 0
        self.timeline: list[tuple[float, int, int, int]] = []  # (t, prefill, decode, switching)
        self.on_prefill_complete: Callable[[SimRequest, float], None] | None = None
        self._record_roles()

    def host_load_seconds(self, tokens: int) -> float:
        """Loading ``tokens`` of a rank's KV back from host memory (each GPU its share)."""
        bw = HOST_BYTES_PER_SECOND_PER_GPU * self.gpus_per_rank
        return tokens * self.profile.kv_wire_bytes_per_token / bw

    def store_write_seconds(self, tokens: int) -> float:
        """Writing ``tokens`` of a rank's KV to the shared store over its NICs."""
        bw = STORE_BYTES_PER_SECOND_PER_GPU * self.gpus_per_rank
        return max(tokens, 0) * self.profile.kv_wire_bytes_per_token / bw

    def store_load_seconds(self, tokens: int) -> float:
        """Fetching ``tokens`` from the shared store to host memory, then to the GPUs."""
        return self.store_write_seconds(tokens) + self.host_load_seconds(tokens)

    def offload(self, req: SimRequest) -> None:
        """Decode-side KV offload: a finished or aborted request's context goes to L3
        (whole pages; the prompt's pages are there from its prefill)."""
        assert self.kv_store is not None
        self.kv_store.put(req.traj, req.context())
        self.kv_store.offloads += 1

    # -- bookkeeping -------------------------------------------------------------------------

    def role_counts(self) -> tuple[int, int, int]:
        p = d = s = 0
        for inst in self.instances:
            if inst.switch is not None:
                s += 1
            elif inst.role == DECODE:
                d += 1
            else:
                p += 1
        return p, d, s

    def _record_roles(self) -> None:
        p, d, s = self.role_counts()
        if self.timeline and self.timeline[-1][1:] == (p, d, s):
            return
        self.timeline.append((self.loop.now, p, d, s))

    def engine_states(self) -> list[EngineState]:
        return [inst.state() for inst in self.instances]

    def check(self) -> None:
        """Assert the bookkeeping invariants (tests call this between events)."""
        backlog = sum(q.prompt for q in self.pending_prefill)
        for inst in self.instances:
            nreq = 0
            for r in inst.ranks:
                nreq += len(r.pq) + r.n_run
                left = sum(q.prompt + (q.generated if q.silent else 0) - q.done for q in r.pq)
                assert left == r.pq_tokens, (inst.name, r.idx, left, r.pq_tokens)
                held = sum(q.prompt + (q.generated if q.silent else 0) for q in r.pq if q.started)
                assert held == r.kv_prefill, (inst.name, r.idx, held, r.kv_prefill)
                running = sum(q.admit_kv + r.counter - q.admit_counter for q in r.running)
                assert running == r.kv_running(), (inst.name, r.idx, running, r.kv_running())
                assert r.n_run == len(r.running)
                assert r.wait_tokens == sum(q.prompt + q.generated for q in r.wait)
                assert sum(r.cache.values()) == r.cache_tokens
                assert sum(r.host.values()) == r.host_tokens
                assert r.host_tokens <= inst.host_cap or not r.host
                assert r.kv_used() <= inst.cap or r.n_run <= 1, (inst.name, r.idx)
                backlog += sum(q.prompt for q in r.pq if not q.silent)
            assert nreq == inst.nreq, (inst.name, nreq, inst.nreq)
        assert backlog == self.backlog_tokens, (backlog, self.backlog_tokens)
        if self.kv_store is not None:
            self.kv_store.check()

    # -- routing -----------------------------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        """A request joins the ready queue (the trainer emitted request_queued)."""
        self.backlog_tokens += req.prompt
        self._route_prefill(req)

    def _route_prefill(self, req: SimRequest) -> None:
        """smg ``cache_aware`` at its defaults; the rank as the deployment's router picks it.

        A worker's load is its request count. When the busiest worker has more than
        ``BALANCE_ABS`` requests over the idlest and ``BALANCE_REL`` times as many, the idlest
        wins; otherwise the worker holding the trajectory's prefix wins when the match covers
        ``CACHE_THRESHOLD`` of the prompt; else the idlest worker, ties going to the one
        that was sent the fewest requests since smg registered it (smg's ``(load,
        processed, index)`` key).

        With ``dp_aware`` (smg ``--dp-aware``) smg registers every attention-DP rank as a
        worker of its own and sends the rank it chose with the request (``routed_dp_rank``,
        which SGLang's DP controller honours: ``maybe_external_dp_rank_routing``), so the
        policy above runs over ranks. Without it the workers are instances and SGLang's DP
        controller picks the rank: round robin (:meth:`Instance.next_rank`).
        """
        if not self._prefill_insts:
            # smg 1.13.0 refuses such a request at once (503 no_available_workers;
            # tests/test_smg_router_no_prefill.py) and the SDK resends it after its backoff.
            # The trainer waits for Ready (Simulation.start_trainer) and the Controller keeps
            # roles.prefill.min, so a run sends none while the bootstrap runs (Ready comes
            # at the tick after the flips, which smg lists 2 s after them); a prompt that
            # still finds no prefill worker is held here, a simplification of those resends,
            # and routed when one is listed again (on_routable).
            req.where = QUEUED
            self.pending_prefill.append(req)
            return
        target = self._pick_rank(req) if self.dp_aware else self._pick_instance(req)
        req.where = QUEUED
        req.started = False
        req.done = 0
        req.inst, req.rank = target.inst, target
        target.pq.append(req)
        target.inst.nreq += 1
        target.pq_tokens += req.prompt
        target.inst.poke()

    def _prefix_home(self, req: SimRequest) -> SimRank | None:
        """The rank that cached the trajectory's prefix last, if it still serves prefill
        and holds enough of it for cache_aware's match threshold."""
        traj = req.traj
        home = self.home.get(traj)
        if home is None or not home.inst.accepting or home.inst.role == DECODE:
            return None
        hit = home.cache.get(traj, 0) or home.host.get(traj, 0)
        return home if hit and hit >= CACHE_THRESHOLD * req.prompt else None

    def _pick_rank(self, req: SimRequest) -> SimRank:
        """cache_aware over attention-DP ranks as workers (smg ``--dp-aware``)."""
        best: SimRank | None = None
        best_key: tuple[float, float] = (math.inf, math.inf)
        lo, hi = math.inf, -math.inf
        for inst in self._prefill_insts:
            for r in inst.ranks:
                load = len(r.pq) + r.n_run
                if load > hi:
                    hi = load
                if load < lo:
                    lo = load
                key = (load, r.processed)
                if key < best_key:
                    best, best_key = r, key
        assert best is not None
        home = self._prefix_home(req)
        skewed = hi - lo > BALANCE_ABS and hi > BALANCE_REL * lo
        target = home if home is not None and not skewed else best
        target.processed += 1
        return target

    def _pick_instance(self, req: SimRequest) -> SimRank:
        """cache_aware over instances as workers; SGLang's DP controller picks the rank."""
        best: Instance | None = None
        best_key: tuple[float, float] = (math.inf, math.inf)
        lo, hi = math.inf, -math.inf
        for inst in self._prefill_insts:
            load = inst.nreq
            if load < lo:
                lo = load
            if load > hi:
                hi = load
            key = (load, inst.processed)
            if key < best_key:
                best, best_key = inst, key
        assert best is not None
        home = self._prefix_home(req)
        skewed = hi - lo > BALANCE_ABS and hi > BALANCE_REL * lo
        inst = home.inst if home is not None and not skewed else best
        inst.processed += 1
        return inst.ranks[inst.next_rank()]

    def on_prefill_done(self, req: SimRequest, now: float) -> None:
        self.backlog_tokens -= req.prompt
        if self.on_prefill_complete is not None:
            self.on_prefill_complete(req, now)

    def send_to_decode(self, req: SimRequest, src: SimRank, now: float) -> None:
        """KV of a finished prompt goes over RDMA to a decode instance (one NIC per rank)."""
        dst = self._pick_decode()
        start = max(now, src.tx_free)
        done = start + self.profile.transfer_seconds(req.prompt)
        src.tx_free = done
        if self.kv_store is not None:
            # The new part of the prompt goes to L3 over the same NIC, after the transfer.
            src.tx_free += self.store_write_seconds(req.prompt - req.cached)
        req.where = TRANSFER
        self.transferring[req] = None
        if dst is None:
            self.loop.at(done, self._park_decode, req)
            return
        dst.transfers_in += 1
        self.loop.at(done, self._transfer_done, req, dst)

    def _park_decode(self, req: SimRequest) -> None:
        self.transferring.pop(req, None)
        if req.where == TRANSFER:
            dst = self._pick_decode()
            if dst is None:
                self.pending_decode.append(req)
            else:
                self.arrive_decode(req, dst)

    def _transfer_done(self, req: SimRequest, dst: Instance) -> None:
        dst.transfers_in -= 1
        self.transferring.pop(req, None)
        if req.where != TRANSFER:
            dst._maybe_finish_drain(self.loop.now)
            return
        self.arrive_decode(req, dst)
        if not dst.busy:
            dst._maybe_finish_drain(self.loop.now)

    def _pick_decode(self) -> Instance | None:
        best: Instance | None = None
        best_load = math.inf
        for inst in self._decode_insts:
            load = inst.kv_load()
            if load < best_load:
                best, best_load = inst, load
        return best

    def _refresh_routes(self) -> None:
        """Recompute the routable workers after a role or drain change."""
        self._prefill_insts = [i for i in self.instances if i.accepting and i.role != DECODE]
        self._decode_insts = [i for i in self.instances if i.accepting and i.role == DECODE]

    def arrive_decode(
        self, req: SimRequest, inst: Instance, *, rank: SimRank | None = None
    ) -> None:
        if not inst.accepting or inst.role != DECODE:
            other = self._pick_decode()
            if other is None:
                self.pending_decode.append(req)
                return
            inst, rank = other, None
        if rank is not None and rank.inst is inst:
            r = rank
        elif self.dp_aware:
            # smg picks the decode rank too (a worker per rank): the one with the least KV.
            r = inst.ranks[0]
            low = math.inf
            for x in inst.ranks:
                load = x.kv_base + x.n_run * x.counter + x.kv_prefill + x.wait_tokens
                if load < low:
                    r, low = x, load
        else:
            r = inst.ranks[inst.next_rank()]
        need = req.prompt + req.generated
        req.where = WAITING
        req.inst, req.rank = inst, r
        r.wait.append(req)
        r.wait_tokens += need
        inst.kv_est += need
        inst.poke()

    # -- cancellation (dropped trajectories) and weight updates ----------------------------

    def cancel(self, req: SimRequest) -> None:
        """Remove a request wherever it is (its trajectory was dropped)."""
        where, inst, r = req.where, req.inst, req.rank
        if where == QUEUED:
            if req in self.pending_prefill:
                self.pending_prefill.remove(req)
                self.backlog_tokens -= req.prompt
            elif r is not None and req in r.pq:
                self._unqueue(r, req)
                if not req.silent:
                    self.backlog_tokens -= req.prompt
        elif where == WAITING and r is not None:
            r.wait.remove(req)
            r.wait_tokens -= req.prompt + req.generated
        elif where == RUNNING and r is not None and inst is not None:
            inst._take_off(r, req)  # the step in flight goes on; its heap entry is stale
        elif where == TRANSFER:
            self.transferring.pop(req, None)
            if req in self.pending_decode:
                self.pending_decode.remove(req)
        req.where = DONE
        if inst is not None and not inst.busy:
            inst._maybe_finish_drain(self.loop.now)

    def _unqueue(self, r: SimRank, req: SimRequest) -> None:
        r.pq.remove(req)
        r.inst.nreq -= 1
        target = req.prompt + (req.generated if req.silent else 0)
        r.pq_tokens -= target - req.done
        if req.started:
            r.kv_prefill -= target

    def new_weights(self) -> None:
        """A weight update: caches are invalid, in-flight generations are interrupted.

        Requests waiting for prefill keep their place but lose any progress; requests past
        prefill are aborted and resent by the trainer with their partial output (AReaL-
        style interruptible generation: carried-over trajectories re-prefill, paper §3.1).
        """
        now = self.loop.now
        if self.kv_store is not None:
            self.kv_store.new_weights()
        aborted: list[SimRequest] = []
        for inst in self.instances:
            inst.gen += 1
            inst.busy = False
            for r in inst.ranks:
                _clear_caches(r)
                r.plan = []
                r.kind = 0
                for req in r.pq:
                    # Prefill starts over on the new weights (no cached prefix survives);
                    # a started request keeps its KV allocation and, to the trainer, stays
                    # in prefill: no new event.
                    r.pq_tokens += req.done
                    req.done = 0
                    req.cached = 0
                    if req.silent:  # a retracted decode: interrupt it like the others
                        aborted.append(req)
                for req in list(r.running):
                    inst._take_off(r, req)
                    aborted.append(req)
                r.heap.clear()
                while r.wait:
                    req = r.wait.popleft()
                    aborted.append(req)
                r.wait_tokens = 0
        aborted.extend(self.pending_decode)
        self.pending_decode.clear()
        aborted.extend(self.transferring)  # they are dropped when they land
        self.transferring.clear()
        for inst in self.instances:
            for r in inst.ranks:
                for req in [q for q in r.pq if q.silent]:
                    r.pq.remove(req)
                    inst.nreq -= 1
                    r.pq_tokens -= req.prompt + req.generated
                    if req.started:
                        r.kv_prefill -= req.prompt + req.generated
        for req in aborted:
            self._abort(req, now)
        # Transfers in flight are dropped when they land (their requests are marked done).
        for inst in self.instances:
            if not inst.busy:
                inst._plan(now)

    def _abort(self, req: SimRequest, now: float) -> None:
        req.where = DONE
        req.silent = False
        self.aborted += 1
        self.listener.on_aborted(req, now)

    # -- the switch executor -----------------------------------------------------------------

    def start_switch(
        self,
        name: str,
        to: str,
        *,
        on_done: Callable[[bool, float], None] | None = None,
    ) -> bool:
        """Drain ``name`` and flip it to ``to``; False when it is busy switching already."""
        inst = self.by_name[name]
        now = self.loop.now
        if inst.switch is not None or inst.role == to or inst.role == COLOCATED:
            return False
        inst.accepting = False
        self._refresh_routes()
        inst.switch = SwitchJob(
            to=to, started=now, deadline=now + self.drain_timeout, on_done=on_done
        )
        self._record_roles()
        if inst.role == PREFILL:
            # Queued prompts that have not started go back to the router.
            moved: list[SimRequest] = []
            for r in inst.ranks:
                keep: deque[SimRequest] = deque()
                for req in r.pq:
                    if req.started:
                        keep.append(req)
                    else:
                        r.pq_tokens -= req.prompt - req.done
                        moved.append(req)
                inst.nreq -= len(r.pq) - len(keep)
                r.pq = keep
            for req in moved:
                self._route_prefill(req)
        else:
            moved = []
            for r in inst.ranks:
                while r.wait:
                    req = r.wait.popleft()
                    r.wait_tokens -= req.prompt + req.generated
                    moved.append(req)
            for req in moved:
                self.arrive_decode(req, inst)
            self.loop.at(inst.switch.deadline, self._drain_deadline, inst, inst.switch)
        if not inst.busy:
            inst._maybe_finish_drain(now)
        return True

    def _drain_deadline(self, inst: Instance, job: SwitchJob) -> None:
        """Drain timeout: abort what still runs; the trainer SDK resends it."""
        if inst.switch is not job or job.phase != "draining":
            return
        now = self.loop.now
        victims: list[SimRequest] = []
        for r in inst.ranks:
            for req in list(r.running):
                inst._take_off(r, req)
                victims.append(req)
            r.heap.clear()
            r.kind = 0
            r.plan = []
        inst.gen += 1
        inst.busy = False
        for req in victims:
            if self.kv_store is not None:
                self.offload(req)  # the retry resumes from it on any prefill instance
            self._abort(req, now)
        inst._plan(now)

    def on_switched(self, inst: Instance, job: SwitchJob, now: float) -> None:
        self.switches_done += 1
        if inst.accepting:
            self._refresh_routes()
        self._record_roles()
        if job.on_done is not None:
            job.on_done(True, now)
        if inst.accepting:
            self.on_routable(inst, routes=False)

    def on_routable(self, inst: Instance, *, routes: bool = True) -> None:
        """The router sends the flipped instance work again, the queue it kept first."""
        if routes:
            self._refresh_routes()
        if inst.role == DECODE:
            while self.pending_decode:
                self.arrive_decode(self.pending_decode.popleft(), inst)
        else:
            while self.pending_prefill:
                req = self.pending_prefill.popleft()
                self._route_prefill(req)
