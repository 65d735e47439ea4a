"""The demo's live view and summary as a user reads them in an 80×24 terminal.

Rendered with rich's own recording console at that size: everything fits on the screen,
the trainer panel with "tokens lost" included; pod names keep the part that tells them
apart; no line is cut mid-word; a drain never reads ``draining → ?``.
"""

from __future__ import annotations

import io
import re
import time
from types import SimpleNamespace
from typing import Any

from rich.cells import cell_len
from rich.console import Console

from prorsa_lab.demo.frame import LEGEND, Frame, wrap_lines
from prorsa_lab.demo.live_panel import distinct_names, render_live
from prorsa_lab.demo.monitor import PodState
from prorsa_lab.demo.pod_directory import LabelChange, PodView
from prorsa_lab.demo.view import LiveView, PlainView

REASON = (
    "prefill demand 0.84 inst, decode KV 2.71 inst (planned on 0.80/2.60 over 5s); best "
    "margin at 1P:3D; θ_P 87101 tok/s at prefix-cache hit ratio 54%"
)


def _frame(reason: str = REASON, target: tuple[int, int] = (1, 3)) -> Frame:
    return Frame(
        elapsed=83.2, duration=150.0, phase="reasoning (decode-heavy)", mode="predictive",
        labels={"prefill": 1, "decode": 2, "draining": 1}, target=target, demand=(0.84, 2.71),
        forecast={"prefillTokens": 123_456, "decodeKvTokens": 312_000,
                  "components": {"ready": 1000, "inflight": 20_000, "tool": 3000}},
        capacity={"prefillTokensPerSecond": 40_000, "decodeKvTokens": 120_000}, margin=0.12,
        reason=reason, wape=(0.27, 0.61), sent=12_345, completed=12_300, in_flight=45,
        resumed=21, resumes=42, lost=0, live=32, events_per_second=143.0,
    )  # fmt: skip


def _pods(n: int) -> list[PodState]:
    roles = ["prefill", "decode", "draining", "decode"]
    return [
        PodState(
            name=f"demo-engine-{i}",
            role=roles[i % 4],
            intent="prefill" if roles[i % 4] == "draining" else None,
            engine_role="prefill" if i % 4 == 0 else "decode",
            running=31,
            waiting=2,
            waiting_tokens=15_200,
            kv_used=98_000,
            kv_capacity=120_000,
            healthy=True,
        )
        for i in range(n)
    ]


def _screen(
    instances: int,
    *,
    log: list[str],
    width: int = 80,
    height: int = 24,
    reason: str = REASON,
    target: tuple[int, int] = (1, 3),
) -> list[str]:
    console = Console(width=width, height=height, record=True, file=io.StringIO())
    console.print(
        render_live(
            _frame(reason, target),
            task="coding",
            instances=instances,
            pods=_pods(instances),
            log=log,
            switches=len(log),
            width=width,
            height=height,
        )
    )
    return console.export_text().splitlines()


SWITCH_LOG = [
    f"01:{10 + i:02d} demo-engine-{i % 4} decode → prefill [green]succeeded[/] in 0.62 s"
    for i in range(12)
]


def test_the_live_view_fits_80x24_with_the_trainer_panel_and_the_newest_switch() -> None:
    screen = _screen(4, log=SWITCH_LOG)
    assert len(screen) <= 23, "\n".join(screen)  # the last row holds the cursor
    assert all(len(line) <= 80 for line in screen)
    text = "\n".join(screen)
    assert "tokens lost 0" in text and "12345 sent" in text
    assert "01:21 demo-engine-3 decode → prefill succeeded" in text  # the newest switch
    assert "01:10 " not in text  # older ones give way
    assert "best margin" in text or "planned on" in text  # the Decision's reason, one line


def test_pod_names_keep_the_part_that_tells_them_apart() -> None:
    screen = _screen(4, log=[])
    rows = [line.strip("│ ").split() for line in screen if re.search(r"\bengine-\d\b", line)]
    names = [row[0] for row in rows if row and row[0].startswith("engine-")]
    assert names == ["engine-0", "engine-1", "engine-2", "engine-3"], "\n".join(screen)
    assert any("engine pods demo-…" in line for line in screen)
    assert distinct_names(["a-b-pod-10", "a-b-pod-11"]) == ("a-b-", ["pod-10", "pod-11"])
    assert distinct_names(["only-one"]) == ("", ["only-one"])
    assert distinct_names(["x-1", "y-2"]) == ("", ["x-1", "y-2"])


def test_with_eight_pods_the_trainer_panel_still_shows_at_24_rows() -> None:
    screen = _screen(8, log=SWITCH_LOG)
    trainer_end = max(i for i, line in enumerate(screen) if "WAPE P" in line)
    assert trainer_end < 24 and "tokens lost 0" in "\n".join(screen[:24])


def test_a_wider_terminal_shows_the_forecast_detail_with_its_legend() -> None:
    assert not any("K_D+K̂_D" in line for line in _screen(4, log=SWITCH_LOG))
    for width in (80, 120):
        screen = _screen(4, log=SWITCH_LOG, width=width, height=40)
        text = "\n".join(screen)
        assert all(cell_len(line) <= width for line in screen), text
        assert "K_D+K̂_D" in text
        # Every symbol of the forecast line is explained, whole, whatever the width.
        for entry in LEGEND:
            assert entry in text, (width, entry, text)


HELD = (
    "prefill demand 3.10 inst, decode KV 1.20 inst (planned on 2.90/1.10 over 5s); best "
    "margin at 3P:1D; over budget: the tighter side needs 1.45x the capacity; holding: "
    "demo-engine-3 decode->prefill: gains 6s over the payoff horizon, costs 9s (12k tokens "
    "to recompute); θ_P 10000 tok/s at prefix-cache hit ratio 0%"
)


def _demand_lines(screen: list[str]) -> list[str]:
    """The reason's lines: the demand panel's rows after its two role rows."""
    top = next(i for i, line in enumerate(screen) if "demand vs capacity" in line)
    bottom = next(i for i in range(top + 1, len(screen)) if screen[i].startswith("╰"))
    return [line.strip("│ ") for line in screen[top + 3 : bottom]]


def test_the_reason_fits_80_and_120_columns_and_keeps_its_point() -> None:
    for width in (80, 120):
        screen = _screen(4, log=SWITCH_LOG, width=width, reason=HELD, target=(2, 2))
        assert all(cell_len(line) <= width for line in screen)
        point = _demand_lines(screen)[0]
        # Where the split goes, that Eq. 1 wanted another split, and why not: no cut.
        assert "2P:2D" in point and "Eq. 1's" in point and "3P:1D" in point, point
        assert "did not pay" in point and "…" not in point, point
    wide = _demand_lines(_screen(4, log=SWITCH_LOG, width=120, reason=HELD, target=(2, 2)))
    assert "gains 6 s, costs 9 s" in wide[0]
    rounded = HELD.replace("gains 6s", "gains -0s")  # a loss under half a second
    point = _demand_lines(_screen(4, log=[], width=120, reason=rounded, target=(2, 2)))[0]
    assert "gains 0 s, costs 9 s" in point and "-0" not in point, point
    assert wide[1].startswith("prefill demand 3.10 inst")  # the detail, on the next line


def test_the_view_says_when_the_target_is_eq1s_best_and_how_it_gets_there() -> None:
    moving = HELD.replace("holding: ", "switching: ")
    point = _demand_lines(_screen(4, log=[], width=80, reason=moving, target=(3, 1)))[0]
    assert point.startswith("to Eq. 1's best 3P:1D: engine-3 decode→prefill gains 6 s"), point
    hysteresis = (
        "prefill demand 1.00 inst, decode KV 2.00 inst; best margin at 1P:3D; holding "
        "2P:2D: best split gains 8% headroom (< 10% hysteresis)"
    )
    point = _demand_lines(_screen(4, log=[], width=80, reason=hysteresis, target=(2, 2)))[0]
    assert point == "2P:2D, not Eq. 1's 1P:3D: hysteresis (8% < 10%)"
    point = _demand_lines(_screen(4, log=[], width=120, reason=hysteresis, target=(2, 2)))[0]
    assert point == "target 2P:2D, not Eq. 1's best 1P:3D: hysteresis, it gains 8% headroom (< 10%)"
    settled = "prefill demand 1.00 inst, decode KV 2.00 inst; best margin at 2P:2D"
    point = _demand_lines(_screen(4, log=[], width=80, reason=settled, target=(2, 2)))[0]
    assert point == "at Eq. 1's best 2P:2D"


def test_the_plain_view_prints_the_legend_and_why_once_per_change() -> None:
    stream = io.StringIO()
    view = PlainView(
        options=SimpleNamespace(task="coding", instances=4, duration=60.0),
        monitor=SimpleNamespace(switches={}),
        trainer=SimpleNamespace(t0=time.time()),
        router=None,
        directory=SimpleNamespace(changes=[], pods={}),
        stream=stream,
    )
    other_figures = HELD.replace("gains 6s", "gains 7s")
    frames = iter([_frame(HELD, (2, 2)), _frame(other_figures, (2, 2)), _frame(REASON, (1, 3))])
    view.frame = lambda: next(frames)  # type: ignore[method-assign]
    view.start()
    for _ in range(3):
        view._last_line = 0.0
        view.refresh()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("  legend: W_P: prefill tokens forecast")
    whys = [line.strip() for line in lines if line.strip().startswith("why:")]
    assert len(whys) == 2  # the same point twice is said once, whatever its figures
    assert "the move was priced and did not pay" in whys[0]


def _view(kind: type[Any], changes: list[LabelChange], pods: dict[str, PodView]) -> Any:
    return kind(
        options=SimpleNamespace(task="coding", instances=4, duration=60.0),
        monitor=SimpleNamespace(switches={}),
        trainer=SimpleNamespace(t0=changes[0].at - 10),
        router=None,
        directory=SimpleNamespace(changes=changes, pods=pods),
        stream=io.StringIO(),
    )


def test_a_drain_names_its_target_even_after_the_switch_has_ended() -> None:
    now = time.time()
    changes = [
        LabelChange(at=now, pod="demo-engine-2", old="decode", new="draining"),
        LabelChange(at=now + 0.6, pod="demo-engine-2", old="draining", new="prefill"),
        LabelChange(at=now + 2, pod="demo-engine-0", old="prefill", new="draining"),
    ]
    # By the time the view refreshes, engine-2 has flipped and lost its intent annotation.
    pods = {
        "demo-engine-2": PodView("demo-engine-2", "u2", "prefill", None, None),
        "demo-engine-0": PodView("demo-engine-0", "u0", "draining", None, "decode"),
    }
    live = _view(LiveView, changes, pods)
    live.refresh()
    assert live._log == [
        "00:10 demo-engine-2 draining → prefill",
        "00:12 demo-engine-0 draining → decode",
    ]
    plain = _view(PlainView, changes, pods)
    assert [plain.drain_text(p, t, arrow="->") for _, p, t in plain.fresh_drains()] == [
        "demo-engine-2 draining -> prefill",
        "demo-engine-0 draining -> decode",
    ]


def test_the_summary_folds_at_spaces_under_its_labels() -> None:
    lines = [
        "  requests      12345 sent, 12345 completed, 0 failed; 21 resumed after aborts "
        "(42 resumes; aborts seen: 3 in prefill, 20 in decode)",
        "  phase lag     11.6, 19.9 s after each phase change; prefill backlog at phase ends "
        "14 req/152k, 2 req/32k, 6 req/79k",
        "  timeline      bench-out/demo/timeline.png",
    ]
    folded = list(wrap_lines(lines, 80))
    assert all(len(line) <= 80 for line in folded)
    assert folded[1].startswith(" " * 16) and folded[1][16] != " "
    assert " ".join(folded).split() == " ".join(lines).split()  # no word was cut
    assert list(wrap_lines(lines, None)) == lines  # a pipe gets one line per figure
