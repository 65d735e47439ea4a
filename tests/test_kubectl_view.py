"""What a user sees with the real ``kubectl`` against the demo's stack (API emulator, fake
kubelet, operator): engine pods READY 1/1, ``kubectl get events`` with its usual columns,
and every finished switch in ``kubectl describe rolloutcluster`` by the time the status
shows it.

kubectl 1.32.3 comes from ``scripts/ci_tools.py`` (the same pinned PyPI wheel as helm), or
from PATH; the tests skip, saying why, only when neither is available. kubectl runs as a
subprocess without blocking the event loop, since the operator runs in the test's loop.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from prorsa_contract.labels import COMPONENT_LABEL
from prorsa_lab.doubles.kube.event_table import EVENTS_KEY
from prorsa_lab.doubles.kube.resources import BUILTIN_RESOURCES, PODS_KEY, table_columns, table_row
from prorsa_lab.doubles.stack import NAMESPACE, Stack, cluster_manifest, stack

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)
POD_SPEC = next(s for s in BUILTIN_RESOURCES if s.key == PODS_KEY)


def _ci_tools() -> ModuleType:
    name = "prorsa_scripts_ci_tools"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "ci_tools.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def kubectl_bin() -> str:
    tools = _ci_tools()
    try:
        return str(tools.kubectl())
    except tools.ToolUnavailable as exc:
        found = shutil.which("kubectl")
        if found is None:
            pytest.skip(f"kubectl could not be obtained here ({exc}) and is not on PATH")
        return found


async def kubectl(binary: str, env: Stack, *args: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    proc = await asyncio.create_subprocess_exec(
        binary,
        "--kubeconfig",
        str(env.server.kubeconfig_path),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=environ,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


def _rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()[1:] if line.strip()]


def _describe_events(text: str) -> list[str]:
    """The lines under ``Events:`` of ``kubectl describe``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Events:"))
    return lines[start + 3 :]


async def _up(env: Stack) -> None:
    await env.create_cluster(cluster_manifest())
    await env.kubelet.wait_running(4)

    async def one_prefill() -> bool:
        return (await env.count_roles()).get("prefill", 0) == 1

    await env.wait_for(one_prefill, what="the first prefill engine")


@pytest.mark.slow  # the whole operator: left out by `make test-fast`
async def test_engine_pods_are_ready_and_events_print_kubectls_columns(kubectl_bin: str) -> None:
    async with stack() as env:
        await _up(env)
        pods = await kubectl(
            kubectl_bin, env, "get", "pods", "-n", NAMESPACE, "-l", f"{COMPONENT_LABEL}=engine"
        )
        assert pods.split()[:3] == ["NAME", "READY", "STATUS"], pods
        rows = _rows(pods)
        assert len(rows) == 4 and all(r[1:3] == ["1/1", "Running"] for r in rows), pods

        async def switch_event() -> str | None:
            text = await kubectl(kubectl_bin, env, "get", "events", "-n", NAMESPACE)
            return text if "SwitchSucceeded" in text else None

        events = await env.wait_for(switch_event, what="the bootstrap switch's event")
        assert events.split()[:6] == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
        row = next(r for r in _rows(events) if r[2] == "SwitchSucceeded")
        assert row[0].endswith("s") and row[1] == "Normal" and row[3] == "rolloutcluster/demo"
        assert "succeeded in" in " ".join(row[4:])

        wide = await kubectl(kubectl_bin, env, "get", "events", "-n", NAMESPACE, "-o", "wide")
        header = wide.splitlines()[0].split()
        assert header[-6:] == ["SOURCE", "MESSAGE", "FIRST", "SEEN", "COUNT", "NAME"], wide
        row = next(r for r in _rows(wide) if r[2] == "SwitchSucceeded")
        assert row[-2:][0] == "1" and row[-1].startswith("kopf-event-")
        assert "kopf" in row


@pytest.mark.slow  # the whole operator: left out by `make test-fast`
async def test_describe_lists_every_switch_the_status_shows(kubectl_bin: str) -> None:
    async with stack() as env:
        await _up(env)
        # Prefill-heavy demand moves a second engine to prefill: two switches so far.
        queued = [
            env.event("request_queued", f"p-{i}", prompt_tokens=10_000, turn=0) for i in range(30)
        ]
        assert (await env.post(queued)).status_code == 200

        async def two_switches() -> list[dict] | None:
            status = (await env.get_cluster()).get("status") or {}
            history = status.get("switchHistory") or []
            return history if len(history) >= 2 else None

        history = await env.wait_for(two_switches, what="a second switch in the status")
        described = await kubectl(kubectl_bin, env, "describe", "rolloutcluster", "-n", NAMESPACE)
        events = [line for line in _describe_events(described) if "SwitchSucceeded" in line]
        for switch in history:
            assert any(switch["pod"] in line for line in events), (switch, described)
        # Each event was posted when its switch ended, not at a later flush.
        posted = [
            (e["message"].split(":")[0], datetime.datetime.fromisoformat(e["firstTimestamp"]))
            for e in await env.events()
            if e.get("reason") == "SwitchSucceeded"
        ]
        for switch in history:
            started = datetime.datetime.fromisoformat(switch["started"])
            end = started + datetime.timedelta(seconds=switch["seconds"])
            delays = [(at - end).total_seconds() for pod, at in posted if pod == switch["pod"]]
            assert any(-1.0 <= d < 3.0 for d in delays), (switch, delays)


# -- what kubectl's printers read, checked without the binary ------------------------------------


@pytest.mark.slow  # the whole operator: left out by `make test-fast`
async def test_the_fake_kubelet_writes_container_statuses_kubectl_counts_ready_from() -> None:
    async with stack() as env:
        await _up(env)
        for pod in await env.pods():
            status = pod["status"]
            (container,) = status["containerStatuses"]
            assert container["ready"] is True and container["started"] is True
            assert "startedAt" in container["state"]["running"]
            assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
            assert table_row(POD_SPEC, pod, NOW)[1:3] == ["1/1", "Running"]
        name = next(iter(env.kubelet.pods))
        await env.kubelet.fail(name)
        failed = next(p for p in await env.pods() if p["metadata"]["name"] == name)
        assert table_row(POD_SPEC, failed, NOW)[1:3] == ["0/1", "Error"]


def test_event_rows_fall_back_as_the_real_printer_does() -> None:
    spec = next(s for s in BUILTIN_RESOURCES if s.key == EVENTS_KEY)
    names = [c["name"] for c in table_columns(spec) if c["priority"] == 0]
    assert names == ["Last Seen", "Type", "Reason", "Object", "Message"]
    # events.k8s.io-style: only eventTime, the reporting controller, no count.
    modern = {
        "metadata": {"name": "e1"},
        "eventTime": "2026-12-01T11:59:00.250000Z",
        "type": "Warning",
        "reason": "SwitchFailed",
        "reportingController": "prorsa.io/operator",
        "reportingInstance": "prorsa-0",
        "involvedObject": {"kind": "RolloutCluster", "name": "demo"},
        "message": "  demo-engine-1: decode -> prefill failed \n",
    }
    assert table_row(spec, modern, NOW) == [
        "59s", "Warning", "SwitchFailed", "rolloutcluster/demo", "",
        "prorsa.io/operator, prorsa-0", "demo-engine-1: decode -> prefill failed", "59s", 1, "e1",
    ]  # fmt: skip
    # core/v1 as kopf posts it (offsets, fractions), repeated and aggregated by count.
    repeated = modern | {
        "firstTimestamp": "2026-12-01T11:50:00.5+00:00",
        "lastTimestamp": "2026-12-01T11:59:30+00:00",
        "count": 3,
        "source": {"component": "kopf"},
    }
    row = table_row(spec, repeated, NOW)
    assert row[0] == "30s" and row[5] == "kopf" and row[7] == "9m59s" and row[8] == 3
