"""Bounded operator memory (issue 25 item 6): at the live-trajectory limit the operator's
RSS stays under the chart's memory limit, whatever legal requests a trainer sends.

The RSS test runs the real ``prorsa operator`` in a process of its own against the
Kubernetes API emulator and measures the kernel's peak RSS of that process (``VmHWM``),
after filling one cluster to its default ``maxLiveTrajectories`` with legal 4 MiB batches
and sending three large snapshots and a burst of batches at once. Without the limit the
same 120 batches held 2.3 M trajectories and took the operator to 1.4 GiB (measured with
the limit set to 10 M). Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import cluster_runtime, make_spec
from kubernetes import client

from prorsa.clusters import TrajectoryLimit
from prorsa.core.spec import GROUP, PLURAL, VERSION, TrainerSpec
from prorsa.k8s import crd_manifest
from prorsa_contract.events import parse_events
from prorsa_lab.doubles.kube.emulator import KubeEmulatorServer
from prorsa_lab.doubles.kubelet import free_port
from prorsa_lab.doubles.stack import PATIENCE, TOKEN, TOKEN_SECRET, cluster_manifest

ROOT = Path(__file__).resolve().parent.parent
NS = "rl"
BATCH_BYTES = 4 << 20  # the webhook's largest batch
MAX_BATCHES = 120  # 2.4 M trajectories: what grew an uncapped operator past 1 GiB


def chart_memory_limit() -> int:
    """The chart's memory limit of the operator container, in bytes."""
    values = yaml.safe_load((ROOT / "charts" / "prorsa" / "values.yaml").read_text())
    text = str(values["resources"]["limits"]["memory"])
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB, as the kernel counts them."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


# -- the status condition ---------------------------------------------------------------


async def test_refusals_at_the_limit_set_the_condition_and_post_one_warning() -> None:
    events: list[tuple[str, str, str]] = []

    async def post_event(kind: str, reason: str, message: str) -> None:
        events.append((kind, reason, message))

    runtime = cluster_runtime(make_spec(trainer={"maxLiveTrajectories": 2}), post_event=post_event)
    handle = runtime.handle
    now = time.time()

    def queued(trajectory: str) -> Any:
        return parse_events(
            [{"id": uuid.uuid4().hex, "type": "request_queued", "trajectory": trajectory,
              "ts": now, "prompt_tokens": 10, "turn": 0}]
        )  # fmt: skip

    await runtime.status.trajectory_limit(runtime.spec)
    assert runtime.status.conditions["TrajectoryLimit"]["status"] == "False"
    for name in ("a", "b"):
        await handle.apply(queued(name), received=handle.clock.monotonic())
    for _ in range(2):
        with pytest.raises(TrajectoryLimit):
            await handle.apply(queued("c"), received=handle.clock.monotonic())
        await runtime.status.trajectory_limit(runtime.spec)
        condition = runtime.status.conditions["TrajectoryLimit"]
        assert (condition["status"], condition["reason"]) == ("True", "MaxLiveTrajectories")
        assert "maxLiveTrajectories (2)" in condition["message"]
    assert [(k, r) for k, r, _ in events] == [("Warning", "TrajectoryLimit")]  # once
    await runtime.status.trajectory_limit(runtime.spec)  # a tick with no refusal
    assert runtime.status.conditions["TrajectoryLimit"]["status"] == "False"


def test_the_default_limit_is_what_the_rss_test_fills() -> None:
    assert TrainerSpec().max_live_trajectories == 100_000


# -- RSS of a real operator process at the limit ----------------------------------------


@pytest.fixture
def operator_process(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """The emulator (CRD, namespace, token Secret, a RolloutCluster with the default limit)
    and ``prorsa operator`` serving it from a process of its own: (webhook URL, pid)."""
    server = KubeEmulatorServer(kubeconfig_path=tmp_path / "kubeconfig")
    server.emulator.add_crd(crd_manifest.crd())
    with server:
        api = server.api_client()
        core = client.CoreV1Api(api)
        core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        secret = {"metadata": {"name": TOKEN_SECRET}, "stringData": {"token": TOKEN}}
        core.create_namespaced_secret(NS, secret)
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, cluster_manifest("demo", namespace=NS, gpuBudget=16)
        )
        port = free_port()
        log = (tmp_path / "operator.log").open("w")
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "prorsa.cli", "operator", "-n", NS,
                "--kubeconfig", str(server.kubeconfig_path),
                "--listen", f"127.0.0.1:{port}",
                "--liveness", f"http://127.0.0.1:{free_port()}/healthz",
                "--tick-seconds", "5",
            ],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            yield f"http://127.0.0.1:{port}", proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            log.close()
            api.close()


def _batch(start: int, *, now: float, size: int = BATCH_BYTES) -> tuple[bytes, int]:
    """request_queued events for new trajectories from ``start`` on, up to ``size`` bytes
    of JSON: (body, how many)."""
    events = []
    used = 20
    i = start
    while True:
        event = json.dumps(
            {
                "id": f"q-{i:012d}-{uuid.uuid4().hex}",
                "ts": now,
                "type": "request_queued",
                "trajectory": f"traj-{i:012d}-{'x' * 40}",
                "prompt_tokens": 12_000 + i % 977,
                "turn": i % 7,
            }
        )
        if used + len(event) + 1 > size:
            break
        events.append(event)
        used += len(event) + 1
        i += 1
    return ('{"events":[' + ",".join(events) + "]}").encode(), len(events)


def _snapshot(n: int, *, now: float) -> bytes:
    """A whole-table snapshot of ``n`` trajectories, ~300 bytes a row (ids, group, task,
    tool and instance all given)."""
    rows = [
        {"trajectory": f"traj-{i:012d}-{'x' * 40}", "state": "tool", "since": now - 1,
         "context_tokens": 20_000 + i % 991, "group": f"group-{i // 16:08d}", "task": "swe",
         "turn": i % 9, "instance": "demo-engine-1", "mode": "prewarm", "tool": "bash-run"}
        for i in range(n)
    ]  # fmt: skip
    return json.dumps({"ts": now, "trajectories": rows}).encode()


async def _post(http: httpx.AsyncClient, path: str, body: bytes) -> httpx.Response:
    """Post like the SDK: a 429 ``busy`` (bodies in flight) is retried after Retry-After."""
    deadline = time.monotonic() + 4 * PATIENCE
    while True:
        r = await http.post(path, content=body)
        busy = r.status_code == 429 and r.json().get("reason") == "busy"
        if not busy or time.monotonic() > deadline:
            return r
        await asyncio.sleep(float(r.headers.get("Retry-After", "1")))


@pytest.mark.slow  # the whole operator: left out by `make test-fast`
async def test_the_operator_stays_under_the_charts_memory_limit_at_the_cap(
    operator_process: tuple[str, int],
) -> None:
    url, pid = operator_process
    limit = TrainerSpec().max_live_trajectories
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    base = f"/v1/namespaces/{NS}/rolloutclusters/demo"
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=4 * PATIENCE) as http:
        deadline = time.monotonic() + 2 * PATIENCE
        while True:  # the operator starts, then serves the cluster
            try:
                if (await http.get(f"{base}/status")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the operator never served the cluster"
            await asyncio.sleep(0.2)
        started = memory_kib(pid)

        # 1. Legal 4 MiB batches of new trajectories until the limit refuses three in a row.
        now = time.time()
        sent = refused_in_a_row = batches = 0
        while refused_in_a_row < 3 and batches < MAX_BATCHES:
            body, n = _batch(sent, now=now)
            r = await _post(http, f"{base}/events", body)
            batches += 1
            sent += n
            if r.status_code == 429 and r.json().get("reason") == "trajectory_limit":
                refused_in_a_row += 1
            else:
                assert r.status_code == 200, r.text
                refused_in_a_row = 0
        live = sum((await http.get(f"{base}/status")).json()["liveTrajectories"].values())
        filled = memory_kib(pid)

        # 2. Three snapshots of the whole table at once, with eight 4 MiB batches.
        snapshot = _snapshot(limit, now=time.time())
        bursts = [_batch(sent + k * 30_000, now=time.time())[0] for k in range(8)]
        replies = await asyncio.gather(
            *(_post(http, f"{base}/snapshot", snapshot) for _ in range(3)),
            *(_post(http, f"{base}/events", body) for body in bursts),
        )
        live_after = sum((await http.get(f"{base}/status")).json()["liveTrajectories"].values())
    peak = memory_kib(pid)["VmHWM"] << 10
    print(
        f"\nprorsa operator RSS (KiB): started {started}, at the limit {filled}, at the end "
        f"{memory_kib(pid)}; {batches} batches of {len(body) / 2**20:.1f} MiB, {sent} trajectories "
        f"sent, {live} live (limit {limit}); snapshot {len(snapshot) / 2**20:.1f} MiB x 3; "
        f"peak {peak / 2**20:.0f} MiB of the chart's {chart_memory_limit() >> 20} MiB"
    )
    assert live == limit, "the limit did not hold"
    assert [r.status_code for r in replies[:3]] == [200, 200, 200]
    # Past the limit (or past the cluster's queue, eight at once): 429 with Retry-After, to be
    # resent; nothing accepted was dropped (the live count held).
    assert {r.status_code for r in replies[3:]} == {429}
    assert {r.json()["reason"] for r in replies[3:]} <= {"trajectory_limit", "queue_full"}
    assert all(int(r.headers["Retry-After"]) >= 1 for r in replies[3:])
    assert live_after == limit
    assert peak < chart_memory_limit()
