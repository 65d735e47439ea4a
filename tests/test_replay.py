"""``prorsa replay``: a recorded job replayed on every policy of the rollout simulator.

The committed recording (tests/data/replay/deepseek-math.*) was made by the simulator's own
trainer, which emits the webhook contract events, with
``python -m prorsa_lab.replay.record_sim --model deepseek-v3-dp8 --task math --staleness 2
--groups 3 --steps 3 --prefill 3 --out tests/data/replay/deepseek-math``: AIME-like math
trajectories, asynchronous with staleness 2, recorded on a 3:5 split of 8 DP8 engines; the
manifest is the one the operator would run that scenario with (its ``capacity.*`` as the
benchmark profiles the cost table).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from prorsa.cli import main
from prorsa_lab.replay.api import ReplayError, replay_recording
from prorsa_lab.replay.record_sim import manifest, record
from prorsa_lab.replay.recording import RecordingError, rebuild
from prorsa_lab.sim.policies import Static
from prorsa_lab.sim.simulator import Scenario, simulate

DATA = Path(__file__).parent / "data" / "replay"
EVENTS = DATA / "deepseek-math.ndjson"
CLUSTER = DATA / "deepseek-math.yaml"


def _replay_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    code = main(["replay", "--cluster", str(CLUSTER), "--events", str(EVENTS), "--json", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    doc: dict[str, object] = json.loads(out.out)
    return doc


def test_committed_recording_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _replay_json(capsys, "--workers", "1")
    rows = {r["policy"]: r for r in doc["rows"]}  # type: ignore[attr-defined]
    assert list(rows) == [
        "colocation",
        *(f"static-{p}P" for p in range(1, 8)),
        "best-static",
        "prorsa",
        "reference",
    ]
    for row in rows.values():
        assert row["makespanSeconds"] > 0
        assert row["speedupVsBestStatic"] is not None
        assert row["speedupVsColocation"] is not None
    assert doc["bestStatic"] == {"prefill": 1, "decode": 7}
    best = rows["best-static"]["makespanSeconds"]
    assert best == min(rows[f"static-{p}P"]["makespanSeconds"] for p in range(1, 8))
    # On this math job colocation beats every split (long decodes, little prefill).
    assert rows["colocation"]["makespanSeconds"] < best
    assert rows["colocation"]["speedupVsBestStatic"] > 1.0
    assert str(doc["advice"]).startswith("colocate:")
    # The reference starts from the best static split and only ever moves to a better one.
    assert rows["reference"]["makespanSeconds"] <= best
    # The dispatch printed is what the recording shows.
    d = doc["dispatch"]
    assert d["staleness"] == 2 and d["groupSize"] == 8 and d["groupsPerStep"] == 3  # type: ignore[index]
    assert d["injection"] == "replaceOnReward" and d["steps"] == 3  # type: ignore[index]


def test_table_output_and_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "split.png"
    code = main(
        [
            "replay",
            "--cluster",
            str(CLUSTER),
            "--events",
            str(EVENTS),
            "--no-reference",
            "--static",
            "1,3",
            "--workers",
            "1",
            "--png",
            str(png),
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "advice: colocate" in out.out
    assert "inferred: staleness 2" in out.out
    assert "best static split: 1:7" in out.out
    assert "roles.prefill.initial: 1" in out.out  # the recorded job's advice to start from
    assert "[1/4]" in out.err  # progress on stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flags_override_the_inferred_dispatch() -> None:
    on_policy = replay_recording(
        events=EVENTS, cluster=CLUSTER, staleness=0, static=[2], reference=False
    )
    inferred = replay_recording(events=EVENTS, cluster=CLUSTER, static=[2], reference=False)
    assert on_policy.dispatch.staleness == 0 and inferred.dispatch.staleness == 2
    # Waiting for each whole step takes longer than refilling slots as rewards come in.
    assert on_policy.makespan("static-2P") > inferred.makespan("static-2P")


def test_fixed_rate_without_a_rate_is_refused() -> None:
    with pytest.raises(ReplayError, match="fixedRate injection needs a rate"):
        replay_recording(events=EVENTS, cluster=CLUSTER, injection="fixedRate", reference=False)


def test_time_to_common_count() -> None:
    report = replay_recording(events=EVENTS, cluster=CLUSTER, static=[1, 4], reference=False)
    n = report.common_count()
    assert n == min(len(r.completed_at) for r in report.runs.values()) > 0
    for name in ("colocation", "static-1P", "static-4P", "prorsa", "best-static"):
        t = report.time_to_count(name, n)
        assert t is not None and 0 < t <= report.makespan(name)
    assert report.time_to_count("prorsa", 10**6) is None
    # Completion order: the 10th trajectory never completes after the 20th.
    t10, t20 = report.time_to_count("prorsa", 10), report.time_to_count("prorsa", 20)
    assert t10 is not None and t20 is not None and t10 <= t20


@pytest.mark.parametrize(
    ("task", "staleness", "groups"), [("math", 0, 2), ("math", 2, 2), ("general", 2, 1)]
)
def test_round_trip_matches_the_original_simulation(
    tmp_path: Path, task: str, staleness: int, groups: int
) -> None:
    """Record the simulator's own workload on 3:5, replay it on the same cost table: each
    static split takes what the original simulation of that split took (same scripts)."""
    scenario = Scenario(
        model="qwen3-dp8", task=task, staleness=staleness, steps=2, groups_per_step=groups
    )
    lines, result = record(scenario, prefill=3)
    events, cluster = tmp_path / "rec.ndjson", tmp_path / "rc.yaml"
    events.write_text("".join(line + "\n" for line in lines))
    cluster.write_text(manifest(scenario, name="rt"))
    report = replay_recording(
        events=events, cluster=cluster, model="qwen3-dp8", static=[2, 3, 5], reference=False
    )
    assert report.makespan("static-3P") == pytest.approx(result.makespan, rel=1e-3)
    for p in (2, 5):
        original = simulate(scenario, Static(p)).makespan
        assert report.makespan(f"static-{p}P") == pytest.approx(original, rel=0.01)


def test_capacity_engine_model_is_sourced() -> None:
    report = replay_recording(events=EVENTS, cluster=CLUSTER, static=[3], reference=False)
    text = "\n".join(report.engine.sources)
    assert "θ_P" in text and "C_KV" in text and "knee" in text
    assert "median over" in text  # the lone decode step measured in the recording
    # The recording's own split replayed on the capacity-built engine: near what it took.
    recorded = report.recording.span_seconds
    # (measured: 813 s against 734 s; the cost table itself, --model, gives 734 s)
    assert report.makespan("static-3P") == pytest.approx(recorded, rel=0.15)


def test_lone_decode_step_without_prefill_events(tmp_path: Path) -> None:
    """A blocking client behind a PD router sends no prefill events (verl and AReaL today):
    the lone decode step is then timed from request_queued less the modelled prefill."""
    scenario = Scenario(
        model="qwen3-dp8",
        task="math",
        staleness=2,
        steps=2,
        groups_per_step=2,
        prefill_events="none",
    )
    lines, result = record(scenario, prefill=3)
    assert not any('"prefill_finished"' in line for line in lines)
    events, cluster = tmp_path / "rec.ndjson", tmp_path / "rc.yaml"
    events.write_text("".join(line + "\n" for line in lines))
    cluster.write_text(manifest(scenario, name="none"))
    report = replay_recording(events=events, cluster=cluster, static=[3], reference=False)
    assert report.dispatch.prefill_events == "none"
    assert any("timed from request_queued" in source for source in report.engine.sources)
    assert report.makespan("static-3P") == pytest.approx(result.makespan, rel=0.15)


def test_cut_recording_is_replayed_as_far_as_it_went(tmp_path: Path) -> None:
    lines = EVENTS.read_text().splitlines()
    cut = tmp_path / "cut.ndjson"
    cut.write_text("\n".join(lines[:600]) + "\n")
    rec = rebuild(cut)
    assert rec.cut > 0
    stopped = [s for s in rec.scripts if s.stop is not None]
    assert len(stopped) == rec.cut
    report = replay_recording(events=cut, cluster=CLUSTER, static=[3], reference=False)
    # No weight update in the excerpt: one step of every group, so every trajectory of it
    # is replayed, and the replay ends when the last one reaches the recording's end.
    assert rec.dispatch.steps == 1
    assert rec.dispatch.groups_per_step == len({s.group for s in rec.scripts})
    assert rec.dispatch.staleness >= 1  # it refilled slots inside the step
    run = report.runs["static-3P"]
    assert math.isfinite(run.makespan)
    assert run.ran_out
    assert run.cut == rec.cut
    assert len(run.completed_at) + run.cut == len(rec.scripts)


def test_recorded_drop_is_replayed_as_a_drop(tmp_path: Path) -> None:
    """A trajectory dropped in the recording (here: in its first tool call) is dropped at
    the same point of the replay, on every policy."""
    events = [json.loads(line) for line in EVENTS.read_text().splitlines()]
    victim = next(e["trajectory"] for e in events if e["type"] == "tool_started")
    kept, dropped = [], False
    for e in events:
        if e.get("trajectory") != victim or not dropped:
            kept.append(e)
        if e.get("trajectory") == victim and e["type"] == "tool_started" and not dropped:
            dropped = True
            kept.append(
                {
                    "id": f"{victim}#drop",
                    "ts": e["ts"] + 0.5,
                    "trajectory": victim,
                    "type": "trajectory_dropped",
                    "reason": "sandbox-error",
                }
            )
    path = tmp_path / "drop.ndjson"
    path.write_text("".join(json.dumps(e) + "\n" for e in kept))
    rec = rebuild(path)
    script = next(s for s in rec.scripts if s.drop_reason is not None)
    assert (script.stop, script.drop_reason, rec.dropped) == ("tool", "sandbox-error", 1)
    report = replay_recording(events=path, cluster=CLUSTER, static=[3], reference=False)
    assert all(run.dropped >= 1 for run in report.runs.values())


def _error(tmp_path: Path, events: str, cluster: Path = CLUSTER) -> str:
    path = tmp_path / "bad.ndjson"
    path.write_text(events)
    with pytest.raises(ReplayError) as exc:
        replay_recording(events=path, cluster=cluster, reference=False, static=[1])
    return str(exc.value)


def test_error_not_ndjson(tmp_path: Path) -> None:
    message = _error(tmp_path, '{"id": "a#1", "ts": 0}\nnot json at all\n')
    assert "bad.ndjson:2" in message


def test_error_decode_without_request(tmp_path: Path) -> None:
    events = [
        {"id": "t1#1", "ts": 0, "trajectory": "t1", "type": "sample_dispatched", "group": "g"},
        {
            "id": "t1#2",
            "ts": 1,
            "trajectory": "t1",
            "type": "decode_finished",
            "output_tokens": 5,
            "finish": "stop",
        },
    ]
    message = _error(tmp_path, "".join(json.dumps(e) + "\n" for e in events))
    assert "trajectory t1" in message and "decode_finished without its request_queued" in message
    assert "line 2" in message


def test_error_reward_without_decode(tmp_path: Path) -> None:
    events = [
        {"id": "t2#1", "ts": 0, "trajectory": "t2", "type": "sample_dispatched"},
        {
            "id": "t2#2",
            "ts": 1,
            "trajectory": "t2",
            "type": "request_queued",
            "prompt_tokens": 100,
            "turn": 0,
        },
        {"id": "t2#3", "ts": 2, "trajectory": "t2", "type": "reward_finished", "accepted": True},
    ]
    message = _error(tmp_path, "".join(json.dumps(e) + "\n" for e in events))
    assert "trajectory t2" in message and "reward_finished without a decode_finished" in message


def test_error_trajectory_without_dispatch(tmp_path: Path) -> None:
    events = [
        {
            "id": "t3#1",
            "ts": 0,
            "trajectory": "t3",
            "type": "request_queued",
            "prompt_tokens": 100,
            "turn": 0,
        },
    ]
    message = _error(tmp_path, "".join(json.dumps(e) + "\n" for e in events))
    assert "trajectory t3" in message and "before its sample_dispatched" in message


def test_error_manifest_without_capacity(tmp_path: Path) -> None:
    import yaml

    doc = yaml.safe_load(CLUSTER.read_text())
    del doc["spec"]["capacity"]
    cluster = tmp_path / "rc.yaml"
    cluster.write_text(yaml.safe_dump(doc))
    message = _error(tmp_path, EVENTS.read_text(), cluster)
    assert "no spec.capacity" in message and "--model" in message
    doc["spec"]["capacity"] = {"prefillTokensPerSecond": 40000}
    cluster.write_text(yaml.safe_dump(doc))
    message = _error(tmp_path, EVENTS.read_text(), cluster)
    assert "capacity.decodeKvTokens, capacity.decodeConcurrency missing" in message


def test_cli_error_exit_code(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.ndjson"
    bad.write_text("")
    code = main(["replay", "--cluster", str(CLUSTER), "--events", str(bad)])
    assert code == 2
    assert "prorsa replay: error:" in capsys.readouterr().err


def test_recording_error_names_every_trajectory(tmp_path: Path) -> None:
    events = [
        {
            "id": "a#1",
            "ts": 0,
            "trajectory": "a",
            "type": "request_queued",
            "prompt_tokens": 1,
            "turn": 0,
        },
        {"id": "b#1", "ts": 0, "trajectory": "b", "type": "tool_started"},
    ]
    path = tmp_path / "two.ndjson"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    with pytest.raises(RecordingError) as exc:
        rebuild(path)
    assert [p.split(":")[0] for p in exc.value.problems] == ["trajectory a", "trajectory b"]


def test_a_concurrency_capped_trainer_is_replayed_as_one(tmp_path: Path) -> None:
    """No weight update and never every trajectory in flight: the trainer only capped its
    concurrency (the demo's, AReaL's between updates). A new trajectory replaced every one
    that ended, rejected ones included: replace-on-end, under the recorded cap."""
    scenario = Scenario(
        model="qwen3-dp8",
        task="general",
        staleness=1,
        steps=1,
        groups_per_step=6,
        injection="replaceOnEnd",
        max_concurrent=12,
    )
    lines, result = record(scenario, prefill=3)
    events, cluster = tmp_path / "rec.ndjson", tmp_path / "rc.yaml"
    events.write_text("".join(line + "\n" for line in lines))
    cluster.write_text(manifest(scenario, name="capped"))
    rec = rebuild(events)
    d = rec.dispatch
    assert d.capped and d.max_concurrent == 12 and d.steps == 1, rec.inferred
    assert d.injection == "replaceOnEnd", rec.inferred
    assert "concurrency-capped" in d.describe()
    report = replay_recording(
        events=events, cluster=cluster, model="qwen3-dp8", static=[3], reference=False
    )
    # The same split, the same scripts, the same rule: what the original run took to
    # complete the trajectories it completed.
    t = report.time_to_count("static-3P", rec.completed)
    assert t is not None and t == pytest.approx(result.makespan, rel=0.05)


def test_a_manifest_without_a_prefix_cache_replays_every_context(tmp_path: Path) -> None:
    """capacity.prefillCacheTokens: 0 (engines that keep no prefix cache, as the engine
    double): every turn prefills its whole context, so multi-turn work takes longer."""
    import yaml

    doc = yaml.safe_load(CLUSTER.read_text())
    doc["spec"]["capacity"]["prefillCacheTokens"] = 0
    no_cache = tmp_path / "no-cache.yaml"
    no_cache.write_text(yaml.safe_dump(doc))
    kw: dict[str, object] = {"events": EVENTS, "static": [3], "reference": False}
    cached = replay_recording(cluster=CLUSTER, policies=["static-3P"], **kw)  # type: ignore[arg-type]
    uncached = replay_recording(cluster=no_cache, policies=["static-3P"], **kw)  # type: ignore[arg-type]
    assert set(cached.runs) == {"static-3P"}  # the policy filter
    assert uncached.makespan("static-3P") > cached.makespan("static-3P")


def test_switch_seconds_and_policies_are_checked() -> None:
    with pytest.raises(ReplayError, match="switch seconds"):
        replay_recording(events=EVENTS, cluster=CLUSTER, switch_seconds=-1.0)
    with pytest.raises(ReplayError, match="policies"):
        replay_recording(events=EVENTS, cluster=CLUSTER, static=[3], policies=["static-9P"])


def test_count_and_kv_pool_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """--count N gives each policy's time to N trajectories (what a measured run finished);
    --kv-pool-tokens replaces the pool the profile's arithmetic gives, and says so."""
    doc = _replay_json(
        capsys, "--static", "3", "--no-reference", "--count", "20", "--kv-pool-tokens", "900000"
    )
    times = doc["timeToCount"]
    assert isinstance(times, dict) and times["count"] == 20
    assert {"colocation", "static-3P", "prorsa"} <= set(times)
    for name in ("colocation", "static-3P", "prorsa"):
        assert 0 < times[name] < doc["rows"][0]["makespanSeconds"] * 2
    assert any("900,000 tokens per instance (--kv-pool-tokens)" in s for s in doc["engine"])


def test_a_trajectory_ended_after_a_tool_call_is_rewarded(tmp_path: Path) -> None:
    """The demo's trainer ends a trajectory after a tool call once its context is full:
    decode (finish "tool"), the tool, then the reward with no further turn. The replay
    runs the tool and then the reward, on every policy, and completes it."""
    events = [json.loads(line) for line in EVENTS.read_text().splitlines()]
    finished = [e["trajectory"] for e in events if e["type"] == "reward_finished"]
    victim = finished[0]
    last_decode = max(
        i
        for i, e in enumerate(events)
        if e.get("trajectory") == victim and e["type"] == "decode_finished"
    )
    ts = events[last_decode]["ts"]
    events[last_decode]["finish"] = "tool"
    tool = [
        {
            "id": f"{victim}#t0",
            "ts": ts,
            "trajectory": victim,
            "type": "tool_started",
            "tool": "python",
        },
        {
            "id": f"{victim}#t1",
            "ts": ts + 0.25,
            "trajectory": victim,
            "type": "tool_finished",
            "result_tokens": 40,
        },
    ]
    events[last_decode + 1 : last_decode + 1] = tool
    for e in events[last_decode + 3 :]:
        if e.get("trajectory") == victim and e["type"] in ("reward_started", "reward_finished"):
            e["ts"] = max(e["ts"], ts + 0.25)
    path = tmp_path / "tool-last.ndjson"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    rec = rebuild(path)
    script = next(s for s in rec.scripts if s.turns[-1].finish == "tool")
    assert script.stop is None and script.turns[-1].tool_seconds == pytest.approx(0.25)
    report = replay_recording(events=path, cluster=CLUSTER, static=[3], reference=False)
    original = replay_recording(events=EVENTS, cluster=CLUSTER, static=[3], reference=False)
    # One turn's 0.25 s tool and 40 tokens more: each policy completes what it completed on
    # the original recording, give or take the one trajectory at the cut.
    for name, run in report.runs.items():
        assert abs(len(run.completed_at) - len(original.runs[name].completed_at)) <= 1, name


def test_times_to_a_count_start_with_the_trainer_as_a_recordings_do() -> None:
    """A recorded trainer started once its cluster served: the replay's completion times
    count from the simulated trainer's start too, so Prorsa's wait for Ready (its engines
    start as decode; the bootstrap's flips are seen at the tick at 20 s) is in its
    makespan but not in the times compared with a recording's."""
    report = replay_recording(events=EVENTS, cluster=CLUSTER, static=[2], reference=False)
    prorsa, static = report.runs["prorsa"], report.runs["static-2P"]
    assert prorsa.makespan - prorsa.completed_at[-1] == pytest.approx(20.0)
    assert static.makespan == pytest.approx(static.completed_at[-1])
