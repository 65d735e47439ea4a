"""Engine instances: step timing from the cost model, DP interference, KV admission, switches."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from prorsa_lab.sim.costmodel import ModelProfile, StepTimes, load_profile
from prorsa_lab.sim.engine import (
    COLOCATED,
    DECODE,
    DECODE_RESERVE_TOKENS,
    PREFILL,
    SimCluster,
    SimRequest,
)
from prorsa_lab.sim.loop import Loop


class Recorder:
    """Stands in for the trainer: records what the engines report, resends aborts."""

    def __init__(self, cluster: SimCluster | None = None) -> None:
        self.log: list[tuple[str, str, float]] = []
        self.done: dict[str, float] = {}
        self.aborted: list[SimRequest] = []
        self.cluster = cluster

    def on_prefill_started(self, req: SimRequest, instance: str, now: float) -> None:
        self.log.append(("prefill_started", req.rid, now))

    def on_prefill_finished(self, req: SimRequest, instance: str, now: float) -> None:
        self.log.append(("prefill_finished", req.rid, now))

    def on_decode_finished(self, req: SimRequest, now: float) -> None:
        self.log.append(("decode_finished", req.rid, now))
        self.done[req.rid] = now

    def on_aborted(self, req: SimRequest, now: float) -> None:
        self.log.append(("aborted", req.rid, now))
        self.aborted.append(req)


def make(
    roles: list[str], *, profile: ModelProfile | None = None, **kw: Any
) -> tuple[Loop, SimCluster, Recorder]:
    loop = Loop()
    rec = Recorder()
    cluster = SimCluster(
        loop=loop, profile=profile or load_profile("qwen3-235b"), roles=roles, listener=rec, **kw
    )
    rec.cluster = cluster
    return loop, cluster, rec


def run_until(loop: Loop, t: float, cluster: SimCluster | None = None) -> None:
    """Advance virtual time to ``t`` (checking invariants on the way when asked)."""

    def stop() -> None:
        loop.stop()

    loop.at(t, stop)
    if cluster is not None:
        loop.every(0.25, lambda _now: cluster.check())
    loop.stopped = False
    loop.run(until=t + 1)
    loop.stopped = False


def req(rid: str, prompt: int, new: int, traj: str | None = None, turn: int = 0) -> SimRequest:
    return SimRequest(rid=rid, traj=traj or rid, turn=turn, prompt=prompt, new_tokens=new)


def test_one_request_takes_exactly_the_cost_model_time() -> None:
    """Chunked prefill (3 chunks), RDMA transfer, then one decode step per token."""
    p = load_profile("qwen3-235b")
    loop, cluster, rec = make([PREFILL, DECODE])
    cluster.submit(req("r", 10_000, 100))
    run_until(loop, 200, cluster)
    times = StepTimes(p)
    prefill = times.prefill(4096, 0) + times.prefill(4096, 4096) + times.prefill(1808, 8192)
    decode = sum(times.decode(1, 10_000 + k) for k in range(1, 100))
    expect = prefill + p.transfer_seconds(10_000) + decode
    kinds = [k for k, _r, _t in rec.log]
    assert kinds == ["prefill_started", "prefill_finished", "decode_finished"]
    assert rec.log[1][2] == pytest.approx(prefill, rel=1e-9)
    assert rec.done["r"] == pytest.approx(expect, rel=1e-3)
    state = {s.instance: s for s in cluster.engine_states()}
    assert state["sim-engine-0"].prefill_tokens == 10_000
    assert state["sim-engine-0"].prefill_busy_seconds == pytest.approx(prefill)


def _decode_delay(roles: list[str]) -> tuple[float, float, SimCluster]:
    """Finish time of 4 long decodes, with and without a 32k prompt arriving at t=2 s."""
    out = []
    for with_prompt in (False, True):
        loop, cluster, rec = make(roles)
        for i in range(4):
            cluster.submit(req(f"d{i}", 500, 400))
        if with_prompt:
            loop.at(2.0, cluster.submit, req("long", 32_768, 1))
        run_until(loop, 120, cluster)
        out.append(max(rec.done[f"d{i}"] for i in range(4)))
    return out[0], out[1], cluster


def test_a_prefill_chunk_stalls_every_decoding_rank_under_colocation() -> None:
    """Paper §3.2: a rank running a prefill chunk holds the decoding ranks at the MoE sync."""
    p = load_profile("qwen3-235b")
    times = StepTimes(p)
    prefill = sum(times.prefill(4096, k * 4096) for k in range(8))
    base, slowed, cluster = _decode_delay([COLOCATED])
    assert slowed - base >= 0.8 * prefill
    inst = cluster.instances[0]
    assert inst.interference_idle > 0.5 * prefill * (p.ranks - 1)
    # Disaggregated, the same prompt runs on the prefill instance: decodes barely notice.
    base_pd, slowed_pd, _ = _decode_delay([PREFILL, DECODE])
    assert slowed_pd - base_pd < 0.1 * prefill


def test_decode_admission_never_overfills_kv() -> None:
    small = dataclasses.replace(load_profile("qwen3-235b"), ranks=1, kv_capacity_per_rank=20_000)
    loop, cluster, rec = make([PREFILL, DECODE], profile=small)
    for i in range(5):
        cluster.submit(req(f"r{i}", 6_000, 300))
    peak = [0]

    def watch(_now: float) -> None:
        r = cluster.instances[1].ranks[0]
        assert r.kv_used() <= 20_000
        peak[0] = max(peak[0], r.n_run)

    loop.every(0.05, watch)
    run_until(loop, 300, cluster)
    assert len(rec.done) == 5
    # 6k prompts plus a growth reserve per running request: never more than 3 at once.
    assert 2 <= peak[0] <= 3
    assert 2 * (6_001 + DECODE_RESERVE_TOKENS) <= 20_000


def test_kv_overflow_while_decoding_retracts_the_newest_request() -> None:
    small = dataclasses.replace(load_profile("qwen3-235b"), ranks=1, kv_capacity_per_rank=12_000)
    loop, cluster, rec = make([PREFILL, DECODE], profile=small)
    cluster.submit(req("a", 5_000, 3_000))
    cluster.submit(req("b", 5_000, 3_000))
    run_until(loop, 600, cluster)
    assert set(rec.done) == {"a", "b"}
    assert cluster.retracted >= 1
    assert rec.done["a"] < rec.done["b"]  # the older one kept its place


def test_next_turn_hits_the_prefix_cache_of_its_prefill_rank() -> None:
    p = load_profile("qwen3-235b")
    loop, cluster, rec = make([PREFILL, DECODE])
    cluster.submit(req("t0", 8_000, 20, traj="a"))
    run_until(loop, 30, cluster)
    start = loop.now
    cluster.submit(req("t1", 9_000, 20, traj="a", turn=1))
    run_until(loop, 60, cluster)
    first = next(t for k, r, t in rec.log if k == "prefill_finished" and r == "t1")
    assert first - start == pytest.approx(StepTimes(p).prefill(1_000, 8_000), rel=1e-6)
    # The agent counts computed tokens, as SGLang's total_prefill_uncached_tokens does:
    # 8,000 for the first turn, then only the 1,000 new ones of the second.
    state = {s.instance: s for s in cluster.engine_states()}
    assert state["sim-engine-0"].prefill_tokens == 9_000


def test_switch_drains_aborts_after_timeout_then_flips() -> None:
    loop, cluster, rec = make([PREFILL, DECODE, DECODE], switch_seconds=5.0, drain_timeout=2.0)
    cluster.submit(req("long", 1_000, 5_000))
    run_until(loop, 3, cluster)
    victim = next(i for i in cluster.instances if i.role == DECODE and i.nreq)
    other = next(i for i in cluster.instances if i.role == DECODE and i is not victim)
    finished: list[tuple[bool, float]] = []
    t0 = loop.now
    assert cluster.start_switch(
        victim.name, PREFILL, on_done=lambda ok, at: finished.append((ok, at))
    )
    assert not cluster.start_switch(victim.name, PREFILL)  # already switching
    assert {s.instance: s.switching for s in cluster.engine_states()}[victim.name]
    cluster.submit(req("new", 1_000, 10))
    run_until(loop, t0 + 1.5, cluster)
    assert rec.done.get("new") and other.nreq == 0  # routed around the draining instance
    run_until(loop, t0 + 2.5, cluster)
    assert [r.rid for r in rec.aborted] == ["long"]  # drain timeout: cancel-and-resend
    assert victim.role == DECODE
    run_until(loop, t0 + 8, cluster)
    assert victim.role == PREFILL and finished == [(True, pytest.approx(t0 + 7.0))]
    assert cluster.role_counts() == (2, 1, 0)
    assert [row[1:] for row in cluster.timeline] == [(1, 2, 0), (1, 1, 1), (2, 1, 0)]


def test_the_router_sets_the_pace_of_a_switch_of_an_idle_instance() -> None:
    # smg drops a relabelled worker only after its fixed drain, and lists it with its new
    # role a little after the flip: an idle instance still takes 6 + 5 + 2 s to serve.
    loop, cluster, _rec = make(
        [PREFILL, DECODE, DECODE],
        profile=load_profile("qwen3-tp8"),  # one rank per instance: smg's worker is the pod
        switch_seconds=5.0,
        router_drain_seconds=6.0,
        router_register_seconds=2.0,
    )
    run_until(loop, 1, cluster)
    idle = cluster.instances[2]
    finished: list[tuple[bool, float]] = []
    assert cluster.start_switch(
        idle.name, PREFILL, on_done=lambda ok, at: finished.append((ok, at))
    )
    run_until(loop, 11.5, cluster)
    assert idle.role == DECODE and not finished  # idle at once, but flips at 1 + 6 + 5 s
    run_until(loop, 12.5, cluster)
    assert idle.role == PREFILL and finished == [(True, pytest.approx(12.0))]
    prefill_nreq = cluster.instances[0].nreq
    cluster.submit(req("before", 30_000, 5))  # routed while smg does not list it yet
    assert idle.nreq == 0 and cluster.instances[0].nreq == prefill_nreq + 1
    run_until(loop, 14.5, cluster)
    cluster.submit(req("after", 30_000, 5))
    assert idle.nreq == 1  # listed again 2 s after the flip: it takes the next prompt


def test_draining_prefill_instance_hands_its_queue_to_the_others() -> None:
    loop, cluster, rec = make([PREFILL, PREFILL, DECODE])
    for i in range(12):
        cluster.submit(req(f"r{i}", 30_000, 5))
    src = max(cluster.instances[:2], key=lambda i: i.nreq)
    cluster.start_switch(src.name, DECODE)
    run_until(loop, 400, cluster)
    assert len(rec.done) == 12
    assert src.role == DECODE


def test_new_weights_interrupt_generation_and_flush_caches() -> None:
    loop, cluster, rec = make([PREFILL, DECODE])
    cluster.submit(req("a", 2_000, 4_000, traj="a"))
    cluster.submit(req("b", 2_000, 10, traj="b"))
    run_until(loop, 5, cluster)
    assert any(r.cache for i in cluster.instances for r in i.ranks)
    cluster.new_weights()
    assert [r.rid for r in rec.aborted] == ["a"]
    assert not any(r.cache for i in cluster.instances for r in i.ranks)
    cluster.check()


def test_a_host_tier_hit_is_loaded_back_not_recomputed_and_a_flip_wipes_it() -> None:
    """HiCache: the GPU cache evicts a context, its host copy still saves the recompute."""
    profile = dataclasses.replace(load_profile("qwen3-235b-tp8"), kv_capacity_per_rank=200_000)

    def second_turn(hicache_ratio: float) -> int:
        loop, cluster, _rec = make([PREFILL, DECODE], profile=profile, hicache_ratio=hicache_ratio)
        cluster.submit(SimRequest(rid="a0", traj="a", turn=0, prompt=100_000, new_tokens=1))
        run_until(loop, 20.0, cluster)
        # Two more trajectories push "a" out of the single rank's 200k-token GPU cache.
        for t in ("b", "c"):
            cluster.submit(SimRequest(rid=f"{t}0", traj=t, turn=0, prompt=90_000, new_tokens=1))
            run_until(loop, loop.now + 20.0, cluster)
        assert "a" not in cluster.instances[0].ranks[0].cache
        again = SimRequest(rid="a1", traj="a", turn=1, prompt=101_000, new_tokens=1)
        cluster.submit(again)
        run_until(loop, loop.now + 20.0, cluster)
        return again.cached

    assert second_turn(2.0) == 100_000, "the host tier held the evicted context"
    assert second_turn(0.0) == 0, "GPU-only: the evicted context is recomputed"

    loop, cluster, _rec = make([PREFILL, PREFILL, DECODE], profile=profile, hicache_ratio=2.0)
    cluster.submit(SimRequest(rid="a0", traj="a", turn=0, prompt=100_000, new_tokens=1))
    run_until(loop, 20.0, cluster)
    home = cluster.home["a"]
    assert home.host["a"] == 100_000
    assert cluster.start_switch(home.inst.name, DECODE)
    run_until(loop, 60.0, cluster)
    assert home.inst.role == DECODE
    assert not home.host and not home.cache, "SGLang's flip resets the radix tree and host pool"


def test_without_dp_aware_routing_the_engine_round_robins_its_ranks() -> None:
    # smg without --dp-aware sees whole engines; SGLang's DP controller, resolved to round
    # robin for an engine launched as decode, deals requests to ranks in turn, colocated
    # or prefill alike, and the decode side does the same with what it admits.
    for role in (COLOCATED, PREFILL):
        loop, cluster, _rec = make([role, DECODE], dp_aware=False)
        for i in range(8):
            cluster.submit(req(f"r{i}", 2_000, 5))
        assert [len(r.pq) for r in cluster.instances[0].ranks] == [2, 2, 2, 2]
    loop, cluster, _rec = make([PREFILL, DECODE], dp_aware=False)
    for i in range(4):
        cluster.submit(req(f"r{i}", 2_000, 500))
    run_until(loop, 5, cluster)
    assert [r.n_run for r in cluster.instances[1].ranks] == [1, 1, 1, 1]


def test_a_returning_turn_finds_its_prefix_only_where_the_router_places_it() -> None:
    """--dp-aware: the rank holding the prefix; round robin: the next rank in turn."""
    p = load_profile("qwen3-235b")  # 4 attention-DP ranks per instance
    for dp_aware, cached in ((True, 8_000), (False, 0)):
        loop, cluster, rec = make([PREFILL, DECODE], dp_aware=dp_aware)
        cluster.submit(req("t0", 8_000, 20, traj="a"))
        run_until(loop, 30, cluster)
        home = cluster.home["a"]
        start = loop.now
        cluster.submit(req("t1", 9_000, 20, traj="a", turn=1))
        assert (cluster.instances[0].ranks.index(rank_of("t1", cluster)) == home.idx) is dp_aware
        run_until(loop, 60, cluster)
        first = next(t for k, r, t in rec.log if k == "prefill_finished" and r == "t1")
        # What is not cached is prefilled in chunks, each attending to what came before.
        steps, done = 0.0, cached
        while done < 9_000:
            take = min(p.chunk, 9_000 - done)
            steps += StepTimes(p).prefill(take, done)
            done += take
        assert first - start == pytest.approx(steps, rel=1e-6)


def rank_of(rid: str, cluster: SimCluster) -> Any:
    return next(r for i in cluster.instances for r in i.ranks for q in r.pq if q.rid == rid)
