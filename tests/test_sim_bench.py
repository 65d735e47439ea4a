"""``prorsa bench rollout``: the command a user runs, its table, its JSON and its picture."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from prorsa.cli import main
from prorsa.commands import lab
from prorsa_lab.bench import rollout_bench as rollout
from prorsa_lab.sim.runner import GridConfig, SettingRow, aggregate, jobs

TINY = [
    "--models",
    "qwen3-tp8",
    "--tasks",
    "general",
    "--staleness",
    "0,8",
    "--steps",
    "1",
    "--scale",
    "0.125",
    "--workers",
    "1",
]


def test_registered_in_prorsa_bench() -> None:
    assert lab.entry_point(lab.BENCHES, "rollout").value == "prorsa_lab.bench.rollout_bench"
    assert lab.load(lab.BENCHES, "rollout") is rollout


def test_json_has_every_policy_speedups_wape_and_writes_the_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "rollout", *TINY, "--json", "--out", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["rollout"]
    assert {r["staleness"] for r in rows} == {0, 8}
    for s in (0, 8):
        mine = {r["policy"]: r for r in rows if r["staleness"] == s}
        assert set(mine) == set(rollout.POLICIES)
        for r in mine.values():
            assert set(r) == {
                "model",
                "deployment",
                "attention",
                "dpSize",
                "roleSwitchCapable",
                "regime",
                "task",
                "staleness",
                "policy",
                "makespanSeconds",
                "speedupVsColocation",
                "speedupVsBestStatic",
                "speedupVsTaskStatic",
                "decodeKvUtilisation",
                "admissionQueue",
                "switches",
                "kvStore",  # what a shared KV store served (None: per-instance caches)
            }
            assert r["makespanSeconds"] > 0
            assert r["roleSwitchCapable"] is True and r["regime"] in ("kv-bound", "latency-bound")
            assert r["deployment"].startswith("Qwen3-235B")
            assert (r["attention"], r["dpSize"]) == ("tp", 1)
            assert r["speedupVsColocation"] == pytest.approx(
                mine["colocation"]["makespanSeconds"] / r["makespanSeconds"]
            )
        assert mine["colocation"]["speedupVsColocation"] == 1.0
        assert mine["best-static"]["speedupVsBestStatic"] == 1.0
        # One task: its one split is the best on average, never better than each best.
        assert mine["task-static"]["speedupVsBestStatic"] <= 1.0
        assert mine["task-static"]["speedupVsTaskStatic"] == 1.0
        assert 0.0 <= mine["best-static"]["decodeKvUtilisation"] <= 1.0
        # The reference starts from the best static split and only moves to do better.
        assert mine["reference"]["speedupVsBestStatic"] >= 1.0
    wape = data["wape"]
    assert {(w["model"], w["task"], w["staleness"]) for w in wape} == {
        ("qwen3-tp8", "general", 0),
        ("qwen3-tp8", "general", 8),
    }
    assert all(w["deployment"].startswith("Qwen3-235B") for w in wape)
    assert all(w["prefill"] >= 0 for w in wape)
    png = Path(data["png"])
    assert png.parent == tmp_path and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    settings = {s["staleness"]: s for s in data["settings"]}
    assert settings[8]["bestStatic"]["prefill"] + settings[8]["bestStatic"]["decode"] == 8
    assert settings[8]["taskStatic"]["prefill"] + settings[8]["taskStatic"]["decode"] == 8
    goals = {g["goal"] for g in data["goals"]}
    assert "every role-switch-capable setting: Prorsa >= 0.97x best static" in goals
    (schedule,) = [x for x in data["referenceSchedules"] if x["staleness"] == 8]
    assert schedule["start"] == settings[8]["bestStatic"]["prefill"]
    assert schedule["decisions"] and schedule["timeline"]
    assert {d["why"] for d in schedule["decisions"]} <= {"periodic", "weights"}


def test_table_prints_makespans_speedups_and_goals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "rollout", *TINY, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "makespan (s)" in out and "speedup over colocation / over best static" in out
    assert "best split" in out and "task split" in out and "WAPE P" in out
    assert "dec KV" in out and ("kv-bound" in out or "latency-bound" in out)
    assert "general" in out and "on-policy" in out
    assert "goals" in out
    assert f"wrote {tmp_path / 'rollout.png'}, {tmp_path / 'rollout.json'}" in out
    saved = json.loads((tmp_path / "rollout.json").read_text())
    assert {r["policy"] for r in saved["rollout"]} == set(rollout.POLICIES)


def test_quick_grid_is_the_documented_reduction() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    rollout.configure(parser)
    quick = rollout._config(parser.parse_args(["--quick"]))
    full = rollout._config(parser.parse_args([]))
    assert full == GridConfig(seed=1)
    assert (quick.steps, quick.scale, quick.static) == (2, 0.5, (2, 3, 4, 5, 6))
    assert (quick.models, quick.tasks, quick.staleness) == (full.models, full.tasks, (0, 2, 8))
    assert full.models[:3] == ("deepseek-v3-dp8", "qwen3-dp8", "qwen3-dp4")
    assert len(jobs(full)) == 7 * 3 * 3 * (1 + 7 + 4 + 1)
    with pytest.raises(ValueError, match="gpt-9"):
        rollout._config(parser.parse_args(["--models", "gpt-9"]))


def test_unknown_model_is_refused_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "rollout", "--models", "gpt-9", "--workers", "1"]) == 2
    assert "gpt-9" in capsys.readouterr().err


def test_goals_are_judged_from_the_measured_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SettingRow, "role_switch_capable", property(lambda r: r.model != "ep"))
    monkeypatch.setattr(SettingRow, "dp_size", property(lambda r: 1 if r.model == "tp" else 8))

    def row(model: str, task: str, s: int, **ms: float) -> SettingRow:
        r = SettingRow(model, task, s, makespan=dict(ms), best_static=3)
        r.wape_prefill, r.wape_decode = 0.05, 0.2
        return r

    rows = [
        # DP, coding: 1.2x colocation, 1.2x best static; the reference 1.5x: 40% captured
        row("dp", "coding", 8, colocation=120, **{"best-static": 120, "prorsa": 100}),
        # DP, coding: 1.04x the best static (goal 1.05x), reference 1.04x (no capture goal)
        row("dp", "coding", 2, colocation=150, **{"best-static": 104, "prorsa": 100}),
        # DP, general: 1.05x colocation (goal 1.10x), 0.95x best static (goal 0.97x)
        row("dp", "general", 8, colocation=105, **{"best-static": 95, "prorsa": 100}),
        row("tp", "general", 8, colocation=50, **{"best-static": 100, "prorsa": 98}),
        row("ep", "general", 8, colocation=50, **{"best-static": 100, "prorsa": 80}),
    ]
    rows[0].makespan["reference"] = 80
    rows[1].makespan["reference"] = 100
    rows[2].makespan["reference"] = 95
    rows[3].makespan["reference"] = 90
    got = {g["goal"]: g for g in rollout.goals(rows)}
    colocation = got["DP-attention rows, agentic tasks: Prorsa >= 1.10x colocation"]
    assert colocation["ok"] is False and colocation["misses"] == ["dp/general/8"]
    assert set(colocation["measured"]) == {"dp/coding/8", "dp/coding/2", "dp/general/8"}
    assert colocation["measured"]["dp/coding/8"] == {
        "prorsa": 1.2,
        "reference": 1.5,
        "wape": {"prefill": 0.05, "decode": 0.2},
    }
    coding = got["DP-attention rows, coding at staleness 2 and 8: Prorsa >= 1.05x best static"]
    assert coding["ok"] is False and coding["misses"] == ["dp/coding/2"]
    capture = got[
        "where the reference gains >= 5% over the best static split, Prorsa captures >= 70% "
        "of that gain"
    ]
    # dp/coding/8: 20 of 40 s; tp/general/8: 2 of 10 s. The others gain under 5%.
    assert set(capture["measured"]) == {"dp/coding/8", "tp/general/8"}
    assert capture["measured"]["dp/coding/8"]["captured"] == 0.5
    assert capture["ok"] is False and capture["misses"] == ["dp/coding/8", "tp/general/8"]
    floor = got["every role-switch-capable setting: Prorsa >= 0.97x best static"]
    assert floor["misses"] == ["dp/general/8"]  # the EP row is not judged
    assert "ep/general/8" not in floor["measured"]
    assert rollout.goals([])[0]["ok"] is None  # nothing measured, nothing judged


def test_best_static_is_the_fastest_split_and_dnf_is_infinite() -> None:
    base = {
        "model": "m",
        "task": "coding",
        "staleness": 2,
        "idleRatio": 0.1,
        "wapePrefill": None,
        "wapeDecode": None,
    }
    results = [
        base | {"policy": "static-1P", "makespan": math.inf},
        base | {"policy": "static-2P", "makespan": 50.0},
        base | {"policy": "static-3P", "makespan": 40.0},
        base | {"policy": "colocation", "makespan": 80.0},
    ]
    (row,) = aggregate(results, instances=4)
    assert row.best_static == 3 and row.makespan["best-static"] == 40.0
    assert row.speedup("colocation", over="best-static") == 0.5
    assert rollout._num(math.inf) == "DNF"


def test_schedule_bound_script_ranks_schedules_against_the_best_static_split() -> None:
    root = Path(__file__).resolve().parents[1]
    script = str(root / "scripts/schedule_bound.py")
    setting = ["qwen3-235b", "general", "2", "--steps", "2", "--groups", "1"]
    out = subprocess.run(
        [sys.executable, script, *setting, "--at", "", "--workers", "1"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "[91/91]" in out.stderr  # progress: 7 static splits and 84 burst schedules
    head, *ranked = out.stdout.strip().splitlines()
    best_static = float(head.split("best static ")[1].split(" s")[0])
    times = [float(line.split()[0]) for line in ranked]
    assert len(times) == 8 and times == sorted(times)
    assert times[0] <= best_static  # the static splits are among the schedules


def test_grid_options_reach_every_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    rollout.configure(parser)
    args = ["--hicache-ratio", "0", "--no-weight-update-events", "--smoothing", "300"]
    cfg = rollout._config(parser.parse_args(args))
    for sc in cfg.scenarios():
        assert (sc.hicache_ratio, sc.weight_update_events, sc.smoothing) == (0.0, False, 300.0)
        assert sc.spec().capacity.prefill_cache_tokens == sc.profile().kv_capacity
    assert main(["bench", "rollout", "--hicache-ratio", "-1", "--workers", "1"]) == 2
    assert "--hicache-ratio must be >= 0" in capsys.readouterr().err
    # Weight updates take the model's published broadcast time unless told otherwise.
    by_model = {sc.model: sc.update_seconds() for sc in cfg.scenarios()}
    assert by_model["qwen3-tp8"] == pytest.approx(7.21)
    assert by_model["deepseek-v3-tp16"] == pytest.approx(13.66)
    measured = rollout._config(parser.parse_args(["--weight-update-seconds", "measured"]))
    assert {sc.model: sc.update_seconds() for sc in measured.scenarios()} == by_model
    instant = rollout._config(parser.parse_args(["--weight-update-seconds", "0"]))
    assert {sc.update_seconds() for sc in instant.scenarios()} == {0.0}
    fixed = rollout._config(parser.parse_args(["--weight-update-seconds", "20"]))
    assert {sc.update_seconds() for sc in fixed.scenarios()} == {20.0}
    # The router's part of a switch: smg's measured delays unless told there are none.
    assert {(sc.router_drain_seconds, sc.router_register_seconds) for sc in cfg.scenarios()} == {
        (6.0, 2.0)
    }
    none = rollout._config(parser.parse_args(["--router-delays", "none"]))
    assert {(sc.router_drain_seconds, sc.router_register_seconds) for sc in none.scenarios()} == {
        (0.0, 0.0)
    }
    for bad in ("-1", "soon"):
        assert main(["bench", "rollout", "--weight-update-seconds", bad, "--workers", "1"]) == 2
        assert "--weight-update-seconds must be 'measured' or seconds >= 0" in (
            capsys.readouterr().err
        )
    # DP ranks are placed as the operator deploys smg (--dp-aware) unless told otherwise.
    assert {sc.model: sc.dp_aware() for sc in cfg.scenarios()} == {
        "deepseek-v3-dp8": True,
        "qwen3-dp8": True,
        "qwen3-dp4": True,
        "qwen3-dp2": True,
        "deepseek-v3-dp16": True,
        "qwen3-tp8": False,  # one rank: smg's worker is the engine
        "deepseek-v3-tp16": False,
    }
    rr = rollout._config(parser.parse_args(["--dp-routing", "round-robin"]))
    assert {sc.dp_aware() for sc in rr.scenarios()} == {False}
    ref = rollout._config(
        parser.parse_args(["--reference-cadence", "45", "--reference-moves=-1,1"])
    )
    assert (ref.reference_cadence, ref.reference_moves) == (45.0, (-1, 1))
    assert "reference" not in rollout._config(parser.parse_args(["--no-reference"])).policies
    for flag, bad in (("--reference-cadence", "0"), ("--reference-moves", "0,1")):
        assert main(["bench", "rollout", flag, bad, "--workers", "1"]) == 2
        assert flag in capsys.readouterr().err


def test_reuse_runs_only_the_controller_and_keeps_the_rest_of_a_previous_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tuning the Controller reruns prorsa and the oracle against a previous run's statics
    and reference, and refuses a previous run of another grid or seed."""
    tiny = [*TINY[:5], "8", *TINY[6:]]  # one setting: general, staleness 8
    assert main(["bench", "rollout", *tiny, "--json", "--out", str(tmp_path)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["grid"]["seed"] == 1
    previous = tmp_path / "previous.json"
    previous.write_text(json.dumps(first))
    assert main(["bench", "rollout", *tiny, "--json", "--reuse", str(previous)]) == 0
    progress = capsys.readouterr()
    again = json.loads(progress.out)
    # Only the two policies that run the Controller were simulated again.
    assert "[2/2]" in progress.err and "[3/" not in progress.err
    by = {r["policy"]: r for r in again["rollout"]}
    was = {r["policy"]: r for r in first["rollout"]}
    assert set(by) == set(was) == set(rollout.POLICIES)
    for p in by:  # deterministic per seed: every figure is the same
        assert by[p]["makespanSeconds"] == pytest.approx(was[p]["makespanSeconds"])
        assert by[p]["switches"] == was[p]["switches"]
    assert again["settings"] == first["settings"]
    assert again["referenceSchedules"] == first["referenceSchedules"]
    assert [g["ok"] for g in again["goals"]] == [g["ok"] for g in first["goals"]]
    for bad, why in (
        (["--seed", "2"], "seed 1, here 2"),
        (["--staleness", "0"], "has no figures for qwen3-tp8/general/on-policy"),
    ):
        args = [*tiny, *bad] if bad[0] == "--seed" else [*TINY[:4], *TINY[6:], *bad]
        assert main(["bench", "rollout", *args, "--reuse", str(previous)]) == 2
        assert why in capsys.readouterr().err
    previous.write_text("{}")
    assert main(["bench", "rollout", *tiny, "--reuse", str(previous)]) == 2
    assert "not a `prorsa bench rollout --json` output" in capsys.readouterr().err
