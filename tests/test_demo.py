"""``prorsa demo`` end to end, as a user runs it: a subprocess on loopback, no cluster.

A short run must still show the system working: the operator switches engines in both
directions as the workload swings, requests aborted by switches are resumed with nothing
lost (checked here again from the per-request record, not only from the summary), and the
timeline PNG is a real image.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
Run = tuple[subprocess.CompletedProcess[str], Path]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("demo")
    proc = subprocess.run(
        [sys.executable, "-m", "prorsa.cli", "demo", "--duration", "20", "--instances", "4",
         "--no-live", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    return proc, out


def test_demo_exits_cleanly_and_prints_the_summary(demo_run: Run) -> None:
    proc, _ = demo_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "export KUBECONFIG=" in text and "kubectl get pods -n rl -L prorsa.io/role" in text
    assert "prorsa demo summary" in text
    lost = next(line for line in text.splitlines() if line.strip().startswith("tokens lost"))
    assert lost.split()[2] == "0", lost
    assert "resumed after aborts" in text


def test_demo_switches_both_ways_and_loses_nothing(demo_run: Run) -> None:
    proc, out = demo_run
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["switches"] >= 2, summary
    assert summary["switch_results"].get("succeeded", 0) >= 1, summary
    # The workload swings: more prefill for the tools phase, back to decode after it.
    assert summary["switch_directions"].get("decode->prefill", 0) >= 1, summary
    assert summary["switch_directions"].get("prefill->decode", 0) >= 1, summary
    assert summary["prefill_wape"] is not None  # the Controller scored its forecasts
    assert summary["requests_sent"] > 20
    assert summary["requests_completed"] == summary["requests_sent"]
    assert summary["requests_failed"] == 0 and summary["tokens_lost"] == 0
    assert isinstance(summary["requests_resumed"], int) and summary["requests_resumed"] >= 0
    # Resumes answer aborts the router saw (an abort that lands after the last token
    # needs none), and a resumed request took at least one resume.
    assert summary["resumes"] <= summary["prefill_aborts"] + summary["decode_aborts"]
    assert summary["requests_resumed"] <= summary["resumes"]
    assert summary["events_dropped"] == 0 and summary["events_delivered"] > 100

    # Every answer, re-checked: exactly the tokens asked, however many resumes it took.
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == summary["requests_sent"]
    assert all(r["got"] == r["asked"] and r["error"] is None for r in records)
    assert sum(1 for r in records if r["resumes"]) == summary["requests_resumed"]
    assert {r["phase"] for r in records} == {"tools", "reasoning"}


def test_demo_writes_a_png_timeline(demo_run: Run) -> None:
    _, out = demo_run
    png = out / "timeline.png"
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC
    import matplotlib.image

    image = matplotlib.image.imread(png)  # decodes every chunk: a truncated file fails
    height, width = image.shape[:2]
    assert width >= 800 and height >= 600
    assert not (out / "kubeconfig").exists()  # it pointed at an emulator that is gone
