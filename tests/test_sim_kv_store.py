"""The shared KV store: prefixes and aborted decodes survive a flip; old weights never hit."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from prorsa.cli import main
from prorsa_lab.bench import rollout_bench as rollout
from prorsa_lab.sim.costmodel import load_profile
from prorsa_lab.sim.engine import DECODE, PREFILL, SimCluster, SimRequest
from prorsa_lab.sim.kv_store import (
    PAGE_TOKENS,
    SharedKVStore,
    default_capacity_tokens,
)
from prorsa_lab.sim.loop import Loop
from prorsa_lab.sim.policies import baseline
from prorsa_lab.sim.simulator import Scenario, simulate
from tests.test_sim_engine import Recorder, run_until

# One rank per instance, so "another instance" is unambiguous.
PROFILE = load_profile("qwen3-235b-tp8")
BIG = 10**9


def make(
    roles: list[str], *, store: SharedKVStore | None, **kw: Any
) -> tuple[Loop, SimCluster, Recorder]:
    loop = Loop()
    rec = Recorder()
    cluster = SimCluster(
        loop=loop,
        profile=kw.pop("profile", PROFILE),
        roles=roles,
        listener=rec,
        hicache_ratio=2.0,
        kv_store=store,
        **kw,
    )
    rec.cluster = cluster
    return loop, cluster, rec


def flip_home_and_return(store: SharedKVStore | None) -> tuple[SimRequest, SimCluster, str]:
    """Turn 0 of "a" prefills on one instance, which then flips to decode; turn 1 comes."""
    loop, cluster, _rec = make([PREFILL, PREFILL, DECODE], store=store)
    cluster.submit(SimRequest(rid="a0", traj="a", turn=0, prompt=20_000, new_tokens=1))
    run_until(loop, 20.0, cluster)
    home = cluster.home["a"].inst
    assert cluster.start_switch(home.name, DECODE)
    run_until(loop, 60.0, cluster)
    assert home.role == DECODE
    again = SimRequest(rid="a1", traj="a", turn=1, prompt=21_000, new_tokens=1)
    cluster.submit(again)
    run_until(loop, 90.0, cluster)
    assert again.started
    return again, cluster, home.name


def test_a_flip_keeps_the_prefix_in_the_shared_store_for_another_instance() -> None:
    again, cluster, flipped = flip_home_and_return(SharedKVStore(capacity_tokens=BIG))
    prefilled = cluster.home["a"].inst.name  # where turn 1 was prefilled
    assert prefilled != flipped
    # Turn 0's prompt and its one generated token (decode offload), whole pages only.
    assert again.cached == 20_001 // PAGE_TOKENS * PAGE_TOKENS
    state = {s.instance: s for s in cluster.engine_states()}
    assert state[prefilled].prefill_tokens == 21_000 - again.cached
    assert cluster.kv_store is not None and cluster.kv_store.loaded_tokens == again.cached


def test_per_instance_caches_lose_the_prefix_with_the_flip() -> None:
    again, _cluster, _flipped = flip_home_and_return(None)
    assert again.cached == 0, "today's engines: the flip wiped the only copy"


def test_the_flipped_instance_itself_finds_its_old_prefixes_in_the_store() -> None:
    loop, cluster, _rec = make([PREFILL, DECODE, DECODE], store=SharedKVStore(capacity_tokens=BIG))
    cluster.submit(SimRequest(rid="a0", traj="a", turn=0, prompt=20_000, new_tokens=1))
    run_until(loop, 20.0, cluster)
    # The prefill instance flips to decode and back; its own GPU and host tiers are gone.
    p = cluster.instances[0]
    assert cluster.start_switch(p.name, DECODE)
    run_until(loop, 40.0, cluster)
    assert cluster.start_switch(p.name, PREFILL)
    run_until(loop, 80.0, cluster)
    assert p.role == PREFILL and not p.ranks[0].cache and not p.ranks[0].host
    again = SimRequest(rid="a1", traj="a", turn=1, prompt=21_000, new_tokens=1)
    cluster.submit(again)
    run_until(loop, 110.0, cluster)
    assert cluster.home["a"] is p.ranks[0]
    assert again.cached == 20_001 // PAGE_TOKENS * PAGE_TOKENS


def test_a_store_hit_is_loaded_at_the_store_bandwidth_not_recomputed() -> None:
    again, cluster, _flipped = flip_home_and_return(SharedKVStore(capacity_tokens=BIG))
    started = next(t for k, r, t in cluster.listener.log if k == "prefill_started" and r == "a1")  # type: ignore[attr-defined]
    finished = next(t for k, r, t in cluster.listener.log if k == "prefill_finished" and r == "a1")  # type: ignore[attr-defined]
    hit = again.cached
    expect = cluster.times.prefill(21_000 - hit, hit) + cluster.store_load_seconds(hit)
    assert finished - started == pytest.approx(expect, rel=1e-6)
    recompute = cluster.times.prefill(8192, 0) + cluster.times.prefill(8192, 8192)
    assert finished - started < recompute / 5


def abort_on_switch(store: SharedKVStore | None) -> SimRequest:
    """A decode request cut by a switch's drain timeout, resent as prompt + partial output."""
    loop, cluster, rec = make(
        [PREFILL, DECODE, DECODE], store=store, switch_seconds=5.0, drain_timeout=2.0
    )
    cluster.submit(SimRequest(rid="long", traj="t", turn=0, prompt=10_000, new_tokens=5_000))
    run_until(loop, 6.0, cluster)
    victim = next(i for i in cluster.instances if i.role == DECODE and i.nreq)
    assert cluster.start_switch(victim.name, PREFILL)
    run_until(loop, loop.now + 2.5, cluster)
    [cut] = rec.aborted
    assert cut.generated > PAGE_TOKENS
    retry = SimRequest(
        rid="long.2",
        traj="t",
        turn=0,
        prompt=cut.prompt + cut.generated,
        new_tokens=5_000 - cut.generated,
    )
    cluster.submit(retry)
    run_until(loop, loop.now + 30.0, cluster)
    assert retry.started
    return retry


def test_a_cancelled_decode_resumes_from_the_store_recomputing_at_most_a_page() -> None:
    retry = abort_on_switch(SharedKVStore(capacity_tokens=BIG))
    assert retry.prompt - PAGE_TOKENS < retry.cached <= retry.prompt - 1
    assert retry.cached % PAGE_TOKENS == 0


def test_per_instance_a_cancelled_decode_recomputes_its_output() -> None:
    retry = abort_on_switch(None)
    assert retry.cached <= 10_000, "only the prompt's prefix, from the prefill instance"


def test_kv_from_older_weights_never_hits() -> None:
    loop, cluster, _rec = make([PREFILL, PREFILL, DECODE], store=SharedKVStore(capacity_tokens=BIG))
    cluster.submit(SimRequest(rid="a0", traj="a", turn=0, prompt=20_000, new_tokens=1))
    run_until(loop, 20.0, cluster)
    store = cluster.kv_store
    assert store is not None and store.lookup("a") > 0
    cluster.new_weights()
    assert "a" in store.entries, "still stored (it ages out of the LRU), but under v0"
    again = SimRequest(rid="a1", traj="a", turn=1, prompt=21_000, new_tokens=1)
    cluster.submit(again)
    run_until(loop, 60.0, cluster)
    assert again.cached == 0
    assert store.stale_misses >= 1
    # What the new weights computed hits again.
    third = SimRequest(rid="a2", traj="a", turn=2, prompt=22_000, new_tokens=1)
    cluster.submit(third)
    run_until(loop, 90.0, cluster)
    assert third.cached >= 21_000 // PAGE_TOKENS * PAGE_TOKENS


def test_the_store_evicts_least_recently_used_chains_past_its_capacity() -> None:
    store = SharedKVStore(capacity_tokens=1_000, page_tokens=100)
    store.put("a", 450)
    store.put("b", 399)
    assert store.entries == {"a": (400, 0), "b": (300, 0)}
    assert store.lookup("a") == 400  # "a" is now the most recently used
    store.put("c", 500)
    assert list(store.entries) == ["a", "c"] and store.tokens == 900
    assert store.evicted_tokens == 300 and store.lookup("b") == 0
    store.put("a", 200)  # a shorter chain of the same version is a prefix: kept whole
    assert store.entries["a"] == (400, 0)
    store.put("d", 5_000)  # larger than the whole store: not stored, nothing evicted
    assert "d" not in store.entries and store.tokens == 900
    store.check()
    with pytest.raises(ValueError, match="capacity_tokens"):
        SharedKVStore(capacity_tokens=-1)


def test_default_capacity_is_the_host_memory_the_hicache_tiers_leave() -> None:
    p = load_profile("deepseek-v3-dp8")
    one = default_capacity_tokens(p, instances=1, hicache_ratio=2.0)
    pool = p.kv_capacity_per_rank * p.ranks
    assert one == pytest.approx(2e12 / p.kv_wire_bytes_per_token - 2 * pool, rel=1e-6)
    assert default_capacity_tokens(p, instances=8, hicache_ratio=2.0) == pytest.approx(
        8 * one, rel=1e-6
    )
    # A store too small for the chains it is given evicts in the simulator too.
    loop, cluster, _rec = make([PREFILL, DECODE], store=SharedKVStore(capacity_tokens=30_000))
    for t in ("a", "b", "c"):
        cluster.submit(SimRequest(rid=f"{t}0", traj=t, turn=0, prompt=12_000, new_tokens=1))
    run_until(loop, 30.0, cluster)
    assert cluster.kv_store is not None
    assert cluster.kv_store.tokens <= 30_000 and cluster.kv_store.evicted_tokens > 0
    assert "a" not in cluster.kv_store.entries


def test_the_default_run_is_unchanged_and_shared_is_its_own_run() -> None:
    """The default is today's model: the makespans main printed before the store existed
    (0a46f9e, this scenario), and a run that names per-instance is the same run."""
    sc = Scenario(model="qwen3-dp2", task="general", staleness=2, steps=2, groups_per_step=4)
    default = simulate(sc, baseline("static-3P"))
    assert default.makespan == pytest.approx(411.72859610920773, rel=1e-12)
    assert simulate(sc, baseline("colocation")).makespan == pytest.approx(
        411.8841772955047, rel=1e-12
    )
    named = simulate(dataclasses.replace(sc, kv_store="per-instance"), baseline("static-3P"))
    assert named.makespan == default.makespan
    assert "kvStore" not in default.extra
    shared = simulate(dataclasses.replace(sc, kv_store="shared"), baseline("static-3P"))
    assert shared.extra["kvStore"]["loadedTokens"] > 0
    assert shared.makespan != default.makespan
    with pytest.raises(ValueError, match="kv_store"):
        dataclasses.replace(sc, kv_store="nfs").shared_store()  # type: ignore[arg-type]


def test_the_bench_names_the_store_it_ran_and_runs_only_the_policies_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["--models", "qwen3-dp2", "--tasks", "general", "--staleness", "8", "--steps", "1"]
    tiny += ["--scale", "0.125", "--workers", "1", "--out", str(tmp_path)]
    picked = ["--policies", "colocation,static,reference"]
    assert main(["bench", "rollout", *tiny, *picked, "--kv-store", "shared"]) == 0
    out = capsys.readouterr().out
    assert "KV store shared;" in out.splitlines()[0]
    doc = json.loads((tmp_path / "rollout.json").read_text())
    assert doc["grid"]["kvStore"] == "shared"
    rows = {r["policy"]: r for r in doc["rollout"]}
    assert set(rows) == {"colocation", "best-static", "task-static", "reference"}
    assert rows["best-static"]["kvStore"]["capacityTokens"] > 0
    # The default names per-instance caches; a JSON from before the flag counts as one.
    assert main(["bench", "rollout", *tiny, "--policies", "colocation", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["grid"]["kvStore"] == "per-instance"
    assert {r["kvStore"] for r in plain["rollout"]} == {None}
    del plain["grid"]["kvStore"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(plain))
    parser = argparse.ArgumentParser()
    rollout.configure(parser)
    cfg = rollout._config(parser.parse_args(tiny[:-2]))
    rollout.read_previous(old, cfg)
    shared = rollout._config(parser.parse_args([*tiny[:-2], "--kv-store", "shared"]))
    with pytest.raises(ValueError, match="kvStore 'per-instance', here 'shared'"):
        rollout.read_previous(old, shared)
    for bad in ("prorsa,magic", "reference"):
        assert main(["bench", "rollout", *tiny, "--policies", bad]) == 2
        assert "--policies must name some of" in capsys.readouterr().err


def test_a_scenario_can_tell_the_controller_a_flip_loses_no_cache() -> None:
    sc = Scenario(model="qwen3-dp4", task="coding", kv_store="shared")
    p = sc.profile()
    # Today's default: the host tier (2x the GPU pool, write-through) holds the most.
    assert sc.spec().capacity.prefill_cache_tokens == 2 * p.kv_capacity
    told = dataclasses.replace(sc, prefill_cache_tokens=0).spec().capacity
    assert told.prefill_cache_tokens == 0
