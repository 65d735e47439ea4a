"""A trainer's recording, replayed by `prorsa plan`: the SDK's ``record=`` and `prorsa record`.

A recording holds exactly the events the webhook applied, in the order it applied them: a
refused event, a replayed id or a batch the server never accepted leaves no line, so
`prorsa plan --events` replays the job as the operator saw it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import make_spec
from test_ingest_cli import CLUSTER, ROOT, Proc

from prorsa.clusters import ClusterRegistry
from prorsa.core.controller import Controller
from prorsa.ingest import WebhookServer
from prorsa.ingest.recording import EventRecorder
from prorsa_contract.events import parse_lines, parse_ndjson
from prorsa_sdk import AsyncEventEmitter, EventEmitter

TOKEN = "s3cret-token"
BASE = "/v1/namespaces/rl/rolloutclusters/c"


@pytest.fixture
async def webhook() -> AsyncIterator[str]:
    registry = ClusterRegistry()
    registry.add(namespace="rl", name="c", token=TOKEN, controller=Controller(make_spec()))
    async with WebhookServer(registry).serving() as url:
        yield url


def emit_a_job(em: AsyncEventEmitter | EventEmitter, t0: float) -> None:
    """Two trajectories' turns, one event the webhook refuses, one replayed id."""
    em.sample_dispatched("t1", group="g", task="swe", prompt_tokens=900, ts=t0)
    em.request_queued("t1", prompt_tokens=1000, turn=0, ts=t0 + 1)
    em.request_queued("t2", prompt_tokens=-5, turn=0, ts=t0 + 1.5)  # refused: 422
    em.decode_finished("t1", output_tokens=300, finish="tool", ts=t0 + 2)
    em.weight_update_started(version=1, expected_seconds=5.0, ts=t0 + 3, id="w1")
    em.weight_update_started(version=1, expected_seconds=5.0, ts=t0 + 3, id="w1")  # again
    em.tool_started("t1", tool="bash", ts=t0 + 3.5)


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_async_emitter_records_what_the_webhook_accepted(
    webhook: str, tmp_path: Path
) -> None:
    path = tmp_path / "job.ndjson"
    t0 = time.time() - 60
    async with AsyncEventEmitter(
        url=webhook, namespace="rl", name="c", token=TOKEN, record=path, batch_size=3
    ) as em:
        emit_a_job(em, t0)
        assert await em.flush()
    stats = em.stats
    lines = read(path)
    # The refused event is not there; the replayed id is (the webhook counted it a
    # duplicate, not refused it), so a replay sees both copies and applies one.
    assert [e["type"] for e in lines] == [
        "sample_dispatched",
        "request_queued",
        "decode_finished",
        "weight_update_started",
        "weight_update_started",
        "tool_started",
    ]
    assert stats.recorded == 6 and stats.dropped_invalid == 1
    assert "trajectory" not in lines[3]  # a cluster event, as sent
    assert parse_lines(path.read_text().splitlines())  # valid for prorsa plan


async def test_threaded_emitter_appends_to_an_existing_recording(
    webhook: str, tmp_path: Path
) -> None:
    path = tmp_path / "job.ndjson"
    path.write_text("")  # a restarted trainer appends to its recording

    def work() -> int:
        with EventEmitter(
            url=webhook, namespace="rl", name="c", token=TOKEN, record=path, batch_size=2
        ) as em:
            emit_a_job(em, time.time() - 60)
            assert em.flush()
        return em.stats.recorded

    assert await asyncio.to_thread(work) == 6
    assert [e["ts"] for e in read(path)] == sorted(e["ts"] for e in read(path))
    assert len(read(path)) == 6


async def test_a_webhook_that_never_answers_leaves_nothing_recorded(tmp_path: Path) -> None:
    path = tmp_path / "job.ndjson"
    em = AsyncEventEmitter(
        url="http://127.0.0.1:9", namespace="rl", name="c", token=TOKEN, record=path
    )
    em.request_queued("t1", prompt_tokens=10, turn=0)
    stats = await em.aclose(timeout=0.5)
    assert stats.recorded == 0 and stats.dropped_undeliverable == 1
    assert path.read_text() == ""


def test_an_unwritable_record_path_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        AsyncEventEmitter(
            url="http://127.0.0.1:9",
            namespace="rl",
            name="c",
            token=TOKEN,
            record=tmp_path / "no" / "such" / "dir.ndjson",
        )


async def test_the_webhook_records_applied_events_once_in_order(tmp_path: Path) -> None:
    registry = ClusterRegistry()
    handle = registry.add(namespace="rl", name="c", token=TOKEN, controller=Controller(make_spec()))
    recorder = EventRecorder(tmp_path / "rec.ndjson")
    handle.on_applied = recorder.add
    t = time.time()
    batch = [
        {"id": "a", "ts": t, "trajectory": "x", "type": "request_queued", "prompt_tokens": 5,
         "turn": 0},
        {"id": "b", "ts": t + 0.1, "trajectory": "x", "type": "decode_finished",
         "output_tokens": 7, "finish": "stop"},
    ]  # fmt: skip
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        WebhookServer(registry).serving() as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        assert (await http.post(f"{BASE}/events", json={"events": batch}, headers=auth)).is_success
        again = await http.post(f"{BASE}/events", json={"events": batch}, headers=auth)
        assert again.json()["duplicates"] == 2
        bad = [{**batch[0], "id": "c", "prompt_tokens": "5"}]
        assert (await http.post(f"{BASE}/events", json={"events": bad}, headers=auth)).is_error
    recorder.close()
    recorded = parse_ndjson((tmp_path / "rec.ndjson").read_bytes())
    assert [e.id for e in recorded] == ["a", "b"]
    with pytest.raises(FileExistsError):
        EventRecorder(tmp_path / "rec.ndjson")
    EventRecorder(tmp_path / "rec.ndjson", append=True).close()


def test_prorsa_record_then_prorsa_plan_replays_the_job(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER))
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    out = tmp_path / "job.ndjson"
    proc = Proc(
        "-m", "prorsa.cli", "record", "--cluster", str(cluster), "--listen", "127.0.0.1:0",
        "--token-file", str(token), "--out", str(out), "--tick", "0.3",
    )  # fmt: skip
    try:
        url = proc.expect(r"serving rl/qwen3-coder on (http://127\.0\.0\.1:\d+)").group(1)
        proc.expect(rf"recording to {out}")
        proc.expect(r"^\d\d:\d\d:\d\d recorded 0 events \(\+0\) \| batches 0 \| live 0")
        trainer = subprocess.run(
            [
                sys.executable, "examples/minimal_trainer.py", "--url", url,
                "--namespace", "rl", "--name", "qwen3-coder", "--token-file", str(token),
                "--duration", "2", "--speed", "30", "--concurrency", "8",
            ],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert trainer.returncode == 0, trainer.stdout + trainer.stderr
        assert ", 0 resync(s)" in trainer.stdout  # a recording starts with the job
        emitted = int(trainer.stdout.split(" events emitted")[0].rsplit(" ", 1)[1])
        proc.expect(rf"recorded {emitted} events \(\+\d+\)")
        proc.p.send_signal(signal.SIGINT)
        assert proc.finish() == 0
    finally:
        proc.kill()
    assert proc.lines[-1] == (
        f"prorsa record: recorded {emitted} events to {out}; replay them: "
        f"prorsa plan --cluster {cluster} --events {out}"
    )
    assert len(out.read_text().splitlines()) == emitted
    plan = subprocess.run(
        [sys.executable, "-m", "prorsa.cli", "plan", "--cluster", str(cluster), "--events",
         str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["mode"] == "predictive"
    assert "did not fit the state machine" not in plan.stderr

    again = subprocess.run(
        [sys.executable, "-m", "prorsa.cli", "record", "--cluster", str(cluster),
         "--token-file", str(token), "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 2
    assert again.stderr.strip() == (
        f"prorsa record: error: {out} exists: give another file, or --append to add to it"
    )


def test_prorsa_ingest_records_too(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER))
    token = tmp_path / "token"
    token.write_text(TOKEN)
    out = tmp_path / "job.ndjson"
    proc = Proc(
        "-m", "prorsa.cli", "ingest", "--cluster", str(cluster), "--listen", "127.0.0.1:0",
        "--token-file", str(token), "--tick", "0.3", "--record", str(out),
    )  # fmt: skip
    try:
        url = proc.expect(r"serving rl/qwen3-coder on (http://\S+) ").group(1)
        event = {"id": "q", "ts": time.time(), "trajectory": "t", "type": "request_queued",
                 "prompt_tokens": 4096, "turn": 0}  # fmt: skip
        r = httpx.post(
            f"{url}/v1/namespaces/rl/rolloutclusters/qwen3-coder/events",
            json={"events": [event]},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 200
        proc.expect(r"predictive .*\| recorded 1$")
        proc.p.send_signal(signal.SIGTERM)
        assert proc.finish() == 0
    finally:
        proc.kill()
    assert [e["id"] for e in read(out)] == ["q"]


def test_a_recorder_that_cannot_listen_leaves_no_file(tmp_path: Path) -> None:
    import socket

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER))
    token = tmp_path / "token"
    token.write_text(TOKEN)
    out = tmp_path / "job.ndjson"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "prorsa.cli", "record", "--cluster", str(cluster),
             "--token-file", str(token), "--out", str(out), "--listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert r.returncode == 1 and "cannot listen" in r.stderr
    assert not out.exists()  # a retry on another port is not refused for a file it left
