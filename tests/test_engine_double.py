"""The SGLang 0.5.23 engine double, over real HTTP on loopback.

Field names and shapes asserted here are those of the 0.5.23 wheel (io_struct.py,
load_snapshot.py, http_server.py, role_switch.py); the double is only useful if they match.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from prorsa_agent.config import engine_argv
from prorsa_lab.doubles.engine.cli import check_cache_flags, configure
from prorsa_lab.doubles.sglang_double import (
    CRASH_EXIT_CODE,
    NOT_IDLE,
    EngineConfig,
    EngineCore,
    EngineDouble,
    Faults,
    TimingModel,
)

SLOW_DECODE = TimingModel(decode_step_seconds=0.02, health_check_timeout_seconds=0.5)
SWITCH_REPLY_KEYS = {
    "rid",
    "http_worker_ipc",
    "success",
    "message",
    "old_role",
    "new_role",
    "safe_to_restore",
}
META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
}
LOAD_CORE_KEYS = {
    "timestamp",
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "num_total_tokens",
    "num_active_tokens",
    "num_prealloc_ready_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
    "decode_moments",
}


@pytest.fixture
async def engine() -> AsyncIterator[EngineDouble]:
    async with EngineDouble(EngineConfig(role="decode", timing=SLOW_DECODE)) as double:
        yield double


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


async def _generate(client: httpx.AsyncClient, url: str, **body: object) -> dict:
    response = await client.post(f"{url}/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _loads(client: httpx.AsyncClient, url: str, **params: str) -> list[dict]:
    response = await client.get(f"{url}/v1/loads", params=params)
    assert response.status_code == 200, response.text
    return response.json()["loads"]


# ------------------------------------------------------------------ generation


async def test_generate_in_decode_role_returns_the_sglang_body(engine, client):
    out = await _generate(
        client, engine.url, text="one two three four", sampling_params={"max_new_tokens": 5}
    )
    assert len(out["output_ids"]) == 5
    assert out["text"].split() == [f"t{t}" for t in out["output_ids"]]
    meta = out["meta_info"]
    assert META_KEYS | {"e2e_latency"} == set(meta)
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 5
    # One token comes with the KV from the prefill peer, four are decode steps of 20 ms.
    assert meta["e2e_latency"] >= 4 * SLOW_DECODE.decode_step_seconds
    counters = engine.counters()
    assert counters.requests_finished == 1
    assert counters.prompt_tokens == 4 and counters.generation_tokens == 5


async def test_generate_streams_cumulative_server_sent_events(engine, client):
    body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 4}}
    chunks = []
    async with client.stream("POST", f"{engine.url}/generate", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line:
                chunks.append(line.removeprefix("data: "))
    assert chunks[-1] == "[DONE]"
    outs = [json.loads(c) for c in chunks[:-1]]
    assert [len(o["output_ids"]) for o in outs] == [1, 2, 3, 4]
    assert all(o["meta_info"]["finish_reason"] is None for o in outs[:-1])
    assert outs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert outs[-1]["output_ids"][:3] == outs[-2]["output_ids"]


async def test_batch_generate_returns_one_output_per_prompt(engine, client):
    response = await client.post(
        f"{engine.url}/generate",
        json={
            "text": ["a b", "c d e"],
            "rid": ["x1", "x2"],
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    outs = response.json()
    assert [o["meta_info"]["id"] for o in outs] == ["x1", "x2"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 3]


async def test_prefill_role_prefills_and_finishes_with_the_first_token(client):
    timing = TimingModel(prefill_tokens_per_second=100_000.0)
    async with EngineDouble(EngineConfig(role="prefill", timing=timing)) as engine:
        out = await _generate(
            client, engine.url, input_ids=list(range(5000)), sampling_params={"max_new_tokens": 64}
        )
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert len(out["output_ids"]) == 1
        (load,) = await _loads(client, engine.url)
        assert load["total_prefill_uncached_tokens"] == 5000
        # Prefill time follows the timing model (sleeps are never shorter than asked).
        assert load["total_prefill_busy_us"] >= 1e6 * timing.prefill_seconds(5000)
        assert engine.counters().prefill_tokens == 5000


def test_timing_model_scales_with_prompt_length_and_batch_size():
    timing = TimingModel(
        prefill_tokens_per_second=10_000,
        prefill_overhead_seconds=0.01,
        decode_step_seconds=0.02,
        decode_step_seconds_per_request=0.001,
    )
    assert timing.prefill_seconds(10_000) == pytest.approx(1.01)
    assert timing.prefill_seconds(1_000) == pytest.approx(0.11)
    assert timing.decode_seconds(1) == pytest.approx(0.021)
    assert timing.decode_seconds(64) == pytest.approx(0.084)
    with pytest.raises(ValueError, match="prefill_tokens_per_second"):
        TimingModel(prefill_tokens_per_second=float("nan"))


async def test_attention_cost_and_decode_moments_as_sglang_reports_them(client):
    """Prefill grows with the prompt (``prorsa profile`` measures it) and each rank reports
    0.5.23's decode step-time moment sums (load_snapshot.py ``decode_moments``)."""
    timing = TimingModel(
        prefill_tokens_per_second=100_000,
        prefill_overhead_seconds=0.0,
        prefill_cost_doubling_tokens=10_000,
        decode_step_seconds=0.005,
        decode_step_seconds_per_request=0.0,
    )
    assert timing.prefill_batch_seconds([10_000]) == pytest.approx(0.15)  # 10k·(1 + ½)/100k
    assert timing.prefill_batch_seconds([5_000, 5_000]) == pytest.approx(0.125)
    async with EngineDouble(EngineConfig(role="null", timing=timing)) as engine:
        (idle,) = await _loads(client, engine.url)
        assert idle["decode_moments"] is None
        await _generate(
            client,
            engine.url,
            input_ids=[[7] * 100, [8] * 100],
            sampling_params={"max_new_tokens": 10},
        )
        (load,) = await _loads(client, engine.url)
    steps, batch, step_us, batch_sq, batch_step_us, generated = load["decode_moments"]
    # The first token comes from the prefill; nine decode steps of both requests follow.
    assert (steps, batch, batch_sq, generated) == (9, 18, 36, 18)
    assert step_us >= 9 * 5_000 and batch_step_us == pytest.approx(2 * step_us)
    assert load["total_prefill_busy_us"] >= 1e6 * timing.prefill_batch_seconds([100, 100])


async def test_bad_generate_requests_are_refused_like_sglang(engine, client):
    missing = await client.post(f"{engine.url}/generate", json={"sampling_params": {}})
    assert missing.status_code == 400
    assert missing.json() == {
        "error": {"message": "Either text, input_ids or input_embeds should be provided."}
    }
    negative = await client.post(
        f"{engine.url}/generate", json={"text": "a", "sampling_params": {"max_new_tokens": -1}}
    )
    assert negative.status_code == 400
    too_long = await client.post(
        f"{engine.url}/generate",
        json={"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 10**6}},
    )
    assert too_long.status_code == 400
    assert "maximum context length" in too_long.json()["error"]["message"]
    not_json = await client.post(f"{engine.url}/generate", content=b"{nope")
    assert not_json.status_code == 422


async def test_duplicate_request_id_is_refused_while_the_first_runs(engine, client):
    first = asyncio.create_task(
        client.post(
            f"{engine.url}/generate",
            json={"text": "a", "rid": "same", "sampling_params": {"max_new_tokens": 50}},
        )
    )
    await _until(lambda: _running_at_least(client, engine.url, 1))
    second = await client.post(
        f"{engine.url}/generate",
        json={"text": "a", "rid": "same", "sampling_params": {"max_new_tokens": 1}},
    )
    assert second.status_code == 400
    assert "Duplicate request ID" in second.json()["error"]["message"]
    await client.post(f"{engine.url}/abort_request", json={"rid": "same"})
    assert (await first).json()["meta_info"]["finish_reason"]["type"] == "abort"


async def _running_at_least(client: httpx.AsyncClient, url: str, n: int) -> bool:
    loads = await _loads(client, url)
    return sum(load["num_running_reqs"] for load in loads) >= n


# ------------------------------------------------------------------ aborts


async def test_abort_all_returns_partial_output_and_empties_the_queue(client):
    config = EngineConfig(role="decode", max_running_requests=2, timing=SLOW_DECODE)
    async with EngineDouble(config) as engine:
        body = {"text": "p q r", "sampling_params": {"max_new_tokens": 1000}}
        tasks = [
            asyncio.create_task(client.post(f"{engine.url}/generate", json=body)) for _ in range(3)
        ]

        async def two_running_one_waiting() -> bool:
            (load,) = await _loads(client, engine.url)
            return load["num_running_reqs"] == 2 and load["num_waiting_reqs"] == 1

        await _until(two_running_one_waiting)
        await asyncio.sleep(0.1)  # let the running ones produce a few tokens
        response = await client.post(f"{engine.url}/abort_request", json={"abort_all": True})
        assert response.status_code == 200
        outs = [(await t).json() for t in tasks]
        reasons = [o["meta_info"]["finish_reason"] for o in outs]
        running = [o for o, r in zip(outs, reasons, strict=True) if r.get("status_code", 0) is None]
        assert len(running) == 2
        for out in running:
            assert out["meta_info"]["finish_reason"] == {
                "type": "abort",
                "message": "Aborted",
                "status_code": None,
                "err_type": None,
            }
            assert 0 < len(out["output_ids"]) < 1000
            assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
        queued = [r for r in reasons if r.get("message") == "Abort in waiting queue"]
        assert queued == [{"type": "abort", "message": "Abort in waiting queue"}]
        (load,) = await _loads(client, engine.url)
        assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0
        assert load["num_used_tokens"] == 0
        counters = engine.counters()
        assert counters.requests_aborted == 3 and counters.abort_calls == 1


async def test_abort_by_rid_hits_only_that_request(engine, client):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 200}}
    keep = asyncio.create_task(
        client.post(
            f"{engine.url}/generate",
            json={**body, "rid": "keep-1", "sampling_params": {"max_new_tokens": 10}},
        )
    )
    drop = asyncio.create_task(
        client.post(f"{engine.url}/generate", json={**body, "rid": "drop-1"})
    )
    await _until(lambda: _running_at_least(client, engine.url, 2))
    await client.post(f"{engine.url}/abort_request", json={"rid": "drop-1"})
    assert (await drop).json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await keep).json()["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    # An unknown rid is ignored, as SGLang's tokenizer manager ignores it.
    unknown = await client.post(f"{engine.url}/abort_request", json={"rid": "nobody"})
    assert unknown.status_code == 200
    assert engine.counters().abort_calls == 1


async def test_client_disconnect_aborts_the_request(engine, client):
    with pytest.raises(httpx.ReadTimeout):
        await client.post(
            f"{engine.url}/generate",
            json={"text": "a", "sampling_params": {"max_new_tokens": 10_000}},
            timeout=0.2,
        )

    async def released() -> bool:
        (load,) = await _loads(client, engine.url)
        return load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0

    await _until(released)
    assert engine.counters().requests_aborted == 1


async def test_requests_wait_when_the_kv_pool_is_full(client):
    # Admission reserves prompt + max_new_tokens: 120 tokens fit once in a 200-token pool.
    config = EngineConfig(role="decode", kv_capacity_tokens=200, timing=SLOW_DECODE)
    async with EngineDouble(config) as engine:
        body = {"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 20}}
        tasks = [
            asyncio.create_task(client.post(f"{engine.url}/generate", json=body)) for _ in range(2)
        ]

        async def one_waits() -> bool:
            (load,) = await _loads(client, engine.url)
            return load["num_running_reqs"] == 1 and load["num_waiting_reqs"] == 1

        await _until(one_waits)
        (load,) = await _loads(client, engine.url)
        assert 100 <= load["num_used_tokens"] <= 120
        assert load["token_usage"] == round(load["num_used_tokens"] / 200, 4)
        outs = [(await t).json() for t in tasks]
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)


# ------------------------------------------------------------------ role switch


async def _switch(client: httpx.AsyncClient, url: str, **body: object) -> httpx.Response:
    return await client.post(f"{url}/pd_role_switch", json=body)


async def test_role_switch_succeeds_when_idle_and_reports_the_new_role(engine, client):
    response = await _switch(client, engine.url, new_role="prefill")
    assert response.status_code == 200
    reply = response.json()
    assert set(reply) == SWITCH_REPLY_KEYS
    # SGLang leaves safe_to_restore at its default (false) on success.
    assert reply == {
        "rid": None,
        "http_worker_ipc": None,
        "success": True,
        "message": "ok",
        "old_role": "decode",
        "new_role": "prefill",
        "safe_to_restore": False,
    }
    info = (await client.get(f"{engine.url}/server_info")).json()
    assert info["internal_states"][0]["disaggregation_mode"] == "prefill"
    assert (await client.get(f"{engine.url}/health_generate")).status_code == 200
    # Now it serves as a prefill engine.
    out = await _generate(client, engine.url, text="a b c", sampling_params={"max_new_tokens": 9})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    same = (await _switch(client, engine.url, new_role="prefill")).json()
    assert same["success"] is True and same["old_role"] == "prefill"


async def test_role_switch_is_refused_while_requests_run(engine, client):
    task = asyncio.create_task(
        client.post(
            f"{engine.url}/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 500}}
        )
    )
    await _until(lambda: _running_at_least(client, engine.url, 1))
    response = await _switch(client, engine.url, new_role="prefill")
    assert response.status_code == 400
    reply = response.json()
    assert reply["message"] == NOT_IDLE
    assert reply["safe_to_restore"] is True and reply["success"] is False
    assert engine.role == "decode"
    await client.post(f"{engine.url}/abort_request", json={"abort_all": True})
    await task


@pytest.mark.parametrize(
    ("config", "body", "message", "safe"),
    [
        (
            EngineConfig(enable_pd_role_switch=False),
            {"new_role": "prefill"},
            "--enable-pd-role-switch is not set on this server",
            True,
        ),
        (EngineConfig(), {"new_role": ""}, "invalid new_role=''", True),
        (
            EngineConfig(role="null"),
            {"new_role": "prefill"},
            "instance is not running in PD disaggregation mode",
            True,
        ),
        (
            EngineConfig(transfer_backend="nixl"),
            {"new_role": "prefill"},
            "transfer backend 'nixl' does not support runtime role switch",
            True,
        ),
        (
            EngineConfig(role="prefill"),
            {"new_role": "decode"},
            "decode_cuda_graph_memory_gb is required before capturing decode graphs",
            True,
        ),
        (
            EngineConfig(role="prefill", available_gpu_memory_gb=1.0),
            {"new_role": "decode", "decode_cuda_graph_memory_gb": 2.5},
            "insufficient decode CUDA graph headroom: required=2.500 GB, available=1.000 GB",
            True,
        ),
    ],
)
async def test_role_switch_preconditions_answer_400_with_sglang_messages(
    client, config, body, message, safe
):
    async with EngineDouble(config) as engine:
        before = engine.role
        response = await _switch(client, engine.url, **body)
        assert response.status_code == 400
        reply = response.json()
        assert reply["message"] == message
        assert reply["safe_to_restore"] is safe
        assert engine.role == before
        assert (await client.get(f"{engine.url}/health_generate")).status_code == 200


async def test_unknown_role_is_a_schema_error(engine, client):
    response = await _switch(client, engine.url, new_role="encoder")
    assert response.status_code == 422
    assert "detail" in response.json()


async def test_flip_to_decode_captures_graphs_with_the_given_memory(client):
    async with EngineDouble(EngineConfig(role="prefill")) as engine:
        info = (await client.get(f"{engine.url}/server_info")).json()["internal_states"][0]
        assert info["decode_cuda_graph_bs"] == [] and info["decode_cuda_graph_memory_gb"] == 0
        response = await _switch(
            client, engine.url, new_role="decode", decode_cuda_graph_memory_gb=1.5
        )
        assert response.status_code == 200, response.text
        info = (await client.get(f"{engine.url}/server_info")).json()["internal_states"][0]
        assert info["disaggregation_mode"] == "decode"
        assert info["decode_cuda_graph_bs"] and info["decode_cuda_graph_memory_gb"] == 1.5
        assert info["memory_usage"]["graph"]["decode"] == 1.5


async def test_failed_teardown_leaves_the_engine_unhealthy_for_good(client):
    faults = Faults(switch_failure="unsafe")
    async with EngineDouble(EngineConfig(timing=SLOW_DECODE), faults=faults) as engine:
        response = await _switch(client, engine.url, new_role="prefill")
        assert response.status_code == 400
        reply = response.json()
        assert reply["safe_to_restore"] is False
        assert reply["message"].startswith(
            "role switch failed; instance unhealthy, restart required"
        )
        # Every later switch is refused, and generation no longer works.
        again = (await _switch(client, engine.url, new_role="prefill")).json()
        assert again["message"] == (
            "instance is unhealthy after a failed role switch; restart required"
        )
        assert again["safe_to_restore"] is False
        assert (await client.get(f"{engine.url}/health_generate")).status_code == 503
        # A restart (new process) brings a healthy engine back in its launch role.
        await engine.restart()
        assert engine.role == "decode"
        assert (await client.get(f"{engine.url}/health_generate")).status_code == 200
        assert engine.counters().restarts == 1


async def test_safe_switch_failure_keeps_the_engine_serving(client):
    faults = Faults(switch_failure="safe", switch_failure_count=1)
    async with EngineDouble(EngineConfig(), faults=faults) as engine:
        first = await _switch(client, engine.url, new_role="prefill")
        assert first.status_code == 400 and first.json()["safe_to_restore"] is True
        assert engine.role == "decode"
        assert (await client.get(f"{engine.url}/health_generate")).status_code == 200
        second = await _switch(client, engine.url, new_role="prefill")
        assert second.status_code == 200
        assert engine.role == "prefill"


async def test_injected_crash_on_switch_stops_the_engine_answering(client):
    async with EngineDouble(EngineConfig(), faults=Faults(crash_on_switch=True)) as engine:
        with pytest.raises(httpx.TransportError):
            await _switch(client, engine.url, new_role="prefill")
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{engine.url}/health")
        assert engine.counters().crashes == 1


async def test_a_crash_cuts_streams_and_restart_serves_again(engine, client):
    body = {"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 10_000}}

    async def consume() -> int:
        seen = 0
        async with client.stream("POST", f"{engine.url}/generate", json=body) as response:
            async for line in response.aiter_lines():
                seen += bool(line)
        return seen

    task = asyncio.create_task(consume())
    await _until(lambda: _running_at_least(client, engine.url, 1))
    await engine.crash()
    with pytest.raises(httpx.TransportError):
        await task
    await engine.restart()
    out = await _generate(client, engine.url, text="a", sampling_params={"max_new_tokens": 2})
    assert out["meta_info"]["finish_reason"]["type"] == "length"


# ------------------------------------------------------------------ observation


async def test_loads_follow_the_load_snapshot_layout(client):
    async with EngineDouble(EngineConfig(dp_size=2, timing=SLOW_DECODE)) as engine:
        full = (await client.get(f"{engine.url}/v1/loads")).json()
        assert set(full) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
        assert full["version"] == "0.5.23"
        assert [load["dp_rank"] for load in full["loads"]] == [0, 1]
        first = full["loads"][0]
        assert set(first) == LOAD_CORE_KEYS | {"memory", "disaggregation", "queues"}
        assert set(first["disaggregation"]) == {
            "mode",
            "prefill_bootstrap_queue_reqs",
            "prefill_inflight_queue_reqs",
            "decode_prealloc_queue_reqs",
            "decode_transfer_queue_reqs",
            "decode_retracted_queue_reqs",
            "kv_transfer_speed_gb_s",
            "kv_transfer_latency_ms",
        }
        core = await _loads(client, engine.url, include="core")
        assert set(core[0]) == LOAD_CORE_KEYS
        disagg = await _loads(client, engine.url, include="core,disagg")
        assert set(disagg[0]) == LOAD_CORE_KEYS | {"disaggregation"}
        one = await _loads(client, engine.url, dp_rank="1")
        assert [load["dp_rank"] for load in one] == [1]
        bad = await client.get(f"{engine.url}/v1/loads", params={"include": "core,bogus"})
        assert bad.status_code == 400 and "Invalid include sections" in bad.json()["detail"]
        prom = (await client.get(f"{engine.url}/v1/loads", params={"format": "prometheus"})).text
        assert 'sglang_num_running_reqs{dp_rank="1"} 0' in prom
        assert "# TYPE sglang_disagg_decode_prealloc_queue_reqs gauge" in prom


async def test_requests_are_spread_over_dp_ranks(client):
    async with EngineDouble(EngineConfig(dp_size=2, timing=SLOW_DECODE)) as engine:
        body = {"text": "a", "sampling_params": {"max_new_tokens": 300}}
        tasks = [
            asyncio.create_task(client.post(f"{engine.url}/generate", json=body)) for _ in range(4)
        ]
        await _until(lambda: _running_at_least(client, engine.url, 4))
        loads = await _loads(client, engine.url)
        assert [load["num_running_reqs"] for load in loads] == [2, 2]
        await client.post(f"{engine.url}/abort_request", json={"abort_all": True})
        await asyncio.gather(*tasks)


async def test_server_info_carries_internal_states_per_dp_rank(client):
    async with EngineDouble(EngineConfig(dp_size=2)) as engine:
        info = (await client.get(f"{engine.url}/server_info")).json()
        assert info["version"] == "0.5.23"
        assert len(info["internal_states"]) == 2
        state = info["internal_states"][0]
        assert state["disaggregation_mode"] == "decode"
        assert state["decode_cuda_graph_bs"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
        assert state["decode_cuda_graph_memory_gb"] == 1.25
        assert set(state["memory_usage"]["graph"]) == {
            "prefill",
            "decode",
            "target_verify",
            "draft_prefill",
            "draft_decode",
            "draft_extend",
        }
        assert state["memory_usage"]["token_capacity"] == 200_000
        assert info["max_total_num_tokens"] == 200_000
        assert "startup_time" in info


async def test_metrics_use_sglang_names_and_move(engine, client):
    await _generate(client, engine.url, text="a b c", sampling_params={"max_new_tokens": 3})
    await client.post(f"{engine.url}/abort_request", json={"abort_all": True})
    text = (await client.get(f"{engine.url}/metrics")).text
    base = 'engine_type="decode",is_streaming="false",model_name="prorsa/engine-double"'
    assert f"sglang:prompt_tokens_total{{{base}}} 3.0" in text
    assert f"sglang:generation_tokens_total{{{base}}} 3.0" in text
    assert f"sglang:num_requests_total{{{base}}} 1.0" in text
    # SGLang counts one abort per /abort_request call.
    assert re.search(r"sglang:num_aborted_requests_total\{[^}]*\} 1\.0", text)
    assert "sglang:time_to_first_token_seconds_bucket" in text
    # Scheduler gauges carry engine_type="dynamic" with role switching on.
    assert re.search(r'sglang:max_total_num_tokens\{[^}]*engine_type="dynamic"[^}]*\} 200000', text)
    for name in (
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "kv_used_tokens",
        "kv_available_tokens",
        "gen_throughput",
        "cache_hit_rate",
    ):
        assert f"sglang:{name}{{" in text


async def test_admin_key_guards_control_endpoints_but_not_probes(client):
    async with EngineDouble(EngineConfig(admin_api_key="adm")) as engine:
        refused = await _switch(client, engine.url, new_role="prefill")
        assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
        wrong = await client.post(
            f"{engine.url}/abort_request",
            json={"abort_all": True},
            headers={"Authorization": "Bearer nope"},
        )
        assert wrong.status_code == 401
        assert (await client.get(f"{engine.url}/health")).status_code == 200
        assert (await client.get(f"{engine.url}/metrics")).status_code == 200
        ok = await client.post(
            f"{engine.url}/pd_role_switch",
            json={"new_role": "prefill"},
            headers={"Authorization": "Bearer adm"},
        )
        assert ok.status_code == 200


async def test_pause_holds_new_requests_until_continue(engine, client):
    await client.post(f"{engine.url}/pause_generation", json={"mode": "in_place"})
    assert (await client.get(f"{engine.url}/ready")).status_code == 503
    task = asyncio.create_task(
        _generate(client, engine.url, text="a", sampling_params={"max_new_tokens": 2})
    )
    await asyncio.sleep(0.1)
    assert not task.done()
    await client.post(f"{engine.url}/continue_generation", json={})
    assert (await task)["meta_info"]["finish_reason"]["type"] == "length"


async def test_slow_drain_fault_slows_every_step(client):
    timing = TimingModel(decode_step_seconds=0.01)
    async with EngineDouble(EngineConfig(timing=timing)) as engine:
        fast = await _generate(client, engine.url, text="a", sampling_params={"max_new_tokens": 5})
        response = await client.post(
            f"{engine.url}/_double/faults", json={"step_time_multiplier": 10.0}
        )
        assert response.json()["step_time_multiplier"] == 10.0
        slow = await _generate(client, engine.url, text="a", sampling_params={"max_new_tokens": 5})
        # Four decode steps of 10 ms x 10 (sleeps are never shorter than asked).
        assert slow["meta_info"]["e2e_latency"] >= 4 * 0.1
        assert fast["meta_info"]["finish_reason"] == slow["meta_info"]["finish_reason"]
        bad = await client.post(f"{engine.url}/_double/faults", json={"no_such_fault": 1})
        assert bad.status_code == 400


# ------------------------------------------------------------------ the process


def _reap(proc: subprocess.Popen[str]) -> None:
    """Kill the process if it still runs, wait for it and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _start_process(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "prorsa.cli", "engine-double", "--host", "127.0.0.1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"listening on (http://\S+)", line)
    if match is None:
        proc.kill()
        raise AssertionError(f"no URL from the double: {line!r} {proc.stderr.read()!r}")
    return proc, match.group(1)


def test_engine_double_command_serves_and_crashes_like_a_process():
    proc, url = _start_process(
        "--port", "0", "--disaggregation-mode", "prefill", "--enable-pd-role-switch",
        "--enable-metrics", "--max-total-tokens", "5000",
    )  # fmt: skip
    try:
        with httpx.Client(timeout=5.0) as c:
            (load,) = c.get(f"{url}/v1/loads").json()["loads"]
            assert load["disaggregation"]["mode"] == "prefill"
            assert load["max_total_num_tokens"] == 5000
            assert c.get(f"{url}/metrics").status_code == 200
            assert c.post(f"{url}/_double/crash").status_code == 202
        assert proc.wait(timeout=10) == CRASH_EXIT_CODE
    finally:
        _reap(proc)


def test_module_entry_point_ignores_unmodelled_sglang_flags():
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "prorsa_lab.doubles.sglang_double",
            "--host", "127.0.0.1", "--port", "0",
            "--disaggregation-mode", "decode", "--enable-pd-role-switch",
            "--chunked-prefill-size", "4096", "--mem-fraction-static", "0.8",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert proc.stderr is not None
        assert "--mem-fraction-static 0.8" in proc.stderr.read()
    finally:
        _reap(proc)


def _double_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_double_accepts_the_prefix_cache_flags_the_agent_adds():
    argv = engine_argv(command=(), engine_url="http://127.0.0.1:30000")
    args = _double_args(*argv)  # parse_args: an unknown flag would exit
    assert args.disaggregation_decode_enable_radix_cache and args.enable_hierarchical_cache
    check_cache_flags(args)


@pytest.mark.parametrize(
    "argv",
    [
        ("--disaggregation-mode", "prefill", "--enable-hicache", "--disable-radix-cache"),
        ("--disaggregation-mode", "decode", "--enable-hierarchical-cache"),
    ],
)
def test_double_refuses_hicache_without_a_radix_cache_as_sglang_does(argv):
    with pytest.raises(ValueError, match="mutually exclusive"):
        check_cache_flags(_double_args(*argv))


async def test_a_health_check_passes_on_any_output_as_sglangs_does() -> None:
    # SGLang's /health_generate is healthy once anything is output after it began
    # (last_receive_tstamp > tic), its own request or not. A check that gives up while its
    # request is being prefilled leaves the queue, not the batch: the batch still outputs
    # its token, and a later check sees it. Here one prefill outlasts a check's window.
    core = EngineCore(
        EngineConfig(
            timing=TimingModel(prefill_overhead_seconds=0.5, health_check_timeout_seconds=0.2)
        )
    )
    core.start()
    try:
        assert (await core.pd_role_switch(new_role="prefill"))["success"]
        results = [await core.health_generate() for _ in range(5)]
        assert any(results), results  # a later check saw the batch's output
    finally:
        await core.stop()
