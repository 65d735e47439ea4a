"""The in-pod agent against the SGLang double, over real HTTP on loopback.

Every switch path of SGLang 0.5.23's role switch (docs/sglang-role-switch.md): idle, with
requests streaming (aborted with their partial output), not idle at the flip (retried),
refused with safe_to_restore true or false, left unhealthy, timed out, crashed mid-switch;
plus concurrent calls, an agent restart during a switch, and bad tokens.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from prorsa_agent.config import AgentConfig
from prorsa_agent.server import Agent
from prorsa_contract.agent_api import EngineState, RoleResult
from prorsa_lab.doubles.sglang_double import (
    FAST_TIMEOUTS,
    EngineConfig,
    EngineDouble,
    EnginePod,
    Faults,
    TimingModel,
)

TOKEN = "agent-token-7c1e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SLOW = TimingModel(decode_step_seconds=0.02, health_check_timeout_seconds=0.3)
LONG = {"text": "a b c", "sampling_params": {"max_new_tokens": 10_000}}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=20.0) as c:
        yield c


@pytest.fixture
async def pod() -> AsyncIterator[EnginePod]:
    async with EnginePod(
        instance="qwen-engine-3", token=TOKEN, engine=EngineConfig(timing=SLOW)
    ) as p:
        yield p


async def _role(
    client: httpx.AsyncClient,
    pod: EnginePod,
    role: str,
    drain: float = 10.0,
    headers: dict[str, str] = AUTH,
    **kwargs: object,
) -> httpx.Response:
    return await client.post(
        f"{pod.agent_url}/v1/role",
        json={"role": role, "drainTimeoutSeconds": drain},
        headers=headers,
        **kwargs,
    )


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _state(client: httpx.AsyncClient, url: str) -> EngineState:
    response = await client.get(f"{url}/v1/state")
    assert response.status_code == 200
    return EngineState.model_validate(response.json())


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + ("{" if labels else " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} {labels} in metrics")


def _stream(client: httpx.AsyncClient, url: str, body: dict) -> asyncio.Task[list[dict]]:
    async def consume() -> list[dict]:
        outs = []
        async with client.stream("POST", f"{url}/generate", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    outs.append(json.loads(line.removeprefix("data: ")))
        return outs

    return asyncio.create_task(consume())


async def _running(client: httpx.AsyncClient, pod: EnginePod, n: int) -> None:
    async def enough() -> bool:
        return (await _state(client, pod.agent_url)).running_requests >= n

    await _until(enough)


# ------------------------------------------------------------------ state and probes


async def test_state_reports_the_engine_in_contract_fields(client, pod):
    response = await client.get(f"{pod.agent_url}/v1/state")
    body = response.json()
    assert set(body) == {
        "instance", "role", "switching", "healthy", "runningRequests", "waitingRequests",
        "waitingTokens", "kvUsedTokens", "kvCapacityTokens", "prefillBusySeconds",
        "prefillTokens",
    }  # fmt: skip
    assert body["instance"] == "qwen-engine-3"
    assert body["role"] == "decode" and body["healthy"] is True and body["switching"] is False
    assert body["kvCapacityTokens"] == 200_000
    assert (await client.get(f"{pod.agent_url}/healthz")).status_code == 200
    assert (await client.get(f"{pod.agent_url}/readyz")).status_code == 200
    assert (await client.get(f"{pod.agent_url}/livez")).status_code == 200


async def test_state_sums_over_dp_ranks(client):
    engine = EngineConfig(role="prefill", dp_size=2, kv_capacity_tokens=10_000)
    # No periodic probes here: each /health probe prefills one token on a prefill engine.
    quiet = replace(FAST_TIMEOUTS, health_interval=60.0)
    async with EnginePod(instance="p-0", token=TOKEN, engine=engine, timeouts=quiet) as pod:
        url = pod.engine_url
        before = await _state(client, pod.agent_url)
        await client.post(f"{url}/pause_generation", json={"mode": "in_place"})
        body = {"input_ids": [7] * 100, "sampling_params": {"max_new_tokens": 4}}
        tasks = [asyncio.create_task(client.post(f"{url}/generate", json=body)) for _ in range(4)]

        async def queued() -> bool:
            return (await _state(client, pod.agent_url)).waiting_requests == 4

        await _until(queued)
        loads = (await client.get(f"{url}/v1/loads")).json()["loads"]
        assert [load["num_waiting_reqs"] for load in loads] == [2, 2]
        state = await _state(client, pod.agent_url)
        assert state.waiting_tokens == 400
        assert state.kv_capacity_tokens == 20_000
        await client.post(f"{url}/continue_generation", json={})
        await asyncio.gather(*tasks)
        state = await _state(client, pod.agent_url)
        assert state.prefill_tokens - before.prefill_tokens == 400
        assert state.prefill_busy_seconds > before.prefill_busy_seconds
        assert state.waiting_requests == state.running_requests == 0


async def test_an_unreachable_engine_is_reported_not_hidden(client, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "token"
    token.write_text(TOKEN)
    config = AgentConfig(
        engine_url=f"http://127.0.0.1:{port}",
        token_file=token,
        instance="gone-0",
        listen_host="127.0.0.1",
        listen_port=0,
        timeouts=FAST_TIMEOUTS,
    )
    async with Agent(config) as agent:
        state = await _state(client, agent.url)
        assert state.healthy is False and state.role == "decode"
        health = await client.get(f"{agent.url}/healthz")
        assert health.status_code == 503 and health.json()["status"] == "starting"
        response = await client.post(f"{agent.url}/v1/role", json={"role": "prefill"}, headers=AUTH)
        assert response.status_code == 503
        assert RoleResult.model_validate(response.json()).ok is False


async def test_a_busy_engine_answers_state_in_time_with_its_last_loads(client):
    """SGLang answers /v1/loads between forward steps; on a busy host that can take longer
    than the operator waits for /v1/state (2 s), which would count a busy engine as
    unavailable. The agent answers in time with its last read instead, and reports the
    engine unhealthy only once that read is older than ``state_max_age``."""
    timeouts = replace(FAST_TIMEOUTS, request=60.0, state=0.2, state_max_age=3.0)
    async with EnginePod(instance="e-9", token=TOKEN, timeouts=timeouts) as pod:
        streams = [_stream(client, pod.engine_url, LONG) for _ in range(2)]
        await _running(client, pod, 2)
        pod.double.faults.hang_loads = True
        started = time.monotonic()
        state = await _state(client, pod.agent_url)
        # Not the 60 s the engine call itself may take: the last read, at once.
        assert time.monotonic() - started < 10.0
        assert state.healthy is True and state.running_requests == 2

        async def unhealthy() -> bool:
            return not (await _state(client, pod.agent_url)).healthy

        await _until(unhealthy, timeout=30.0)
        pod.double.faults.hang_loads = False

        async def back() -> bool:
            state = await _state(client, pod.agent_url)
            return state.healthy and state.running_requests == 2

        await _until(back, timeout=30.0)
        await client.post(f"{pod.engine_url}/abort_request", json={"abort_all": True})
        for stream in streams:
            await stream


# ------------------------------------------------------------------ switches that work


async def test_idle_switch_flips_and_verifies(client, pod):
    response = await _role(client, pod, "prefill")
    assert response.status_code == 200
    result = RoleResult.model_validate(response.json())
    assert result.ok and result.old_role == "decode" and result.new_role == "prefill"
    assert result.aborted_requests == 0
    assert pod.double.role == "prefill"
    assert (await _state(client, pod.agent_url)).role == "prefill"
    assert pod.double.counters().health_checks >= 1  # the post-flip /health_generate
    back = RoleResult.model_validate((await _role(client, pod, "decode")).json())
    assert back.ok and pod.double.role == "decode"
    metrics = (await client.get(f"{pod.agent_url}/metrics")).text
    assert _metric(metrics, "prorsa_agent_switches_total", result="ok", to="prefill") == 1
    assert _metric(metrics, "prorsa_agent_switches_total", result="ok", to="decode") == 1
    assert _metric(metrics, "prorsa_agent_switch_duration_seconds_count", to="prefill") == 1
    assert _metric(metrics, "prorsa_agent_drain_duration_seconds_count") == 2


async def test_switch_while_requests_stream_aborts_them_with_partial_output(client, pod):
    streams = [_stream(client, pod.engine_url, LONG) for _ in range(3)]
    await _running(client, pod, 3)
    response = await _role(client, pod, "prefill", drain=0.2)
    result = RoleResult.model_validate(response.json())
    assert response.status_code == 200 and result.ok
    assert result.aborted_requests == 3
    for stream in streams:
        outs = await stream
        last = outs[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(last["output_ids"]) < 10_000
    assert pod.double.counters().requests_aborted == 3
    metrics = (await client.get(f"{pod.agent_url}/metrics")).text
    assert _metric(metrics, "prorsa_agent_aborted_requests_total") == 3


async def test_requests_that_finish_within_the_drain_are_not_aborted(client, pod):
    body = {"text": "a", "sampling_params": {"max_new_tokens": 10}}
    tasks = [
        asyncio.create_task(client.post(f"{pod.engine_url}/generate", json=body)) for _ in range(2)
    ]
    await _running(client, pod, 2)
    result = RoleResult.model_validate((await _role(client, pod, "prefill", drain=10)).json())
    assert result.ok and result.aborted_requests == 0
    for task in tasks:
        finish = (await task).json()["meta_info"]["finish_reason"]
        assert finish == {"type": "length", "length": 10}


async def test_same_role_is_an_immediate_success(client, pod):
    response = await _role(client, pod, "decode")
    result = RoleResult.model_validate(response.json())
    assert response.status_code == 200 and result.ok
    assert result.old_role == result.new_role == "decode"
    assert pod.double.counters().switch_calls == 0
    metrics = (await client.get(f"{pod.agent_url}/metrics")).text
    assert _metric(metrics, "prorsa_agent_switches_total", result="noop", to="decode") == 1


async def test_not_idle_at_the_flip_is_drained_and_retried(client):
    faults = Faults(busy_on_switch=1)
    async with EnginePod(instance="e-1", token=TOKEN, faults=faults) as pod:
        result = RoleResult.model_validate((await _role(client, pod, "prefill")).json())
        assert result.ok
        assert pod.double.counters().switch_calls == 2
        status = (await client.get(f"{pod.agent_url}/v1/role")).json()
        assert status["switching"] is False and status["last"]["ok"] is True


async def test_not_idle_with_nothing_in_the_loads_is_waited_out(client):
    """SGLang's idle check waits for work no load field shows (its last batch, deferred KV
    releases): the agent waits before asking again (2 polls, then 4: its third call comes
    0.6 s after the first) rather than spending its three attempts in milliseconds. The
    double refuses for 0.5 s after the first call."""
    faults = Faults(busy_seconds_on_switch=0.5)
    timeouts = replace(FAST_TIMEOUTS, poll=0.1, retry_drain=1.0)
    async with EnginePod(instance="e-1", token=TOKEN, faults=faults, timeouts=timeouts) as pod:
        result = RoleResult.model_validate((await _role(client, pod, "prefill")).json())
        assert result.ok, result.message
        assert pod.double.counters().switch_calls >= 2  # refused at least once


async def test_an_engine_that_never_gets_idle_fails_safely(client):
    faults = Faults(busy_on_switch=10)
    async with EnginePod(instance="e-1", token=TOKEN, faults=faults) as pod:
        response = await _role(client, pod, "prefill")
        assert response.status_code == 502
        result = RoleResult.model_validate(response.json())
        assert not result.ok and result.safe_to_restore is True
        assert result.new_role == "decode"  # still the old role
        assert "not idle" in result.message
        assert pod.double.counters().switch_calls == 3  # max_switch_attempts
        assert (await client.get(f"{pod.agent_url}/healthz")).status_code == 200


# ------------------------------------------------------------------ switches that fail


async def test_an_engine_outside_pd_mode_is_unhealthy_and_not_switched(client):
    """SGLang's mode is no role (``null``: launched without PD disaggregation): the agent
    reports its last role unhealthy and refuses a switch, naming the mode."""
    async with EnginePod(instance="e-n", token=TOKEN, engine=EngineConfig(role="null")) as pod:
        state = await _state(client, pod.agent_url)
        assert state.healthy is False and state.role == "decode"
        response = await _role(client, pod, "prefill")
        assert response.status_code == 503
        result = RoleResult.model_validate(response.json())
        assert result.safe_to_restore is True and not result.ok
        assert "not in PD disaggregation mode (mode 'null')" in result.message


async def test_safe_refusal_reports_safe_to_restore_and_keeps_serving(client):
    async with EnginePod(instance="e-2", token=TOKEN, faults=Faults(switch_failure="safe")) as pod:
        response = await _role(client, pod, "prefill")
        assert response.status_code == 502
        result = RoleResult.model_validate(response.json())
        assert result.safe_to_restore is True and result.new_role == "decode"
        assert "refused" in result.message
        assert (await client.get(f"{pod.agent_url}/healthz")).status_code == 200
        assert (await _state(client, pod.agent_url)).healthy is True
        again = RoleResult.model_validate((await _role(client, pod, "prefill")).json())
        assert again.ok
        metrics = (await client.get(f"{pod.agent_url}/metrics")).text
        assert (
            _metric(metrics, "prorsa_agent_switches_total", result="failed_safe", to="prefill") == 1
        )


async def test_unsafe_failure_marks_the_engine_failed_until_it_restarts(client):
    async with EnginePod(
        instance="e-3",
        token=TOKEN,
        engine=EngineConfig(timing=SLOW),
        faults=Faults(switch_failure="unsafe"),
    ) as pod:
        response = await _role(client, pod, "prefill")
        assert response.status_code == 502
        result = RoleResult.model_validate(response.json())
        assert result.safe_to_restore is False and result.new_role is None
        assert "restart required" in result.message
        health = await client.get(f"{pod.agent_url}/healthz")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert (await _state(client, pod.agent_url)).healthy is False
        refused = await _role(client, pod, "prefill")
        assert refused.status_code == 503
        assert RoleResult.model_validate(refused.json()).safe_to_restore is False
        # The pod's engine restarts (a new process): the agent sees a new startup_time.
        await pod.double.restart()

        async def healthy() -> bool:
            return (await client.get(f"{pod.agent_url}/healthz")).status_code == 200

        await _until(healthy)
        assert RoleResult.model_validate((await _role(client, pod, "prefill")).json()).ok


async def test_an_engine_left_unhealthy_after_the_flip_fails_verification(client):
    async with EnginePod(
        instance="e-4",
        token=TOKEN,
        engine=EngineConfig(timing=SLOW),
        faults=Faults(unhealthy_after_switch=True),
    ) as pod:
        response = await _role(client, pod, "prefill")
        result = RoleResult.model_validate(response.json())
        assert response.status_code == 502 and result.safe_to_restore is False
        assert "/health_generate" in result.message
        assert (await client.get(f"{pod.agent_url}/healthz")).json()["status"] == "failed"


async def test_a_flip_is_verified_for_the_whole_budget_not_one_sglang_health_window(client):
    # SGLang's /health_generate answers 503 once its own window (20 s; 0.2 s here) passes
    # with no output. Here the first prefill after the flip outlasts one window: the engine
    # is healthy, and the agent asks again within its verify budget (5 s) instead of failing
    # the switch unsafe (which gets the pod, or a whole multi-node group, replaced).
    first_window_silent = TimingModel(
        prefill_overhead_seconds=0.5, health_check_timeout_seconds=0.2
    )
    async with EnginePod(
        instance="e-7", token=TOKEN, engine=EngineConfig(timing=first_window_silent)
    ) as pod:
        response = await _role(client, pod, "prefill")
        result = RoleResult.model_validate(response.json())
        assert response.status_code == 200 and result.ok, result.message
        assert pod.double.role == "prefill"
        assert (await client.get(f"{pod.agent_url}/v1/role", headers=AUTH)).status_code == 200


async def test_a_hung_switch_times_out(client):
    timeouts = replace(FAST_TIMEOUTS, switch=0.3)
    async with EnginePod(
        instance="e-5", token=TOKEN, faults=Faults(hang_on_switch=True), timeouts=timeouts
    ) as pod:
        response = await _role(client, pod, "prefill")
        result = RoleResult.model_validate(response.json())
        assert response.status_code == 502 and result.safe_to_restore is False
        assert "timed out while switching" in result.message


async def test_an_engine_too_slow_to_answer_while_draining_keeps_its_role(client):
    # /v1/loads stops answering in time while the agent drains (a loaded host, a scheduler
    # in a long collective). No flip was asked for: the switch fails safe, the pod takes its
    # old label back, and the engine is not marked for a restart (reloading its weights).
    timeouts = replace(FAST_TIMEOUTS, request=0.3)
    async with EnginePod(instance="e-8", token=TOKEN, timeouts=timeouts) as pod:
        streams = [_stream(client, pod.engine_url, LONG) for _ in range(2)]
        await _running(client, pod, 2)
        call = asyncio.create_task(_role(client, pod, "prefill", drain=30))

        async def draining() -> bool:
            progress = (await client.get(f"{pod.agent_url}/v1/role", headers=AUTH)).json()
            return progress["progress"] is not None and progress["progress"]["phase"] == "draining"

        await _until(draining)
        pod.double.faults.hang_loads = True
        response = await call
        pod.double.faults.hang_loads = False
        result = RoleResult.model_validate(response.json())
        assert response.status_code == 502 and not result.ok, result
        assert result.safe_to_restore is True and result.new_role == "decode", result
        assert "timed out while draining" in result.message
        assert "role is unchanged" in result.message
        assert pod.double.role == "decode"
        assert (await client.get(f"{pod.agent_url}/healthz")).status_code == 200
        await client.post(f"{pod.engine_url}/abort_request", json={"abort_all": True})
        for stream in streams:
            await stream
        response = await _role(client, pod, "prefill")  # no restart was needed
        assert response.status_code == 200, response.text
        assert pod.double.role == "prefill"


async def test_an_engine_crash_mid_switch_is_reported_unsafe(client):
    async with EnginePod(instance="e-6", token=TOKEN, faults=Faults(crash_on_switch=True)) as pod:
        response = await _role(client, pod, "prefill")
        result = RoleResult.model_validate(response.json())
        assert response.status_code == 502 and result.safe_to_restore is False
        assert "stopped answering" in result.message
        assert (await client.get(f"{pod.agent_url}/healthz")).status_code == 503
        assert (await _state(client, pod.agent_url)).healthy is False


async def test_flip_to_decode_passes_the_graph_memory_when_needed(client):
    prefill = EngineConfig(role="prefill")
    async with EnginePod(instance="p-1", token=TOKEN, engine=prefill) as pod:
        response = await _role(client, pod, "decode")
        result = RoleResult.model_validate(response.json())
        assert response.status_code == 502 and result.safe_to_restore is True
        assert "--decode-cuda-graph-memory-gb" in result.message
    async with EnginePod(
        instance="p-2", token=TOKEN, engine=prefill, decode_cuda_graph_memory_gb=1.0
    ) as pod:
        result = RoleResult.model_validate((await _role(client, pod, "decode")).json())
        assert result.ok
        info = (await client.get(f"{pod.engine_url}/server_info")).json()
        assert info["internal_states"][0]["decode_cuda_graph_memory_gb"] == 1.0


async def test_the_engine_admin_key_is_sent_and_a_wrong_one_fails_safely(client, tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    key = tmp_path / "engine-key"
    async with EngineDouble(EngineConfig(admin_api_key="engine-admin")) as double:
        config = AgentConfig(
            engine_url=double.url,
            token_file=token,
            instance="e-8",
            listen_host="127.0.0.1",
            listen_port=0,
            engine_api_key_file=key,
            timeouts=FAST_TIMEOUTS,
        )
        key.write_text("not-the-key")
        async with Agent(config) as agent:
            url = f"{agent.url}/v1/role"
            wrong = await client.post(url, json={"role": "prefill"}, headers=AUTH)
            assert wrong.status_code == 502
            result = RoleResult.model_validate(wrong.json())
            assert result.safe_to_restore is True and "HTTP 401" in result.message
            assert double.role == "decode"
            key.write_text("engine-admin\n")
            right = await client.post(url, json={"role": "prefill"}, headers=AUTH)
            assert right.status_code == 200 and double.role == "prefill"


# ------------------------------------------------------------------ concurrency, restarts


async def test_concurrent_role_calls_run_one_switch(client, pod):
    streams = [_stream(client, pod.engine_url, LONG) for _ in range(2)]
    await _running(client, pod, 2)
    # The streams outlive the drain, so the switch lasts at least the 2 s drain.
    first = asyncio.create_task(_role(client, pod, "prefill", drain=2.0))

    async def switching() -> bool:
        return (await client.get(f"{pod.agent_url}/v1/role")).json()["switching"]

    await _until(switching)
    assert (await client.get(f"{pod.agent_url}/readyz")).status_code == 503
    assert (await _state(client, pod.agent_url)).switching is True
    same = await _role(client, pod, "prefill")
    assert same.status_code == 202
    progress = RoleResult.model_validate(same.json())
    assert not progress.ok and progress.new_role == "prefill"
    assert "in progress" in progress.message
    other = await _role(client, pod, "decode")
    assert other.status_code == 409
    assert "in progress" in RoleResult.model_validate(other.json()).message
    done = await first
    assert done.status_code == 200 and RoleResult.model_validate(done.json()).ok
    await asyncio.gather(*streams)
    assert pod.double.counters().switches_ok == 1
    assert (await client.get(f"{pod.agent_url}/readyz")).status_code == 200


async def test_switch_survives_its_caller_going_away(client, pod):
    streams = [_stream(client, pod.engine_url, LONG)]
    await _running(client, pod, 1)
    with pytest.raises(httpx.ReadTimeout):
        await _role(client, pod, "prefill", drain=0.3, timeout=0.1)

    async def finished() -> bool:
        last = (await client.get(f"{pod.agent_url}/v1/role")).json()["last"]
        return last is not None and last["ok"]

    await _until(finished)
    assert pod.double.role == "prefill"
    await asyncio.gather(*streams)


async def test_agent_restart_during_a_switch(client, tmp_path: Path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    async with EngineDouble(EngineConfig(timing=SLOW)) as double:
        config = AgentConfig(
            engine_url=double.url,
            token_file=token,
            instance="e-7",
            listen_host="127.0.0.1",
            listen_port=0,
            timeouts=FAST_TIMEOUTS,
        )
        streams = [_stream(client, double.url, LONG) for _ in range(2)]
        first = Agent(config)
        await first.start()
        call = asyncio.create_task(
            client.post(
                f"{first.url}/v1/role", json={"role": "prefill", "drainTimeoutSeconds": 30},
                headers=AUTH,
            )
        )  # fmt: skip

        async def draining() -> bool:
            progress = (await client.get(f"{first.url}/v1/role")).json()["progress"]
            return progress is not None and progress["phase"] == "draining"

        await _until(draining)
        await first.stop()  # the agent dies mid-drain
        try:
            answer = await call
            assert answer.status_code >= 500
        except httpx.TransportError:
            pass
        # Nothing was aborted or flipped: the engine still serves its requests as decode.
        assert double.role == "decode" and double.counters().requests_aborted == 0
        async with Agent(config) as second:
            state = await _state(client, second.url)
            assert state.role == "decode" and not state.switching and state.running_requests == 2
            response = await client.post(
                f"{second.url}/v1/role", json={"role": "prefill", "drainTimeoutSeconds": 0.1},
                headers=AUTH,
            )  # fmt: skip
            result = RoleResult.model_validate(response.json())
            assert result.ok and result.aborted_requests == 2
            # Repeating the call after the switch finished is a no-op success.
            repeat = await client.post(
                f"{second.url}/v1/role", json={"role": "prefill"}, headers=AUTH
            )
            assert repeat.status_code == 200 and repeat.json()["message"] == (
                "already in the requested role"
            )
        for stream in streams:
            assert (await stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"


# ------------------------------------------------------------------ authentication


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"Authorization": "Bearer"},
    ],
)
async def test_role_calls_without_the_token_are_refused(client, pod, headers):
    response = await _role(client, pod, "prefill", headers=headers)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert pod.double.role == "decode" and pod.double.counters().switch_calls == 0


async def test_the_token_file_is_reread_when_it_changes(client, pod):
    assert pod.agent is not None
    token_file = pod.agent.config.token_file
    token_file.write_text("rotated-token-2\n")
    old = await _role(client, pod, "decode")
    assert old.status_code == 401
    new = await _role(client, pod, "decode", headers={"Authorization": "Bearer rotated-token-2"})
    assert new.status_code == 200
    token_file.write_text("")
    # An empty token file accepts nothing at all, not even an "empty" token.
    for header in ("Bearer", "Bearer rotated-token-2", "Bearer x"):
        empty = await _role(client, pod, "decode", headers={"Authorization": header})
        assert empty.status_code == 401


async def test_bad_role_bodies_are_refused_with_the_field(client, pod):
    url = f"{pod.agent_url}/v1/role"
    assert (await client.post(url, content=b"{", headers=AUTH)).status_code == 400
    bad_role = await client.post(url, json={"role": "encoder"}, headers=AUTH)
    assert bad_role.status_code == 422
    assert bad_role.json()["details"][0]["field"] == "role"
    negative = await client.post(
        url, json={"role": "prefill", "drainTimeoutSeconds": -1}, headers=AUTH
    )
    assert negative.status_code == 422
    assert re.search("drainTimeoutSeconds", json.dumps(negative.json()))
    extra = await client.post(url, json={"role": "prefill", "force": True}, headers=AUTH)
    assert extra.status_code == 422
    assert pod.double.counters().switch_calls == 0
