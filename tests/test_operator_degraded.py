"""Degraded must be visible (issue 25 item 12): an engine whose agent stops answering in
time is counted unavailable and the split is planned without it. The status says so
(phase Degraded, the Degraded condition naming the pod and the cause), ``kubectl get
rollc`` shows Ready and Phase without ``-o wide``, one Warning Event per cause names the
pods, the log names the pod, and recovery is said once too."""

from __future__ import annotations

import datetime
import logging
from dataclasses import replace
from typing import Any

import httpx
import pytest

from prorsa.control.availability import STARTUP_GRACE_SECONDS, DegradedReporter, assess
from prorsa.core.spec import GROUP, PLURAL, VERSION
from prorsa.engines.agents import Unanswered
from prorsa.k8s.crd_manifest import PRINTER_COLUMNS
from prorsa_contract.agent_api import EngineState
from prorsa_lab.doubles.sglang_double import FAST_TIMEOUTS
from prorsa_lab.doubles.stack import NAMESPACE, PATIENCE, Stack, cluster_manifest, stack

NOW = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)


def pod(name: str, *, age: float = 60.0, ip: str | None = "10.0.0.1") -> dict[str, Any]:
    created = (NOW - datetime.timedelta(seconds=age)).isoformat().replace("+00:00", "Z")
    status: dict[str, Any] = {"phase": "Running" if ip else "Pending"}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": name, "uid": f"uid-{name}", "creationTimestamp": created},
            "status": status}  # fmt: skip


def healthy(name: str, ok: bool = True) -> EngineState:
    return EngineState(instance=name, role="decode", healthy=ok)


def test_a_pod_is_starting_until_it_answers_then_lost_with_a_cause() -> None:
    seen: set[str] = set()
    pods = [pod("c-engine-0"), pod("c-engine-1", ip=None), pod("c-engine-2")]
    timeout = Unanswered("AgentTimeout", "its agent did not answer within 2 s")
    # Nobody answered yet: starting, nothing lost.
    found = assess(pods, {}, {"c-engine-0": timeout}, seen=seen, now=NOW)
    assert found.lost == () and found.starting == ("c-engine-0", "c-engine-1", "c-engine-2")
    # All answered once; then c-engine-0 times out, c-engine-1 loses its IP, c-engine-2
    # reports its engine unhealthy: three causes, each naming its pod.
    states = {n: healthy(n) for n in ("c-engine-0", "c-engine-1", "c-engine-2")}
    assert assess(pods, states, {}, seen=seen, now=NOW).lost == ()
    found = assess(
        pods, {"c-engine-2": healthy("c-engine-2", ok=False)}, {"c-engine-0": timeout},
        seen=seen, now=NOW,
    )  # fmt: skip
    causes = {u.pod: u.cause for u in found.lost}
    assert causes == {
        "c-engine-0": "AgentTimeout",
        "c-engine-1": "PodNotRunning",
        "c-engine-2": "EngineUnhealthy",
    }
    assert found.reason == "EnginesUnavailable"
    assert "3 of 3 engine(s) unavailable" in found.message(3)
    assert "c-engine-0: its agent did not answer" in found.message(3)
    # A recreated pod (new uid) starts afresh; one that never comes up is lost in the end.
    fresh = [{**pods[0], "metadata": {**pods[0]["metadata"], "uid": "new"}}]
    assert assess(fresh, {}, {"c-engine-0": timeout}, seen=seen, now=NOW).starting
    stuck = [pod("c-engine-9", age=STARTUP_GRACE_SECONDS + 1)]
    (lost,) = assess(stuck, {}, {"c-engine-9": timeout}, seen=seen, now=NOW).lost
    assert lost.cause == "EngineNotStarted" and "did not answer" in lost.detail


def test_one_warning_per_cause_again_only_when_a_pod_joins_it() -> None:
    seen = {"uid-a", "uid-b"}
    reporter = DegradedReporter()
    pods = [pod("a"), pod("b")]
    slow = Unanswered("AgentTimeout", "timed out")

    def tick(unanswered: dict[str, Unanswered]) -> list[tuple[str, str, str]]:
        states = {n: healthy(n) for n in ("a", "b") if n not in unanswered}
        found = assess(pods, states, unanswered, seen=seen, now=NOW)
        reporter.log_lines(found)
        return reporter.events(found)

    (event,) = tick({"a": slow})
    assert event[:2] == ("Warning", "AgentTimeout") and event[2].startswith("a unavailable")
    assert tick({"a": slow}) == []  # the same cause, the same pod: said already
    (event,) = tick({"a": slow, "b": slow})  # b joins: said again, naming both
    assert event[2].startswith("a, b unavailable")
    assert tick({"a": slow, "b": slow}) == []
    (event,) = tick({})
    assert event == ("Normal", "EnginesAvailable", "every engine answers again (a, b)")
    assert tick({}) == []


def test_ready_and_phase_are_default_columns() -> None:
    default = [c["name"] for c in PRINTER_COLUMNS if not c.get("priority")]
    assert default == ["Prefill", "Decode", "Target", "Margin", "Ready", "Phase", "Age"]


async def rollc_table(env: Stack) -> list[dict[str, Any]]:
    """``kubectl get rollc``: the API server's Table (what kubectl prints), default columns."""
    url = f"{env.server.url}/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io"
    async with httpx.AsyncClient() as client:
        table = (await client.get(url, headers={"Accept": accept}, timeout=10)).json()
    names = [c["name"] for c in table["columnDefinitions"] if c["priority"] == 0]
    return [dict(zip(names, row["cells"], strict=False)) for row in table["rows"]]


async def ticks_pass(env: Stack, n: int) -> None:
    """Wait until the operator has written its status ``n`` more times."""
    seen: list[str] = []

    async def written() -> bool:
        at = ((await env.get_cluster()).get("status") or {}).get("target", {}).get("at", "")
        if not seen or seen[-1] != at:
            seen.append(at)
        return len(seen) > n

    await env.wait_for(written, what=f"{n} more ticks")


async def condition(env: Stack, kind: str) -> dict[str, Any]:
    status = (await env.get_cluster()).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


@pytest.mark.slow  # the whole operator: left out by `make test-fast`
async def test_an_agent_that_times_out_degrades_the_cluster_for_all_to_see(caplog) -> None:
    caplog.set_level(logging.INFO, logger="prorsa.runtime")
    # The agent waits longer for its engine than the operator waits for the agent (an
    # agent configured past the operator's 2 s, as a hung agent or a slow network would
    # be): a hung engine scheduler (/v1/loads) makes the operator's health poll time out.
    patient = replace(FAST_TIMEOUTS, request=30.0, state=30.0)
    async with stack(agent_timeouts=patient) as env:
        await env.create_cluster(cluster_manifest())
        await env.kubelet.wait_running(4)

        async def running() -> bool:
            rows = await rollc_table(env)
            return bool(rows) and rows[0]["Ready"] == "True" and rows[0]["Phase"] == "Running"

        await env.wait_for(running, timeout=2 * PATIENCE, what="Ready True, Phase Running")
        (row,) = await rollc_table(env)
        assert list(row) == ["Name", "Prefill", "Decode", "Target", "Margin", "Ready", "Phase",
                             "Age"]  # fmt: skip
        victim = sorted((await env.roles()).items(), key=lambda kv: (kv[1], kv[0]))[0][0]
        env.kubelet.pods[victim].engine.faults.hang_loads = True

        async def degraded() -> dict[str, Any] | None:
            rows = await rollc_table(env)
            ok = rows and rows[0]["Ready"] == "False" and rows[0]["Phase"] == "Degraded"
            return rows[0] if ok else None

        await env.wait_for(degraded, timeout=PATIENCE, what="Ready False, Phase Degraded")
        cond = await condition(env, "Degraded")
        assert cond["status"] == "True" and cond["reason"] == "AgentTimeout", cond
        assert f"{victim}: its agent did not answer" in cond["message"]
        assert (await condition(env, "Ready"))["reason"] == "EnginesUnavailable"
        await env.wait_for_event("AgentTimeout")
        # Several ticks later: still the one Warning Event for the cause.
        await ticks_pass(env, 5)
        warnings = [e for e in await env.events() if e.get("reason") == "AgentTimeout"]
        assert warnings and all(e["type"] == "Warning" for e in warnings)
        # Once per cause: another Event only when another pod joins it (on a loaded machine a
        # healthy agent may miss the 2 s too), each naming its pods.
        named = [e["message"].split(" unavailable (")[0] for e in warnings]
        assert all(victim in n.split(", ") for n in named), named
        assert len(named) == len(set(named)), named
        assert " unavailable (agent health check timed out)" in warnings[0]["message"]
        lines = [r.getMessage() for r in caplog.records if r.name == "prorsa.runtime"]
        assert any(f"{victim} unavailable: its agent did not answer" in m for m in lines), lines

        env.kubelet.pods[victim].engine.faults.hang_loads = False
        await env.wait_for(running, timeout=PATIENCE, what="Ready again")
        await env.wait_for_event("EnginesAvailable")
        assert (await condition(env, "Degraded"))["status"] == "False"
        lines = [r.getMessage() for r in caplog.records if r.name == "prorsa.runtime"]
        assert any(f"{victim} available again" in m for m in lines), lines
