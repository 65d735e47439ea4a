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

from rich.console import Console

from prorsa_lab.demo.frame import Frame, wrap_lines
from prorsa_lab.demo.live_panel import distinct_names, render_live
from prorsa_lab.demo.monitor import PodState
from prorsa_lab.demo.pod_directory import LabelChange, PodView
from prorsa_lab.demo.view import LiveView, PlainView

REASON = (
    "prefill demand 0.84 inst, decode KV 2.71 inst (planned on 0.80/2.60 over 5s); best "
    "margin at 1P:3D; θ_P 87101 tok/s at prefix-cache hit ratio 54%"
)


def _frame() -> Frame:
    return Frame(
        elapsed=83.2, duration=150.0, phase="reasoning (decode-heavy)", mode="predictive",
        labels={"prefill": 1, "decode": 2, "draining": 1}, target=(1, 3), demand=(0.84, 2.71),
        forecast={"prefillTokens": 123_456, "decodeKvTokens": 312_000,
                  "components": {"ready": 1000, "inflight": 20_000, "tool": 3000}},
        capacity={"prefillTokensPerSecond": 40_000, "decodeKvTokens": 120_000}, margin=0.12,
        reason=REASON, wape=(0.27, 0.61), sent=12_345, completed=12_300, in_flight=45,
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


def _screen(instances: int, *, log: list[str], width: int = 80, height: int = 24) -> list[str]:
    console = Console(width=width, height=height, record=True, file=io.StringIO())
    console.print(
        render_live(
            _frame(),
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


def test_a_wider_terminal_shows_the_forecast_detail() -> None:
    assert not any("K_D+K̂_D" in line for line in _screen(4, log=SWITCH_LOG))
    assert any("K_D+K̂_D" in line for line in _screen(4, log=SWITCH_LOG, width=120, height=40))


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
