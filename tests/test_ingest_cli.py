"""``prorsa ingest`` as a trainer developer runs it, with the example trainer against it."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from prorsa.core.decision import Decision

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = {
    "apiVersion": "prorsa.io/v1alpha1",
    "kind": "RolloutCluster",
    "metadata": {"name": "qwen3-coder", "namespace": "rl"},
    "spec": {
        "model": {"path": "/models/Qwen3-235B-A22B-FP8"},
        "gpuBudget": 64,
        "forecast": {"horizonSeconds": 10, "injection": {"policy": "replaceOnReward"}},
    },
}


class Proc:
    """A child process whose stdout lines can be awaited with a timeout."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def expect(self, pattern: str, timeout: float = 20.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matching {pattern!r} in:\n" + "\n".join(self.lines))

    def finish(self, timeout: float = 20.0) -> int:
        rc = self.p.wait(timeout)
        while (line := self._q.get(timeout=5)) is not None:
            self.lines.append(line)
        return rc

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(5)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER))
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    return cluster, token


@pytest.fixture
def ingest(files: tuple[Path, Path]) -> Iterator[tuple[Proc, str]]:
    cluster, token = files
    proc = Proc(
        "-m", "prorsa.cli", "ingest", "--cluster", str(cluster),
        "--listen", "127.0.0.1:0", "--token-file", str(token), "--tick", "0.3",
    )  # fmt: skip
    try:
        url = proc.expect(r"serving rl/qwen3-coder on (http://127\.0\.0\.1:\d+)").group(1)
        yield proc, url
    finally:
        proc.kill()


def test_sandbox_serves_the_example_trainer_and_stops_cleanly_on_ctrl_c(
    ingest: tuple[Proc, str], files: tuple[Path, Path]
) -> None:
    proc, url = ingest
    proc.expect(r"^\d\d:\d\d:\d\d reactive .*target \dP:\dD")  # ticks before any trainer
    trainer = subprocess.run(
        [
            sys.executable, "examples/minimal_trainer.py", "--url", url,
            "--namespace", "rl", "--name", "qwen3-coder", "--token-file", str(files[1]),
            "--duration", "2", "--speed", "30", "--concurrency", "8",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert re.search(r"\d+ events emitted, \d+ delivered, 0 dropped, 1 resync", trainer.stdout)
    assert "latest decision: predictive" in trainer.stdout
    line = proc.expect(r"predictive .*\| events (\d+) ").group(0)
    assert "awaiting snapshot" not in line  # the trainer answered the resync
    proc.p.send_signal(signal.SIGINT)
    assert proc.finish() == 0
    summary = proc.lines[-1]
    m = re.search(r"stopped after \d+ batches: (\d+) events applied", summary)
    assert m and int(m.group(1)) > 100, summary


def test_sigterm_stops_it_and_the_port_is_released(ingest: tuple[Proc, str]) -> None:
    proc, url = ingest
    assert httpx.get(f"{url}/healthz").json()["clusters"] == 1
    proc.p.send_signal(signal.SIGTERM)
    assert proc.finish() == 0
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # free again


def test_a_changed_token_file_is_in_force_within_a_second(
    ingest: tuple[Proc, str], files: tuple[Path, Path]
) -> None:
    """The trainer's token rotated in the file (as a mounted Secret is): the new one is
    accepted and the old one refused, with no restart; a file emptied by mistake keeps the
    token in force."""
    proc, url = ingest
    _, token_file = files
    status = f"{url}/v1/namespaces/rl/rolloutclusters/qwen3-coder/status"

    def code(token: str) -> int:
        return httpx.get(status, headers={"Authorization": f"Bearer {token}"}).status_code

    assert code("s3cret-token") == 200
    token_file.write_text("")
    proc.expect(r"--token-file .*: .*empty.*the token in force stays")
    assert code("s3cret-token") == 200
    token_file.write_text("rotated-token\n")
    proc.expect(r"changed: its token is in force, the previous one is refused")
    assert code("rotated-token") == 200
    assert code("s3cret-token") == 401


def test_json_format_prints_each_decision(files: tuple[Path, Path]) -> None:
    cluster, token = files
    proc = Proc(
        "-m", "prorsa.cli", "ingest", "--cluster", str(cluster), "--listen", "127.0.0.1:0",
        "--token-file", str(token), "--tick", "0.2", "--format", "json",
    )  # fmt: skip
    try:
        url = proc.expect(r"on (http://\S+) ").group(1)
        r = httpx.post(
            f"{url}/v1/namespaces/rl/rolloutclusters/qwen3-coder/events",
            json={
                "events": [
                    {
                        "id": "e1",
                        "ts": time.time(),
                        "trajectory": "t1",
                        "type": "request_queued",
                        "prompt_tokens": 4096,
                        "turn": 0,
                    }
                ]
            },
            headers={"Authorization": "Bearer s3cret-token"},
        )
        assert r.status_code == 200
        decision = Decision.model_validate(json.loads(proc.expect(r'^\{.*"predictive"').string))
        assert decision.forecast.components.ready == 4096
    finally:
        proc.kill()


def test_errors_are_one_line_with_an_exit_code(files: tuple[Path, Path], tmp_path: Path) -> None:
    cluster, token = files

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "prorsa.cli", "ingest", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = run("--cluster", str(cluster), "--token-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "--token-file" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**CLUSTER, "spec": {**CLUSTER["spec"], "gpuBudget": 12}}))
    r = run("--cluster", str(bad), "--token-file", str(token))
    assert r.returncode == 2 and "gpuBudget" in r.stderr
    r = run("--cluster", str(cluster), "--token-file", str(token), "--listen", "nowhere")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run("--cluster", str(cluster), "--token-file", str(token), "--listen", f":{port}")
    assert r.returncode == 1 and "cannot listen" in r.stderr


def test_examples_compile() -> None:
    for example in ("minimal_trainer.py", "verl_agent_loop.py", "slime_prorsa.py"):
        source = (ROOT / "examples" / example).read_text()
        compile(source, example, "exec")
