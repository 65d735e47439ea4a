"""The value table of ``prorsa bench rollout``: what any one fixed split risks, in hindsight.

Ratios are a choice's makespan over the setting's best static makespan, so a split that is
slower reads above 1; the worst and the geometric mean are over the role-switch-capable
settings only. The arithmetic is checked on synthetic rows whose answers are known.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from prorsa.cli import main
from prorsa_lab.bench.split_value import value_json, value_lines, value_table
from prorsa_lab.sim.runner import SettingRow, aggregate

# qwen3-dp8 can be role-switched; qwen3-235b (MoE EP8) cannot, so it must not count.
CAPABLE, EP = "qwen3-dp8", "qwen3-235b"


def row(model: str, task: str, statics: dict[int, float], **policies: float) -> SettingRow:
    best = min(statics, key=lambda n: (statics[n], n))
    r = SettingRow(model, task, 8, best_static=best, statics=dict(statics))
    r.makespan = {
        "best-static": statics[best],
        **{k.replace("_", "-"): v for k, v in policies.items()},
    }
    return r


def rows() -> list[SettingRow]:
    return [
        # coding: 3P is best (100 s); 1P takes 2.1x as long; Prorsa beats it by moving.
        row(CAPABLE, "coding", {1: 210, 2: 130, 3: 100, 4: 120}, prorsa=90, colocation=150),
        # general: 1P is best (50 s); 3P takes 1.6x as long.
        row(CAPABLE, "general", {1: 50, 2: 60, 3: 80, 4: 100}, prorsa=55, colocation=40),
        # Not role-switch-capable: 4P at 40x would be the worst of everything if counted.
        row(EP, "coding", {1: 1, 2: 2, 3: 3, 4: 40}, prorsa=1, colocation=1),
    ]


def by_choice() -> dict[str, Any]:
    return {x.choice: x for x in value_lines(rows())}


def test_each_fixed_split_reports_its_worst_and_geometric_mean_slowdown() -> None:
    got = by_choice()
    assert list(got) == ["1P:7D", "2P:6D", "3P:5D", "4P:4D", "prorsa", "colocation"]
    one, three = got["1P:7D"], got["3P:5D"]
    # Slower than the best split reads above 1 (a flipped ratio would read 1/2.1).
    assert one.worst == pytest.approx(2.1) and one.worst_at == "qwen3-dp8/coding/8"
    assert one.geomean == pytest.approx(math.sqrt(2.1 * 1.0))
    assert three.worst == pytest.approx(1.6) and three.worst_at == "qwen3-dp8/general/8"
    assert three.geomean == pytest.approx(math.sqrt(1.0 * 1.6))
    assert got["4P:4D"].worst == pytest.approx(2.0)  # general: 100 / 50; EP row left out
    assert (one.best_in, got["2P:6D"].best_in, three.best_in) == (1, 0, 1)
    assert {x.settings for x in got.values()} == {2}


def test_prorsa_and_colocation_stand_on_the_same_footing() -> None:
    got = by_choice()
    # Prorsa: 90/100 and 55/50: it can beat the hindsight best split where it moves.
    assert got["prorsa"].worst == pytest.approx(1.1)
    assert got["prorsa"].geomean == pytest.approx(math.sqrt(0.9 * 1.1))
    assert got["colocation"].worst == pytest.approx(1.5)
    assert got["colocation"].worst_at == "qwen3-dp8/coding/8"
    assert got["colocation"].geomean == pytest.approx(math.sqrt(1.5 * 0.8))
    assert got["prorsa"].best_in is None


def test_a_split_that_never_finishes_is_infinitely_worse_and_a_missing_one_is_left_out() -> None:
    data = rows()[:2]
    data[0].statics[5] = math.inf  # 5P never finished coding
    data[1].statics[5] = 70.0
    data[1].statics[6] = 70.0  # 6P ran on one setting only: no worst over all of them
    got = {x.choice: x for x in value_lines(data)}
    assert "6P:2D" not in got
    assert math.isinf(got["5P:3D"].worst) and math.isinf(got["5P:3D"].geomean)
    assert got["5P:3D"].worst_at == "qwen3-dp8/coding/8"
    line = next(x for x in value_json(data)["scopes"]["all"]["lines"] if x["choice"] == "5P:3D")
    assert (line["worst"], line["geomean"]) == (None, None)  # JSON has no infinity
    assert "DNF / DNF" in value_table(data)


def test_the_per_task_split_is_one_split_per_task_across_its_settings() -> None:
    """Paper §5.4: one split per task, the one with the least geometric-mean slowdown over
    the task's settings, kept across models and staleness."""
    spans = {
        # coding: 2P is never best but always 1.2x (geometric mean 1.2); 1P is best twice
        # and 2x once (geometric mean 1.26), 3P best once. The task split is 2P.
        ("qwen3-dp8", 0): {1: 100.0, 2: 120.0, 3: 200.0},
        ("qwen3-dp8", 8): {1: 200.0, 2: 120.0, 3: 100.0},
        ("qwen3-dp4", 8): {1: 100.0, 2: 120.0, 3: 200.0},
    }
    results: list[dict[str, Any]] = []
    for (model, stale), statics in spans.items():
        base = {"model": model, "task": "coding", "staleness": stale}
        for n, ms in statics.items():
            results.append(base | {"policy": f"static-{n}P", "makespan": ms})
        results.append(
            base
            | {
                "policy": "prorsa",
                "makespan": min(statics.values()),
                "wapePrefill": None,
                "wapeDecode": None,
            }
        )
    got_rows = aggregate(results, instances=8)
    assert {r.task_static for r in got_rows} == {2}
    assert {tuple(r.statics) for r in got_rows} == {(1, 2, 3)}
    task = next(x for x in value_lines(got_rows) if x.choice == "task split")
    assert task.worst == pytest.approx(1.2)
    assert task.geomean == pytest.approx(1.2)
    one = next(x for x in value_lines(got_rows) if x.choice == "1P:7D")
    assert one.worst == pytest.approx(2.0) and one.best_in == 2
    doc = value_json(got_rows)
    assert doc["taskSplits"] == {"coding": "2P:6D"}
    assert set(doc["scopes"]) == {"all", "qwen3-dp8", "qwen3-dp4"}
    assert doc["scopes"]["qwen3-dp4"]["settings"] == 1


def test_no_role_switch_capable_setting_gives_no_value() -> None:
    assert value_lines(rows()[2:]) == []
    assert value_json(rows()[2:])["scopes"] == {}


def test_rollout_prints_the_value_table_and_puts_it_in_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["--models", "qwen3-tp8", "--tasks", "general", "--staleness", "0,8"]
    tiny += ["--steps", "1", "--scale", "0.125", "--workers", "1"]
    pol = ["--policies", "prorsa,static,colocation"]
    assert main(["bench", "rollout", *tiny, *pol, "--json", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "[18/18]" in out.err  # 2 settings x (colocation, 7 splits, prorsa)
    data = json.loads(out.out)
    assert {r["policy"] for r in data["rollout"]} == {
        "colocation",
        "best-static",
        "task-static",
        "prorsa",
    }
    lines = {x["choice"]: x for x in data["value"]["scopes"]["all"]["lines"]}
    assert set(lines) == {f"{n}P:{8 - n}D" for n in range(1, 8)} | {
        "task split",
        "prorsa",
        "colocation",
    }
    assert sum(x["bestIn"] for x in lines.values() if x["bestIn"] is not None) == 2
    for s in data["settings"]:
        statics = s["staticMakespans"]
        assert set(statics) == {str(n) for n in range(1, 8)}
        best = s["bestStatic"]["prefill"]
        assert statics[str(best)] == min(statics.values())
    assert min(x["worst"] for x in lines.values() if x["bestIn"] is not None) >= 1.0
    assert main(["bench", "rollout", *tiny, *pol, "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "value: makespan over the hindsight best static split" in text
    assert "safest fixed split: " in text


@pytest.mark.parametrize(
    ("policies", "why"),
    [
        ("prorsa,oracel", "got 'prorsa,oracel'"),
        ("reference,prorsa", "(reference with static)"),
    ],
)
def test_a_bad_policy_filter_is_refused(
    policies: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "rollout", "--policies", policies, "--workers", "1"]) == 2
    assert why in capsys.readouterr().err
