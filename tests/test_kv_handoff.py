"""The doubles' KV hand-off: a decode double answers only after the prefill of its
bootstrap room, and a prefill abort becomes a decode abort (as SGLang behind smg)."""

from __future__ import annotations

import asyncio
import time

import httpx

from prorsa_lab.doubles.kubelet import free_port
from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble, TimingModel

SLOW_PREFILL = TimingModel(prefill_tokens_per_second=2_000, kv_transfer_seconds=0.2)


def body(room: int, bootstrap_port: int, *, tokens: int = 1_000, want: int = 4) -> dict:
    """What smg sends to both engines: the same body with the bootstrap fields."""
    return {
        "rid": f"r-{room}",
        "text": "w " * tokens,
        "model": "prorsa/engine-double",
        "sampling_params": {"max_new_tokens": want},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": room,
    }


async def test_decode_waits_for_its_prefill_and_the_transfer() -> None:
    port = free_port()
    prefill = EngineDouble(
        EngineConfig(role="prefill", bootstrap_port=port, serve_bootstrap=True, timing=SLOW_PREFILL)
    )
    decode = EngineDouble(EngineConfig(role="decode", bootstrap_port=free_port()))
    async with prefill, decode, httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(f"http://127.0.0.1:{port}/health")).text == "OK"
        t0 = time.monotonic()
        d = asyncio.create_task(client.post(f"{decode.url}/generate", json=body(7, port)))
        await asyncio.sleep(0.05)  # the decode half may arrive first
        p = await client.post(f"{prefill.url}/generate", json=body(7, port))
        prefill_done = time.monotonic() - t0
        reply = (await d).json()
        took = time.monotonic() - t0
    assert p.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert len(reply["output_ids"]) == 4
    # 1,000 tokens at 2,000/s plus 0.2 s of transfer: the decode answer comes after both.
    assert prefill_done >= 0.7
    assert took >= prefill_done


async def test_a_prefill_abort_aborts_the_decode_request() -> None:
    port = free_port()
    prefill = EngineDouble(
        EngineConfig(role="prefill", bootstrap_port=port, serve_bootstrap=True, timing=SLOW_PREFILL)
    )
    decode = EngineDouble(EngineConfig(role="decode", bootstrap_port=free_port()))
    async with prefill, decode, httpx.AsyncClient(timeout=30) as client:
        d = asyncio.create_task(client.post(f"{decode.url}/generate", json=body(9, port)))
        p = asyncio.create_task(
            client.post(f"{prefill.url}/generate", json=body(9, port, tokens=4_000))
        )
        await asyncio.sleep(0.3)
        await client.post(f"{prefill.url}/abort_request", json={"rid": "r-9"})
        aborted = (await p).json()["meta_info"]["finish_reason"]
        reply = (await d).json()
    assert aborted["type"] == "abort"
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert reply["output_ids"] == []
    assert decode.counters().requests_aborted == 1


async def test_without_a_reachable_prefill_the_decode_request_aborts() -> None:
    decode = EngineDouble(EngineConfig(role="decode", bootstrap_port=free_port()))
    async with decode, httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{decode.url}/generate", json=body(3, free_port()))
    assert reply.json()["meta_info"]["finish_reason"]["type"] == "abort"
